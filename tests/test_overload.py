"""Overload: refusals come at once and cost nothing, abandoned work is never computed, under twice the
load the server can carry accepted requests stay fast and every answer is the right one, and a soak
with a churning cache keeps memory flat."""

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from conftest import WAIT_S, Gate, post, uvicorn_in_thread, wait_until
from mnv3 import report
from mnv3.config import ServerConfig
from mnv3.engine import Engine
from mnv3.loadtest import PredictClient, ServerProcess, run_closed_loop, run_open_loop
from mnv3.photos import load_images
from mnv3.preprocess import decode_image, preprocess
from mnv3.server import create_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def images():
    return load_images(16, seed=5)


@contextmanager
def live_server(model_path, **settings):
    """A real uvicorn server in a thread, so a test can both hold its engine and use raw sockets on it."""
    engine = Engine.load(model_path, max_batch_size=settings.get("max_batch_size", 32))
    config = ServerConfig(model=model_path, **({"cache_size": 0} | settings))
    app = create_app(config, engine)
    with uvicorn_in_thread(app, log_level="warning") as port:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(url + "/readyz", timeout=WAIT_S).status_code == 200, "the server to be ready")
        yield url, app.state.serving


def open_socket(
    url: str,
    content_length: int,
    body: bytes,
    headers: str = "",
    path: str = "/predict",
    content_type: str = "image/jpeg",
) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n{headers}"
        f"Content-Length: {content_length}\r\n\r\n".encode()
        + body
    )
    return sock


def answer_and_next(sock: socket.socket) -> tuple[bytes, bytes | None]:
    """The answer waiting on `sock`, then what a GET /healthz sent on the same connection gets: its answer,
    b"" when the server closed the connection, or None when nothing comes (the server is still reading
    the first request's body: it took the GET for part of it)."""
    answer = sock.recv(65536)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(2)
        return answer, sock.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return answer, b""
    except TimeoutError:
        return answer, None


def test_an_answer_before_its_body_arrived_closes_the_connection_unless_the_rest_can_be_dropped(
    fp32_model_path, images
):
    photo = images[0]
    with live_server(fp32_model_path) as (url, _):
        # answered before the body: a client waiting for 100 Continue never sends it, so the connection
        # closes, or the next request on it would be read as that body and never answered
        for path, content_type in (("/predict", "text/plain"), ("/predict?model=nope", "image/jpeg")):
            with open_socket(url, len(photo), b"", "Expect: 100-continue\r\n", path, content_type) as waiting:
                answer, then = answer_and_next(waiting)
            assert answer.split(b" ")[1] in (b"415", b"404") and b"connection: close" in answer.lower(), answer
            assert then == b"", then
        # a body of announced length the server takes: it is dropped as it arrives and the connection serves on
        with open_socket(url, len(photo), photo[:100], "", "/predict", "text/plain") as sending:
            answer = sending.recv(65536)
            assert answer.startswith(b"HTTP/1.1 415") and b"connection: close" not in answer.lower()
            sending.sendall(photo[100:] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            then = sending.recv(65536)
        assert then.startswith(b"HTTP/1.1 200") and then.endswith(b'{"status":"ok"}'), then
        # requests without a body, and answered uploads, keep their connection
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=WAIT_S) as idle:
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, then = answer_and_next(idle)
        assert answer.startswith(b"HTTP/1.1 200") and then is not None and then.startswith(b"HTTP/1.1 200")
        with open_socket(url, len(photo), photo) as uploaded:
            answer, then = answer_and_next(uploaded)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower()
        assert then is not None and then.startswith(b"HTTP/1.1 200"), then


def test_in_flight_limit_refuses_at_arrival_without_reading_the_body(fp32_model_path, images):
    with (
        live_server(fp32_model_path, max_batch_size=1, max_in_flight=2) as (url, serving),
        ThreadPoolExecutor(2) as pool,
    ):
        gate = Gate(serving.engine)
        running = gate.hold(pool, post, url, images[0])
        queued = pool.submit(post, url, images[1])
        wait_until(lambda: serving.batcher.depth == 1, "the second request to queue")

        with open_socket(url, 10**12, b"") as refused:  # a terabyte announced, none sent: it must not be awaited
            response = refused.recv(65536)
        assert response.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in response.lower()
        assert b"2 requests in flight (limit 2)" in response
        assert b"connection: close" in response.lower()  # a body over --max-upload-bytes is not waited for
        gate.release.set()
        assert running.result().status_code == queued.result().status_code == 200
        metrics = requests.get(url + "/metrics", timeout=WAIT_S).text
        assert 'mnv3_rejections_total{reason="busy"} 1.0' in metrics
        # the two admitted are timed, not the refusal: instant 503s pulled the latency quantiles down under overload
        assert "mnv3_request_latency_seconds_count 2.0" in metrics
        assert serving.in_flight == 0


