"""The page, the live panel and the offline API docs, in a real headless Chromium against a real server.

The browser may reach 127.0.0.1 only: every test checks the page tried nothing else.
"""

import io
import math
import re
from contextlib import contextmanager

import pytest
import requests
from PIL import Image

from mnv3.auth import new_key_line
from mnv3.browser import CHROMIUM, local_browser
from mnv3.loadtest import ServerProcess, read_metrics
from mnv3.photos import load_images

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} not installed (Debian: apt-get install chromium; `make test` installs it)",
    ),
]
WAIT_MS = 30_000  # upper bound on any wait in the page; a broken page fails instead of hanging
# What the page's Content-Security-Policy blocks, recorded in window.blocked as "directive URI"
RECORD_BLOCKED = (
    "window.blocked = []; document.addEventListener('securitypolicyviolation', "
    "(e) => window.blocked.push(`${e.effectiveDirective} ${e.blockedURI}`));"
)


@pytest.fixture(scope="module")
def server(fp32_model_path):
    with ServerProcess(fp32_model_path, max_batch_size=8, batch_window_ms=20, cache_size=64) as url:
        yield url


@pytest.fixture(scope="module")
def two_models(fp32_model_path, other_model_path):
    """A server of two models with different answers: `fp32` (the default) and `shifted`."""
    with ServerProcess(
        f"fp32={fp32_model_path}",
        extra_models=(f"shifted={other_model_path}",),
        max_batch_size=8,
        batch_window_ms=20,
        cache_size=64,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def stand_in_model_path(fp32_model_path, tmp_path_factory):
    """The fixture model beside a manifest that says it is stage 1's random-init stand-in."""
    from mnv3.artifacts import CLASS_NAMES_JSON, update_manifest

    directory = tmp_path_factory.mktemp("stand_in")
    for name in (fp32_model_path.name, CLASS_NAMES_JSON):
        (directory / name).write_bytes((fp32_model_path.parent / name).read_bytes())
    update_manifest(directory, weights="random-init")
    return directory / fp32_model_path.name


@pytest.fixture(scope="module")
def browser():
    with local_browser() as browser:
        yield browser


@contextmanager
def opened(browser, url):
    tried_before = len(browser.off_host)
    page = browser.context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.add_init_script(RECORD_BLOCKED)  # every test runs the page under its Content-Security-Policy
    thrown: list[str] = []  # uncaught in the page's script: a test would otherwise see only a wait time out
    page.on("pageerror", lambda error: thrown.append(str(error)))
    page.goto(url + "/")
    yield page
    blocked = page.evaluate("window.blocked")
    page.close()
    assert browser.off_host[tried_before:] == [], "the page tried to load something from another host"
    assert blocked == [], "the page's own Content-Security-Policy blocked it"
    assert thrown == [], "the page's script threw"


@pytest.fixture
def page(browser, server):
    with opened(browser, server) as page:
        yield page


@pytest.fixture
def two_model_page(browser, two_models):
    with opened(browser, two_models) as page:
        yield page


@pytest.fixture(scope="module")
def photos():
    return load_images(4, seed=11)


def shown_predictions(card):
    card.locator(".top5 li").nth(4).wait_for()
    rows = card.locator(".top5 li")
    return [
        {
            "class_id": int(row.get_attribute("data-class-id")),
            "label": row.locator(".label").inner_text(),
            "probability": float(row.get_attribute("data-probability")),
            "percent": row.locator(".percent").inner_text(),
        }
        for row in rows.all()
    ]


# Every text the status line (#announce) is given, in order: what a screen reader is told.
RECORD_ANNOUNCED = """() => {
    window.announced = [];
    new MutationObserver(() => {
        const text = document.getElementById("announce").textContent;
        if (text) window.announced.push(text);  // not the moment it is cleared, to be set anew
    })
        .observe(document.getElementById("announce"), {childList: true, characterData: true, subtree: true});
}"""


def wait_for_text(page, element_id: str, text: str) -> None:
    """Until the element's text is exactly `text` (the page says some after a moment: see page.js's say())."""
    page.wait_for_function("([id, text]) => document.getElementById(id).textContent === text", arg=[element_id, text])


def timings(card) -> dict[str, str]:
    terms, values = card.locator(".timings dt").all_inner_texts(), card.locator(".timings dd").all_inner_texts()
    return dict(zip(terms, values, strict=True))


def predict(url: str, photo: bytes, model: str | None = None) -> dict:
    answer = requests.post(
        url + "/predict", params={"model": model} if model else None, files={"file": ("photo.jpg", photo, "image/jpeg")}
    )
    assert answer.ok, answer.text
    return answer.json()


def top5(predictions) -> list[tuple]:
    return [(p["class_id"], p["label"], p["probability"]) for p in predictions]


def test_a_chosen_photo_shows_the_same_top5_as_predict(page, server, photos, tmp_path):
    path = tmp_path / "street.jpg"
    path.write_bytes(photos[0])
    page.evaluate(RECORD_ANNOUNCED)
    page.get_by_label("Choose photos").set_input_files(path)  # the file input is labelled

    card = page.locator("#photos .photo").first
    shown = shown_predictions(card)
    # a screen reader hears the upload start and its outcome, and can go to the photo by its heading
    page.wait_for_function("() => window.announced.length === 2")
    assert page.evaluate("window.announced") == [
        "street.jpg: Uploading…",
        f"street.jpg: most likely {shown[0]['label']}, {shown[0]['percent']}",
    ]
    assert card.get_by_role("heading", level=3).inner_text() == "street.jpg"
    answer = requests.post(server + "/predict", files={"file": ("street.jpg", photos[0], "image/jpeg")}).json()
    assert answer["cache_hit"], "the page did not upload the photo's exact bytes"
    assert [(p["class_id"], p["label"], p["probability"]) for p in shown] == [
        (p["class_id"], p["label"], p["probability"]) for p in answer["predictions"]
    ]
    for p in shown:  # the percentage as printed agrees with the probability to its last printed digit
        printed = p["percent"].rstrip("%")
        decimals = len(printed.partition(".")[2])
        assert abs(float(printed) - 100 * p["probability"]) <= 0.5 * 10**-decimals + 1e-12

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
    page.evaluate(RECORD_ANNOUNCED)
    page.locator("#file-input").set_input_files(paths)

    cards = page.locator("#photos .photo")
    cards.nth(len(paths) - 1).wait_for()
    # Their start and their end are said, not each photo's steps and outcome: a dozen photos' would be half a
    # minute of speech, or be dropped.
    done = f"{len(paths)} photos done: {len(paths)} classified"
    page.wait_for_function("done => window.announced.includes(done)", arg=done)
    assert page.evaluate("window.announced") == [f"Classifying {len(paths)} photos…", done]
    for card in cards.all():
        name = card.locator("figcaption").inner_text().split(" · ")[0]
        data = photos[1:][paths.index(tmp_path / name)]
        answer = requests.post(server + "/predict", files={"file": (name, data, "image/jpeg")}).json()
        assert [p["label"] for p in shown_predictions(card)] == [p["label"] for p in answer["predictions"]]


def test_focus_on_a_photos_cancel_button_stays_on_the_photo_when_its_answer_comes(page, photos, tmp_path):
    # The answer replaced the Cancel button, and focus fell to <body>: a screen reader starts again at the top.
    page.evaluate("""() => {
        const send = XMLHttpRequest.prototype.send;
        XMLHttpRequest.prototype.send = function (body) { setTimeout(() => send.call(this, body), 1500); };
    }""")
    path = tmp_path / "focused.jpg"
    path.write_bytes(photos[1])
    page.locator("#file-input").set_input_files(path)
    card = page.locator("#photos .photo").first
    card.get_by_role("button", name="Cancel (focused.jpg)").focus()
    card.locator(".top5").first.wait_for()
    focused = page.evaluate("document.activeElement.matches('li.photo') && document.activeElement.textContent.trim()")
    assert focused and focused.startswith("focused.jpg"), focused  # the card, whose heading comes first


def test_answers_that_come_together_are_each_announced(page, photos):
    # The status line held one message, replaced by the next: two photos answered by one batch, and only the
    # second was said.
    page.evaluate(RECORD_ANNOUNCED)
    page.evaluate("""() => {
        announce("first.jpg: most likely a cat", "first.jpg");
        announce("second.jpg: sending again in 1 s (try 2)…", "second.jpg");
        announce("second.jpg: most likely a dog", "second.jpg");  // its step, still waiting, is stale: replaced
    }""")
    page.wait_for_function("() => window.announced.length === 2")
    page.wait_for_timeout(700)  # nothing more comes
    assert page.evaluate("window.announced") == ["first.jpg: most likely a cat", "second.jpg: most likely a dog"]


def test_a_non_image_shows_the_servers_reason(page, server):
    body = b"these are notes, not a photo"
    page.locator("#file-input").set_input_files({"name": "notes.txt", "mimeType": "text/plain", "buffer": body})

    error = page.locator("#photos .photo").first.locator(".error")
    error.wait_for()
    answer = requests.post(server + "/predict", files={"file": ("notes.txt", body, "text/plain")})
    assert answer.status_code == 400
    assert error.inner_text() == f"400: {answer.json()['detail']}"
    # Said once by the page's status line, not as an alert per card (a batch of bad files fired one each).
    assert error.get_attribute("role") is None
    said = f"notes.txt: 400: {answer.json()['detail']}"
    wait_for_text(page, "announce", said)
    # the file is the fault: sent again, it would be refused again
    assert page.locator("#photos .photo").first.locator(".send-again").count() == 0


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


def test_the_live_panel_follows_the_server(browser, fp32_model_path, photos, tmp_path):
    # A server of its own, so that nothing but this test's photos is in its window.
    with (
        ServerProcess(fp32_model_path, max_batch_size=8, batch_window_ms=20, cache_size=64) as url,
        opened(browser, url) as page,
    ):
        page.wait_for_function("() => document.getElementById('stat-rps').textContent === '0.0'")
        assert page.locator("#stat-requests").inner_text() == "0"
        paths = []
        for i, data in enumerate(photos):
            paths.append(tmp_path / f"live{i}.jpg")
            paths[-1].write_bytes(data)
        page.locator("#file-input").set_input_files(paths)
        page.locator("#photos .photo .top5").nth(len(paths) - 1).wait_for()

        page.wait_for_function(f"() => document.getElementById('stat-requests').textContent === '{len(paths)}'")
        window, rps = page.evaluate(
            "[document.getElementById('live-window').textContent, "
            "Number(document.getElementById('stat-rps').textContent)]"
        )  # one refresh's
        seconds = int(re.match(r"Last (\d+) s: everything since the server started", window).group(1))
        assert rps > 0 and abs(rps - len(paths) / seconds) <= 0.05 + len(paths) * 0.5 / seconds**2
        stats = requests.get(url + "/stats").json()
        assert stats["requests"] == len(paths) and stats["cache"]["misses"] == len(paths)
        assert page.locator("#stat-p50").inner_text().endswith(" ms")
        assert page.locator("#stat-hit-rate").inner_text() == "0%"
        assert page.locator("#batch-sizes .histogram-row").count() == 4  # sizes 1, 2, 3-4, 5-8: up to max_batch_size
        assert page.locator("#per-model").is_hidden()  # one model: its figures are the server's, shown above
        counts = [int(n) for n in page.locator("#batch-sizes .count").all_inner_texts()]
        assert counts == [b["inferences"] for b in stats["batch_size"]["buckets"][:4]] and sum(counts) > 0
        # where the CPU went: a row per kind of thread of the next GET /stats the page reads, as it says
        with page.expect_response(lambda response: response.url.endswith("/stats")) as answer:
            pass
        cores = answer.value.json()["cpu_cores"]
        assert set(cores) == {"event_loop", "preprocess", "inference", "engine_and_other"}
        page.wait_for_function(
            "cores => Object.entries(cores).every(([role, n]) => "
            "document.getElementById(`cpu-${role}`).textContent === n.toFixed(2))",
            arg=cores,
        )


def test_a_dropped_link_says_to_drop_the_saved_file(page):
    # an image dragged from another site's page comes as its address: the drop did nothing, without a word
    page.evaluate("""() => {
        const dropped = new DataTransfer();
        dropped.setData("text/uri-list", "https://example.com/cat.jpg");
        window.dispatchEvent(new DragEvent("drop", {dataTransfer: dropped, cancelable: true}));
    }""")
    said = "That was a link, not a file: save the image, then drop or choose the saved file."
    wait_for_text(page, "drop-note", said)
    assert page.locator("#photos .photo").count() == 0
    page.locator("#file-input").set_input_files({"name": "notes.txt", "mimeType": "text/plain", "buffer": b"x"})
    assert page.locator("#drop-note").is_hidden()  # a file came after all: the note is old news


def test_pasted_images_each_get_a_name_of_their_own(page, photos):
    # Browsers call every image pasted from the clipboard image.png: their cards, buttons and announcements were all
    # alike. A file copied in a file manager comes with its own name, which it keeps.
    page.evaluate(
        """(bytes) => {
        for (const name of ["image.png", "image.png", "holiday.jpg", "image"]) {
            const pasted = new DataTransfer();
            pasted.items.add(new File([new Uint8Array(bytes)], name, {type: "image/jpeg"}));
            document.dispatchEvent(new ClipboardEvent("paste", {clipboardData: pasted}));
        }
    }""",
        list(photos[0]),
    )
    page.wait_for_function("() => document.querySelectorAll('#photos .photo .top5').length === 4")
    captions = page.locator("#photos figcaption").all_inner_texts()
    names = ["image", "holiday.jpg", "pasted image 2.png", "pasted image 1.png"]  # newest first
    assert [caption.split(" · ")[0] for caption in captions] == names


def test_the_live_figures_can_be_paused(page, server, photos):
    # They change every 1.5 s, for as long as the page is open: WCAG's "pause, stop, hide"
    pause = page.get_by_role("button", name="Pause live figures")
    page.wait_for_function("() => /^[0-9]+$/.test(document.getElementById('stat-requests').textContent)")
    pause.click()
    assert pause.get_attribute("aria-pressed") == "true"
    page.wait_for_timeout(600)  # a refresh under way when it was pressed has landed
    shown, asked = page.locator("#stat-requests").inner_text(), []
    page.on("request", lambda request: asked.append(request.url) if request.url.endswith("/stats") else None)
    assert requests.post(server + "/predict", files={"file": ("p.jpg", photos[3], "image/jpeg")}).ok
    page.wait_for_timeout(3200)  # two refreshes' time
    assert asked == [] and page.locator("#stat-requests").inner_text() == shown
    assert page.locator("#live-window").inner_text().startswith("Paused")
    pause.click()
    assert pause.get_attribute("aria-pressed") == "false"
    page.wait_for_function("shown => document.getElementById('stat-requests').textContent !== shown", arg=shown)


def test_figures_asked_for_before_a_pause_are_not_shown_after_it(page, server, photos):
    # The answer of a GET /stats under way when Pause was pressed was drawn when it came, and said no more that
    # the figures were paused.
    page.wait_for_function("() => /^[0-9]+$/.test(document.getElementById('stat-requests').textContent)")
    page.evaluate("""() => {
        const fetched = window.fetch;
        window.fetch = (url, options) => url !== "stats" ? fetched(url, options)
            : new Promise((resolve) => { window.answerStats = () => resolve(fetched(url, options)); });
    }""")
    page.wait_for_function("() => window.answerStats !== undefined")  # a refresh is under way
    assert requests.post(server + "/predict", files={"file": ("p.jpg", photos[2], "image/jpeg")}).ok
    page.get_by_role("button", name="Pause live figures").click()
    shown = page.locator("#stat-requests").inner_text()
    page.evaluate("window.answerStats()")
    page.wait_for_timeout(500)
    assert page.locator("#stat-requests").inner_text() == shown
    assert page.locator("#live-window").inner_text().startswith("Paused")


def test_a_probability_short_of_one_never_shows_as_a_certain_hundred_percent(page):
    shown = page.evaluate("[0.9995, 0.99996, 1, 0.9994, 0.5, 0.01234].map(formatPercent)")
    assert shown == [">99.9%", ">99.9%", "100.0%", "99.9%", "50.0%", "1.23%"]


def test_the_window_label_says_why_it_is_not_a_minute(page):
    assert page.evaluate("windowLabel(60.8)") == "Last 61 s."
    assert page.evaluate("windowLabel(5.2)").startswith("Last 5 s: everything since the server started")
    assert page.evaluate("windowLabel(303)").startswith("Last 5 min 3 s: the stats went unread for a while")
    # read every 8 s, a 30/min key's pace: a window of 68 s is a minute to within a refresh, not "unread"
    assert page.evaluate("windowLabel(68, 8000)") == "Last 68 s."
    assert page.evaluate("windowLabel(68)").startswith("Last 68 s: the stats went unread")


def test_the_selector_lists_every_model_and_the_chosen_one_answers(two_model_page, two_models, photos, tmp_path):
    page = two_model_page
    served = requests.get(two_models + "/models").json()
    select = page.get_by_label("Model", exact=True)  # the selector is labelled
    select.locator("option").nth(1).wait_for(state="attached")
    assert (
        select.locator("option").evaluate_all("options => options.map(o => o.value)")
        == [m["name"] for m in served["models"]]
        == ["fp32", "shifted"]
    )
    assert select.input_value() == served["default"] == "fp32"
    assert page.locator("#model-line").inner_text() == "2 models: fp32, shifted (default fp32)"
    # each name with the file it serves: a user comparing FP32 with INT8 could not tell which was which
    assert select.locator("option").all_inner_texts() == [
        f"{m['name']} ({m['model'].split(':')[0]} on {m['backend']})" for m in served["models"]
    ]

    select.select_option("shifted")
    path = tmp_path / "street.jpg"
    path.write_bytes(photos[0])
    page.locator("#file-input").set_input_files(path)
    card = page.locator("#photos .photo").first
    shown = shown_predictions(card)
    assert card.locator(".result h4").all_inner_texts() == ["shifted"]
    answer = predict(two_models, photos[0], "shifted")
    assert answer["cache_hit"], "the page did not send the photo to ?model=shifted"
    assert [(p["class_id"], p["label"], p["probability"]) for p in shown] == top5(answer["predictions"])
    assert top5(answer["predictions"]) != top5(predict(two_models, photos[0])["predictions"]), (
        "the two models answer alike: this test could not tell which one the page asked"
    )


def test_compare_mode_shows_every_model_side_by_side_and_their_top1_agreement(
    two_model_page, two_models, photos, tmp_path
):
    page = two_model_page
    page.get_by_label("Compare all models").check()
    assert page.get_by_label("Model", exact=True).is_disabled()  # every model answers: nothing to choose
    paths = []
    for i, data in enumerate(photos[1:]):  # photos[0] may be cached already: every side here must be a miss
        paths.append(tmp_path / f"compare{i}.jpg")
        paths[-1].write_bytes(data)
    page.locator("#file-input").set_input_files(paths)

    cards = page.locator("#photos .photo")
    # Every card, not the last: the page uploads several photos at once, so they can finish in any order.
    page.wait_for_function(
        "n => document.querySelectorAll('#photos .photo .agreement-line').length === n", arg=len(paths)
    )
    same_top1 = 0
    for card in cards.all():
        data = photos[1:][paths.index(tmp_path / card.locator("figcaption").inner_text().split(" · ")[0])]
        sides = card.locator(".compare .result")
        assert sides.locator("h4").all_inner_texts() == ["fp32", "shifted"]
        answers = {}
        for side, name in zip(sides.all(), ("fp32", "shifted"), strict=True):
            answers[name] = predict(two_models, data, name)
            assert answers[name]["cache_hit"], f"the page did not send this photo to ?model={name}"
            assert [(p["class_id"], p["label"], p["probability"]) for p in shown_predictions(side)] == top5(
                answers[name]["predictions"]
            )
            times = timings(side)
            assert re.fullmatch(r"\d+(\.\d+)? ms", times["round trip"]), times
            assert times["cache"] == "miss"
        first = {name: answer["predictions"][0] for name, answer in answers.items()}
        if first["fp32"]["class_id"] == first["shifted"]["class_id"]:
            same_top1 += 1
            expected = f"Top-1: all 2 models agree ({first['fp32']['label']})"
        else:
            expected = f"Top-1 differs: fp32 → {first['fp32']['label']}, shifted → {first['shifted']['label']}"
        assert card.locator(".agreement-line").inner_text() == expected
    assert page.locator("#agreement").inner_text() == (
        f"Top-1 agreement with fp32 over the photos compared: shifted {same_top1}/{len(paths)} "
        f"({math.floor(100 * same_top1 / len(paths) + 0.5)}%)"
    )

    # The live panel's table of each model shows what GET /stats says of each (read and shown in one go).
    models, rows = page.evaluate("""async () => {
        const stats = await (await fetch("stats")).json();
        renderStats(stats, STATS_EVERY_MS);
        return [stats.models, [...document.querySelectorAll("#per-model tbody tr")].map(
            (row) => [...row.children].map((cell) => cell.textContent))];
    }""")
    assert page.locator("#per-model").is_visible()
    assert [row[0] for row in rows] == list(models) == ["fp32", "shifted"]
    assert models["shifted"]["requests"] >= len(paths) + 1  # the selector's photo, then the compared ones
    for row, m in zip(rows, models.values(), strict=True):
        assert row[1] == f"{m['requests_per_s']:.1f}" and float(row[1]) > 0
        assert row[2].endswith(" ms") and row[3].endswith(" ms")
        assert row[4] == f"{math.floor(100 * m['cache_hit_rate'] + 0.5)}%"  # as Math.round: halves up


def test_stand_in_weights_are_named_on_the_page_and_other_weights_are_not(
    browser, page, fp32_model_path, stand_in_model_path
):
    page.wait_for_function("() => document.getElementById('model-line').textContent.startsWith('Serving')")
    assert page.locator("#weights-notice").is_hidden()  # the fixture's weights are unknown, not the stand-in's
    with ServerProcess(f"standin={stand_in_model_path}", extra_models=(f"fp32={fp32_model_path}",)) as url:
        assert [m["weights"] for m in requests.get(url + "/models").json()["models"]] == ["random-init", "unknown"]
        with opened(browser, url) as stand_in_page:
            notice = stand_in_page.locator("#weights-notice")
            notice.wait_for(state="visible")
            assert notice.inner_text().startswith("standin: random-init weights, a seeded stand-in")
            assert "The labels mean nothing" in notice.inner_text() and "fp32" not in notice.inner_text()


def test_the_page_fits_a_narrow_window(page):
    page.set_viewport_size({"width": 360, "height": 800})
    page.locator("#stat-requests").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")


def test_docs_render_offline_and_list_every_operation(page, server):
    operations = requests.get(server + "/openapi.json").json()["paths"]
    page.goto(server + "/docs")
    page.locator(".opblock").first.wait_for()
    shown = {
        (
            block.locator(".opblock-summary-method").inner_text().lower(),
            block.locator(".opblock-summary-path").inner_text().replace("\u200b", ""),
        )
        for block in page.locator(".opblock").all()
    }
    assert shown == {(method, path) for path, methods in operations.items() for method in methods}

    page.goto(server + "/redoc")
    for methods in operations.values():
        for operation in methods.values():
            page.get_by_role("heading", name=operation["summary"]).first.wait_for()


def test_requests_to_other_hosts_are_blocked_and_recorded(browser, server):
    # The guard the other tests rely on: a request off 127.0.0.1 fails and is recorded. From /healthz, a document
    # without the page's Content-Security-Policy, which would refuse it before the guard saw it.
    tried_before = len(browser.off_host)
    page = browser.context.new_page()
    try:
        page.goto(server + "/healthz")
        outcome = page.evaluate("fetch('http://192.0.2.1/x.js').then(() => 'loaded', () => 'failed')")
        assert outcome == "failed"
        assert browser.off_host[tried_before:] == ["http://192.0.2.1/x.js"]
    finally:
        page.close()
        del browser.off_host[tried_before:]  # recorded on purpose: not a failure of the other tests


def test_the_pages_policy_lets_it_load_nothing_but_its_own(browser, server):
    # It holds a tab's API key: a script injected into it could neither load from nor send to another host,
    # and no other site may frame it (a helper reviewing the server as an attacker would found no such headers)
    answer = requests.get(server + "/")
    assert "default-src 'self'" in answer.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]
    assert answer.headers["X-Content-Type-Options"] == "nosniff" and answer.headers["X-Frame-Options"] == "DENY"
    # nowhere else, where it would come without them (and its relative URLs would lead nowhere)
    assert requests.get(server + "/static/index.html").status_code == 404
    tried_before = len(browser.off_host)
    page = browser.context.new_page()
    try:
        page.add_init_script(RECORD_BLOCKED)
        page.goto(server + "/")
        outcome = page.evaluate("fetch('http://192.0.2.1/x.js').then(() => 'loaded', () => 'failed')")
        assert outcome == "failed" and page.evaluate("window.blocked") == ["connect-src http://192.0.2.1/x.js"]
        assert browser.off_host[tried_before:] == []  # refused by the page itself: it never left the browser
    finally:
        page.close()


