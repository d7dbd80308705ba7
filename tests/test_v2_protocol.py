"""The v2 codec against Triton's own Python client: requests built by tritonclient.http, responses read by it."""

import base64
import json
import random
import struct

import numpy as np
import pytest
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput

from mnv3.v2_protocol import (
    EXTENSIONS,
    IMAGE_INPUT,
    PIXELS_INPUT,
    PROBABILITIES_OUTPUT,
    InferRequest,
    ModelDescription,
    V2Error,
    _binary_bytes_elements,
    _flatten,
    classifications,
    encode_infer_response,
    model_config,
    model_metadata,
    parse_infer_request,
    server_metadata,
)

pytestmark = pytest.mark.unit

CLASS_NAMES = ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead"]
MODEL = ModelDescription(
    name="fp32",
    version="1",
    input_shape=(3, 4, 5),
    class_names=CLASS_NAMES,
    num_classes=len(CLASS_NAMES),
    max_images=4,
    batcher_max_batch_size=8,
    batch_window_s=0.002,
)
# Not images, but every byte value: the codec must carry them untouched (decoding is the server's job).
PAYLOADS = [bytes(range(256)) * 3, b"\xff\xd8\xff\x00\x00jpeg", b"\x89PNG\r\n\x1a\n" + bytes(17)]


