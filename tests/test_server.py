"""The HTTP server against the real (random-init) MobileNetV3 ONNX export from conftest."""

import io
import json
import logging
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from fastapi.testclient import TestClient
from PIL import Image

import mnv3.server
import mnv3.serving
from conftest import WAIT_S, Gate, post, post_file, post_raw, serving_client, wait_until
from mnv3.artifacts import CLASS_NAMES_JSON
from mnv3.config import ServerConfig, parse_args
from mnv3.engine import Engine, InferenceError, ModelLoadError, top_k_ids
from mnv3.loadtest import ServerProcess, parse_metrics
from mnv3.photos import load_images
from mnv3.preprocess import decode_image, preprocess
from mnv3.server import AccessFormatter, raise_open_file_limit, uvicorn_log_config
from mnv3.thread_cpu import EVENT_LOOP, INFERENCE, PREPROCESS, ROLES

pytestmark = pytest.mark.integration

UPLOAD_LIMIT = 1_000_000
PIXEL_LIMIT = 1_000_000


@pytest.fixture(scope="module")
def client(fp32_model_path):
    with serving_client(
        fp32_model_path,
        max_batch_size=8,
        batch_window_ms=100,
        cache_size=64,
        max_upload_bytes=UPLOAD_LIMIT,
        max_pixels=PIXEL_LIMIT,
    ) as client:
        yield client


@pytest.fixture(scope="module")
def images():
    return load_images(12, seed=3)


