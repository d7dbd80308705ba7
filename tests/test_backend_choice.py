"""`--backend auto`: stage 2's engine choice in the manifest, what the server and the in-process limit make of
it, the fallbacks and their reasons, the agreement guard, and that every engine variant computes the same network."""

import importlib.util
import logging
import shutil
import sys
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import REAL_WEIGHTS, engine_choice_entry
from mnv3.artifacts import CLASS_NAMES_JSON, FP32_ONNX, STATIC_INT8_ONNX, update_manifest
from mnv3.backend_choice import MANIFEST_KEY, choose, manifest_entry, resolve_auto
from mnv3.batching_benchmark import limit_engines
from mnv3.cli import QUICK
from mnv3.config import ServerConfig
from mnv3.engine import Engine, ModelLoadError
from mnv3.limit import run_limit
from mnv3.photos import load_images
from mnv3.preprocess import DEFAULT_DECODING, DEFAULT_PREPROCESSING
from mnv3.quantize import DEFAULT_RECIPE, RECIPES, calibration_photos, preprocess_photos, quantize_static_int8
from mnv3.server import create_app
from mnv3.variants import (
    Bench,
    EngineVariant,
    build_openvino_int8,
    candidates,
    engine_rows,
    engine_runner,
    engine_variants,
)

pytestmark = pytest.mark.e2e

# The random-init stand-in amplifies small perturbations layer by layer (see test_quantize.py): the same FP32
# network in another engine agrees exactly, INT8 only partly. Its bounds here are test_quantize's for static
# INT8; a model that outputs FP32's mean logits gets top-1 0.02, so they still tell a network from noise.
SAME_FP32_TOP1 = 0.99
INT8_TOP1 = 0.45


@pytest.fixture(scope="module")
def openvino_installed():
    pytest.importorskip("openvino", reason="optional backend: pip install -r requirements-openvino.txt")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    return calibration_photos(tmp_path_factory.mktemp("calibration"), 16)


@pytest.fixture(scope="module")
def models_dir(fp32_model_dir, calibration, tmp_path_factory):
    """FP32 and the shipped static INT8 recipe side by side, as stage 2 leaves them."""
    directory = tmp_path_factory.mktemp("engine_choice")
    for name in (FP32_ONNX, CLASS_NAMES_JSON):
        shutil.copy(fp32_model_dir / name, directory / name)
    quantize_static_int8(
        directory / FP32_ONNX, directory / STATIC_INT8_ONNX, preprocess_photos(calibration), RECIPES[DEFAULT_RECIPE]
    )
    return directory


def test_auto_serves_the_manifest_choice_and_explicit_backend_wins(models_dir, openvino_installed):
    update_manifest(models_dir, **{MANIFEST_KEY: engine_choice_entry("openvino", FP32_ONNX, "f32")})
    engine = Engine.load(models_dir / STATIC_INT8_ONNX, "auto")
    assert (engine.backend, engine.path.name, engine.providers) == ("openvino", FP32_ONNX, ["OpenVINO:CPU:f32"])
    assert engine.choice.requested == "auto" and not engine.choice.fallback
    assert engine.choice.reason.startswith("fastest of 3 engine x precision variants")
    explicit = Engine.load(models_dir / STATIC_INT8_ONNX, "onnxruntime")
    assert (explicit.backend, explicit.path.name, explicit.choice.reason) == (
        "onnxruntime",
        STATIC_INT8_ONNX,
        "--backend onnxruntime given",
    )


def test_auto_cuts_batches_into_the_part_size_stage_2_measured(models_dir, openvino_installed):
    """A part size in the choice compiles the parts up to it (and the server's batches run in them); a choice
    without one (stage 2 before part sizes were measured) keeps the backend's default."""
    from mnv3.openvino_backend import DEFAULT_PART_SIZE

    entry = engine_choice_entry("openvino", FP32_ONNX, "f32", streams=2)
    update_manifest(models_dir, **{MANIFEST_KEY: entry | {"part_size": 8}})
    engine = Engine.load(models_dir / STATIC_INT8_ONNX, "auto", max_batch_size=16)
    assert sorted(engine.session._parts) == [1, 2, 4, 8] and engine.choice.describe()["part_size"] == 8
    update_manifest(models_dir, **{MANIFEST_KEY: entry})
    default = Engine.load(models_dir / STATIC_INT8_ONNX, "auto", max_batch_size=16)
    assert max(default.session._parts) == DEFAULT_PART_SIZE and default.choice.part_size is None


