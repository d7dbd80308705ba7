"""How far a variant is from the silicon: the network's multiply-accumulates (MACs) per image, counted from
its ONNX graph, against the fastest large matrix product OpenVINO runs on this CPU in each precision.

A variant's rate is its MACs per image over its per-image time at the benchmark's batch size; its share
of the peak of the precision it computes in (`compute_precision`) says how much of the CPU's arithmetic
it turns into the network's. The peak is measured, not derived from clock and vector widths: a VM's clock
is not known, and a large product is the best case of the same kernels the convolutions use. OpenVINO runs
a product with one of two kernel families, a MatMul's or a convolution's (the network's pointwise layers are
1x1 convolutions), and which is faster depends on the CPU (without VNNI, the INT8 convolution kernel is far
ahead of the INT8 MatMul's), so each shape runs in both forms and the best counts. Depthwise
convolutions, element-wise ops and memory traffic keep a network well below a product's rate, so a share
says how far the ceiling is, not that 1.0 is reachable.
"""

import itertools
import math
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from mnv3.latency import warm_up_turn

# Large enough to be compute bound (activations and weights of MBs, not KBs); two shapes, the best kept, as a
# single shape can land on a slow blocking of some kernel. M is a square number of pixels for the 1x1 convolution.
GEMM_SHAPES = ((256, 1024, 1024), (1024, 1024, 1024))  # (M, K, N): an (M, K) input times a (K, N) weight
GEMM_FORMS = ("matmul", "conv1x1")  # the same product through OpenVINO's MatMul and convolution kernels
GEMM_CALLS = 5  # a timed burst; the best of GEMM_BURSTS bursts counts, as other load only ever slows a burst
GEMM_BURSTS = 5
# Untimed calls first, by time (not one call): after its compile's idle gap a model's first calls run markedly
# slower on a shared VM (as in mnv3.latency), for longer than all the bursts take, so with a single untimed
# call every burst could land in that recovery and the peak come out far too low.
GEMM_WARMUP_S = 0.2
PEAK_PRECISIONS = ("f32", "bf16", "int8")


def count_macs(onnx_path: Path) -> int:
    """Multiply-accumulates per image of a float ONNX model: its Conv, Gemm and MatMul nodes at batch 1.

    Shapes come from ONNX shape inference with the batch axis set to 1. Other ops (activations, pooling,
    additions) are not MACs and are not counted."""
    import onnx
    from onnx import shape_inference

    model = onnx.load(str(onnx_path))
    weights = {init.name for init in model.graph.initializer}  # older exports list them as inputs too
    for graph_input in model.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        if graph_input.name not in weights and dims:
            dims[0].ClearField("dim_param")
            dims[0].dim_value = 1
    graph = shape_inference.infer_shapes(model).graph
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        shapes[value.name] = [dim.dim_value for dim in value.type.tensor_type.shape.dim]

    def shape(node, name: str) -> list[int]:
        # A dim shape inference could not resolve reads 0: counting it would undercount in silence.
        if not shapes.get(name) or min(shapes[name]) <= 0:
            raise ValueError(f"{onnx_path}: the shape of {name!r} ({node.op_type} {node.name!r}) is not known")
        return shapes[name]

    macs = 0
    for node in graph.node:
        if node.op_type == "Conv":
            # Every output element sums over its group's input channels times the kernel window.
            macs += int(np.prod(shape(node, node.output[0]))) * int(np.prod(shape(node, node.input[1])[1:]))
        elif node.op_type in ("Gemm", "MatMul"):
            trans_a = any(a.name == "transA" and a.i for a in node.attribute)
            a_shape = shape(node, node.input[0])
            inner = a_shape[-2] if trans_a else a_shape[-1]
            macs += int(np.prod(shape(node, node.output[0]))) * inner
    if not macs:
        raise ValueError(f"{onnx_path}: no Conv, Gemm or MatMul: not a float ONNX model")
    return macs


def compute_precision(file: str, fp32_file: str, precision: str) -> str:
    """The precision a variant's heavy ops compute in: int8 for a quantized file (every file but `fp32_file`),
    else OpenVINO's precision hint (bf16 or f32); onnxruntime computes an FP32 file in f32."""
    if file != fp32_file:
        return "int8"
    return "bf16" if precision == "bf16" else "f32"