def png(size, mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def test_predict_multipart_and_raw_body(client, images, fp32_model_dir):
    names = json.loads((fp32_model_dir / CLASS_NAMES_JSON).read_text())
    multipart = post_file(client, images[0])
    assert multipart.status_code == 200, multipart.text
    body = multipart.json()
    assert body["model"].startswith("fp32.onnx:") and len(body["model"].split(":")[1]) == 12
    assert body["name"] == "fp32"  # the file's stem, without NAME= (GET /models lists it)
    assert len(body["predictions"]) == 5
    assert [p["label"] for p in body["predictions"]] == [names[p["class_id"]] for p in body["predictions"]]
    probabilities = [p["probability"] for p in body["predictions"]]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < probabilities[0] <= 1
    assert body["cache_hit"] is False and body["batch_size"] == 1
    assert all(body[k] >= 0 for k in ("queue_ms", "preprocess_ms", "inference_ms")) and body["inference_ms"] > 0

    raw = post_raw(client, images[1])
    assert raw.status_code == 200, raw.text
    assert raw.json()["cache_hit"] is False


def test_second_identical_request_is_a_cache_hit(client, images):
    first, second = post_file(client, images[2]).json(), post_raw(client, images[2]).json()
    assert (first["cache_hit"], second["cache_hit"]) == (False, True)
    assert second["predictions"] == first["predictions"]
    assert second["batch_size"] == 0 and second["inference_ms"] == 0


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(client, images, fp32_model_path):
    distinct = images[4:12]
    with ThreadPoolExecutor(len(distinct)) as pool:
        responses = list(pool.map(lambda data: post_file(client, data), distinct))
    assert all(r.status_code == 200 for r in responses)
    bodies = [r.json() for r in responses]
    assert max(b["batch_size"] for b in bodies) > 1

    engine = Engine.load(fp32_model_path)
    for data, body in zip(distinct, bodies, strict=True):
        alone = engine.predict(preprocess(decode_image(data))[None])[0]
        assert body["predictions"][0]["class_id"] == int(alone.argmax())
        for p in body["predictions"]:
            assert p["probability"] == pytest.approx(float(alone[p["class_id"]]), rel=1e-4)


@pytest.mark.parametrize(
    "send, status, message",
    [
        (lambda c, jpeg: post_raw(c, b""), 400, "empty body"),
        (lambda c, jpeg: post_raw(c, b"hello, world", "image/png"), 400, "not a recognised image"),
        (lambda c, jpeg: post_file(c, jpeg[: len(jpeg) // 2]), 400, "truncated"),
        (lambda c, jpeg: post_file(c, jpeg, field="image"), 400, "'file'"),
        (lambda c, jpeg: post_raw(c, b"--x\r\n", "multipart/form-data"), 400, "multipart"),
        (lambda c, jpeg: post_raw(c, jpeg, None), 415, "content type"),
        (lambda c, jpeg: post_raw(c, jpeg, "text/plain"), 415, "content type"),
        (lambda c, jpeg: post_raw(c, bytes(UPLOAD_LIMIT + 1)), 413, "over the limit"),
        (lambda c, jpeg: post_raw(c, iter([bytes(UPLOAD_LIMIT // 2)] * 3)), 413, "over the limit"),  # chunked
        (lambda c, jpeg: post_file(c, png((1200, 1000), "L")), 413, "pixels"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(client, images, send, status, message):
    response = send(client, images[3])
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert post_file(client, images[3]).status_code == 200


def test_head_answers_as_get_on_every_get_endpoint(client):
    # uptime checks and load balancers probe with HEAD (curl -I too); FastAPI's GET routes answered 405
    for path in ("/healthz", "/readyz", "/model", "/models", "/metrics", "/stats", "/", "/v2", "/v2/health/ready"):
        head, get = client.head(path), client.get(path)
        assert head.status_code == get.status_code == 200, path
        assert head.headers.get("content-type") == get.headers.get("content-type"), path
    assert client.head("/predict").status_code == 405  # a POST route stays one


def test_get_answers_say_what_a_cache_may_keep(client, images):
    # None said anything: a CDN's default lifetime could serve a key holder's /stats or /metrics to anyone,
    # and a browser its heuristic copy of an upgraded server's page.js.
    for path in ("/healthz", "/readyz", "/model", "/models", "/metrics", "/stats", "/v2", "/v2/models/fp32", "/nope"):
        assert client.get(path).headers["cache-control"] == "no-store", path
        assert client.head(path).headers["cache-control"] == "no-store", path
    for path in ("/", "/static/page.js", "/static/page.css", "/static/favicon.svg"):
        assert client.get(path).headers["cache-control"] == "no-cache", path  # kept, revalidated by ETag
    etag = client.get("/static/page.js").headers["etag"]
    unchanged = client.get("/static/page.js", headers={"If-None-Match": etag})
    assert unchanged.status_code == 304 and "cache-control" not in unchanged.headers  # the copy keeps its no-cache
    assert "cache-control" not in post_file(client, images[0]).headers  # a POST's answer is kept by no cache


def test_operational_endpoints(client, fp32_model_path):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    info = client.get("/model").json()
    assert info["file"] == "fp32.onnx" and info["variant"] == "fp32"
    assert info["input_shape"][1:] == [3, 224, 224] and info["providers"] == ["CPUExecutionProvider"]
    assert info["batching"]["max_batch_size"] == 8 and info["cache"]["size"] == 64
    # onnxruntime runs a batch on the intra-op threads too (--batch-threads is OpenVINO's)
    assert info["threads"] == {"intra_op": 2, "inter_op": 1, "batch": 2, "preprocess": 2}
    assert info["ort_spinning"] is False
    assert info["weights"] == "unknown"  # the fixture has no manifest to say where its weights came from
    # torchvision's preprocessing: the fixture's manifest records none, so the engine takes the default
    assert info["preprocessing"] == {
        "resize": 256,
        "crop": 224,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "jpeg_draft": True,
        "resize_crop_only": True,
    }

    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        # from a cache hit's scale to past --body-timeout-s (prometheus_client's default: 5 ms to 10 s)
        'mnv3_request_latency_seconds_bucket{le="0.00025"}',
        'mnv3_request_latency_seconds_bucket{le="60.0"}',
        'mnv3_queue_wait_seconds_bucket{le="0.00025"}',
        "mnv3_queue_wait_seconds_count",
        "mnv3_preprocess_seconds_sum",
        "mnv3_inference_seconds_count",
        'mnv3_batch_size_bucket{le="128.0"}',
        "mnv3_cache_hits_total",
        "mnv3_cache_misses_total",
        "mnv3_cache_entries",
        "mnv3_queue_depth",
        "mnv3_in_flight 0.0",
        "mnv3_dropped_total 0.0",
        'mnv3_rejections_total{reason="queue_full"}',
        'mnv3_rejections_total{reason="busy"}',
        'mnv3_rejections_total{reason="slow_upload"}',
        "process_cpu_seconds_total",  # the standard process series, which load tests divide per request
        "process_resident_memory_bytes",
    ):
        assert name in metrics.text

    assert client.get("/docs").status_code == 200
    document = client.get("/openapi.json").json()
    predict_doc = document["paths"]["/predict"]["post"]
    assert {"200", "400", "408", "413", "415", "500", "503", "504"} <= set(predict_doc["responses"])
    assert {"multipart/form-data", "image/*", "application/octet-stream"} <= set(predict_doc["requestBody"]["content"])
    # No request gets FastAPI's 422 (every parameter is a string): the document does not promise one.
    assert all("422" not in op["responses"] for ops in document["paths"].values() for op in ops.values())
    assert "499" not in predict_doc["responses"]  # counted, never sent: its client has gone
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_the_api_document_gives_the_package_version(fp32_model_path, monkeypatch):
    """/openapi.json's version is the installed package's, as GET /v2's is (FastAPI's default is 0.1.0,
    which pyproject.toml's version happens to equal, hence another version here)."""
    monkeypatch.setattr(mnv3.server, "__version__", "9.8.7")
    app = mnv3.server.create_app(parse_args(["--model", str(fp32_model_path)]))
    assert app.openapi()["info"]["version"] == "9.8.7"


def test_a_shutdown_delay_serves_on_with_readyz_503_before_the_port_closes(fp32_model_path, images):
    """SIGTERM closed the port at once: a load balancer still sending for a moment (Kubernetes removes the
    endpoint while it signals the pod) found no one listening, and /readyz never answered 503."""
    server = ServerProcess(fp32_model_path, shutdown_delay_s=3)
    with server as url:
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: requests.get(url + "/readyz", timeout=WAIT_S).status_code == 503, "/readyz to say 503")
        assert requests.get(url + "/readyz", timeout=WAIT_S).json() == {"status": "shutting down"}
        assert requests.get(url + "/v2/health/ready", timeout=WAIT_S).status_code == 503
        for model_ready in ("/v2/models/fp32/ready", "/v2/models/fp32/versions/1/ready"):  # tritonclient's probe
            answer = requests.get(url + model_ready, timeout=WAIT_S)
            assert answer.status_code == 503 and answer.json() == {"error": "shutting down"}
        assert post(url, images[0]).status_code == 200  # still served, on a new connection
        assert server.process.wait(WAIT_S) == 0 and time.monotonic() - signalled >= 3
    second = ServerProcess(fp32_model_path, shutdown_delay_s=60)
    with second:
        signalled = time.monotonic()
        second.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        second.process.send_signal(signal.SIGTERM)  # a second one stops it now
        assert second.process.wait(WAIT_S) == 0 and time.monotonic() - signalled < 30


def test_ctrl_c_stops_the_server_with_exit_0_and_no_traceback(fp32_model_path):
    server = ServerProcess(fp32_model_path)
    with server:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(WAIT_S) == 0
        assert "Traceback" not in server.output_tail()


def test_the_cpu_seconds_by_role_never_go_down_from_one_reading_to_the_next():
    """engine_and_other (the process's time less its threads') also held what threads burnt while they were read,
    and gave it back at the next reading: the counter went down in about half of the scrapes of a server at rest,
    which Prometheus reads as a reset."""
    from mnv3.metrics import Metrics
    from mnv3.thread_cpu import PREPROCESS_THREADS

    metrics = Metrics(["m"], lambda: 0, {threading.get_ident(): EVENT_LOOP})  # what reads is the event loop
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    busy = [threading.Thread(target=spin, name=f"{PREPROCESS_THREADS}_{i}") for i in range(2)]
    for thread in busy:
        thread.start()
    try:
        readings = [metrics.thread_cpu_seconds() for _ in range(300)]
    finally:
        stop.set()
        for thread in busy:
            thread.join()
    for role in ROLES:
        went_down = [i for i in range(1, len(readings)) if readings[i][role] < readings[i - 1][role]]
        assert not went_down, (role, len(went_down))


def test_metrics_split_the_server_cpu_by_what_its_threads_do(fp32_model_path, images):
    """Misses decode on the preprocess threads and run on the inference thread; hits do neither, only the
    event loop's HTTP work: the split says so, and it adds up to the process's CPU time."""

    def cpu(client) -> dict[str, float]:
        return {
            role: value
            for (name, role), value in parse_metrics(client.get("/metrics").text).items()
            if name == "mnv3_thread_cpu_seconds_total"
        }

    with serving_client(fp32_model_path) as client:
        before = cpu(client)
        for image in images:  # misses
            assert post_file(client, image).json()["cache_hit"] is False
        misses = cpu(client)
        for _ in range(5):  # hits
            for image in images:
                assert post_file(client, image).json()["cache_hit"] is True
        hits = cpu(client)
        process_s = parse_metrics(client.get("/metrics").text)[("process_cpu_seconds_total", "")]

    assert set(before) == set(ROLES)
    assert all(misses[role] > before[role] for role in (EVENT_LOOP, PREPROCESS, INFERENCE))
    # a hit decodes nothing and runs nothing: at most the tail of the last miss's work after its answer (once
    # 16 us on the inference thread), where one decode or inference of these photos takes milliseconds
    assert all(0 <= hits[role] - misses[role] < 0.001 for role in (PREPROCESS, INFERENCE)), (misses, hits)
    assert hits[EVENT_LOOP] > misses[EVENT_LOOP]
    # process_cpu_seconds_total counts in the OS's clock ticks (10 ms), read a moment later
    assert sum(hits.values()) == pytest.approx(process_s, abs=0.05)


def test_full_queue_gives_503_with_retry_after(fp32_model_path, images):
    with (
        serving_client(fp32_model_path, max_batch_size=1, queue_limit=1, cache_size=0) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        serving = client.app.state.serving
        gate = Gate(serving.engine)
        running = gate.hold(pool, post_file, client, images[0])
        queued = pool.submit(post_file, client, images[1])
        wait_until(lambda: serving.batcher.depth == 1, "the second request to queue")
        refused = post_file(client, images[2])
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "queue full" in refused.json()["detail"]
        gate.release.set()
        assert running.result().status_code == queued.result().status_code == 200
        assert 'mnv3_rejections_total{reason="queue_full"} 1.0' in client.get("/metrics").text


def test_deadline_gives_504_and_drops_work_not_yet_run(fp32_model_path, images):
    with (
        serving_client(fp32_model_path, max_batch_size=1, deadline_ms=300, cache_size=0) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        gate = Gate(client.app.state.serving.engine)
        running = gate.hold(pool, post_file, client, images[0])
        queued = pool.submit(post_file, client, images[1])
        assert running.result().status_code == queued.result().status_code == 504
        assert "deadline" in queued.result().json()["detail"]
        gate.release.set()
        assert post_file(client, images[2]).status_code == 200
        assert gate.batch_sizes == [1, 1]  # the first and the last: the expired queued request never ran
        assert client.app.state.serving.batcher.dropped == 1


class FailingSession:
    """An onnxruntime session whose `fail_call`-th run gets float64 input: a real ORT error, for that batch only."""

    def __init__(self, session, fail_call: int):
        self.session, self.fail_call, self.calls = session, fail_call, 0

    def run(self, outputs, feeds):
        self.calls += 1
        if self.calls == self.fail_call:
            feeds = {name: array.astype(np.float64) for name, array in feeds.items()}
        return self.session.run(outputs, feeds)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_onnxruntime_error_fails_only_its_batch_and_the_server_serves_on(fp32_model_path, images, caplog):
    with (
        serving_client(fp32_model_path, max_batch_size=4, batch_window_ms=100, cache_size=0) as client,
        ThreadPoolExecutor(3) as pool,
    ):
        engine = client.app.state.serving.engine
        gate = Gate(engine)
        engine.session = FailingSession(engine.session, fail_call=2)
        alone = gate.hold(pool, post_file, client, images[0])  # batch 1, held open while batch 2 queues
        together = [pool.submit(post_file, client, data) for data in images[1:3]]
        wait_until(lambda: client.app.state.serving.batcher.depth == 2, "batch 2 to queue")
        gate.release.set()
        assert alone.result().status_code == 200
        for failed in together:
            assert failed.result().status_code == 500
            assert "onnxruntime failed on a batch of 2" in failed.result().json()["detail"]
        assert gate.batch_sizes == [1, 2]
        assert post_file(client, images[3]).status_code == 200
        # The operator sees it: one ERROR line for the batch, and the failures counted.
        failures = [r for r in caplog.records if r.levelname == "ERROR" and "failed on a batch" in r.getMessage()]
        assert len(failures) == 1 and "a batch of 2 images: each request in it gets 500" in failures[0].getMessage()
        assert 'mnv3_rejections_total{reason="inference_failed"} 2.0' in client.get("/metrics").text


def test_an_inference_failure_is_not_handed_to_followers_of_the_same_image(fp32_model_path, images):
    # Only the batch that failed fails: requests for the same image that waited on it compute again (they had
    # all got the leader's 500).
    with (
        serving_client(fp32_model_path, max_batch_size=1, cache_size=8) as client,
        ThreadPoolExecutor(3) as pool,
    ):
        engine = client.app.state.serving.engine
        gate = Gate(engine)
        engine.session = FailingSession(engine.session, fail_call=1)
        leader = gate.hold(pool, post_file, client, images[0])
        followers = [pool.submit(post_file, client, images[0]) for _ in range(2)]
        wait_until(lambda: client.app.state.serving.in_flight == 3, "the followers to wait for the leader")
        gate.release.set()
        assert leader.result().status_code == 500
        answers = [follower.result() for follower in followers]
        assert [answer.status_code for answer in answers] == [200, 200]
        assert sorted(answer.json()["cache_hit"] for answer in answers) == [False, True]  # one computed, one shared
        assert gate.batch_sizes == [1, 1]
        assert 'mnv3_rejections_total{reason="inference_failed"} 1.0' in client.get("/metrics").text


class ChangedOutput:
    """An onnxruntime session whose output (the logits) `change` turns into something else."""

    def __init__(self, session, change):
        self.session, self.change = session, change

    def run(self, outputs, feeds):
        return [self.change(self.session.run(outputs, feeds)[0])]

    def __getattr__(self, name):
        return getattr(self.session, name)


def nan_in_the_last_of_two(logits):
    if len(logits) == 2:
        logits[-1, 7] = np.nan
    return logits


def test_a_non_finite_output_is_a_500_for_its_image_alone_and_never_cached(fp32_model_path, images, caplog):
    # A NaN logit was answered 200 with null probabilities, cached, and served so again until evicted.
    with (
        serving_client(fp32_model_path, max_batch_size=2, batch_window_ms=100, cache_size=8) as client,
        ThreadPoolExecutor(3) as pool,
    ):
        engine = client.app.state.serving.engine
        gate = Gate(engine)
        engine.session = ChangedOutput(engine.session, nan_in_the_last_of_two)
        alone = gate.hold(pool, post_file, client, images[0])
        together = {data: pool.submit(post_file, client, data) for data in images[1:3]}
        wait_until(lambda: client.app.state.serving.batcher.depth == 2, "a batch of 2 to queue")
        gate.release.set()
        assert alone.result().status_code == 200
        answers = {data: answer.result() for data, answer in together.items()}
        assert gate.batch_sizes == [1, 2]
        assert sorted(answer.status_code for answer in answers.values()) == [200, 500]
        (failed,) = [data for data, answer in answers.items() if answer.status_code == 500]
        assert "output for this image is not finite" in answers[failed].json()["detail"]
        again = post_file(client, failed)  # alone now, so finite: computed, not the failure
        assert again.status_code == 200 and again.json()["cache_hit"] is False
        assert 'mnv3_rejections_total{reason="inference_failed"} 1.0' in client.get("/metrics").text
        assert [r.getMessage() for r in caplog.records if "is not finite" in r.getMessage()] == [
            f"model {client.app.state.serving.model(None).name}: its output for an image is not finite "
            "(NaN or infinite logits): answered 500"
        ]


def test_identical_requests_waiting_on_a_non_finite_output_share_its_500(fp32_model_path, images):
    # Each took over from the one before and ran the image again, one after another, to the same NaN.
    with (
        serving_client(fp32_model_path, max_batch_size=1, cache_size=8) as client,
        ThreadPoolExecutor(3) as pool,
    ):
        engine = client.app.state.serving.engine
        gate = Gate(engine)
        engine.session = ChangedOutput(engine.session, lambda logits: logits * np.nan)
        leader = gate.hold(pool, post_file, client, images[0])
        followers = [pool.submit(post_file, client, images[0]) for _ in range(2)]
        wait_until(lambda: client.app.state.serving.in_flight == 3, "the followers to wait for the leader")
        gate.release.set()
        for answer in (leader, *followers):
            assert answer.result().status_code == 500 and "not finite" in answer.result().json()["detail"]
        assert gate.batch_sizes == [1]  # computed once
        assert post_file(client, images[0]).status_code == 500 and gate.batch_sizes == [1, 1]  # and not cached


def test_an_engine_call_that_does_not_return_turns_the_probes_503_until_it_does(
    fp32_model_path, images, caplog, monkeypatch
):
    # A hung runtime left every probe at 200 while both models' requests timed out behind it (one lock). A call
    # that is merely past the requests' deadline (a busy server) is no reason to restart it.
    config = ServerConfig(
        model=f"a={fp32_model_path}", extra_models=(f"b={fp32_model_path}",), deadline_ms=200, cache_size=0
    )
    with TestClient(mnv3.server.create_app(config)) as client, ThreadPoolExecutor(1) as pool:
        wait_until(lambda: client.get("/readyz").status_code == 200, "warm-up")
        gate = Gate(client.app.state.serving.model("a").engine)
        held = gate.hold(pool, post_file, client, images[0])
        assert held.result().status_code == 504  # its deadline passed while the call ran
        assert client.get("/healthz").status_code == client.get("/readyz").status_code == 200
        monkeypatch.setattr(mnv3.serving, "STUCK_AFTER_S", 0.5)  # instead of minutes
        wait_until(lambda: client.get("/readyz").status_code == 503, "/readyz to say the engine looks hung")
        hung = "model a's engine has not returned from a call for "
        assert client.get("/readyz").json()["status"].startswith(hung)
        assert client.get("/healthz").status_code == 503 and client.get("/healthz").json()["status"].startswith(hung)
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/a/ready", "/v2/models/b/ready"):
            answer = client.get(path)
            assert answer.status_code == 503 and answer.json()["error"].startswith(hung), path
        gate.release.set()
        wait_until(lambda: client.get("/readyz").status_code == 200, "/readyz to be 200 once the call returned")
        assert client.get("/healthz").status_code == client.get("/v2/models/b/ready").status_code == 200
    said = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "mnv3.serving" and "call" in r.getMessage()
    ]
    assert len(said) == 2 and said[0][0] == "ERROR" and said[0][1].startswith(hung)  # once, however many probes
    assert said[0][1].endswith(": it looks hung")
    assert said[1][0] == "WARNING" and said[1][1].startswith("model a: a call into its engine returned after ")


def test_debug_logs_a_line_a_batch(fp32_model_path, images, caplog):
    with serving_client(fp32_model_path, cache_size=0) as client:
        name = client.app.state.serving.model(None).name
        with caplog.at_level(logging.INFO, logger="mnv3.serving"):
            assert post_file(client, images[0]).status_code == 200
        assert not [r for r in caplog.records if "a batch of" in r.getMessage()]  # info: the access log only
        with caplog.at_level(logging.DEBUG, logger="mnv3.serving"):
            for data in images[:2]:
                assert post_file(client, data).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "a batch of" in r.getMessage()]
        assert len(lines) == 2 and all(
            re.fullmatch(rf"model {name}: a batch of 1, inference \d+\.\d ms", line) for line in lines
        )


def test_debug_is_the_servers_own_not_every_librarys(fp32_model_path):
    # Pillow wrote a debug line per chunk of every PNG uploaded
    png = io.BytesIO()
    Image.new("RGB", (64, 48), "teal").save(png, "PNG")
    server = ServerProcess(fp32_model_path, log_level="debug")
    with server as url:
        assert requests.post(url + "/predict", files={"file": ("a.png", png.getvalue(), "image/png")}).ok
        wait_until(lambda: "a batch of 1" in server.output_tail(), "the batch's debug line")
        debug = [line for line in server.output_tail(1000).splitlines() if " DEBUG " in line]
    assert debug and all(" DEBUG mnv3." in line for line in debug), debug


def test_every_log_line_gives_its_time_with_the_zone(fp32_model_path, monkeypatch):
    # logging's default time (2026-12-06 17:14:44,123) named no zone: read elsewhere, a line was hours off
    monkeypatch.setenv("TZ", "EST+5")  # the server's zone, 5 hours behind UTC all year
    server = ServerProcess(fp32_model_path, log_level="info")
    with server as url:
        assert requests.get(url + "/healthz", timeout=WAIT_S).ok
        wait_until(lambda: "GET /healthz" in server.output_tail(), "the access-log line")
        lines = server.output_tail(1000).splitlines()
    zoned = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}-05:00 INFO "
    for logger in ("mnv3.", "uvicorn.error:", "uvicorn.access:"):  # the server's own, uvicorn's lifecycle, its access
        logged = [line for line in lines if f" INFO {logger}" in line]
        assert logged and all(re.match(zoned, line) for line in logged), (logger, lines)


@pytest.mark.parametrize("trusted", ["", "10.0.0.1"])
def test_behind_a_proxy_the_docs_carry_its_prefix_and_the_log_its_client(fp32_model_path, trusted):
    # A reverse proxy on 127.0.0.1 serving the app under /mnv3 and stripping it: the page's URLs are relative,
    # the API docs' need the prefix; the client's address comes from X-Forwarded-For if the proxy is trusted.
    server = ServerProcess(fp32_model_path, log_level="info", root_path="/mnv3", forwarded_allow_ips=trusted or None)
    with server as url:
        docs = requests.get(url + "/docs", timeout=WAIT_S).text
        assert "url: '/mnv3/openapi.json'" in docs and 'src="/mnv3/docs/swagger-ui-bundle.js"' in docs
        assert requests.get(url + "/openapi.json", timeout=WAIT_S).json()["servers"] == [{"url": "/mnv3"}]
        assert requests.get(url + "/healthz", headers={"X-Forwarded-For": "203.0.113.8"}, timeout=WAIT_S).ok
        wait_until(
            lambda: "GET /mnv3/healthz" in server.output_tail(), "the access-log line"
        )  # the path as the client asked
        client = "203.0.113.8" if not trusted else "127.0.0.1"  # by default uvicorn trusts 127.0.0.1 only
        assert f"{client}:" in next(line for line in server.output_tail().splitlines() if "GET /mnv3/healthz" in line)


def run_server(*args):
    return subprocess.run([sys.executable, "-m", "mnv3.server", *args], capture_output=True, text=True, timeout=WAIT_S)


def test_missing_model_exits_2_with_one_line(tmp_path):
    result = run_server("--model", str(tmp_path / "nonexistent.onnx"), "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not found" in result.stderr
    assert result.stderr.startswith("python -m mnv3.server: error: ")
    # started as the package's command, its errors say so (they said python -m mnv3.server)
    command = Path(sys.executable).parent / "mnv3-serve"
    for args in (["--port", "x"], ["--model", str(tmp_path / "nonexistent.onnx"), "--port", "0"]):
        result = subprocess.run([command, *args], capture_output=True, text=True, timeout=WAIT_S)
        assert result.returncode == 2 and result.stderr.startswith("mnv3-serve: error: "), result.stderr


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("static_int8.onnx", "stage 2 writes it: run python static_quantization.py --artifacts-dir {folder}"),
        (
            "nncf_rewritten_full_int8.xml",
            "stage 2 writes it: run python static_quantization.py --artifacts-dir {folder}",
        ),
        (
            "recipes/qdq_minmax.onnx",
            "stage 2 writes it with --compare-recipes: run python static_quantization.py --artifacts-dir {folder} "
            "--compare-recipes",
        ),
        ("fp32.onnx", "stage 1 writes it: run python baseline_export_quantize.py --artifacts-dir {folder} (with the "),
        # a mistyped name beside stage 1's models was said to be stage 2's, whose rerun would not write it either
        ("fp23.onnx", "if one of this project's stages wrote it, rerun that stage"),
    ],
)
def test_a_missing_model_names_the_stage_that_writes_it_and_the_models_beside_it(tmp_path, fp32_model_path, name, says):
    # e.g. after stage 1 on a new model removed stage 2's builds (and said so): the stages name it, the server did not
    (tmp_path / "recipes").mkdir()
    (tmp_path / "fp32.onnx").write_bytes(fp32_model_path.read_bytes())
    (tmp_path / "manifest.json").write_text("{}")
    if name == "fp32.onnx":
        (tmp_path / name).unlink()
    with pytest.raises(ModelLoadError) as refused:
        Engine.load(tmp_path / name)
    folder = (tmp_path / name).parent
    beside = f" (the models in {folder}: fp32.onnx)" if folder == tmp_path and name != "fp32.onnx" else ""
    assert str(refused.value).startswith(
        f"model file {tmp_path / name} not found{beside}: {says.format(folder=tmp_path)}"
    )


def test_a_port_in_use_exits_2_with_one_line_before_loading_the_models(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a missing model would be its own error: the port is checked first, before any model loads
        result = run_server("--model", str(tmp_path / "nonexistent.onnx"), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"python -m mnv3.server: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "pick another --port (or --host)"
    )


def test_model_reports_the_predictions_an_answer_carries_when_top_k_exceeds_the_classes(fp32_model_path, images):
    with serving_client(fp32_model_path, top_k=5000) as client:
        reported = client.get("/model").json()["top_k"]
        answered = len(post_file(client, images[0]).json()["predictions"])
    assert reported == answered == 1000  # every class, not the 5000 asked for


def test_a_model_name_with_a_slash_is_named_as_the_problem(fp32_model_path):
    result = run_server("--model", f"bad/name={fp32_model_path}", "--port", "0")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert result.stderr.strip().endswith("not found; if 'bad/name' is its name, a model name cannot contain '/'")


def test_a_folder_as_the_model_exits_2_naming_the_model_files_in_it(tmp_path):
    (tmp_path / "fp32.onnx").write_bytes(b"")
    (tmp_path / "manifest.json").write_text("{}")
    result = run_server("--model", str(tmp_path), "--port", "0")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"python -m mnv3.server: error: {tmp_path} is a folder: pass a model file in it (fp32.onnx)"
    )


def test_corrupt_model_exits_2_with_one_line_naming_the_stage_that_remakes_it(tmp_path):
    (tmp_path / "corrupt.onnx").write_bytes(b"this is not a protobuf")
    result = run_server("--model", str(tmp_path / "corrupt.onnx"), "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a loadable ONNX model" in result.stderr
    assert result.stderr.strip().endswith("if one of this project's stages wrote it, rerun that stage")


@pytest.mark.parametrize(("name", "stage"), [("fp32.onnx", "stage 1"), ("static_int8.onnx", "stage 2")])
def test_a_stage_model_cut_short_names_the_stage_and_folder_that_remake_it(tmp_path, name, stage):
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / name).write_bytes(b"\x08\x07\x12")  # the first bytes of a protobuf, the rest never written
    with pytest.raises(ModelLoadError) as refused:
        Engine.load(tmp_path / name, "onnxruntime")
    assert str(refused.value).startswith(f"{tmp_path / name} is not a loadable ONNX model (")
    assert f"{stage} writes it: run python " in str(refused.value)
    assert f" --artifacts-dir {tmp_path}" in str(refused.value)


@pytest.mark.parametrize("text", ['{"weights": "random-init"', "[]"])
def test_a_manifest_cut_short_or_not_a_record_exits_2_with_one_line(fp32_model_dir, tmp_path, text):
    shutil.copy(fp32_model_dir / "fp32.onnx", tmp_path / "fp32.onnx")
    (tmp_path / "manifest.json").write_text(text)  # was json's traceback
    result = run_server("--model", str(tmp_path / "fp32.onnx"), "--port", "0")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert f"error: {tmp_path}/manifest.json " in result.stderr
    assert result.stderr.strip().endswith("stages 1 and 2 write it; remove it and rerun them")


@pytest.mark.parametrize("backend", ["onnxruntime", "auto"])
def test_engine_load_refuses_a_manifest_cut_short_with_its_own_error_under_either_backend(
    fp32_model_dir, tmp_path, backend
):
    shutil.copy(fp32_model_dir / "fp32.onnx", tmp_path / "fp32.onnx")
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="manifest.json holds a JSON list"):  # auto: UnreadableManifest
        Engine.load(tmp_path / "fp32.onnx", backend)


def test_a_model_built_before_class_names_json_keeps_its_labels(fp32_model_dir, tmp_path):
    # Stage 1 wrote imagenet_classes.json (its manifest names it) before the file was renamed: the new server
    # served such a model as class_<id>.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(fp32_model_dir / "fp32.onnx", model_dir / "fp32.onnx")
    manifest = {"fp32": {"path": "fp32.onnx", "class_names": "imagenet_classes.json"}}  # as stage 1 wrote it
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    names = [f"old name {i}" for i in range(1000)]
    (model_dir / "imagenet_classes.json").write_text(json.dumps(names))
    assert Engine.load(model_dir / "fp32.onnx").class_names == names
    # a name beside the model, never a path: a file outside its folder is not read
    (tmp_path / "imagenet_classes.json").write_text(json.dumps(names))
    manifest["fp32"]["class_names"] = "../imagenet_classes.json"
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    assert Engine.load(model_dir / "fp32.onnx").class_names == []


def test_engine_predict_refuses_an_array_other_than_a_preprocessed_batch(fp32_model_path):
    engine = Engine.load(fp32_model_path)
    good = np.zeros((2, 3, 224, 224), np.float32)
    assert engine.predict(good).shape == (2, 1000) and engine.predict(good[:0]).shape == (0, 1000)
    for wrong_shape in (good[0], good[:, :, :200], good[..., None]):
        with pytest.raises(ValueError, match=r"a batch of shape \(N, 3, 224, 224\), got"):
            engine.predict(wrong_shape)  # (3, 224, 224) was "onnxruntime failed on a batch of 3"
    for wrong_type in (good.astype(np.float64), good.astype(np.uint8), good.tolist()):
        with pytest.raises(TypeError, match="float32 numpy array"):
            engine.predict(wrong_type)  # OpenVINO answered a uint8 batch


@pytest.mark.parametrize(
    "reshape, shape",
    [
        (lambda out: out[:1], "(1, 1000)"),
        (lambda out: out[:, :10], "(2, 10)"),
        (lambda out: out[..., None], "(2, 1000, 1)"),
    ],
)
def test_engine_predict_refuses_output_out_of_shape(fp32_model_path, reshape, shape):
    # Rows go to requests by position: one row for two images, or 10 classes for 1000, was answered 200.
    engine = Engine.load(fp32_model_path)
    engine.session = ChangedOutput(engine.session, reshape)
    with pytest.raises(InferenceError, match=re.escape(f"with output of shape {shape}, not (2, 1000)")):
        engine.predict(np.zeros((2, 3, 224, 224), np.float32))


def test_engine_predict_gives_finite_probabilities_for_large_logits(fp32_model_path):
    # The softmax shifts by each row's largest logit: exp(1000) alone overflows, and the image would get a 500.
    engine = Engine.load(fp32_model_path)
    engine.session = ChangedOutput(engine.session, lambda logits: logits + 1000)
    probabilities = engine.predict(np.zeros((2, 3, 224, 224), np.float32))
    assert np.isfinite(probabilities).all() and np.allclose(probabilities.sum(axis=1), 1)


def test_a_pytorch_checkpoint_as_the_model_exits_2_saying_to_export_it(tmp_path):
    (tmp_path / "model_29.pth").write_bytes(b"PK\x03\x04 a zip, as torch.save writes")
    result = run_server("--model", str(tmp_path / "model_29.pth"), "--port", "0")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert (
        "is a PyTorch checkpoint" in result.stderr and "python baseline_export_quantize.py --weights" in result.stderr
    )


def test_wrong_input_shape_exits_2_with_one_line(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    tensor = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["logits"])],
        "tiny",
        [tensor("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [tensor("logits", TensorProto.FLOAT, ["batch", 3, 32, 32])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "tiny.onnx")
    result = run_server("--model", str(tmp_path / "tiny.onnx"), "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "expected [batch, 3, 224, 224]" in result.stderr
    assert "Uvicorn running" not in result.stderr + result.stdout  # refused before the port was bound
    # a model copied without its manifest: the error says so, and what to copy
    assert "with no manifest.json beside it (copy stage 1's there)" in result.stderr


def test_flags_override_environment():
    environ = {"MNV3_MODEL": "m.onnx", "MNV3_CACHE_SIZE": "0", "MNV3_BATCH_WINDOW_MS": "5"}
    config = parse_args(["--batch-window-ms", "7"], environ)
    assert (str(config.model), config.cache_size, config.batch_window_ms, config.max_batch_size) == (
        "m.onnx",
        0,
        7.0,
        32,
    )
    with pytest.raises(SystemExit):
        parse_args(["--model", "m.onnx", "--max-batch-size", "0"], {})


def test_a_cache_entry_costs_about_a_kilobyte():
    """The cache is bounded in entries, not bytes: this measurement is what makes that a memory bound.
    An entry is its key and a Classified of top_k Predictions (labels are shared with the engine)."""
    import asyncio
    import tracemalloc

    from mnv3.cache import ResultCache
    from mnv3.engine import Prediction
    from mnv3.serving import Classified

    entries, labels = 500, [f"class name {i}" for i in range(5)]

    async def fill():
        cache = ResultCache(entries, "static_int8.onnx:0123456789ab")
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(entries):

            async def compute():
                return Classified([Prediction(j, labels[j], 0.1 * j) for j in range(5)], 8, 1.0, 2.0, 3.0)

            await cache.get_or_compute(i.to_bytes(8, "little"), compute)
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / entries
        tracemalloc.stop()
        return per_entry, len(cache)

    per_entry, stored = asyncio.run(fill())
    assert stored == entries and 500 < per_entry < 2048  # so the default 1024 entries stay near a megabyte


def test_ort_spinning_is_off_by_default_and_a_flag_turns_it_on():
    assert parse_args(["--model", "m.onnx"], environ={}).ort_spinning == 0
    assert parse_args(["--model", "m.onnx", "--ort-spinning", "1"], environ={}).ort_spinning == 1
    assert parse_args(["--model", "m.onnx"], environ={"MNV3_ORT_SPINNING": "1"}).ort_spinning == 1


def test_corrupt_class_names_file_is_a_clear_load_error(fp32_model_path, tmp_path):
    model = tmp_path / "fp32.onnx"
    model.write_bytes(fp32_model_path.read_bytes())
    (tmp_path / CLASS_NAMES_JSON).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a JSON list of class names"):
        Engine.load(model)


def test_error_response_takes_status_and_headers_from_the_table_and_its_body_shape_from_the_caller():
    from mnv3.errors import Busy, SlowUpload, error_response

    def error_body(message):  # another router's convention, e.g. the Open Inference Protocol's
        return {"error": message}

    busy = error_response(Busy("server busy"), body=error_body)
    assert (busy.status_code, json.loads(busy.body)) == (503, {"error": "server busy"})
    # whether a refusal closes its connection depends on the body's arrival (uploads.CloseUnreadBody), not on it
    assert busy.headers["retry-after"] == "1" and "connection" not in busy.headers
    slow = error_response(SlowUpload("too slow"))
    assert (slow.status_code, json.loads(slow.body)) == (408, {"detail": "too slow"})
    assert slow.headers["connection"] == "close" and "retry-after" not in slow.headers


def test_top_k_past_the_class_count_is_all_classes_and_ties_keep_class_order(fp32_model_path):
    engine = Engine.load(fp32_model_path)
    row = np.array([0.1, 0.3, 0.1, 0.3, 0.2])  # ties as an INT8 model's quantized logits make them
    assert [p.class_id for p in engine.top_k(row, 10)] == [1, 3, 4, 0, 2]


def test_top_k_ids_is_the_head_of_a_stable_argsort_with_ties_nan_and_any_k():
    rng = np.random.default_rng(0)
    with_nan = rng.random(1000).astype(np.float32)
    with_nan[rng.choice(1000, 7, replace=False)] = np.nan
    rows = {
        "distinct": rng.random(1000).astype(np.float32),
        "quantized, many ties": (rng.integers(0, 20, 1000) / 20).astype(np.float32),
        "all equal": np.full(1000, 0.001, np.float32),
        "NaN among them": with_nan,
        "all NaN": np.full(1000, np.nan, np.float32),
        "a short row": np.array([0.1, 0.3, 0.1, 0.3, 0.2], np.float32),
    }
    for name, row in rows.items():
        for k in (0, 1, 2, 5, 8, 999, 1000, 5000):
            expected = np.argsort(-row, kind="stable")[:k]
            assert top_k_ids(row, k).tolist() == expected.tolist(), (name, k)


def test_engine_preprocesses_as_the_manifest_beside_the_model_says(fp32_model_path, tmp_path):
    from mnv3.artifacts import update_manifest
    from mnv3.preprocess import DEFAULT_PREPROCESSING, Preprocessing

    model = tmp_path / "fp32.onnx"
    model.write_bytes(fp32_model_path.read_bytes())
    assert Engine.load(model).preprocessing == DEFAULT_PREPROCESSING  # no manifest: torchvision's
    update_manifest(tmp_path, preprocessing=Preprocessing(resize=232, std=(0.2, 0.2, 0.2)).record())
    assert Engine.load(model).preprocessing == Preprocessing(resize=232, std=(0.2, 0.2, 0.2))
    update_manifest(tmp_path, preprocessing=Preprocessing(resize=160, crop=128).record())
    with pytest.raises(ModelLoadError, match=r"expected \[batch, 3, 128, 128\]"):  # exported for 224, not 128
        Engine.load(model)
    update_manifest(tmp_path, preprocessing={"resize": 256})
    with pytest.raises(ModelLoadError, match="no valid preprocessing.*rerun stage 1"):
        Engine.load(model)


def test_engine_names_its_weights_as_the_manifest_beside_the_model_records_them(fp32_model_path, tmp_path, caplog):
    from mnv3.artifacts import update_manifest

    model = tmp_path / "fp32.onnx"
    model.write_bytes(fp32_model_path.read_bytes())
    assert Engine.load(model).weights == "unknown"  # no manifest: no guess
    update_manifest(tmp_path, weights="file:0123456789ab")
    with caplog.at_level("WARNING", logger="mnv3.engine"):
        assert Engine.load(model).weights == "file:0123456789ab"
    assert "random-init" not in caplog.text
    update_manifest(tmp_path, weights="random-init")
    with caplog.at_level("WARNING", logger="mnv3.engine"):
        assert Engine.load(model).weights == "random-init"
    assert "fp32.onnx: the weights are stage 1's random-init stand-in" in caplog.text
    assert "labels it answers with mean nothing" in caplog.text


def test_model_reports_the_memory_its_engine_took_to_open_and_to_warm_up(fp32_model_path, monkeypatch):
    # Resident memory read around the engine's opening (OpenVINO compiles every batch size then) and around
    # its warm-up (onnxruntime allocates most of its buffers then): each figure is its own difference.
    opening, warming = iter([100_000_000, 130_000_000]), iter([500_000_000, 520_000_000])
    monkeypatch.setattr("mnv3.engine.rss_bytes", lambda: next(opening))
    monkeypatch.setattr("mnv3.serving.rss_bytes", lambda: next(warming))
    with serving_client(fp32_model_path) as client:
        memory = client.get("/model").json()["memory"]
    assert memory == {
        "file_bytes": fp32_model_path.stat().st_size,
        "load_rss_bytes": 30_000_000,
        "warm_up_rss_bytes": 20_000_000,
    }


@pytest.mark.parametrize(
    ("limits", "set_to"),
    [
        ((1024, 4096), (4096, 4096)),  # up to the hard limit
        ((1024, 1_048_576), (65_536, 1_048_576)),  # at most MAX_OPEN_FILES
        ((1024, "unlimited"), (65_536, "unlimited")),
        ((100_000, 1_048_576), None),  # already above the cap: never lowered
        ((8192, 8192), None),
    ],
)
def test_the_open_file_limit_is_raised_to_the_hard_one_at_most_65536_never_lowered(monkeypatch, limits, set_to):
    def real(limit):
        return resource.RLIM_INFINITY if limit == "unlimited" else limit

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: tuple(map(real, limits)))
    monkeypatch.setattr(resource, "setrlimit", lambda which, values: calls.append(values))
    raise_open_file_limit()
    assert calls == ([] if set_to is None else [tuple(map(real, set_to))])


def test_an_empty_model_name_says_to_leave_it_out(fp32_model_path):
    with serving_client(fp32_model_path) as client:
        empty, unknown = client.get("/model?model="), client.get("/model?model=nope")
    assert empty.status_code == unknown.status_code == 404
    assert (
        empty.json()["detail"]
        == "no model named ''; leave ?model= out for the default; this server serves fp32 (default fp32)"
    )
    assert unknown.json()["detail"] == "no model named 'nope'; this server serves fp32 (default fp32)"


def test_predict_refuses_a_query_parameter_it_does_not_take(fp32_model_path, images):
    # ?modle=int8 was ignored: the default model answered, as if it had been asked for
    with serving_client(fp32_model_path) as client:
        for query in ("?modle=int8", "?model=fp32&k=10"):
            answer = client.post(f"/predict{query}", files={"file": ("a.jpg", images[0], "image/jpeg")})
            name = query.split("&")[-1].lstrip("?").split("=")[0]
            assert answer.status_code == 400, query
            assert answer.json() == {"detail": f"unknown query parameter '{name}': /predict takes only ?model=NAME"}
        twice = client.post("/predict?model=nope&model=fp32", files={"file": ("a.jpg", images[0], "image/jpeg")})
        assert (twice.status_code, twice.json()) == (
            400,
            {"detail": "?model= given more than once: /predict takes one model"},  # the last one had answered
        )
        assert client.post("/predict?model=fp32", files={"file": ("a.jpg", images[0], "image/jpeg")}).status_code == 200
        assert 'mnv3_rejections_total{reason="bad_input"} 3.0' in client.get("/metrics").text


def test_an_access_line_quotes_a_forwarded_address_that_is_not_one():
    # uvicorn takes X-Forwarded-For's text as the client's address, from a trusted proxy (127.0.0.1 by default)
    # unchecked: a client could write a second, forged request line into the log.
    formatter = AccessFormatter(fmt=uvicorn_log_config()["formatters"]["access"]["fmt"], use_colors=False)

    def access_line(client: str) -> str:
        args = (client, "GET", "/healthz", "1.1", 200)
        return formatter.format(
            logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)
        )

    for address in ("127.0.0.1:53412", "::1:53412", "1.2.3.4:0"):
        assert access_line(address).endswith(f' {address} - "GET /healthz HTTP/1.1" 200 OK')
    forged = access_line('1.2.3.4 - "GET /admin HTTP/1.1" 200:0')
    assert forged.endswith(
        ' uvicorn.access: not-an-address:"1.2.3.4 - \\"GET /admin HTTP/1.1\\" 200:0" - "GET /healthz HTTP/1.1" 200 OK'
    )
    scoped = access_line('::1%"><img src=x> - "GET \\admin HTTP 1.1" 200:0')  # any scope id but / and %
    assert ' uvicorn.access: not-an-address:"::1%\\"><img' in scoped
    assert "\\t<script>" in access_line("\t<script>" + "x" * 100 + ":0")  # escaped, and cut at 64 characters
    assert "x" * 60 not in access_line("\t<script>" + "x" * 100 + ":0")


def test_the_readmes_python_example_answers_as_predict_does(fp32_model_path, capsys):
    import skimage

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("\n## From Python\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    photos = [str(Path(skimage.__file__).parent / "data" / name) for name in ("chelsea.png", "coffee.png")]
    example = example.replace('"artifacts/static_int8.onnx"', repr(str(fp32_model_path)))
    exec(example.replace('["cat.jpg", "dog.png"]', repr(photos)), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(photos)
    with serving_client(fp32_model_path) as client:
        for photo, line in zip(photos, printed, strict=True):
            answer = post_file(client, Path(photo).read_bytes()).json()["predictions"][:3]
            assert line == str([(p["label"], round(p["probability"], 4)) for p in answer])
