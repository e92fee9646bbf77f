"""TaskSupervisor: every background task of the process runs under it, with a bounded shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[None]"]
"""``TaskSupervisor.spawn`` as a value, for code that starts tasks on a supervisor it does not own."""


class ShuttingDownError(RuntimeError):
    """The process is shutting down and takes no new work; the caller reports it, never drops work silently."""


class SupervisorClosedError(ShuttingDownError):
    """Raised by ``spawn`` after shutdown began: the caller must report the failure, not drop the work."""


class TaskSupervisor:
    def __init__(self, name: str = "chatbridge") -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Start ``coro`` as a supervised task. Raises SupervisorClosedError once shutdown has begun."""
        if self._closed:
            coro.close()
            raise SupervisorClosedError(f"{self._name}: shutting down, cannot start {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s failed: %s", task.get_name(), exc, exc_info=exc)

    async def shutdown(self, timeout: float) -> list[str]:
        """Refuse new tasks, cancel the rest and wait at most ``timeout`` seconds.

        Returns the names of tasks that did not finish in time (they stay cancelled).
        """
        self._closed = True
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        stragglers = sorted(t.get_name() for t in pending)
        if stragglers:
            log.warning("%s: %d task(s) did not stop within %.1fs: %s", self._name, len(stragglers), timeout,
                        ", ".join(stragglers))
        return stragglers
