"""Dynamic batching: requests that arrive close together run as one batched inference call.

Two threads a model. The runner calls the model, one batch at a time. The assembler gathers the next
batch meanwhile: it takes the first queued request, then more, until `max_batch_size`, or until the
runner is free and `window_ms` have passed since the first one was queued, copying each request's input
into the batch's rows as it takes it. So when a call returns, the next batch is already stacked: the
model does not idle while ~19 MB of images are copied (a batch of 32) on cores the decode threads also
want. Under load the window has long passed by the time the runner is free, so a batch is whatever is
queued then: it grows with the load, latency does not. The window also closes early when no further
request is on its way (none `expect()`ed is still being prepared): waiting then only idles the CPU,
which is what made a fixed window lose to no batching at low concurrency. Inputs of another shape than
a batch's first start the next batch.

A request comes in one of two ways. `submit(array)` queues a ready input and waits for its row.
`expect()` registers one whose input another thread is still making (the decode pool): that thread
`queue()`s the input, or `fail()`s the request, itself, and the event loop awaits `result()`. The event
loop is then woken once a request, for its answer, not also for its decoded image, and only queues
requests and receives each batch's rows (one callback a batch): under load it is busy with hundreds of
connections, and neither the model nor the decode threads ever wait for it. One runner a model: ORT and
OpenVINO already spread one call over their own threads (sized to the cores), so overlapping calls would
only oversubscribe the CPU, and decode/preprocess work in its own pool never waits behind a batch.
`run_batch` gets a view of rows the assembler reuses two batches later, so the batcher copies any output
that may share memory with it.

Work nobody waits for any more (deadline passed, client gone) is dropped before it runs and counted
in `dropped`: a queued request as it is taken into a batch, or before its batch is handed over (the gap
filled from the queue); an expected one is no longer waited for at once, and its input, when it comes, is
not queued (counted when its request ends, if it ended for want of anyone waiting). `stop()` drains:
expected, queued and running requests are still answered, new ones are refused; what the drain leaves is
failed.
"""

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mnv3.thread_cpu import INFERENCE_THREADS

log = logging.getLogger(__name__)

NO_ROWS = np.empty(0, np.float32)
MIN_WAIT_S = 0.001  # the shortest wait for a window's end, so that clock rounding never spins


class QueueFull(Exception):
    """More requests are queued than the limit allows; retry later."""


class ShuttingDown(QueueFull):
    """The server is stopping: it answers what it has queued but takes nothing new."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its result was ready; its work was dropped if not yet run."""


@dataclass(frozen=True)
class BatchResult:
    row: np.ndarray  # this request's output row: a view of its batch's output, whose rows it keeps alive
    batch_size: int  # how many requests shared the inference call
    queue_s: float  # from being queued (its input ready) to the start of the inference call
    inference_s: float  # the whole batch's inference call


@dataclass(eq=False)
class Expected:
    """A request the batcher knows of: `expect()`ed, its input queued later (or failed) from any thread."""

    future: asyncio.Future
    timeout_at: float  # the deadline on the event loop's clock (`loop.time()`)
    expected_at: float  # time.perf_counter(): uvloop's loop.time() has only millisecond resolution
    deadline: float  # the deadline on the time.perf_counter() clock, which every thread can read
    array: np.ndarray | None = None  # its input, once queued
    queued_at: float = 0.0  # time.perf_counter() when its input was queued; 0.0 until then
    settled: bool = False  # answered or dropped, and counted so; set on the event loop only

    def wanted(self, now: float) -> bool:
        # Read from other threads: a future's state is a plain field, and a stale read only means one
        # request more or less is computed (or decoded) for nobody.
        return not self.future.done() and self.deadline > now

    @property
    def preparing_s(self) -> float:
        """From `expect()` to `queue()`: waiting for a decode thread and decoding."""
        return self.queued_at - self.expected_at if self.array is not None else 0.0


