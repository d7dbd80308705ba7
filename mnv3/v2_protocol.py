"""The Open Inference Protocol (KServe v2, Triton's REST protocol) as pure functions: no app, no I/O.

`parse_infer_request` turns an infer request body (JSON, or JSON header + raw tensors with the binary
tensor data extension) into an `InferRequest`; `encode_infer_response` turns class probabilities back
into a response body; `server_metadata`, `model_metadata` and `model_config` are the documents of
`GET /v2`, `GET /v2/models/{name}` and its `/config`. Every malformed request raises `V2Error` with
the HTTP status Triton would answer and a reason for the client: nothing else escapes the parser.

One model takes either of two inputs, one per request:
- `IMAGE`, BYTES, one element per encoded image (JPEG, PNG, ...), shape [N] or [N, 1]. In binary each
  element is a uint32 little-endian length and the bytes, as Triton's clients send them. A JSON BYTES
  element is a string, which cannot carry arbitrary bytes, so in JSON the input must say
  `"parameters": {"content_type": "base64"}` (MLServer's convention) and hold base64 strings.
- `PIXELS`, FP32 [N, *input_shape], already preprocessed; JSON data flat or nested, binary little-endian.
Both are `optional` in the model config: that is how a Triton config says "not every input is required",
and `perf_analyzer` then sends only the inputs its data file provides.

The one output is `PROBABILITIES`, FP32 [N, classes]; Triton's classification extension
(`"parameters": {"classification": k}` on the requested output) returns it as BYTES [N, k] of
`"probability:index[:label]"`, most probable first, the probability printed as C++'s std::to_string
prints a float (6 decimals).
"""

import base64
import json
import math
import re
import reprlib
import struct
from dataclasses import dataclass, field

import numpy as np
import orjson

from mnv3.engine import top_k_ids

PATH_PREFIX = "/v2"
IMAGE_INPUT = "IMAGE"
PIXELS_INPUT = "PIXELS"
PROBABILITIES_OUTPUT = "PROBABILITIES"
INPUT_NAMES = (IMAGE_INPUT, PIXELS_INPUT)

# The response header carrying the JSON length when binary sections follow it (both directions).
HEADER_LENGTH = "Inference-Header-Content-Length"
# What the server implements of Triton's extensions; `statistics` is not one of them, and perf_analyzer
# polls /stats when a server lists it.
EXTENSIONS = ("binary_tensor_data", "classification", "model_configuration")
DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
)
_DATATYPE_OF_INPUT = {IMAGE_INPUT: "BYTES", PIXELS_INPUT: "FP32"}
_LENGTH = struct.Struct("<I")  # the prefix of each BYTES element


