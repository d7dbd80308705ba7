"""The optional OpenVINO backend against onnxruntime on the same (random-init) FP32 export and real photos."""

import gc
import hashlib
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import serving_client
from mnv3.config import ServerConfig
from mnv3.engine import Engine, ModelLoadError
from mnv3.photos import held_out_images, load_images
from mnv3.preprocess import decode_image, preprocess, preprocess_batch
from mnv3.server import create_app
from mnv3.variants import OPENVINO_INT8_BUILDS

pytestmark = pytest.mark.e2e

# Relative, as the random-init model's probabilities are all ~1e-3 and its top two often differ by a
# fraction of a percent: the same FP32 network in two runtimes differs only by float rounding;
# BF16 (only on CPUs with AVX512_BF16/AMX; not measured here, no such CPU) keeps ~3 significant digits.
RELATIVE_TOLERANCE = {"f32": 1e-5, "bf16": 5e-2}


@pytest.fixture(scope="module")
def openvino_installed():
    pytest.importorskip("openvino", reason="optional backend: pip install -r requirements-openvino.txt")


@pytest.fixture(scope="module")
def engines(fp32_model_path, openvino_installed):
    return Engine.load(fp32_model_path), Engine.load(fp32_model_path, "openvino", max_batch_size=8)


def precision(engine: Engine) -> str:
    return engine.providers[0].rsplit(":", 1)[1]


def assert_same_answers(reference: np.ndarray, got: np.ndarray, precision: str):
    """Every probability close, and top-1 equal wherever the reference's lead is beyond the tolerance."""
    tolerance = RELATIVE_TOLERANCE[precision]
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=tolerance, atol=0)
    assert (got.argmax(1) == reference.argmax(1))[clear_lead(reference, tolerance)].all()


def clear_lead(probabilities: np.ndarray, tolerance: float) -> np.ndarray:
    """Rows whose top-1 leads the runner-up by more than twice the tolerance (for f32: all rows seen)."""
    top2 = np.sort(probabilities, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) / top2[..., 1] > 2 * tolerance


@pytest.mark.parametrize("batch_size", [1, 5])
def test_openvino_predicts_what_onnxruntime_predicts(engines, batch_size):
    ort_engine, ov_engine = engines
    photos = preprocess_batch(held_out_images(batch_size, seed=5))
    reference = ort_engine.predict(photos)
    if precision(ov_engine) == "f32":
        assert clear_lead(reference, RELATIVE_TOLERANCE["f32"]).all()  # so top-1 is compared on every photo
    assert_same_answers(reference, ov_engine.predict(photos), precision(ov_engine))
    assert ov_engine.model_id == ort_engine.model_id and ov_engine.class_names == ort_engine.class_names
    row = ov_engine.predict(photos[:1])[0]
    assert [p.class_id for p in ov_engine.top_k(row, 3)] == list(np.argsort(row)[::-1][:3])