def test_a_protected_server_gets_a_key_from_the_page_for_this_tab_only(browser, fp32_model_path, photos, tmp_path):
    key, scraper_key = new_key_line()[0], new_key_line()[0]
    key_file = tmp_path / "api_keys"
    key_file.write_text(f"{key} infer\n{scraper_key} metrics\n")
    with ServerProcess(fp32_model_path, api_keys=key_file, max_batch_size=8, cache_size=64) as url:
        tried_before = len(browser.off_host)
        page = browser.context.new_page()
        page.set_default_timeout(WAIT_MS)
        try:
            page.goto(url + "/")
            key_input = page.get_by_label("API key")
            key_input.wait_for()  # the page asked what the server serves and got a 401
            assert page.locator("#key-reason").inner_text() == "This server needs an API key."
            key_input.fill(f"“{key}”")  # pasted with typographic quotes: no header can carry it (fetch throws)
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("That is not an API key").wait_for()
            assert page.evaluate("sessionStorage.getItem('mnv3-api-key')") is None and key_input.is_visible()
            key_input.fill("not-the-key-0123456789")
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("did not accept this tab's API key").wait_for()
            key_input.fill(scraper_key)  # valid, but for /metrics only: the page cannot use it
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("This tab's API key may not use the page").wait_for()
            path = tmp_path / "street.jpg"
            path.write_bytes(photos[0])
            page.get_by_label("Choose photos").set_input_files(path)  # chosen before the key: it waits for one
            page.locator("#photos .pending").get_by_text("Waiting for an API key…").wait_for()

            key_input.fill(key)
            page.get_by_role("button", name="Use this key").click()
            page.get_by_text("Serving fp32.onnx").wait_for()  # GET /models went through with the key
            assert page.locator("#key-form").is_hidden()
            assert page.evaluate("document.activeElement.id") == "file-input"  # not <body>: on to the photos
            shown = shown_predictions(page.locator("#photos .photo").first)
            answer = requests.post(
                url + "/predict",
                files={"file": ("street.jpg", photos[0], "image/jpeg")},
                headers={"Authorization": f"Bearer {key}"},
                timeout=WAIT_MS / 1000,
            ).json()
            assert [p["class_id"] for p in shown] == [p["class_id"] for p in answer["predictions"]]
            page.wait_for_function("() => Number(document.getElementById('stat-requests').textContent) >= 1")
            # The metrics link sends the tab's key (a plain link would open a 401): an infer key is refused.
            with browser.context.expect_page() as opened_tab:
                page.get_by_role("link", name="Prometheus metrics").click()
            metrics_tab = opened_tab.value
            try:
                metrics_tab.wait_for_url("blob:**")
                shown = metrics_tab.locator("body").inner_text()
                assert shown.startswith("GET /metrics answered 403 to this tab's API key") and "scope metrics" in shown
            finally:
                metrics_tab.close()

            # Kept in this tab's sessionStorage, nowhere else: a new tab asks again.
            assert page.evaluate("[sessionStorage.getItem('mnv3-api-key'), localStorage.length]") == [key, 0]
            other_tab = browser.context.new_page()
            try:
                other_tab.goto(url + "/")
                other_tab.get_by_label("API key").wait_for()
                assert other_tab.get_by_role("button", name="Forget this tab's API key").is_hidden()  # none in use
            finally:
                other_tab.close()
            # Forgotten on request (the form went for good once a key was taken): the page asks again.
            page.get_by_role("button", name="Forget this tab's API key").click()
            page.get_by_label("API key").wait_for()
            assert page.evaluate("sessionStorage.getItem('mnv3-api-key')") is None
        finally:
            page.close()
        assert browser.off_host[tried_before:] == []