class V2Error(Exception):
    """A request the protocol refuses: `status` is the HTTP status, `message` the reason for `{"error": ...}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _bad(message: str) -> V2Error:
    return V2Error(400, message)


@dataclass(frozen=True)
class ModelDescription:
    """What the metadata documents and the parser need to know about one served model."""

    name: str
    version: str
    input_shape: tuple[int, ...]  # of one image, e.g. (3, 224, 224)
    class_names: list[str]  # may be empty: then labels are left out, as Triton does without a label file
    num_classes: int
    max_images: int  # per request; Triton's `max_batch_size`
    batcher_max_batch_size: int
    batch_window_s: float
    platform: str = "onnxruntime_onnx"


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary_data: bool | None = None  # None: the request-level `binary_data_output`
    classification: int | None = None  # top-k strings instead of the probabilities


@dataclass(frozen=True)
class InferRequest:
    """A valid infer request: exactly one of `images` (encoded, one per image) and `pixels` (N, *shape)."""

    id: str | None
    images: list[bytes] | None
    pixels: np.ndarray | None
    outputs: tuple[RequestedOutput, ...]  # empty: every output, in binary iff `binary_output`
    binary_output: bool = False


@dataclass(frozen=True)
class InferResponse:
    """`body` to send; `header_length` is None for pure JSON (Content-Type application/json), else the
    value of `Inference-Header-Content-Length` (Content-Type application/octet-stream)."""

    body: bytes
    header_length: int | None = field(default=None)


# ---- request ---------------------------------------------------------------------------------------


def parse_infer_request(body: bytes, header_length: str | None, model: ModelDescription) -> InferRequest:
    """Parse and validate an infer request body; `header_length` is the `Inference-Header-Content-Length`
    header's value (None when absent: the whole body is JSON)."""
    json_end = len(body) if header_length is None else _parse_header_length(header_length, len(body))
    header = _parse_json_header(body[:json_end])
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad('"id" must be a string')
    parameters = _object(header.get("parameters", {}), '"parameters"')
    binary_output = _flag(parameters.get("binary_data_output", False), '"parameters.binary_data_output"')
    if "classification" in parameters:  # answered with the whole tensor, it would look ignored
        raise _bad(
            'classification is a parameter of the requested output, not of the request: "outputs": '
            f'[{{"name": "{PROBABILITIES_OUTPUT}", "parameters": {{"classification": k}}}}]'
        )

    tensor = _the_one_input(header.get("inputs"))
    name, shape = _name_and_shape(tensor)
    count = _batch_size(name, shape, model)
    raw = _input_bytes(tensor, body, json_end)
    images = pixels = None
    if name == IMAGE_INPUT:
        # Read up to one element past the shape's count: millions of empty elements fit a small gzip'd body, and
        # walking them all on the event loop held every other request for seconds.
        images = _binary_bytes_elements(raw, count + 1) if raw is not None else _json_bytes_elements(tensor, count + 1)
        if len(images) != count:
            held = f"{len(images)}" if len(images) < count else f"more than {count}"
            raise _bad(f"{name} has shape {shape} ({count} elements) but holds {held} elements")
    else:
        pixels = _binary_fp32(raw, shape) if raw is not None else _json_fp32(tensor["data"], shape)
        non_finite = pixels.size - int(np.isfinite(pixels).sum())
        if non_finite:  # a NaN would come back as probabilities of NaN, which JSON cannot carry
            raise _bad(
                f"{name}: {non_finite} of its {pixels.size} values are not finite FP32 numbers (NaN, infinite, or "
                "beyond FP32's range); send finite ones"
            )
    return InferRequest(request_id, images, pixels, _requested_outputs(header.get("outputs")), binary_output)


# Triton's extensions this server does not offer, by the paths their clients call, and what to do instead:
# a 404 there names the extension rather than a model called "stats" or a bare "Not Found".
UNOFFERED_EXTENSIONS = [
    (re.compile(re.escape(PATH_PREFIX) + pattern), extension, instead)
    for pattern, extension, instead in (
        (r"/models(/[^/]+(/versions/[^/]+)?)?/stats", "statistics", "read GET /metrics (Prometheus) or GET /stats"),
        (r"/repository(/.*)?", "model repository", "the models are the --model flags the server started with"),
        (r"/(system|cuda)sharedmemory(/.*)?", "shared memory", "send tensors in the request, binary or JSON"),
        (r"(/models/[^/]+(/versions/[^/]+)?)?/trace(/.*)?", "trace", "GET /metrics times every stage"),
        (r"/logging", "logging", "the server's --log-level sets it at start-up"),
    )
]


def unoffered_extension(path: str) -> str | None:
    """For a path of a Triton extension this server does not offer, the 404's message saying so."""
    for pattern, extension, instead in UNOFFERED_EXTENSIONS:
        if pattern.fullmatch(path):
            return f"this server does not offer Triton's {extension} extension (GET /v2 lists those it does): {instead}"
    return None


