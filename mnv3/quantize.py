"""INT8 quantization with onnxruntime: dynamic (stage 1) and static from calibration photos (stage 2).

A static recipe is a small dataclass so a better one can be added to RECIPES and picked with --recipe,
and so the manifest and CSVs record exactly what produced static_int8.onnx. The exact graph rewrites a
recipe applies first live in mnv3/graph_rewrites.py.
"""

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from mnv3.accuracy import array_batches
from mnv3.artifacts import INPUT_NAME, replaced_when_written
from mnv3.graph_rewrites import GRAPH_REWRITES, rewritten_file
from mnv3.photos import fill_calibration_dir, is_generated, list_images, spread
from mnv3.preprocess import DEFAULT_PREPROCESSING, Preprocessing, preprocess_files

CALIBRATION_BATCH_SIZE = 8


@dataclass
class StaticRecipe:
    """Arguments to quantize_static, as names (QuantFormat/QuantType/CalibrationMethod members)."""

    quant_format: str = "QDQ"
    per_channel: bool = True
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    calibrate_method: str = "MinMax"
    reduce_range: bool = False
    nodes_to_exclude: tuple[str, ...] = ()
    op_types_to_quantize: tuple[str, ...] = ()  # empty: every op type ORT can quantize
    extra_options: dict = field(default_factory=dict)
    graph_rewrites: tuple[str, ...] = ()  # GRAPH_REWRITES names, applied in order to the FP32 graph first

    def record(self) -> dict:
        """JSON/CSV-friendly description for the manifest and results.

        The rewrites are one "+"-joined `graph_rewrite` cell, the column the committed results have.
        """
        record = asdict(self) | {
            "nodes_to_exclude": list(self.nodes_to_exclude),
            "op_types_to_quantize": list(self.op_types_to_quantize),
        }
        del record["graph_rewrites"]
        return record | {"graph_rewrite": "+".join(self.graph_rewrites)}

    def calibration_key(self) -> str:
        """What the calibrated ranges depend on: recipes with the same key can share them."""
        inputs = [
            list(self.graph_rewrites),
            self.calibrate_method,
            sorted(self.op_types_to_quantize),
            sorted(self.extra_options.items()),
        ]
        return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:16]


def _named(stem: str, suffix: str = "", **fields) -> tuple[str, StaticRecipe]:
    """(name, recipe): the name is `stem`, the tokens of the recipe's graph rewrites in order, then `suffix`."""
    recipe = StaticRecipe(**fields)
    tokens = [GRAPH_REWRITES[name].token for name in recipe.graph_rewrites]
    return "_".join([stem, *tokens, *filter(None, [suffix])]), recipe


# QDQ, per-channel S8 weights, U8 activations, MinMax: ORT's recommended CPU starting point.
# reduce_range (7-bit weights) because without VNNI the U8xS8 kernels saturate their int16 sums; it
# costs little where they do not, so it is the safe default on any x86 CPU.
# The graph rewrites (mnv3/graph_rewrites.py) keep HardSwish (clip) and the squeeze-excite gates (gate)
# in integers, fold HardSwish's x1/6 into the next weights (fold6) and pad depthwise channels for ORT's
# fast INT8 depthwise kernel (pad16). The default is the fastest recipe at equal SQNR in
# `static_quantization.py --compare-recipes all`; its numbers are in results/02_recipes.csv.
_CLIP = ("hardswish_to_clip",)
_CLIP_FOLD6 = ("hardswish_to_clip", "fold6")
_PAD16_CLIP_FOLD6 = ("pad16", "hardswish_to_clip", "fold6")
_ALL_REWRITES = ("pad16", "hardswish_to_clip", "fold6", "hardsigmoid_to_clip")
RECIPES = dict(
    [
        _named("qdq_per_channel_minmax", reduce_range=True),
        _named("qdq_per_tensor_minmax", per_channel=False, reduce_range=True),
        _named("qoperator_per_channel_minmax", quant_format="QOperator", reduce_range=True),
        _named("qdq_per_channel", reduce_range=True, graph_rewrites=_CLIP),
        _named("qdq_per_channel", "noreduce", reduce_range=False, graph_rewrites=_CLIP),
        _named("qdq_per_tensor", per_channel=False, reduce_range=True, graph_rewrites=_CLIP),
        _named("qdq_per_channel", reduce_range=True, graph_rewrites=_CLIP_FOLD6),
        _named("qdq_per_channel", reduce_range=True, graph_rewrites=_PAD16_CLIP_FOLD6),
        _named("qdq_per_channel", reduce_range=True, graph_rewrites=_ALL_REWRITES),
        # The same graph as QLinear* ops: ORT runs the same kernels from a smaller file (no bias scales or
        # Q/DQ nodes), but OpenVINO cannot read ORT's com.microsoft ops, so it is not the default.
        _named("qoperator_per_channel", quant_format="QOperator", reduce_range=True, graph_rewrites=_ALL_REWRITES),
    ]
)
DEFAULT_RECIPE = "qdq_per_channel_pad16_clip_fold6_gate"


