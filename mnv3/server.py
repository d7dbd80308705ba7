"""The HTTP server: `python -m mnv3.server --model PATH [flags]`, or `create_app(ServerConfig(...))`.

POST /predict: admit (or 503 at once when --max-in-flight are already in) -> read the body (bounded in
size and time, streamed) -> cache lookup by sha256 of the bytes -> on a miss, decode + preprocess in a
thread pool -> DynamicBatcher (one ORT thread) -> top-k. A request whose client goes away or whose
deadline passes is cancelled wherever it is, so its work is dropped, not computed. SIGTERM drains:
no new connections, in-flight requests are answered, then the process exits 0. Nothing here imports torch.
Settings are `mnv3.config`, failures answer as `mnv3.errors` lists them, bodies are read by
`mnv3.uploads` and timings and counts are exported by `mnv3.metrics`.
"""
import asyncio
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace

import numpy as np
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from mnv3.batcher import DeadlineExceeded, DynamicBatcher, QueueFull
from mnv3.cache import ResultCache
from mnv3.api_docs import docs_router
from mnv3.config import ServerConfig, parse_args
from mnv3.engine import Engine, InferenceError, ModelLoadError, Prediction
from mnv3.errors import ERROR_DOCS, ERRORS, Busy, error_entry, error_response
from mnv3.metrics import Metrics
from mnv3.page import page_router
from mnv3.preprocess import decode_and_preprocess
from mnv3.stats import stats_router
from mnv3.uploads import read_upload

log = logging.getLogger(__name__)


def load_engine(config: ServerConfig) -> Engine:
    return Engine.load(config.model, config.backend, config.intra_op_threads, config.inter_op_threads,
                       config.max_batch_size, allow_spinning=bool(config.ort_spinning))


# ---------------------------------------------------------------------------------------------- serving

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
        self.metrics = Metrics(self.cache, self.batcher, in_flight=lambda: self.in_flight)
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
                                                                         self.config.max_pixels,
                                                                         self.engine.preprocessing)
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
    # vars, not asdict: asdict deep-copies the predictions, and a cache hit has little else to do.
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

async def reject(request: Request, exc: Exception) -> JSONResponse:
    """The handler of every exception in ERRORS: count the rejection by its reason, answer as the table says."""
    _, reason, _ = error_entry(exc)
    if reason:
        request.app.state.serving.metrics.rejections.labels(reason).inc()
    return error_response(exc)


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
        app.add_exception_handler(exc_type, reject)
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