def test_the_header_says_what_is_served_and_when_batching_or_the_cache_is_off(page):
    page.wait_for_function("() => document.getElementById('model-line').textContent.startsWith('Serving')")
    off = "{batching: {max_batch_size: 1, batch_window_ms: 20}, cache: {size: 0}}"
    on = "{batching: {max_batch_size: 8, batch_window_ms: 20}, cache: {size: 64}}"
    assert page.evaluate(f"batchingAndCache({off})") == "no batching, no cache"
    assert page.evaluate(f"batchingAndCache({on})") == "batches of up to 8 (window 20 ms), cache of 64 results"
    # --backend auto serving stage 2's choice for the file named: both names, not the chosen file's alone
    chosen = "{name: 'static_int8', model: 'nncf_rewritten_full_int8.xml:7dc027a8e885'}"
    assert page.evaluate(f"servedAs({chosen})") == "static_int8 as nncf_rewritten_full_int8.xml:7dc027a8e885"
    assert page.evaluate("servedAs({name: 'fp32', model: 'fp32.onnx:0123456789ab'})") == "fp32.onnx:0123456789ab"


def test_the_live_panel_leaves_a_rate_limited_keys_budget_to_the_photos(page):
    # The server's RateLimit-Policy field (mnv3.auth: q requests each w seconds) paces GET /stats to at most a
    # quarter of the key's rate; without the field, every 1.5 s.
    page.wait_for_function("() => server.models.length > 0")
    delays = page.evaluate("""() => [null, "q=50;w=1", "q=1;w=2", "q=5;w=6"].map((policy) => {
        noteKeyRate(new Response(null, policy === null ? {} : {headers: {"RateLimit-Policy": `"key";${policy}`}}));
        return statsDelayMs();
    })""")
    assert delays == [1500, 1500, 8000, 4800]  # no rate; 50/s; 30/min: 8 s; 50/min: 4.8 s
    page.evaluate("noteKeyRate(new Response(null))")