def is_protocol_path(path: str) -> bool:
    """Whether a request path is the protocol's, so that any error on it answers in `error_body`'s shape."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_body(message: str) -> dict:
    """The protocol's error shape; Triton's clients read `error`."""
    return {"error": message}


def _parse_header_length(value: str, body_length: int) -> int:
    text = value.strip()
    if text.startswith("-") and text[1:].isdigit():
        raise _bad(f"{HEADER_LENGTH} is negative ({text})")
    if not re.fullmatch(r"[0-9]+", text):
        raise _bad(f"{HEADER_LENGTH} must be a decimal byte count, got {_quoted(value)}")
    length = int(text)
    if length > body_length:
        raise _bad(f"{HEADER_LENGTH} is {length} but the body has only {body_length} bytes")
    return length


def _parse_json_header(data: bytes) -> dict:
    # Either parser holds the GIL throughout, so the event loop, in whichever thread parsing ran, waits while a
    # tensor's numbers are read: orjson reads them several times faster than json. What orjson refuses (UTF-16,
    # a byte-order mark, NaN, a lone surrogate) json reads as before, or refuses and says why. Where the two
    # differ: orjson reads an integer past 64 bits as a float (a PIXELS value so written is taken at its FP32
    # value, as 1.8e19 always was, where json's int was refused; elsewhere it is refused as not an integer,
    # where json's int was refused as too large, or as a classification k clipped to the classes), and nesting
    # to 1024 levels, where json's limit was the stack's (about 950 deep in the server).
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError:
        header = _parse_json_header_slowly(data)
    if not isinstance(header, dict):
        raise _bad("the inference header must be a JSON object")
    return header


def _parse_json_header_slowly(data: bytes):
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except NonJsonConstant as exc:
        raise _bad(f"the inference header is not JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise _bad(
            f"the inference header is not JSON ({exc or 'nested too deeply'}); with binary tensors, "
            f"send its length in {HEADER_LENGTH}"
        ) from None


class NonJsonConstant(ValueError):
    """NaN, Infinity or -Infinity, which Python's json reads and JSON (RFC 8259) does not have."""


def _refuse_constant(name: str):
    raise NonJsonConstant(f"{name} is not a JSON value")


# A client's value quoted in a refusal, bounded: in depth (orjson reads nesting 1024 deep, deeper than repr
# can print before a RecursionError) and in length (a refusal need not echo a megabyte back).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 3, 8, 4, 80, 80


def _quoted(value) -> str:
    return _QUOTE.repr(value)


def _the_one_input(inputs) -> dict:
    if inputs is None or inputs == []:
        raise _bad(f"missing input: send one of {', '.join(INPUT_NAMES)}")
    if not isinstance(inputs, list) or not all(isinstance(tensor, dict) for tensor in inputs):
        raise _bad('"inputs" must be a list of tensor objects')
    names = [tensor.get("name") for tensor in inputs]
    unknown = [name for name in names if name not in INPUT_NAMES]
    if unknown:
        raise _bad(f"unknown input {_quoted(unknown[0])}; the inputs are {', '.join(INPUT_NAMES)} (send one)")
    if len(inputs) > 1:
        listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise _bad(
            f"send one input, not {len(inputs)} ({listed}): {IMAGE_INPUT} for encoded "
            f"images or {PIXELS_INPUT} for a preprocessed tensor (perf_analyzer sends every input unless its "
            "--input-data file holds one: python -m mnv3.perf_analyzer_setup writes one of photos)"
        )
    return inputs[0]


def _name_and_shape(tensor: dict) -> tuple[str, list[int]]:
    name, datatype, shape = tensor["name"], tensor.get("datatype"), tensor.get("shape")
    if datatype not in DATATYPES:
        raise _bad(f"{name} has unknown datatype {_quoted(datatype)}; the protocol's are {', '.join(DATATYPES)}")
    if datatype != _DATATYPE_OF_INPUT[name]:
        raise _bad(f"{name} takes {_DATATYPE_OF_INPUT[name]}, not {datatype}")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise _bad(f"{name}'s shape must be a list of non-negative integers, got {_quoted(shape)}")
    if math.prod(shape) == 0:
        raise _bad(f"{name} is an empty tensor (shape {_quoted(shape)})")
    return name, shape


