"""The HTTP server: `python -m mnv3.server --model PATH [flags]`, or `create_app(ServerConfig(...))`.

POST /predict: admit (or 503 at once when --max-in-flight are already in) -> read the body (bounded in
size and time, streamed) -> cache lookup by sha256 of the bytes -> on a miss, decode + preprocess in a
thread pool -> DynamicBatcher (one ORT thread) -> top-k. A request whose client goes away or whose
deadline passes is cancelled wherever it is, so its work is dropped, not computed. SIGTERM drains:
no new connections, in-flight requests are answered, then the process exits 0. Nothing here imports torch.
"""
import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from mnv3.batcher import DeadlineExceeded, DynamicBatcher, QueueFull, ShuttingDown
from mnv3.cache import ResultCache
from mnv3.engine import BACKENDS, Engine, InferenceError, ModelLoadError, Prediction
from mnv3.latency import DEFAULT_INTER_OP_THREADS, DEFAULT_INTRA_OP_THREADS
from mnv3.preprocess import DEFAULT_MAX_PIXELS, ImageTooLarge, InvalidImage, decode_and_preprocess
from mnv3.api_docs import docs_router
from mnv3.page import page_router
from mnv3.stats import stats_router

log = logging.getLogger(__name__)

# Pillow's decode/resize and numpy's normalisation release the GIL, so two threads keep both cores
# of the target machine busy while the event loop stays free; more would only fight ORT's intra-op
# threads for the same two cores. Raise it with the core count.
DEFAULT_PREPROCESS_THREADS = 2
RETRY_AFTER_S = 1
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _option(default, help: str, minimum=None, choices=None):
    return field(default=default, metadata={"help": help, "minimum": minimum, "choices": choices})


@dataclass(frozen=True)
class ServerConfig:
    """Every setting of one server. Each field is also a CLI flag and an MNV3_<NAME> variable."""
    model: Path = field(metadata={"help": "ONNX model file; imagenet_classes.json beside it names the classes"})
    host: str = _option("127.0.0.1", "address to bind")
    port: int = _option(8000, "port to bind", minimum=0)
    backend: str = _option("onnxruntime", "inference runtime", choices=BACKENDS)
    cache_size: int = _option(1024, "result cache entries; 0 disables the cache", minimum=0)
    batch_window_ms: float = _option(20.0, "how long a batch waits for more requests after its first", minimum=0)
    max_batch_size: int = _option(32, "largest batch; 1 runs every request alone, with no window wait", minimum=1)
    max_in_flight: int = _option(512, "requests admitted at once (uploading, decoding, queued or running); more get "
                                      "503 before their body is read", minimum=1)
    queue_limit: int = _option(512, "requests waiting for inference before new ones get 503", minimum=1)
    deadline_ms: float = _option(10_000.0, "per request from arrival; past it: 504, and unrun work is dropped",
                                 minimum=1)
    intra_op_threads: int = _option(DEFAULT_INTRA_OP_THREADS, "onnxruntime threads within an operator", minimum=1)
    inter_op_threads: int = _option(DEFAULT_INTER_OP_THREADS, "onnxruntime threads across operators", minimum=1)
    # Off by default: spinning intra-op threads steal the cores that decoding needs. Measured at 250
    # concurrent clients on 2 cores, batch 32: 95-100 req/s spinning vs 125-129 req/s not.
    ort_spinning: int = _option(0, "1 lets idle onnxruntime threads busy-wait (faster only on otherwise idle cores)",
                                choices=(0, 1))
    preprocess_threads: int = _option(DEFAULT_PREPROCESS_THREADS, "threads that decode and preprocess images",
                                      minimum=1)
    max_upload_bytes: int = _option(10 * 1024 * 1024, "largest request body in bytes (413 above)", minimum=1)
    max_pixels: int = _option(DEFAULT_MAX_PIXELS, "largest image, width x height, checked before decoding (413)",
                              minimum=1)
    body_timeout_s: float = _option(30.0, "seconds to receive a whole request body; a slower or stalled upload "
                                          "gets 408", minimum=0.001)
    shutdown_timeout_s: float = _option(30.0, "on SIGTERM, how long in-flight requests may take before they are "
                                              "cancelled", minimum=0)
    top_k: int = _option(5, "predictions per response", minimum=1)
    log_level: str = _option("info", "logging level", choices=LOG_LEVELS)

    def __post_init__(self):
        for f in fields(self):
            value, minimum, choices = getattr(self, f.name), f.metadata.get("minimum"), f.metadata.get("choices")
            if minimum is not None and value < minimum:
                raise ValueError(f"{f.name} must be at least {minimum}, got {value}")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def parse_args(argv=None, environ=os.environ) -> ServerConfig:
    parser = argparse.ArgumentParser(
        prog="python -m mnv3.server", description="Serve an ONNX MobileNetV3 classifier over HTTP.",
        epilog="Each flag can also be set as MNV3_<FLAG> (e.g. MNV3_CACHE_SIZE=0); the flag wins.")
    for f in fields(ServerConfig):
        env = f"MNV3_{f.name.upper()}"
        default = environ.get(env, None if f.default is MISSING else f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=f.type, default=default, required=default is None,
                            choices=f.metadata.get("choices"),
                            help=f"{f.metadata['help']} [{env}" + ("]" if default is None else "; %(default)s]"))
    args = parser.parse_args(argv)
    try:
        return ServerConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))