class DynamicBatcher:
    def __init__(
        self,
        run_batch: Callable[[np.ndarray], np.ndarray],
        max_batch_size: int = 32,
        window_ms: float = 20.0,
        queue_limit: int = 512,
    ):
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.window_s = window_ms / 1000.0
        self.queue_limit = queue_limit
        # Requests may queue before start(): they wait for the model's warm-up instead of failing.
        # One lock guards the fields from here to `dropped`: the assembler waits on `_changed` (an input
        # queued, a request no longer expected, the runner free, stopping), the runner on `_handed` (a batch
        # handed over, or exit).
        lock = threading.Lock()
        self._changed = threading.Condition(lock)
        self._handed = threading.Condition(lock)
        self._preparing: set[Expected] = set()  # expected, input not yet queued: the window waits for these
        self._queue: deque[Expected] = deque()  # inputs ready, not yet taken into a batch
        self._filling: list[Expected] = []  # the batch the assembler is gathering
        self._next: tuple[list[Expected], np.ndarray] | None = None  # assembled, for the runner to take
        self._running: list[Expected] = []  # the batch the runner is computing
        self._runner_exits = False  # the assembler has stopped: the runner stops once its batch is done
        self._stopping = False
        self._refusing = False  # stop() has failed what was left: later inputs are refused too
        self.dropped = 0  # requests skipped before inference because nobody waited for them any more
        self._rows: list[np.ndarray | None] = [None, None]  # the assembler's: one batch filled while one runs
        self._threads: list[threading.Thread] = []
        self._unanswered = 0  # known, not yet settled; event loop only
        self._answered: asyncio.Future | None = None  # what an Expected's future becomes once its answer is taken
        self._drained = asyncio.Event()  # set when stopping and nothing is left unanswered

    @property
    def _runner_free(self) -> bool:
        """Under the lock: whether the runner has nothing handed to it and nothing running."""
        return self._next is None and not self._running

    @property
    def depth(self) -> int:
        """Requests waiting for inference: queued, or in the batch being gathered."""
        with self._changed:
            return len(self._queue) + len(self._filling)

    def start(self) -> None:
        loop = asyncio.get_running_loop()  # where the threads answer
        self._threads = [
            threading.Thread(target=self._assemble, args=(loop,), name=f"{INFERENCE_THREADS}_assembler", daemon=True),
            threading.Thread(target=self._run, args=(loop,), name=f"{INFERENCE_THREADS}_0", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    async def stop(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, answer the expected, queued and running ones (for up to `drain_s`), then fail
        every one still unanswered."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        if self._threads and self._unanswered:
            try:
                async with asyncio.timeout(drain_s):
                    await self._drained.wait()
            except TimeoutError:
                pass
        with self._changed:
            self._refusing = True
            left = [
                *self._preparing,
                *self._queue,
                *self._filling,
                *(self._next[0] if self._next else []),
                *self._running,
            ]
            self._preparing.clear()
            self._queue.clear()
            self._changed.notify()
        for p in left:  # the drain ran out: answered 503, not left to hang; the threads skip what they hold
            self._fail_one(p, ShuttingDown("server stopped before this request's turn came"))

    def expect(self, deadline: float = math.inf) -> Expected:
        """On the event loop: a request whose input is still being made; its maker then calls `queue()` or
        `fail()`, from any thread. `deadline` is on the `loop.time()` clock."""
        loop = asyncio.get_running_loop()
        if self._stopping:
            raise ShuttingDown("server is shutting down; retry on another instance or after restart")
        now = time.perf_counter()
        left_s = deadline - loop.time()
        if left_s <= 0:
            raise DeadlineExceeded("deadline passed before the request was queued")
        if self._answered is None:
            self._answered = loop.create_future()
            self._answered.cancel()
        expected = Expected(loop.create_future(), deadline, now, now + left_s)
        with self._changed:
            self._preparing.add(expected)
        self._unanswered += 1
        return expected

    def queue(self, expected: Expected, array: np.ndarray) -> bool:
        """From any thread: `expected`'s input is ready. Whether it now waits for a batch: not if nobody waits
        for it any more, nor when the queue is full (its request gets QueueFull)."""
        if not isinstance(array, np.ndarray):
            self.fail(expected, TypeError(f"an input is a numpy array, not {type(array).__name__}"))
            return False
        now = time.perf_counter()
        refusal: QueueFull | None = None
        with self._changed:
            if expected not in self._preparing:  # given up on: its deadline passed or its client left
                return False
            self._preparing.discard(expected)
            self._changed.notify()  # a new input, or one fewer to wait for
            if not expected.wanted(now):
                pass  # its answer (504, or none: the client left) is the event loop's
            elif self._refusing:
                refusal = ShuttingDown("server stopped before this request's turn came")
            elif len(self._queue) + len(self._filling) >= self.queue_limit:
                refusal = QueueFull(f"queue full: {self.queue_limit} requests already wait for inference")
            else:
                expected.array, expected.queued_at = array, now
                self._queue.append(expected)
                return True
        self._answer(expected.future.get_loop(), self._fail_one, expected, refusal)
        return False

    def fail(self, expected: Expected, exc: Exception) -> None:
        """From any thread: `expected`'s input could not be made; its request gets `exc`."""
        self._expected_no_more(expected)
        self._answer(expected.future.get_loop(), self._fail_one, expected, exc)

    async def result(self, expected: Expected) -> BatchResult:
        """On the event loop: `expected`'s row, once its batch has run. Taken once."""
        if expected.future is self._answered:
            raise RuntimeError("this request's result was taken already")
        answered = False  # with its input's failure or a refusal, not for want of anyone waiting any more
        try:
            async with asyncio.timeout_at(expected.timeout_at):
                return await expected.future
        except TimeoutError:
            pass  # DeadlineExceeded is raised below, outside this handler: see there
        except Exception as exc:  # its input failed or was refused, unless it came too late (DeadlineExceeded)
            answered = not isinstance(exc, DeadlineExceeded)
            raise
        finally:
            expected.future.cancel()  # deadline or client gone: the threads skip work nobody waits for
            # The answer is taken: the future (holding a failure, whose traceback holds the frames that hold
            # `expected`, the request's body among their locals) is let go, or that reference cycle would keep
            # the body until a garbage collection, which the server makes rare. The stand-in is done too.
            assert self._answered is not None  # made by expect()
            expected.future = self._answered
            if expected.array is None:  # nobody waits for its input any more, nor should the window
                self._given_up(expected, nobody_waited=not answered)
        # Raised in the handler, it would have the TimeoutError as its context, whose traceback holds the
        # timeout, its task and (a task that ends with it) this exception: a cycle holding the request's frames.
        if expected.array is None:
            raise DeadlineExceeded("deadline passed while the image waited for a decode thread or was decoded")
        waited = time.perf_counter() - expected.queued_at
        raise DeadlineExceeded(f"deadline passed after {waited:.3f} s waiting for inference")

    def _given_up(self, expected: Expected, nobody_waited: bool) -> None:
        """On the event loop: `expected`, whose input never came, is answered (or gone) and expected no more;
        dropped, and counted so, if `nobody_waited` for it any more. Under the lock, as a decode thread may be
        queueing its input just now: then it is the assembler's to drop and count."""
        with self._changed:
            self.dropped += nobody_waited and expected.array is None
            self._not_preparing(expected)
        self._fail_one(expected, None)

    def _expected_no_more(self, expected: Expected) -> None:
        """From any thread: the window no longer waits for `expected`'s input."""
        with self._changed:
            self._not_preparing(expected)

    def _not_preparing(self, expected: Expected) -> None:
        """Under the lock."""
        if expected in self._preparing:
            self._preparing.discard(expected)
            self._changed.notify()  # the window may close now

    async def submit(self, array: np.ndarray, deadline: float = math.inf) -> BatchResult:
        """Queue one (C, H, W) input and wait for its row. `deadline` is on the `loop.time()` clock."""
        expected = self.expect(deadline)
        self.queue(expected, array)
        return await self.result(expected)

    # ------------------------------------------------------------------------- the assembler thread

    def _assemble(self, loop: asyncio.AbstractEventLoop) -> None:
        which = 0
        while True:
            try:
                batch = self._gather(loop, which)
            except Exception as exc:  # e.g. no memory for a batch's rows: its requests fail, the thread goes on
                log.exception("gathering a batch failed; each request in it gets the error")
                with self._changed:
                    failed, self._filling = self._filling, []
                for p in failed:
                    self._answer(loop, self._fail_one, p, exc)
                continue
            if batch is None:
                return
            if batch:  # else every request in it was dropped, and its rows are free again
                which = 1 - which

    def _gather(self, loop: asyncio.AbstractEventLoop, which: int) -> list[Expected] | None:
        """Gather the next batch into rows `which`, copying each input in as it is taken, and hand it to
        the runner once the runner is free and the batch is full or its window has closed. Requests nobody
        waits for any more are dropped as they are taken, and again before the batch is handed over (the
        gap filled from the queue). Returns the batch handed over; None once stopping with nothing left to
        come, after telling the runner to exit."""
        rows = NO_ROWS  # until the first input says what rows it needs
        taken = 0
        while True:
            keep: list[int] | None = None
            with self._changed:
                while True:
                    if self._queue and taken < self.max_batch_size and not self._other_shape(rows, taken):
                        p = self._queue.popleft()
                        if not p.wanted(time.perf_counter()):
                            self._drop(loop, [p])
                            continue
                        self._filling.append(p)
                        break
                    if taken and self._runner_free and self._closes(taken, rows):
                        now = time.perf_counter()
                        # Once refusing, stop() has answered the batch (ShuttingDown), or is about to
                        wanted = [p.wanted(now) and not self._refusing for p in self._filling]
                        if all(wanted):
                            return self._hand_over(rows, taken)
                        keep = [i for i, is_wanted in enumerate(wanted) if is_wanted]
                        self._drop(
                            loop, [p for p, is_wanted in zip(self._filling, wanted, strict=True) if not is_wanted]
                        )
                        self._filling = [self._filling[i] for i in keep]
                        break
                    if not taken and (self._refusing or self._stopping and not self._queue and not self._preparing):
                        self._runner_exits = True  # once it has run what it was handed
                        self._handed.notify()
                        return None
                    self._changed.wait(self._wait_s(taken))
            # Outside the lock: queue() and the runner go on meanwhile; only this thread writes these rows.
            if keep is not None:  # some went while it was gathered: the rest close up, and the gap is refilled
                rows[: len(keep)] = rows[keep]
                taken = len(keep)
                continue
            array = p.array
            assert array is not None  # a queued request's input
            if not taken:  # the batch's later inputs fit its rows: _other_shape leaves the others queued
                rows = self._rows_for(which, array)
            rows[taken] = array
            taken += 1

    def _drop(self, loop: asyncio.AbstractEventLoop, gone: list[Expected]) -> None:
        """Under the lock: requests nobody waits for any more, skipped before inference. Those stop() answers
        (ShuttingDown, once refusing: it may not have yet) are not counted as dropped."""
        if not self._refusing:  # until then only the threads settle a queued request: none in `gone` is yet
            self.dropped += len(gone)
        self._answer(loop, self._settle, gone)

    def _other_shape(self, rows: np.ndarray, taken: int) -> bool:
        """Under the lock: whether the next queued input cannot join the rows taken (another shape or type)."""
        head = self._queue[0].array
        assert head is not None  # a queued request's input
        return taken > 0 and not _fits(rows, head)

    def _closes(self, taken: int, rows: np.ndarray) -> bool:
        """Under the lock: whether `taken` rows go to the free runner now, rather than wait for more."""
        if taken >= self.max_batch_size or self._stopping or (self._queue and self._other_shape(rows, taken)):
            return True
        if not self._queue and not self._preparing:  # nothing more on its way: waiting would only idle the CPU
            return True
        return time.perf_counter() - self._filling[0].queued_at >= self.window_s

    def _wait_s(self, taken: int) -> float | None:
        """How long to wait for a change: a new input, a free runner and a request no longer expected notify;
        the end of an open window does not, so a wait with a free runner ends with it."""
        if not taken or not self._runner_free:
            return None
        return max(MIN_WAIT_S, self.window_s - (time.perf_counter() - self._filling[0].queued_at))

    def _rows_for(self, which: int, array: np.ndarray) -> np.ndarray:
        """Batch rows `which`, made anew for inputs of another shape or type than before."""
        rows = self._rows[which]
        if rows is None or not _fits(rows, array):
            self._rows[which] = None  # the old rows are freed before the new ones are made
            rows = self._rows[which] = np.empty((self.max_batch_size, *array.shape), array.dtype)
        return rows

    def _hand_over(self, rows: np.ndarray, taken: int) -> list[Expected]:
        """Under the lock: the gathered batch, to the runner."""
        batch, self._filling = self._filling, []
        self._next = (batch, rows[:taken])
        self._handed.notify()
        return batch

    # ------------------------------------------------------------------------- the runner thread

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            with self._handed:
                while self._next is None and not self._runner_exits:
                    self._handed.wait()
                if self._next is None:
                    return
                (batch, rows), self._next = self._next, None
                if self._refusing:  # stop() answers this batch (ShuttingDown): nobody waits for its rows
                    self._changed.notify()  # the runner is free
                    continue
                self._running = batch
            started = time.perf_counter()
            outcome: np.ndarray | Exception  # the batch's rows, or what failed it
            try:
                outcome = np.asarray(self.run_batch(rows))
                if len(outcome) != len(batch):  # else some requests would wait for a row that never comes
                    raise RuntimeError(f"run_batch returned {len(outcome)} rows for a batch of {len(batch)}")
                if np.may_share_memory(outcome, rows):  # the rows are reused two batches on
                    outcome = outcome.copy()
            except Exception as exc:  # fails this batch's requests only; the thread goes on
                outcome = exc
            self._answer(loop, self._deliver, batch, outcome, started, time.perf_counter() - started)
            # A failure's traceback holds this frame: holding the failure here too would be a cycle, which
            # keeps the frames its requests raised it through (their bodies) until a garbage collection.
            del batch, rows, outcome
            with self._changed:
                self._running = []
                self._changed.notify()  # the runner is free

    @staticmethod
    def _answer(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        """Run `callback(*args)` on the event loop, which alone touches the requests' futures."""
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            pass

    # ------------------------------------------------------------------------- on the event loop

    def _deliver(
        self, batch: list[Expected], outcome: np.ndarray | Exception, started: float, inference_s: float
    ) -> None:
        """Each request of `batch` gets its row, or the batch's error."""
        for i, p in enumerate(batch):
            if not p.future.done():
                if isinstance(outcome, Exception):
                    p.future.set_exception(outcome)
                else:
                    p.future.set_result(BatchResult(outcome[i], len(batch), started - p.queued_at, inference_s))
        self._settle(batch)

    def _fail_one(self, expected: Expected, exc: Exception | None) -> None:
        """`expected`, whose input never came, was refused or cannot run, gets `exc` (None: already answered)."""
        if exc is not None and not expected.future.done():
            expected.future.set_exception(exc)
        self._settle([expected])

    def _settle(self, requests: list[Expected]) -> None:
        """`requests` are answered or dropped (once each, whoever gets there first); stop() waits for all."""
        for p in requests:
            if not p.settled:
                p.settled = True
                self._unanswered -= 1
        if self._stopping and not self._unanswered:
            self._drained.set()


def _fits(rows: np.ndarray, array: np.ndarray) -> bool:
    """Whether `array` can be a row of `rows`: the same shape and type."""
    return rows.shape[1:] == array.shape and rows.dtype == array.dtype
