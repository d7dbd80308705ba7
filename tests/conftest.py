"""Shared fixtures and the helpers several test modules use (`from conftest import ...`).

Nothing here downloads: models are seeded random-init MobileNetV3 exports.
"""

import select
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import requests
import uvicorn
from fastapi.testclient import TestClient

from mnv3.artifacts import STATIC_INT8_ONNX
from mnv3.backend_choice import manifest_entry
from mnv3.config import ServerConfig
from mnv3.engine import Engine
from mnv3.preprocess import Decoding
from mnv3.report import cpu_info
from mnv3.server import create_app

# Every combination of the server's decoding shortcuts (--jpeg-draft, --resize-crop-only).
EVERY_DECODING = [Decoding(jpeg_draft, crop_only) for jpeg_draft in (False, True) for crop_only in (False, True)]


def decoding_id(decoding: Decoding) -> str:
    return f"draft{decoding.jpeg_draft:d}-crop_only{decoding.resize_crop_only:d}"


WAIT_S = 30  # upper bound on any wait; a broken test fails instead of hanging
REAL_WEIGHTS = "imagenet"  # any provenance but the stand-in's: stage 2's agreement guard applies


def export_random_init(arch: str, directory):
    """`directory` with a batch-dynamic ONNX export of torchvision's `arch`, seeded random init with
    BatchNorm re-estimated on photos, and its class names."""
    import torch
    import torchvision.models

    from mnv3.artifacts import FP32_ONNX, write_class_names
    from mnv3.model import IMAGENET_CLASSES, export_onnx, recalibrate_batchnorm
    from mnv3.photos import CALIBRATION_SOURCES, augmented_views

    torch.manual_seed(0)
    model = recalibrate_batchnorm(
        getattr(torchvision.models, arch)(weights=None), augmented_views(CALIBRATION_SOURCES, 16, 0)
    )
    export_onnx(model, directory / FP32_ONNX)
    write_class_names(directory, IMAGENET_CLASSES)
    return directory


@pytest.fixture(scope="session")
def fp32_model_dir(tmp_path_factory):
    """A directory with a real batch-dynamic MobileNetV3-Large ONNX export and its class names."""
    return export_random_init("mobilenet_v3_large", tmp_path_factory.mktemp("fp32_model"))


@pytest.fixture(scope="session")
def fp32_model_path(fp32_model_dir):
    from mnv3.artifacts import FP32_ONNX

    return fp32_model_dir / FP32_ONNX


@pytest.fixture(scope="session")
def other_model_path(fp32_model_path, tmp_path_factory):
    """The fixture model with its classifier's bias shifted: another model (other answers) in a second."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from mnv3.artifacts import CLASS_NAMES_JSON

    model = onnx.load(fp32_model_path)
    bias = next(tensor for tensor in model.graph.initializer if tensor.name == model.graph.node[-1].input[2])
    shifted = numpy_helper.to_array(bias) + np.random.default_rng(0).normal(0, 1, bias.dims).astype(np.float32)
    bias.CopyFrom(numpy_helper.from_array(shifted, bias.name))
    directory = tmp_path_factory.mktemp("other_model")
    onnx.save(model, directory / "other.onnx")
    (directory / CLASS_NAMES_JSON).write_bytes((fp32_model_path.parent / CLASS_NAMES_JSON).read_bytes())
    return directory / "other.onnx"


@pytest.fixture(scope="session")
def fp32_small_model_path(tmp_path_factory):
    """The same for MobileNetV3-Small, whose depthwise channel counts differ from Large's."""
    from mnv3.artifacts import FP32_ONNX

    return export_random_init("mobilenet_v3_small", tmp_path_factory.mktemp("fp32_small_model")) / FP32_ONNX


@pytest.fixture(scope="session")
def held_out():
    """32 preprocessed photos none of the calibration sets use."""
    from mnv3.photos import held_out_images
    from mnv3.preprocess import preprocess_batch

    return preprocess_batch(held_out_images(32))


def wait_until(condition, what: str):
    give_up = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.01)


def metric(url: str, sample: str) -> float:
    """The value of the first line of a server's /metrics that starts with `sample` (a name, with its labels)."""
    text = requests.get(url + "/metrics", timeout=WAIT_S).text
    return float(next(line for line in text.splitlines() if line.startswith(sample)).split()[-1])


