"""The HTTP server: `python -m mnv3.server --model PATH [flags]`, or `create_app(ServerConfig(...))`.

POST /predict: admit (or 503 at once when --max-in-flight are already in) -> read the body (bounded in
size and time, streamed) -> cache lookup by sha256 of the bytes -> on a miss, decode + preprocess in a
thread pool, which queues the image for inference -> DynamicBatcher (one thread gathers the next batch
while another runs the engine) -> top-k. A request whose client goes away or whose deadline passes is
cancelled wherever it is, so its work is dropped, not computed. SIGTERM drains: no new connections,
in-flight requests are answered, then the process exits 0. Nothing here imports torch.
Settings are `mnv3.config`, failures answer as `mnv3.errors` lists them, bodies are read by
`mnv3.uploads` and timings and counts are exported by `mnv3.metrics`. Several models can be served
side by side (`mnv3.serving`): `?model=NAME` picks one, `GET /models` lists them. The Open Inference
Protocol's endpoints (`/v2/...`, Triton's clients) are `mnv3.v2_router`, over the same models.
With `--api-keys FILE`, `mnv3.auth` lets a request in only with a key of the scope its path needs.
"""

import asyncio
import copy
import gc
import ipaddress
import json
import logging
import resource
import signal
import socket
import sys
import threading
from contextlib import asynccontextmanager
from datetime import datetime

import uvicorn
import uvicorn.logging
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mnv3 import __version__, container
from mnv3.api_docs import docs_router, without_validation_errors
from mnv3.artifacts import UnreadableManifest
from mnv3.auth import ApiKeyAuth, KeyFileError, Keys, document_keys, exposure_warning, load_key_file, route_path
from mnv3.batcher import ShuttingDown
from mnv3.config import PROG, ModelSpec, ServerConfig, command_name, parse_args, unknown_variables
from mnv3.connections import BoundedHeadProtocol
from mnv3.engine import Engine, ModelLoadError, Prediction
from mnv3.errors import (
    CUT_OFF,
    ERROR_DOCS,
    ERRORS,
    INTERNAL,
    UnknownQueryParameter,
    body_for_path,
    error_response,
    internal_error_message,
)
from mnv3.page import page_router
from mnv3.serving import ModelName, ServedModel, Serving, served_model, serving, unless_disconnected
from mnv3.stats import stats_router
from mnv3.uploads import CloseUnreadBody, read_upload
from mnv3.v2_protocol import HEADER_LENGTH
from mnv3.v2_router import http_error_in_shape, v2_router

# Named, not __name__: run as `python -m mnv3.server` that is "__main__", whose lines --log-level and "mnv3" miss.
log = logging.getLogger("mnv3.server")


def load_engine(config: ServerConfig, spec: ModelSpec | None = None) -> Engine:
    """The engine of `spec`, one of `config.models` (default: the default model)."""
    spec = spec or config.models[0]
    return Engine.load(
        spec.path,
        config.backend_of(spec),
        config.intra_op_threads,
        config.inter_op_threads,
        config.max_batch_size,
        allow_spinning=bool(config.ort_spinning),
        batch_threads=config.batch_threads,  # 0: stage 2's measurement, else half (Engine.load)
    )


def load_engines(config: ServerConfig) -> list[Engine]:
    """Every model's engine, in `config.models` order."""
    return [load_engine(config, spec) for spec in config.models]


# -------------------------------------------------------------------------------------------- endpoints


class PredictResponse(BaseModel):
    model: str = Field(
        description="the file that answered and the first 12 hex digits of its sha256 (under --backend auto, the "
        "build stage 2 chose, which may not be the file the server was given)"
    )
    name: str = Field(description="the served model's name: what ?model= picks and GET /models lists")
    predictions: list[Prediction] = Field(description="top-k classes, most probable first")
    cache_hit: bool = Field(
        description="answered without running inference for this request: from the cache, "
        "or shared with an identical request in flight"
    )
    batch_size: int = Field(description="requests in the inference call this one ran in; 0 on a cache hit")
    queue_ms: float = Field(description="from queueing to the start of its batch's inference; 0 on a cache hit")
    preprocess_ms: float = Field(description="decode + preprocess, including waiting for a thread; 0 on a cache hit")
    inference_ms: float = Field(description="the whole batch's inference call; 0 on a cache hit")


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {"file": {"type": "string", "format": "binary"}},
                }
            },
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}

