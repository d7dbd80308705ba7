"""The serving core of one app: the models it serves, each with its own cache and batcher, and what they share.

`Serving` holds, for the app's lifetime, one `ServedModel` per configured model (engine, result cache,
dynamic batcher, metrics series) and what they share: the preprocess thread pool, the admission count
(--max-in-flight counts every request, whatever its model) and one inference lock. Endpoints reach it
with `Depends(serving)`, and the model a request names with `Depends(served_model)` (`?model=NAME`,
default: the first configured model) or `Serving.model(name)`; an unknown name is `UnknownModel` (404).
The busiest endpoints (/predict, /v2 infer) take it from `request.app.state` instead: FastAPI solves each
dependency anew for every request.

Guarantees:
- at most one inference call runs at a time across all models: each batcher has its own runner thread,
  and the lock makes them take turns, because one call already spreads over every core
  (--intra-op-threads) and two at once would only oversubscribe them;
- a model's batcher starts only after every model has warmed up, so warm-up calls never overlap
  anything; readiness (`unready` None) means every model is warmed up, no call into an engine has run past
  STUCK_AFTER_S, and the server is not draining;
- a request's decode, queueing and inference are cancelled when its deadline passes or its client
  leaves (`unless_disconnected`), so abandoned work is dropped, not computed (a decode under way runs to
  its end, and its image is not queued).
"""

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Annotated

import numpy as np
from fastapi import Query, Request
from starlette.requests import ClientDisconnect

from mnv3.batcher import BatchResult, DeadlineExceeded, DynamicBatcher, Expected, QueueFull
from mnv3.cache import ResultCache
from mnv3.config import ModelSpec, ServerConfig
from mnv3.engine import Engine, InferenceError, NonFiniteOutput, Prediction, model_bytes, rss_bytes
from mnv3.errors import Busy, UnknownModel
from mnv3.metrics import Metrics
from mnv3.preprocess import decode_and_preprocess
from mnv3.thread_cpu import EVENT_LOOP, PREPROCESS_THREADS

log = logging.getLogger(__name__)
# A call into an engine running this long is taken for hung (probes answer 503): MobileNetV3's largest batch
# takes seconds even on a slow CPU, while --deadline-ms is a latency target a busy server may well miss.
STUCK_AFTER_S = 120.0


@dataclass(frozen=True)
class Classified:
    predictions: list[Prediction]
    batch_size: int
    queue_ms: float
    preprocess_ms: float
    inference_ms: float

    def as_cache_hit(self) -> "Classified":
        """What a request answered from the cache reports: these predictions, and no batch and no stage
        times, since it ran nothing."""
        return replace(self, batch_size=0, queue_ms=0.0, preprocess_ms=0.0, inference_ms=0.0)


@dataclass(frozen=True)
class ModelMemory:
    file_bytes: int
    load_rss_bytes: int | None  # None: no /proc to read
    warm_up_rss_bytes: int | None  # None: not warmed up yet, or no /proc to read