def load_engine(config: ServerConfig) -> Engine:
    return Engine.load(config.model, config.backend, config.intra_op_threads, config.inter_op_threads,
                       config.max_batch_size, allow_spinning=bool(config.ort_spinning))


# ---------------------------------------------------------------------------------------------- errors

class BadUpload(ValueError):
    """The request does not carry an image the way /predict takes one."""


class UnsupportedMediaType(BadUpload):
    pass


class BodyTooLarge(BadUpload):
    pass


class SlowUpload(BadUpload):
    pass


class Busy(QueueFull):
    """--max-in-flight requests are already admitted: refused before reading the body, so memory stays bounded."""


# exception -> (HTTP status, mnv3_rejections_total reason or None, what it means for the API docs)
ERRORS = {
    BadUpload: (400, "bad_input", "no multipart field 'file', or a malformed multipart body"),
    InvalidImage: (400, "bad_input", "empty body, not an image, or a corrupt/truncated image"),
    SlowUpload: (408, "slow_upload", "the body did not arrive within --body-timeout-s"),
    BodyTooLarge: (413, "too_large", "body over --max-upload-bytes (refused by its Content-Length before reading)"),
    ImageTooLarge: (413, "too_large", "image over --max-pixels, or a decompression bomb"),
    UnsupportedMediaType: (415, "bad_input", "content type is neither multipart/form-data nor image/*"),
    InferenceError: (500, None, "inference failed for the batch this request ran in"),
    QueueFull: (503, "queue_full", "--queue-limit requests already wait for inference"),
    Busy: (503, "busy", "--max-in-flight requests already admitted (refused before reading the body)"),
    ShuttingDown: (503, "shutting_down", "the server is stopping"),
    DeadlineExceeded: (504, "deadline", "no result within --deadline-ms; work not yet run was dropped"),
    # nginx's code for it: only the server's log and metrics see this, the client has gone
    ClientDisconnect: (499, "disconnected", "the client closed the connection first; its work was dropped"),
}
REJECTION_REASONS = sorted({reason for _, reason, _ in ERRORS.values() if reason})


class ErrorDetail(BaseModel):
    detail: str = Field(description="what was wrong, for a person to read")


ERROR_DOCS = {status: {"model": ErrorDetail,
                       "description": "; ".join(doc for s, _, doc in ERRORS.values() if s == status)}
              for status in sorted({status for status, _, _ in ERRORS.values()})}
