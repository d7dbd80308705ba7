"""`serving.unless_disconnected`: a client's disconnect cancels its request's work and ends it as
ClientDisconnect, and the request's task keeps a true cancel count, which `AnswerCancelledAtShutdown` reads to
tell the server's own cancel from others. (The live server's side is tests/test_overload.py.)"""

import asyncio
import types

import pytest

from mnv3.cache import ResultCache
from mnv3.preprocess import InvalidImage
from mnv3.serving import unless_disconnected
from mnv3.v2_router import _rows

pytestmark = pytest.mark.unit


class Client:
    """A request whose body is read: its next ASGI message is the disconnect, once `gone` is set."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def ending(work):
    """What ended the request's task (its result, or the exception's name), and its cancel count then."""
    try:
        outcome = await work
    except BaseException as exc:  # noqa: BLE001 - CancelledError is one of the outcomes
        outcome = type(exc).__name__
    return outcome, asyncio.current_task().cancelling()


async def settled() -> None:
    for _ in range(3):  # the request's task and its watcher both waiting
        await asyncio.sleep(0)


def test_the_work_answers_when_the_client_stays():
    async def scenario():
        done = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(ending(unless_disconnected(Client(), done)))
        await settled()
        done.set_result("answer")
        return await task

    assert asyncio.run(scenario()) == ("answer", 0)


def test_a_disconnect_cancels_the_work_and_ends_the_request_as_client_disconnect():
    cancelled = []

    async def work():
        try:
            await asyncio.get_running_loop().create_future()  # never answers
        except asyncio.CancelledError:
            cancelled.append(True)  # the work itself saw the cancel: its decode and inference are dropped
            raise

    async def scenario():
        client = Client()
        task = asyncio.create_task(ending(unless_disconnected(client, work())))
        await settled()
        client.gone.set()
        return await task

    assert asyncio.run(scenario()) == ("ClientDisconnect", 0)
    assert cancelled == [True]


def test_a_receive_that_fails_drops_the_work_as_a_disconnect(caplog):
    """Ray Serve's receive re-raises a failed fetch from its proxy: the answer could not reach the client."""

    class BrokenClient:
        async def receive(self):
            raise RuntimeError("the proxy is gone")

    async def scenario():
        work = asyncio.Event().wait()  # never ends of itself
        return await asyncio.wait_for(asyncio.create_task(ending(unless_disconnected(BrokenClient(), work))), 5)

    assert asyncio.run(scenario()) == ("ClientDisconnect", 0)
    assert "the proxy is gone" in caplog.text


def test_a_cancel_from_outside_with_the_disconnect_still_ends_the_request_cancelled():
    """uvicorn's shutdown (or Ray's cancel of a replica's request) landing in the same iteration as the client's
    disconnect: the task was cancelled from outside, so it ends cancelled, once."""

    async def scenario():
        client = Client()
        task = asyncio.create_task(ending(unless_disconnected(client, asyncio.get_running_loop().create_future())))
        await settled()
        client.gone.set()
        task.cancel()
        return await task

    assert asyncio.run(scenario()) == ("CancelledError", 1)


def test_work_that_ends_otherwise_after_the_disconnect_leaves_no_cancel_counted():
    async def work(swallow):
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if swallow == "returns":
                return "answer"
            raise InvalidImage("not an image") from None

    async def scenario(swallow):
        client = Client()
        task = asyncio.create_task(ending(unless_disconnected(client, work(swallow))))
        await settled()
        client.gone.set()
        return await task

    assert asyncio.run(scenario("returns")) == ("answer", 0)
    assert asyncio.run(scenario("raises")) == ("InvalidImage", 0)


def test_a_v2_request_whose_image_fails_leaves_its_task_uncancelled():
    """/v2 infer's rows run in a TaskGroup, which (Python 3.11) cancels its parent task when a row fails as it
    exits and never uncancels it: the group runs in a task of its own, not the request's."""

    async def probabilities(data, deadline):
        await asyncio.sleep(0)
        raise InvalidImage("not an image")

    model = types.SimpleNamespace(cache=ResultCache(0, "m"), probabilities=probabilities)
    parsed = types.SimpleNamespace(images=[b"x"], pixels=None)

    async def scenario():
        return await ending(unless_disconnected(Client(), _rows(model, parsed, 0.0)))

    assert asyncio.run(scenario()) == ("InvalidImage", 0)
