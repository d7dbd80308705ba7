"""The page, the live panel and the offline API docs, in a real headless Chromium against a real server.

The browser may reach 127.0.0.1 only: every test checks the page tried nothing else.
"""
import io
import re

import pytest
import requests
from PIL import Image

from mnv3.auth import new_key_line
from mnv3.browser import CHROMIUM, local_browser
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (Debian: apt-get install "
                                                     "chromium; `make test` installs it)"),
]
WAIT_MS = 30_000  # upper bound on any wait in the page; a broken page fails instead of hanging


@pytest.fixture(scope="module")
def server(fp32_model_path):
    with ServerProcess(fp32_model_path, max_batch_size=8, batch_window_ms=20, cache_size=64) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with local_browser() as browser:
        yield browser


@pytest.fixture
def page(browser, server):
    tried_before = len(browser.off_host)
    page = browser.context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(server + "/")
    yield page
    page.close()
    assert browser.off_host[tried_before:] == [], "the page tried to load something from another host"


@pytest.fixture(scope="module")
def photos():
    return load_images(4, seed=11)


def shown_predictions(card):
    card.locator(".top5 li").nth(4).wait_for()
    rows = card.locator(".top5 li")
    return [{"class_id": int(row.get_attribute("data-class-id")), "label": row.locator(".label").inner_text(),
             "probability": float(row.get_attribute("data-probability")),
             "percent": row.locator(".percent").inner_text()} for row in rows.all()]


def timings(card) -> dict[str, str]:
    terms, values = card.locator(".timings dt").all_inner_texts(), card.locator(".timings dd").all_inner_texts()
    return dict(zip(terms, values))


def test_a_chosen_photo_shows_the_same_top5_as_predict(page, server, photos, tmp_path):
    path = tmp_path / "street.jpg"
    path.write_bytes(photos[0])
    page.get_by_label("Choose photos").set_input_files(path)  # the file input is labelled

    card = page.locator("#photos .photo").first
    shown = shown_predictions(card)
    answer = requests.post(server + "/predict", files={"file": ("street.jpg", photos[0], "image/jpeg")}).json()
    assert answer["cache_hit"], "the page did not upload the photo's exact bytes"
    assert [(p["class_id"], p["label"], p["probability"]) for p in shown] == \
           [(p["class_id"], p["label"], p["probability"]) for p in answer["predictions"]]
    for p in shown:  # the percentage as printed agrees with the probability to its last printed digit
        printed = p["percent"].rstrip("%")
        decimals = len(printed.partition(".")[2])
        assert abs(float(printed) - 100 * p["probability"]) <= 0.5 * 10 ** -decimals + 1e-12

    times = timings(card)
    assert times["cache"] == "miss" and times["batch size"] == "1"
    for stage in ("queue", "decode + preprocess", "inference", "round trip"):
        assert re.fullmatch(r"\d+(\.\d+)? ms", times[stage]), (stage, times[stage])
    assert card.locator("img").get_attribute("alt") == "Photo street.jpg"
    assert card.locator("img").evaluate("img => img.complete && img.naturalWidth > 0")
    assert page.locator("#model-choice").is_hidden()  # one model: no selector


def test_several_photos_at_once_each_get_their_own_answer(page, server, photos, tmp_path):
    paths = []
    for i, data in enumerate(photos[1:]):
        paths.append(tmp_path / f"photo{i}.jpg")
        paths[-1].write_bytes(data)
    page.locator("#file-input").set_input_files(paths)

    cards = page.locator("#photos .photo")
    cards.nth(len(paths) - 1).wait_for()
    for card in cards.all():
        name = card.locator("figcaption").inner_text().split(" · ")[0]
        data = photos[1:][paths.index(tmp_path / name)]
        answer = requests.post(server + "/predict", files={"file": (name, data, "image/jpeg")}).json()
        assert [p["label"] for p in shown_predictions(card)] == [p["label"] for p in answer["predictions"]]


def test_a_non_image_shows_the_servers_reason(page, server):
    body = b"these are notes, not a photo"
    page.locator("#file-input").set_input_files({"name": "notes.txt", "mimeType": "text/plain", "buffer": body})

    error = page.locator("#photos .photo").first.locator(".error")
    error.wait_for()
    answer = requests.post(server + "/predict", files={"file": ("notes.txt", body, "text/plain")})
    assert answer.status_code == 400
    assert error.inner_text() == f"400: {answer.json()['detail']}"
    assert error.get_attribute("role") == "alert"