def gemm_peaks(threads: int, precisions: Iterable[str] = PEAK_PRECISIONS) -> dict[str, float]:
    """GMAC/s of the fastest large matrix product OpenVINO's CPU plugin runs here with `threads` threads, as a
    MatMul or as a 1x1 convolution, per precision (bf16 only where the CPU computes it natively); {} without
    openvino."""
    try:
        from mnv3.openvino_backend import DEVICE, bf16_supported, latency_config, shared_core
    except ModuleNotFoundError as exc:
        if exc.name != "openvino":
            raise
        return {}
    core = shared_core()
    peaks = {}
    for precision in precisions:
        if precision == "bf16" and not bf16_supported():
            continue
        config = latency_config(threads, "bf16" if precision == "bf16" else "f32")
        rates = []
        for (m, k, n), form in itertools.product(GEMM_SHAPES, GEMM_FORMS):
            compiled = core.compile_model(gemm_model(m, k, n, int8=precision == "int8", form=form), DEVICE, config)
            x = np.random.default_rng(0).uniform(0, 1, tuple(compiled.input(0).shape)).astype(np.float32)
            rates.append(m * k * n / _best_seconds(compiled.create_infer_request(), x) / 1e9)
        peaks[precision] = round(max(rates), 1)
    return peaks


def _best_seconds(request, x: np.ndarray) -> float:
    """The fastest of GEMM_BURSTS bursts of GEMM_CALLS calls, per call, after GEMM_WARMUP_S of untimed calls
    (the first of which allocates)."""
    warm_up_turn(lambda batch: request.infer({0: batch}), x, GEMM_WARMUP_S)
    best = float("inf")
    for _ in range(GEMM_BURSTS):
        started = time.perf_counter()
        for _ in range(GEMM_CALLS):
            request.infer({0: x})
        best = min(best, (time.perf_counter() - started) / GEMM_CALLS)
    return best


def gemm_model(m: int, k: int, n: int, int8: bool, form: str = "matmul"):
    """An OpenVINO model multiplying an (m, k) input by a constant (k, n) weight: a MatMul, or with `form`
    "conv1x1" the same product as a 1x1 convolution from k to n channels over a square image of m pixels. With
    `int8`, both sides go through FakeQuantize (u8 activations, symmetric i8 weights), which the CPU plugin runs
    as an INT8 product, as it does a quantized convolution."""
    import openvino as ov
    import openvino.opset13 as ops

    weight = np.random.default_rng(1).uniform(-1, 1, (k, n)).astype(np.float32)
    if form == "matmul":
        x = ops.parameter([m, k], np.float32)
        w = ops.constant(weight)
    elif form == "conv1x1":
        side = math.isqrt(m)
        if side * side != m:
            raise ValueError(f"a 1x1 convolution's product needs a square number of pixels, not {m}")
        x = ops.parameter([1, k, side, side], np.float32)
        w = ops.constant(np.ascontiguousarray(weight.T.reshape(n, k, 1, 1)))
    else:
        raise ValueError(f"form is one of {GEMM_FORMS}, not {form!r}")
    a, b = x, w
    if int8:
        zero, one = np.float32(0), np.float32(1)
        a = ops.fake_quantize(x, zero, one, zero, one, 256)
        b = ops.fake_quantize(w, -one, one, -one, one, 255)
    if form == "matmul":
        product = ops.matmul(a, b, False, False)
    else:
        product = ops.convolution(a, b, strides=[1, 1], pads_begin=[0, 0], pads_end=[0, 0], dilations=[1, 1])
    return ov.Model([product], [x])


def silicon_columns(row: dict, fp32_file: str, macs: int, peaks: dict[str, float]) -> dict:
    """An engine row's precision, MAC rate at its batch size and share of that precision's peak (None where no
    peak was measured for it)."""
    computes_in = compute_precision(row["file"], fp32_file, row["precision"])
    peak = peaks.get(computes_in)
    rate = macs / (float(row["per_image_ms"]) / 1000) / 1e9
    return {
        "computes_in": computes_in,
        "gmac_per_s": round(rate, 1),
        "peak_gmac_per_s": peak,
        "of_peak": round(rate / peak, 3) if peak else None,
    }
