"""Operations that land even when their caller is cancelled, and a store that waits for them on close.

A transaction on a pooled connection runs in its caller's task, so cancelling the caller would roll back a
write already on its way (asyncpg resets the connection it gives back). The SQLite store promises the
opposite, and core counts on it: it ends its tasks before it closes the store, and the writes those tasks
made must still land. So every operation of the PostgreSQL store runs in a task of its own, which the
caller awaits through ``asyncio.shield``: a cancelled caller stops waiting, the operation completes (or
fails) as if the caller had waited, and ``close`` waits for every operation started before it — within a
bound (``drain``'s timeout): an operation stuck past it is given up on, never waited for forever.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class InFlight:
    """The operations under way."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, name: str, coro: Coroutine[Any, Any, R]) -> R:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the caller saw it, or stopped waiting for it: either way it is handled

    async def drain(self, *, timeout: float | None = None) -> bool:
        """Wait until every operation started so far has finished, for at most ``timeout`` seconds (None: no
        limit); False when some are still under way then."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=left)
        return True


class Landing(Protocol):
    @property
    def in_flight(self) -> InFlight: ...

    def check_open(self, op: str) -> None: ...


S = TypeVar("S", bound=Landing)


def lands(method: Callable[Concatenate[S, P], Awaitable[R]]) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Run the decorated store method as an in-flight operation (see the module docstring); a call made once
    the store is closing fails at once."""

    @functools.wraps(method)
    async def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.check_open(method.__name__)

        async def operation() -> R:
            return await method(self, *args, **kwargs)

        return await self.in_flight.run(method.__name__, operation())

    return wrapper
