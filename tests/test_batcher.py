"""DynamicBatcher against a fake engine: each input is a 1-element array holding a request id."""

import asyncio
import gc
import threading
import time
import weakref

import numpy as np
import pytest

from mnv3.batcher import DeadlineExceeded, DynamicBatcher, QueueFull, ShuttingDown

pytestmark = pytest.mark.unit

BLOCK_TIMEOUT_S = 10  # a broken test fails instead of hanging


class FakeEngine:
    """Returns 10 x each input; records every batch; can be held inside a call to fill the queue."""

    def __init__(self, poison: float | None = None):
        self.batches: list[list[float]] = []
        self.poison = poison
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.batches.append(batch[:, 0].tolist())
        self.entered.set()
        self.release.wait(BLOCK_TIMEOUT_S)
        if self.poison in batch:
            raise RuntimeError("poisoned batch")
        return batch * 10

    @property
    def computed(self) -> list[float]:
        return [x for batch in self.batches for x in batch]


def item(request_id: float) -> np.ndarray:
    return np.array([request_id], dtype=np.float32)


def run(scenario):
    """Run `scenario(batcher_factory)` on a fresh loop; every batcher made is stopped afterwards."""

    async def main():
        made = []

        def make(engine, **kwargs):
            batcher = DynamicBatcher(engine, **kwargs)
            batcher.start()
            made.append(batcher)
            return batcher

        try:
            await asyncio.wait_for(scenario(make), BLOCK_TIMEOUT_S)
        finally:
            for batcher in made:
                await batcher.stop()
                # Its threads gone too: until then a thread may hold what it last handled (a test's body).
                for thread in batcher._threads:
                    await asyncio.to_thread(thread.join, BLOCK_TIMEOUT_S)

    asyncio.run(main())


async def held(engine: FakeEngine, batcher: DynamicBatcher, request_id: float) -> asyncio.Task:
    """Start a request whose inference call blocks until `engine.release` is set."""
    engine.release.clear()
    engine.entered.clear()
    task = asyncio.create_task(batcher.submit(item(request_id)))
    await asyncio.to_thread(engine.entered.wait, BLOCK_TIMEOUT_S)
    return task


def test_window_groups_concurrent_requests_and_rows_go_to_their_requests():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=8, window_ms=100)
        results = await asyncio.gather(*(batcher.submit(item(i)) for i in range(5)))
        assert engine.batches == [[0, 1, 2, 3, 4]]
        assert [float(r.row[0]) for r in results] == [0, 10, 20, 30, 40]
        assert {r.batch_size for r in results} == {5}
        assert all(r.queue_s >= 0 and r.inference_s >= 0 for r in results)

    run(scenario)


def test_max_batch_size_is_respected():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=4, window_ms=50)
        results = await asyncio.gather(*(batcher.submit(item(i)) for i in range(10)))
        assert [len(b) for b in engine.batches] == [4, 4, 2]
        assert [float(r.row[0]) for r in results] == [10 * i for i in range(10)]

    run(scenario)


def test_batch_size_one_runs_each_request_alone_without_waiting_for_the_window():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=60_000)
        results = await asyncio.gather(*(batcher.submit(item(i)) for i in range(3)))
        assert engine.batches == [[0], [1], [2]]
        assert {r.batch_size for r in results} == {1}

    run(scenario)


def test_expired_request_raises_and_is_not_computed():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        loop = asyncio.get_running_loop()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit(item(2), deadline=loop.time() + 0.05)
        engine.release.set()
        await first
        await batcher.submit(item(3))  # the inference thread has passed request 2 by the time 3 is answered
        assert engine.computed == [1, 3]
        with pytest.raises(DeadlineExceeded):
            await batcher.submit(item(4), deadline=loop.time() - 1)

    run(scenario)


def test_queue_full_raises():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0, queue_limit=1)
        first = await held(engine, batcher, 1)
        second = asyncio.create_task(batcher.submit(item(2)))
        await asyncio.sleep(0)  # let it queue
        assert batcher.depth == 1
        with pytest.raises(QueueFull):
            await batcher.submit(item(3))
        late = batcher.expect()  # an input a decode thread queues meets the same limit
        assert not await asyncio.to_thread(batcher.queue, late, item(4))
        with pytest.raises(QueueFull):
            await batcher.result(late)
        engine.release.set()
        assert float((await second).row[0]) == 20
        await first

    run(scenario)