def _batch_size(name: str, shape: list[int], model: ModelDescription) -> int:
    if name == IMAGE_INPUT:
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise _bad(f"{name} has shape {_quoted(shape)}; send [N] or [N, 1]: one element per image")
    elif shape[1:] != list(model.input_shape):
        expected = ", ".join(map(str, model.input_shape))
        raise _bad(f"{name} has shape {_quoted(shape)}; model {model.name} takes [N, {expected}]")
    if shape[0] > model.max_images:
        raise _bad(f"{shape[0]} images in one request; the limit is {model.max_images} (split the request)")
    return shape[0]


def _input_bytes(tensor: dict, body: bytes, json_end: int) -> bytes | None:
    """The tensor's binary section, or None if its data is in the JSON; the body holds nothing else."""
    name, parameters = tensor["name"], _object(tensor.get("parameters", {}), f"{tensor['name']}'s parameters")
    _refuse_shared_memory(name, parameters)
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in tensor:
            raise _bad(f'{name} has neither "data" nor parameters.binary_data_size')
        if json_end != len(body):
            raise _bad(f"{len(body) - json_end} bytes follow the inference header but no input is binary")
        return None
    if "data" in tensor:
        raise _bad(f'{name} has both "data" and parameters.binary_data_size; send one')
    if type(size) is not int or size < 0:
        raise _bad(f"{name}'s binary_data_size must be a non-negative integer, got {_quoted(size)}")
    available = len(body) - json_end
    if size != available:
        raise _bad(f"{name}'s binary_data_size is {size} but {available} bytes follow the inference header")
    return body[json_end:]


def _binary_bytes_elements(raw: bytes, at_most: int) -> list[bytes]:
    """The length-prefixed elements of `raw`, the first `at_most` of them if it holds more."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw) and len(elements) < at_most:
        if offset + _LENGTH.size > len(raw):
            raise _bad(f"{IMAGE_INPUT} element {len(elements)} is cut off in its 4-byte length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise _bad(
                f"{IMAGE_INPUT} element {len(elements)} says {length} bytes but only "
                f"{len(raw) - offset} remain in the tensor data"
            )
        elements.append(raw[offset : offset + length])
        offset += length
    return elements


def _json_bytes_elements(tensor: dict, at_most: int) -> list[bytes]:
    """The base64 strings of `tensor`'s data, decoded: the first `at_most` of them if it holds more."""
    parameters = tensor.get("parameters", {})
    if parameters.get("content_type") != "base64":
        raise _bad(
            f'{IMAGE_INPUT} in JSON needs "parameters": {{"content_type": "base64"}} and base64 strings '
            "(a JSON BYTES element is text); or send the images with the binary tensor data extension"
        )
    strings = _flatten(tensor["data"], at_most)
    if not all(isinstance(item, str) for item in strings):
        raise _bad(f"{IMAGE_INPUT}'s data must be base64 strings")
    return [_base64_decoded(item) for item in strings]


def _base64_decoded(text: str) -> bytes:
    """Strict base64, except for line breaks: MIME's, and what `base64` and `openssl base64` print."""
    try:
        try:
            return base64.b64decode(text, validate=True)
        except ValueError:
            if "\n" not in text:
                raise
            return base64.b64decode(text.replace("\r\n", "").replace("\n", ""), validate=True)
    except ValueError as exc:  # binascii.Error, or a character outside ASCII
        raise _bad(f"{IMAGE_INPUT} holds a string that is not base64 ({exc})") from None


def _binary_fp32(raw: bytes, shape: list[int]) -> np.ndarray:
    expected = math.prod(shape) * 4
    if len(raw) != expected:
        raise _bad(f"{PIXELS_INPUT} has shape {shape}: {expected} bytes of FP32, but binary_data_size is {len(raw)}")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)