class ServedModel:
    """One model being served: its engine, its result cache and its batcher."""

    def __init__(
        self,
        spec: ModelSpec,
        engine: Engine,
        default: bool,
        config: ServerConfig,
        preprocess_pool: ThreadPoolExecutor,
        inference_lock: threading.Lock,
        metrics: Metrics,
    ):
        self.name, self.engine, self.default, self.config = spec.name, engine, default, config
        self.preprocess_pool, self.inference_lock = preprocess_pool, inference_lock
        # An inference failure is its batch's (the README: only that batch fails), not the image's.
        self.cache = ResultCache(
            config.cache_size,
            engine.model_id,
            leader_only_errors=(DeadlineExceeded, QueueFull, ClientDisconnect, InferenceError),
        )
        self.batcher = DynamicBatcher(
            self._run_batch, config.max_batch_size, config.batch_window_ms, config.queue_limit
        )
        self.metrics = metrics.for_model(self.name, self.cache, self.batcher)
        self.not_ready_reason: str | None = "is warming up"  # None once warmed up
        self.memory = ModelMemory(model_bytes(engine.path), engine.load_rss_bytes, None)
        self.inference_started: float | None = None  # perf_counter() when the running call into the engine began

    @contextmanager
    def _inference(self):
        """The inference lock, held for one call into the engine, whose start `Serving.stuck` reads."""
        with self.inference_lock:
            self.inference_started = started = time.perf_counter()
            try:
                yield
            finally:
                self.inference_started = None
                if (took := time.perf_counter() - started) > STUCK_AFTER_S:
                    log.warning("model %s: a call into its engine returned after %.0f s", self.name, took)

    def warm_up(self) -> None:
        """Run batch 1 and the largest batch once (in a thread), so first requests do not pay for allocations."""
        before = rss_bytes()
        for size in sorted({1, self.config.max_batch_size}):
            with self._inference():  # a call at a time, as `Serving.stuck` times calls
                self.engine.warm_up([size])
        after = rss_bytes()
        if before is not None and after is not None:
            self.memory = replace(self.memory, warm_up_rss_bytes=after - before)
        self.not_ready_reason = None

    async def _decoded_and_inferred(self, data: bytes, deadline: float) -> tuple[BatchResult, float]:
        """One encoded image's row, decoded in the shared pool and queued for inference from there, and the
        seconds the decoding took (waiting for a decode thread included)."""
        expected = self.batcher.expect(deadline)
        # Cancelling the request marks `expected` unwanted: a decode that has not started yet is skipped.
        self.preprocess_pool.submit(self._decode, expected, data)
        result = await self.batcher.result(expected)
        self.metrics.queue_wait.observe(result.queue_s)
        if not np.isfinite(result.row).all():  # a 500, shared with identical requests waiting, never cached
            log.error(
                "model %s: its output for an image is not finite (NaN or infinite logits): answered 500", self.name
            )
            raise NonFiniteOutput(
                f"{self.engine.backend}'s output for this image is not finite (NaN or infinite logits)"
            )
        return result, expected.preparing_s

    def _decode(self, expected: Expected, data: bytes) -> None:
        """In a decode thread: `data` decoded and preprocessed, and queued for inference, or the error why not."""
        if not expected.wanted(time.perf_counter()):  # deadline passed, or client gone, while it waited here
            self.batcher.fail(expected, DeadlineExceeded("deadline passed while the image waited for a decode thread"))
            return
        try:
            array = decode_and_preprocess(data, self.config.max_pixels, self.config.decoding, self.engine.preprocessing)
        except Exception as exc:  # a bad image (400), or any other failure: that request's answer
            self.batcher.fail(expected, exc)
            return
        if self.batcher.queue(expected, array):
            self.metrics.preprocess.observe(expected.preparing_s)

    async def infer(self, array: np.ndarray, deadline: float) -> BatchResult:
        """One preprocessed image's probabilities, as one entry of this model's batcher."""
        result = await self.batcher.submit(array, deadline)
        self.metrics.queue_wait.observe(result.queue_s)
        return result

    async def classify(self, data: bytes, deadline: float) -> Classified:
        """/predict's answer for one encoded image: the top-k and where the time went."""
        result, preprocess_s = await self._decoded_and_inferred(data, deadline)
        return Classified(
            self.engine.top_k(result.row, self.config.top_k),
            result.batch_size,
            1000 * result.queue_s,
            1000 * preprocess_s,
            1000 * result.inference_s,
        )

    async def probabilities(self, data: bytes, deadline: float) -> np.ndarray:
        """Every class's probability for one encoded image (what the Open Inference Protocol returns)."""
        result, _ = await self._decoded_and_inferred(data, deadline)
        # A copy: the row is a view of its whole batch's output, which a cached view would keep alive.
        return result.row.copy()

    def _run_batch(self, batch: np.ndarray) -> np.ndarray:
        with self._inference():
            started = time.perf_counter()
            try:
                probabilities = self.engine.predict(batch)
            except InferenceError as exc:  # its requests get a 500 each; the log says why, once a batch
                log.error(
                    "model %s: %s (a batch of %d images: each request in it gets 500)", self.name, exc, len(batch)
                )
                raise
            inference_s = time.perf_counter() - started
            self.metrics.inference.observe(inference_s)
        self.metrics.batch_size.observe(len(batch))
        # --log-level debug: how batching behaves, a line a batch (what /metrics sums up)
        log.debug("model %s: a batch of %d, inference %.1f ms", self.name, len(batch), 1000 * inference_s)
        return probabilities


