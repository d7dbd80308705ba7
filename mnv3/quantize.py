"""INT8 quantization with onnxruntime: dynamic (stage 1) and static from calibration photos (stage 2).

A static recipe is a small dataclass so a better one can be added to RECIPES and picked with --recipe,
and so the manifest and CSVs record exactly what produced static_int8.onnx.
"""
import copy
import hashlib
import json
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_dynamic, quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process
from tqdm import tqdm

from mnv3.photos import fill_calibration_dir, list_images
from mnv3.preprocess import open_image, preprocess_batch

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
    graph_rewrite: str = ""  # "+"-joined GRAPH_REWRITES names, applied to the FP32 graph before pre_process

    def record(self) -> dict:
        """JSON/CSV-friendly description for the manifest and results."""
        return asdict(self) | {"nodes_to_exclude": list(self.nodes_to_exclude),
                               "op_types_to_quantize": list(self.op_types_to_quantize)}


    def calibration_key(self) -> str:
        """What the calibrated ranges depend on: recipes with the same key can share them."""
        inputs = [self.graph_rewrite, self.calibrate_method, sorted(self.op_types_to_quantize),
                  sorted(self.extra_options.items())]
        return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:16]


def hardswish_to_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every HardSwish(x) written as Mul(Mul(x, Clip(Add(x, 3), 0, 6)), 1/6).

    Exact in FP32 (it is HardSwish's definition). It must run before quant_pre_process, which would
    otherwise split HardSwish into HardSigmoid x Mul, and ORT has no integer HardSigmoid: each one then
    runs as DequantizeLinear -> FP32 HardSigmoid -> QuantizeLinear (about a third of INT8 time). Here
    the Add and Muls become QLinearAdd / QLinearMul and the Clip vanishes into the quantization range
    of its input, so the whole activation stays in integers.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    taken = {init.name for init in graph.initializer} | {n for node in graph.node for n in node.output}
    constants = {}
    for key, value in (("three", 3.0), ("zero", 0.0), ("six", 6.0), ("sixth", 1 / 6)):
        name = f"hardswish_to_clip/{key}"
        assert name not in taken, f"{name} already in the graph"
        constants[key] = name
    nodes, rewritten = [], 0
    for index, node in enumerate(graph.node):
        if node.op_type != "HardSwish" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        x, y, prefix = node.input[0], node.output[0], node.name or f"HardSwish_{index}"
        nodes += [
            helper.make_node("Add", [x, constants["three"]], [f"{prefix}/add3"], name=f"{prefix}/add3"),
            helper.make_node("Clip", [f"{prefix}/add3", constants["zero"], constants["six"]], [f"{prefix}/clip"],
                             name=f"{prefix}/clip"),
            helper.make_node("Mul", [x, f"{prefix}/clip"], [f"{prefix}/mul"], name=f"{prefix}/mul"),
            helper.make_node("Mul", [f"{prefix}/mul", constants["sixth"]], [y], name=f"{prefix}/div6"),
        ]
        rewritten += 1
    if rewritten:
        graph.initializer.extend(numpy_helper.from_array(np.array(value, np.float32), constants[key])
                                 for key, value in (("three", 3.0), ("zero", 0.0), ("six", 6.0), ("sixth", 1 / 6)))
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def fold_hardswish_sixth(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of hardswish_to_clip's output with the x1/6 Mul folded into the next layers' weights.

    conv(y / 6, W) = conv(y, W / 6), and the factor passes unchanged through what is linear in y on
    the way: a GlobalAveragePool or Flatten, or the squeeze-excite Mul by a gate computed elsewhere.
    So where every path from a HardSwish reaches a Conv or Gemm (as its data input, with weights of
    its own) through only those, the Mul goes, and one QLinearMul per such HardSwish with it. Exact up
    to float rounding of W / 6; a HardSwish that also feeds an Add (MobileNetV3's stem) keeps its Mul.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    uses = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, position))
    graph_outputs = {output.name for output in graph.output}

    def absorbers(name, scaled) -> dict | None:
        """{weight name: Conv/Gemm} that absorb a factor on tensor `name`, or None where one can't."""
        if name in graph_outputs:
            return None
        scaled.add(name)
        found = {}
        for consumer, position in uses.get(name, []):
            if (consumer.op_type in ("Conv", "Gemm") and position == 0 and consumer.input[1] in initializers
                    and len(uses[consumer.input[1]]) == 1 and not _attribute(consumer, "transA")):
                found[consumer.input[1]] = consumer
                continue
            linear = consumer.op_type in ("GlobalAveragePool", "Flatten") or (
                consumer.op_type == "Mul" and len(consumer.input) == 2
                and consumer.input[1 - position] not in scaled | {name} | set(initializers))
            further = absorbers(consumer.output[0], scaled) if linear else None
            if further is None:
                return None
            found |= further
        return found or None

    removed = set()
    for node in graph.node:
        if node.op_type != "Mul" or node.input[1] != "hardswish_to_clip/sixth":
            continue
        found = absorbers(node.output[0], set())
        if found is None:
            continue
        for weight_name in found:
            weight = initializers[weight_name]
            weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) / np.float32(6), weight.name))
        for consumer, position in uses[node.output[0]]:
            consumer.input[position] = node.input[0]
        removed.add(node.name)
    kept = [node for node in graph.node if node.name not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    return model


def hardsigmoid_to_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each HardSigmoid that directly follows a Conv folded into that Conv.

    HardSigmoid(z) = Clip(alpha * z + beta, 0, 1), and alpha * (W x + b) + beta is a Conv with weights
    alpha * W and bias alpha * b + beta. What is left, Clip(0, 1), the quantizer absorbs into the
    range of the Conv's output. ORT has no integer HardSigmoid, so each one (MobileNetV3's 8 SE gates)
    otherwise runs as DequantizeLinear -> FP32 HardSigmoid -> QuantizeLinear. Exact up to float rounding.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    arrays = _constant_arrays(graph)
    producers = {name: node for node in graph.node for name in node.output}
    uses = Counter(name for node in graph.node for name in node.input)
    graph_outputs = {output.name for output in graph.output}
    bounds = []
    for node in graph.node:
        conv = producers.get(node.input[0]) if node.op_type == "HardSigmoid" else None
        if (conv is None or conv.op_type != "Conv" or uses[node.input[0]] != 1 or node.input[0] in graph_outputs
                or len(conv.input) < 3 or any(name not in arrays for name in conv.input[1:])):
            continue
        alpha, beta = (_attribute(node, name) for name in ("alpha", "beta"))
        alpha, beta = 0.2 if alpha is None else alpha, 0.5 if beta is None else beta  # ONNX's defaults
        weight, bias = (arrays[name] for name in conv.input[1:3])
        _replace_input(graph, conv, 1, weight * np.float32(alpha), "hardsigmoid")  # the old ones may be shared
        _replace_input(graph, conv, 2, bias * np.float32(alpha) + np.float32(beta), "hardsigmoid")
        if not bounds:
            bounds = ["hardsigmoid_to_clip/zero", "hardsigmoid_to_clip/one"]
            graph.initializer.extend(numpy_helper.from_array(np.array(value, np.float32), name)
                                     for name, value in zip(bounds, (0.0, 1.0)))
        node.CopyFrom(helper.make_node("Clip", [node.input[0], *bounds], list(node.output),
                                       name=f"{node.name or conv.name}/clip"))
    _drop_unused_initializers(graph)
    return model


