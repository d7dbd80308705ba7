import asyncio
import gc
import weakref

import pytest

from mnv3.cache import ResultCache

pytestmark = pytest.mark.unit


class Computation:
    """An async compute function that counts its calls and can be held open until released."""

    def __init__(self, result="result", error: Exception | None = None):
        self.result, self.error = result, error
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self):
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def leader_and_follower(compute: Computation, follow=None):
    """A cache and two requests for one image in it: the leader computing, held until `compute.release`, and a
    follower waiting on it (through `follow`)."""
    cache = ResultCache(maxsize=8, model_id="m")
    compute.release.clear()
    leader = asyncio.create_task(cache.get_or_compute(b"x", compute))
    await asyncio.sleep(0)
    follower = asyncio.create_task(cache.get_or_compute(b"x", compute, follow=follow))
    await asyncio.sleep(0)
    return cache, leader, follower


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_hits_misses_and_lru_eviction():
    async def scenario():
        cache = ResultCache(maxsize=2, model_id="m:abc")
        compute = Computation()
        assert await cache.get_or_compute(b"a", compute) == ("result", False)
        assert await cache.get_or_compute(b"a", compute) == ("result", True)
        await cache.get_or_compute(b"b", compute)
        await cache.get_or_compute(b"a", compute)  # a is now the most recently used
        await cache.get_or_compute(b"c", compute)  # evicts b
        assert len(cache) == 2
        assert (await cache.get_or_compute(b"a", compute))[1] is True
        assert (await cache.get_or_compute(b"b", compute))[1] is False
        assert (cache.hits, cache.misses, compute.calls) == (3, 4, 4)

    run(scenario())


def test_key_names_the_model():
    assert ResultCache(1, "a.onnx:1").key(b"x") != ResultCache(1, "b.onnx:2").key(b"x")


def test_size_zero_disables_caching():
    async def scenario():
        cache = ResultCache(maxsize=0, model_id="m")
        compute = Computation()
        for _ in range(3):
            assert await cache.get_or_compute(b"a", compute) == ("result", False)
        assert (compute.calls, len(cache), cache.hits) == (3, 0, 0)

    run(scenario())


def test_concurrent_identical_requests_share_one_computation():
    async def scenario():
        cache = ResultCache(maxsize=8, model_id="m")
        compute = Computation()
        compute.release.clear()
        tasks = [asyncio.create_task(cache.get_or_compute(b"same", compute)) for _ in range(10)]
        await asyncio.sleep(0)
        compute.release.set()
        outcomes = await asyncio.gather(*tasks)
        assert compute.calls == 1
        assert sorted(hit for _, hit in outcomes) == [False] + [True] * 9
        assert (cache.hits, cache.misses) == (9, 1)

    run(scenario())


def test_leader_failure_reaches_followers_and_is_not_cached():
    async def scenario():
        cache = ResultCache(maxsize=8, model_id="m")
        failing = Computation(error=ValueError("bad image"))
        failing.release.clear()
        tasks = [asyncio.create_task(cache.get_or_compute(b"x", failing)) for _ in range(3)]
        await asyncio.sleep(0)
        failing.release.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert [str(o) for o in outcomes] == ["bad image"] * 3
        assert failing.calls == 1 and len(cache) == 0
        assert await cache.get_or_compute(b"x", Computation("fixed")) == ("fixed", False)

    run(scenario())


class Upload:
    """What a request's frames hold (its body, a half-decoded image), as an object a weak reference can follow."""


@pytest.mark.parametrize("requests", [1, 3], ids=["leader", "leader and followers"])
def test_a_failed_computation_leaves_no_cycle_holding_the_request(requests):
    # A failed upload's body sits in the frames its exception went through. Kept in a reference cycle, it stays
    # until the garbage collector runs, which the server makes rare (server.settle_garbage_collector): a
    # stream of bad 6 MB uploads grew a server by a gigabyte.
    async def scenario():
        cache = ResultCache(maxsize=8, model_id="m")
        upload = Upload()
        release = asyncio.Event()

        async def compute(held_in_this_frame=upload):
            await release.wait()
            raise ValueError("corrupt or truncated image")

        tasks = [asyncio.create_task(cache.get_or_compute(b"image", compute)) for _ in range(requests)]
        await asyncio.sleep(0)
        release.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(outcome, ValueError) for outcome in outcomes)
        freed = weakref.ref(upload)
        del upload, compute, tasks, outcomes
        return freed

    gc.disable()
    try:
        freed = run(scenario())
        assert freed() is None, "the upload outlived its request: a cycle holds it until a collection"
    finally:
        gc.enable()


