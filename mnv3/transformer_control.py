"""The control for stage 1's dynamic-INT8 finding: the same harness on a transformer classifier.

Stage 1 times MobileNetV3's dynamic INT8 against FP32 (results/01_baseline.csv); where it is slower, its
profile says why (`ConvInteger`). On its own
that cannot tell a reader whether dynamic quantization is simply broken on the machine. This module
runs the same steps on a vision transformer built with torchvision's `VisionTransformer`: the same
`export_onnx` (TorchScript exporter, opset 17, dynamic batch), the same `quantize_dynamic_int8`
(`quant_pre_process` + `quantize_dynamic`, QInt8 weights; the pre-processing without ORT's symbolic
shape inference, which fails on torch's exported attention; 7-bit weights, `reduce_range`, since ORT's
integer MatMul kernels saturate without VNNI: on an AVX2-only CPU full-range weights put the control's
INT8 logits as far from its FP32 as MobileNetV3's, so it would control nothing), FP32 and dynamic INT8 timed in turns by
`interleaved_benchmark` with the stage's own timing and threads, agreement with its FP32 on the same
held-out photos, and the ORT profile of the INT8 model. A transformer's time is in `MatMul`s, which
dynamic quantization turns into `MatMulInteger`/`DynamicQuantizeMatMul`: integer kernels ORT does
have fast, where a conv net's `ConvInteger` has none.

Which ViT: ViT-Ti/16's shape (12 layers, hidden 192, 3 heads, MLP 768: DeiT-Tiny's encoder) by
default, not torchvision's `vit_b_16`. ViT-B/16 takes 17.6 G multiply-adds a 224x224 image, ViT-Ti
1.3 G (MobileNetV3-Large 0.22 G). Stage 1's timing (`latency.Timing`, plus warm-up, agreement and
profiling) is mostly batch-32 calls, so the row's time scales with the multiply-adds: ViT-Ti's about 14
times less than ViT-B's.
ViT-Ti is still a transformer of the standard shape: a patch-embedding conv, then MatMuls, softmax
and LayerNorm. `--quick` builds a 2-layer, hidden-64 ViT that runs in seconds.

Weights are a seeded random init (labelled `random-init` in every row), as for the stand-in
MobileNetV3. torchvision zero-initialises the classifier head (it is meant for fine-tuning), which
would make every logit 0 and agreement meaningless, so the head gets `nn.Linear`'s default init.
A ViT has LayerNorm, not BatchNorm, so no statistics need re-estimating.
"""

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.models.vision_transformer import VisionTransformer

from mnv3 import cli
from mnv3.accuracy import array_batches, evaluate, held_out_batch, predict
from mnv3.artifacts import ARTIFACTS_DIR, STAND_IN_PROVENANCE
from mnv3.engine import model_size_mb
from mnv3.latency import Timing, interleaved_benchmark
from mnv3.model import RANDOM_INIT_SEED, check_export, export_onnx
from mnv3.preprocess import CROP_SIZE
from mnv3.profiling import op_type_summary, profile_model
from mnv3.quantize import quantize_dynamic_int8
from mnv3.report import machine_columns, markdown_table
from mnv3.runtime import DEFAULT_INTRA_OP_THREADS, make_session, ort_runner

INTEGER_MATMUL_OPS = ("MatMulInteger", "DynamicQuantizeMatMul")


@dataclass(frozen=True)
class ViTShape:
    name: str
    num_layers: int
    num_heads: int
    hidden_dim: int
    mlp_dim: int
    patch_size: int = 16


CONTROL_VIT = ViTShape("vit_ti_16", num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768)
QUICK_CONTROL_VIT = ViTShape("vit_2x64", num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128)  # --quick


def control_vit(quick: bool) -> ViTShape:
    return QUICK_CONTROL_VIT if quick else CONTROL_VIT


@dataclass(frozen=True)
class ControlResult:
    """`rows`: stage 1's `01_baseline.csv` columns plus `model`, one row each for onnx_fp32 and
    onnx_dynamic_int8; `profile`: the INT8 model's `op_type_summary` rows, largest share first."""

    rows: list[dict]
    profile: list[dict]


def build_vit(shape: ViTShape) -> VisionTransformer:
    """A seeded random-init ViT for 224x224 inputs (the held-out photos' crop) in eval mode."""
    torch.manual_seed(RANDOM_INIT_SEED)
    model = VisionTransformer(
        image_size=CROP_SIZE,
        patch_size=shape.patch_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        hidden_dim=shape.hidden_dim,
        mlp_dim=shape.mlp_dim,
    )
    model.heads.head.reset_parameters()  # torchvision's zero init would make every logit 0
    return model.eval()