def pre_process(fp32_path, out_path, symbolic_shapes: bool = True) -> Path:
    """ORT's recommended step before quantizing: shape inference plus graph optimisation (BN folding...).

    `symbolic_shapes=False` skips ORT's symbolic shape inference (ONNX's still runs), which cannot follow
    the shape arithmetic of torch's exported MultiheadAttention."""
    quant_pre_process(str(fp32_path), str(out_path), skip_symbolic_shape=not symbolic_shapes)
    return Path(out_path)


def quantize_dynamic_int8(
    fp32_path, out_path, symbolic_shapes: bool = True, reduce_range: bool = False, unsigned_weights: bool = False
) -> Path:
    """INT8 weights, activations quantized on the fly per call (DynamicQuantizeLinear + ConvInteger, or
    DynamicQuantizeMatMul for MatMuls); `reduce_range`: 7-bit weights, which a model whose time is in MatMuls
    needs on CPUs without VNNI, where ORT's U8xS8 MatMul kernels saturate their int16 sums (as the static
    recipes' do). A conv net's ConvInteger does not saturate there, and its per-tensor weights lose more to
    the lost bit than the MatMuls' do.

    `unsigned_weights`: uint8 weights instead of `quantize_dynamic`'s default int8. ConvInteger hands its
    weights to onnxruntime's integer GEMM (MLAS) as the left operand, and on x86 MLAS has vector kernels for
    an unsigned left operand only (signed ones need AVX-VNNI-INT8): int8 weights run its portable C loop."""
    weight_type = QuantType.QUInt8 if unsigned_weights else QuantType.QInt8
    with tempfile.TemporaryDirectory() as tmp, replaced_when_written(out_path) as partial:
        prepared = pre_process(fp32_path, Path(tmp) / "prepared.onnx", symbolic_shapes)
        quantize_dynamic(str(prepared), str(partial), weight_type=weight_type, reduce_range=reduce_range)
    return Path(out_path)


