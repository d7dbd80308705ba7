"""Stopping a Ray Serve app the way the plain server stops: what was taken in is answered, nothing new is taken.

Ray's `serve.shutdown()` kills its HTTP proxy at once, so every request in flight then gets no answer.
Deleting the app first lets each replica finish the requests it holds, but those still queued in the proxy
wait for a replica that never comes, and new requests meet Ray's 404 for an unknown route. So
`mnv3.ray_serve`, on SIGTERM or Ctrl-C, first raises a flag (`DrainFlag`, a named actor it starts beside the
app) and waits in `drain()`; the proxy middleware `RefuseWhileDraining` (in every proxy started with
mnv3's callback) reports to the flag, every `POLL_S`, the state it applies and what it has in flight.

Guarantees, for proxies with the middleware, and for requests to mnv3's paths (`is_mnv3_path`: on a cluster
shared with other apps, theirs pass untouched):
- a proxy applies the flag's state at its next report: from DRAINING on it answers every new request with a
  JSON 503, Retry-After and `Connection: close` (the plain server closes its port instead: a proxy cannot),
  and its first request ever waits (up to LOOKUP_S) for its first report, so a proxy idle until then takes
  nothing in late;
- `drain()` waits until every proxy live when it began (reported in the last STALE_S), or reporting since,
  has reported, already applying DRAINING, nothing in flight, however long one is silent meanwhile (up to
  the timeout); a proxy's count is taken in the same step of its event loop as the state it reports, so no
  request slips between the two;
- at `drain()`'s timeout (`--shutdown-timeout-s`), or when the wait is skipped (a second Ctrl-C or
  SIGTERM), the flag says STOPPED: each proxy answers every request whose answer has not begun with a 503,
  once, and drops what the app sends for it after; `drain()` waits (up to CONFIRM_S) for every proxy to
  report it has;
- a proxy whose flag has gone (its driver stopped) takes requests again, for whichever app comes next.
A proxy without the middleware (a cluster started without mnv3's callback) never reports and is not waited for.
"""

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from mnv3.auth import route_path
from mnv3.batcher import ShuttingDown
from mnv3.errors import CUT_OFF, body_for_path, error_response

logger = logging.getLogger("ray.serve")  # in Ray's proxy: its log files
DRAIN_FLAG_NAME = "mnv3-drain"
DRAIN_FLAG_NAMESPACE = "mnv3"
POLL_S = 0.1  # how often a proxy reports to the flag
LOOKUP_S = 1.0  # how often a proxy looks for a flag that is not there (no mnv3 driver, or not yet)
STALE_S = 5.0  # a proxy silent this long when a drain begins is gone (its node stopped): not waited for
CONFIRM_S = 2.0  # how long drain() waits for the proxies to answer what is left at STOPPED
# What the flag says, in order: take requests; answer those taken, refuse new ones; give up on those left.
SERVING, DRAINING, STOPPED = "serving", "draining", "stopped"
REFUSED = "the server is stopping: it answers the requests it had and takes no new ones; retry elsewhere or later"
# The first segment of every path mnv3's app serves (tests/test_ray_shutdown.py checks it against the app's
# routes): on a cluster shared with other apps, a proxy drains only these.
MNV3_PATH = re.compile(r"/(|predict|v2|models?|metrics|healthz|readyz|stats|static|docs|redoc|openapi\.json)(/.*)?")


def is_mnv3_path(path: str) -> bool:
    return MNV3_PATH.fullmatch(path) is not None


@dataclass(frozen=True)
class Report:
    at: float  # time.monotonic() on the flag's clock
    applied: str  # the state the proxy applied when it counted
    in_flight: int


class Flag:
    """Whether the app is stopping, and each proxy's latest report (the actor `DrainFlag` holds one). A proxy
    is known by its node's id: Serve runs one a node, and one restarted on its node takes its place."""

    def __init__(self) -> None:
        self.state = SERVING
        self.reports: dict[str, Report] = {}
        self.waited_for: set[str] = set()  # the proxies live when the drain began: waited for however silent

    def set(self, state: str) -> None:
        if state == DRAINING and self.state == SERVING:
            now = time.monotonic()
            self.waited_for = {proxy for proxy, report in self.reports.items() if now - report.at < STALE_S}
        self.state = state

    def report(self, proxy: str, applied: str, in_flight: int) -> str:
        self.reports[proxy] = Report(time.monotonic(), applied, in_flight)
        if self.state != SERVING:
            self.waited_for.add(proxy)
        return self.state

    def progress(self, live_nodes: frozenset[str] | None = None) -> tuple[int, int]:
        """(proxies not yet applying the state, requests in flight at them all, at their latest reports).
        Before a drain, the proxies live now; during one, those live when it began and those since, except
        those whose node is not among `live_nodes` (None: all are): their requests went with it."""
        if self.state == SERVING:
            waited = [report for report in self.reports.values() if time.monotonic() - report.at < STALE_S]
        else:
            waited = [self.reports[node] for node in self.waited_for if live_nodes is None or node in live_nodes]
        return sum(report.applied != self.state for report in waited), sum(report.in_flight for report in waited)


DrainFlag = ray.remote(num_cpus=0)(Flag)  # no CPU: it must not take one the replicas were sized to


def start_flag() -> "ray.actor.ActorHandle":
    """The flag the proxies watch, at SERVING; it lives as long as this driver does."""
    return DrainFlag.options(name=DRAIN_FLAG_NAME, namespace=DRAIN_FLAG_NAMESPACE).remote()