def _json_fp32(data, shape: list[int]) -> np.ndarray:
    count = math.prod(shape)
    # Counted and typed before numpy sees them: one long string among the numbers made np.asarray build a
    # fixed-width text array of (count x its length) characters, gigabytes from a small body.
    values = _flatten(data, count + 1)
    if len(values) != count:
        held = f"{len(values)}" if len(values) < count else f"more than {count}"
        raise _bad(f"{PIXELS_INPUT} has shape {shape} ({count} elements) but holds {held}")
    if not all(type(value) in (int, float) for value in values):
        raise _bad(f"{PIXELS_INPUT}'s data must be numbers")
    try:
        array = np.asarray(data, dtype=np.float32)
    except (ValueError, RecursionError):  # ragged, or nested deeper than numpy's dimensions
        raise _bad(f"{PIXELS_INPUT}'s data is not a rectangular array of numbers") from None
    return array.reshape(shape)


def _flatten(data, at_most: int) -> list:
    """Row-major elements of flat or nested JSON data (iterative: the nesting depth is the client's), the first
    `at_most` of them if it holds more. It visits at most 2 x `at_most` + 1 lists and elements, enough for every
    tensor this server takes ([N] or [N, 1] images, [N, 3, H, W] pixels): a body of empty lists (`[[], [], ...]`)
    adds no elements, and was walked in full."""
    budget = 2 * at_most + 1
    items: list = []
    pending = [data]
    while pending and len(items) < at_most and budget:
        budget -= 1
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(reversed(item[:budget]))  # no more than the budget can visit
        else:
            items.append(item)
    return items


def _requested_outputs(outputs) -> tuple[RequestedOutput, ...]:
    if outputs is None:
        return ()
    if not isinstance(outputs, list) or not all(isinstance(output, dict) for output in outputs):
        raise _bad('"outputs" must be a list of objects')
    requested: list[RequestedOutput] = []
    for output in outputs:
        name = output.get("name")
        if name != PROBABILITIES_OUTPUT:
            raise _bad(f"unknown output {_quoted(name)}; the output is {PROBABILITIES_OUTPUT}")
        if any(seen.name == name for seen in requested):
            raise _bad(f"output {name} is requested twice")
        parameters = _object(output.get("parameters", {}), f"output {name}'s parameters")
        _refuse_shared_memory(f"output {name}", parameters)  # else answered inline while the client reads its region
        binary = parameters.get("binary_data")
        k = parameters.get("classification")
        if k is not None and (type(k) is not int or k < 1):
            raise _bad(f"classification must be a positive integer (the top k), got {_quoted(k)}")
        requested.append(RequestedOutput(name, None if binary is None else _flag(binary, "binary_data"), k))
    return tuple(requested)


def _refuse_shared_memory(what: str, parameters: dict) -> None:
    if "shared_memory_region" in parameters:
        raise _bad(
            f"{what} names a shared memory region, and this server has no shared memory extension (GET /v2 "
            "lists its extensions): send the tensor in the request, binary or JSON"
        )


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(f"{what} must be a JSON object")
    return value


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{what} must be true or false, got {_quoted(value)}")
    return value


# ---- response --------------------------------------------------------------------------------------


def encode_infer_response(request: InferRequest, probabilities: np.ndarray, model: ModelDescription) -> InferResponse:
    """The response to `request`, given the model's (N, classes) probabilities for its N images."""
    outputs, sections = [], []
    for requested in request.outputs or (RequestedOutput(PROBABILITIES_OUTPUT),):
        binary = requested.binary_data if requested.binary_data is not None else request.binary_output
        tensor, section = _output(requested, probabilities, model.class_names, binary)
        outputs.append(tensor)
        sections.append(section)
    header = {"model_name": model.name, "model_version": model.version, "outputs": outputs}
    if request.id is not None:
        header["id"] = request.id
    header_bytes = _json_bytes(header)
    if not any(section is not None for section in sections):
        return InferResponse(header_bytes)
    return InferResponse(header_bytes + b"".join(filter(None, sections)), len(header_bytes))