@contextmanager
def uvicorn_in_thread(app, **options):
    """`app` under a real uvicorn on 127.0.0.1 (`options`: uvicorn.Config's) in a thread, for raw sockets; yields
    its port, stops it after."""
    from mnv3.loadtest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, name="uvicorn")
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started, "uvicorn did not start"
        yield port
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


@contextmanager
def offline_weights():
    """torchvision's download of ImageNet weights fails at once, as on a machine without internet: stage 1 then
    takes its labelled random-init stand-in, and no test downloads."""
    import urllib.error

    import torchvision

    def offline(*args, **kwargs):
        raise urllib.error.URLError("offline test")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
        yield


@contextmanager
def serving_client(model_path, **settings):
    with TestClient(create_app(ServerConfig(model=model_path, **settings))) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, "warm-up")
        yield client


def post_file(client, data: bytes, field: str = "file"):
    return client.post("/predict", files={field: ("photo.jpg", data, "image/jpeg")})


def post_raw(client, data, content_type: str | None = "image/jpeg"):
    return client.post("/predict", content=data, headers={"content-type": content_type} if content_type else {})


def post(url: str, body: bytes) -> requests.Response:
    """POST one image to a server listening at `url` (a real socket, not a TestClient)."""
    return requests.post(url + "/predict", files={"file": ("a.jpg", body, "image/jpeg")}, timeout=WAIT_S)


def upload(port: int, size: int, first: int, headers: str = "") -> tuple[bytes, bool, bool]:
    """POST /predict to 127.0.0.1:`port` announcing `size` bytes and sending the first `first` of them; the
    rest only once the server has not answered within 2 s. Returns the response, whether the server closed
    the connection after it (rather than waiting for the rest of the body), and whether the rest was sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(
            f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n{headers}"
            f"Content-Length: {size}\r\n\r\n".encode()
            + b"\0" * first
        )
        rest_sent = not select.select([sock], [], [], 2)[0]
        if rest_sent:
            sock.sendall(b"\0" * (size - first))
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(65536)
        head, _, body = response.partition(b"\r\n\r\n")
        length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
        while len(body) < length:
            body += sock.recv(65536)
        # The whole response is in: does the server close the connection? (Sooner than uvicorn's 5 s keep-alive.)
        sock.settimeout(2)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with our unread body on its way: also a close
            closed = True
        except TimeoutError:
            closed = False
    return head + b"\r\n\r\n" + body, closed, rest_sent


def assert_rate(rate, count, seconds):
    """`rate` is `count` / `seconds`, all three as the CSV holds them: seconds to 1 ms, rates to 0.01/s."""
    count, seconds = int(count), float(seconds)
    assert count / (seconds + 0.0005) - 0.005 <= float(rate) <= count / (seconds - 0.0005) + 0.005


class Gate:
    """Wraps Engine.predict so a test can hold an inference call open and count the calls made."""

    def __init__(self, engine: Engine):
        self.real = engine.predict
        self.batch_sizes: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()
        engine.predict = self

    def __call__(self, batch):
        self.batch_sizes.append(len(batch))
        self.entered.set()
        self.release.wait(WAIT_S)
        return self.real(batch)

    def hold(self, pool, send, *args):
        """`pool.submit(send, *args)`, returned once that request's inference call is inside the gate."""
        held = pool.submit(send, *args)
        assert self.entered.wait(WAIT_S), "the held request never reached the engine"
        return held


def engine_choice_entry(
    engine: str, file: str, precision: str = "f32", for_model: str = STATIC_INT8_ONNX, streams: int = 1
) -> dict:
    """A manifest's engine choice, as stage 2 writes it, of `file` on `engine` for `for_model`."""
    row = {
        "variant": f"{engine}_{file}",
        "engine": engine,
        "file": file,
        "precision": precision,
        "streams": streams,
        "mean_ms_vs_onnx_fp32": 0.5,
        "per_image_ms_vs_onnx_fp32": 0.4,
        "batch_size": 32,
        "top1_agreement": 1.0,
    }
    return manifest_entry(row, {}, for_model, 3, REAL_WEIGHTS, 0.99, 512, False, cpu_info())  # measured here


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items):
    """A test without a tier would drop out of `make test-fast` unnoticed: refuse to run one."""
    untiered = sorted(
        {item.nodeid.split("::")[0] for item in items if not any(item.get_closest_marker(tier) for tier in TIERS)}
    )
    if untiered:
        raise pytest.UsageError(
            f"no tier marker (pytestmark = pytest.mark.<{'|'.join(TIERS)}>) in: {', '.join(untiered)}"
        )
