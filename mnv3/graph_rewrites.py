"""Exact FP32 graph rewrites that let onnxruntime run a static INT8 MobileNetV3 in integers (and one that
OpenVINO's INT8 builds run faster).

Every rewrite takes an ONNX model and returns a rewritten copy (its input is left as it was) that
computes the same function in FP32, up to float rounding where its docstring says so; where its
pattern does not occur, the copy equals the input. None depends on a network's channel counts, so
they hold for MobileNetV3-Large and -Small alike.

GRAPH_REWRITES names them. A static recipe (mnv3/quantize.py) lists the names it applies, in order,
and its name is spelled from their tokens, so a recipe's name and its rewrites cannot disagree.
"""

import copy
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

# hardswish_to_clip's x1/6 constant: fold_hardswish_sixth finds the Muls to fold by it.
HARDSWISH_SIXTH = "hardswish_to_clip/sixth"
_HARDSWISH_CONSTANTS = {
    "hardswish_to_clip/three": 3.0,
    "hardswish_to_clip/zero": 0.0,
    "hardswish_to_clip/six": 6.0,
    HARDSWISH_SIXTH: 1 / 6,
}
_HARDSIGMOID_BOUNDS = {"hardsigmoid_to_clip/zero": 0.0, "hardsigmoid_to_clip/one": 1.0}

# Ops whose output has the channels of their (first) input, element by element: padding passes through.
_CHANNELWISE_OPS = ("Relu", "HardSwish", "HardSigmoid", "Clip", "Sigmoid", "GlobalAveragePool", "AveragePool")
# Ops that tie the channels of all their activation inputs and outputs together (constants must be scalars).
_ELEMENTWISE_OPS = (*_CHANNELWISE_OPS, "Add", "Mul")


def hardswish_to_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every HardSwish(x) written as Mul(Mul(x, Clip(Add(x, 3), 0, 6)), 1/6).

    Exact in FP32 (it is HardSwish's definition); a model without HardSwish comes back unchanged. It
    must run before quant_pre_process, which would otherwise split HardSwish into HardSigmoid x Mul,
    and ORT has no integer HardSigmoid: each one would run as DequantizeLinear -> FP32 HardSigmoid ->
    QuantizeLinear. Here the Add and Muls become QLinearAdd / QLinearMul and the Clip vanishes into the
    quantization range of its input, so the whole activation stays in integers.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    taken = {init.name for init in graph.initializer} | {n for node in graph.node for n in node.output}
    for name in _HARDSWISH_CONSTANTS:
        assert name not in taken, f"{name} already in the graph"
    three, zero, six, sixth = _HARDSWISH_CONSTANTS
    nodes, rewritten = [], 0
    for index, node in enumerate(graph.node):
        if node.op_type != "HardSwish" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        x, y, prefix = node.input[0], node.output[0], node.name or f"HardSwish_{index}"
        nodes += [
            helper.make_node("Add", [x, three], [f"{prefix}/add3"], name=f"{prefix}/add3"),
            helper.make_node("Clip", [f"{prefix}/add3", zero, six], [f"{prefix}/clip"], name=f"{prefix}/clip"),
            helper.make_node("Mul", [x, f"{prefix}/clip"], [f"{prefix}/mul"], name=f"{prefix}/mul"),
            helper.make_node("Mul", [f"{prefix}/mul", sixth], [y], name=f"{prefix}/div6"),
        ]
        rewritten += 1
    if rewritten:
        graph.initializer.extend(
            numpy_helper.from_array(np.array(value, np.float32), name) for name, value in _HARDSWISH_CONSTANTS.items()
        )
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def fold_hardswish_sixth(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of hardswish_to_clip's output with the x1/6 Mul folded into the next layers' weights.

    conv(y / 6, W) = conv(y, W / 6), and the factor passes unchanged through what is linear in y on
    the way: a GlobalAveragePool or Flatten, or the squeeze-excite Mul by a gate computed elsewhere.
    So where every path from a HardSwish reaches a Conv or Gemm (as its data input, with weights of
    its own) through only those, the Mul goes, and one QLinearMul per such HardSwish with it. Exact up
    to float rounding of W / 6. It does nothing to a model hardswish_to_clip has not rewritten, and a
    HardSwish with any other path (MobileNetV3-Large's stem, which feeds a residual Add) keeps its Mul.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    uses = defaultdict(list)  # tensor -> (node, input position) of every read
    for node in graph.node:
        for position, name in enumerate(node.input):
            uses[name].append((node, position))
    graph_outputs = {output.name for output in graph.output}

    def absorbers(name, scaled) -> dict | None:
        """{weight name: Conv/Gemm} that absorb a factor on tensor `name`, or None where one can't."""
        if name in graph_outputs:
            return None
        scaled.add(name)
        found = {}
        for consumer, position in uses[name]:
            if (
                consumer.op_type in ("Conv", "Gemm")
                and position == 0
                and consumer.input[1] in initializers
                and len(uses[consumer.input[1]]) == 1
                and not _attribute(consumer, "transA")
            ):
                found[consumer.input[1]] = consumer
                continue
            linear = consumer.op_type in ("GlobalAveragePool", "Flatten") or (
                consumer.op_type == "Mul"
                and len(consumer.input) == 2
                and consumer.input[1 - position] not in scaled | {name} | set(initializers)
            )
            further = absorbers(consumer.output[0], scaled) if linear else None
            if further is None:
                return None
            found |= further
        return found or None

    kept = []
    for node in graph.node:
        found = absorbers(node.output[0], set()) if node.op_type == "Mul" and node.input[1] == HARDSWISH_SIXTH else None
        if found is None:
            kept.append(node)
            continue
        for weight_name in found:
            weight = initializers[weight_name]
            weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) / np.float32(6), weight.name))
        for consumer, position in uses[node.output[0]]:
            consumer.input[position] = node.input[0]
    del graph.node[:]
    graph.node.extend(kept)
    return model