# Ops whose output has the channels of their (first) input, element by element: padding passes through.
_CHANNELWISE_OPS = ("Relu", "HardSwish", "HardSigmoid", "Clip", "Sigmoid", "GlobalAveragePool")


def pad_depthwise_channels(model: onnx.ModelProto, multiple: int = 16) -> onnx.ModelProto:
    """A copy of `model` whose depthwise convolutions have a multiple of `multiple` channels, zero-padded.

    ORT runs an INT8 depthwise conv with its fast symmetric kernel (MlasConvSymDepthwise) only when
    the channel count is a multiple of 16; MobileNetV3-Large's 72, 120, 200 and 184 fall back to a
    generic kernel. Padding C to C' adds zero output channels to the convolution that produces them,
    zero filters to the depthwise conv, and zero input columns to every convolution that reads them, so
    the extra channels never reach a real one: exact in FP32, at 4-11% more depthwise work.

    Channels are followed through element-wise ops, pooling and the squeeze-excite Mul; a channel set
    that reaches anything else (a graph output, a reshape, a grouped conv...) is left as it is.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    arrays = _constant_arrays(graph)

    def conv_kind(node):  # "depthwise", "dense" (group 1) or None: any other op, or a conv we leave alone
        if (node.op_type != "Conv" or any(name not in arrays for name in node.input[1:])
                or arrays[node.input[1]].ndim != 4):
            return None  # padding rewrites constant weights and biases only
        weight, group = arrays[node.input[1]], _attribute(node, "group") or 1
        if group == 1:
            return "dense"
        return "depthwise" if group == weight.shape[0] and weight.shape[1] == 1 else None

    nodes = list(graph.node)  # one wrapper per node, so id() names a node below
    kinds = {id(node): conv_kind(node) for node in nodes}
    parent = {}  # union-find over tensor names: one set per channel dimension that must keep one size

    def find(name):
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    touched_by = {}  # tensor -> the nodes that read or write it
    for node in nodes:
        tensors = [name for name in [*node.input, *node.output] if name and name not in arrays]
        for name in tensors:
            touched_by.setdefault(name, []).append(node)
        if node.op_type in _CHANNELWISE_OPS or node.op_type in ("Add", "Mul") or kinds[id(node)] == "depthwise":
            for name in tensors[1:]:
                parent[find(name)] = find(tensors[0])

    def handled(node):
        if node.op_type in _CHANNELWISE_OPS or node.op_type in ("Add", "Mul"):
            return all(name not in arrays or arrays[name].size == 1 for name in node.input)  # scalars only
        return kinds[id(node)] is not None

    graph_ends = {value.name for value in [*graph.input, *graph.output]}
    channel_sets = {}
    for name in touched_by:
        channel_sets.setdefault(find(name), set()).add(name)
    for root, members in channel_sets.items():
        around = list({id(n): n for name in members for n in touched_by[name]}.values())
        depthwise = [n for n in around if kinds[id(n)] == "depthwise"]
        if not depthwise or members & graph_ends or not all(handled(n) for n in around):
            continue
        channels = arrays[depthwise[0].input[1]].shape[0]
        padded = -(-channels // multiple) * multiple
        if padded == channels:
            continue
        for node in around:
            if kinds[id(node)] is None:
                continue
            weight = arrays[node.input[1]]
            if find(node.output[0]) == root:  # zero filters and bias for the extra output channels
                _replace_input(graph, node, 1, np.pad(weight, [(0, padded - len(weight))] + [(0, 0)] * 3), "padded")
                if len(node.input) > 2:
                    _replace_input(graph, node, 2, np.pad(arrays[node.input[2]], (0, padded - channels)), "padded")
                if kinds[id(node)] == "depthwise":
                    next(a for a in node.attribute if a.name == "group").i = padded
            else:  # a dense conv reading them: zero columns, so the extra channels add nothing
                _replace_input(graph, node, 1, np.pad(weight, [(0, 0), (0, padded - channels), (0, 0), (0, 0)]),
                               "padded")
    _drop_unused_initializers(graph)
    return model


def _constant_arrays(graph) -> dict[str, np.ndarray]:
    """Initializers by name, and the Identity nodes the exporter uses to share equal constants."""
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in arrays:
            arrays[node.output[0]] = arrays[node.input[0]]
    return arrays


def _replace_input(graph, node, position: int, array: np.ndarray, tag: str) -> None:
    """Point input `position` of `node` at a new initializer holding `array` (the old one may be shared)."""
    name = f"{node.name}/{tag}_input_{position}"
    graph.initializer.append(numpy_helper.from_array(array.astype(np.float32), name))
    node.input[position] = name


def _drop_unused_initializers(graph) -> None:
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _attribute(node, name):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


GRAPH_REWRITES = {  # a recipe's graph_rewrite names some of these, joined by "+", applied left to right
    "pad16": pad_depthwise_channels,
    "hardswish_to_clip": hardswish_to_clip,
    "fold6": fold_hardswish_sixth,  # after hardswish_to_clip, whose 1/6 Muls it folds
    "hardsigmoid_to_clip": hardsigmoid_to_clip,
}


def apply_graph_rewrites(model: onnx.ModelProto, names: str) -> onnx.ModelProto:
    """`model` after the "+"-joined GRAPH_REWRITES `names` ("" leaves it as it is)."""
    for name in filter(None, names.split("+")):
        model = GRAPH_REWRITES[name](model)
    return model


# QDQ, per-channel S8 weights, U8 activations, MinMax: ORT's recommended CPU starting point.
# reduce_range (7-bit weights) because without VNNI the U8xS8 kernels saturate their int16 sums; it
# costs little where they do not, so it is the safe default on any x86 CPU.
# The *_clip recipes first rewrite HardSwish (hardswish_to_clip) so it runs in integers; *_fold6 also
# folds its x1/6 into the next Conv/Gemm; *_pad16 first pads depthwise channels to a multiple of 16
# (pad_depthwise_channels) for ORT's fast INT8 depthwise kernel; *_gate also folds the SE gates'
# HardSigmoid into the conv before them (hardsigmoid_to_clip). The default is the fastest recipe at
# equal SQNR in `static_quantization.py --compare-recipes all`; its numbers are in results/02_recipes.csv.
RECIPES = {
    "qdq_per_channel_minmax": StaticRecipe(reduce_range=True),
    "qdq_per_tensor_minmax": StaticRecipe(per_channel=False, reduce_range=True),
    "qoperator_per_channel_minmax": StaticRecipe(quant_format="QOperator", reduce_range=True),
    "qdq_per_channel_clip": StaticRecipe(reduce_range=True, graph_rewrite="hardswish_to_clip"),
    "qdq_per_channel_clip_noreduce": StaticRecipe(reduce_range=False, graph_rewrite="hardswish_to_clip"),
    "qdq_per_tensor_clip": StaticRecipe(per_channel=False, reduce_range=True, graph_rewrite="hardswish_to_clip"),
    "qdq_per_channel_clip_fold6": StaticRecipe(reduce_range=True, graph_rewrite="hardswish_to_clip+fold6"),
    "qdq_per_channel_pad16_clip_fold6": StaticRecipe(reduce_range=True, graph_rewrite="pad16+hardswish_to_clip+fold6"),
    "qdq_per_channel_pad16_clip_fold6_gate": StaticRecipe(
        reduce_range=True, graph_rewrite="pad16+hardswish_to_clip+fold6+hardsigmoid_to_clip"),
    # The same graph as QLinear* ops: ORT runs the same kernels from a smaller file (no bias scales or
    # Q/DQ nodes), but OpenVINO cannot read ORT's com.microsoft ops, so it is not the default.
    "qoperator_per_channel_pad16_clip_fold6_gate": StaticRecipe(
        quant_format="QOperator", reduce_range=True, graph_rewrite="pad16+hardswish_to_clip+fold6+hardsigmoid_to_clip"),
}
DEFAULT_RECIPE = "qdq_per_channel_pad16_clip_fold6_gate"


def pre_process(fp32_path, out_path, symbolic_shapes: bool = True) -> Path:
    """ORT's recommended step before quantizing: shape inference plus graph optimisation (BN folding...).

    `symbolic_shapes=False` skips ORT's symbolic shape inference (ONNX's still runs), which cannot follow
    the shape arithmetic of torch's exported MultiheadAttention."""
    quant_pre_process(str(fp32_path), str(out_path), skip_symbolic_shape=not symbolic_shapes)
    return Path(out_path)