def test_cancelled_request_is_dropped():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        abandoned = asyncio.create_task(batcher.submit(item(2)))
        await asyncio.sleep(0)
        abandoned.cancel()
        engine.release.set()
        await first
        await batcher.submit(item(3))
        assert engine.computed == [1, 3]
        assert abandoned.cancelled()

    run(scenario)


def test_engine_error_fails_only_its_batch():
    async def scenario(make):
        engine = FakeEngine(poison=-1)
        batcher = make(engine, max_batch_size=2, window_ms=50)
        outcomes = await asyncio.gather(
            batcher.submit(item(-1)), batcher.submit(item(1)), batcher.submit(item(2)), return_exceptions=True
        )
        assert [type(o) for o in outcomes[:2]] == [RuntimeError, RuntimeError]
        assert float(outcomes[2].row[0]) == 20
        assert float((await batcher.submit(item(3))).row[0]) == 30  # the inference thread survived

    run(scenario)


def test_window_closes_early_when_nothing_else_is_expected_and_waits_while_something_is():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=8, window_ms=60_000)
        alone = await batcher.submit(item(1))  # a 60 s window would time the test out if it were waited
        assert alone.batch_size == 1

        decoding = batcher.expect()  # a second request is being decoded: the first waits for it
        first = asyncio.create_task(batcher.submit(item(2)))
        await asyncio.sleep(0.05)
        assert not first.done() and batcher.depth == 1  # in the batch being gathered, held open by the window
        await asyncio.to_thread(batcher.queue, decoding, item(3))  # from another thread, as the decode pool does
        second = await batcher.result(decoding)
        assert second.batch_size == 2 and (await first).batch_size == 2
        assert engine.batches == [[1], [2, 3]]

        failing = batcher.expect()  # a decode that fails closes the window too
        third = asyncio.create_task(batcher.submit(item(4)))
        await asyncio.sleep(0.05)
        assert not third.done()
        await asyncio.to_thread(batcher.fail, failing, ValueError("not an image"))
        assert (await third).batch_size == 1
        with pytest.raises(ValueError, match="not an image"):
            await batcher.result(failing)

        abandoned = batcher.expect()  # so does one given up (its client left) while it is decoded
        waiting = asyncio.create_task(batcher.result(abandoned))
        fourth = asyncio.create_task(batcher.submit(item(5)))
        await asyncio.sleep(0.05)
        assert not fourth.done()
        waiting.cancel()
        assert (await fourth).batch_size == 1
        assert not await asyncio.to_thread(batcher.queue, abandoned, item(6))  # its decode ends: not queued

    run(scenario)


def test_next_batch_is_gathered_while_one_runs_and_rows_stay_right_when_reused():
    """An engine that answers with its input rows themselves (a view): the batcher reuses those rows two
    batches on, so every answer must still be its own request's."""

    def identity(batch: np.ndarray) -> np.ndarray:
        engine.entered.set()
        engine.release.wait(BLOCK_TIMEOUT_S)
        engine.batches.append(batch[:, 0].tolist())
        return batch

    engine = FakeEngine()

    async def scenario(make):
        batcher = make(identity, max_batch_size=4, window_ms=60_000)
        engine.release.clear()
        running = asyncio.create_task(batcher.submit(item(0)))
        await asyncio.to_thread(engine.entered.wait, BLOCK_TIMEOUT_S)
        waiting = [asyncio.create_task(batcher.submit(item(i))) for i in range(1, 10)]
        await asyncio.sleep(0.05)
        assert batcher.depth == 9  # four gathered (a full batch, waiting for the runner), five queued
        engine.release.set()
        results = await asyncio.gather(running, *waiting)
        assert engine.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
        assert [float(r.row[0]) for r in results] == list(range(10))

    run(scenario)


def test_inputs_of_another_shape_start_a_new_batch():
    async def scenario(make):
        batches = []

        def engine(batch: np.ndarray) -> np.ndarray:
            batches.append(batch.shape)
            return batch.sum(axis=1, keepdims=True)

        batcher = make(engine, max_batch_size=8, window_ms=50)
        shapes = [(1,), (1,), (2,), (2,), (1,)]
        results = await asyncio.gather(
            *(batcher.submit(np.full(shape, i, np.float32)) for i, shape in enumerate(shapes))
        )
        assert batches == [(2, 1), (2, 2), (1, 1)]
        assert [float(r.row[0]) for r in results] == [0, 1, 4, 6, 4]

    run(scenario)