def hardsigmoid_to_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each HardSigmoid that directly follows a Conv folded into that Conv.

    HardSigmoid(z) = Clip(alpha * z + beta, 0, 1), and alpha * (W x + b) + beta is a Conv with weights
    alpha * W and bias alpha * b + beta. What is left, Clip(0, 1), the quantizer absorbs into the
    range of the Conv's output. ORT has no integer HardSigmoid, so each one (MobileNetV3's squeeze-excite
    gates) otherwise runs as DequantizeLinear -> FP32 HardSigmoid -> QuantizeLinear. Exact up to float
    rounding. A HardSigmoid whose input is not a Conv with constant weights and bias, read by it alone,
    is left as it is.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    arrays = _constant_arrays(graph)
    producers = {name: node for node in graph.node for name in node.output}
    uses = Counter(name for node in graph.node for name in node.input)
    graph_outputs = {output.name for output in graph.output}
    bounds: list[str] = []
    for node in graph.node:
        conv = producers.get(node.input[0]) if node.op_type == "HardSigmoid" else None
        if (
            conv is None
            or conv.op_type != "Conv"
            or uses[node.input[0]] != 1
            or node.input[0] in graph_outputs
            or len(conv.input) < 3
            or any(name not in arrays for name in conv.input[1:])
        ):
            continue
        alpha, beta = (_attribute(node, name) for name in ("alpha", "beta"))
        alpha, beta = 0.2 if alpha is None else alpha, 0.5 if beta is None else beta  # ONNX's defaults
        weight, bias = (arrays[name] for name in conv.input[1:3])
        _replace_input(graph, arrays, conv, 1, weight * np.float32(alpha), "hardsigmoid")
        _replace_input(graph, arrays, conv, 2, bias * np.float32(alpha) + np.float32(beta), "hardsigmoid")
        if not bounds:
            bounds = list(_HARDSIGMOID_BOUNDS)
            graph.initializer.extend(
                numpy_helper.from_array(np.array(value, np.float32), name)
                for name, value in _HARDSIGMOID_BOUNDS.items()
            )
        node.CopyFrom(
            helper.make_node("Clip", [node.input[0], *bounds], list(node.output), name=f"{node.name or conv.name}/clip")
        )
    _drop_unused_initializers(graph)
    return model