def request_body(inputs, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    """The body and Inference-Header-Content-Length exactly as tritonclient.http sends them."""
    body, json_size = InferenceServerClient.generate_request_body(inputs, outputs=outputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def image_input(payloads, binary=True, shape=None) -> InferInput:
    array = np.array(payloads, dtype=object).reshape(shape or [len(payloads)])
    tensor = InferInput(IMAGE_INPUT, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def pixels_input(pixels: np.ndarray, binary=True) -> InferInput:
    tensor = InferInput(PIXELS_INPUT, list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels, binary_data=binary)
    return tensor


def parse(body, header_length=None, model=MODEL) -> InferRequest:
    return parse_infer_request(body, header_length, model)


def random_pixels(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, *MODEL.input_shape), dtype=np.float32)


def probabilities(n: int) -> np.ndarray:
    logits = np.random.default_rng(100 + n).standard_normal((n, MODEL.num_classes)).astype(np.float32)
    return np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)


def read_response(response):
    """tritonclient's own parser (InferResult) over what we encoded."""
    return InferenceServerClient.parse_response_body(response.body, header_length=response.header_length)


# ---- requests ----------------------------------------------------------------------------------------


def test_binary_images_as_the_client_sends_them():
    request = parse(*request_body([image_input(PAYLOADS)], request_id="req-7"))
    assert request.images == PAYLOADS and request.pixels is None
    assert request.id == "req-7"
    # tritonclient asks for every output in binary when it names none.
    assert request.outputs == () and request.binary_output


def test_images_shaped_n_by_1_as_perf_analyzer_sends_them():
    request = parse(*request_body([image_input(PAYLOADS[:2], shape=[2, 1])]))
    assert request.images == PAYLOADS[:2]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_pixels_round_trip(binary):
    pixels = random_pixels(2)
    request = parse(*request_body([pixels_input(pixels, binary=binary)]))
    assert request.images is None and request.pixels.dtype == np.float32
    np.testing.assert_array_equal(request.pixels, pixels)


def test_nested_json_pixels_equal_flat_ones():
    pixels = random_pixels(1)
    header = {
        "inputs": [{"name": PIXELS_INPUT, "datatype": "FP32", "shape": list(pixels.shape), "data": pixels.tolist()}]
    }
    np.testing.assert_array_equal(parse(json.dumps(header).encode()).pixels, pixels)


def test_json_images_in_base64():
    header = {
        "id": "b64",
        "inputs": [
            {
                "name": IMAGE_INPUT,
                "datatype": "BYTES",
                "shape": [2, 1],
                "parameters": {"content_type": "base64"},
                "data": [[base64.b64encode(p).decode()] for p in PAYLOADS[:2]],
            }
        ],
    }
    request = parse(json.dumps(header).encode())
    assert request.images == PAYLOADS[:2] and request.id == "b64" and not request.binary_output
    # as `base64` prints it: lines of 76 characters, LF or CRLF
    for end in (b"\n", b"\r\n"):
        header["inputs"][0]["data"] = [[base64.encodebytes(p).replace(b"\n", end).decode()] for p in PAYLOADS[:2]]
        assert parse(json.dumps(header).encode()).images == PAYLOADS[:2]


def test_requested_outputs_and_their_parameters():
    outputs = [InferRequestedOutput(PROBABILITIES_OUTPUT, binary_data=False, class_count=3)]
    request = parse(*request_body([image_input(PAYLOADS[:1])], outputs=outputs))
    [output] = request.outputs
    assert (output.name, output.binary_data, output.classification) == (PROBABILITIES_OUTPUT, False, 3)
    assert not request.binary_output


# ---- responses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_probabilities_read_back_by_tritonclient(binary):
    request = parse(
        *request_body(
            [image_input(PAYLOADS)],
            request_id="r1",
            outputs=[InferRequestedOutput(PROBABILITIES_OUTPUT, binary_data=binary)],
        )
    )
    probs = probabilities(3)
    response = encode_infer_response(request, probs, MODEL)
    assert (response.header_length is not None) == binary
    result = read_response(response)
    np.testing.assert_array_equal(result.as_numpy(PROBABILITIES_OUTPUT), probs)
    header = result.get_response()
    assert (header["model_name"], header["model_version"], header["id"]) == ("fp32", "1", "r1")
    [output] = header["outputs"]
    # perf_analyzer requires binary_data_size in any parameters object of a binary output.
    assert ("binary_data_size" in output.get("parameters", {})) == binary


def test_binary_by_default_when_the_client_names_no_output():
    request = parse(*request_body([image_input(PAYLOADS[:2])]))
    response = encode_infer_response(request, probabilities(2), MODEL)
    assert response.header_length is not None
    np.testing.assert_array_equal(read_response(response).as_numpy(PROBABILITIES_OUTPUT), probabilities(2))


def test_no_id_in_the_request_none_in_the_response():
    request = parse(*request_body([image_input(PAYLOADS[:1])]))
    assert "id" not in read_response(encode_infer_response(request, probabilities(1), MODEL)).get_response()


def expected_classification(row: np.ndarray, k: int, class_names) -> list[str]:
    """Triton's classification.cc: std::to_string(prob) + ":" + index [+ ":" + label], highest first."""
    ranked = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    # C's printf format, as Triton's C++ writes it: an independent check of the module's own formatting.
    labels = [[class_names[i]] if class_names else [] for i in range(len(row))]
    return [":".join(["%f" % row[i], str(i), *labels[i]]) for i in ranked]  # noqa: UP031


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("k", [1, 3, 50])
def test_classification_extension(binary, k):
    outputs = [InferRequestedOutput(PROBABILITIES_OUTPUT, binary_data=binary, class_count=k)]
    request = parse(*request_body([image_input(PAYLOADS)], outputs=outputs))
    probs = probabilities(3)
    result = read_response(encode_infer_response(request, probs, MODEL))
    strings = result.as_numpy(PROBABILITIES_OUTPUT)
    assert strings.shape == (3, min(k, MODEL.num_classes))
    for row, got in zip(probs, strings, strict=True):
        assert [s.decode() if isinstance(s, bytes) else s for s in got] == expected_classification(row, k, CLASS_NAMES)


def test_classification_without_class_names_has_no_label():
    unlabelled = ModelDescription(**{**MODEL.__dict__, "class_names": []})
    outputs = [InferRequestedOutput(PROBABILITIES_OUTPUT, binary_data=False, class_count=2)]
    request = parse(*request_body([image_input(PAYLOADS[:1])], outputs=outputs), model=unlabelled)
    probs = probabilities(1)
    [row] = read_response(encode_infer_response(request, probs, unlabelled)).as_numpy(PROBABILITIES_OUTPUT)
    assert list(row) == expected_classification(probs[0], 2, [])


def test_classification_of_a_class_without_a_name_has_no_label():
    # Without class names (an empty list), class 0 must not look up a name past the list's end (a 500)
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], np.float32)
    assert classifications(probs, 2, []) == [["0.700000:0", "0.200000:1"], ["0.600000:2", "0.300000:1"]]
    assert classifications(probs, 1, ["tench", "goldfish"]) == [["0.700000:0:tench"], ["0.600000:2"]]


# ---- metadata ----------------------------------------------------------------------------------------


def test_server_metadata_lists_only_what_is_implemented():
    document = server_metadata("0.1.0")
    assert document["version"] == "0.1.0"
    assert set(document["extensions"]) == set(EXTENSIONS) and "statistics" not in document["extensions"]