def test_a_server_gives_batches_the_threads_stage_2_measured_fastest_under_load(models_dir, openvino_installed):
    """--batch-threads 0 (Engine.load's 0): the measured threads, for the intra-op threads stage 2 measured with;
    else, or without a measurement, half of them; a number given wins."""
    entry = engine_choice_entry("openvino", FP32_ONNX, "f32", streams=2) | {"threads": 2}
    update_manifest(models_dir, **{MANIFEST_KEY: entry | {"batch_threads": 2}})

    def batch_threads(given: int, intra_op_threads: int = 2) -> int:
        engine = Engine.load(
            models_dir / STATIC_INT8_ONNX, "auto", intra_op_threads, max_batch_size=8, batch_threads=given
        )
        return engine.session.batch_threads

    assert batch_threads(0) == 2 and batch_threads(1) == 1
    update_manifest(models_dir, **{MANIFEST_KEY: entry | {"batch_threads": 1}})
    assert batch_threads(0) == 1 and batch_threads(2) == 2
    assert batch_threads(0, intra_op_threads=4) == 2  # measured with 2 threads, not 4: half of 4
    update_manifest(models_dir, **{MANIFEST_KEY: entry})
    assert batch_threads(0) == 1


def test_auto_falls_back_to_onnxruntime_with_the_reason(models_dir, monkeypatch, caplog):
    # (test_engine_choice_rules.py has resolve_auto's other fallbacks; this one loads the model.)
    update_manifest(models_dir, **{MANIFEST_KEY: engine_choice_entry("openvino", STATIC_INT8_ONNX)})
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if openvino were not installed
    caplog.set_level(logging.INFO, logger="mnv3.engine")
    engine = Engine.load(models_dir / STATIC_INT8_ONNX, "auto")
    assert [(r.levelno, r.getMessage()) for r in caplog.records][-1] == (
        logging.WARNING,
        f"--backend auto: {STATIC_INT8_ONNX} with onnxruntime: {engine.choice.reason}",
    )
    assert (engine.backend, engine.path.name, engine.providers) == (
        "onnxruntime",
        STATIC_INT8_ONNX,
        ["CPUExecutionProvider"],
    )
    assert "openvino is not installed here" in engine.choice.reason


def test_a_choice_measured_on_another_machine_is_served_with_a_warning(models_dir, caplog):
    # an image built where stage 2 ran, served on another CPU: logged at INFO as "fastest ... on this machine"
    elsewhere = {"cpu": "Another CPU", "isa": "avx2"}
    update_manifest(models_dir, **{MANIFEST_KEY: engine_choice_entry("onnxruntime", STATIC_INT8_ONNX) | elsewhere})
    caplog.set_level(logging.INFO, logger="mnv3.engine")
    engine = Engine.load(models_dir / STATIC_INT8_ONNX, "auto")
    assert engine.choice.measured_elsewhere and (engine.backend, engine.path.name) == ("onnxruntime", STATIC_INT8_ONNX)
    assert [(r.levelno, r.getMessage()) for r in caplog.records][-1] == (
        logging.WARNING,
        f"--backend auto: {STATIC_INT8_ONNX} with onnxruntime: {engine.choice.reason}",
    )


def test_an_openvino_ir_is_served_by_openvino_or_refused_in_one_line(models_dir, tmp_path):
    ir = tmp_path / "mine.xml"
    ir.write_text("<net/>")
    auto = resolve_auto(ir)  # no choice applies: the fallback is the one engine that reads the file
    assert (auto.backend, auto.path, auto.fallback) == ("openvino", ir, True)
    assert auto.reason.endswith("serving mine.xml with openvino")
    with pytest.raises(ModelLoadError) as refused:  # was onnxruntime's "INVALID_PROTOBUF: Protobuf parsing failed"
        Engine.load(ir, "onnxruntime")
    assert str(refused.value) == (
        f"{ir} is an OpenVINO IR, which onnxruntime cannot read: serve it with openvino "
        "(--backend openvino or auto, or PATH@openvino)"
    )
    if importlib.util.find_spec("openvino") is not None:  # the one engine that reads it says what it could not
        with pytest.raises(ModelLoadError, match=f"^{ir} is not a loadable OpenVINO IR \\("):
            Engine.load(ir, "openvino")


def test_model_endpoint_says_what_was_chosen_and_why(models_dir, openvino_installed):
    entry = engine_choice_entry("openvino", FP32_ONNX, "f32")
    update_manifest(models_dir, **{MANIFEST_KEY: entry})
    with TestClient(create_app(ServerConfig(model=models_dir / STATIC_INT8_ONNX, max_batch_size=2))) as client:
        give_up = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < give_up, "warm-up did not finish"
            time.sleep(0.05)
        info = client.get("/model").json()
    assert (info["backend"], info["file"], info["providers"]) == ("openvino", FP32_ONNX, ["OpenVINO:CPU:f32"])
    choice = info["backend_choice"]
    assert (choice["requested"], choice["path"], choice["precision"], choice["fallback"]) == (
        "auto",
        FP32_ONNX,
        "f32",
        False,
    )
    assert choice["manifest_entry"] == entry and choice["reason"] == entry["reason"]