def test_advice_for_a_photo_over_the_upload_limit_is_advice_that_helps(page):
    page.wait_for_function("() => server.models.length > 0")
    errors = page.evaluate("""async () => {
        const photo = async (width, height) => {  // a PNG of that size, drawn by the browser
            const canvas = new OffscreenCanvas(width, height);
            canvas.getContext("2d").fillRect(0, 0, 1, 1);
            return canvas.convertToBlob({type: "image/png"});
        };
        const limits = server.models[0].limits, kept = {...limits};
        limits.max_upload_bytes = 100;  // every PNG here is over it once multipart's own bytes are counted
        limits.max_pixels = 1_000_000;
        const name = server.models[0].name, ask = (blob, shrunk) => predict(blob, "a.png", name, shrunk, () => {});
        try {
            const large = await photo(2000, 1500), small = await photo(400, 300), tall = await photo(600, 4000);
            return [await ask(large, false), await ask(large, true), await ask(small, false), await ask(tall, false),
                    await ask(new Blob([new Uint8Array(700)]), false)].map((r) => r.error);
        } finally { Object.assign(limits, kept); }
    }""")
    assert errors[0].endswith(
        "tick “Shrink large photos” to send a smaller copy of a photo over 512 px on its short side, or save it smaller"
    )
    assert errors[1].endswith("; save it smaller (say, as a JPEG) to send it")  # shrinking already failed to help
    assert errors[2].endswith("; “Shrink large photos” leaves a 400×300 photo as it is: save it smaller")
    assert errors[3].endswith("; even shrunk to 512×3413 it is over the server's limit of 1,000,000 pixels: crop it")
    assert errors[4].endswith("is over the server's upload limit of 100 B")  # not a picture: no advice


