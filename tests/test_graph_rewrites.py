"""The exact graph rewrites: each equal to the FP32 graph on photos for MobileNetV3-Large and -Small, and what
each one changes, on the fixture models and on small hand-built graphs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mnv3.graph_rewrites import (
    GRAPH_REWRITES,
    HARDSWISH_SIXTH,
    apply_graph_rewrites,
    channel_groups,
    hardswish_to_clip,
    pad_depthwise_channels,
)
from mnv3.quantize import RECIPES
from mnv3.runtime import make_session, ort_runner

pytestmark = pytest.mark.integration

FIXTURE_MODELS = {"mobilenet_v3_large": "fp32_model_path", "mobilenet_v3_small": "fp32_small_model_path"}
# Each rewrite alone, and every list of them a recipe applies (the shipped one among them).
REWRITE_LISTS = sorted(
    {(name,) for name in GRAPH_REWRITES} | {recipe.graph_rewrites for recipe in RECIPES.values()} - {()}
)


# MobileNetV3-Small needs an export of its own (seconds): `make test` runs it, `make test-fast` does not.
SMALL = pytest.param("mobilenet_v3_small", marks=pytest.mark.slow)


@pytest.fixture(scope="module", params=["mobilenet_v3_large", SMALL])
def fp32_path(request):
    return request.getfixturevalue(FIXTURE_MODELS[request.param])


@pytest.fixture(scope="module")
def reference(fp32_path, held_out):
    return ort_runner(make_session(fp32_path))(held_out)


def run(model: onnx.ModelProto, batch: np.ndarray) -> np.ndarray:
    return ort_runner(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]))(batch)


def op_types(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node}


def depthwise_groups(model: onnx.ModelProto) -> list[int]:
    return [a.i for node in model.graph.node for a in node.attribute if a.name == "group" and a.i > 1]


def make_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    def values(names_and_shapes):
        return [
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name, shape in names_and_shapes
        ]

    graph = onnx.helper.make_graph(
        nodes,
        "test",
        values(inputs),
        values(outputs),
        [onnx.numpy_helper.from_array(np.asarray(array, np.float32), name) for name, array in initializers.items()],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("rewrites", REWRITE_LISTS, ids="+".join)
def test_graph_rewrites_are_exact_in_fp32_on_photos(fp32_path, held_out, reference, rewrites):
    original = onnx.load(str(fp32_path))
    untouched = original.SerializeToString()
    rewritten = apply_graph_rewrites(original, rewrites)
    onnx.checker.check_model(rewritten)
    assert original.SerializeToString() == untouched  # the input is left alone
    assert {"HardSwish", "HardSigmoid"} <= op_types(original)
    assert ("HardSwish" in op_types(rewritten)) == ("hardswish_to_clip" not in rewrites)
    assert ("HardSigmoid" in op_types(rewritten)) == ("hardsigmoid_to_clip" not in rewrites)
    if "pad16" in rewrites:
        assert all(groups % 16 == 0 for groups in depthwise_groups(rewritten))
    assert ("GlobalAveragePool" in op_types(rewritten)) == ("global_pool_to_avgpool" not in rewrites)
    if rewrites == ("fold6",):  # nothing to fold without hardswish_to_clip's 1/6
        assert rewritten == original
    np.testing.assert_allclose(run(rewritten, held_out), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "unaligned"),
    [
        ("mobilenet_v3_large", {72, 120, 200, 184}),
        pytest.param("mobilenet_v3_small", {72, 88, 120}, marks=pytest.mark.slow),
    ],
)
def test_pad_depthwise_channels_rounds_every_depthwise_conv_up_to_16_exactly(request, held_out, arch, unaligned):
    fp32_path = request.getfixturevalue(FIXTURE_MODELS[arch])
    original = onnx.load(str(fp32_path))
    padded = pad_depthwise_channels(original)
    onnx.checker.check_model(padded)
    before, after = depthwise_groups(original), depthwise_groups(padded)
    assert unaligned <= set(before)  # these miss ORT's fast INT8 depthwise kernel
    assert after == [-(-groups // 16) * 16 for groups in before]
    reference = ort_runner(make_session(fp32_path))(held_out)
    np.testing.assert_allclose(run(padded, held_out), reference, rtol=0, atol=1e-5)


def test_pad_depthwise_channels_leaves_channels_that_reach_a_graph_output():
    model = make_model(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], group=24)],
        [("x", [1, 24, 8, 8])],
        [("y", [1, 24, 6, 6])],
        {"w": np.ones((24, 1, 3, 3))},
    )
    assert pad_depthwise_channels(model).graph == model.graph


def test_pad_depthwise_channels_pads_a_conv_between_two_padded_groups_on_both_sides():
    """dw(24) -> 1x1 conv -> dw(40) -> +1, unnamed nodes: the middle conv gets zero columns and zero filters,
    and the last conv zero columns for the extra channels the Add made non-zero."""
    rng = np.random.default_rng(0)
    weights = {
        "w_in": rng.normal(size=(24, 8, 1, 1)),
        "w_dw1": rng.normal(size=(24, 1, 3, 3)),
        "b_dw1": rng.normal(size=24),
        "w_mid": rng.normal(size=(40, 24, 1, 1)),
        "w_dw2": rng.normal(size=(40, 1, 3, 3)),
        "w_out": rng.normal(size=(8, 40, 1, 1)),
        "one": 1.0,
    }
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w_in"], ["a"]),
        onnx.helper.make_node("Conv", ["a", "w_dw1", "b_dw1"], ["b"], group=24, pads=[1, 1, 1, 1]),
        onnx.helper.make_node("Relu", ["b"], ["c"]),
        onnx.helper.make_node("Conv", ["c", "w_mid"], ["d"]),
        onnx.helper.make_node("Conv", ["d", "w_dw2"], ["e"], group=40, pads=[1, 1, 1, 1]),
        onnx.helper.make_node("Add", ["e", "one"], ["f"]),
        onnx.helper.make_node("Conv", ["f", "w_out"], ["y"]),
    ]
    model = make_model(nodes, [("x", [2, 8, 6, 6])], [("y", [2, 8, 6, 6])], weights)
    constants = {name: np.asarray(array) for name, array in weights.items()}
    assert [sorted(group.tensors) for group in channel_groups(model.graph, constants)] == [
        ["x"],
        ["a", "b", "c"],
        ["d", "e", "f"],
        ["y"],
    ]
    padded = pad_depthwise_channels(model)
    onnx.checker.check_model(padded)
    assert depthwise_groups(padded) == [32, 48]
    shapes = {init.name: tuple(init.dims) for init in padded.graph.initializer}
    assert sorted(shapes[name] for name in padded.graph.node[3].input[1:]) == [(48, 32, 1, 1)]
    x = rng.normal(size=(2, 8, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(run(padded, x), run(model, x), rtol=0, atol=1e-4)


def test_pad_depthwise_channels_leaves_a_group_with_a_per_channel_constant():
    model = make_model(
        [
            onnx.helper.make_node("Conv", ["x", "w"], ["a"], group=24),
            onnx.helper.make_node("Add", ["a", "shift"], ["b"]),
            onnx.helper.make_node("Conv", ["b", "w_out"], ["y"]),
        ],
        [("x", [1, 24, 8, 8])],
        [("y", [1, 8, 6, 6])],
        {"w": np.ones((24, 1, 3, 3)), "shift": np.ones((24, 1, 1)), "w_out": np.ones((8, 24, 1, 1))},
    )
    assert pad_depthwise_channels(model).graph == model.graph


def test_fold_sixth_keeps_only_the_mul_of_the_hardswish_that_feeds_a_residual_add(fp32_model_path):
    model = apply_graph_rewrites(onnx.load(str(fp32_model_path)), ("hardswish_to_clip", "fold6"))
    kept = [node.name for node in model.graph.node if node.op_type == "Mul" and HARDSWISH_SIXTH in node.input]
    assert kept == ["/features/features.0/features.0.2/HardSwish/div6"]  # the stem's: block 1 adds it back


@pytest.mark.parametrize("attributes", [{}, {"alpha": 1 / 6, "beta": 0.5}, {"alpha": 0.25, "beta": 0.0}])
def test_hardsigmoid_to_clip_folds_any_alpha_and_beta_into_the_conv(attributes):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 5, 5)).astype(np.float32) * 4
    model = make_model(
        [
            onnx.helper.make_node("Conv", ["x", "w", "b"], ["z"]),
            onnx.helper.make_node("HardSigmoid", ["z"], ["y"], **attributes),
        ],
        [("x", x.shape)],
        [("y", [2, 3, 5, 5])],
        {"w": rng.normal(size=(3, 4, 1, 1)), "b": rng.normal(size=3)},
    )
    folded = apply_graph_rewrites(model, ("hardsigmoid_to_clip",))
    assert [node.op_type for node in folded.graph.node] == ["Conv", "Clip"]
    np.testing.assert_allclose(run(folded, x), run(model, x), atol=1e-6)


def test_global_pool_to_avgpool_pools_the_whole_window_and_leaves_an_unknown_one():
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 7)).astype(np.float32)
    model = make_model(
        [onnx.helper.make_node("GlobalAveragePool", ["x"], ["y"])], [("x", x.shape)], [("y", [2, 3, 1, 1])], {}
    )
    pooled = apply_graph_rewrites(model, ("global_pool_to_avgpool",))
    [node] = pooled.graph.node
    assert node.op_type == "AveragePool" and list(node.attribute[0].ints) == [5, 7]
    np.testing.assert_allclose(run(pooled, x), x.mean(axis=(2, 3), keepdims=True), atol=1e-6)
    dynamic = make_model(
        [onnx.helper.make_node("GlobalAveragePool", ["x"], ["y"])], [("x", [2, 3, "h", "w"])], [("y", [2, 3, 1, 1])], {}
    )
    assert apply_graph_rewrites(dynamic, ("global_pool_to_avgpool",)) == dynamic


def test_hardswish_to_clip_writes_the_definition():
    x = np.linspace(-5, 5, 101, dtype=np.float32).reshape(1, -1)
    model = hardswish_to_clip(
        make_model([onnx.helper.make_node("HardSwish", ["x"], ["y"])], [("x", x.shape)], [("y", x.shape)], {})
    )
    assert [node.op_type for node in model.graph.node] == ["Add", "Clip", "Mul", "Mul"]
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x * np.clip(x + 3, 0, 6) / 6, atol=1e-6)