def global_pool_to_avgpool(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each GlobalAveragePool whose input has a known height and width written as an
    AveragePool over that whole window: the same mean, exact up to float rounding (the order of the sum).

    For OpenVINO: its ONNX frontend turns GlobalAveragePool into a ReduceMean, which the CPU plugin runs
    much slower than its pooling kernel on an INT8 tensor at batch 1 (MobileNetV3's squeeze-excite pools);
    an AveragePool stays a pooling layer. A GlobalAveragePool whose input's spatial size is not static (or
    not inferable) is left as it is.
    """
    model = copy.deepcopy(model)
    inferred = onnx.shape_inference.infer_shapes(model).graph
    spatial = {
        value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim][2:]
        for value in [*inferred.input, *inferred.value_info, *inferred.output]
    }
    for node in model.graph.node:
        window = spatial.get(node.input[0]) if node.op_type == "GlobalAveragePool" else None
        if window and all(size > 0 for size in window):
            pool = helper.make_node("AveragePool", list(node.input), list(node.output), node.name, kernel_shape=window)
            node.CopyFrom(pool)
    return model


def pad_depthwise_channels(model: onnx.ModelProto, multiple: int = 16) -> onnx.ModelProto:
    """A copy of `model` whose depthwise convolutions have a multiple of `multiple` channels, zero-padded.

    ORT runs an INT8 depthwise conv with its fast symmetric kernel (MlasConvSymDepthwise) only when
    the channel count is a multiple of 16; other counts fall back to a generic kernel. Padding C to C'
    adds zero output channels to every convolution that produces the channel group, zero filters to
    its depthwise conv, and zero input columns to every convolution that reads it, so the extra
    channels never reach a real one: exact in FP32.

    A channel group (see channel_groups) is padded only if it holds a depthwise conv and every node
    around it is one this can pad; one that reaches a graph input or output, a reshape, a grouped conv
    or any other op is left as it is, and so is one already a multiple of `multiple`.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    arrays = _constant_arrays(graph)
    graph_ends = {value.name for value in [*graph.input, *graph.output]}
    for group in channel_groups(graph, arrays):
        nodes = [graph.node[position] for position in group.nodes]
        channels = _group_channels(nodes, group.tensors, arrays)
        if (
            channels is None
            or group.tensors & graph_ends
            or not any(_conv_kind(node, arrays) == "depthwise" for node in nodes)
        ):
            continue
        padded = -(-channels // multiple) * multiple
        if padded != channels:
            pad_channel_group(graph, arrays, group, padded - channels)
    _drop_unused_initializers(graph)
    return model


@dataclass(frozen=True)
class ChannelGroup:
    """Activation tensors whose channel dimension must keep one size, and the nodes that read or write them."""

    tensors: frozenset[str]
    nodes: tuple[int, ...]  # positions in graph.node, in graph order


def channel_groups(graph: onnx.GraphProto, arrays: dict[str, np.ndarray]) -> list[ChannelGroup]:
    """Every activation tensor of `graph` in exactly one ChannelGroup, groups in graph order.

    Element-wise ops, pooling and depthwise convolutions keep channel c at position c, so all the
    activations they read and write share one channel count; dense convolutions start a new one.
    `arrays` holds the constants (see _constant_arrays), which belong to no group.
    """
    touching = defaultdict(list)  # tensor -> positions of the nodes that read or write it
    tied = defaultdict(set)  # tensor -> the tensors one node ties its channels to
    for position, node in enumerate(graph.node):
        tensors = [name for name in [*node.input, *node.output] if name and name not in arrays]
        for name in tensors:
            touching[name].append(position)
        if node.op_type in _ELEMENTWISE_OPS or _conv_kind(node, arrays) == "depthwise":
            for name in tensors:
                tied[name].update(tensors)
    groups, grouped = [], set()
    for start in touching:  # first touched first: graph order
        if start in grouped:
            continue
        members, frontier = set(), [start]
        while frontier:
            name = frontier.pop()
            if name not in members:
                members.add(name)
                frontier.extend(tied[name] - members)
        grouped |= members
        groups.append(
            ChannelGroup(
                frozenset(members), tuple(sorted({position for name in members for position in touching[name]}))
            )
        )
    return groups


def pad_channel_group(graph: onnx.GraphProto, arrays: dict[str, np.ndarray], group: ChannelGroup, extra: int) -> None:
    """Add `extra` zero channels to `group`, in place: the convolutions around it change, nothing else.

    A convolution writing the group gets zero filters and bias for the extra channels (a depthwise
    one its group count too); a dense one reading it gets zero input columns, so whatever the
    element-wise ops make of the extra channels never reaches a real one. `arrays` follows the new
    weights, so a convolution between two padded groups is padded on both sides.
    """
    for node in (graph.node[position] for position in group.nodes):
        kind = _conv_kind(node, arrays)
        if kind is None:  # element-wise ops and pooling carry the extra channels as they are
            continue
        weight = arrays[node.input[1]]
        if node.output[0] in group.tensors:
            weight = np.pad(weight, [(0, extra), (0, 0), (0, 0), (0, 0)])
            if kind == "depthwise":
                next(a for a in node.attribute if a.name == "group").i += extra
        if kind == "dense" and node.input[0] in group.tensors:
            weight = np.pad(weight, [(0, 0), (0, extra), (0, 0), (0, 0)])
        _replace_input(graph, arrays, node, 1, weight, "padded")
        if node.output[0] in group.tensors and len(node.input) > 2:
            _replace_input(graph, arrays, node, 2, np.pad(arrays[node.input[2]], (0, extra)), "padded")


def _group_channels(nodes, tensors, arrays) -> int | None:
    """The one channel count of a group, or None where a node around it is one padding can't follow."""
    channels = set()
    for node in nodes:
        if node.op_type in _ELEMENTWISE_OPS:
            if any(name in arrays and arrays[name].size != 1 for name in node.input):
                return None  # a per-channel constant would need padding too
            continue
        kind = _conv_kind(node, arrays)
        if kind is None:
            return None
        weight = arrays[node.input[1]]
        if node.output[0] in tensors:
            channels.add(weight.shape[0])
        if kind == "dense" and node.input[0] in tensors:
            channels.add(weight.shape[1])
    return channels.pop() if len(channels) == 1 else None


def _conv_kind(node, arrays) -> str | None:
    """ "depthwise", "dense" (group 1), or None: not a 2-D Conv with constant weights and bias."""
    if node.op_type != "Conv" or any(name not in arrays for name in node.input[1:]) or arrays[node.input[1]].ndim != 4:
        return None
    weight, group = arrays[node.input[1]], _attribute(node, "group") or 1
    if group == 1:
        return "dense"
    return "depthwise" if group == weight.shape[0] and weight.shape[1] == 1 else None


def _constant_arrays(graph) -> dict[str, np.ndarray]:
    """Initializers by name, and the Identity nodes the exporter uses to share equal constants."""
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in arrays:
            arrays[node.output[0]] = arrays[node.input[0]]
    return arrays


def _replace_input(graph, arrays, node, position: int, array: np.ndarray, tag: str) -> None:
    """Point input `position` of `node` at a new initializer holding `array`: the old one may be shared."""
    taken = {init.name for init in graph.initializer} | {name for n in graph.node for name in n.output}
    name = base = f"{node.name}/{tag}_input_{position}"
    suffix = 0
    while name in taken:  # a node without a name, or an input replaced before
        suffix += 1
        name = f"{base}_{suffix}"
    arrays[name] = array.astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(arrays[name], name))
    node.input[position] = name


def _drop_unused_initializers(graph) -> None:
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _attribute(node, name):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


@dataclass(frozen=True)
class GraphRewrite:
    """A rewrite and the token that spells it in a recipe's name."""

    rewrite: Callable[[onnx.ModelProto], onnx.ModelProto]
    token: str


GRAPH_REWRITES = {
    "pad16": GraphRewrite(pad_depthwise_channels, "pad16"),
    "hardswish_to_clip": GraphRewrite(hardswish_to_clip, "clip"),
    "fold6": GraphRewrite(fold_hardswish_sixth, "fold6"),  # after hardswish_to_clip, whose 1/6 Muls it folds
    "hardsigmoid_to_clip": GraphRewrite(hardsigmoid_to_clip, "gate"),
    "global_pool_to_avgpool": GraphRewrite(global_pool_to_avgpool, "avgpool"),
}


def apply_graph_rewrites(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """`model` after the GRAPH_REWRITES `names`, left to right (none: `model` itself)."""
    for name in names:
        model = GRAPH_REWRITES[name].rewrite(model)
    return model


def rewritten_file(path: str | Path, names: Sequence[str], folder: str | Path) -> Path:
    """The ONNX file at `path` after the GRAPH_REWRITES `names`, saved in `folder` (a quantizer's scratch
    folder); `path` itself when there are none."""
    if not names:
        return Path(path)
    rewritten = Path(folder) / "rewritten.onnx"
    onnx.save(apply_graph_rewrites(onnx.load(str(path)), names), str(rewritten))
    return rewritten