predict_router = APIRouter(tags=["predict"])


@predict_router.post(
    "/predict",
    response_model=PredictResponse,
    responses=ERROR_DOCS,
    openapi_extra=UPLOAD_BODY,
    summary="Classify one image (multipart field 'file', or a raw image/* or octet-stream body) with the "
    "default model, or the one ?model= names",
)
async def predict(request: Request, model_name: ModelName = None) -> PredictResponse:
    # Not Depends(serving) and Depends(served_model), as the other endpoints have them: FastAPI solves each
    # dependency anew for every request, which on the busiest path costs the event loop more than the lookups.
    s: Serving = request.app.state.serving
    if request.scope["query_string"]:  # a misspelt ?model= would be ignored, and the default model answer
        if unknown := [name for name in request.query_params if name != "model"]:
            raise UnknownQueryParameter(f"unknown query parameter {unknown[0][:64]!r}: /predict takes only ?model=NAME")
        if len(request.query_params.getlist("model")) > 1:  # one of them would be ignored
            raise UnknownQueryParameter("?model= given more than once: /predict takes one model")
    model = s.model(model_name)
    with s.request(model):
        data = await read_upload(request, s.config.max_upload_bytes, s.config.body_timeout_s)
        deadline = s.deadline()
        # The computation and a follower's wait on an identical request watch for a disconnect (a follower
        # left waiting holds its --max-in-flight place); a cache hit is answered before a watcher would start.
        result, hit = await model.cache.get_or_compute(
            data,
            lambda: unless_disconnected(request, model.classify(data, deadline)),
            follow=lambda waiting: unless_disconnected(request, waiting),
        )
    if hit:
        result = result.as_cache_hit()
    # vars, not asdict: asdict deep-copies the predictions, and a cache hit has little else to do.
    return PredictResponse(model=model.engine.model_id, name=model.name, cache_hit=hit, **vars(result))


class Status(BaseModel):
    status: str


class ModelMemoryInfo(BaseModel):
    file_bytes: int = Field(
        description="the model's size on disk (an OpenVINO IR: its .xml and .bin), about what its weights take "
        "in memory"
    )
    load_rss_bytes: int | None = Field(
        description="how much the process's resident memory grew while this model's engine opened: "
        "OpenVINO compiles (and runs once) every static batch size then, onnxruntime allocates most of its "
        "buffers at the warm-up instead. Approximate; null without /proc"
    )
    warm_up_rss_bytes: int | None = Field(
        description="how much the process's resident memory grew while this model warmed up (batch 1 and the "
        "largest batch): mostly its runtime's buffers for the largest batch. Measured around the "
        "warm-up, so approximate, and negative when the process gave back more than the warm-up took (memory "
        "freed after the opening); null before warm-up or without /proc"
    )


class ModelInfo(BaseModel):
    name: str = Field(description="what ?model= and /v2/models/{name} take")
    default: bool = Field(description="whether requests that name no model get this one")
    model: str
    variant: str = Field(description="the model file's stem, e.g. fp32 or static_int8")
    file: str
    sha256: str
    weights: str = Field(
        description="where the weights came from, as stage 1 recorded it beside the model: imagenet1k_v1, "
        "file:<sha256[:12]> (--weights), random-init (a seeded stand-in: its latency is real, its labels mean "
        "nothing) or unknown (no manifest beside the model says)"
    )
    backend: str = Field(description="the engine that runs the model (onnxruntime or openvino)")
    backend_choice: dict = Field(
        description="--backend asked for, what serves (file, engine, OpenVINO precision) "
        "and why: under auto, stage 2's manifest entry or the fallback's reason"
    )
    input_name: str
    input_shape: list[int | str]
    providers: list[str]
    class_names: str = Field(description="where labels come from")
    preprocessing: dict = Field(
        description="what every upload goes through before this model (from the manifest beside it): "
        "shorter side to resize, centre crop, (x/255 - mean)/std; jpeg_draft: large JPEGs decoded at reduced scale; "
        "resize_crop_only: only the part the crop keeps resized (both false: equal to torchvision's transforms)"
    )
    threads: dict[str, int] = Field(
        description="intra_op: a single image's inference (and every onnxruntime call); inter_op: onnxruntime's "
        "pool across operators; batch: what a batch of more than one image runs on (OpenVINO: --batch-threads); "
        "preprocess: the decoding threads"
    )
    ort_spinning: bool = Field(description="whether idle onnxruntime threads busy-wait")
    batching: dict[str, int | float]
    cache: dict[str, int]
    limits: dict[str, int | float]
    top_k: int = Field(description="predictions an answer carries: --top-k, or every class of a model with fewer")
    memory: ModelMemoryInfo