@pytest.mark.parametrize("path", ["/predict", "/v2/models/fp32/infer"])
def test_the_deadline_starts_once_the_body_has_arrived_so_a_slow_upload_is_answered(fp32_model_path, images, path):
    """A photo sent over a slow link took longer than --deadline-ms to arrive, and always got a 504 after being
    read in full (a page user at 60 KB/s: every photo of 800 KB); the upload's own time is --body-timeout-s's."""
    body, content_type, headers = images[0], "image/jpeg", ""
    if path.startswith("/v2"):  # the binary extension: a JSON header, then BYTES (each a 4-byte length, the file)
        data = len(body).to_bytes(4, "little") + body
        inputs = [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(data)}}]
        header = json.dumps({"inputs": inputs}).encode()
        body, content_type = header + data, "application/octet-stream"
        headers = f"Inference-Header-Content-Length: {len(header)}\r\n"
    with live_server(fp32_model_path, deadline_ms=300) as (url, _):
        with open_socket(url, len(body), body[:100], headers, path, content_type) as sock:
            part = len(body) // 6 + 1
            for start in range(100, len(body), part):  # the rest over about 0.6 s
                time.sleep(0.1)
                sock.sendall(body[start : start + part])
            response = answer_and_next(sock)[0]
    assert response.startswith(b"HTTP/1.1 200 "), response[:300]


