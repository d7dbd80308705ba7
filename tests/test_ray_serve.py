"""The Ray Serve deployment against the plain server: same answers, both replicas used, same error shape.

One local Ray cluster (127.0.0.1 only, 2 CPUs) for the module; it is shut down at the end.
"""

import os
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is optional: pip install -r requirements-ray.txt")
pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -r requirements-ray.txt")

import requests  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from ray import serve  # noqa: E402

from mnv3 import ray_serve, server  # noqa: E402
from mnv3.auth import KeyFileError, new_key_line  # noqa: E402
from mnv3.config import ServerConfig  # noqa: E402
from mnv3.errors import RETRY_AFTER_S  # noqa: E402
from mnv3.loadtest import free_port  # noqa: E402
from mnv3.photos import load_images  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
IMAGES = 16
CONCURRENCY = 8
TIMEOUT_S = 60
RTOL = 1e-4


@pytest.fixture(scope="module")
def config(fp32_model_path):
    # Cache off: every request runs the model in whichever replica gets it.
    return ServerConfig(model=fp32_model_path, max_batch_size=8, batch_window_ms=10, cache_size=0)


@pytest.fixture(scope="module")
def ray_url(config):
    port = free_port()
    sigterm = signal.getsignal(signal.SIGTERM)
    ray_serve.start_local_cluster(num_cpus=2, port=port, log_to_driver=False)
    try:
        # ray.init's handler replaced the caller's: a --bench run on SIGTERM exited 15, not as every stage does
        assert signal.getsignal(signal.SIGTERM) is sigterm
        url = f"http://127.0.0.1:{port}"
        ray_serve.deploy(ray_serve.build(config, replicas=2, num_cpus=1), url)
        yield url
    finally:
        ray_serve.stop_local_cluster()


@pytest.fixture(scope="module")
def images():
    return load_images(IMAGES, seed=5)


def post(url: str, body: bytes) -> requests.Response:
    return requests.post(url + "/predict", files={"file": ("image.jpg", body, "image/jpeg")}, timeout=TIMEOUT_S)


def test_answers_match_plain_server_and_both_replicas_serve(ray_url, config, images):
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        responses = list(pool.map(lambda body: post(ray_url, body), images))
    assert [r.status_code for r in responses] == [200] * IMAGES, [r.text for r in responses if r.status_code != 200]

    with TestClient(server.create_app(config)) as plain:
        expected = [plain.post("/predict", files={"file": ("image.jpg", body, "image/jpeg")}).json() for body in images]
    for response, want in zip(responses, expected, strict=True):
        got = response.json()
        assert got["model"] == want["model"]
        # Batch composition and thread count differ between the two: equal up to float rounding.
        np.testing.assert_allclose(
            [p["probability"] for p in got["predictions"]], [p["probability"] for p in want["predictions"]], rtol=RTOL
        )
        got_top, want_top = got["predictions"][0], want["predictions"][0]
        # The random-init stand-in is nearly uniform (top-2 margins ~1e-6): only a class tied with the
        # plain server's top-1 within rounding may lead instead (on this machine the outputs are identical).
        tied = {p["class_id"] for p in want["predictions"] if p["probability"] >= want_top["probability"] * (1 - RTOL)}
        assert got_top["class_id"] == want_top["class_id"] or got_top["class_id"] in tied, (got_top, want_top)

    replicas = {r.headers[ray_serve.REPLICA_HEADER] for r in responses}
    assert len(replicas) == 2, f"expected both replicas to serve, got {replicas}"
    # Each replica sized its ORT session to the 1 CPU Ray gave it, not to the machine.
    assert requests.get(ray_url + "/model", timeout=TIMEOUT_S).json()["threads"]["intra_op"] == 1


def test_ray_backpressure_has_the_plain_servers_error_shape(ray_url, config, images):
    # A second app on the same cluster that holds one request and queues one: the rest Ray refuses.
    tight = ray_serve.build(config, replicas=1, num_cpus=0, max_ongoing_requests=1, max_queued_requests=1)
    serve.run(tight, name="tight", route_prefix="/tight")
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            responses = list(pool.map(lambda body: post(ray_url + "/tight", body), images[:CONCURRENCY]))
    finally:
        serve.delete("tight")
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses and set(statuses) == {200, 503}, statuses
    for refused in (r for r in responses if r.status_code == 503):
        assert refused.headers["content-type"] == "application/json"
        assert set(refused.json()) == {"detail"} and "backpressure" in refused.json()["detail"]
        assert refused.headers["retry-after"] == str(RETRY_AFTER_S)