class ModelsInfo(BaseModel):
    default: str = Field(description="the name of the model that requests naming none get")
    models: list[ModelInfo] = Field(description="every model served, the default first")


ops_router = APIRouter(tags=["operations"])


@ops_router.get(
    "/healthz",
    response_model=Status,
    responses={
        503: {
            "model": Status,
            "description": "a model's warm-up failed (unready for good, until a restart), or a call into an engine "
            "has not returned for minutes (a hung runtime)",
        }
    },
    summary="Liveness: the process is up, not broken for good and not stuck in an inference",
)
async def healthz(s: Serving = Depends(serving)):
    return probe_answer(s.not_live, "ok")


@ops_router.get(
    "/readyz",
    response_model=Status,
    responses={
        503: {
            "model": Status,
            "description": "warming up, a model's warm-up failed, a call into an engine has not returned for "
            "minutes, or shutting down (the status says)",
        }
    },
    summary="Every model is loaded and warmed up",
)
async def readyz(s: Serving = Depends(serving)):
    return probe_answer(s.unready, "ready")


def probe_answer(problem: str | None, fine: str) -> Status | JSONResponse:
    """A probe's answer: 503 saying `problem` if there is one, else 200 saying `fine`."""
    return JSONResponse({"status": problem}, 503) if problem else Status(status=fine)


@ops_router.get(
    "/model",
    response_model=ModelInfo,
    responses={404: ERROR_DOCS[404]},
    summary="What is served, and how: the default model, or the one ?model= names",
)
async def model_info(model: ServedModel = Depends(served_model)) -> ModelInfo:
    return describe(model)


@ops_router.get("/models", response_model=ModelsInfo, summary="Every model served, as GET /model describes one")
async def models_info(s: Serving = Depends(serving)) -> ModelsInfo:
    return ModelsInfo(default=s.default.name, models=[describe(model) for model in s.models.values()])


def describe(served: ServedModel) -> ModelInfo:
    engine, config = served.engine, served.config
    return ModelInfo(
        name=served.name,
        default=served.default,
        model=engine.model_id,
        variant=engine.path.stem,
        file=engine.path.name,
        sha256=engine.sha256,
        weights=engine.weights,
        backend=engine.backend,
        backend_choice=engine.choice.describe(),
        input_name=engine.input_name,
        input_shape=engine.input_shape,
        providers=engine.providers,
        class_names=f"{len(engine.class_names)} names from the file beside the model"
        if engine.class_names
        else "none found: labels are class_<id>",
        preprocessing=engine.preprocessing.record() | config.decoding.record(),
        threads={
            "intra_op": config.intra_op_threads,
            "inter_op": config.inter_op_threads,
            "batch": engine.batch_threads,
            "preprocess": config.preprocess_threads,
        },
        ort_spinning=bool(config.ort_spinning),
        batching={
            "max_batch_size": config.max_batch_size,
            "batch_window_ms": config.batch_window_ms,
            "queue_limit": config.queue_limit,
            "deadline_ms": config.deadline_ms,
        },
        cache={"size": config.cache_size, "entries": len(served.cache)},
        limits={
            "max_upload_bytes": config.max_upload_bytes,
            "max_pixels": config.max_pixels,
            "max_in_flight": config.max_in_flight,
            "body_timeout_s": config.body_timeout_s,
            "shutdown_timeout_s": config.shutdown_timeout_s,
        },
        top_k=min(config.top_k, engine.num_classes),  # --top-k past the model's classes answers them all
        memory=ModelMemoryInfo(**vars(served.memory)),
    )