def quantize_dynamic_int8(fp32_path, out_path, symbolic_shapes: bool = True) -> Path:
    """INT8 weights, activations quantized on the fly per call (DynamicQuantizeLinear + ConvInteger)."""
    with tempfile.TemporaryDirectory() as tmp:
        prepared = pre_process(fp32_path, Path(tmp) / "prepared.onnx", symbolic_shapes)
        quantize_dynamic(str(prepared), str(out_path), weight_type=QuantType.QInt8)
    return Path(out_path)


def calibration_photos(folder, count: int) -> list[Path]:
    """Up to `count` calibration images from `folder`, generating them if it has none.

    Generated images left by a smaller earlier run (say --quick) are regenerated rather than silently
    calibrating on fewer photos than asked for; images a user put there are never touched.
    """
    existing = list_images(folder) if Path(folder).is_dir() else []
    if existing and len(existing) < count and all(p.name.startswith("generated_") for p in existing):
        for path in existing:
            path.unlink()
    return fill_calibration_dir(folder, count)[:count]


def preprocess_photos(image_paths) -> np.ndarray:
    """The calibration photos as one preprocessed (N, 3, 224, 224) array, to calibrate several recipes on."""
    return np.concatenate([preprocess_batch([open_image(path) for path in image_paths[i:i + CALIBRATION_BATCH_SIZE]])
                           for i in range(0, len(image_paths), CALIBRATION_BATCH_SIZE)])


