"""Stopping a Ray Serve app the way the plain server stops: what was taken in is answered, nothing new is taken.

Ray's `serve.shutdown()` kills its HTTP proxy at once, so every request in flight then gets no answer.
Deleting the app first lets each replica finish the requests it holds, but those still queued in the proxy
wait for a replica that never comes, and new requests meet Ray's 404 for an unknown route. So
`mnv3.ray_serve`, on SIGTERM or Ctrl-C, first raises a flag (`DrainFlag`, a named actor it starts beside the
app) and waits in `drain()`; the proxy middleware `RefuseWhileDraining` (in every proxy started with
mnv3's callback) watches the flag and reports what its proxy has in flight.

Guarantees, for proxies with the middleware:
- within about `POLL_S` of the flag going up, a proxy answers every new request with a JSON 503 and
  Retry-After (the plain server closes its port instead: a proxy cannot);
- `drain()` returns once every such proxy has reported nothing in flight since the flag went up, or once
  its timeout (`--shutdown-timeout-s`) runs out; then each request still in flight whose answer has not
  begun is answered 503, as the plain server answers one its drain did not finish;
- a proxy whose flag has gone (its driver stopped) takes requests again, for whichever app comes next.
A proxy without the middleware (a cluster started without mnv3's callback) never reports and is not waited for.
"""

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from mnv3.auth import route_path
from mnv3.batcher import ShuttingDown
from mnv3.errors import body_for_path, error_response

logger = logging.getLogger("ray.serve")  # in Ray's proxy: its log files
DRAIN_FLAG_NAME = "mnv3-drain"
DRAIN_FLAG_NAMESPACE = "mnv3"
POLL_S = 0.1  # how often a proxy reports to the flag: how late a new request may still be taken in
LOOKUP_S = 1.0  # how often a proxy looks for a flag that is not there (no mnv3 driver, or not yet)
# What the flag says, in order: take requests; answer those taken, refuse new ones; give up on those left.
SERVING, DRAINING, STOPPED = "serving", "draining", "stopped"
REFUSED = "the server is stopping: it answers the requests it had and takes no new ones; retry elsewhere or later"
CUT_OFF = "the server stopped before this request finished (--shutdown-timeout-s)"


@ray.remote(num_cpus=0)  # it must not take a CPU the replicas were sized to
class DrainFlag:
    """Whether the app is stopping, and what each proxy has had in flight since it began to."""

    def __init__(self):
        self.state = SERVING
        self.in_flight: dict[str, int] = {}  # proxy -> its latest count, reported since the drain began

    def set(self, state: str) -> None:
        self.state = state

    def report(self, proxy: str, in_flight: int) -> str:
        if self.state != SERVING:
            self.in_flight[proxy] = in_flight
        return self.state

    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())


def start_flag() -> "ray.actor.ActorHandle":
    """The flag the proxies watch, at SERVING; it lives as long as this driver does."""
    # ray.remote made the class an ActorClass, which mypy cannot see through the decorator.
    return DrainFlag.options(name=DRAIN_FLAG_NAME, namespace=DRAIN_FLAG_NAMESPACE).remote()  # type: ignore[attr-defined]


def drain(flag: "ray.actor.ActorHandle", timeout_s: float) -> int:
    """Stop taking requests and wait until the proxies have answered those they had, at most `timeout_s`;
    then have the proxies answer what is left with 503. How many requests were left."""
    deadline = time.monotonic() + timeout_s
    ray.get(flag.set.remote(DRAINING))
    time.sleep(3 * POLL_S)  # every watching proxy has seen the flag, and reported since
    while (in_flight := ray.get(flag.in_flight_total.remote())) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if in_flight:
        ray.get(flag.set.remote(STOPPED))
        time.sleep(3 * POLL_S)  # the proxies answer what is left
    return in_flight


@dataclass(eq=False)
class InFlight:
    """A request a proxy has taken in: what it needs to answer it from outside the request's own task."""

    scope: dict
    receive: Callable
    send: Callable
    started: bool = False  # its answer has begun: it cannot be replaced
    cut_off: bool = False  # answered 503 at STOPPED: what the app sends after is dropped


class RefuseWhileDraining:
    """ASGI middleware for Ray's proxy: keeps the requests its proxy has in flight and reports how many to the
    drain flag; refuses new ones with a 503 while the flag is up, and once it says STOPPED answers those whose
    answer has not begun with a 503 (JSON in the path's error shape, with Retry-After, as the plain server)."""

    def __init__(self, app):
        self.app = app
        self.state = SERVING
        self.requests: set[InFlight] = set()
        self.watcher: asyncio.Task | None = None  # started on the first request, in the proxy's event loop

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.watcher is None and ray.is_initialized():  # in Ray's proxy; not in a test's TestClient
            self.watcher = asyncio.create_task(self._watch())
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
        proxy = f"{socket.gethostname()}:{os.getpid()}"
        flag = None
        while True:
            try:
                if flag is None:
                    flag = await asyncio.to_thread(ray.get_actor, DRAIN_FLAG_NAME, namespace=DRAIN_FLAG_NAMESPACE)
                state = await flag.report.remote(proxy, len(self.requests))
            except (ValueError, RayActorError):  # no flag (yet), or its driver has stopped
                flag, self.state = None, SERVING
                await asyncio.sleep(LOOKUP_S)
                continue
            except Exception:  # anything else: the watch goes on, or a drain would wait for nothing
                logger.exception("mnv3: the drain flag could not be read; trying again")
                flag = None
                await asyncio.sleep(LOOKUP_S)
                continue
            previous, self.state = self.state, state
            if state == STOPPED and previous != STOPPED:
                await self._cut_off()
            await asyncio.sleep(POLL_S)

    async def _cut_off(self) -> None:
        for request in [request for request in self.requests if not request.started]:
            request.cut_off = True
            await answer(ShuttingDown(CUT_OFF), request.scope, request.receive, request.send)


async def answer(exc: Exception, scope, receive, send) -> None:
    """`exc` answered as the plain server answers it, in the error shape of the request's path."""
    await error_response(exc, body=body_for_path(route_path(scope)))(scope, receive, send)