@ops_router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(s: Serving = Depends(serving)) -> Response:
    return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------------------------------------- app


async def reject(request: Request, exc: Exception) -> JSONResponse:
    """The handler of every exception in ERRORS: count the rejection by its reason, answer as the table says."""
    request.app.state.serving.metrics.count_rejection(exc)
    return error_response(exc)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Any exception no other handler takes (a bug): a 500 with a JSON reason in the path's error shape, where
    Starlette answered plain text, counted as `internal`. Starlette then raises it on, and uvicorn logs it."""
    request.app.state.serving.metrics.rejections.labels(INTERNAL).inc()
    return JSONResponse(body_for_path(route_path(request.scope))(internal_error_message(exc)), 500)


def reload_keys_on_sighup(keys: Keys, path) -> bool:
    """From now on, SIGHUP reads the key file at `path` again into `keys` (a key revoked, added or rotated
    without a restart; a file that cannot be used leaves the keys as they were, and says why). Whether it
    could be set up: only the main thread's event loop can take a signal (not an app served in a thread)."""
    loop = asyncio.get_running_loop()

    def reload() -> None:
        try:
            keys.replace_with(load_key_file(path))
        except KeyFileError as exc:
            log.error("SIGHUP: the keys stay as they were (%d): %s", len(keys.keys), exc)
            return
        log.info("SIGHUP: %d keys read again from %s", len(keys.keys), path)

    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals (Windows)
        return False
    return True