def test_a_failed_photo_can_be_sent_again_with_the_options_as_they_are_now(page, photos, tmp_path):
    page.wait_for_function("() => server.models.length > 0")
    large = Image.open(io.BytesIO(photos[0])).resize((2000, 1500))
    path = tmp_path / "large.jpg"
    large.save(path, quality=95)
    page.evaluate("server.models[0].limits.max_upload_bytes = 150000")  # over it as it is, under it shrunk
    page.locator("#file-input").set_input_files(path)
    card = page.locator("#photos .photo").first
    card.locator(".error").wait_for()
    assert "over the server's upload limit" in card.locator(".error").inner_text()
    page.get_by_label("Shrink large photos in the browser before upload").check()
    card.get_by_role("button", name="Send again (large.jpg)").click()  # the same file, not chosen again
    # the button went with its outcome: focus stays on the photo, where it fell back to the page's start
    assert page.evaluate("document.activeElement.classList.contains('photo')")
    assert len(shown_predictions(card)) == 5
    assert card.locator(".error").count() == 0 and card.locator(".send-again").count() == 0
    assert "2000×1500 → 683×512" in card.locator(".outcomes > .hint").inner_text()


def test_busy_answers_are_sent_again_after_retry_after(browser, fp32_model_path, photos, tmp_path):
    with ServerProcess(fp32_model_path, max_in_flight=1, cache_size=0) as url, opened(browser, url) as page:
        paths = []
        for i, data in enumerate(photos[:3]):
            paths.append(tmp_path / f"busy{i}.jpg")
            paths[-1].write_bytes(data)
        page.locator("#file-input").set_input_files(paths)  # three uploads at once, one admitted at a time
        page.wait_for_function("() => document.querySelectorAll('#photos .photo .top5').length === 3")
        assert page.locator("#photos .error").count() == 0
        assert requests.get(url + "/stats").json()["rejected"]["busy"] >= 1, "no upload was refused: nothing retried"