def test_server_serves_with_the_openvino_backend(fp32_model_path, engines):
    ort_engine, ov_engine = engines
    photos = load_images(3, seed=7)
    config = ServerConfig(
        model=fp32_model_path, backend="openvino", max_batch_size=4, batch_window_ms=200, cache_size=0
    )
    with TestClient(create_app(config)) as client, ThreadPoolExecutor(len(photos)) as pool:
        give_up = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < give_up, "warm-up did not finish"
            time.sleep(0.01)
        info = client.get("/model").json()
        assert info["backend"] == "openvino" and info["providers"] == ov_engine.providers
        assert (info["threads"]["intra_op"], info["threads"]["batch"]) == (2, 1)  # --batch-threads' default
        assert client.app.state.serving.engine.session.batch_threads == 1
        assert info["providers"][0].startswith("OpenVINO:CPU:")
        responses = list(
            pool.map(lambda data: client.post("/predict", files={"file": ("a.jpg", data, "image/jpeg")}), photos)
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert max(body["batch_size"] for body in bodies) > 1  # a dynamic batch went through OpenVINO
    reference = ort_engine.predict(np.stack([preprocess(decode_image(data)) for data in photos]))
    tolerance = RELATIVE_TOLERANCE[precision(ov_engine)]
    for body, ref in zip(bodies, reference, strict=True):
        assert body["model"] == ort_engine.model_id
        shown = [p["class_id"] for p in body["predictions"]]  # the top 5 only
        np.testing.assert_allclose([p["probability"] for p in body["predictions"]], ref[shown], rtol=tolerance)
        assert shown[0] == ref.argmax() or not clear_lead(ref, tolerance)


def test_an_openvino_ir_is_its_xml_and_the_weights_beside_it(fp32_model_path, openvino_installed, tmp_path):
    """/model's file size and digest cover the .bin too: the .xml alone is the graph, under a tenth of the model."""
    import openvino

    xml = tmp_path / "fp32.xml"
    openvino.save_model(openvino.convert_model(str(fp32_model_path)), str(xml))
    weights = xml.with_suffix(".bin")
    with serving_client(xml, backend="openvino", max_batch_size=1) as client:
        info = client.get("/model").json()
    assert info["memory"]["file_bytes"] == xml.stat().st_size + weights.stat().st_size
    assert weights.stat().st_size > 10 * xml.stat().st_size
    assert info["sha256"] == hashlib.sha256(xml.read_bytes() + weights.read_bytes()).hexdigest()


def test_without_batches_model_says_a_request_runs_on_every_thread(fp32_model_path, openvino_installed):
    config = ServerConfig(model=fp32_model_path, backend="openvino", max_batch_size=1)
    with TestClient(create_app(config)) as client:
        assert client.get("/model").json()["threads"]["batch"] == config.intra_op_threads


def test_missing_openvino_is_a_clear_load_error(fp32_model_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now raises ImportError
    with pytest.raises(ModelLoadError) as missing:
        Engine.load(fp32_model_path, "openvino")
    # what a server installed from a wheel can run, as well as a checkout's requirements file
    assert str(missing.value) == (
        "backend openvino needs the openvino package: `pip install openvino` "
        "(in a checkout, `pip install -r requirements-openvino.txt`, with NNCF for stage 2)"
    )


def test_onnxruntime_serving_never_imports_openvino(fp32_model_path):
    code = (
        "import sys; from mnv3.config import ServerConfig; from mnv3.server import load_engine; "
        "load_engine(ServerConfig(model=sys.argv[1])); print('openvino imported:', 'openvino' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(fp32_model_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("openvino imported: False")


def run_within(session, rows: np.ndarray, timeout_s: float = 30) -> np.ndarray:
    """`session.run` on a daemon thread: a call that hangs fails the test instead of hanging it."""
    outcome: list = []

    def call():
        try:
            outcome.append(session.run(None, {"input": rows})[0])
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"the engine did not answer within {timeout_s} s"
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def test_batches_that_fail_to_start_leave_the_engine_serving(fp32_model_path, openvino_installed):
    # OpenVINO's AsyncInferQueue keeps a request whose start_async raised busy for good: after as many failures
    # as a queue has requests, every later batch waited for ever (a server answering 504 to everything).
    session = Engine.load(fp32_model_path, "openvino", max_batch_size=8).session
    rows = np.stack([preprocess(decode_image(data)) for data in load_images(8, seed=3)])
    expected = run_within(session, rows)
    wrong_shape = np.zeros((8, 3, 200, 224), np.float32)
    for _ in range(2 * sum(len(queue) for queue in session._parts.values()) + 1):
        with pytest.raises(RuntimeError):
            run_within(session, wrong_shape)

    class FailsSecondStart:  # a batch whose first part started and whose second did not, nor its waiting
        calls = waits = 0

        def __init__(self, queue):
            self.queue = queue

        def start_async(self, *args, **kwargs):
            FailsSecondStart.calls += 1
            if FailsSecondStart.calls == 2:
                raise RuntimeError("injected")
            return self.queue.start_async(*args, **kwargs)

        def wait_all(self):
            self.queue.wait_all()
            FailsSecondStart.waits += 1
            if FailsSecondStart.waits == 1:
                raise RuntimeError("waiting failed too")

    session._parts = {size: FailsSecondStart(queue) for size, queue in session._parts.items()}
    with pytest.raises(RuntimeError, match="injected"):  # the first failure, not the one while recovering
        run_within(session, rows)
    for _ in range(3):
        np.testing.assert_array_equal(run_within(session, rows), expected)


def test_an_openvino_engine_for_single_images_runs_a_batch_one_image_at_a_time(fp32_model_path, engines):
    reference, _ = engines
    single = Engine.load(fp32_model_path, "openvino", max_batch_size=1)  # a batch of 3 was an InferenceError
    rows = np.stack([preprocess(decode_image(data)) for data in load_images(3, seed=5)])
    assert_same_answers(reference.predict(rows), single.predict(rows), precision(single))
    assert single.predict(rows[:0]).shape == (0, single.num_classes)


def test_a_dropped_openvino_engine_is_freed(fp32_model_path, openvino_installed):
    # Its queues' callbacks were the session's own method, a cycle through OpenVINO's C++ that the garbage
    # collector cannot see: every engine loaded kept its memory and plugin threads (stage 2 loads many).
    engine = Engine.load(fp32_model_path, "openvino", max_batch_size=8)
    engine.predict(np.zeros((5, *engine.preprocessing.input_shape), np.float32))  # a batch in parts
    session = weakref.ref(engine.session)
    del engine
    gc.collect()
    assert session() is None


def test_openvino_sends_no_telemetry_from_mnv3(fp32_model_path, openvino_installed, tmp_path):
    # With no consent file in ~/intel, `import openvino` (its model converter) and NNCF count as consent and
    # send usage events to Google Analytics: importing mnv3 leaves both on their no-op stubs.
    code = (
        "import sys; from mnv3.engine import Engine; Engine.load(sys.argv[1], 'openvino'); import nncf; "
        "import openvino.tools.ovc.telemetry_utils as ovc; from nncf.telemetry import wrapper; "
        "print(ovc.tm.__name__, type(wrapper.telemetry).__name__)"
    )
    home = tmp_path / "home"  # a fresh home: no consent file, as on a new machine or container
    home.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", code, str(fp32_model_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
    )
    assert result.returncode == 0, result.stderr
    # (without mnv3: openvino_telemetry and NNCFTelemetry, and ~/intel holding a client id and stats)
    assert result.stdout.split() == ["openvino.tools.ovc.telemetry_stub", "MagicMock"]  # NNCF's stub is a MagicMock
    assert list(home.iterdir()) == []
    # A user who said yes (opt_in_out --opt_in writes 1 there) keeps it; only mnv3's choice is checked here, as
    # importing openvino would then send its event.
    (home / "intel").mkdir()
    (home / "intel" / "openvino_telemetry").write_text("1\n")
    blocked = "import sys, mnv3; print(sys.modules.get('openvino_telemetry', 'importable') is None)"
    result = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, env={"HOME": str(home)}
    )
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def nncf_build(fp32_model_path, out_path, graph_rewrites=(), quantize_logits=False) -> tuple[Path, np.ndarray]:
    """An NNCF INT8 build of the fixture, and the 8 photos it was calibrated on."""
    pytest.importorskip("nncf", reason="optional: pip install -r requirements-openvino.txt")
    from mnv3.openvino_int8 import quantize_nncf_int8

    calibration = np.stack([preprocess(decode_image(data)) for data in load_images(8, seed=11)])
    return quantize_nncf_int8(fp32_model_path, out_path, calibration, graph_rewrites, quantize_logits), calibration


def nncf_kernels(fp32_model_path, out_path, graph_rewrites=(), quantize_logits=False) -> set[tuple[str, str]]:
    """(layer type, kernel) of every layer an NNCF INT8 build of the fixture runs at batch 1 on 1 thread."""
    from mnv3.profiling import openvino_layer_summary

    path, calibration = nncf_build(fp32_model_path, out_path, graph_rewrites, quantize_logits)
    layers = openvino_layer_summary(path, calibration[:1], runs=3, threads=1, precision="f32")
    return {(layer["layer_type"], layer["kernel"]) for layer in layers}


def test_an_nncf_build_remade_under_its_name_leaves_an_engine_serving_it_as_it_was(
    fp32_model_path, openvino_installed, tmp_path
):
    # OpenVINO maps an IR's weights, and stage 2 rewrote the .bin in place: a running server's answers changed
    # the moment a rerun of stage 2 wrote it (and a .bin cut short was a bus error).
    path, calibration = nncf_build(fp32_model_path, tmp_path / "int8.xml")
    engine = Engine.load(path, "openvino", max_batch_size=8)
    served = engine.predict(calibration)
    from mnv3.openvino_int8 import quantize_nncf_int8

    other_photos = np.stack([preprocess(decode_image(data)) for data in load_images(8, seed=12)])
    quantize_nncf_int8(fp32_model_path, path, other_photos)  # another build under the same name
    np.testing.assert_array_equal(engine.predict(calibration), served)
    assert not np.array_equal(Engine.load(path, "openvino", max_batch_size=8).predict(calibration), served)
    assert sorted(file.name for file in tmp_path.iterdir()) == ["int8.bin", "int8.xml"]


def test_an_ir_written_to_a_full_disk_is_the_oserror_a_stage_reports_in_one_line(
    fp32_model_path, openvino_installed, tmp_path, monkeypatch
):
    # OpenVINO's failed write is a RuntimeError ("basic_ios::clear: iostream error"), which a stage let
    # through as a traceback, where Python's own writes raise OSError(ENOSPC): one line, exit 2.
    import errno
    import shutil
    from types import SimpleNamespace

    import openvino as ov

    from mnv3.openvino_int8 import save_ir

    model = ov.convert_model(str(fp32_model_path))
    (tmp_path / "int8.xml").write_text("the last build")

    def fails(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(ov, "save_model", fails)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    with pytest.raises(OSError) as full:
        save_ir(model, tmp_path / "int8.xml")
    assert full.value.errno == errno.ENOSPC and full.value.filename == str(tmp_path / "int8.xml")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10**12))
    with pytest.raises(RuntimeError, match="iostream"):  # not a full disk: OpenVINO's error as it is
        save_ir(model, tmp_path / "int8.xml")
    assert sorted(file.name for file in tmp_path.iterdir()) == ["int8.xml"]  # the last build, untouched
    assert (tmp_path / "int8.xml").read_text() == "the last build"