def test_model_metadata_and_config_agree():
    metadata, config = model_metadata(MODEL), model_config(MODEL)
    assert metadata["name"] == config["name"] == "fp32" and metadata["versions"] == ["1"]
    assert config["max_batch_size"] == MODEL.max_images > 0
    # With max_batch_size > 0 the config's dims leave out the batch dimension that the metadata shows as -1.
    config_inputs = {tensor["name"]: tensor for tensor in config["input"]}
    for tensor in metadata["inputs"]:
        assert tensor["shape"][0] == -1 and config_inputs[tensor["name"]]["dims"] == tensor["shape"][1:]
        assert config_inputs[tensor["name"]]["optional"]  # a request sends one of the two
    assert config_inputs[PIXELS_INPUT]["dims"] == list(MODEL.input_shape)
    [output] = metadata["outputs"]
    assert output["shape"] == [-1, MODEL.num_classes] and config["output"][0]["dims"] == output["shape"][1:]
    assert config["dynamic_batching"] == {"preferred_batch_size": [8], "max_queue_delay_microseconds": 2000}


# ---- bad input ---------------------------------------------------------------------------------------


def json_request(*inputs, **header) -> tuple[bytes, None]:
    return json.dumps({"inputs": list(inputs), **header}).encode(), None


def json_pixels_spelling(value: str, count: int) -> tuple[bytes, None]:
    """A JSON PIXELS request whose first `count` values are written as `value` (text json.dumps never writes)."""
    body, _ = json_request({"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "data": [0.5] * 60})
    return body.replace(b"0.5", value.encode(), count), None


def binary_images(elements: bytes, shape, size=None) -> tuple[bytes, str]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": IMAGE_INPUT,
                    "datatype": "BYTES",
                    "shape": shape,
                    "parameters": {"binary_data_size": len(elements) if size is None else size},
                }
            ]
        }
    )
    return header.encode() + elements, str(len(header))


def resized(tensor: InferInput, shape) -> InferInput:
    tensor.set_shape(shape)  # after the data: tritonclient checks the shape against the array only then
    return tensor


def tritonclient_body(*inputs, outputs=None):
    return request_body(list(inputs), outputs=outputs)


def _in_shared_memory() -> InferInput:
    tensor = InferInput(IMAGE_INPUT, [1], "BYTES")
    tensor.set_shared_memory("region0", 1024)
    return tensor


def _output_in_shared_memory() -> InferRequestedOutput:
    output = InferRequestedOutput(PROBABILITIES_OUTPUT)
    output.set_shared_memory("region1", 4000)
    return output


def _fp32_named(name) -> InferInput:
    tensor = InferInput(name, [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))
    return tensor


def _bytes_input(name) -> InferInput:
    tensor = InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"x"], dtype=object))
    return tensor


_BASE64_IMAGE = {
    "name": IMAGE_INPUT,
    "datatype": "BYTES",
    "shape": [1],
    "parameters": {"content_type": "base64"},
    "data": ["eA=="],
}