def test_photos_chosen_together_take_turns_within_a_keys_rate(browser, fp32_model_path, tmp_path):
    """Six photos with a key of 30/min, burst 1: two of them failed after four tries each (429), as all six
    contended for one token every 2 s; now each waits its turn."""
    key = new_key_line()[0]
    (tmp_path / "api_keys").write_text(f"{key} infer rate=30/min burst=1\n")
    with (
        ServerProcess(fp32_model_path, api_keys=tmp_path / "api_keys", cache_size=0) as url,
        opened(browser, url) as page,
    ):
        page.evaluate(f"sessionStorage.setItem('mnv3-api-key', '{key}')")
        page.reload()
        page.get_by_text("Serving fp32.onnx").wait_for()
        paths = []
        for i, data in enumerate(load_images(6, seed=12)):
            paths.append(tmp_path / f"turn{i}.jpg")
            paths[-1].write_bytes(data)
        page.locator("#file-input").set_input_files(paths)
        page.wait_for_function(
            "() => document.getElementById('announce').textContent.startsWith('6 photos done')", timeout=60_000
        )
        assert page.locator("#announce").inner_text() == "6 photos done: 6 classified"


def test_the_live_panel_blanks_its_figures_when_the_server_stops(browser, fp32_model_path):
    server = ServerProcess(fp32_model_path)
    with server as url, opened(browser, url) as page:
        page.wait_for_function("() => document.getElementById('stat-requests').textContent === '0'")
        server.stop()
        page.get_by_text("No stats:").wait_for()
        figures = page.locator(".live dd").all_inner_texts()
        assert figures and set(figures) == {"–"}, figures  # not the last figures, as if the server still answered
        # the header, which said what is served, says it is not answering (it went on naming the models)
        assert page.locator("#model-line").inner_text().endswith(" (the server does not answer now)")


