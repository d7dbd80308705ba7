"""A real server process with two models, driven by Triton's own client (tritonclient.http) over the Open
Inference Protocol, and by /predict: the two paths must give the same answers for the same photos."""

import gzip
import importlib.metadata
import json
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from starlette.testclient import TestClient
from tritonclient.utils import InferenceServerException

from conftest import Gate, metric, post_file, serving_client, wait_until
from mnv3.artifacts import CLASS_NAMES_JSON
from mnv3.config import ServerConfig
from mnv3.engine import InferenceError
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images
from mnv3.preprocess import decode_image, preprocess
from mnv3.server import create_app, load_engines

pytestmark = pytest.mark.integration

WAIT_S = 60
MAX_BATCH_SIZE = 8
UPLOAD_LIMIT = 8_000_000  # two 224x224 photos as JSON FP32 take ~6 MB
PROBABILITY_TOLERANCE = 1e-4  # the same model in batches of other sizes: float rounding only


@pytest.fixture(scope="module")
def server(fp32_model_path, other_model_path):
    """Two models with different answers, `large` (the default) and `small`, in one server process."""
    with ServerProcess(
        f"large={fp32_model_path}",
        extra_models=(f"small={other_model_path}",),
        max_batch_size=MAX_BATCH_SIZE,
        batch_window_ms=50,
        cache_size=64,
        max_upload_bytes=UPLOAD_LIMIT,
    ) as url:
        yield url


def triton_client(url: str) -> triton.InferenceServerClient:
    # One per thread: the client (geventhttpclient underneath) is not thread-safe.
    return triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=WAIT_S, network_timeout=WAIT_S)


@pytest.fixture(scope="module")
def client(server):
    with triton_client(server) as client:
        yield client


@pytest.fixture(scope="module")
def photos():
    return load_images(6, seed=11)


def class_names(model_path) -> list[str]:
    return json.loads((model_path.parent / CLASS_NAMES_JSON).read_text())


def predict(url: str, photo: bytes, model: str | None = None) -> requests.Response:
    return requests.post(
        url + "/predict",
        params={"model": model} if model else None,
        files={"file": ("photo.jpg", photo, "image/jpeg")},
        timeout=WAIT_S,
    )