def transformer_control(
    shape: ViTShape,
    held_out: np.ndarray,
    timing: Timing,
    batch_size: int,
    threads: int,
    profile_runs: int,
    artifacts_dir,
) -> ControlResult:
    """Export `shape`'s ViT, quantize it dynamically, time FP32 and INT8 in turns, compare, profile INT8.

    `held_out` is the preprocessed photos stage 1 compares its variants on; `timing`, `batch_size` and
    `threads` are the stage's, so the two models' rows are measured alike.
    """
    artifacts_dir = Path(artifacts_dir)
    torch.set_num_threads(threads)
    model = build_vit(shape)
    with warnings.catch_warnings():
        # torch's attention compares tensor shapes with Python ints while tracing; here they are
        # constants of the model (only the batch varies), so the trace is right and the warnings noise.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        fp32_path = export_onnx(model, artifacts_dir / f"{shape.name}_fp32.onnx")
    fp32_run = ort_runner(make_session(fp32_path, threads))
    export_diff = check_export(model, fp32_run, held_out, (1, batch_size))
    # ORT's symbolic shape inference cannot follow exported attention's shape arithmetic; ONNX's still runs.
    int8_path = quantize_dynamic_int8(
        fp32_path, artifacts_dir / f"{shape.name}_dynamic_int8.onnx", symbolic_shapes=False, reduce_range=True
    )
    int8_run = ort_runner(make_session(int8_path, threads))

    reference = predict(fp32_run, array_batches(held_out, batch_size))
    variants = {"onnx_fp32": (fp32_run, fp32_path), "onnx_dynamic_int8": (int8_run, int8_path)}
    latency = interleaved_benchmark(
        {variant: run for variant, (run, _) in variants.items()}, held_out, batch_size, timing, reference="onnx_fp32"
    )
    rows = [
        {
            "model": shape.name,
            "variant": variant,
            **latency[variant],
            "size_mb": model_size_mb(path),
            "threads": threads,
            "weights": STAND_IN_PROVENANCE,
            "arch": "vision_transformer",
            "classes": model.num_classes,
            "bn_recalibration_images": 0,
            "export_max_abs_diff": f"{export_diff:.2e}" if variant == "onnx_fp32" else "",
            # Its own ONNX FP32 is the reference, as for MobileNetV3.
            **evaluate(run, held_out, None if variant == "onnx_fp32" else reference, batch_size=batch_size),
            **machine_columns(),
        }
        for variant, (run, path) in variants.items()
    ]

    trace = profile_model(
        int8_path, held_out[:1], profile_runs, threads, artifacts_dir / f"{shape.name}_dynamic_int8_profile.json"
    )
    return ControlResult(rows, op_type_summary(trace, profile_runs))


def op_shares(profile: list[dict], op_types) -> str:
    """'MatMulInteger 40.1%, ...' for `op_types`, plus the share of every other op type."""
    shares = {row["op_type"]: row["share_pct"] for row in profile}
    return (
        ", ".join(f"{op} {shares.get(op, 0)}%" for op in op_types)
        + f", other op types {round(100 - sum(shares.get(op, 0) for op in op_types), 2)}%"
    )


def int8_vs_fp32(rows: list[dict], int8_variant: str = "onnx_dynamic_int8") -> str:
    """The same-run ratios: dynamic INT8's (`int8_variant`'s) batch-1 mean and per-image time over FP32's
    (interleaved_benchmark's, by round), and its size over FP32's."""
    fp32, int8 = (next(row for row in rows if row["variant"] == variant) for variant in ("onnx_fp32", int8_variant))
    return (
        f"dynamic INT8 / FP32: batch 1 {int8['mean_ms_vs_onnx_fp32']:.2f}x, per image at batch "
        f"{int8['batch_size']} {int8['per_image_ms_vs_onnx_fp32']:.2f}x, "
        f"size {int8['size_mb'] / fp32['size_mb']:.3f}x"
    )


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=add_help)
    parser.add_argument("--artifacts-dir", default=str(ARTIFACTS_DIR), help="where the ViT models and profile go")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a {QUICK_CONTROL_VIT.num_layers}-layer ViT, few timed calls: a smoke run in seconds",
    )
    parser.add_argument(
        "--threads",
        type=cli.positive_int,
        default=DEFAULT_INTRA_OP_THREADS,
        help="intra-op threads for onnxruntime and torch",
    )
    parser.add_argument(
        "--batch-size", type=cli.positive_int, default=None, help="batch for per-image throughput (default: stage 1's)"
    )
    return parser


def main(args):
    mode = cli.defaults(args)  # stage 1's counts, as the control runs stage 1's steps
    shape = control_vit(args.quick)
    result = transformer_control(
        shape,
        held_out_batch(mode.held_out_images),
        mode.timing,
        args.batch_size or mode.batch_size,
        args.threads,
        mode.profile_runs,
        args.artifacts_dir,
    )
    print(f"{shape} (weights: random-init)")
    columns = dict.fromkeys(key for row in result.rows for key in row)  # FP32, the reference, has no agreement
    print(markdown_table([{key: row.get(key, "") for key in columns} for row in result.rows]))
    print(int8_vs_fp32(result.rows))
    print(markdown_table(result.profile[:8]))
    print("dynamic INT8 kernel time at batch 1: " + op_shares(result.profile, INTEGER_MATMUL_OPS + ("ConvInteger",)))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
