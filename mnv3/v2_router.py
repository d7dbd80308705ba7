"""The Open Inference Protocol's REST endpoints (KServe v2, Triton's HTTP API) over `mnv3.v2_protocol`.

Served by the same models as /predict: `/v2/models/{name}` is the model `?model={name}` names, in its
one version, "1". An encoded image (input `IMAGE`) goes the way a /predict upload goes: the model's
result cache (its whole probability row, under a key of its own), the shared preprocess pool and the
model's batcher, one batcher entry per image, all of a request's images at once; a preprocessed row
(input `PIXELS`) goes straight to the batcher, again one entry per row. /predict's limits hold here
too (body size and time, pixels, requests in flight, queue, deadline), plus --max-request-images.

Every failure on these routes answers as Triton does, `{"error": "..."}`, with the status of
`mnv3.errors`' table (400 bad request, 404 unknown model or version, 503 busy or not ready, 504
deadline...), and is counted in `mnv3_rejections_total` as /predict's are.
"""

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Path, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mnv3 import __version__
from mnv3.auth import Scope, required_scope, route_path
from mnv3.errors import ERRORS, INTERNAL_DOC, BadUpload, BodyTooLarge, UnknownModel, error_response
from mnv3.preprocess import InvalidImage
from mnv3.serving import ServedModel, Serving, serving, unless_disconnected
from mnv3.uploads import read_body
from mnv3.v2_protocol import (
    HEADER_LENGTH,
    IMAGE_INPUT,
    PATH_PREFIX,
    PIXELS_INPUT,
    InferRequest,
    ModelDescription,
    V2Error,
    encode_infer_response,
    error_body,
    is_protocol_path,
    model_config,
    model_metadata,
    parse_infer_request,
    server_metadata,
    unoffered_extension,
)

MODEL_VERSION = "1"  # one version per model: the file it was started with


# The mnv3.errors class a V2Error counts as in mnv3_rejections_total, by its status: so its reason is the one
# table's. A 404 is a model the request names that is not served, by its name or its version; a 503 "not
# ready" answers a probe and refuses no work.
V2_ERROR_CLASSES: dict[int, type[Exception]] = {400: BadUpload, 404: UnknownModel}