def test_stop_waits_for_expected_requests():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=4, window_ms=0)
        decoding = batcher.expect()
        stopping = asyncio.create_task(batcher.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()
        with pytest.raises(ShuttingDown):
            batcher.expect()
        await asyncio.to_thread(batcher.queue, decoding, item(5))
        assert float((await batcher.result(decoding)).row[0]) == 50
        await stopping
        assert engine.computed == [5]

    run(scenario)


def test_stop_drains_queued_requests_and_refuses_new_ones():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        queued = [asyncio.create_task(batcher.submit(item(i))) for i in (2, 3)]
        await asyncio.sleep(0)
        stopping = asyncio.create_task(batcher.stop())
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDown):
            await batcher.submit(item(4))
        engine.release.set()
        await stopping
        assert [float((await t).row[0]) for t in (first, *queued)] == [10, 20, 30]
        assert engine.computed == [1, 2, 3]

    run(scenario)


@pytest.mark.parametrize("threads_first", [False, True], ids=["answered, then released", "released, then answered"])
def test_stop_answers_what_it_could_not_drain_with_shutting_down(threads_first):
    """What the drain leaves is answered ShuttingDown: neither computed nor counted dropped, also where the threads
    go on between stop()'s lock and its answers (the batch it answered went to the freed runner, and counted)."""

    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        queued = asyncio.create_task(batcher.submit(item(2)))
        await asyncio.sleep(0)
        if threads_first:
            fail_one = batcher._fail_one

            def released_first(expected, exc):
                engine.release.set()
                time.sleep(0.2)
                fail_one(expected, exc)

            batcher._fail_one = released_first
        await batcher.stop(drain_s=0.05)  # the engine is still held: nothing drains
        with pytest.raises(ShuttingDown):
            await queued
        with pytest.raises(ShuttingDown):
            await first  # taken by the inference thread, but its batch never finished
        engine.release.set()
        for thread in batcher._threads:  # the gatherer meets `queued` again at hand-over, answered already
            await asyncio.to_thread(thread.join, BLOCK_TIMEOUT_S)
        assert engine.computed == [1]
        assert batcher.dropped == 0  # answered ShuttingDown, not work nobody waited for

    run(scenario)


def test_dropped_counts_work_skipped_for_expired_and_cancelled_requests():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        loop = asyncio.get_running_loop()
        expired = asyncio.create_task(batcher.submit(item(2), deadline=loop.time() + 0.02))
        abandoned = asyncio.create_task(batcher.submit(item(3)))
        await asyncio.sleep(0)
        abandoned.cancel()
        with pytest.raises(DeadlineExceeded):
            await expired
        engine.release.set()
        await first
        await batcher.submit(item(4))
        assert engine.computed == [1, 4] and batcher.dropped == 2

    run(scenario)


def test_the_next_batch_runs_while_the_event_loop_is_busy():
    # The inference thread takes its next batch straight from the queue: a busy event loop (hundreds of
    # connections under load) must not leave the model idle between calls.
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        second = asyncio.create_task(batcher.submit(item(2)))
        await asyncio.sleep(0)  # queued behind the held call
        engine.entered.clear()
        engine.release.set()
        # The loop is blocked from here on: only the inference thread can start the second call.
        assert engine.entered.wait(BLOCK_TIMEOUT_S)
        assert engine.batches == [[1], [2]]
        assert [float((await t).row[0]) for t in (first, second)] == [10, 20]

    run(scenario)


class SlowEngine(FakeEngine):
    """FakeEngine whose calls take `seconds`, so requests queue up behind them."""

    def __init__(self, seconds: float, poison: float | None = None):
        super().__init__(poison)
        self.seconds = seconds

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        time.sleep(self.seconds)
        return super().__call__(batch)