def test_stage5_limits_the_served_engine_and_onnxruntime_fp32_and_int8(models_dir, openvino_installed):
    update_manifest(models_dir, **{MANIFEST_KEY: engine_choice_entry("openvino", STATIC_INT8_ONNX, "f32")})
    engines = limit_engines(models_dir / STATIC_INT8_ONNX)
    assert list(engines) == ["openvino_static_int8_f32", "onnxruntime_fp32", "onnxruntime_static_int8"]
    limit, grid, finalists = run_limit(
        "openvino_static_int8_f32",
        engines["openvino_static_int8_f32"],
        load_images(4),
        decoding=DEFAULT_DECODING,
        batch_sizes=(1, 4),
        thread_splits=((1, 1),),
        confirm_passes=1,
        desc=None,
    )
    assert limit.engine == "openvino_static_int8_f32" and limit.images_per_s > 0 and len(grid) == len(finalists) == 2


@pytest.fixture(scope="module")
def measured_rows(models_dir, calibration, held_out):
    """Every installed engine x precision (NNCF builds too where nncf is installed) and a degraded variant
    that skips the network and returns noise, timed in turns with FP32 in --quick counts."""
    openvino_files = build_openvino_int8(models_dir / FP32_ONNX, preprocess_photos(calibration), models_dir)
    variants = engine_variants(STATIC_INT8_ONNX, openvino_files, 2)
    bench = Bench(
        2, QUICK.timing, 8, held_out[:16], None, REAL_WEIGHTS, "mobilenet_v3_large", 1000, "", DEFAULT_PREPROCESSING
    )
    runners = {variant: engine_runner(variant, models_dir, 2, 8) for variant in variants}
    rng = np.random.default_rng(0)
    runners[EngineVariant("degraded_noise", "onnxruntime", FP32_ONNX)] = lambda batch: rng.standard_normal(
        (len(batch), 1000)
    ).astype(np.float32)
    return {row["variant"]: row for row in engine_rows(models_dir / FP32_ONNX, runners, bench)}


def test_the_engine_tables_ratios_are_against_onnx_fp32_as_stage_1_times_it(models_dir, held_out, monkeypatch):
    """The yardstick is onnxruntime with its defaults (idle threads spin), as stage 1 times ONNX FP32. The
    server's onnxruntime FP32 (idle threads sleep, slower at batch 1) is a candidate row of its own: ratios
    against it would flatter every other engine."""
    import onnxruntime as ort

    opened = []

    class RecordingSession(ort.InferenceSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self.get_session_options().get_session_config_entry("session.intra_op.allow_spinning"))

    monkeypatch.setattr(ort, "InferenceSession", RecordingSession)
    bench = Bench(
        2, QUICK.timing, 4, held_out[:4], None, "random-init", "mobilenet_v3_large", 1000, "", DEFAULT_PREPROCESSING
    )
    rows = engine_rows(models_dir / FP32_ONNX, {}, bench)
    assert [row["variant"] for row in rows] == ["onnx_fp32", "onnxruntime_fp32"]
    assert opened == ["0", "1"]  # the served FP32 opens first, then measure_runners opens the reference
    assert rows[0]["mean_ms_vs_onnx_fp32"] == 1.0 and rows[0]["per_image_ms_vs_onnx_fp32"] == 1.0
    assert candidates(rows) == rows[1:] and "top1_agreement" not in rows[1]


@pytest.mark.slow
def test_every_engine_variant_computes_the_same_network(measured_rows):
    same_fp32 = [
        name
        for name, row in measured_rows.items()
        if row["file"] == FP32_ONNX
        and row["precision"] != "bf16"
        and name not in ("onnx_fp32", "onnxruntime_fp32", "degraded_noise")
    ]
    int8 = [name for name, row in measured_rows.items() if "int8" in row["file"] or row["precision"] == "bf16"]
    assert "onnxruntime_static_int8" in int8
    for name in same_fp32:
        assert measured_rows[name]["top1_agreement"] >= SAME_FP32_TOP1, name
    for name in int8:
        assert measured_rows[name]["top1_agreement"] >= INT8_TOP1, name
        assert measured_rows[name]["top5_agreement"] >= measured_rows[name]["top1_agreement"], name
    assert measured_rows["degraded_noise"]["top1_agreement"] < INT8_TOP1  # the bound tells noise apart


