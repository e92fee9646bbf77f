"""Session workers: one serial worker per active session, a bounded queue in front of it.

A worker exists only while its session has work; after ``session_idle_seconds`` without any it exits,
and the session costs nothing but its database row. ``stop`` reaches the running turn directly,
never through the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from core.cancel_signal import CancelSignal
from core.context_cache import ContextCache
from core.envelope import InboundEnvelope
from core.executor import ConversationExecutor
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import TaskSupervisor

log = logging.getLogger(__name__)


class Admission(Enum):
    QUEUED = "queued"
    BUSY = "busy"


@dataclass(slots=True)
class _ActiveSession:
    key: str
    queue: asyncio.Queue[InboundEnvelope]
    context: ContextCache
    """The session's context between its turns; goes when the worker does."""
    cancel: CancelSignal | None = None
    """Cancel signal of the turn being executed, if any."""
    worker: asyncio.Task[None] | None = None


class SessionManager:
    def __init__(self, store: Store, executor: ConversationExecutor, supervisor: TaskSupervisor,
                 settings: CoreSettings,
                 on_unserved: Callable[[InboundEnvelope], Awaitable[None]] | None = None) -> None:
        self._store = store
        self._executor = executor
        self._supervisor = supervisor
        self._settings = settings
        self._active: dict[str, _ActiveSession] = {}
        self._on_unserved = on_unserved
        self._closing = False

    @property
    def active_count(self) -> int:
        return len(self._active)

    def idle(self) -> bool:
        """True when no session has a running turn or a queued message."""
        return all(s.cancel is None and s.queue.empty() for s in self._active.values())

    def is_running(self, key: str) -> bool:
        s = self._active.get(key)
        return bool(s and s.cancel is not None)

    def enqueue(self, envelope: InboundEnvelope) -> Admission:
        """Queue a message for its session, starting the worker if needed. Never blocks.

        Raises SupervisorClosedError when shutting down (the caller reports it)."""
        key = envelope.key()
        session = self._active.get(key)
        if session is None:
            session = _ActiveSession(key, asyncio.Queue(maxsize=self._settings.queue_capacity),
                                     ContextCache(self._settings.history_limit))
            session.worker = self._supervisor.spawn(f"session:{key}", self._work(session))
            self._active[key] = session
        try:
            session.queue.put_nowait(envelope)
        except asyncio.QueueFull:
            return Admission.BUSY
        return Admission.QUEUED

    async def stop(self, key: str) -> bool:
        """Cancel the running turn of ``key`` (generation bump first, so nothing stale commits).
        Returns False when nothing was running."""
        session = self._active.get(key)
        if session is None or session.cancel is None:
            return False
        cancel = session.cancel
        await self._store.bump_generation(key)
        cancel.set()
        return True

    async def _work(self, session: _ActiveSession) -> None:
        try:
            while not self._closing:
                try:
                    async with asyncio.timeout(self._settings.session_idle_seconds):  # no task per message
                        envelope = await session.queue.get()
                except TimeoutError:
                    if session.queue.empty():  # no await between this check and the removal
                        return
                    continue
                if self._closing:
                    await self._unserved(envelope)
                    break
                session.cancel = CancelSignal()
                try:
                    await self._executor.execute(envelope, session.cancel, session.context)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("turn in %s failed unexpectedly", session.key)
                finally:
                    session.cancel = None
        finally:
            if self._active.get(session.key) is session:
                del self._active[session.key]
            # Anything still queued when the worker ends (shutdown) is answered, never dropped silently.
            while not session.queue.empty():
                leftover = session.queue.get_nowait()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._unserved(leftover), 5)

    async def _unserved(self, envelope: InboundEnvelope) -> None:
        if self._on_unserved is not None:
            await self._on_unserved(envelope)

    async def shutdown(self, timeout: float) -> None:
        """Stop running turns (their terminal state is delivered once), answer queued messages with a
        restart notice, and wait at most ``timeout`` for the workers."""
        self._closing = True
        workers = []
        for session in list(self._active.values()):
            if session.cancel is not None:
                session.cancel.set()
            if session.worker is not None:
                workers.append(session.worker)
        # Idle workers exit now rather than after their idle timeout.
        for session in list(self._active.values()):
            if session.cancel is None and session.queue.empty() and session.worker is not None:
                session.worker.cancel()
        if workers:
            await asyncio.wait(workers, timeout=timeout)