def test_long_model_names_wrap_instead_of_widening_the_page(
    browser, fp32_model_path, other_model_path, photos, tmp_path
):
    names = ("mobilenetv3_large_static_int8_per_channel_calibrated", "mobilenetv3_large_fp32_reference_export")
    with (
        ServerProcess(f"{names[0]}={fp32_model_path}", extra_models=(f"{names[1]}={other_model_path}",)) as url,
        opened(browser, url) as page,
    ):
        page.get_by_label("Compare all models").check()
        path = tmp_path / "long.jpg"
        path.write_bytes(photos[0])
        page.locator("#file-input").set_input_files(path)
        page.locator("#photos .agreement-line").wait_for()
        page.wait_for_function("() => !document.getElementById('per-model').hidden")
        for width in (1280, 390, 320):  # 320 CSS px: a 1280 px window at 400% zoom (WCAG's reflow)
            page.set_viewport_size({"width": width, "height": 900})
            assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth"), width
            # every label whole, wrapped where it must be (a tooltip, its only other place, reaches no keyboard)
            assert page.locator(".top5 .label").evaluate_all(
                "labels => labels.every((l) => l.scrollWidth <= l.clientWidth)"
            ), width
            headings = page.locator(".compare .result h4").evaluate_all(
                "hs => hs.map((h) => { const r = h.getBoundingClientRect(); return [r.left, r.right]; })"
            )
            assert headings[0][1] <= headings[1][0] or width <= 390, headings  # side by side, not drawn over


def test_agreement_starts_again_when_the_served_models_change_and_batches_show_before_models_are_known(page):
    page.wait_for_function("() => server.models.length > 0")
    state = page.evaluate("""() => {
        agreement.photos = 2; agreement.sameTop1 = {other: 1}; $("agreement").hidden = false;
        describeModels();  // the same models: the count stands
        const kept = agreement.photos;
        server.models = [{...server.models[0], name: "restarted"}]; server.defaultModel = "restarted";
        describeModels();  // a server restarted with others: counts against the old models say nothing
        const models = server.models; server.models = [];
        renderBatchSizes({mean: 1, inferences: 3, buckets: [{smallest: 1, largest: 1, inferences: 3}]});
        server.models = models;
        const rows = document.querySelectorAll("#batch-sizes .histogram-row").length;
        return [kept, agreement.photos, $("agreement").hidden, rows];
    }""")
    assert state == [2, 0, True, 1]  # the histogram was empty while GET /models had not answered


def test_agreement_starts_again_when_a_model_runs_another_file_under_its_name(page):
    page.wait_for_function("() => server.models.length > 0")
    photos = page.evaluate("""() => {
        describeModels();
        agreement.photos = 2; agreement.sameTop1 = {other: 1};
        server.models = [{...server.models[0], model: "dynamic_int8.onnx:0123456789ab", backend: "onnxruntime"}];
        describeModels();  // restarted with another file under the same name: its counts are another model's
        return agreement.photos;
    }""")
    assert photos == 0


def test_the_page_asks_again_what_is_served_when_the_live_panel_sees_other_models(page):
    # A server restarted with other models while the page was open kept its old header, selector and default:
    # the page asked GET /models again only after a 404.
    page.wait_for_function("() => server.models.length > 0")
    served = page.evaluate("server.models.map((m) => m.name)")
    page.evaluate("""() => {
        server.models = [{...server.models[0], name: "from_before_a_restart"}];
        server.defaultModel = "from_before_a_restart";
        describeModels();
    }""")
    page.wait_for_function(
        "names => JSON.stringify(server.models.map((m) => m.name)) === JSON.stringify(names)", arg=served
    )
    assert page.locator("#model-line").inner_text().startswith("Serving ")
    assert "from_before_a_restart" not in page.locator("#model-line").inner_text()


