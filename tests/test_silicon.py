"""How far variants are from the silicon: the MAC count of an ONNX graph, the measured GEMM peaks and
OpenVINO's per-layer profile."""

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mnv3.silicon import compute_precision, count_macs, silicon_columns


def tiny_model(path, weights_as_inputs: bool = False):
    """Input (N, 3, 8, 8) -> 3x3 conv to 4 channels -> 3x3 depthwise -> global pool -> Gemm to 10 -> MatMul to 2.
    `weights_as_inputs`: the weights listed as graph inputs too, as older exporters did."""

    def weight(name, *shape):
        return numpy_helper.from_array(np.ones(shape, np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=4),
        helper.make_node("GlobalAveragePool", ["c2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w3"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "w4"], ["y"]),
    ]
    weights = [weight("w1", 4, 3, 3, 3), weight("w2", 4, 1, 3, 3), weight("w3", 10, 4), weight("w4", 10, 2)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, list(w.dims)) for w in weights]
    graph = helper.make_graph(
        nodes, "tiny", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], weights
    )
    onnx.save(helper.make_model(graph), path)
    return path


@pytest.mark.unit
def test_count_macs_counts_convs_by_group_and_matrix_products_at_batch_1(tmp_path):
    # conv: 4x8x8 outputs x 3x3x3; depthwise: 4x8x8 x 1x3x3; Gemm: 10 outputs x 4; MatMul: 2 outputs x 10
    assert count_macs(tiny_model(tmp_path / "tiny.onnx")) == 256 * 27 + 256 * 9 + 10 * 4 + 2 * 10


@pytest.mark.unit
def test_count_macs_leaves_weights_listed_as_inputs_alone(tmp_path):
    assert count_macs(tiny_model(tmp_path / "old.onnx", weights_as_inputs=True)) == count_macs(
        tiny_model(tmp_path / "new.onnx")
    )


@pytest.mark.unit
def test_count_macs_refuses_a_product_whose_shape_is_unknown(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="classifier")],
        "unknown",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "features"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(np.ones((4, 2), np.float32), "w")],
    )
    onnx.save(helper.make_model(graph), tmp_path / "unknown.onnx")
    with pytest.raises(ValueError, match="'x' \\(MatMul 'classifier'\\) is not known"):
        count_macs(tmp_path / "unknown.onnx")


@pytest.mark.unit
def test_count_macs_refuses_a_graph_without_products(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph), tmp_path / "relu.onnx")
    with pytest.raises(ValueError, match="no Conv, Gemm or MatMul"):
        count_macs(tmp_path / "relu.onnx")


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["large", "small"])
def test_count_macs_of_the_export_equals_torchvisions_own_figure(arch, request):
    from torchvision.models import MobileNet_V3_Large_Weights, MobileNet_V3_Small_Weights

    path = request.getfixturevalue({"large": "fp32_model_path", "small": "fp32_small_model_path"}[arch])
    weights = {"large": MobileNet_V3_Large_Weights, "small": MobileNet_V3_Small_Weights}[arch]
    # torchvision's model card lists the network's multiply-accumulates (as "GFLOPS") to three places.
    assert round(count_macs(path) / 1e9, 3) == weights.IMAGENET1K_V1.meta["_ops"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("file", "precision", "expected"),
    [
        ("fp32.onnx", "auto", "f32"),  # onnxruntime
        ("fp32.onnx", "f32", "f32"),
        ("fp32.onnx", "bf16", "bf16"),
        ("static_int8.onnx", "auto", "int8"),
        ("static_int8.onnx", "bf16", "int8"),  # bf16 only for what is not quantized
        ("nncf_int8.xml", "f32", "int8"),
    ],
)
def test_compute_precision_is_int8_for_every_quantized_file(file, precision, expected):
    assert compute_precision(file, "fp32.onnx", precision) == expected


@pytest.mark.unit
def test_silicon_columns_are_the_mac_rate_over_the_peak_of_the_rows_precision():
    row = {"file": "static_int8.onnx", "precision": "f32", "per_image_ms": 0.5}
    columns = silicon_columns(row, "fp32.onnx", 200_000_000, {"f32": 100.0, "int8": 800.0})
    assert columns == {"computes_in": "int8", "gmac_per_s": 400.0, "peak_gmac_per_s": 800.0, "of_peak": 0.5}
    bf16 = silicon_columns(row | {"file": "fp32.onnx", "precision": "bf16"}, "fp32.onnx", 200_000_000, {"f32": 1.0})
    assert bf16["computes_in"] == "bf16" and bf16["peak_gmac_per_s"] is None and bf16["of_peak"] is None


@pytest.fixture(scope="module")
def openvino():
    return pytest.importorskip("openvino", reason="optional backend: pip install -r requirements-openvino.txt")


def runtime_precisions(compiled, layer_type: str) -> set[str]:
    return {
        op.get_rt_info()["runtimePrecision"].astype(str)
        for op in compiled.get_runtime_model().get_ops()
        if op.get_rt_info()["layerType"].astype(str) == layer_type
    }