def test_every_request_settles_under_racing_deadlines_cancels_and_failures():
    # The inference thread and the event loop share the queue: with requests expiring, being
    # abandoned and failing while batches run, every request must still end exactly one way with its
    # own row, every queued one be either computed or counted as dropped, and stop() find nothing left.
    rng = np.random.default_rng(0)
    count = 600

    async def scenario(make):
        engine = SlowEngine(0.002, poison=-1)
        batcher = make(engine, max_batch_size=8, window_ms=2, queue_limit=count)
        loop = asyncio.get_running_loop()

        async def submit(request_id: float, short_deadline: bool):
            return await batcher.submit(item(request_id), loop.time() + (0.01 if short_deadline else 30.0))

        async def request(i: int):
            task = asyncio.create_task(submit(-1 if rng.random() < 0.05 else i, rng.random() < 0.3))
            if rng.random() < 0.2:
                await asyncio.sleep(float(rng.random()) / 100)
                task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                return "cancelled"
            except DeadlineExceeded:
                return "deadline"
            except RuntimeError:
                return "failed"
            assert float(result.row[0]) == 10 * i  # its own row, never another request's
            return "answered"

        outcomes = await asyncio.gather(*(request(i) for i in range(count)))
        await batcher.stop(drain_s=BLOCK_TIMEOUT_S)
        assert set(outcomes) == {"answered", "cancelled", "deadline", "failed"}  # every path was taken
        assert batcher.dropped > 0 and batcher.depth == 0
        assert len(engine.computed) + batcher.dropped == count  # each request computed or dropped, once

    run(scenario)


def test_requests_nobody_waits_for_give_up_their_place_in_the_batch_and_queue():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=4, window_ms=0, queue_limit=6)
        loop = asyncio.get_running_loop()
        first = await held(engine, batcher, 0)
        short = [asyncio.create_task(batcher.submit(item(100 + i), loop.time() + 0.05)) for i in range(2)]
        await asyncio.sleep(0.01)
        live = [asyncio.create_task(batcher.submit(item(i))) for i in (1, 2, 3, 4)]  # two gathered, two queued
        await asyncio.sleep(0.1)  # the short ones' deadlines pass in the batch being gathered
        late = batcher.expect(loop.time() + 0.05)  # its deadline passes while it is decoded
        await asyncio.sleep(0.1)
        assert not batcher.queue(late, item(200))  # not queued: it would only take a live request's place
        engine.release.set()
        await first
        assert [float((await t).row[0]) for t in live] == [10, 20, 30, 40]
        assert engine.batches == [[0], [1, 2, 3, 4]] and batcher.dropped == 2  # the two short ones
        for task in short:
            with pytest.raises(DeadlineExceeded):
                await task
        with pytest.raises(DeadlineExceeded, match="decode"):
            await batcher.result(late)
        assert batcher.dropped == 3  # and the late one, whose input came when nobody waited for it any more

    run(scenario)


def test_a_request_given_up_while_its_input_is_made_counts_as_dropped_and_a_failed_input_does_not():
    # mnv3_dropped is "requests skipped before inference: deadline passed or client gone"; only queued ones
    # were counted, so a deadline passing while the image was decoded (the load's usual 504) went uncounted.
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=4, window_ms=0)
        loop = asyncio.get_running_loop()
        left = batcher.expect()  # its client leaves while it is decoded
        waiting = asyncio.create_task(batcher.result(left))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        expired = batcher.expect(loop.time() + 0.02)  # its deadline passes while it is decoded
        with pytest.raises(DeadlineExceeded, match="decode"):
            await batcher.result(expired)
        bad = batcher.expect()  # not an image: answered, not dropped
        batcher.fail(bad, ValueError("not an image"))
        with pytest.raises(ValueError):
            await batcher.result(bad)
        assert not batcher.queue(left, item(1)) and not batcher.queue(expired, item(2))  # their inputs come late
        assert batcher.dropped == 2

    run(scenario)


def test_stop_fails_requests_still_being_decoded_once_the_drain_runs_out():
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=4, window_ms=0)
        decoding = batcher.expect()  # whose decode never ends
        await batcher.stop(drain_s=0.05)
        with pytest.raises(ShuttingDown):
            await batcher.result(decoding)
        assert not batcher.queue(decoding, item(1))

    run(scenario)


def test_a_bad_input_or_a_failed_gathering_fails_its_requests_and_the_batcher_goes_on():
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=4, window_ms=0)
        with pytest.raises(TypeError, match="numpy array"):
            await batcher.submit([1.0])
        rows_for = batcher._rows_for
        batcher._rows_for = lambda *args: (_ for _ in ()).throw(MemoryError("no room for a batch"))
        with pytest.raises(MemoryError):
            await batcher.submit(item(1))
        batcher._rows_for = rows_for
        assert float((await batcher.submit(item(2))).row[0]) == 20

    run(scenario)


