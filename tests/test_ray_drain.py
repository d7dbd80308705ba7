"""The drain's parts without a cluster (mnv3.ray_drain): the flag's bookkeeping, and the proxy middleware
against a stand-in flag: what it reports, refuses, cuts off and lets through. SIGTERM to a real
`python -m mnv3.ray_serve` is tests/test_ray_shutdown.py."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -r requirements-ray.txt")

from conftest import WAIT_S  # noqa: E402
from mnv3 import ray_drain  # noqa: E402
from mnv3.ray_drain import CUT_OFF, DRAINING, REFUSED, SERVING, STALE_S, STOPPED, Flag, Report  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_flag_waits_for_every_proxy_live_when_the_drain_began_to_apply_it_with_nothing_in_flight():
    flag = Flag()
    assert flag.progress() == (0, 0)  # no proxy with the middleware: nothing to wait for
    flag.report("a", SERVING, 3)
    flag.report("b", SERVING, 0)
    flag.reports["gone"] = Report(flag.reports["a"].at - STALE_S - 1, SERVING, 5)  # silent since long before
    flag.set(DRAINING)
    assert flag.progress() == (2, 3)  # a count from before a proxy refused new requests is not the end
    assert flag.report("a", DRAINING, 2) == DRAINING
    assert flag.progress() == (1, 2)
    flag.report("b", DRAINING, 0)
    assert flag.progress() == (0, 2)
    flag.report("a", DRAINING, 0)
    assert flag.progress() == (0, 0)
    flag.reports["a"] = Report(flag.reports["a"].at - STALE_S - 1, DRAINING, 1)  # paused mid-drain, not gone
    assert flag.progress() == (0, 1)
    flag.report("late", SERVING, 0)  # a proxy first heard of during the drain is waited for too
    assert flag.progress() == (1, 1)
    assert flag.progress(live_nodes=frozenset({"b"})) == (0, 0)  # a and late's nodes are gone, with their requests


class StandInFlag:
    """What `ray.get_actor` returns in a proxy: `report.remote(...)` answers the state set here."""

    def __init__(self):
        self.state, self.reports, self.failure = SERVING, [], None
        self.report = self

    def remote(self, proxy, applied, in_flight):
        async def answer():
            if self.failure:
                raise self.failure
            self.reports.append((applied, in_flight))
            return self.state

        return answer()

    async def until_applied(self, state, in_flight=None):
        give_up = asyncio.get_running_loop().time() + WAIT_S
        while not self.reports or self.reports[-1][0] != state or in_flight not in (None, self.reports[-1][1]):
            assert asyncio.get_running_loop().time() < give_up, f"no report of {state} with {in_flight} in flight"
            await asyncio.sleep(0.001)


class HeldApp:
    """Answers each /predict once its release is set; `begin` sends the answer's start before waiting."""

    def __init__(self):
        self.release: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send):
        name = scope["query_string"].decode()
        if scope["path"] == "/predict":
            if name.startswith("begin"):
                await send({"type": "http.response.start", "status": 200, "headers": []})
            await self.release.setdefault(name, asyncio.Event()).wait()
        if not name.startswith("begin"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": name.encode()})


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


def request(app, path, name=""):
    """The messages `app` sends for one request, once it returns (a task)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "query_string": name.encode(),
        "headers": [],
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def run():
        await app(scope, receive, send)
        return sent

    return asyncio.create_task(run())


def answer_of(messages):
    start, body = messages
    return start["status"], dict(start["headers"]), body["body"]


def test_the_middleware_reports_refuses_cuts_off_once_and_serves_again_when_the_flag_goes(monkeypatch):
    flag = StandInFlag()
    monkeypatch.setattr(ray_drain.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_drain.ray, "get_actor", lambda *args, **kwargs: flag)
    monkeypatch.setattr(ray_drain.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr(ray_drain, "POLL_S", 0.001)
    monkeypatch.setattr(ray_drain, "LOOKUP_S", 0.001)

    async def scenario():
        held = HeldApp()
        app = ray_drain.RefuseWhileDraining(held)
        waiting, answering = request(app, "/predict", "waiting"), request(app, "/predict", "begin")
        await flag.until_applied(SERVING, 2)

        flag.state = DRAINING
        await flag.until_applied(DRAINING, 2)  # the count taken with the state applied
        refused = answer_of(await request(app, "/predict", "late"))
        assert refused[0] == 503 and refused[2] == b'{"detail":"' + REFUSED.encode() + b'"}'
        assert refused[1][b"connection"] == b"close" and refused[1][b"retry-after"] == b"1"
        assert answer_of(await request(app, "/other/app", "theirs"))[0] == 200  # another app's path: untouched

        flag.state = STOPPED
        await flag.until_applied(STOPPED)
        await asyncio.sleep(0.01)  # the cut-off answers are sent from tasks of their own
        held.release["waiting"].set()
        held.release.setdefault("begin", asyncio.Event()).set()
        cut_off = answer_of(await waiting)  # one answer: what its app sent after is dropped
        assert cut_off[0] == 503 and CUT_OFF.encode() in cut_off[2]
        begun = await answering  # its answer had begun: not replaced
        assert [m.get("status", m.get("body")) for m in begun] == [200, b"begin"]

        flag.failure = ray_drain.ActorUnavailableError("out of reach", None)  # for a moment: the drain holds
        reports = len(flag.reports)
        await asyncio.sleep(0.05)
        assert app.state == STOPPED and len(flag.reports) == reports
        assert answer_of(await request(app, "/predict", "meanwhile"))[0] == 503

        flag.failure = ray_drain.ActorDiedError()  # the driver stopped: its flag with it
        await asyncio.wait_for(until(lambda: app.state == SERVING), WAIT_S)
        served = request(app, "/predict", "next")
        await asyncio.sleep(0.01)
        held.release["next"].set()
        assert answer_of(await served)[0] == 200
        app.watcher.cancel()

    asyncio.run(scenario())


class StandInHandle:
    """An actor handle on a local Flag: each `.remote(...)` runs the method (ray.get is patched to pass it on)."""

    def __init__(self, flag):
        for name in ("set", "progress", "report"):
            setattr(self, name, SimpleNamespace(remote=getattr(flag, name)))


@pytest.fixture
def no_cluster(monkeypatch):
    monkeypatch.setattr(ray_drain.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(ray_drain.ray, "nodes", lambda: [{"NodeID": "head", "Alive": True}])


def test_the_drain_ends_at_once_for_a_proxy_whose_node_is_gone_and_a_skip_sends_stopped(no_cluster):
    flag = Flag()
    flag.report("head", SERVING, 0)
    flag.report("worker", SERVING, 1)  # its node dies before the drain: its request went with it

    def head_proxy():  # the live proxy goes on reporting, idle, applying each state, until it applies STOPPED
        while flag.report("head", flag.state, 0) != STOPPED or flag.reports["head"].applied != STOPPED:
            time.sleep(0.01)

    reporting = threading.Thread(target=head_proxy)
    reporting.start()
    started = time.monotonic()
    left = ray_drain.drain(StandInHandle(flag), timeout_s=WAIT_S, skipped=lambda: False)
    assert left == 0 and time.monotonic() - started < WAIT_S / 2 and flag.state == DRAINING
    flag.report("head", DRAINING, 3)  # requests the drain would wait for, but the user said skip
    started = time.monotonic()
    assert ray_drain.drain(StandInHandle(flag), timeout_s=WAIT_S, skipped=lambda: True) == 3
    assert flag.state == STOPPED and time.monotonic() - started < ray_drain.CONFIRM_S  # the proxy confirmed
    reporting.join(WAIT_S)