@pytest.mark.integration
@pytest.mark.parametrize(("form", "layer_type"), [("matmul", "FullyConnected"), ("conv1x1", "Convolution")])
@pytest.mark.parametrize(("int8", "expected"), [(False, {"f32"}), (True, {"u8"})])
def test_the_peak_gemm_runs_in_the_precision_it_is_the_peak_of(openvino, form, layer_type, int8, expected):
    from mnv3.silicon import gemm_model

    compiled = openvino.Core().compile_model(
        gemm_model(64, 128, 128, int8=int8, form=form), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    assert runtime_precisions(compiled, layer_type) == expected


@pytest.mark.integration
def test_the_peak_gemm_computes_the_same_product_as_a_matmul_and_as_a_1x1_convolution(openvino):
    """The convolution form counts m * k * n MACs only if it is the same product: its pixels are the rows."""
    from mnv3.silicon import gemm_model

    core = openvino.Core()
    x = np.random.default_rng(0).uniform(0, 1, (64, 96)).astype(np.float32)
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    matmul = core.compile_model(gemm_model(64, 96, 32, int8=False), "CPU", config)({0: x})[0]
    conv = core.compile_model(gemm_model(64, 96, 32, int8=False, form="conv1x1"), "CPU", config)(
        {0: x.T.reshape(1, 96, 8, 8)}
    )[0]
    assert matmul.shape == (64, 32) and conv.shape == (1, 32, 8, 8)
    np.testing.assert_allclose(conv.reshape(32, 64).T, matmul, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="square number of pixels"):
        gemm_model(60, 96, 32, int8=False, form="conv1x1")


@pytest.mark.integration
def test_gemm_peaks_measures_each_precision_the_cpu_runs(openvino):
    from mnv3.openvino_backend import bf16_supported
    from mnv3.silicon import gemm_peaks

    peaks = gemm_peaks(threads=2)
    assert set(peaks) == {"f32", "int8"} | ({"bf16"} if bf16_supported() else set())
    assert all(rate > 0 for rate in peaks.values())


@pytest.mark.integration
@pytest.mark.parametrize("faster", ["matmul", "conv1x1"])
def test_gemm_peaks_counts_the_faster_of_the_two_forms(openvino, monkeypatch, faster):
    """Which kernel family is faster depends on the CPU (the INT8 convolution's, without VNNI): either may set
    the peak. A 16 x 16 x 16 product (4096 MACs) timed as 2 GMAC/s in the faster form, 0.5 in the other."""
    import mnv3.silicon as silicon

    monkeypatch.setattr(silicon, "GEMM_SHAPES", ((16, 16, 16),))

    def best_seconds(request, x):
        return 4096 / (2e9 if (x.ndim == 4) == (faster == "conv1x1") else 0.5e9)

    monkeypatch.setattr(silicon, "_best_seconds", best_seconds)
    assert silicon.gemm_peaks(threads=1, precisions=("f32", "int8")) == {"f32": 2.0, "int8": 2.0}


class SlowAfterCompile:
    """An infer request whose calls take 2 ms for its first 100 ms, as a fresh model's do after an idle gap,
    then 0.1 ms."""

    def __init__(self):
        self.created = time.perf_counter()

    def infer(self, inputs):
        time.sleep(0.002 if time.perf_counter() - self.created < 0.1 else 0.0001)


@pytest.mark.unit
def test_the_peak_is_timed_after_the_recovery_from_the_compile():
    """All the bursts together take less than the recovery: with one untimed call every burst was slow."""
    from mnv3.silicon import GEMM_BURSTS, GEMM_CALLS, _best_seconds

    assert GEMM_BURSTS * GEMM_CALLS * 0.002 <= 0.1 / 2  # the slow spell outlasts the bursts twice over
    assert _best_seconds(SlowAfterCompile(), np.zeros(1)) < 0.001


@pytest.mark.integration
def test_openvino_layer_summary_splits_the_time_by_layer_and_kernel(openvino, fp32_model_path, held_out, tmp_path):
    from mnv3.profiling import openvino_layer_summary
    from mnv3.silicon import gemm_model

    fp32 = openvino_layer_summary(fp32_model_path, held_out[:2], runs=2, threads=1, precision="f32")
    assert sum(row["share_pct"] for row in fp32) == pytest.approx(100, abs=0.5)
    assert [row["ms_per_run"] for row in fp32] == sorted((row["ms_per_run"] for row in fp32), reverse=True)
    assert "Convolution" in {row["layer_type"] for row in fp32}
    assert not any("I8" in row["kernel"] for row in fp32)
    openvino.save_model(gemm_model(64, 128, 128, int8=True), tmp_path / "gemm.xml")
    x = np.random.default_rng(0).uniform(0, 1, (64, 128)).astype(np.float32)
    int8 = openvino_layer_summary(tmp_path / "gemm.xml", x, runs=2, threads=1, precision="f32")
    [product] = [row for row in int8 if row["layer_type"].startswith("FullyConnected")]
    assert "I8" in product["kernel"] and product["calls_per_run"] == 1