def test_rows_an_engine_returns_as_a_list_of_views_are_copied_before_their_buffer_is_reused():
    async def scenario(make):
        batcher = make(lambda batch: list(batch), max_batch_size=1, window_ms=0)
        first = await batcher.submit(item(1))
        await batcher.submit(item(2))
        await batcher.submit(item(3))  # rows of the first batch's buffer again
        assert float(first.row[0]) == 1

    run(scenario)


@pytest.mark.parametrize("failure", ["bad image", "engine error", "deadline while queued", "deadline while decoded"])
def test_a_failed_request_leaves_no_cycle_holding_its_body(failure):
    # A failed upload's body sits in the frames its exception went through (the request's, a decode thread's),
    # and the request's future, its task and the batcher's threads may hold that exception. Kept in a
    # reference cycle, the body stays until the garbage collector runs, which the server makes rare
    # (server.settle_garbage_collector); see test_cache's test of the same for the cache.
    class Upload:
        pass

    async def request(batcher, engine, body):  # as ServedModel._decoded_and_inferred, holding the body
        loop = asyncio.get_running_loop()
        expected = batcher.expect(loop.time() + (0.05 if failure.startswith("deadline") else 10))

        def decode(held_in_this_frame=body):  # as ServedModel._decode, in a decode thread
            try:
                if failure == "bad image":
                    raise ValueError("corrupt or truncated image")
            except ValueError as exc:
                batcher.fail(expected, exc)
                return
            batcher.queue(expected, item(-1 if failure == "engine error" else 1))

        if failure == "deadline while queued":
            engine.release.clear()  # the batch runs past the deadline
        if failure != "deadline while decoded":  # else the decode never ends
            await asyncio.to_thread(decode)
        return await batcher.result(expected)

    async def scenario(make):
        engine = FakeEngine(poison=-1)
        batcher = make(engine, max_batch_size=4, window_ms=0)
        body = Upload()
        freed.append(weakref.ref(body))
        task = asyncio.ensure_future(request(batcher, engine, body))  # its own task, as each request is
        del body
        with pytest.raises((ValueError, RuntimeError, DeadlineExceeded)):
            await task
        del task
        engine.release.set()

    freed: list = []
    gc.disable()
    try:
        run(scenario)
        assert freed[0]() is None, "the body outlived its request: a cycle holds it until a collection"
    finally:
        gc.enable()


def test_a_result_is_taken_once():
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=4, window_ms=0)
        expected = batcher.expect()
        batcher.queue(expected, item(1))
        assert float((await batcher.result(expected)).row[0]) == 10
        with pytest.raises(RuntimeError, match="taken already"):
            await batcher.result(expected)

    run(scenario)


def test_stop_waits_for_expected_requests_after_the_batcher_has_answered_some():
    # Pinned (a mutation test's find): were the drain's event set whenever nothing is left unanswered, stopping or
    # not, stop() on a server that had answered a request would return at once, failing requests still decoding.
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=4, window_ms=0)
        assert float((await batcher.submit(item(1))).row[0]) == 10  # nothing is left unanswered now
        decoding = batcher.expect()
        stopping = asyncio.create_task(batcher.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()
        await asyncio.to_thread(batcher.queue, decoding, item(2))
        assert float((await batcher.result(decoding)).row[0]) == 20
        await stopping
        assert engine.computed == [1, 2]

    run(scenario)


def test_the_window_runs_from_the_first_request_of_a_batch_however_many_follow():
    # Counted from the latest request taken, the window would slide with each arrival: a steady trickle, each
    # request within the window of the one before, would keep the first waiting for as long as the trickle lasts.
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=64, window_ms=100)
        decoding = batcher.expect()  # one more on its way: the window does not close early for want of requests
        first = asyncio.create_task(batcher.submit(item(0)))
        later = []
        for i in range(1, 13):  # one every ~60 ms, for ~0.7 s unless the first's batch runs before
            await asyncio.sleep(0.06)
            if first.done():
                break
            later.append(asyncio.create_task(batcher.submit(item(i))))
        assert 0.09 < (await first).queue_s < 0.6  # its 100 ms window, not the trickle's length nor 10 times it
        await asyncio.to_thread(batcher.queue, decoding, item(99))
        await asyncio.gather(batcher.result(decoding), *later)

    run(scenario)