def drain(flag: "ray.actor.ActorHandle", timeout_s: float, skipped: Callable[[], bool]) -> int:
    """Stop taking requests and wait until the proxies have answered those they had, at most `timeout_s`
    (`skipped()` true ends the wait early); then have them answer what is left with 503. How many requests
    were in flight at live proxies when the wait ended (at their latest reports). Every call to the flag is
    bounded in time, so a flag out of reach cannot hold the driver past its deadline."""
    deadline = time.monotonic() + timeout_s
    in_flight = 0
    _ask(flag.set.remote(DRAINING))
    while True:
        progress = _ask(flag.progress.remote(_live_nodes()))
        if progress is not None:
            behind, in_flight = progress
            if not behind and not in_flight:
                return 0
        if skipped() or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    _ask(flag.set.remote(STOPPED))
    confirm_by = time.monotonic() + CONFIRM_S
    while time.monotonic() < confirm_by:
        progress = _ask(flag.progress.remote(_live_nodes()))
        if progress is not None and not progress[0]:
            break
        time.sleep(POLL_S)
    return in_flight


def _ask(ref, timeout_s: float = 1.0):
    """`ref`'s value, or None if the flag does not answer within `timeout_s`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        return None


def _live_nodes() -> frozenset[str]:
    return frozenset(node["NodeID"] for node in ray.nodes() if node["Alive"])


@dataclass(eq=False)
class InFlight:
    """A request a proxy has taken in: what it needs to answer it from outside the request's own task."""

    scope: dict
    receive: Callable
    send: Callable
    started: bool = False  # its answer has begun: it cannot be replaced
    cut_off: bool = False  # answered 503 at STOPPED: what the app sends after is dropped


class RefuseWhileDraining:
    """ASGI middleware for Ray's proxy: keeps the requests for mnv3's paths its proxy has in flight and
    reports how many to the drain flag; refuses new ones while the flag is up, and once it says STOPPED
    answers those whose answer has not begun (503s in the path's error shape, as the plain server's)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.state = SERVING
        self.requests: set[InFlight] = set()
        self.watcher: asyncio.Task | None = None  # in the proxy's event loop, from its first request on
        self.first_report = asyncio.Event()
        self.answering: set[asyncio.Task] = set()  # cut-off answers being sent

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_mnv3_path(route_path(scope)):
            return await self.app(scope, receive, send)
        if ray.is_initialized():  # in Ray's proxy; not in a test's TestClient
            if self.watcher is None or self.watcher.done():
                self.watcher = asyncio.create_task(self._watch())
            if not self.first_report.is_set():  # a proxy idle so far may be joining a drain
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.first_report.wait(), LOOKUP_S)
        if self.state != SERVING:
            return await answer(ShuttingDown(REFUSED), scope, receive, send)
        request = InFlight(scope, receive, send)
        self.requests.add(request)

        # Not cancelled at STOPPED: Ray's proxy takes a cancel for a client gone, and retrying what lost its
        # replica (RetryLostReplica) would send it again. Its work ends when the proxy stops, moments later.
        async def send_unless_cut_off(message):
            if request.cut_off:
                return
            if message["type"] == "http.response.start":
                request.started = True
            await send(message)

        try:
            await self.app(scope, receive, send_unless_cut_off)
        finally:
            self.requests.discard(request)

    async def _watch(self) -> None:
        node = ray.get_runtime_context().get_node_id()
        flag: Any = None  # its ActorHandle, once found
        while True:
            try:
                if flag is None:
                    flag = await asyncio.to_thread(ray.get_actor, DRAIN_FLAG_NAME, namespace=DRAIN_FLAG_NAMESPACE)
                state = await flag.report.remote(node, self.state, len(self.requests))
            except (ValueError, ActorDiedError):  # no flag (yet), or its driver has stopped: serve
                flag, self.state = None, SERVING
                self.first_report.set()
            except ActorUnavailableError:  # out of reach for now: keep the state, try again
                pass
            except Exception:  # anything else: the watch goes on, or a drain would wait for nothing
                logger.exception("mnv3: the drain flag could not be read; trying again")
                flag = None
            else:
                if state == STOPPED and self.state != STOPPED:
                    self._cut_off()
                self.state = state  # applied: the next report says so
                self.first_report.set()
            await asyncio.sleep(POLL_S if flag is not None else LOOKUP_S)

    def _cut_off(self) -> None:
        """Every request whose answer has not begun is marked, in one step (no other task runs between the
        test and the mark), then answered 503."""
        for request in list(self.requests):
            if not request.started and not request.cut_off:
                request.cut_off = True
                self.requests.discard(request)  # answered: its app may take a while to notice
                task = asyncio.create_task(self._answer_cut_off(request))
                self.answering.add(task)
                task.add_done_callback(self.answering.discard)

    async def _answer_cut_off(self, request: InFlight) -> None:
        try:
            await answer(ShuttingDown(CUT_OFF), request.scope, request.receive, request.send)
        except Exception:  # its client has gone, most likely: nothing else depends on this answer
            logger.exception("mnv3: a request cut off at the drain's end could not be answered")


async def answer(exc: Exception, scope, receive, send) -> None:
    """`exc` answered as the plain server answers it, in the error shape of the request's path, closing the
    connection: a client that keeps it would come back to a proxy that is going away."""
    response = error_response(exc, body=body_for_path(route_path(scope)))
    response.headers["connection"] = "close"
    await response(scope, receive, send)