@pytest.mark.slow
def test_the_guard_refuses_a_degraded_variant_with_real_weights_only(measured_rows):
    rows = candidates(list(measured_rows.values()))
    chosen, refused = choose(rows, 0.99, guard_applies=True)
    assert chosen["variant"] != "degraded_noise"
    assert "degraded_noise" in refused and "< 0.99" in refused["degraded_noise"]
    assert all(float(measured_rows[name]["top1_agreement"]) < 0.99 for name in refused)
    # On the stand-in the guard means nothing and is not applied: the fastest wins, here the one that skips the work.
    unguarded, none_refused = choose(rows, 0.99, guard_applies=False)
    assert unguarded["variant"] == "degraded_noise" and none_refused == {}
    entry = manifest_entry(chosen, refused, STATIC_INT8_ONNX, len(rows), REAL_WEIGHTS, 0.99, 512, False, {})
    assert entry["guard_applied"] and "degraded_noise (top-1 agreement with FP32" in entry["reason"]
    stand_in = manifest_entry(unguarded, {}, STATIC_INT8_ONNX, len(rows), "random-init", 0.99, 64, False, {})
    assert not stand_in["guard_applied"] and stand_in["agreement_guard"].startswith("not applied")


@pytest.mark.parametrize("file_name", [FP32_ONNX, STATIC_INT8_ONNX])
def test_openvino_parts_of_a_batch_compute_each_photo_as_alone(models_dir, held_out, openvino_installed, file_name):
    """Every way a batch is cut (1..9 photos: parts of 4, 2 and 1 on one or two streams, parts of up to 8, or
    on one thread as a server runs them) gives each photo the logits it gets alone, and in its own row."""
    from mnv3.engine import open_session

    def session(**options):
        return open_session(models_dir / file_name, "openvino", 2, max_batch_size=8, precision="f32", **options)

    sessions = [session(streams=1), session(streams=2), session(batch_threads=1), session(streams=2, part_size=8)]
    assert sorted(sessions[-1]._parts) == [1, 2, 4, 8]
    alone = np.concatenate([sessions[0].run(None, {"input": photo[None]})[0] for photo in held_out[:9]])
    for session in sessions:
        for size in range(1, 10):
            np.testing.assert_allclose(
                session.run(None, {"input": held_out[:size]})[0], alone[:size], rtol=1e-4, atol=1e-5
            )


def test_batch_threads_run_the_parts_and_leave_a_single_image_every_thread(models_dir, openvino_installed):
    from mnv3.openvino_backend import OpenVINOSession

    def threads_and_streams(request):
        compiled = request.get_compiled_model()
        return compiled.get_property("INFERENCE_NUM_THREADS"), compiled.get_property("NUM_STREAMS")

    for streams, batch_threads, parts in [(2, None, (2, 2)), (2, 1, (1, 1)), (1, 1, (1, 1)), (2, 2, (2, 2))]:
        session = OpenVINOSession(models_dir / STATIC_INT8_ONNX, 2, "f32", 8, streams, batch_threads)
        assert threads_and_streams(session._alone) == (2, 1)
        assert {threads_and_streams(queue[0]) for queue in session._parts.values()} == {parts}
        assert session.batch_threads == parts[0]


def test_a_file_fixed_at_one_image_keeps_every_thread(models_dir, openvino_installed, tmp_path):
    import onnx

    from mnv3.openvino_backend import OpenVINOSession

    model = onnx.load(str(models_dir / FP32_ONNX))
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    batch.ClearField("dim_param")
    batch.dim_value = 1
    onnx.save(model, str(tmp_path / "fixed1.onnx"))
    session = OpenVINOSession(tmp_path / "fixed1.onnx", 2, "f32", 1, streams=2, batch_threads=1)
    [queue] = session._parts.values()
    assert queue[0].get_compiled_model().get_property("INFERENCE_NUM_THREADS") == 2
    assert session.batch_threads == 2  # what /model reports


def test_a_batch_is_cut_into_the_compiled_sizes(openvino_installed):
    from mnv3.openvino_backend import split_batch

    assert split_batch(13, [1, 2, 4]) == [4, 4, 4, 1]
    assert split_batch(32, [1, 2, 4]) == [4] * 8
    assert split_batch(7, [4, 2, 1]) == [4, 2, 1]
    assert split_batch(6, [3]) == [3, 3]  # a file with a fixed batch axis of 3
    # on several streams no part is larger than a stream's share, so no stream idles while another works
    assert split_batch(16, [1, 2, 4, 8, 16]) == [16]
    assert split_batch(16, [1, 2, 4, 8, 16], streams=2) == [8, 8]
    assert split_batch(32, [1, 2, 4, 8, 16], streams=2) == [16, 16]
    assert split_batch(5, [1, 2, 4], streams=2) == [2, 2, 1]
    assert split_batch(6, [3], streams=4) == [3, 3]
    with pytest.raises(ValueError, match="cannot be cut into the compiled sizes"):
        split_batch(5, [3])
