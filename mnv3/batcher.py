"""Dynamic batching: requests that arrive close together run as one batched inference call.

A dedicated inference thread takes the first queued request, then collects more until
`max_batch_size` or until `window_ms` after that first request arrived, stacks them, runs the model
once and hands every request its own row. Under load the window has long passed by the time the
thread is free again, so it takes what is queued without waiting: the batch grows with the load,
latency does not. The window also closes early when no further request is on its way (`incoming()`
is 0, e.g. none is being decoded): waiting then only idles the CPU, which is what made a fixed window
lose to no batching at low concurrency.

The thread collects its next batch itself, straight from the queue, the moment a call returns: it
never waits for the event loop, which under load is busy with hundreds of connections and would
otherwise leave the model idle between calls. The event loop only queues requests and receives each
batch's rows (one callback a batch). One inference thread a model: ORT and OpenVINO already spread
one call over their own threads (sized to the cores), so overlapping calls would only oversubscribe
the CPU, and decode/preprocess work in its own pool never waits behind a batch.

Work nobody waits for any more (deadline passed, client gone) is dropped before it runs and counted
in `dropped`. `stop()` drains: queued requests are still answered, new ones are refused.
"""

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mnv3.thread_cpu import INFERENCE_THREADS

WINDOW_POLL_S = 0.001


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
    deadline: float  # time.perf_counter() clock, which the inference thread can read

    def wanted(self, now: float) -> bool:
        # Read from the inference thread: a future's state is a plain field, and a stale read only
        # means one request more or less is computed for nobody.
        return not self.future.done() and self.deadline > now


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
        self._queue: deque[_Pending] = deque()
        self._changed = threading.Condition()  # guards _queue, dropped and _stopping; notified on each change
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._unanswered = 0  # submitted, not yet answered by the thread; event loop only
        self._drained = asyncio.Event()  # set when stopping and nothing is left unanswered
        self._running: list[_Pending] = []  # the batch the thread is computing; it alone writes this
        self.dropped = 0  # requests skipped before inference because nobody waited for them any more

    @property
    def depth(self) -> int:
        """Requests queued and not yet taken into a batch (or dropped)."""
        with self._changed:
            return len(self._queue)

    def start(self) -> None:
        loop = asyncio.get_running_loop()  # where the thread answers
        self._thread = threading.Thread(target=self._work, args=(loop,), name=f"{INFERENCE_THREADS}_0", daemon=True)
        self._thread.start()

    async def stop(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, answer the queued ones (for up to `drain_s`), then fail what is left."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None and self._unanswered:
            try:
                async with asyncio.timeout(drain_s):
                    await self._drained.wait()
            except TimeoutError:
                pass
        with self._changed:
            left, self._queue = list(self._queue), deque()
            self._changed.notify_all()
        self._unanswered -= len(left)  # answered here; the running batch is still answered by the thread
        for p in left + self._running:  # the drain ran out: answered 503, not left to hang
            if not p.future.done():
                p.future.set_exception(ShuttingDown("server stopped before this request's turn came"))

    async def submit(self, array: np.ndarray, deadline: float = math.inf) -> BatchResult:
        """Queue one (C, H, W) input and wait for its row. `deadline` is on the `loop.time()` clock."""
        loop = asyncio.get_running_loop()
        if self._stopping:
            raise ShuttingDown("server is shutting down; retry on another instance or after restart")
        now = time.perf_counter()
        left_s = deadline - loop.time()
        if left_s <= 0:
            raise DeadlineExceeded("deadline passed before the request was queued")
        pending = _Pending(array, loop.create_future(), now, now + left_s)
        with self._changed:
            if len(self._queue) >= self.queue_limit:
                raise QueueFull(f"queue full: {self.queue_limit} requests already wait for inference")
            self._queue.append(pending)
            self._changed.notify()
        self._unanswered += 1
        try:
            async with asyncio.timeout_at(deadline):
                return await pending.future
        except TimeoutError:
            waited = time.perf_counter() - pending.queued_at
            raise DeadlineExceeded(f"deadline passed after {waited:.3f} s waiting for inference") from None
        finally:
            pending.future.cancel()  # deadline or client gone: the thread skips work nobody waits for

    # ------------------------------------------------------------------------- the inference thread

    def _work(self, loop: asyncio.AbstractEventLoop) -> None:
        while (batch := self._next_batch(loop)) is not None:
            self._running = batch
            started = time.perf_counter()
            outcome: np.ndarray | Exception  # the batch's rows, or what failed it
            try:
                outcome = self.run_batch(np.stack([p.array for p in batch]))
                if len(outcome) != len(batch):  # else some requests would wait for a row that never comes
                    raise RuntimeError(f"run_batch returned {len(outcome)} rows for a batch of {len(batch)}")
            except Exception as exc:  # fails this batch's requests only; the thread goes on
                outcome = exc
            self._answer(loop, self._deliver, batch, outcome, started, time.perf_counter() - started)
            self._running = []

    def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Pending] | None:
        """The next batch of wanted requests; None once stopping with nothing queued."""
        while True:
            batch, dropped = self._collect()
            if dropped:  # so that stop() knows these are settled
                self._answer(loop, self._settled, dropped)
            if batch is None or batch:  # an empty one: every request taken was dropped
                return batch

    def _collect(self) -> tuple[list[_Pending] | None, int]:
        """Block for a first request, then gather more until the batch is full or its window closes.
        Returns the wanted ones and how many were dropped; None for the batch once stopping with nothing queued."""
        batch: list[_Pending] = []
        with self._changed:
            dropped = 0
            while len(batch) < self.max_batch_size:
                if self._queue:
                    p = self._queue.popleft()
                    if p.wanted(time.perf_counter()):
                        batch.append(p)
                    else:
                        dropped += 1
                    continue
                if not batch:
                    if self._stopping:
                        self.dropped += dropped
                        return None, dropped
                    self._changed.wait()
                    continue
                remaining = self.window_s - (time.perf_counter() - batch[0].queued_at)
                if remaining <= 0 or self._stopping or (self.incoming is not None and self.incoming() == 0):
                    break
                # A new request notifies, but `incoming()` falling to 0 (a decode failed) does not,
                # so the wait is re-checked every WINDOW_POLL_S rather than held for the whole window.
                self._changed.wait(min(remaining, WINDOW_POLL_S))
            now = time.perf_counter()
            live = [p for p in batch if p.wanted(now)]  # some may have gone during the window
            dropped += len(batch) - len(live)
            self.dropped += dropped
        return live, dropped

    def _answer(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        """Run `callback(*args)` on the event loop, which alone touches the requests' futures."""
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            pass

    def _deliver(
        self, batch: list[_Pending], outcome: np.ndarray | Exception, started: float, inference_s: float
    ) -> None:
        """On the event loop: each request of `batch` gets its row, or the batch's error."""
        for i, p in enumerate(batch):
            if p.future.done():
                continue
            if isinstance(outcome, Exception):
                p.future.set_exception(outcome)
            else:
                p.future.set_result(BatchResult(outcome[i], len(batch), started - p.queued_at, inference_s))
        self._settled(len(batch))

    def _settled(self, count: int) -> None:
        """On the event loop: `count` requests are answered or dropped; stop() waits for all of them."""
        self._unanswered -= count
        if self._stopping and not self._unanswered:
            self._drained.set()