def calibration_photos(folder, count: int) -> list[Path]:
    """Up to `count` calibration images from `folder` and the folders within it, generating them if there
    are none. With more than `count`, they are spread evenly over the images in path order, so that a
    dataset's folder per class gives each class its share (the first `count` would be the first classes').

    The user's own images, once there are any, are the only ones used: generated ones a run left there are
    removed then, as they are when a smaller earlier run (say --quick) left fewer than asked for. Images a
    user put there are never touched.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"--calibration-dir {folder} is a file: pass the folder of photos it is in")
    existing = list_images(folder, recursive=True) if folder.is_dir() else []
    generated = [path for path in existing if is_generated(path) and path.parent == folder]  # where they are written
    if generated and (len(generated) < len(existing) or len(existing) < count):
        for path in generated:
            path.unlink()
    photos = fill_calibration_dir(folder, count)
    return spread(photos, count)


def preprocess_photos(image_paths, preprocessing: Preprocessing = DEFAULT_PREPROCESSING) -> np.ndarray:
    """The calibration photos as one preprocessed (N, 3, crop, crop) array, to calibrate several recipes on."""
    return np.concatenate(
        [
            preprocess_files(image_paths[i : i + CALIBRATION_BATCH_SIZE], preprocessing)
            for i in range(0, len(image_paths), CALIBRATION_BATCH_SIZE)
        ]
    )


class ArrayCalibrationReader(CalibrationDataReader):
    """Feeds an already preprocessed (N, 3, H, W) array, a few images per call."""

    def __init__(self, images: np.ndarray, batch_size: int = CALIBRATION_BATCH_SIZE):
        self.batches = array_batches(images, batch_size)

    def get_next(self):
        batch = next(self.batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def quantize_static_int8(
    fp32_path, out_path, calibration_images: np.ndarray, recipe: StaticRecipe, cache_dir=None
) -> Path:
    """Quantize with `recipe`, calibrating on `calibration_images` (a preprocess_photos array).

    With `cache_dir`, calibrated ranges are saved there per recipe.calibration_key() and reused by later
    recipes with the same key; the caller keeps one cache_dir per calibration set.
    """
    reader = ArrayCalibrationReader(calibration_images)
    cache = Path(cache_dir) / f"{recipe.calibration_key()}.json" if cache_dir else None
    with tempfile.TemporaryDirectory() as tmp, replaced_when_written(out_path) as partial:
        prepared = pre_process(rewritten_file(fp32_path, recipe.graph_rewrites, tmp), Path(tmp) / "prepared.onnx")
        quantize_static(
            str(prepared),
            str(partial),
            reader,
            quant_format=QuantFormat[recipe.quant_format],
            per_channel=recipe.per_channel,
            activation_type=QuantType[recipe.activation_type],
            weight_type=QuantType[recipe.weight_type],
            calibrate_method=CalibrationMethod[recipe.calibrate_method],
            reduce_range=recipe.reduce_range,
            nodes_to_exclude=list(recipe.nodes_to_exclude) or None,
            op_types_to_quantize=list(recipe.op_types_to_quantize) or None,
            # Not CalibMaxIntermediateOutputs: ORT drops the batches it flushes instead of merging their
            # ranges, and MinMax only keeps per-tensor min/max anyway, so memory is small.
            extra_options=recipe.extra_options,
            calibration_cache_path=cache,
        )
        onnx.save(drop_zero_points(onnx.load(str(partial))), str(partial))
    return Path(out_path)


def drop_zero_points(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without the all-zero zero points of its quantized constants, and without stale shape annotations.

    ONNX's DequantizeLinear reads an absent zero point as 0. ORT's QDQ writer still stores one per channel:
    int32 zeros beside every quantized bias and int8 zeros beside every symmetric Conv weight, bytes that
    say nothing. Dropped here, the outputs are bit for bit the same and ORT fuses the same kernels, except that
    its QGemm fusion wants the weight's zero point: those of weights read by anything but a Conv stay.
    `value_info` (pre_process's shape inference, before quantization) is dropped too: ORT infers shapes anyway.
    """
    constants = {tensor.name: tensor for tensor in model.graph.initializer}
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    dropped = set()
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 3 or node.input[0] not in constants:
            continue
        zero_point = constants.get(node.input[2])
        if zero_point is None or numpy_helper.to_array(zero_point).any():
            continue
        if zero_point.data_type == onnx.TensorProto.INT32 or readers.get(node.output[0]) == {"Conv"}:
            dropped.add(node.input[2])
            del node.input[2]
    still_read = {name for node in model.graph.node for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name in still_read or tensor.name not in dropped]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    del model.graph.value_info[:]
    return model