def image_input(photos: list[bytes], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("IMAGE", [len(photos)], "BYTES")
    tensor.set_data_from_numpy(np.array(photos, dtype=object), binary_data=binary)
    return tensor


def pixels_input(pixels: np.ndarray, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("PIXELS", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels, binary_data=binary)
    return tensor


def assert_same_as_predict(url: str, model: str, photos: list[bytes], probabilities: np.ndarray) -> None:
    """Each row holds /predict's top-k for that photo: the same classes in the same order, the same values."""
    assert probabilities.shape == (len(photos), 1000)
    for photo, row in zip(photos, probabilities, strict=True):
        response = predict(url, photo, model)
        assert response.status_code == 200, response.text
        assert response.json()["name"] == model  # which served model answered, as /v2's model_name says
        top = response.json()["predictions"]
        assert [p["class_id"] for p in top] == list(np.argsort(row, kind="stable")[::-1][: len(top)])
        np.testing.assert_allclose(
            [p["probability"] for p in top], row[[p["class_id"] for p in top]], rtol=PROBABILITY_TOLERANCE
        )


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("large") and client.is_model_ready("small", "1")
    assert not client.is_model_ready("nope")
    metadata = client.get_server_metadata()
    assert metadata["version"] == importlib.metadata.version("mnv3")  # the package's, not a constant "1"
    assert {"binary_tensor_data", "classification", "model_configuration"} <= set(metadata["extensions"])
    assert "statistics" not in metadata["extensions"]  # perf_analyzer would poll /stats

    model = client.get_model_metadata("small", "1")
    assert model["name"] == "small" and model["versions"] == ["1"]
    assert {(t["name"], t["datatype"]) for t in model["inputs"]} == {("IMAGE", "BYTES"), ("PIXELS", "FP32")}
    assert model["outputs"] == [{"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, 1000]}]
    config = client.get_model_config("large")
    assert config["max_batch_size"] == MAX_BATCH_SIZE  # --max-request-images defaults to the batch size
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 50_000


@pytest.mark.parametrize("model", ["large", "small"])
def test_encoded_jpegs_in_binary_answer_as_predict_does(server, client, photos, model):
    result = client.infer(model, [image_input(photos[:4])], request_id="four photos")
    assert result.get_response()["id"] == "four photos" and result.get_response()["model_name"] == model
    assert_same_as_predict(server, model, photos[:4], result.as_numpy("PROBABILITIES"))


def test_the_two_models_answer_differently(client, photos):
    large, small = (
        client.infer(model, [image_input(photos[:2])]).as_numpy("PROBABILITIES") for model in ("large", "small")
    )
    assert not np.allclose(large, small, rtol=PROBABILITY_TOLERANCE)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_preprocessed_fp32_tensor_answers_as_the_encoded_photo(server, client, photos, binary):
    pixels = np.stack([preprocess(decode_image(photo)) for photo in photos[:2]])
    outputs = [triton.InferRequestedOutput("PROBABILITIES", binary_data=binary)]
    from_pixels = client.infer("large", [pixels_input(pixels, binary)], outputs=outputs).as_numpy("PROBABILITIES")
    from_images = client.infer("large", [image_input(photos[:2])]).as_numpy("PROBABILITIES")
    np.testing.assert_allclose(from_pixels, from_images, rtol=PROBABILITY_TOLERANCE, atol=1e-7)
    assert_same_as_predict(server, "large", photos[:2], from_pixels)


def test_pixels_whose_output_overflows_are_a_400_not_an_answer_of_nan(client, photos):
    # Finite FP32 values far beyond an image's overflow inside the network: its probabilities would be NaN,
    # which a JSON answer writes as null and the classification extension as "nan:0:tench".
    pixels = np.stack([preprocess(decode_image(photos[0])), np.full((3, 224, 224), 3e38, np.float32)])
    with pytest.raises(InferenceServerException) as failure:
        client.infer("large", [pixels_input(pixels)])
    assert failure.value.status() == "400"
    assert "PIXELS row 1: the model's output is not finite" in failure.value.message()


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_a_compressed_request_answers_as_the_plain_one(client, photos, compression):
    # tritonclient's request_compression_algorithm, which Triton takes: the answer comes uncompressed, as the
    # client accepts
    plain = client.infer("large", [image_input(photos[:2])]).as_numpy("PROBABILITIES")
    packed = client.infer("large", [image_input(photos[:2])], request_compression_algorithm=compression).as_numpy(
        "PROBABILITIES"
    )
    np.testing.assert_array_equal(packed, plain)


def test_a_gzip_body_of_several_members_is_read_whole(server, photos):
    # RFC 1952: a gzip body is a series of members; only the first was read, and the request failed as not JSON
    body, headers = binary_request(image_header(1, 4 + len(photos[0])), struct.pack("<I", len(photos[0])) + photos[0])
    packed = gzip.compress(body[:100]) + gzip.compress(body[100:]) + bytes(512)  # zero padding, as gzip(1) allows
    for encoding in ("gzip", "x-gzip"):  # x-gzip: the same coding (RFC 9110, 8.4.1.3)
        answer = requests.post(
            server + "/v2/models/large/infer",
            data=packed,
            headers={**headers, "Content-Encoding": encoding},
            timeout=WAIT_S,
        )
        assert answer.status_code == 200, answer.text


def test_classification_extension_gives_predicts_top_k(server, client, photos, fp32_model_path):
    names = class_names(fp32_model_path)
    outputs = [triton.InferRequestedOutput("PROBABILITIES", class_count=3)]
    strings = client.infer("large", [image_input(photos[:3])], outputs=outputs).as_numpy("PROBABILITIES")
    assert strings.shape == (3, 3)
    for photo, row in zip(photos[:3], strings, strict=True):
        top = predict(server, photo).json()["predictions"][:3]
        fields = [item.decode().split(":", 2) for item in row]
        assert [(int(index), label) for _, index, label in fields] == [(p["class_id"], p["label"]) for p in top]
        assert [label for _, index, label in fields] == [names[int(index)] for _, index, _ in fields]
        np.testing.assert_allclose(
            [float(value) for value, _, _ in fields], [p["probability"] for p in top], atol=1e-6
        )  # printed with 6 decimals


def rejections(server, reason: str) -> float:
    return metric(server, f'mnv3_rejections_total{{reason="{reason}"}} ')


def test_unknown_model_or_version_is_404(server, client, photos):
    counted_before = rejections(server, "unknown_model")
    for call in (
        lambda: client.infer("nope", [image_input(photos[:1])]),
        lambda: client.get_model_metadata("large", "2"),
        lambda: client.get_model_config("nope"),
        lambda: client.infer("large", [image_input(photos[:1])], model_version="7"),
    ):
        with pytest.raises(InferenceServerException) as failure:
            call()
        assert failure.value.status() == "404"
        assert "large" in failure.value.message()  # the message says what is served
    assert rejections(server, "unknown_model") == counted_before + 4


def test_paths_and_methods_the_server_lacks_answer_in_the_protocols_shape(server, client):
    """Triton's client reads only `error` from a failed call: its calls for extensions this server does
    not implement must surface the server's message, not a KeyError of the client's own."""
    counted_before = rejections(server, "unknown_model")
    for call, extension in (
        (client.get_model_repository_index, "model repository"),
        (lambda: client.get_inference_statistics("large"), "statistics"),
        (client.get_inference_statistics, "statistics"),  # GET /v2/models/stats: not a model called "stats"
        (lambda: client.get_system_shared_memory_status(), "shared memory"),
        (lambda: client.get_trace_settings("large"), "trace"),
        (client.get_log_settings, "logging"),
    ):
        with pytest.raises(InferenceServerException) as failure:
            call()
        assert failure.value.status() == "404"
        assert f"does not offer Triton's {extension} extension" in failure.value.message()
    assert rejections(server, "unknown_model") == counted_before  # a path the server lacks, not a refused model
    nowhere = requests.get(server + "/v2/nowhere", timeout=WAIT_S)
    assert (nowhere.status_code, nowhere.json()) == (404, {"error": "Not Found"})
    wrong_method = requests.get(server + "/v2/models/large/infer", timeout=WAIT_S)
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"error": "Method Not Allowed"})
    assert wrong_method.headers["allow"] == "POST"
    elsewhere = requests.get(server + "/nope", timeout=WAIT_S)  # outside /v2: FastAPI's own shape
    assert (elsewhere.status_code, elsewhere.json()) == (404, {"detail": "Not Found"})


def test_predict_takes_a_model_and_models_lists_them(server, photos, fp32_model_path, other_model_path):
    listing = requests.get(server + "/models", timeout=WAIT_S).json()
    assert listing["default"] == "large"
    assert [(m["name"], m["default"]) for m in listing["models"]] == [("large", True), ("small", False)]
    for info, path in zip(listing["models"], (fp32_model_path, other_model_path), strict=True):
        assert info["file"] == path.name and info["backend"] == "onnxruntime"
        assert info["input_shape"][1:] == [3, 224, 224] and info["batching"]["max_batch_size"] == MAX_BATCH_SIZE
        assert info["memory"]["file_bytes"] == path.stat().st_size
        assert {"load_rss_bytes", "warm_up_rss_bytes"} <= set(info["memory"])
    default_model = requests.get(server + "/model", timeout=WAIT_S).json()
    assert default_model | {"cache": None} == listing["models"][0] | {"cache": None}  # its entries may have grown
    assert requests.get(server + "/model", params={"model": "small"}, timeout=WAIT_S).json()["name"] == "small"

    default, large, small = (
        predict(server, photos[5]),
        predict(server, photos[5], "large"),
        predict(server, photos[5], "small"),
    )
    assert default.json()["model"] == large.json()["model"] == listing["models"][0]["model"]
    assert small.json()["model"] == listing["models"][1]["model"] != large.json()["model"]
    assert large.json()["cache_hit"] is True and small.json()["cache_hit"] is False  # a cache per model

    unknown = predict(server, photos[5], "nope")
    assert unknown.status_code == 404 and "large, small" in unknown.json()["detail"]


def test_two_models_serve_concurrently(server, photos):
    def work(i: int):
        model = ("large", "small")[i % 2]
        if i % 4 < 2:
            response = predict(server, photos[i % len(photos)], model)
            return response.status_code, response.json()["predictions"][0]["class_id"]
        with triton_client(server) as client:
            row = client.infer(model, [image_input(photos[i % len(photos) :][:1])]).as_numpy("PROBABILITIES")[0]
        return 200, int(row.argmax())

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(work, range(32)))
    assert all(status == 200 for status, _ in answers)
    # every (model, photo) pair got one answer, whichever path asked
    by_pair = {}
    for i, (_, top1) in enumerate(answers):
        by_pair.setdefault((i % 2, i % len(photos)), set()).add(top1)
    assert all(len(top1s) == 1 for top1s in by_pair.values())
    metrics = requests.get(server + "/metrics", timeout=WAIT_S).text
    assert 'mnv3_batch_size_count{model="large"}' in metrics and 'mnv3_batch_size_count{model="small"}' in metrics


def binary_request(header: dict, tail: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + tail, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def image_header(count: int, size: int) -> dict:
    return {
        "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [count], "parameters": {"binary_data_size": size}}]
    }


def bad_requests(photo: bytes) -> dict[str, tuple[bytes, dict, int, str]]:
    """(body, headers, status, what the message says) of representative bad infer requests, by name."""
    element = struct.pack("<I", len(photo)) + photo
    many = MAX_BATCH_SIZE + 1
    wrong_datatype = {"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    return {
        "header not JSON": (b"{not json" + element, {"Inference-Header-Content-Length": "9"}, 400, "not JSON"),
        "negative header length": (b"{}", {"Inference-Header-Content-Length": "-3"}, 400, "negative"),
        "wrong datatype": (json.dumps(wrong_datatype).encode(), {}, 400, "takes BYTES"),
        "element runs past the data": (*binary_request(image_header(1, len(element) - 5), element[:-5]), 400, "remain"),
        "more images than allowed": (
            *binary_request(image_header(many, many * len(element)), element * many),
            400,
            f"limit is {MAX_BATCH_SIZE}",
        ),
        "not an image": (*binary_request(image_header(1, 8), struct.pack("<I", 4) + b"abcd"), 400, "image 0"),
        "body over the limit": (
            b"x" * (UPLOAD_LIMIT + 1),
            {},
            413,
            "PIXELS takes 602112 bytes a row in binary, so 13 rows fit",
        ),
        # a few kilobytes that inflate past the limit: refused as they inflate, never held
        "gzip bomb": (gzip.compress(b"\0" * (UPLOAD_LIMIT * 8)), {"Content-Encoding": "gzip"}, 413, "inflates to over"),
        "gzip cut short": (gzip.compress(b"{}")[:-4], {"Content-Encoding": "gzip"}, 400, "ends before"),
        "not gzip": (b"{}", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
        "garbage after the gzip body": (gzip.compress(b"{}") + b"GARBAGE", {"Content-Encoding": "gzip"}, 400, "gzip"),
        # each member a new inflater and a copy of its read's rest: thousands of empty ones held the event loop
        "gzip of many members": (gzip.compress(b"") * 100_000, {"Content-Encoding": "gzip"}, 400, "more than 16"),
        "data after gzip padding": (
            gzip.compress(b"{}") + bytes(99) + b"x",
            {"Content-Encoding": "gzip"},
            400,
            "not valid gzip",
        ),
        "data after the deflate body": (zlib.compress(b"{}") + b"x", {"Content-Encoding": "deflate"}, 400, "follows"),
        "unknown coding": (b"{}", {"Content-Encoding": "br"}, 415, "'br' not accepted"),
    }


@pytest.mark.parametrize("case", bad_requests(b"").keys())
def test_bad_input_is_a_4xx_error_and_the_server_serves_on(server, client, photos, case):
    body, headers, status, message = bad_requests(photos[0])[case]
    reason = "too_large" if status == 413 else "bad_input"
    counted_before = rejections(server, reason)
    response = requests.post(server + "/v2/models/large/infer", data=body, headers=headers, timeout=WAIT_S)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert rejections(server, reason) == counted_before + 1
    documented = requests.get(server + "/openapi.json", timeout=WAIT_S).json()["paths"]
    assert str(status) in documented["/v2/models/{name}/infer"]["post"]["responses"]
    assert client.infer("large", [image_input(photos[:1])]).as_numpy("PROBABILITIES").shape == (1, 1000)


def test_deadline_and_full_queue_answer_504_and_503_in_the_protocols_shape(fp32_model_path, photos):
    """With inference held: a queued image's deadline passes (504), and a request whose images do not all
    fit in the queue is refused whole (503 + Retry-After); both as {"error": ...}, then it serves on."""

    def infer(images):
        body, json_size = triton.InferenceServerClient.generate_request_body([image_input(images)])
        return client.post(
            "/v2/models/fp32/infer", content=body, headers={"Inference-Header-Content-Length": str(json_size)}
        )

    with (
        serving_client(
            fp32_model_path, max_batch_size=1, max_request_images=4, queue_limit=3, deadline_ms=500, cache_size=0
        ) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        gate = Gate(client.app.state.serving.engine)
        held = gate.hold(pool, post_file, client, photos[0])
        late = infer(photos[1:2])
        assert late.status_code == 504 and "deadline" in late.json()["error"]
        refused = infer(photos[2:5])  # the late one's entry still holds a place until the inference thread skips it
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "queue full" in refused.json()["error"]
        gate.release.set()
        assert held.result().status_code == 504  # held past its deadline too
        wait_until(lambda: client.app.state.serving.batcher.depth == 0, "the batcher to skip the abandoned entries")
        assert infer(photos[5:6]).status_code == 200
        metrics = client.get("/metrics").text
        assert 'mnv3_rejections_total{reason="deadline"} 2.0' in metrics
        assert 'mnv3_rejections_total{reason="queue_full"} 1.0' in metrics


def test_duplicate_or_unsafe_model_names_are_one_line_cli_errors(fp32_model_path):
    for models, message in (
        ([fp32_model_path, fp32_model_path], "two models are named 'fp32'"),
        ([f"my model={fp32_model_path}"], "not URL-safe"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "mnv3.server", *(f"--model={m}" for m in models)],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]


# An InferenceError says which runtime failed; any other exception (a MemoryError allocating the warm-up batch)
# had ended the warm-up task silently, leaving the server "warming up" for good.
@pytest.mark.parametrize(
    "error, said",
    [
        (InferenceError("out of memory (simulated)"), "out of memory (simulated)"),
        (MemoryError("out of memory (simulated)"), "MemoryError: out of memory (simulated)"),
    ],
)
def test_a_model_whose_warm_up_failed_says_so_and_the_others_are_ready(fp32_model_path, monkeypatch, error, said):
    config = ServerConfig(model=f"a={fp32_model_path}", extra_models=(f"b={fp32_model_path}",))
    engines = load_engines(config)

    def failing(batch_sizes):
        raise error

    monkeypatch.setattr(engines[0], "warm_up", failing)
    with TestClient(create_app(config, *engines)) as client:
        wait_until(lambda: "failed" in client.get("/readyz").json()["status"], "the warm-up's failure")
        assert client.get("/readyz").json() == {"status": f"warm-up failed: a: {said}"}
        failed = client.get("/v2/models/a/ready")
        assert failed.status_code == 503
        assert failed.json() == {"error": f"model a failed to warm up: {said}"}
        assert client.get("/v2/models/b/ready").status_code == 200
        assert client.get("/v2/health/ready").status_code == 503
        # and liveness, which stayed 200: a probe would have left the pod unready for good, never restarted
        assert client.get("/healthz").status_code == 503
        assert client.get("/healthz").json() == {"status": f"warm-up failed: a: {said}"}
        assert client.get("/v2/health/live").status_code == 503


def test_an_unexpected_failure_is_a_json_500_in_the_paths_shape_counted_as_internal(fp32_model_path, photos):
    # A bug's exception (here a MemoryError) got Starlette's plain-text 500, counted nowhere.
    async def failing(*args):
        raise MemoryError

    with TestClient(create_app(ServerConfig(model=fp32_model_path)), raise_server_exceptions=False) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, "warm-up")
        served = client.app.state.serving.default
        served.classify = served.probabilities = failing
        element = struct.pack("<I", len(photos[0])) + photos[0]
        body, headers = binary_request(image_header(1, len(element)), element)
        answers = [post_file(client, photos[0]), client.post("/v2/models/fp32/infer", content=body, headers=headers)]
        message = "internal server error (MemoryError); the server's log has its traceback"
        assert [(a.status_code, a.json()) for a in answers] == [(500, {"detail": message}), (500, {"error": message})]
        assert 'mnv3_rejections_total{reason="internal"} 2.0' in client.get("/metrics").text
        del served.classify  # the instance attribute: the method again
        assert post_file(client, photos[0]).status_code == 200  # and it serves on