class ArrayCalibrationReader(CalibrationDataReader):
    """Feeds an already preprocessed (N, 3, H, W) array, a few images per call."""

    def __init__(self, images: np.ndarray, input_name: str = "input", batch_size: int = CALIBRATION_BATCH_SIZE):
        self.batches = iter([images[i:i + batch_size] for i in range(0, len(images), batch_size)])
        self.input_name = input_name

    def get_next(self):
        batch = next(self.batches, None)
        return None if batch is None else {self.input_name: batch}


class PhotoCalibrationReader(CalibrationDataReader):
    """Feeds calibration photos through the serving preprocessing, a few images per call."""

    def __init__(self, image_paths, input_name: str = "input", batch_size: int = CALIBRATION_BATCH_SIZE):
        self.chunks = [image_paths[i:i + batch_size] for i in range(0, len(image_paths), batch_size)]
        self.input_name = input_name
        self.progress = tqdm(total=len(image_paths), desc="calibration", unit="img", leave=False)

    def get_next(self):
        if not self.chunks:
            self.progress.close()
            return None
        chunk = self.chunks.pop(0)
        batch = preprocess_batch([open_image(path) for path in chunk])
        self.progress.update(len(chunk))
        return {self.input_name: batch}


def quantize_static_int8(fp32_path, out_path, calibration, recipe: StaticRecipe, cache_dir=None) -> Path:
    """Quantize with `recipe`, calibrating on `calibration`: photo paths, or a preprocess_photos array.

    With `cache_dir`, calibrated ranges are saved there per recipe.calibration_key() and reused by later
    recipes with the same key; the caller keeps one cache_dir per calibration set.
    """
    if isinstance(calibration, np.ndarray):
        reader = ArrayCalibrationReader(calibration)
    else:
        reader = PhotoCalibrationReader(list(calibration))
    cache = Path(cache_dir) / f"{recipe.calibration_key()}.json" if cache_dir else None
    with tempfile.TemporaryDirectory() as tmp:
        if recipe.graph_rewrite:
            rewritten = Path(tmp) / "rewritten.onnx"
            onnx.save(apply_graph_rewrites(onnx.load(str(fp32_path)), recipe.graph_rewrite), str(rewritten))
            fp32_path = rewritten
        prepared = pre_process(fp32_path, Path(tmp) / "prepared.onnx")
        quantize_static(
            str(prepared), str(out_path), reader,
            quant_format=QuantFormat[recipe.quant_format],
            per_channel=recipe.per_channel,
            activation_type=QuantType[recipe.activation_type],
            weight_type=QuantType[recipe.weight_type],
            calibrate_method=CalibrationMethod[recipe.calibrate_method],
            reduce_range=recipe.reduce_range,
            nodes_to_exclude=list(recipe.nodes_to_exclude) or None,
            op_types_to_quantize=list(recipe.op_types_to_quantize) or None,
            # Not CalibMaxIntermediateOutputs: in ORT 1.32 it drops the batches it flushes instead of
            # merging their ranges, and MinMax only keeps per-tensor min/max anyway, so memory is small.
            extra_options=recipe.extra_options,
            calibration_cache_path=cache,
        )
    return Path(out_path)


def size_mb(path) -> float:
    return round(Path(path).stat().st_size / 1e6, 3)

