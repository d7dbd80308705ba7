"""Results keyed by the exact image bytes and model, with single-flight for identical requests in flight."""

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cachetools import LRUCache

Result = TypeVar("Result")


class ResultCache:
    """A bounded LRU of computed results; `maxsize=0` turns caching (and single-flight) off.

    Everything runs on one event loop, so the dicts need no locks.
    """

    def __init__(self, maxsize: int, model_id: str, leader_only_errors: tuple[type[BaseException], ...] = ()):
        """`leader_only_errors` say something about the leader's request (its deadline, a full queue, its
        client gone), not about the image: followers then compute under their own budget instead."""
        self.model_id = model_id
        # A leader ending with one of these hands over to a follower instead of failing it.
        self._handover_errors: tuple[type[BaseException], ...] = (asyncio.CancelledError, *leader_only_errors)
        self._results: LRUCache[str, Any] | None = LRUCache(maxsize) if maxsize > 0 else None
        self._in_flight: dict[str, asyncio.Future] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._results) if self._results is not None else 0

    def key(self, data: bytes, kind: str = "") -> str:
        # The model id is in the key so a cache can never answer for a different model file.
        key = f"{hashlib.sha256(data).hexdigest()}:{self.model_id}"
        return f"{key}:{kind}" if kind else key

    async def get_or_compute(
        self,
        data: bytes,
        compute: Callable[[], Awaitable[Result]],
        kind: str = "",
        follow: Callable[[Awaitable[Result]], Awaitable[Result]] | None = None,
    ) -> tuple[Result, bool]:
        """Return (result, hit). A hit is a stored result or one shared with an identical request in flight.
        `kind` tells apart results of different shapes computed from the same bytes.

        The first request for a key (the leader) computes; identical requests arriving meanwhile await
        its future. A leader's exception reaches its followers and is not stored, except a
        `leader_only_errors` one: then, as when the leader's client went away, one follower takes over.
        `follow` wraps a follower's wait (the server's ends it when the follower's own client leaves); an
        exception it raises ends only that follower, not the leader.
        """
        if self._results is None:
            return await compute(), False
        key = self.key(data, kind)
        while True:
            if key in self._results:
                self.hits += 1
                return self._results[key], True
            shared = self._in_flight.get(key)
            if shared is None:
                return await self._lead(key, compute), False
            try:
                waiting = asyncio.shield(shared)
                result = await (follow(waiting) if follow else waiting)
            except asyncio.CancelledError:
                if not shared.cancelled() or asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise  # this request itself was cancelled
                continue  # the leader was cancelled, not us: try again, perhaps as leader
            finally:
                del shared, waiting  # the leader's exception, raised here, would hold this frame in a cycle (_lead)
            self.hits += 1
            return result, True

    async def _lead(self, key: str, compute: Callable[[], Awaitable[Result]]) -> Result:
        assert self._results is not None  # get_or_compute computes directly when the cache is off
        self.misses += 1
        future = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            result = await compute()
        except self._handover_errors:
            future.cancel()  # followers see a cancelled leader and retry, one of them as the new leader
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # marks it retrieved: with no followers asyncio would log it as lost
            raise
        else:
            self._results[key] = result
            future.set_result(result)
            return result
        finally:
            del self._in_flight[key]
            # The future holds the exception, whose traceback holds this frame, which holds the future: a
            # cycle only the garbage collector frees, and with it every frame the exception passed through,
            # the request's body among their locals. Held until a collection, a failed upload's megabytes
            # add up under a stream of them.
            del future