def test_ray_stays_optional():
    """Only mnv3/ray_serve.py and mnv3/ray_drain.py import ray; the plain server and the stages run without it."""
    code = "import sys, mnv3.server, mnv3.loadtest; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    allowed = {REPO / "mnv3" / "ray_serve.py", REPO / "mnv3" / "ray_drain.py", Path(__file__).resolve()}
    for path in [*REPO.glob("*.py"), *REPO.glob("mnv3/*.py"), *REPO.glob("tests/*.py")]:
        if path.resolve() not in allowed:
            lines = path.read_text().splitlines()
            assert not [line for line in lines if line.lstrip().startswith(("import ray", "from ray"))], path


def test_more_cpus_than_the_machine_has_is_one_line_and_exit_2(fp32_model_path, capsys):
    args = ray_serve.parse_args(
        ["--model", str(fp32_model_path), "--replicas", str(os.cpu_count() + 1), "--num-cpus", "1", "--cache-size", "3"]
    )
    assert args.server_flags == ["--cache-size", "3"]
    with pytest.raises(SystemExit) as exit_info:
        ray_serve.main(args)  # before any Ray process starts
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --replicas") and "lower --num-cpus" in error and error.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-replicas", str(os.cpu_count() + 1)], "--max-replicas"),  # autoscaling towards CPUs not there
        (["--min-replicas", "2"], "give --max-replicas too"),  # a floor without autoscaling
        (["--replicas", "2", "--max-replicas", "1"], "below the autoscaling floor 2"),
        (["--min-replicas", "2", "--max-replicas", "1"], "below the autoscaling floor 2"),  # was pydantic's traceback
        (["--shutdown-delay-s", "5"], "(or MNV3_SHUTDOWN_DELAY_S) is the plain server's"),  # taken, then ignored
    ],
)
def test_replica_counts_that_cannot_work_are_one_line_and_exit_2(fp32_model_path, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_info:
        ray_serve.main(ray_serve.parse_args(["--model", str(fp32_model_path), "--num-cpus", "1", *flags]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and says in error and error.count("\n") == 1


def test_build_app_makes_every_model_path_absolute_and_keeps_names_and_backends(fp32_model_path, tmp_path, monkeypatch):
    (tmp_path / "artifacts").mkdir()
    for name in ("fp32.onnx", "class_names.json"):
        (tmp_path / "artifacts" / name).symlink_to(fp32_model_path.parent / name)
    monkeypatch.chdir(tmp_path)  # serve_config.yaml's paths are relative to where `serve run` runs
    application = ray_serve.build_app(
        {
            "model": "int8=artifacts/fp32.onnx",
            "extra_models": "ort=artifacts/fp32.onnx@onnxruntime, artifacts/fp32.onnx",
        }
    )
    (config,) = application._bound_deployment.init_args  # what every replica is constructed with
    folder = tmp_path / "artifacts"
    assert [(spec.name, spec.path, spec.backend) for spec in config.models] == [
        ("int8", folder / "fp32.onnx", None),
        ("ort", folder / "fp32.onnx", "onnxruntime"),
        ("fp32", folder / "fp32.onnx", None),
    ]
    listed = ray_serve.build_app({"model": "artifacts/fp32.onnx", "extra_models": ["b=artifacts/fp32.onnx"]})
    (config,) = listed._bound_deployment.init_args  # a YAML list, as serve_config.yaml gives it
    assert [(spec.name, spec.path) for spec in config.models] == [
        ("fp32", folder / "fp32.onnx"),
        ("b", folder / "fp32.onnx"),
    ]


def test_build_app_reads_the_key_file_once_and_the_replicas_app_is_protected(
    fp32_model_path, tmp_path, monkeypatch, capsys
):
    bad = tmp_path / "bad_keys"
    bad.write_text("sha256:abc infer\n")
    with pytest.raises(KeyFileError, match=f"^{re.escape(str(bad))}:1: sha256: must be followed by the 64 hex"):
        ray_serve.build_app({"model": str(fp32_model_path), "api_keys": str(bad)})  # at `serve run`, no replica
    ray_started = []  # an earlier test's cluster may still be up, so watch for a start rather than ask Ray
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: ray_started.append(args))
    with pytest.raises(SystemExit) as exit_info:  # the CLI: one line, exit 2, before any Ray process starts
        ray_serve.main(ray_serve.parse_args(["--model", str(fp32_model_path), "--api-keys", str(bad)]))
    assert exit_info.value.code == 2 and ray_started == []
    monkeypatch.undo()
    error = capsys.readouterr().err
    assert error.startswith(f"error: {bad}:1: ") and error.count("\n") == 1

    key, line = new_key_line("infer")
    (tmp_path / "api_keys").write_text(line + "\n")
    monkeypatch.chdir(tmp_path)  # the config file names it relative to where `serve run` runs
    application = ray_serve.build_app({"model": str(fp32_model_path), "api_keys": "api_keys", "cache_size": "0"})
    (config,) = application._bound_deployment.init_args  # what every replica is constructed with
    assert config.api_keys == str(tmp_path / "api_keys")  # absolute: replicas run elsewhere
    with TestClient(server.create_app(config)) as client:  # as MobileNetV3.__serve_build_asgi_app__ builds it
        photo = load_images(1, seed=9)[0]
        assert client.post("/predict", files={"file": ("a.jpg", photo, "image/jpeg")}).status_code == 401
        keyed = client.post(
            "/predict", files={"file": ("a.jpg", photo, "image/jpeg")}, headers={"Authorization": f"Bearer {key}"}
        )
        assert keyed.status_code == 200 and len(keyed.json()["predictions"]) == 5
        assert client.get("/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 403
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(("batch_threads", "cpus", "expected"), [(0, 1, 0), (0, 4, 0), (4, 1, 1), (2, 4, 2)])
def test_a_replica_sizes_every_thread_count_to_its_cpus(batch_threads, cpus, expected):
    """0 stays 0, the default: Engine.load then takes stage 2's measurement or half of the replica's threads."""
    sized = ray_serve.sized_to(ServerConfig(model="a.onnx", intra_op_threads=8, batch_threads=batch_threads), cpus)
    assert (sized.intra_op_threads, sized.preprocess_threads, sized.batch_threads) == (cpus, cpus, expected)


def test_an_app_already_on_the_cluster_is_not_replaced(ray_url):
    # mnv3-ray-serve --address auto replaced a serve-deployed mnv3 app, then deleted it on the way out.
    assert "already runs an app named mnv3: update it with serve deploy" in ray_serve.app_name_taken("auto")


def test_a_busy_port_is_one_line_before_any_ray_process(fp32_model_path, capsys):
    # Ray's proxy binds with SO_REUSEPORT: a second cluster shared the port with the first, each answering some.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            ray_serve.main(ray_serve.parse_args(["--model", str(fp32_model_path), "--port", str(port)]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(port) in error and error.count("\n") == 1


@pytest.mark.parametrize(
    "args, problem",
    [
        ({"model": "artifacts/nope.onnx"}, "model file .*nope.onnx not found"),
        ({"model": "CORRUPT"}, "corrupt.onnx is not a loadable ONNX model"),
        ({"cache_size": "lots"}, "cache_size: 'lots' is not a whole number"),
        ({"max_batch_size": 2.9}, "max_batch_size: 2.9 is not a whole number"),
    ],
)
def test_a_config_files_mistake_fails_the_build_not_the_replicas(fp32_model_path, tmp_path, args, problem):
    # Found only by the replicas, a bad model path in `serve deploy` stopped the running version and left none.
    if args.get("model") == "CORRUPT":
        corrupt = tmp_path / "corrupt.onnx"
        corrupt.write_bytes(fp32_model_path.read_bytes()[:100_000])  # a copy cut short
        args = {"model": str(corrupt)}
    with pytest.raises(ValueError if "whole" in problem else server.ModelLoadError, match=problem):
        ray_serve.build_app({"model": str(fp32_model_path)} | args)