def test_cancelled_leader_hands_over_to_a_follower():
    async def scenario():
        compute = Computation()
        cache, leader, follower = await leader_and_follower(compute)
        leader.cancel()
        await asyncio.sleep(0)
        compute.release.set()
        assert await follower == ("result", False)  # it computed, as the new leader
        assert compute.calls == 2
        with pytest.raises(asyncio.CancelledError):
            await leader

    run(scenario())


def test_leader_only_error_is_not_shared_a_follower_computes_under_its_own_budget():
    class LeaderDeadline(Exception):
        pass

    async def scenario():
        cache = ResultCache(maxsize=8, model_id="m", leader_only_errors=(LeaderDeadline,))
        failing = Computation(error=LeaderDeadline("the leader's deadline passed"))
        failing.release.clear()
        leader = asyncio.create_task(cache.get_or_compute(b"x", failing))
        await asyncio.sleep(0)
        follower = asyncio.create_task(cache.get_or_compute(b"x", Computation("own result")))
        await asyncio.sleep(0)
        failing.release.set()
        with pytest.raises(LeaderDeadline):
            await leader
        assert await follower == ("own result", False)
        assert cache.misses == 2 and cache.hits == 0

    run(scenario())


def test_a_cancelled_follower_leaves_the_leader_its_result():
    # A follower awaiting the leader's future itself, not a shield of it, would cancel that future when its own
    # request is cancelled: the leader would then fail to set its result (InvalidStateError, a 500).
    async def scenario():
        compute = Computation()
        cache, leader, follower = await leader_and_follower(compute)
        follower.cancel()
        with pytest.raises(asyncio.CancelledError):
            await follower
        compute.release.set()
        assert await leader == ("result", False)
        assert await cache.get_or_compute(b"x", compute) == ("result", True)
        assert compute.calls == 1

    run(scenario())


def test_an_error_raised_by_follow_ends_only_that_follower():
    # A follower's wait ends when `follow` raises (the server's raises ClientDisconnect when the client leaves),
    # not when the leader's result comes: it would hold its --max-in-flight place meanwhile.
    class ClientLeft(Exception):
        pass

    async def scenario():
        compute = Computation()
        client_left = asyncio.Event()

        async def follow(waiting):  # as the server's unless_disconnected: the wait ends when the client leaves
            await client_left.wait()
            waiting.cancel()
            raise ClientLeft("the follower's client left")

        cache, leader, follower = await leader_and_follower(compute, follow)
        client_left.set()
        await asyncio.wait([follower], timeout=5)
        assert follower.done() and not leader.done()  # it ended while the leader still computes
        with pytest.raises(ClientLeft):
            await follower
        compute.release.set()
        assert await leader == ("result", False)
        assert await cache.get_or_compute(b"x", compute) == ("result", True)  # the leader's result was cached
        assert compute.calls == 1

    run(scenario())


def test_a_follower_cancelled_with_its_leader_ends_cancelled_instead_of_computing():
    # Cancelled in the same tick as its leader, a follower finds the leader's future cancelled; taken for a
    # hand-over, its own cancellation would be swallowed and it would compute for a request nobody awaits.
    async def scenario():
        compute = Computation()
        cache, leader, follower = await leader_and_follower(compute)
        leader.cancel()  # first: its future is cancelled by the time the follower wakes
        follower.cancel()
        compute.release.set()
        outcomes = await asyncio.gather(leader, follower, return_exceptions=True)
        assert [type(o) for o in outcomes] == [asyncio.CancelledError] * 2
        assert compute.calls == 1 and len(cache) == 0

    run(scenario())