def test_a_refused_upload_of_a_size_the_server_takes_keeps_its_connection(fp32_model_path, images):
    # Closing with the body still on its way would reset the connection under a client still sending it,
    # which then sees the reset instead of the 503; uvicorn drops the rest of an answered request's body.
    with (
        live_server(fp32_model_path, max_batch_size=1, max_in_flight=1) as (url, serving),
        ThreadPoolExecutor(1) as pool,
    ):
        gate = Gate(serving.engine)
        running = gate.hold(pool, post, url, images[0])
        photo = images[1]
        half = len(photo) // 2
        with open_socket(url, len(photo), photo[:half]) as refused:
            response = refused.recv(65536)  # before the rest of the body is sent: refused at arrival
            assert response.startswith(b"HTTP/1.1 503") and b"connection: close" not in response.lower()
            refused.sendall(photo[half:] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = refused.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer
        # but a client waiting to be invited to send its body may never send it: that connection closes
        with open_socket(url, len(photo), b"", headers="Expect: 100-continue\r\n") as waiting:
            response = waiting.recv(65536)
        assert response.startswith(b"HTTP/1.1 503") and b"connection: close" in response.lower()
        gate.release.set()
        assert running.result().status_code == 200
        assert serving.in_flight == 0


def test_a_follower_still_gets_its_answer_when_the_identical_leader_disconnects(fp32_model_path, images):
    with live_server(fp32_model_path, max_batch_size=1, cache_size=8) as (url, serving), ThreadPoolExecutor(2) as pool:
        gate = Gate(serving.engine)
        running = gate.hold(pool, post, url, images[0])
        leader = open_socket(url, len(images[1]), images[1])
        wait_until(lambda: serving.batcher.depth == 1, "the leader to queue")
        follower = pool.submit(post, url, images[1])  # the same bytes: it waits for the leader's result
        wait_until(lambda: serving.in_flight == 3, "the follower to wait")
        leader.close()
        # The follower leads now: its own entry queues behind the leader's, which the inference thread will skip.
        wait_until(lambda: serving.in_flight == 2 and serving.batcher.depth == 2, "the follower to take over")

        gate.release.set()
        assert running.result().status_code == 200
        answer = follower.result()
        assert answer.status_code == 200 and answer.json()["cache_hit"] is False  # it computed, as the new leader
        assert serving.batcher.dropped == 1  # the leader's queued work, skipped


def test_disconnected_clients_work_is_dropped_and_nothing_leaks(fp32_model_path, images):
    with live_server(fp32_model_path, max_batch_size=1) as (url, serving), ThreadPoolExecutor(1) as pool:
        gate = Gate(serving.engine)
        running = gate.hold(pool, post, url, images[0])
        abandoned = [open_socket(url, len(body), body) for body in images[1:6]]
        wait_until(lambda: serving.batcher.depth == 5, "five requests to queue")
        for sock in abandoned:
            sock.close()
        wait_until(lambda: serving.in_flight == 1, "the abandoned requests to end")  # only the held one is left

        gate.release.set()
        assert running.result().status_code == 200
        wait_until(lambda: serving.batcher.depth == 0, "the inference thread to pass the abandoned requests")
        assert post(url, images[6]).status_code == 200
        assert gate.batch_sizes == [1, 1], "the abandoned requests were never computed"
        assert serving.batcher.dropped == 5 and serving.in_flight == 0
        metrics = requests.get(url + "/metrics", timeout=WAIT_S).text
        assert 'mnv3_rejections_total{reason="disconnected"} 5.0' in metrics and "mnv3_dropped_total 5.0" in metrics


def test_a_follower_whose_client_left_ends_then_not_when_its_leader_does(fp32_model_path, images):
    # It had held its --max-in-flight place until the leader's answer, and was counted a cache hit: a client
    # sending one slow image and hanging up could fill every place without keeping a socket open.
    with live_server(fp32_model_path, max_batch_size=1, cache_size=8) as (url, serving), ThreadPoolExecutor(1) as pool:
        gate = Gate(serving.engine)
        leader = gate.hold(pool, post, url, images[0])
        followers = [open_socket(url, len(images[0]), images[0]) for _ in range(3)]
        wait_until(lambda: serving.in_flight == 4, "the followers to wait for the leader")
        for sock in followers:
            sock.close()
        wait_until(lambda: serving.in_flight == 1, "the followers to end")
        gate.release.set()
        assert leader.result().status_code == 200
        assert gate.batch_sizes == [1] and serving.default.cache.hits == 0
        metrics = requests.get(url + "/metrics", timeout=WAIT_S).text
        assert 'mnv3_rejections_total{reason="disconnected"} 3.0' in metrics


@pytest.mark.slow
def test_twice_the_sustainable_rate_sheds_load_and_answers_every_accepted_request_right(fp32_model_path, images):
    deadline_s = 0.5
    engine = Engine.load(fp32_model_path)
    expected = {body: engine.predict(preprocess(decode_image(body))[None])[0] for body in images}
    answers = []

    def send_and_keep(send):
        async def send_one(body):
            status, payload = await send(body)
            if payload is not None:
                answers.append((body, payload))
            return status, payload

        return send_one

    with ServerProcess(
        fp32_model_path, cache_size=0, max_batch_size=8, queue_limit=8, max_in_flight=16, deadline_ms=1000 * deadline_s
    ) as url:
        with PredictClient(url) as send:
            sustainable = run_closed_loop(send, images, concurrency=8, count=48)
        assert sustainable.ok == 48
        with PredictClient(url) as send:
            result = run_open_loop(send_and_keep(send), images, rate=2 * sustainable.rps, seconds=3, max_in_flight=64)

    assert set(result.errors) <= {"503", "504"}, result.errors  # shed load, never a 5xx crash or a reset
    assert result.errors, "twice the sustainable rate should have been refused in part"
    assert result.ok >= result.sent / 4, result.summary()
    assert result.latency.p99_ms < 1000 * (deadline_s + 0.5), result.summary()  # queue and deadline bound it
    assert len(answers) == result.ok
    for body, payload in answers:
        alone, top = expected[body], payload["predictions"][0]
        assert top["class_id"] == int(alone.argmax())
        assert top["probability"] == pytest.approx(float(alone.max()), rel=1e-3)
    assert len({round(float(p.max()), 6) for p in expected.values()}) > 1, "the images must be told apart"


@pytest.mark.slow
def test_soak_quick_mode_keeps_memory_flat_with_a_churning_cache(fp32_model_path, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mnv3.soak", "--model", str(fp32_model_path), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = report.read_csv(tmp_path / "07_soak.csv")
    assert len(rows) == 10 and int(rows[-1]["requests_done"]) == 400
    assert all(row["passed"] == "True" and int(row["errors"]) == 0 for row in rows)
    assert float(rows[-1]["rss_growth_pct"]) < 10 and float(rows[-1]["rss_mib"]) > 0
    # More distinct images than entries: the cache hits, misses (so evicts) and stays full.
    assert sum(int(r["cache_hits"]) for r in rows) > 0 and sum(int(r["cache_misses"]) for r in rows) > 0
    assert {int(r["cache_entries"]) for r in rows} == {32}