ERROR_DOCS[503]["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                              "schema": {"type": "integer"}}}


async def error_response(request: Request, exc: Exception) -> JSONResponse:
    status, reason, _ = next(ERRORS[t] for t in type(exc).__mro__ if t in ERRORS)
    if reason:
        request.app.state.serving.metrics.rejections.labels(reason).inc()
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    if status in (408, 413) or isinstance(exc, Busy):
        headers["Connection"] = "close"  # the rest of the body is unread: do not take it as the next request
    return JSONResponse({"detail": str(exc) or "client disconnected"}, status, headers=headers)


# --------------------------------------------------------------------------------------------- uploads

async def read_upload(request: Request, limit: int, timeout_s: float) -> bytes:
    """The image bytes of a multipart 'file' field or a raw image/* body, never reading past `limit` bytes
    nor waiting past `timeout_s` for them: a stalled client would otherwise hold its slot forever."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_upload(request, limit)
    except TimeoutError:
        raise SlowUpload(f"the request body did not arrive within {timeout_s:g} s") from None


async def _read_upload(request: Request, limit: int) -> bytes:
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "multipart/form-data" and not media_type.startswith("image/"):
        raise UnsupportedMediaType(f"content type {content_type or '(none)'!r} not accepted: send multipart/form-data "
                                   "with the image in field 'file', or the raw image with an image/* content type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body of {declared} bytes is over the limit of {limit}")
    body = _bounded(request.stream(), limit)
    if media_type.startswith("image/"):
        return b"".join([chunk async for chunk in body])
    try:
        form = await MultiPartParser(request.headers, body, max_files=1, max_fields=16).parse()
    except MultiPartException as exc:
        raise BadUpload(f"malformed multipart body: {exc.message}") from exc
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadUpload(f"expected the image as multipart file field 'file'; got fields {sorted(form.keys())}")
        return await upload.read()
    finally:
        await form.close()


async def _bounded(stream, limit: int):
    # Content-Length can be absent (chunked) or lie, so the limit is also enforced on what arrives.
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > limit:
            raise BodyTooLarge(f"body is over the limit of {limit} bytes")
        yield chunk


# ---------------------------------------------------------------------------------------------- serving

class Metrics:
    def __init__(self, serving: "Serving"):
        self.registry = CollectorRegistry()  # per app, so tests can build several
        registry = self.registry
        self.request_latency = Histogram("mnv3_request_latency_seconds", "POST /predict, arrival to response",
                                         registry=registry)
        self.queue_wait = Histogram("mnv3_queue_wait_seconds", "queued until its batch's inference started",
                                    registry=registry)
        self.preprocess = Histogram("mnv3_preprocess_seconds", "decode + preprocess, including waiting for a thread",
                                    registry=registry)
        self.inference = Histogram("mnv3_inference_seconds", "one batched inference call", registry=registry)
        self.batch_size = Histogram("mnv3_batch_size", "requests per inference call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self.rejections = Counter("mnv3_rejections", "requests refused, by reason", ["reason"], registry=registry)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)  # exported as 0 before the first rejection
        registry.register(_LiveCounts(serving))


class _LiveCounts:
    """Reads counts where they are kept, at scrape time, so the cache and batcher stay the one source."""

    def __init__(self, serving: "Serving"):
        self.serving, self.cache, self.batcher = serving, serving.cache, serving.batcher

    def collect(self):
        yield CounterMetricFamily("mnv3_cache_hits", "answered from the cache or a shared computation",
                                  value=self.cache.hits)
        yield CounterMetricFamily("mnv3_cache_misses", "computed", value=self.cache.misses)
        yield GaugeMetricFamily("mnv3_cache_entries", "results stored", value=len(self.cache))
        yield GaugeMetricFamily("mnv3_queue_depth", "requests waiting for inference", value=self.batcher.depth)
        yield GaugeMetricFamily("mnv3_in_flight", "requests admitted and not yet answered", value=self.serving.in_flight)
        yield CounterMetricFamily("mnv3_dropped", "requests skipped before inference: deadline passed or client gone",
                                  value=self.batcher.dropped)


@dataclass(frozen=True)
class Classified:
    predictions: list[Prediction]
    batch_size: int
    queue_ms: float
    preprocess_ms: float
    inference_ms: float


class Serving:
    """Everything one app serves with; built at start-up and handed to endpoints by `Depends(serving)`."""

    def __init__(self, config: ServerConfig, engine: Engine):
        self.config = config
        self.engine = engine
        self.cache = ResultCache(config.cache_size, engine.model_id,
                                 leader_only_errors=(DeadlineExceeded, QueueFull, ClientDisconnect))
        self.preprocessing = 0  # requests being decoded: the batcher's window waits only for these
        self.batcher = DynamicBatcher(self._run_batch, config.max_batch_size, config.batch_window_ms, config.queue_limit,
                                      incoming=lambda: self.preprocessing)
        self.preprocess_pool = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="mnv3-preprocess")
        self.in_flight = 0  # admitted /predict requests, from arrival to response
        self.metrics = Metrics(self)
        self.not_ready_reason: str | None = "warming up"

    async def warm_up(self) -> None:
        """Run batch 1 and the largest batch once, then start batching. Requests queue meanwhile."""
        try:
            await asyncio.to_thread(self.engine.warm_up, sorted({1, self.config.max_batch_size}))
            self.not_ready_reason = None
        except InferenceError as exc:
            log.error("warm-up failed: %s", exc)
            self.not_ready_reason = f"warm-up failed: {exc}"
        # Only now, so ORT calls never overlap; even after a failure, so requests fail with its error, not time out.
        self.batcher.start()

    @contextmanager
    def admit(self):
        """Count a request in for its whole life, or refuse it at once when --max-in-flight are in."""
        if self.in_flight >= self.config.max_in_flight:
            raise Busy(f"server busy: {self.in_flight} requests in flight (limit {self.config.max_in_flight})")
        self.in_flight += 1  # only ever changed on the event loop, so no lock
        try:
            yield
        finally:
            self.in_flight -= 1

    async def stop(self) -> None:
        await self.batcher.stop(self.config.shutdown_timeout_s)
        self.preprocess_pool.shutdown(wait=False, cancel_futures=True)

    async def classify(self, data: bytes, deadline: float) -> Classified:
        started = time.perf_counter()
        self.preprocessing += 1  # only ever changed on the event loop, so no lock
        try:
            # Cancelling a decode that has not started yet removes it from the pool's queue.
            async with asyncio.timeout_at(deadline):
                array = await asyncio.get_running_loop().run_in_executor(self.preprocess_pool,
                                                                         decode_and_preprocess, data,
                                                                         self.config.max_pixels)
        except TimeoutError:
            raise DeadlineExceeded("deadline passed while waiting to decode the image") from None
        finally:
            self.preprocessing -= 1
        preprocess_s = time.perf_counter() - started
        self.metrics.preprocess.observe(preprocess_s)
        result = await self.batcher.submit(array, deadline)
        self.metrics.queue_wait.observe(result.queue_s)
        return Classified(self.engine.top_k(result.row, self.config.top_k), result.batch_size,
                          1000 * result.queue_s, 1000 * preprocess_s, 1000 * result.inference_s)

    def _run_batch(self, batch: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        probabilities = self.engine.predict(batch)
        self.metrics.inference.observe(time.perf_counter() - started)
        self.metrics.batch_size.observe(len(batch))
        return probabilities


async def serving(request: Request) -> Serving:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop on every request.
    return request.app.state.serving


# -------------------------------------------------------------------------------------------- endpoints

class PredictResponse(BaseModel):
    model: str = Field(description="model file name and the first 12 hex digits of its sha256")
    predictions: list[Prediction] = Field(description="top-k classes, most probable first")
    cache_hit: bool = Field(description="answered without running inference for this request: from the cache, "
                                        "or shared with an identical request in flight")
    batch_size: int = Field(description="requests in the inference call this one ran in; 0 on a cache hit")
    queue_ms: float = Field(description="from queueing to the start of its batch's inference; 0 on a cache hit")
    preprocess_ms: float = Field(description="decode + preprocess, including waiting for a thread; 0 on a cache hit")
    inference_ms: float = Field(description="the whole batch's inference call; 0 on a cache hit")


UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"],
                                       "properties": {"file": {"type": "string", "format": "binary"}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"}},
}}}

predict_router = APIRouter(tags=["predict"])


@predict_router.post("/predict", response_model=PredictResponse, responses=ERROR_DOCS, openapi_extra=UPLOAD_BODY,
                     summary="Classify one image (multipart field 'file', or a raw image/* body)")
async def predict(request: Request, s: Serving = Depends(serving)) -> PredictResponse:
    started = time.perf_counter()
    deadline = asyncio.get_running_loop().time() + s.config.deadline_ms / 1000
    try:
        with s.admit():
            data = await read_upload(request, s.config.max_upload_bytes, s.config.body_timeout_s)
            # Only the computation watches for a disconnect: a cache hit is answered before a watcher
            # task would even start, and a follower's wait on an identical request costs nothing.
            result, hit = await s.cache.get_or_compute(
                data, lambda: unless_disconnected(request, s.classify(data, deadline)))
    finally:
        s.metrics.request_latency.observe(time.perf_counter() - started)
    if hit:  # this request ran nothing: report no batch and no stage times
        result = replace(result, batch_size=0, queue_ms=0.0, preprocess_ms=0.0, inference_ms=0.0)
    # vars, not asdict: asdict deep-copies the predictions, which took ~0.15 ms of a 1 ms cache hit.
    return PredictResponse(model=s.engine.model_id, cache_hit=hit, **vars(result))


async def unless_disconnected(request: Request, work):
    """Await `work`, cancelling it if the client goes away first, so its decode and inference are dropped.

    Neither uvicorn nor Starlette cancel an endpoint whose client left; with the body read, the next
    ASGI message can only be the disconnect (or the end of our response).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Status(BaseModel):
    status: str


class ModelInfo(BaseModel):
    model: str
    variant: str = Field(description="the model file's stem, e.g. fp32 or static_int8")
    file: str
    sha256: str
    backend: str
    input_name: str
    input_shape: list[int | str]
    providers: list[str]
    class_names: str = Field(description="where labels come from")
    threads: dict[str, int]
    ort_spinning: bool = Field(description="whether idle onnxruntime threads busy-wait")
    batching: dict[str, int | float]
    cache: dict[str, int]
    limits: dict[str, int | float]
    top_k: int


ops_router = APIRouter(tags=["operations"])


@ops_router.get("/healthz", response_model=Status, summary="The process is up")
async def healthz() -> Status:
    return Status(status="ok")


@ops_router.get("/readyz", response_model=Status, responses={503: {"model": Status, "description": "warming up"}},
                summary="The model is loaded and warmed up")
async def readyz(s: Serving = Depends(serving)):
    if s.not_ready_reason:
        return JSONResponse({"status": s.not_ready_reason}, 503)
    return Status(status="ready")


@ops_router.get("/model", response_model=ModelInfo, summary="What is served, and how")
async def model_info(s: Serving = Depends(serving)) -> ModelInfo:
    engine, config = s.engine, s.config
    return ModelInfo(
        model=engine.model_id, variant=engine.path.stem, file=engine.path.name, sha256=engine.sha256,
        backend=config.backend, input_name=engine.input_name, input_shape=engine.input_shape,
        providers=engine.providers,
        class_names=f"{len(engine.class_names)} names from the file beside the model" if engine.class_names
        else "none found: labels are class_<id>",
        threads={"intra_op": config.intra_op_threads, "inter_op": config.inter_op_threads,
                 "preprocess": config.preprocess_threads},
        ort_spinning=bool(config.ort_spinning),
        batching={"max_batch_size": config.max_batch_size, "batch_window_ms": config.batch_window_ms,
                  "queue_limit": config.queue_limit, "deadline_ms": config.deadline_ms},
        cache={"size": config.cache_size, "entries": len(s.cache)},
        limits={"max_upload_bytes": config.max_upload_bytes, "max_pixels": config.max_pixels,
                "max_in_flight": config.max_in_flight, "body_timeout_s": config.body_timeout_s,
                "shutdown_timeout_s": config.shutdown_timeout_s},
        top_k=config.top_k,
    )


@ops_router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(s: Serving = Depends(serving)) -> Response:
    return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------------------------------------- app

def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    """The app; the model is loaded at start-up unless `engine` is given (the CLI loads it first to fail early)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.serving = Serving(config, engine or await asyncio.to_thread(load_engine, config))
        warm_up = asyncio.create_task(app.state.serving.warm_up())  # /readyz says 503 until it is done
        try:
            yield
        finally:
            warm_up.cancel()
            await asyncio.gather(warm_up, return_exceptions=True)
            await app.state.serving.stop()

    app = FastAPI(title="mnv3", summary="MobileNetV3-Large image classification on CPU", lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # served offline by docs_router
    app.include_router(predict_router)
    app.include_router(ops_router)
    app.include_router(stats_router)
    app.include_router(page_router)
    app.include_router(docs_router)
    for exc_type in ERRORS:
        app.add_exception_handler(exc_type, error_response)
    return app


def main(argv=None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = load_engine(config)  # before binding the port: a bad model is a one-line error, exit 2
    except ModelLoadError as exc:
        print(f"mnv3.server: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # uvicorn re-raises the SIGTERM it shut down gracefully on; a requested, completed stop is a success.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(create_app(config, engine), host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=config.shutdown_timeout_s)


if __name__ == "__main__":
    main()