def test_downscale_sends_a_smaller_copy_and_says_so(page, server, photos, tmp_path):
    large = Image.open(io.BytesIO(photos[0])).resize((2000, 1500))
    path = tmp_path / "large.jpg"
    large.save(path, quality=95)
    page.get_by_label("Shrink large photos in the browser before upload").check()
    page.locator("#file-input").set_input_files(path)

    card = page.locator("#photos .photo").first
    assert len(shown_predictions(card)) == 5
    note = card.locator(".outcomes > .hint").inner_text()
    sent_kib = re.search(r"→ (\d+) KiB uploaded", note)
    assert "2000×1500 → 683×512" in note and sent_kib
    assert int(sent_kib.group(1)) * 1024 < path.stat().st_size


def test_the_live_panel_follows_the_server(page, server, photos):
    requests_shown = page.locator("#stat-requests")
    page.wait_for_function("() => /^\\d+$/.test(document.getElementById('stat-requests').textContent)")
    before = int(requests_shown.inner_text())
    sent = 6
    for i in range(sent):
        assert requests.post(server + "/predict", files={"file": ("p.jpg", photos[i % len(photos)], "image/jpeg")}).ok
    page.wait_for_function(f"() => Number(document.getElementById('stat-requests').textContent) >= {before + sent}")
    assert float(page.locator("#stat-rps").inner_text()) > 0
    assert page.locator("#stat-p50").inner_text().endswith(" ms")
    assert page.locator("#stat-hit-rate").inner_text().endswith("%")
    assert page.locator("#batch-sizes .histogram-row").count() == 4  # sizes 1, 2, 3-4, 5-8: up to max_batch_size


def test_the_page_fits_a_narrow_window(page):
    page.set_viewport_size({"width": 360, "height": 800})
    page.locator("#stat-requests").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")


def test_docs_render_offline_and_list_every_operation(page, server):
    operations = requests.get(server + "/openapi.json").json()["paths"]
    page.goto(server + "/docs")
    page.locator(".opblock").first.wait_for()
    shown = {(block.locator(".opblock-summary-method").inner_text().lower(),
              block.locator(".opblock-summary-path").inner_text().replace("\u200b", ""))
             for block in page.locator(".opblock").all()}
    assert shown == {(method, path) for path, methods in operations.items() for method in methods}

    page.goto(server + "/redoc")
    for path, methods in operations.items():
        for operation in methods.values():
            page.get_by_role("heading", name=operation["summary"]).first.wait_for()


def test_requests_to_other_hosts_are_blocked_and_recorded(browser, server):
    # The guard the other tests rely on: a request off 127.0.0.1 fails in the page and is recorded.
    tried_before = len(browser.off_host)
    page = browser.context.new_page()
    try:
        page.goto(server + "/")
        outcome = page.evaluate("fetch('http://192.0.2.1/x.js').then(() => 'loaded', () => 'failed')")
        assert outcome == "failed"
        assert browser.off_host[tried_before:] == ["http://192.0.2.1/x.js"]
    finally:
        page.close()
        del browser.off_host[tried_before:]  # recorded on purpose: not a failure of the other tests


def test_a_protected_server_gets_a_key_from_the_page_for_this_tab_only(browser, fp32_model_path, photos, tmp_path):
    key = new_key_line()[0]
    key_file = tmp_path / "api_keys"
    key_file.write_text(f"{key} infer\n")
    with ServerProcess(fp32_model_path, api_keys=key_file, max_batch_size=8, cache_size=64) as url:
        tried_before = len(browser.off_host)
        page = browser.context.new_page()
        page.set_default_timeout(WAIT_MS)
        try:
            page.goto(url + "/")
            key_input = page.get_by_label("API key")
            key_input.wait_for()  # the page asked what the server serves and got a 401
            assert page.locator("#key-reason").inner_text() == "This server needs an API key."
            key_input.fill("not-the-key-0123456789")
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("did not accept this tab's API key").wait_for()

            key_input.fill(key)
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("Serving fp32.onnx").wait_for()  # GET /models went through with the key
            assert page.locator("#key-form").is_hidden()
            path = tmp_path / "street.jpg"
            path.write_bytes(photos[0])
            page.get_by_label("Choose photos").set_input_files(path)
            shown = shown_predictions(page.locator("#photos .photo").first)
            answer = requests.post(url + "/predict", files={"file": ("street.jpg", photos[0], "image/jpeg")},
                                   headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_MS / 1000).json()
            assert [p["class_id"] for p in shown] == [p["class_id"] for p in answer["predictions"]]
            page.wait_for_function("() => Number(document.getElementById('stat-requests').textContent) >= 1")

            # Kept in this tab's sessionStorage, nowhere else: a new tab asks again.
            assert page.evaluate("[sessionStorage.getItem('mnv3-api-key'), localStorage.length]") == [key, 0]
            other_tab = browser.context.new_page()
            try:
                other_tab.goto(url + "/")
                other_tab.get_by_label("API key").wait_for()
            finally:
                other_tab.close()
        finally:
            page.close()
        assert browser.off_host[tried_before:] == []