BAD_REQUESTS = {
    "wrong datatype": (lambda: tritonclient_body(_fp32_named(IMAGE_INPUT)), "takes BYTES, not FP32"),
    "unknown datatype": (
        lambda: json_request({"name": IMAGE_INPUT, "datatype": "FP8", "shape": [1], "data": ["x"]}),
        "unknown datatype 'FP8'",
    ),
    "shape larger than the data": (
        lambda: tritonclient_body(resized(image_input(PAYLOADS[:1]), [2])),
        "holds 1 elements",
    ),
    "shape smaller than the data": (
        lambda: tritonclient_body(resized(image_input(PAYLOADS), [2])),
        "IMAGE has shape [2] (2 elements) but holds more than 2 elements",
    ),
    "shape smaller than the json data": (
        lambda: json_request(_BASE64_IMAGE | {"data": ["eA=="] * 3}),
        "IMAGE has shape [1] (1 elements) but holds more than 1 elements",
    ),
    "fp32 byte count": (
        lambda: tritonclient_body(resized(pixels_input(random_pixels(1)[:, :, :, :4]), [1, 3, 4, 5])),
        "bytes of FP32, but binary_data_size is",
    ),
    "json element count": (
        lambda: json_request({"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "data": [0.5] * 59}),
        "(60 elements) but holds 59",
    ),
    "ragged json": (
        lambda: json_request(
            {"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "data": [[0.5] * 31, [0.5] * 29]}
        ),
        "not a rectangular array",
    ),
    "strings as pixels": (
        lambda: json_request({"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "data": ["1.5"] * 60}),
        "must be numbers",
    ),
    "missing input": (lambda: tritonclient_body(), "missing input"),
    "two inputs": (
        lambda: tritonclient_body(image_input(PAYLOADS[:1]), pixels_input(random_pixels(1))),
        "send one input, not 2",
    ),
    "unknown input": (lambda: tritonclient_body(_bytes_input("INPUT0")), "unknown input 'INPUT0'"),
    "unknown output": (
        lambda: tritonclient_body(image_input(PAYLOADS[:1]), outputs=[InferRequestedOutput("OUTPUT0")]),
        "unknown output 'OUTPUT0'",
    ),
    "output twice": (
        lambda: tritonclient_body(image_input(PAYLOADS[:1]), outputs=[InferRequestedOutput(PROBABILITIES_OUTPUT)] * 2),
        "requested twice",
    ),
    # tritonclient leaves out class_count=0, so this one is written by hand.
    "classification 0": (
        lambda: json_request(
            _BASE64_IMAGE, outputs=[{"name": PROBABILITIES_OUTPUT, "parameters": {"classification": 0}}]
        ),
        "positive integer",
    ),
    "negative header length": (lambda: (tritonclient_body(image_input(PAYLOADS[:1]))[0], "-5"), "negative"),
    "non-numeric header length": (
        lambda: (tritonclient_body(image_input(PAYLOADS[:1]))[0], "12a"),
        "decimal byte count",
    ),
    "header length past the body": (
        lambda: (tritonclient_body(image_input(PAYLOADS[:1]))[0], "100000"),
        "the body has only",
    ),
    "header not json": (lambda: (b"\xff\xfe not json", None), "not JSON"),
    "binary without its header length": (lambda: (tritonclient_body(image_input(PAYLOADS[:1]))[0], None), "not JSON"),
    "header not an object": (lambda: (b"[1, 2]", None), "must be a JSON object"),
    "bytes element runs past the data": (
        lambda: binary_images(struct.pack("<I", 1000) + b"x" * 10, [1]),
        "says 1000 bytes but only 10 remain",
    ),
    "bytes length cut off": (
        lambda: binary_images(struct.pack("<I", 1) + b"x" + b"\x01\x00", [2]),
        "cut off in its 4-byte length",
    ),
    "binary_data_size past the body": (
        lambda: binary_images(struct.pack("<I", 1) + b"x", [1], size=50),
        "binary_data_size is 50 but 5 bytes follow",
    ),
    "binary_data_size short of the body": (
        lambda: binary_images(struct.pack("<I", 1) + b"x", [1], size=3),
        "binary_data_size is 3 but 5 bytes follow",
    ),
    "bytes after the json": (lambda: (json_request(_BASE64_IMAGE)[0] + b"trailing", None), "not JSON"),
    "bytes after the json header": (
        lambda: (json_request(_BASE64_IMAGE)[0] + b"trailing", str(len(json_request(_BASE64_IMAGE)[0]))),
        "no input is binary",
    ),
    "data and binary_data_size": (
        lambda: json_request(
            {
                "name": IMAGE_INPUT,
                "datatype": "BYTES",
                "shape": [1],
                "data": ["eA=="],
                "parameters": {"binary_data_size": 5},
            }
        ),
        'both "data" and parameters.binary_data_size',
    ),
    "empty tensor": (
        lambda: json_request({"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [0], "data": []}),
        "empty tensor",
    ),
    "too many images": (
        lambda: tritonclient_body(image_input(PAYLOADS + PAYLOADS[:2])),
        "5 images in one request; the limit is 4",
    ),
    "fp32 of another image size": (
        lambda: tritonclient_body(pixels_input(np.zeros((1, 3, 224, 224), np.float32))),
        "takes [N, 3, 4, 5]",
    ),
    "json bytes without base64": (
        lambda: tritonclient_body(image_input(["not an image"], binary=False)),
        "content_type",
    ),
    "json bytes not base64": (
        lambda: json_request(
            {
                "name": IMAGE_INPUT,
                "datatype": "BYTES",
                "shape": [1],
                "parameters": {"content_type": "base64"},
                "data": ["%%%\n"],  # a line break is taken, the rest is still not base64
            }
        ),
        "not base64",
    ),
    "json bytes not ascii": (
        lambda: json_request({**_BASE64_IMAGE, "data": ["é"]}),
        "not base64",
    ),
    "NaN in the json header": (lambda: (b'{"id": NaN, "inputs": []}', None), "NaN is not a JSON value"),
    "NaN in json pixels": (lambda: json_pixels_spelling("Infinity", 1), "Infinity is not a JSON value"),
    "overflowing json pixels": (
        lambda: json_pixels_spelling("1e400", 2),
        "2 of its 60 values are not finite FP32 numbers",
    ),
    "NaN in binary pixels": (
        lambda: tritonclient_body(pixels_input(np.full((1, 3, 4, 5), np.nan, np.float32))),
        "60 of its 60 values are not finite FP32 numbers",
    ),
    "negative dimension": (
        lambda: json_request({"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [-1], "data": []}),
        "non-negative integers",
    ),
    "id not a string": (lambda: json_request(_BASE64_IMAGE, id=7), '"id" must be a string'),
    "no data at all": (
        lambda: json_request({"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [1]}),
        'neither "data" nor',
    ),
    "deeply nested header": (lambda: (b"[" * 100_000 + b"]" * 100_000, None), "not JSON"),
    "input in shared memory": (lambda: tritonclient_body(_in_shared_memory()), "no shared memory extension"),
    "output in shared memory": (  # answered inline, the client would read a region the server never wrote
        lambda: tritonclient_body(image_input(PAYLOADS[:1]), outputs=[_output_in_shared_memory()]),
        "output PROBABILITIES names a shared memory region",
    ),
    "classification on the request": (  # answered with the whole tensor, it looked ignored
        lambda: json_request(_BASE64_IMAGE, parameters={"classification": 3}),
        'classification is a parameter of the requested output, not of the request: "outputs": [{"name"',
    ),
}


def test_image_elements_past_the_shape_are_not_read():
    # 10 KB of gzip held millions of empty elements, all walked on the event loop before the count was compared
    # (a helper reviewing the server as an attacker would: /healthz waited 1.7 s)
    empties = b"\0" * 4 * 2_600_000
    assert _binary_bytes_elements(empties, 3) == [b"", b"", b""]
    assert _flatten([[["a", "b"], "c"], ["d"] * 2_600_000], 3) == ["a", "b", "c"]
    # empty lists add no elements: 3.3M of them (10 KB gzip'd) were walked in full; it stops where a shape of [N]
    # or [N, 1] would have ended, before the element after them
    assert _flatten([[]] * 1_000 + ["a"], 3) == []
    assert _flatten([["a"], ["b"]], 3) == ["a", "b"]


def test_a_long_string_among_the_pixels_is_refused_before_numpy_sizes_an_array_for_it():
    # np.asarray made a fixed-width text array of (elements x the string's length) characters: about 800 MB for a
    # 60 KB body, or a MemoryError that escaped as a 500 (a reviewer's second round)
    data = [0.0] * (4 * 3 * 4 * 5 - 1) + ["x" * 50_000_000]  # 4 images of the test model's 3x4x5: 48 GB of text
    pixels = {"name": PIXELS_INPUT, "datatype": "FP32", "shape": [4, 3, 4, 5], "data": data}
    with pytest.raises(V2Error, match="PIXELS's data must be numbers") as caught:
        parse(*json_request(pixels))
    assert caught.value.status == 400


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_is_a_400_with_its_reason(case):
    make, reason = BAD_REQUESTS[case]
    with pytest.raises(V2Error) as caught:
        parse(*make())
    assert caught.value.status == 400
    assert reason in caught.value.message


def test_a_header_length_of_the_whole_body_is_a_request_without_binary_data():
    # The JSON header may be the whole body, as it is when no tensor goes in binary: not "past the body"
    body, _ = json_request(_BASE64_IMAGE)
    assert parse(body, str(len(body))).images == [b"x"]


def test_mutated_bodies_give_a_request_or_a_v2_error():
    """Whatever a client sends, the parser answers with a request or a V2Error, never another exception."""
    valid = [
        request_body([image_input(PAYLOADS)], request_id="x"),
        request_body([pixels_input(random_pixels(1), binary=False)]),
        request_body([pixels_input(random_pixels(2))], outputs=[InferRequestedOutput(PROBABILITIES_OUTPUT)]),
    ]
    rng = random.Random(0)
    for _ in range(600):
        body, header_length = rng.choice(valid)
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if header_length is not None and rng.random() < 0.2:
            header_length = str(int(header_length) + rng.randint(-8, 8))
        try:
            parse(bytes(mutated), header_length)
        except V2Error as exc:
            assert exc.status == 400 and exc.message


def test_a_json_constant_is_named_without_the_binary_header_advice():
    with pytest.raises(V2Error) as caught:
        parse(b'{"inputs": [], "id": NaN}', None)
    assert caught.value.message == "the inference header is not JSON (NaN is not a JSON value)"


DEEP = 1000  # within orjson's nesting limit (1024), past what repr can print from a request's stack
_PIXELS_60 = {"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "data": [0.5] * 60}
# Where a client's value is quoted back in a refusal, each with a value nested DEEP lists deep.
DEEPLY_NESTED = {
    "input name": lambda deep: json_request({**_PIXELS_60, "name": deep}),
    "datatype": lambda deep: json_request({**_PIXELS_60, "datatype": deep}),
    "shape": lambda deep: json_request({**_PIXELS_60, "shape": deep}),
    "binary_data_size": lambda deep: json_request(
        {"name": PIXELS_INPUT, "datatype": "FP32", "shape": [1, 3, 4, 5], "parameters": {"binary_data_size": deep}}
    ),
    "binary_data_output": lambda deep: json_request(_PIXELS_60, parameters={"binary_data_output": deep}),
    "output name": lambda deep: json_request(_PIXELS_60, outputs=[{"name": deep}]),
    "classification": lambda deep: json_request(
        _PIXELS_60, outputs=[{"name": PROBABILITIES_OUTPUT, "parameters": {"classification": deep}}]
    ),
}


@pytest.mark.parametrize("field", DEEPLY_NESTED)
def test_a_deeply_nested_value_is_refused_with_a_short_quote(field):
    body, _ = DEEPLY_NESTED[field]("DEEP")  # json.dumps cannot write the nesting: it replaces the string
    body = body.replace(b'"DEEP"', b"[" * DEEP + b"1" + b"]" * DEEP)
    with pytest.raises(V2Error) as caught:
        parse(body)
    assert caught.value.status == 400
    assert "[[[[...]]]]" in caught.value.message


LONG_VALUES = {
    "input name": (lambda: json_request({**_PIXELS_60, "name": "x" * 100_000}), "unknown input 'xxx"),
    "empty shape": (lambda: json_request({**_PIXELS_60, "shape": [0] * 100_000}), "PIXELS is an empty tensor"),
    "long shape": (lambda: json_request({**_PIXELS_60, "shape": [1] * 100_000}), "PIXELS has shape [1, 1,"),
    "many inputs": (lambda: json_request(*[_PIXELS_60] * 10_000), "send one input, not 10000 (PIXELS, PIXELS,"),
}


@pytest.mark.parametrize("case", LONG_VALUES)
def test_a_long_value_is_quoted_shortened(case):
    make, start = LONG_VALUES[case]
    with pytest.raises(V2Error) as caught:
        parse(*make())
    assert caught.value.message.startswith(start)
    assert "..." in caught.value.message and len(caught.value.message) < 400


def test_an_integer_past_64_bits_is_a_pixel_value_like_any_number():
    """orjson reads it as a float, so it is taken at its FP32 value, as the same number written 1.8e19 is."""
    body, _ = json_pixels_spelling(str(2**64), 1)
    parsed = parse(body)
    assert parsed.pixels.ravel()[0] == np.float32(2**64) and parsed.pixels.ravel()[1] == 0.5


@pytest.mark.parametrize("encode", [lambda text: b"\xef\xbb\xbf" + text.encode(), lambda text: text.encode("utf-16")])
def test_json_that_orjson_refuses_is_read_as_before(encode):
    """orjson reads UTF-8 without a byte-order mark only; json, the fallback, reads what it read before."""
    text, _ = json_request(_PIXELS_60)
    parsed = parse(encode(text.decode()))
    assert np.array_equal(parsed.pixels, np.full((1, 3, 4, 5), 0.5, np.float32))


def test_an_id_that_is_not_unicode_is_echoed_as_json_read_it():
    """json reads a lone surrogate escape, which orjson neither reads nor writes: the answer still echoes it."""
    body = json_request(_PIXELS_60)[0].replace(b"{", b'{"id": "\\ud800", ', 1)
    request = parse(body)
    assert request.id == "\ud800"
    header = json.loads(encode_infer_response(request, probabilities(1), MODEL).body)
    assert header["id"] == "\ud800"
    assert np.array_equal(np.asarray(header["outputs"][0]["data"], np.float32), probabilities(1).ravel())