def create_app(config: ServerConfig, *engines: Engine) -> FastAPI:
    """The app; the models are loaded at start-up unless their `engines` are given, one per `config.models`
    in order (the CLI loads them first to fail early). A key file that cannot be used is a KeyFileError here."""

    keys = load_key_file(config.api_keys) if config.api_keys else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.serving = Serving(config, list(engines) or await asyncio.to_thread(load_engines, config))
        warm_up = asyncio.create_task(app.state.serving.warm_up())  # /readyz says 503 until it is done
        reloading = keys is not None and reload_keys_on_sighup(keys, config.api_keys)
        try:
            yield
        finally:
            if reloading:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            warm_up.cancel()
            await asyncio.gather(warm_up, return_exceptions=True)
            await app.state.serving.stop()

    app = FastAPI(
        title="mnv3",
        summary="MobileNetV3 image classification on CPU",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )  # served offline by docs_router
    app.include_router(predict_router)
    app.include_router(ops_router)
    app.include_router(v2_router)
    app.include_router(stats_router)
    app.include_router(page_router)
    app.include_router(docs_router)
    for exc_type in ERRORS:
        app.add_exception_handler(exc_type, reject)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(CacheControl)
    app.add_middleware(HeadAsGet)
    app.add_middleware(CloseUnreadBody, limit=config.max_upload_bytes)
    if keys is not None:
        app.add_middleware(
            ApiKeyAuth,
            keys=keys,
            on_refusal=lambda label: app.state.serving.metrics.rejections.labels(label).inc(),
        )

    def openapi() -> dict:  # FastAPI's document, built once on first use, made true of this server
        if app.openapi_schema is None:
            schema = without_validation_errors(FastAPI.openapi(app))
            app.openapi_schema = document_keys(schema) if config.api_keys else schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if config.cors_origins:
        # Outside access control: a browser's preflight (OPTIONS) carries no key, and its answer is all that
        # lets the page send the real request, key and all. Only the listed pages' scripts may read answers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origin_list,
            allow_methods=["GET", "POST"],
            # /v2's binary tensors and compressed requests, as tritonclient sends them, too; and what tracing
            # adds to a page's requests (W3C Trace Context, as OpenTelemetry's browser SDK sends it; request ids)
            allow_headers=[
                "Authorization",
                "X-API-Key",
                "Content-Type",
                "Content-Encoding",
                HEADER_LENGTH,
                "traceparent",
                "tracestate",
                "X-Request-ID",
            ],
            # for a page's own pacing: backing off after a 503 or 429, a rate-limited key's budget; and where a
            # binary /v2 answer's JSON ends
            expose_headers=["Retry-After", "RateLimit", "RateLimit-Policy", HEADER_LENGTH],
            max_age=600,
        )
    return app


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's HTTP errors (404 no such path, 405 wrong method) in the path's error shape; a 405's `Allow`
    names HEAD wherever it names GET, since HeadAsGet answers it (RFC 9110: Allow lists every method)."""
    assert isinstance(exc, StarletteHTTPException)  # the only class it is registered for
    allowed = (exc.headers or {}).get("Allow", "").split(", ")
    if exc.status_code == 405 and "GET" in allowed and "HEAD" not in allowed:
        exc.headers = {**(exc.headers or {}), "Allow": ", ".join([*allowed, "HEAD"])}
    return await http_error_in_shape(request, exc)


class HeadAsGet:
    """A HEAD request is answered as its GET, without the body (RFC 9110: a server that supports GET supports
    HEAD), where FastAPI's GET routes answer 405: uptime checks and load balancers probe with HEAD, as
    `curl -I` does. The app sees a GET; uvicorn, which keeps the request's own method, sends no body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class CacheControl:
    """What a cache may keep of a GET answer whose route said nothing: the page's files (HTML, scripts, styles,
    images) `no-cache`, kept but checked again by their ETag, so a browser runs an upgraded server's script,
    not its own heuristic copy; the rest (JSON, /metrics) `no-store`: probes, /model, /stats and /v2's
    metadata change, and with API keys an answer is a key holder's (X-API-Key is not Authorization, whose
    answers a shared cache would not store). A POST's answer no cache keeps without explicit freshness: it
    passes untouched, at the cost of one comparison."""

    PAGE_FILES = (b"text/html", b"text/css", b"text/javascript", b"application/javascript", b"image/")

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)

        async def send_with_cache_control(message: Message) -> None:
            # A 304's headers update the stored copy's (RFC 9111, 4.3.4): left alone, it keeps the 200's no-cache.
            if message["type"] == "http.response.start" and message["status"] != 304:
                headers = dict(message.get("headers", []))
                if b"cache-control" not in headers:
                    page_file = headers.get(b"content-type", b"").startswith(self.PAGE_FILES)
                    value = b"no-cache" if page_file else b"no-store"
                    message = {**message, "headers": [*message.get("headers", []), (b"cache-control", value)]}
            await send(message)

        await self.app(scope, receive, send_with_cache_control)


FORCED_STOP = "the server was stopped at once (a second Ctrl-C) before this request finished"


