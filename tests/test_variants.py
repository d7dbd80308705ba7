"""mnv3.variants' combined table (model_variants.csv)."""

import pytest

from mnv3.variants import compare_variants

pytestmark = pytest.mark.unit


def row(variant: str, mean_ms: float, **ratio) -> dict:
    return {"variant": variant, "mean_ms": mean_ms, "threads": 2, "batch_size": 32} | ratio


def test_each_variant_keeps_its_own_same_run_ratio_not_its_mean_over_stage_1s_fp32():
    table = compare_variants(
        [
            row("onnx_fp32", 4.0, mean_ms_vs_onnx_fp32=1.0),
            # a burst in one of its turns: its mean over FP32's would say 1.5, its rounds' median 0.9
            row("openvino_fp32", 6.0, mean_ms_vs_onnx_fp32=0.9),
            # stage 2's row, timed in turns with stage 2's FP32 (slower that run)
            row("onnx_static_int8", 4.0, mean_ms_vs_onnx_fp32=0.7),
        ]
    )
    assert [(r["variant"], r["mean_vs_onnx_fp32"]) for r in table] == [
        ("ONNX FP32", 1.0),
        ("OpenVINO FP32", 0.9),
        ("ONNX Static INT8", 0.7),
    ]


def test_a_stage_1_csv_without_ratio_columns_is_compared_by_its_means():
    """01_baseline.csv from before stage 1 recorded its ratios (stage 2 rerun alone on an older results dir)."""
    table = compare_variants(
        [row("onnx_fp32", 4.0), row("openvino_fp32", 3.0), row("onnx_static_int8", 2.0, mean_ms_vs_onnx_fp32=0.7)]
    )
    assert [r["mean_vs_onnx_fp32"] for r in table] == [1.0, 0.75, 0.7]