def test_nncf_int8_weights_fit_in_7_bits(fp32_model_path, openvino_installed, tmp_path):
    """NNCF's overflow fix in every layer: the CPU plugin's INT8 kernels saturate their int16 sums without
    VNNI (NNCF's default fixed the first layer alone; on an AVX2-only EPYC its builds lost 2.3 dB of SQNR to
    the VNNI CPUs'). Each convolution's and MatMul's int8 weights lie in [-64, 64]; NNCF leaves the grouped
    (depthwise) convolutions at 8 bits."""
    import openvino as ov

    path, _ = nncf_build(fp32_model_path, tmp_path / "int8.xml", quantize_logits=True)

    def int8_weights(layer) -> np.ndarray:
        source = layer.input_value(1).get_node()  # through the Convert/Subtract/Multiply that dequantize it
        while source.get_type_name() != "Constant":
            source = source.input_value(0).get_node()
        assert source.get_element_type() == ov.Type.i8, layer.get_friendly_name()
        return source.get_data()

    layers = [
        op for op in ov.Core().read_model(path).get_ordered_ops() if op.get_type_name() in ("Convolution", "MatMul")
    ]
    assert len(layers) > 40  # MobileNetV3-Large: 47 convolutions besides the depthwise ones, 2 MatMuls
    for layer in layers:
        weights = int8_weights(layer)
        assert -64 <= weights.min() and weights.max() <= 64, (layer.get_friendly_name(), weights.min(), weights.max())