@contextmanager
def upload_throttled(browser, page, bytes_per_s: int):
    """Chromium's own network emulation: the page's uploads go at most `bytes_per_s`, as over a slow link."""
    cdp = browser.context.new_cdp_session(page)
    cdp.send("Network.enable")
    conditions = {"offline": False, "latency": 0, "downloadThroughput": -1}
    cdp.send("Network.emulateNetworkConditions", conditions | {"uploadThroughput": bytes_per_s})
    try:
        yield
    finally:
        cdp.send("Network.emulateNetworkConditions", conditions | {"uploadThroughput": -1})
        cdp.detach()


def test_a_slow_upload_shows_its_progress_and_a_photo_can_be_cancelled(browser, fp32_model_path, tmp_path):
    """Nine photos over a slow link: eight upload at once (UPLOADS_AT_ONCE), saying how far each has gone; one
    is cancelled mid-upload and the ninth while it waits its turn, which is then never sent."""
    paths = []
    for i, data in enumerate(load_images(9, seed=11)):
        paths.append(tmp_path / f"slow{i}.jpg")
        paths[-1].write_bytes(data)
    with ServerProcess(fp32_model_path, cache_size=0) as url, opened(browser, url) as page:
        page.get_by_text("Serving fp32.onnx").wait_for()
        with upload_throttled(browser, page, 30_000):
            page.locator("#file-input").set_input_files(paths)
            first = page.locator("#photos .photo").last  # photos are listed newest first
            progress = first.locator(".pending").filter(
                has_text=re.compile(r"^Uploading: \d+ KiB of \d+ KiB \(\d+%\)…$")
            )
            progress.wait_for()
            total_kib = int(re.search(r"of (\d+) KiB", progress.inner_text())[1])
            assert abs(total_kib * 1024 - paths[0].stat().st_size) < 1024  # the photo and its multipart framing
            waiting = page.locator("#photos .photo").first  # the ninth, not sent yet: its turn comes after one of eight
            assert waiting.locator(".pending").inner_text() == "Waiting for its turn to upload…"
            for card, name in ((first, "slow0.jpg"), (waiting, "slow8.jpg")):
                card.get_by_role("button", name=f"Cancel ({name})").click()
                assert card.locator(".outcomes").inner_text().startswith("Cancelled")
                assert card.get_attribute("aria-busy") is None and card.locator(".cancel").count() == 0
                assert page.evaluate("document.activeElement.classList.contains('photo')")  # not <body>
                wait_for_text(page, "announce", f"{name}: cancelled")
        page.wait_for_function(
            "() => document.getElementById('announce').textContent.startsWith('9 photos done')", timeout=60_000
        )
        assert page.locator("#announce").inner_text() == "9 photos done: 7 classified, 2 not (see each photo)"
        metrics = read_metrics(url)
        # seven photos decoded; slow0's upload was cut short (the server's one refusal), slow8's never began
        assert metrics[("mnv3_preprocess_seconds_count", "")] == 7
        assert metrics[("mnv3_rejections_total", "")] == 1
        for card in (first, waiting):
            assert card.locator(".top5").count() == 0
            card.get_by_role("button", name="Send again").click()
            assert len(shown_predictions(card)) == 5


def test_uploads_refused_for_an_old_key_go_again_with_the_new_one_without_asking_again(
    browser, fp32_model_path, tmp_path
):
    """Slow uploads sent with a wrong key were refused after the right key was entered, and asked for a key again:
    their photos waited until it was typed a second time (a reviewer of the diff, with uploads at 40 KB/s)."""
    key = new_key_line()[0]
    (tmp_path / "api_keys").write_text(f"{key} infer\n")
    paths = []
    for i, data in enumerate(load_images(6, seed=13)):
        paths.append(tmp_path / f"k{i}.jpg")
        paths[-1].write_bytes(data)
    with ServerProcess(fp32_model_path, api_keys=tmp_path / "api_keys") as url, opened(browser, url) as page:
        page.evaluate("sessionStorage.setItem('mnv3-api-key', 'not-the-key-0123456789')")
        with upload_throttled(browser, page, 40_000):
            page.locator("#file-input").set_input_files(paths)
            page.locator("#key-form").wait_for()
            page.fill("#key-input", key)
            page.locator("#key-form").evaluate("form => form.requestSubmit()")
            page.wait_for_function(
                "() => document.getElementById('announce').textContent.startsWith('6 photos done')", timeout=60_000
            )
            assert page.locator("#key-form").is_hidden()
        assert page.locator("#announce").inner_text() == "6 photos done: 6 classified"


@pytest.mark.parametrize("status", [204, 600])
def test_an_answer_that_is_no_classification_is_said_not_left_pending(page, photos, tmp_path, status):
    # A 204 (no body) or a status outside HTTP's range made the page's Response throw: the photo stayed
    # "Uploading…" for good, holding one of the eight upload turns
    page.route("**/predict*", lambda route: route.fulfill(status=status, body=""))
    path = tmp_path / "odd.jpg"
    path.write_bytes(photos[0])
    page.locator("#file-input").set_input_files(path)
    error = page.locator("#photos .photo").first.locator(".error")
    error.wait_for()
    said = {
        204: "204: not a classification (an empty answer)",
        600: "the server answered status 600, which is not HTTP's",
    }
    assert error.inner_text() == said[status]
    assert page.locator("#photos .photo").first.get_attribute("aria-busy") is None
