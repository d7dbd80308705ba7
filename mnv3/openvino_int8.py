"""NNCF post-training INT8 quantization for OpenVINO's CPU plugin, calibrated on the same photos as stage 2.

The result is an OpenVINO IR file (.xml, weights in the .bin beside it) that only the openvino backend
serves. NNCF places its quantizers where the CPU plugin has INT8 kernels, which onnxruntime's QDQ
placement does not; the project's exact FP32 graph rewrites (mnv3/graph_rewrites.py) can be applied
first. By default the logits layer stays in floating point: the one layer whose error lands on the logits
unfiltered. `quantize_logits` quantizes it too, for speed at batch 1, where it is the slowest single layer
left in floating point (its 1.28 M weights are read from memory for one image's 1.28 M multiply-adds);
whether its logits stay close enough is for stage 2's agreement columns and, with real weights, its
guard to say. Activation ranges are the calibration set's true min/max, as the
project's static recipes calibrate (MinMax): NNCF's default averages per-sample ranges, which clips the
outliers that a network amplifies layer by layer, as the random-init stand-in does. Weights are 7-bit
in every convolution and MatMul (NNCF's overflow fix for all layers; its default fixes the first alone):
without VNNI the CPU plugin's INT8 kernels saturate their int16 sums as onnxruntime's do, which is why the
static recipes quantize with reduce_range, and stage 2 may build on one CPU what another serves. Needs
`nncf` (requirements-openvino.txt).
"""

import errno
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mnv3.artifacts import replaced_when_written
from mnv3.graph_rewrites import rewritten_file


def logits_layer(model) -> str:
    """The friendly name of the last MatMul: the classifier layer that writes the logits."""
    return [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"][-1].get_friendly_name()


def quantize_nncf_int8(
    fp32_path,
    out_path,
    calibration_images: np.ndarray,
    graph_rewrites: Sequence[str] = (),
    quantize_logits: bool = False,
) -> Path:
    """INT8 OpenVINO IR at `out_path` (.xml) from the ONNX FP32 model, calibrated on `calibration_images`
    (a preprocess_photos array), after `graph_rewrites` if any; the logits layer too with `quantize_logits`."""
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = rewritten_file(fp32_path, graph_rewrites, tmp)
        # convert_model, not read_model: it folds the ONNX frontend's shape arithmetic (ShapeOf, Concat,
        # Reshape around every grouped convolution's weights) into constants. On the unfolded graph NNCF
        # quantized the depthwise weights ahead of that Reshape, where the CPU plugin folds them back to
        # f32, and left HardSwish between quantizers, so neither ran as INT8 kernels nor fused.
        model = ov.convert_model(str(fp32_path))
    # One image a calibration sample, as NNCF expects; its statistics are per tensor across all of them.
    dataset = nncf.Dataset([image[None] for image in calibration_images])
    quantized = nncf.quantize(
        model,
        dataset,
        subset_size=len(calibration_images),
        ignored_scope=nncf.IgnoredScope(names=[] if quantize_logits else [logits_layer(model)]),
        advanced_parameters=AdvancedQuantizationParameters(
            activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX, overflow_fix=OverflowFix.ENABLE
        ),
    )
    return save_ir(quantized, Path(out_path))


# Free space under which a failed IR write is taken for a full disk: more than an NNCF build's weights need.
FULL_DISK_BYTES = 64 << 20


def save_ir(model, path: Path) -> Path:
    """`model` as the IR at `path` (its .bin beside it), replaced whole; OSError(ENOSPC) where the disk filled
    up, as Python's own writes raise it: OpenVINO raises its stream's error as a RuntimeError."""
    import openvino as ov

    with replaced_when_written(path) as partial:
        try:
            ov.save_model(model, str(partial), compress_to_fp16=False)
        except RuntimeError as exc:
            if shutil.disk_usage(partial.parent).free < FULL_DISK_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
            raise
    return path
