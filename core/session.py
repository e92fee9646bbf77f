"""Session workers: one serial worker per active session, a bounded queue in front of it.

A message takes its place in its session's queue the moment it arrives (``reserve``), before it is stored:
the capacity check and the arrival order are settled without waiting, so two messages racing for the last
place cannot both get it, and a slow write never reorders a session. The place is filled once the message
is durably admitted (``Place.fill``), or given back when it was not (``Place.give_back``); the worker
waits for the place at the head of the queue, so messages are served strictly in arrival order.

Besides messages, the queue carries *jobs*: work that must happen in the session's order, such as ``/new``
(which also takes the places of the messages sent before it: they belong to the conversation it ends) or the
notice for a message too old to answer after a restart.

A worker exists only while its session has work; after ``session_idle_seconds`` without any it exits, and
the session costs nothing but its database row. ``stop`` reaches the running turn directly, never through
the queue. At shutdown the running turns are stopped and nothing queued is answered: every queued message
is stored, and the next start resumes it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from core.cancel_signal import CancelSignal
from core.context_cache import ContextCache
from core.envelope import InboundEnvelope
from core.executor import ConversationExecutor
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import TaskSupervisor

log = logging.getLogger(__name__)

Admitted = tuple[InboundEnvelope, int]
"""A message and its inbound seq (``Store.admit_inbound``)."""


class Place:
    """A message's place in its session's queue, reserved before the message is stored."""

    __slots__ = ("_admitted",)

    def __init__(self) -> None:
        self._admitted: asyncio.Future[Admitted | None] = asyncio.get_running_loop().create_future()

    def fill(self, envelope: InboundEnvelope, inbound: int) -> None:
        """The message is durably admitted as ``inbound``: it will be served in this place."""
        if not self._admitted.done():
            self._admitted.set_result((envelope, inbound))

    def give_back(self) -> None:
        """The message was not admitted (a duplicate, or storing it failed): the place is skipped."""
        if not self._admitted.done():
            self._admitted.set_result(None)

    async def admitted(self) -> Admitted | None:
        return await self._admitted


Job = Callable[[Sequence[Admitted]], Awaitable[None]]
"""Ordered session work; it receives the messages it took over (``schedule(..., take_waiting=True)``)."""


@dataclass(slots=True)
class _Job:
    name: str
    run: Job
    taken: list[Place] = field(default_factory=list)


@dataclass(slots=True)
class _ActiveSession:
    key: str
    context: ContextCache
    """The session's context between its turns; goes when the worker does."""
    items: collections.deque[Place | _Job] = field(default_factory=collections.deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    busy: bool = False
    """The worker is handling an item (waiting for a place to fill, a turn, a job)."""
    cancel: CancelSignal | None = None
    """Cancel signal of the turn being executed, if any."""
    worker: asyncio.Task[None] | None = None

    def put(self, item: Place | _Job) -> None:
        self.items.append(item)
        self.wakeup.set()

    def waiting_places(self) -> int:
        return sum(1 for item in self.items if isinstance(item, Place))


class SessionManager:
    def __init__(self, store: Store, executor: ConversationExecutor, supervisor: TaskSupervisor,
                 settings: CoreSettings) -> None:
        self._store = store
        self._executor = executor
        self._supervisor = supervisor
        self._settings = settings
        self._active: dict[str, _ActiveSession] = {}
        self._closing = False

    @property
    def active_count(self) -> int:
        return len(self._active)

    def queued_count(self) -> int:
        """Accepted messages waiting for their session's worker (for the metrics)."""
        return sum(s.waiting_places() for s in self._active.values())

    def running_count(self) -> int:
        """Turns being answered now (for the metrics)."""
        return sum(1 for s in self._active.values() if s.cancel is not None)

    def idle(self) -> bool:
        """True when no session has a running turn, a queued message or a job."""
        return all(not s.busy and not s.items for s in self._active.values())

    def is_running(self, key: str) -> bool:
        s = self._active.get(key)
        return bool(s and s.cancel is not None)

    def reserve(self, key: str) -> Place | None:
        """A place at the end of ``key``'s queue, or None when the queue is full. Never blocks.

        Raises SupervisorClosedError when shutting down (the caller reports it)."""
        session = self._session(key)
        if session.waiting_places() >= self._settings.queue_capacity:
            return None
        place = Place()
        session.put(place)
        return place

    def resume(self, envelope: InboundEnvelope, inbound: int) -> None:
        """Queue a message admitted before a restart (start-up only: it is queued even beyond capacity, so
        nothing stored is refused)."""
        place = Place()
        place.fill(envelope, inbound)
        self._session(envelope.key()).put(place)

    def schedule(self, key: str, name: str, job: Job, *, take_waiting: bool = False) -> None:
        """Run ``job`` in ``key``'s order, after everything queued so far. With ``take_waiting`` the messages
        queued so far are taken out of the queue and handed to the job instead of being served (if the job
        fails, they are served after all)."""
        session = self._session(key)
        taken: list[Place] = []
        if take_waiting:
            kept = [item for item in session.items if not isinstance(item, Place)]
            taken = [item for item in session.items if isinstance(item, Place)]
            session.items = collections.deque(kept)
        session.put(_Job(name, job, taken))

    def cancel_running(self, key: str) -> None:
        """Signal the running turn of ``key`` to stop, without a generation bump (``stop`` bumps first)."""
        session = self._active.get(key)
        if session is not None and session.cancel is not None:
            session.cancel.set()

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

    def _session(self, key: str) -> _ActiveSession:
        session = self._active.get(key)
        if session is None:
            session = _ActiveSession(key, ContextCache(self._settings.history_limit))
            session.worker = self._supervisor.spawn(f"session:{key}", self._work(session))
            self._active[key] = session
        return session

    async def _work(self, session: _ActiveSession) -> None:
        try:
            while not self._closing:
                if not session.items:
                    session.wakeup.clear()
                    try:
                        async with asyncio.timeout(self._settings.session_idle_seconds):  # no task per wait
                            await session.wakeup.wait()
                    except TimeoutError:
                        if not session.items:  # no await between this check and the removal
                            return
                    continue
                item = session.items.popleft()
                session.busy = True
                try:
                    if isinstance(item, Place):
                        await self._serve(session, item)
                    else:
                        await self._run_job(session, item)
                finally:
                    session.busy = False
        finally:
            if self._active.get(session.key) is session:
                del self._active[session.key]
            # Whatever is still queued (shutdown) is stored: the next start resumes it.

    async def _serve(self, session: _ActiveSession, place: Place) -> None:
        admitted = await place.admitted()
        if admitted is None or self._closing:
            return
        envelope, inbound = admitted
        session.cancel = CancelSignal()
        try:
            await self._executor.execute(envelope, session.cancel, session.context, inbound=inbound)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("turn in %s failed unexpectedly", session.key)
        finally:
            session.cancel = None

    async def _run_job(self, session: _ActiveSession, job: _Job) -> None:
        taken = [admitted for place in job.taken if (admitted := await place.admitted()) is not None]
        try:
            await job.run(taken)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s in %s failed", job.name, session.key)
            # the messages it took were not dealt with: they are served after all, first
            refill = []
            for envelope, inbound in taken:
                place = Place()
                place.fill(envelope, inbound)
                refill.append(place)
            session.items.extendleft(reversed(refill))

    async def shutdown(self, timeout: float) -> None:
        """Stop running turns (their terminal state is delivered once) and wait at most ``timeout`` for the
        workers. Queued messages stay stored for the next start."""
        self._closing = True
        workers = []
        for session in list(self._active.values()):
            if session.cancel is not None:
                session.cancel.set()
            elif session.worker is not None:
                session.worker.cancel()  # idle, or waiting for a place or a job: nothing to finish
            if session.worker is not None:
                workers.append(session.worker)
        if workers:
            await asyncio.wait(workers, timeout=timeout)