def _json_bytes(header: dict) -> bytes:
    """The response header as JSON. orjson writes an FP32 array's values in their shortest form that reads
    back to the same FP32 value, in a fraction of the time json takes on a list of Python floats (which
    prints each as the longer float64 it became), and about half the text; the event loop waits either way.
    What orjson refuses, a string that is not Unicode (an id holding a lone surrogate, which json read),
    json writes as before."""
    try:
        return orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError:
        return json.dumps(header, default=np.ndarray.tolist).encode()


def _output(
    requested: RequestedOutput, probabilities: np.ndarray, class_names: list[str], binary: bool
) -> tuple[dict, bytes | None]:
    """One output tensor's JSON, and its binary section if it goes in binary."""
    if requested.classification is None:
        tensor = {"name": requested.name, "datatype": "FP32", "shape": list(probabilities.shape)}
        if not binary:
            return {**tensor, "data": probabilities.ravel()}, None  # written by _json_bytes
        section = probabilities.astype("<f4").tobytes()
    else:
        rows = classifications(probabilities, requested.classification, class_names)
        tensor = {"name": requested.name, "datatype": "BYTES", "shape": [len(rows), len(rows[0])]}
        if not binary:
            return {**tensor, "data": [text for row in rows for text in row]}, None
        section = b"".join(_LENGTH.pack(len(item)) + item for row in rows for item in map(str.encode, row))
    return {**tensor, "parameters": {"binary_data_size": len(section)}}, section


def classifications(probabilities: np.ndarray, k: int, class_names: list[str]) -> list[list[str]]:
    """Triton's classification strings, per row the k (at most all) most probable classes, highest first."""
    return [[_classification(float(row[i]), int(i), class_names) for i in top_k_ids(row, k)] for row in probabilities]


def _classification(probability: float, index: int, class_names: list[str]) -> str:
    text = f"{probability:f}:{index}"
    return f"{text}:{class_names[index]}" if index < len(class_names) else text


# ---- metadata --------------------------------------------------------------------------------------


def server_metadata(version: str) -> dict:
    """`GET /v2`."""
    return {"name": "mnv3", "version": version, "extensions": list(EXTENSIONS)}


def model_metadata(model: ModelDescription) -> dict:
    """`GET /v2/models/{name}[/versions/{v}]`: shapes with the batch dimension, -1 = any."""
    return {
        "name": model.name,
        "versions": [model.version],
        "platform": model.platform,
        "inputs": [
            {"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [-1, 1]},
            {"name": PIXELS_INPUT, "datatype": "FP32", "shape": [-1, *model.input_shape]},
        ],
        "outputs": [{"name": PROBABILITIES_OUTPUT, "datatype": "FP32", "shape": [-1, model.num_classes]}],
    }


def model_config(model: ModelDescription) -> dict:
    """`GET /v2/models/{name}/config`, Triton's ModelConfig: dims without the batch dimension, which
    `max_batch_size` > 0 announces; the batcher as `dynamic_batching`."""
    return {
        "name": model.name,
        "platform": model.platform,
        "max_batch_size": model.max_images,
        "input": [
            {"name": IMAGE_INPUT, "data_type": "TYPE_STRING", "dims": [1], "optional": True},
            {
                "name": PIXELS_INPUT,
                "data_type": "TYPE_FP32",
                "format": "FORMAT_NCHW",
                "dims": list(model.input_shape),
                "optional": True,
            },
        ],
        "output": [{"name": PROBABILITIES_OUTPUT, "data_type": "TYPE_FP32", "dims": [model.num_classes]}],
        "dynamic_batching": {
            "preferred_batch_size": [model.batcher_max_batch_size],
            "max_queue_delay_microseconds": round(model.batch_window_s * 1e6),
        },
    }
