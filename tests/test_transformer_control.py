"""The transformer control in quick mode: a tiny random-init ViT through stage 1's export, dynamic INT8,
interleaved timing, agreement and profiling, giving rows with stage 1's columns."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from mnv3 import transformer_control
from mnv3.accuracy import held_out_batch
from mnv3.cli import QUICK
from mnv3.model import EXPORT_TOLERANCE
from mnv3.report import read_csv
from mnv3.runtime import make_session, ort_runner
from mnv3.transformer_control import INTEGER_MATMUL_OPS, QUICK_CONTROL_VIT, build_vit

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SHAPE = QUICK_CONTROL_VIT  # what --quick builds
THREADS = 2
# Measured on the quick ViT and the 16 quick held-out photos: dynamic INT8 agreed on top-1 for all 16
# at ~30 dB SQNR; answering FP32's mean logits for every photo gets 0.0 and ~2 dB.
MIN_TOP1_AGREEMENT = 0.8
MIN_SQNR_DB = 20.0


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    artifacts_dir = tmp_path_factory.mktemp("transformer_control")
    held_out = held_out_batch(QUICK.held_out_images)
    result = transformer_control.transformer_control(
        SHAPE, held_out, QUICK.timing, QUICK.batch_size, THREADS, QUICK.profile_runs, artifacts_dir
    )
    return result, artifacts_dir, held_out


def test_rows_have_stage_1_columns_filled(control):
    result, _, _ = control
    assert [row["variant"] for row in result.rows] == ["onnx_fp32", "onnx_dynamic_int8"]
    stage_1_columns = set(read_csv(ROOT / "results" / "01_baseline.csv")[0])
    fp32, int8 = result.rows
    agreement_columns = {"top1_agreement", "top5_agreement", "sqnr_db"}  # FP32 is the reference
    stage_1_columns -= {"model_id"}  # which of stage 1's models a row measured: the control is another model
    assert stage_1_columns <= set(int8) and stage_1_columns - agreement_columns <= set(fp32)
    assert "model_id" not in fp32 and "model_id" not in int8
    for row in result.rows:
        assert row["model"] == SHAPE.name and row["weights"] == "random-init"
        assert row["threads"] == THREADS and row["batch_size"] == QUICK.batch_size
        assert 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["mean_ms"] > 0
        assert row["per_image_ms"] > 0 and row["calls"] >= QUICK.timing.iters
    assert float(fp32["export_max_abs_diff"]) <= EXPORT_TOLERANCE and int8["export_max_abs_diff"] == ""
    assert 0 < int8["size_mb"] < 0.5 * fp32["size_mb"]  # INT8 weights; LayerNorms and biases stay FP32


def test_dynamic_int8_agrees_with_its_fp32(control):
    result, artifacts_dir, held_out = control
    int8 = result.rows[1]
    assert int8["top1_agreement"] >= MIN_TOP1_AGREEMENT and int8["sqnr_db"] >= MIN_SQNR_DB
    assert int8["top1_agreement"] <= int8["top5_agreement"] <= 1
    # Agreement means something only if FP32 tells the photos apart (a zero head would give every
    # photo class 0, and agreement 1.0 for free).
    fp32_logits = ort_runner(make_session(artifacts_dir / f"{SHAPE.name}_fp32.onnx", THREADS))(held_out)
    assert len(set(fp32_logits.argmax(axis=1))) > 1


def test_dynamic_int8_weights_fit_in_7_bits(control):
    """reduce_range: ORT's U8xS8 MatMul kernels saturate their int16 sums on CPUs without VNNI unless the
    weights fit in 7 bits, symmetric [-64, 64] (255 * 64 * 2 < 2**15). With 8, on an AVX2-only EPYC, the
    quick control's SQNR fell below 12 dB and its top-1 agreement to 0.62."""
    _, artifacts_dir, _ = control
    model = onnx.load(str(artifacts_dir / f"{SHAPE.name}_dynamic_int8.onnx"))
    weights = [numpy_helper.to_array(init) for init in model.graph.initializer if init.data_type == TensorProto.INT8]
    assert weights and all(-64 <= w.min() and w.max() <= 64 for w in weights)


def test_profile_names_integer_matmuls_for_every_weight_matmul(control):
    result, artifacts_dir, _ = control
    calls = {row["op_type"]: row["calls_per_run"] for row in result.profile}
    model = build_vit(SHAPE)
    # Each attention block has a packed q/k/v projection (not an nn.Linear) besides its Linears.
    weight_matmuls = sum(isinstance(m, (torch.nn.Linear, torch.nn.MultiheadAttention)) for m in model.modules())
    assert sum(calls.get(op, 0) for op in INTEGER_MATMUL_OPS) == weight_matmuls
    # The patch embedding is the only conv, so the only ConvInteger; MobileNetV3's are all convs.
    assert calls.get("ConvInteger", 0) == sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == 1
    assert (artifacts_dir / f"{SHAPE.name}_dynamic_int8_profile.json").exists()
    assert sum(row["share_pct"] for row in result.profile) == pytest.approx(100, abs=0.1)


def test_random_init_is_seeded_with_a_live_head():
    first, second = build_vit(SHAPE), build_vit(SHAPE)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert first.heads.head.weight.abs().sum() > 0  # torchvision's zero init would make every logit 0
    image = torch.from_numpy(np.ascontiguousarray(held_out_batch(QUICK.held_out_images)[:2]))
    with torch.inference_mode():
        logits = first(image)
    assert logits.abs().max() > 0.1


def test_cli_quick_prints_rows_ratios_and_ops(tmp_path, capsys):
    parser = transformer_control.get_args_parser()
    transformer_control.main(parser.parse_args(["--quick", "--artifacts-dir", str(tmp_path)]))
    out = capsys.readouterr().out
    assert "| onnx_dynamic_int8 |" in out and "top1_agreement" in out and "random-init" in out
    assert "dynamic INT8 / FP32: batch 1" in out and "DynamicQuantizeMatMul" in out


def test_cli_rejects_zero_threads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        transformer_control.get_args_parser().parse_args(["--threads", "0"])
    assert exit_info.value.code == 2 and "--threads" in capsys.readouterr().err
