"""Dynamic batching: requests that arrive close together run as one batched inference call.

One worker task takes the first queued request, then collects more until `max_batch_size` or until
`window_ms` after that first request arrived, stacks them, runs the model once and hands every
request its own row. Under load the window has long passed by the time the worker is free again,
so it takes what is queued without waiting: the batch grows with the load, latency does not.
The window also closes early when no further request is on its way (`incoming()` is 0, e.g. none is
being decoded): waiting then only idles the CPU, which is what made a fixed window lose to no
batching at low concurrency.

Inference runs in a dedicated single-thread executor. ORT already spreads one call over its
intra-op threads (sized to the cores), so overlapping calls would only oversubscribe the CPU, and
keeping it off the default executor means decode/preprocess work never waits behind a batch.

Work nobody waits for any more (deadline passed, client gone) is dropped before it runs and counted
in `dropped`. `stop()` drains: queued requests are still answered, new ones are refused.
"""

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mnv3.thread_cpu import INFERENCE_THREADS


class QueueFull(Exception):
    """More requests are queued than the limit allows; retry later."""


class ShuttingDown(QueueFull):
    """The server is stopping: it answers what it has queued but takes nothing new."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its result was ready; its work was dropped if not yet run."""


@dataclass(frozen=True)
class BatchResult:
    row: np.ndarray  # this request's output row
    batch_size: int  # how many requests shared the inference call
    queue_s: float  # from submit to the start of the inference call
    inference_s: float  # the whole batch's inference call


@dataclass
class _Pending:
    array: np.ndarray
    future: asyncio.Future
    queued_at: float  # time.perf_counter(): uvloop's loop.time() has only millisecond resolution
    deadline: float  # loop.time() clock, like asyncio's timeouts


class DynamicBatcher:
    def __init__(
        self,
        run_batch: Callable[[np.ndarray], np.ndarray],
        max_batch_size: int = 32,
        window_ms: float = 20.0,
        queue_limit: int = 512,
        incoming: Callable[[], int] | None = None,
    ):
        """`incoming()` counts requests that will be submitted soon; None means unknown (always wait)."""
        self.run_batch = run_batch
        self.incoming = incoming
        self.max_batch_size = max_batch_size
        self.window_s = window_ms / 1000.0
        self.queue_limit = queue_limit
        # Requests may queue before start(): they wait for the model's warm-up instead of failing.
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(queue_limit)
        self._worker: asyncio.Task | None = None
        self._stopping = False
        self._batch: list[_Pending] = []  # being collected or run
        self.dropped = 0  # requests skipped before inference because nobody waited for them any more
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=INFERENCE_THREADS)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._worker = asyncio.create_task(self._work(), name="mnv3-batcher")

    async def stop(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, answer the queued ones (for up to `drain_s`), then cancel what is left."""
        self._stopping = True
        if self._worker is not None and not self._worker.done():
            try:
                async with asyncio.timeout(drain_s):
                    await self._queue.join()
            except TimeoutError:
                pass
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        left = self._batch + [self._queue.get_nowait() for _ in range(self.depth)]
        for p in left:  # the drain ran out: these are answered 503, not left to hang
            if not p.future.done():
                p.future.set_exception(ShuttingDown("server stopped before this request's turn came"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, array: np.ndarray, deadline: float = math.inf) -> BatchResult:
        """Queue one (C, H, W) input and wait for its row. `deadline` is on the `loop.time()` clock."""
        loop = asyncio.get_running_loop()
        if self._stopping:
            raise ShuttingDown("server is shutting down; retry on another instance or after restart")
        if loop.time() >= deadline:
            raise DeadlineExceeded("deadline passed before the request was queued")
        pending = _Pending(array, loop.create_future(), time.perf_counter(), deadline)
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise QueueFull(f"queue full: {self.queue_limit} requests already wait for inference") from None
        try:
            async with asyncio.timeout_at(deadline):
                return await pending.future
        except TimeoutError:
            waited = time.perf_counter() - pending.queued_at
            raise DeadlineExceeded(f"deadline passed after {waited:.3f} s waiting for inference") from None
        finally:
            pending.future.cancel()  # deadline or client gone: the worker skips work nobody waits for

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._batch = []
            try:
                await self._collect(batch)
                await self._run(loop, batch)
            finally:
                for _ in batch:
                    self._queue.task_done()  # what stop() waits for

    async def _run(self, loop, batch: list[_Pending]) -> None:
        now = loop.time()
        live = [p for p in batch if not p.future.done() and p.deadline > now]
        self.dropped += len(batch) - len(live)
        if not live:
            return
        started = time.perf_counter()
        try:
            # Stacked on the inference thread: a batch is megabytes to copy, which the event loop
            # would otherwise do while every connection waits.
            outputs = await loop.run_in_executor(self._executor, self._stack_and_run, [p.array for p in live])
            if len(outputs) != len(live):  # else some requests would wait for a row that never comes
                raise RuntimeError(f"run_batch returned {len(outputs)} rows for a batch of {len(live)}")
        except Exception as exc:  # fails this batch's requests only; the worker goes on
            for p in live:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        inference_s = time.perf_counter() - started
        for p, row in zip(live, outputs, strict=True):
            if not p.future.done():
                p.future.set_result(BatchResult(row, len(live), started - p.queued_at, inference_s))

    def _stack_and_run(self, arrays: list[np.ndarray]) -> np.ndarray:
        return self.run_batch(np.stack(arrays))

    async def _collect(self, batch: list[_Pending]) -> None:
        """Wait for a first request, then gather more into `batch` until it is full or its window closes."""
        first = await self._queue.get()
        batch.append(first)
        while len(batch) < self.max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = self.window_s - (time.perf_counter() - first.queued_at)
            if remaining <= 0 or (self.incoming is not None and self.incoming() == 0):
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