def test_the_window_closes_on_time_with_no_later_request_to_wake_the_batcher():
    # The assembler sleeps until the window's end, unless a request wakes it: reckoned from the latest request
    # taken, that sleep would outlast the first's window, its batch waiting for the later request's window too.
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=64, window_ms=1000)
        decoding = batcher.expect()  # one more on its way: the window does not close early for want of requests
        first = asyncio.create_task(batcher.submit(item(0)))
        await asyncio.sleep(0.8)
        second = asyncio.create_task(batcher.submit(item(1)))  # late in the first's window, and the last
        assert 0.99 < (await first).queue_s < 1.5  # the first's 1 s window, not the second's (~1.8 s)
        await asyncio.to_thread(batcher.queue, decoding, item(2))
        await asyncio.gather(second, batcher.result(decoding))

    run(scenario)


def test_a_deadline_that_passes_while_queued_is_answered_when_it_passes():
    # A request still queued gets its 504 when its deadline passes, not later (after the client's own timeout,
    # perhaps), holding its place in the queue meanwhile.
    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        first = await held(engine, batcher, 1)
        loop = asyncio.get_running_loop()
        submitted = loop.time()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit(item(2), deadline=submitted + 0.1)
        assert 0.09 < loop.time() - submitted < 0.4
        engine.release.set()
        await first

    run(scenario)


def test_stop_answers_requests_wherever_they_wait_once_the_drain_runs_out(monkeypatch):
    # Also a batch handed to the runner that the runner has not taken yet (its thread not scheduled, say): were
    # stop() to fail only what is expected, queued, being gathered and running, that batch's requests would hang.
    runner_may_start = threading.Event()
    run_batches = DynamicBatcher._run

    def late_runner(self, loop):
        runner_may_start.wait(BLOCK_TIMEOUT_S)
        run_batches(self, loop)

    monkeypatch.setattr(DynamicBatcher, "_run", late_runner)

    async def scenario(make):
        engine = FakeEngine()
        batcher = make(engine, max_batch_size=1, window_ms=0)
        try:
            decoding = batcher.expect()
            waiting = [asyncio.create_task(batcher.submit(item(i))) for i in (1, 2, 3)]
            while batcher.depth != 2:  # 1 is handed over to the runner; 2 and 3 wait, the runner not being free
                await asyncio.sleep(0.01)
            waiting.append(asyncio.create_task(batcher.result(decoding)))
            await batcher.stop(drain_s=0.1)
            _, unanswered = await asyncio.wait(waiting, timeout=5)
            assert not unanswered
            for task in waiting:
                with pytest.raises(ShuttingDown):
                    await task
        finally:
            runner_may_start.set()
        for thread in batcher._threads:
            await asyncio.to_thread(thread.join, BLOCK_TIMEOUT_S)
        assert engine.computed == []  # the runner skips the batch stop() answered

    run(scenario)


def test_an_engine_returning_too_few_rows_fails_its_batch():
    # Unchecked, the missing row would raise IndexError on the event loop, in the callback answering the batch:
    # the requests after the first would never be answered.
    async def scenario(make):
        batcher = make(lambda batch: batch[:-1], max_batch_size=2, window_ms=60_000)
        both = [batcher.expect(), batcher.expect()]  # both expected before either is queued: one batch
        for request_id, expected in enumerate(both):
            batcher.queue(expected, item(request_id))
        for expected in both:
            with pytest.raises(RuntimeError, match="returned 1 rows for a batch of 2"):
                await batcher.result(expected)

    run(scenario)


def test_a_request_failed_for_its_deadline_before_it_was_decoded_counts_as_dropped():
    # A decode thread that finds the deadline passed fails the request with DeadlineExceeded (ServedModel._decode):
    # it counts as dropped, not as an answer its input failed with.
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=4, window_ms=0)
        expected = batcher.expect()
        batcher.fail(expected, DeadlineExceeded("deadline passed while the image waited for a decode thread"))
        with pytest.raises(DeadlineExceeded, match="decode thread"):
            await batcher.result(expected)
        assert batcher.dropped == 1

    run(scenario)


def test_queue_time_starts_when_the_input_is_queued_and_preparing_time_ends_there():
    # queue_s (the queue-wait metric) counted from expect() would include the decode; preparing_s is that decode.
    async def scenario(make):
        batcher = make(FakeEngine(), max_batch_size=4, window_ms=0)
        expected = batcher.expect()
        await asyncio.sleep(1.0)  # decoding
        await asyncio.to_thread(batcher.queue, expected, item(1))
        result = await batcher.result(expected)
        assert 0 <= result.queue_s < 0.8  # not the 1 s decode
        assert expected.preparing_s >= 0.99

    run(scenario)