class V2Route(APIRoute):
    """A route that answers every failure in the protocol's shape (FastAPI's documented way to handle
    errors per router: the app's own handlers answer `{"detail": ...}`). A path under /v2 that matches
    no route, or a wrong method, is answered by `http_error_in_shape`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_in_protocol_shape(request: Request) -> Response:
            try:
                return await handle(request)
            except V2Error as exc:
                if exc.status in V2_ERROR_CLASSES:
                    request.app.state.serving.metrics.count_rejection(V2_ERROR_CLASSES[exc.status](exc.message))
                return JSONResponse(error_body(exc.message), exc.status)
            except tuple(ERRORS) as exc:
                request.app.state.serving.metrics.count_rejection(exc)
                return error_response(exc, body=error_body)

        return handle_in_protocol_shape


class V2ErrorBody(BaseModel):
    error: str = Field(description="what was wrong, for a person to read")


V2_ERROR_DOCS: dict[int | str, dict[str, Any]] = {
    status: {"model": V2ErrorBody, "description": description}
    for status, description in (
        (
            400,
            "malformed request: see the message (datatype, shape, binary lengths, JSON, images per request...), "
            "or an image that is not one",
        ),
        (404, "no model of that name, or no such version (each model has version 1)"),
        (408, "the body did not arrive within --body-timeout-s"),
        (413, "body over --max-upload-bytes; image over --max-pixels or with a side over 65,535"),
        (415, "a Content-Encoding other than gzip or deflate"),
        (500, f"inference failed for the batch an image ran in; {INTERNAL_DOC}"),
        (
            503,
            "--max-in-flight or --queue-limit reached, or shutting down (+ Retry-After); not ready (warming up, or "
            "a warm-up that failed: the readiness paths, no Retry-After)",
        ),
        (504, "no result within --deadline-ms"),
    )
}


async def http_error_in_shape(request: Request, exc: Exception) -> Response:
    """The app's handler of Starlette's HTTP errors (404 no such path, 405 wrong method): `{"error": ...}`
    under /v2, where Triton's clients read nothing else, and FastAPI's `{"detail": ...}` elsewhere."""
    assert isinstance(exc, StarletteHTTPException)  # the only class it is registered for
    path = route_path(request.scope)
    if is_protocol_path(path):
        message = (exc.status_code == 404 and unoffered_extension(path)) or str(exc.detail)
        return JSONResponse(error_body(message), exc.status_code, headers=exc.headers)
    return await http_exception_handler(request, exc)


v2_router = APIRouter(prefix=PATH_PREFIX, tags=["Open Inference Protocol (KServe v2)"], route_class=V2Route)


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str] = Field(description="Triton extensions implemented")


@v2_router.get("", response_model=ServerMetadata, summary="Server metadata")
async def metadata() -> dict:
    return server_metadata(__version__)  # the package's: Triton's clients read it as the server's version


@v2_router.get(
    "/health/live",
    response_class=Response,
    responses={
        200: {"description": "the process is up"},
        503: {
            "model": V2ErrorBody,
            "description": "a model's warm-up failed (unready for good, until a restart), or a call into an "
            "engine has not returned for minutes (a hung runtime)",
        },
    },
    summary="Liveness: 200, empty body; 503 once a model's warm-up failed, or while an inference is stuck",
)
async def live(s: Serving = Depends(serving)) -> Response:
    if reason := s.not_live:
        raise V2Error(503, reason)
    return Response()


@v2_router.get(
    "/health/ready",
    response_class=Response,
    responses={200: {"description": "every model is warmed up"}, 503: V2_ERROR_DOCS[503]},
    summary="Readiness: 200 once every model is warmed up, else 503",
)
async def ready(s: Serving = Depends(serving)) -> Response:
    if s.unready:
        raise V2Error(503, s.unready)
    return Response()


# ---- per model: /v2/models/{name} and /v2/models/{name}/versions/{version} alike


def description(served: ServedModel) -> ModelDescription:
    engine, config = served.engine, served.config
    return ModelDescription(
        name=served.name,
        version=MODEL_VERSION,
        input_shape=tuple(engine.input_shape[1:]),
        class_names=engine.class_names,
        num_classes=engine.num_classes,
        max_images=config.images_per_request,
        batcher_max_batch_size=config.max_batch_size,
        batch_window_s=config.batch_window_ms / 1000,
        platform="onnxruntime_onnx" if engine.backend == "onnxruntime" else engine.backend,
    )


async def named_model(
    request: Request, name: Annotated[str, Path(description="the model's name, as GET /models lists it")]
) -> ServedModel:
    s: Serving = request.app.state.serving
    if name not in s.models:
        if unoffered_extension(route_path(request.scope)):  # GET /v2/models/stats: not a model called "stats"
            raise StarletteHTTPException(404)  # answered, and not counted, as any other path the server lacks
        # An open path (a model's readiness, which probes ask without a key) does not list the models: /models
        # needs a key where keys are on.
        open_path = required_scope(request.method, route_path(request.scope)) is Scope.OPEN
        served = "" if open_path else f"; this server serves {', '.join(s.models)}"
        raise V2Error(404, f"unknown model {name!r}{served}")
    return s.models[name]


async def versioned_model(
    version: Annotated[str, Path(description=f"each model has one version, {MODEL_VERSION}")],
    model: ServedModel = Depends(named_model),
) -> ServedModel:
    if version != MODEL_VERSION:
        raise V2Error(404, f"model {model.name} has no version {version!r}; its one version is {MODEL_VERSION}")
    return model


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1: any size")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata] = Field(description="send one of them: IMAGE (encoded images) or PIXELS")
    outputs: list[TensorMetadata]


class InferResponseBody(BaseModel):
    model_name: str
    model_version: str
    id: str | None = Field(None, description="the request's id, when it had one")
    outputs: list[dict] = Field(
        description="PROBABILITIES, FP32 [N, classes] (or BYTES [N, k] "
        "'probability:index:label' with parameters.classification = k)"
    )


INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name", "shape", "datatype"],
                                "properties": {
                                    "name": {"type": "string", "enum": ["IMAGE", "PIXELS"]},
                                    "shape": {"type": "array", "items": {"type": "integer"}},
                                    "datatype": {"type": "string"},
                                    "parameters": {"type": "object"},
                                    "data": {},
                                },
                            },
                        },
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                            },
                        },
                    },
                }
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": f"binary tensor data extension: the JSON header, then the raw "
                f"tensors; {HEADER_LENGTH} gives the header's length",
            },
        },
    }
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = V2_ERROR_DOCS | {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": f"JSON, or with binary outputs the JSON header and the raw tensors ({HEADER_LENGTH})",
    }
}


def _add_model_routes(path: str, model_dependency) -> None:
    """The model endpoints under `path`, which names the model (and maybe its version) for `model_dependency`."""
    not_found: dict[int | str, dict[str, Any]] = {404: V2_ERROR_DOCS[404]}

    @v2_router.get(path, response_model=ModelMetadata, responses=not_found, summary="Model metadata")
    async def model_metadata_(model: ServedModel = Depends(model_dependency)) -> dict:
        return model_metadata(description(model))

    @v2_router.get(
        path + "/ready",
        response_class=Response,
        responses={200: {"description": "warmed up"}, **not_found, 503: V2_ERROR_DOCS[503]},
        summary="Model readiness: 200 once it is warmed up; 503 while an inference is stuck or the server shuts down",
    )
    async def model_ready(model: ServedModel = Depends(model_dependency), s: Serving = Depends(serving)) -> Response:
        # tritonclient's is_model_ready and KServe's probes ask this path, not /v2/health/ready.
        if reason := s.model_unready(model):
            raise V2Error(503, reason)
        return Response()

    @v2_router.get(
        path + "/config",
        response_model=dict,
        responses=not_found,
        summary="Model configuration (Triton's extension: max_batch_size, dynamic_batching, inputs, outputs)",
    )
    async def model_configuration(model: ServedModel = Depends(model_dependency)) -> dict:
        return model_config(description(model))

    @v2_router.post(
        path + "/infer",
        response_model=InferResponseBody,
        responses=INFER_RESPONSES,
        openapi_extra=INFER_BODY,
        summary="Classify encoded images (IMAGE, BYTES) or preprocessed pixels (PIXELS, FP32 [N, 3, 224, 224])",
    )
    async def infer(request: Request, model: ServedModel = Depends(model_dependency)) -> Response:
        return await _infer(request, model, request.app.state.serving)  # not Depends(serving): see /predict


_add_model_routes("/models/{name}", named_model)
_add_model_routes("/models/{name}/versions/{version}", versioned_model)


async def _infer(request: Request, model: ServedModel, s: Serving) -> Response:
    with s.request(model):
        described = description(model)
        try:
            body = await read_body(request, s.config.max_upload_bytes, s.config.body_timeout_s)
        except BodyTooLarge as exc:
            if "content-encoding" in request.headers:  # an inflated body's limit: rows are not the point
                raise
            row = 4 * math.prod(described.input_shape)  # /config's max_batch_size rows may not fit the limit
            raise BodyTooLarge(
                f"{exc} (--max-upload-bytes): send fewer images a request, or raise the limit ({PIXELS_INPUT} "
                f"takes {row} bytes a row in binary, so {s.config.max_upload_bytes // row} rows fit; "
                f"{IMAGE_INPUT} rows are the encoded files, far smaller)"
            ) from None
        deadline = s.deadline()
        parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH), described)
        del body  # the parsed tensors are copies: the body need not be held while the request waits its turn
        probabilities = np.stack(await unless_disconnected(request, _rows(model, parsed, deadline)))
    response = encode_infer_response(parsed, probabilities, described)
    if response.header_length is None:
        return Response(response.body, media_type="application/json")
    return Response(
        response.body, media_type="application/octet-stream", headers={HEADER_LENGTH: str(response.header_length)}
    )


async def _rows(model: ServedModel, parsed: InferRequest, deadline: float) -> list[np.ndarray]:
    """Every image's or pixel row's probabilities, computed concurrently, each as its own batcher entry;
    the first failure cancels the others and is raised as it is."""
    # In a task of its own: on Python 3.11 a TaskGroup whose row fails while it exits cancels its parent task
    # and never uncancels it (CPython gh-116720); that parent would otherwise be the request's task.
    return await asyncio.ensure_future(_rows_in_a_group(model, parsed, deadline))


async def _rows_in_a_group(model: ServedModel, parsed: InferRequest, deadline: float) -> list[np.ndarray]:
    try:
        async with asyncio.TaskGroup() as group:
            if parsed.images is not None:
                tasks = [
                    group.create_task(_image_row(model, i, data, deadline)) for i, data in enumerate(parsed.images)
                ]
            elif parsed.pixels is not None:
                tasks = [group.create_task(_pixels_row(model, i, row, deadline)) for i, row in enumerate(parsed.pixels)]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


async def _image_row(model: ServedModel, index: int, data: bytes, deadline: float) -> np.ndarray:
    """One encoded image's probabilities, through the model's cache under a key of its own (/predict
    stores only the top-k of an image, and this needs every class)."""
    try:
        row, _ = await model.cache.get_or_compute(
            data, lambda: model.probabilities(data, deadline), kind="probabilities"
        )
    except InvalidImage as exc:  # and ImageTooLarge, its subclass
        raise type(exc)(f"image {index}: {exc}") from None
    return row


async def _pixels_row(model: ServedModel, index: int, row: np.ndarray, deadline: float) -> np.ndarray:
    probabilities = (await model.infer(row, deadline)).row
    if not np.isfinite(probabilities).all():  # finite inputs far beyond any image's overflow inside the network
        raise V2Error(
            400,
            f"{PIXELS_INPUT} row {index}: the model's output is not finite for these values (the largest is "
            f"{float(np.abs(row).max()):.3g}; a preprocessed image's are within a few units of 0); send "
            "preprocessed pixels",
        )
    return probabilities