def is_int8(kernel: str) -> bool:
    return kernel.lower().endswith(("i8", "u8"))


# The rewrites stage 2's rewritten NNCF builds start from.
OPENVINO_REWRITES = OPENVINO_INT8_BUILDS["nncf_rewritten_int8.xml"].graph_rewrites


@pytest.mark.parametrize("graph_rewrites", [(), OPENVINO_REWRITES])
def test_nncf_int8_runs_every_convolution_as_int8(fp32_model_path, openvino_installed, tmp_path, graph_rewrites):
    """Built from the ONNX frontend's unfolded graph, NNCF quantized the depthwise weights ahead of the shape
    arithmetic the CPU plugin folds them through, back to f32: those convolutions ran in f32, with reorders."""
    kernels = {
        (layer_type, kernel)
        for layer_type, kernel in nncf_kernels(fp32_model_path, tmp_path / "int8.xml", graph_rewrites)
        if layer_type in ("Convolution", "GroupConvolution")
    }
    assert {layer_type for layer_type, _ in kernels} == {"Convolution", "GroupConvolution"}
    assert all(is_int8(kernel) for _, kernel in kernels), sorted(kernels)


def test_nncf_int8_pools_with_the_int8_pooling_kernel_after_the_rewrite(fp32_model_path, openvino_installed, tmp_path):
    """OpenVINO reads a GlobalAveragePool as a ReduceMean; written as an AveragePool (global_pool_to_avgpool,
    one of the rewritten builds' rewrites) every pool runs as an INT8 AvgPool layer and no ReduceMean is left."""
    assert "global_pool_to_avgpool" in OPENVINO_REWRITES
    plain = nncf_kernels(fp32_model_path, tmp_path / "plain.xml")
    pooled = nncf_kernels(fp32_model_path, tmp_path / "pooled.xml", ("global_pool_to_avgpool",))
    assert "ReduceMean" in {layer_type for layer_type, _ in plain}
    assert "ReduceMean" not in {layer_type for layer_type, _ in pooled}
    pools = [kernel for layer_type, kernel in pooled if layer_type == "AvgPool"]
    assert pools and all(map(is_int8, pools)), sorted(pooled)


def test_nncf_int8_keeps_the_logits_layer_in_floating_point_unless_asked(fp32_model_path, openvino_installed, tmp_path):
    """The classifier's two layers: by default the first runs INT8 and the logits layer floating point; with
    quantize_logits (stage 2's nncf_rewritten_full_int8.xml) both run INT8."""

    def classifier_kernels(quantize_logits: bool) -> list[str]:
        kernels = nncf_kernels(fp32_model_path, tmp_path / f"{quantize_logits}.xml", quantize_logits=quantize_logits)
        return sorted(kernel for layer_type, kernel in kernels if layer_type.startswith("FullyConnected"))

    default, full = classifier_kernels(False), classifier_kernels(True)
    assert sorted(map(is_int8, default)) == [False, True], default
    assert full and all(map(is_int8, full)), full