class Serving:
    """Everything one app serves with; built at start-up and handed to endpoints by `Depends(serving)`, or
    taken from `request.app.state` by the busiest (see the module's docstring)."""

    def __init__(self, config: ServerConfig, engines: list[Engine]):
        """`engines`: one per `config.models`, in that order. Built on the event loop's thread (the app's
        lifespan), which the metrics then count as the event loop's."""
        self.config = config
        self.preprocess_pool = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix=PREPROCESS_THREADS)
        self.inference_lock = threading.Lock()
        self.in_flight = 0  # admitted requests, from arrival to response
        specs = config.models
        self.metrics = Metrics(
            [spec.name for spec in specs],
            in_flight=lambda: self.in_flight,
            thread_roles={threading.get_ident(): EVENT_LOOP},
        )
        self.models = {
            spec.name: ServedModel(
                spec, engine, i == 0, config, self.preprocess_pool, self.inference_lock, self.metrics
            )
            for i, (spec, engine) in enumerate(zip(specs, engines, strict=True))
        }
        self.default = self.models[specs[0].name]
        self.not_ready_reason: str | None = "warming up"
        # Why the server is broken for good (a model's warm-up failed), or None: what liveness probes are told,
        # as the server stays unready until a restart; readiness alone would leave it so, never restarted.
        self.broken: str | None = None
        self.draining = False  # drain() was called: not ready, whatever warm-up says (`unready`)
        self._stuck_since: float | None = None  # the start of the stuck call `stuck` last logged
        # A second Ctrl-C asked to quit now: stop() lets queued and running work no time to finish.
        self.stopped_at_once = False

    # The default model's pieces: what a one-model server has (tests hold them).
    @property
    def engine(self) -> Engine:
        return self.default.engine

    @property
    def batcher(self) -> DynamicBatcher:
        return self.default.batcher

    def model(self, name: str | None) -> ServedModel:
        """The model called `name` (None: the default one), or UnknownModel listing those served."""
        if name is None:
            return self.default
        try:
            return self.models[name]
        except KeyError:
            empty = "; leave ?model= out for the default" if not name else ""  # ?model= with nothing after it
            raise UnknownModel(
                f"no model named {name!r}{empty}; this server serves {', '.join(self.models)} "
                f"(default {self.default.name})"
            ) from None

    def drain(self) -> None:
        """Not ready from now on, while requests are still served (a SIGTERM's --shutdown-delay-s): a load
        balancer polling /readyz stops sending before the port closes."""
        self.draining = True

    @property
    def stuck(self) -> str | None:
        """Why the server looks hung, or None: a call into an engine (a batch, or a warm-up) has run longer than
        STUCK_AFTER_S, and every model waits for it (one inference at a time). Logged once a call, at the first
        probe that finds it."""
        now = time.perf_counter()
        for served in self.models.values():
            started = served.inference_started
            if started is not None and now - started > STUCK_AFTER_S:
                reason = f"model {served.name}'s engine has not returned from a call for {now - started:.0f} s"
                if started != self._stuck_since:
                    self._stuck_since = started
                    log.error("%s: it looks hung", reason)
                return reason
        return None

    @property
    def unready(self) -> str | None:
        """Why the server is not ready (what /readyz says with its 503), or None: draining comes first, so a
        warm-up ending meanwhile cannot make it ready again."""
        return self._every_model_held or self.not_ready_reason

    @property
    def _every_model_held(self) -> str | None:
        """Why no model can be ready, whatever its own state: the server drains, or an inference is stuck."""
        return "shutting down" if self.draining else self.stuck

    @property
    def not_live(self) -> str | None:
        """Why the server wants a restart (what /healthz says with its 503), or None: a model's warm-up
        failed, or an inference call is stuck (a hung runtime never returns)."""
        return self.broken or self.stuck

    def model_unready(self, served: ServedModel) -> str | None:
        """Why `served` is not ready (its /v2 ready route's 503), or None: a draining server, or a stuck
        inference, holds every model."""
        return self._every_model_held or (served.not_ready_reason and f"model {served.name} {served.not_ready_reason}")

    async def warm_up(self) -> None:
        """Warm every model up, one after the other, then start batching. Requests queue meanwhile. A model
        that fails to warm up says so (its `not_ready_reason`), and so does the server; the others are ready."""
        started = time.perf_counter()
        failures = []
        for served in self.models.values():
            try:
                await in_daemon_thread(served.warm_up)
            except Exception as exc:  # any: a warm-up task that died silently left /readyz "warming up" for good
                what = str(exc) if isinstance(exc, InferenceError) else f"{type(exc).__name__}: {exc}"
                log.error("warm-up of %s failed: %s", served.name, what, exc_info=not isinstance(exc, InferenceError))
                served.not_ready_reason = f"failed to warm up: {what}"
                failures.append(f"{served.name}: {what}")
        if failures:
            self.not_ready_reason = self.broken = f"warm-up failed: {'; '.join(failures)}"
        else:
            self.not_ready_reason = None
            log.info(
                "ready (GET /readyz 200): %s warmed up in %.1f s", ", ".join(self.models), time.perf_counter() - started
            )
        # Even after a failure, so requests fail with its error instead of timing out.
        for served in self.models.values():
            served.batcher.start()

    @contextmanager
    def request(self, model: ServedModel):
        """An inference request to `model` for its whole life: counted in, or refused at once when
        --max-in-flight are in; once in, its latency observed in `model`'s metrics however it ends. Not a
        refusal's: under overload their instant answers would pull the latency quantiles down as it rises
        (mnv3_rejections_total counts them)."""
        if self.in_flight >= self.config.max_in_flight:
            raise Busy(f"server busy: {self.in_flight} requests in flight (limit {self.config.max_in_flight})")
        started = time.perf_counter()
        self.in_flight += 1  # only ever changed on the event loop, so no lock
        try:
            yield
        finally:
            self.in_flight -= 1
            model.metrics.request_latency.observe(time.perf_counter() - started)

    def deadline(self) -> float:
        """A request's deadline once its body has arrived: --deadline-ms from now, on the event loop's clock.
        Not from its arrival: an upload's own time is --body-timeout-s's to bound, and a photo sent over a slow
        link would otherwise always get a 504, after being read in full."""
        return asyncio.get_running_loop().time() + self.config.deadline_ms / 1000

    async def stop(self) -> None:
        drain_s = 0 if self.stopped_at_once else self.config.shutdown_timeout_s
        await asyncio.gather(*(served.batcher.stop(drain_s) for served in self.models.values()))
        self.preprocess_pool.shutdown(wait=False, cancel_futures=True)