class AnswerCancelledAtShutdown:
    """A request uvicorn cancels when `--shutdown-timeout-s` runs out answers 503 + Retry-After in its path's
    error shape, as one refused while stopping does, where uvicorn would send a plain-text 500 and log the
    cancellation as an application error. Only a cancel of the request's own task counts: a CancelledError
    from something it awaited is not the server stopping. A response already begun cannot be replaced.
    For `python -m mnv3.server` only: under uvicorn nothing but the shutdown cancels a request's task."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_noting_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started or task is None or not task.cancelling():
                raise
            task.uncancel()  # the task ends with this answer; nothing is left to cancel
            stopped = ShuttingDown(FORCED_STOP if scope["app"].state.serving.stopped_at_once else CUT_OFF)
            scope["app"].state.serving.metrics.count_rejection(stopped)
            await error_response(stopped, body=body_for_path(route_path(scope)))(scope, receive, send)


# Python's cyclic garbage collector collects the young generation whenever allocations of container objects
# outnumber frees by this many (700 by default). Under load every request in flight holds hundreds of them
# (Starlette's request, tasks, the multipart parser), so at the default the event loop's thread runs young
# collections often and, now and then, a full one over every object start-up left: work the in-process
# limit never does.
GC_YOUNG_THRESHOLD = 10_000


def settle_garbage_collector() -> None:
    """Once start-up is done: what it left (modules, the models' objects, the app) leaves every future
    collection (gc.freeze), so a full collection walks only what serving made since, and the young generation
    is collected per GC_YOUNG_THRESHOLD allocations. Cycles are still found, in fewer, larger passes. It sets
    the whole process's collector, so only a process that is the server (`main`) calls it, not `create_app`."""
    gc.collect()  # garbage of start-up is freed, not frozen
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class CannotListen(OSError):
    """--host/--port cannot be listened on (a port in use, a host that is not this machine's)."""


def check_can_listen(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn will, then let go, or raise CannotListen: before the models load, so a port
    in use is a one-line error at once rather than uvicorn's, after every model has loaded and warmed up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            probe.bind(address)
    except OSError as exc:  # socket.gaierror too: a host that does not resolve
        reason = exc.strerror or str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {reason}; pick another --port (or --host)") from None


MAX_OPEN_FILES = 65_536  # the most raise_open_file_limit asks for: plenty for one process, not the million some allow


def raise_open_file_limit() -> None:
    """The soft limit on open files up to the hard one, at most MAX_OPEN_FILES, never lowered, as far as the
    kernel allows: every connection is a file descriptor, and a soft limit of 1024 (a common default) would
    refuse connections long before memory or CPU run out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open: keep the soft limit
            log.warning("open-file limit stays %d: %s", soft, exc)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ZonedTimes(logging.Formatter):
    """Times in ISO 8601 with milliseconds and the UTC offset, 2026-12-06T17:14:44.123+00:00: logging's own
    (2026-12-06 17:14:44,123) names no zone, so lines read on a machine in another zone, or across a change
    to or from summer time, were placed at the wrong hour."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


class LifecycleFormatter(ZonedTimes, uvicorn.logging.DefaultFormatter):
    """uvicorn's lines other than the access log's, timed as the server's own."""


def uvicorn_log_config() -> dict:
    """uvicorn's logging, in the format of the server's own lines: its lifecycle and access lines had no time
    and a format of their own, so a log shipper saw three formats in one process. Access lines stay on stdout,
    the rest on stderr, as uvicorn has them."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["default"]["fmt"] = LOG_FORMAT
    config["formatters"]["default"]["()"] = f"{__name__}.{LifecycleFormatter.__name__}"
    access = '%(client_addr)s - "%(request_line)s" %(status_code)s'
    config["formatters"]["access"]["fmt"] = LOG_FORMAT.replace("%(message)s", access)
    config["formatters"]["access"]["()"] = f"{__name__}.{AccessFormatter.__name__}"
    return config


class AccessFormatter(ZonedTimes, uvicorn.logging.AccessFormatter):
    """uvicorn's access line, timed as the server's own, with a client address that is not one quoted: behind
    --forwarded-allow-ips, uvicorn takes X-Forwarded-For's text as the client's address unchecked, so a client
    could write what it liked into the line (a second, forged request line; quotes, tabs, markup)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        client_addr, *rest = record.args  # type: ignore[misc]
        if client_addr and not is_address(str(client_addr).rpartition(":")[0]):  # "HOST:PORT", as uvicorn has it
            record = copy.copy(record)
            record.args = (f"not-an-address:{json.dumps(str(client_addr)[:MAX_LOGGED_ADDRESS])}", *rest)
        return super().formatMessage(record)


MAX_LOGGED_ADDRESS = 64  # characters of a forwarded "address" that is not one
ADDRESS_CHARACTERS = frozenset("0123456789abcdefABCDEF.:")


def is_address(host: str) -> bool:
    """An IPv4 or IPv6 address, written with nothing else: no IPv6 scope id, which Python's ipaddress takes
    after a % whatever its text (quotes, markup)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return set(host) <= ADDRESS_CHARACTERS


def main(argv=None) -> None:
    prog = command_name(PROG)
    config = parse_args(argv, prog=prog)
    level = logging.getLevelName(config.log_level.upper())
    # debug is this server's (a line a batch) and uvicorn's: other libraries' debug lines, such as Pillow's line a
    # PNG chunk, stay out
    own_lines = logging.StreamHandler()
    own_lines.setFormatter(ZonedTimes(LOG_FORMAT))
    logging.basicConfig(level=max(level, logging.INFO), handlers=[own_lines])
    logging.getLogger("mnv3").setLevel(level)
    # python-multipart logs every malformed body at WARNING: any client could fill the log with them, and the
    # 400 answered says the same (counted as bad_input)
    logging.getLogger("python_multipart").setLevel(max(level, logging.ERROR))
    # uvicorn re-raises the SIGTERM it shut down gracefully on; a requested, completed stop is a success, and
    # so is one while the models load.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # before serving: a busy port, a bad model or key file is a one-line error, exit 2
        check_can_listen(config.host, config.port)
        if config.api_keys:
            load_key_file(config.api_keys)  # before the models load, which takes seconds
        app = create_app(config, *load_engines(config))
    except (CannotListen, ModelLoadError, KeyFileError, UnreadableManifest) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # Here, not in create_app: uvicorn cancels a request only at shutdown, while Ray Serve's replicas, which
    # build the same app, are cancelled when their client leaves, which is no reason to answer 503.
    app.add_middleware(AnswerCancelledAtShutdown)
    if not config.api_keys and (warning := exposure_warning(config.host)):
        log.warning(warning)
    for warning in unknown_variables():
        log.warning(warning)
    for warning in container.warnings_for(config):  # settings that ask for more than a container's CPUs or memory
        log.warning(warning)
    raise_open_file_limit()
    settle_garbage_collector()
    server = DelayedShutdownServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=BoundedHeadProtocol,  # a request's head bounded in size and time (mnv3.connections)
            log_level=config.log_level,
            log_config=uvicorn_log_config(),
            # typed int, but uvicorn waits with asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
            timeout_keep_alive=config.keep_alive_s,  # type: ignore[arg-type]
            root_path=config.root_path,
            forwarded_allow_ips=config.forwarded_allow_ips or None,  # None: uvicorn's own default
        ),
        config.shutdown_delay_s,
        app,
    )
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised by uvicorn once it has stopped: a stop asked for (uvicorn.run's)
        pass


class DelayedShutdownServer(uvicorn.Server):
    """uvicorn's server, which on a first SIGTERM goes on serving for `delay_s` with /readyz (and /v2's) answering
    503 before it stops as uvicorn does (the port closed, in-flight requests given --shutdown-timeout-s). A load
    balancer goes on sending for a moment after it is told a pod is going (Kubernetes removes the endpoint while
    the pod is signalled): closed at once, those requests find no one listening. A second SIGTERM, or Ctrl-C,
    ends the wait: uvicorn's stop begins then. A second Ctrl-C during that stop quits without waiting for
    requests in flight (uvicorn's force quit), each answered 503."""

    def __init__(self, config: uvicorn.Config, delay_s: float, app: FastAPI):
        super().__init__(config)
        self.delay_s, self.app = delay_s, app
        self.delayed: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        serving: Serving | None = getattr(self.app.state, "serving", None)  # None: still starting, nothing served
        waiting = sig == signal.SIGTERM and self.delay_s and self.delayed is None and not self.should_exit
        if not waiting or serving is None:
            if self.delayed is not None:
                self.delayed.cancel()
            super().handle_exit(sig, frame)
            return
        serving.drain()
        log.info("SIGTERM: /readyz answers 503; serving %g s more, then stopping", self.delay_s)
        # A plain attribute is what uvicorn's loop polls: setting it from the timer's thread is safe.
        self.delayed = threading.Timer(self.delay_s, super().handle_exit, (sig, frame))
        self.delayed.daemon = True
        self.delayed.start()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        # not when uvicorn ran it before the second Ctrl-C came (that one drained as the first asked)
        if self.force_exit and not getattr(self.lifespan, "shutdown_event", asyncio.Event()).is_set():
            # A second Ctrl-C: uvicorn skips the app's shutdown, which asyncio.run then cancels, and Starlette
            # logs that as a failed shutdown with a traceback. It runs here instead, without a drain: whatever
            # still waits for inference is answered 503 at once.
            serving: Serving | None = getattr(self.app.state, "serving", None)
            if serving is not None:
                serving.stopped_at_once = True
            await self.lifespan.shutdown()


if __name__ == "__main__":
    main()