async def serving(request: Request) -> Serving:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop on every request.
    return request.app.state.serving


# ?model=NAME: the model a request names
ModelName = Annotated[
    str | None,
    Query(alias="model", description="the model's name (GET /models lists them); default: the server's default model"),
]


async def served_model(request: Request, model: ModelName = None) -> ServedModel:
    return request.app.state.serving.model(model)


async def unless_disconnected(request: Request, work):
    """Await `work`, cancelling it if the client goes away first, so its decode and inference are dropped.

    Neither uvicorn nor Starlette cancel an endpoint whose client left (uvicorn cancels it only at shutdown,
    Ray Serve does when the client leaves); with the body read, the next ASGI message can only be the
    disconnect (or the end of our response). A watcher task waits for it and cancels this task; `work` is
    awaited here, not in a task of its own, and without asyncio.wait: every request pays for those, a
    disconnect is rare. The watcher's cancel is always undone, so the task's cancel count
    (`Task.cancelling`, which `AnswerCancelledAtShutdown` reads) holds only cancels from outside.
    """
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, task))
    try:
        result = await work
    except asyncio.CancelledError:
        # ClientDisconnect only when the watcher's was the one cancel: one from outside (uvicorn's shutdown,
        # Ray's cancel of a replica's request) arriving with it still ends the task cancelled.
        if _fired(watcher) and task.uncancel() == 0:
            raise ClientDisconnect() from None
        raise
    except BaseException:
        if _fired(watcher):  # the work ended otherwise: the watcher's cancel is undone all the same
            task.uncancel()
        raise
    else:
        if _fired(watcher):
            task.uncancel()
        return result
    finally:
        watcher.cancel()


def _fired(watcher: asyncio.Task) -> bool:
    """Whether the watcher saw the disconnect, and so cancelled its request's task."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


async def _cancel_on_disconnect(request: Request, task: asyncio.Task) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        # Ray Serve's receive re-raises a failed fetch from its HTTP proxy (one that ended, say; a request the
        # proxy no longer holds is a disconnect already): no answer could reach the client either.
        log.warning("receiving from the client failed; its work is dropped as for a disconnect", exc_info=True)
    task.cancel()


async def in_daemon_thread(function) -> None:
    """`function()` run in a daemon thread and awaited. asyncio.to_thread's executor is joined when the event
    loop closes, so a call that never returns (a hung runtime) kept a stopped server's process alive."""
    done: Future = Future()  # a thread's, which asyncio.wrap_future hands to the loop

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # cancelled before it began: the server is stopping
            return
        try:
            done.set_result(function())
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            done.set_exception(exc)

    # Not named as an inference thread: thread_cpu counts those for the batcher's life, and this one exits.
    threading.Thread(target=run, name="mnv3-warm-up", daemon=True).start()
    await asyncio.wrap_future(done)  # (dropped there if the loop has closed meanwhile)
