"""Session workers: one serial worker per active session, a bounded queue in front of it.

A message takes its place in its session's queue the moment it arrives (``reserve``), before it is stored:
the capacity check and the arrival order are settled without waiting, so two messages racing for the last
place cannot both get it, and a slow write never reorders a session. The place is filled once the message
is durably admitted (``Place.fill``), or given back when it was not (``Place.give_back``); the worker
waits for the place at the head of the queue, so messages are served strictly in arrival order.

Besides messages, the queue carries *jobs*: work that must happen in the session's order, such as ``/new``
(which also takes the places of the messages sent before it: they belong to the conversation it ends) or the
notice for a message too old to answer after a restart. A job another process stored with the session's
messages (a forwarded ``/new``, ``StoredJob``) is read back with them and queued in its place by inbound
seq.

A worker exists only while its session has work; after ``session_idle_seconds`` without any it exits, and
the session costs nothing but its database row. ``stop`` reaches the running turn directly, never through
the queue. At shutdown the running turns are stopped and nothing queued is answered: every queued message
is stored, and the next start resumes it.

A worker serves only while its process holds the session's lease (``core.leases``). With one process per
database (``LocalLeases``) that is always, at no cost. With several processes on one database the worker
first waits until the messages queued in it are stored, then takes the lease: granted, it first takes the
session over (``Takeover.take``: a turn a dead holder left running is closed with its notice, its
undelivered turns are sent) and reads the session's waiting messages from the store, whichever process
admitted them (``Takeover.waiting``); refused, it drops its queue (every message in it is stored): the
holder reads the store after each turn, and serves them. A holder with nothing left releases the lease at
once (so whichever process receives the next message serves it), then reads the store once more. Because a
message is stored before the lease is asked for, a message is never left waiting with nobody to serve it;
one read from the store and also queued here is served once (by its inbound seq). A worker whose lease was
lost (``SessionLeases.renew``) abandons its running turn (``CancelSignal.abandon``: it commits and delivers
nothing more, the next holder closes it with its notice) and starts nothing more. When that turn's first
write was already on its way, it may land after the new holder's takeover looked and before the new holder
serves the same message: the store serves a message once (``InboundServedError``), and the new holder, finding
it served, takes the session over again there, closing that turn with its notice in the message's place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from core.cancel_signal import CancelSignal
from core.context_cache import ContextCache
from core.envelope import InboundEnvelope
from core.executor import SERVED_ELSEWHERE, ConversationExecutor
from core.leases import LocalLeases, SessionLeases
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import TaskSupervisor

log = logging.getLogger(__name__)

Admitted = tuple[InboundEnvelope, int]
"""A message and its inbound seq (``Store.admit_inbound``)."""


class Place:
    """A message's place in its session's queue, reserved before the message is stored."""

    __slots__ = ("_admitted", "loaded")

    def __init__(self, *, loaded: bool = False) -> None:
        self._admitted: asyncio.Future[Admitted | None] = asyncio.get_running_loop().create_future()
        self.loaded = loaded
        """Read from the store (``refresh``) rather than queued by this process's router."""

    @property
    def pending(self) -> bool:
        """Not yet filled nor given back."""
        return not self._admitted.done()

    @property
    def given_back(self) -> bool:
        return self._admitted.done() and self._admitted.result() is None

    @property
    def filled(self) -> Admitted | None:
        return self._admitted.result() if self._admitted.done() else None

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


@dataclass(frozen=True, slots=True)
class StoredJob:
    """Ordered session work another process stored with the session's messages (a forwarded ``/new``): it
    runs in its place among them and takes the messages stored before it (``schedule(..., take_waiting)``),
    whichever process serves the session next."""

    name: str
    run: Job
    seq: int
    """Its inbound seq: its place in the session's order."""


Waiting = Admitted | StoredJob
"""What a session's stored queue holds, in order (``Takeover.waiting``)."""


@dataclass(slots=True)
class _Job:
    name: str
    run: Job
    taken: list[Place] = field(default_factory=list)
    forward: Callable[[], Awaitable[None]] | None = None
    """How the job reaches the session's holder when another process holds the lease (None: dropped)."""
    sent_at: float | None = None
    """With ``take_waiting``: messages other processes stored that were received before this are taken too."""


class Takeover(Protocol):
    """What a worker needs besides its queue when the lease is shared (``ChatCore`` provides it)."""

    async def take(self, key: str) -> None:
        """The lease was just granted: finish what a previous holder left (interrupted and undelivered turns)."""
        ...

    async def waiting(self, key: str) -> list[Waiting]:
        """The session's stored messages waiting for an answer and its stored jobs, in arrival order (others
        are dealt with)."""
        ...


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
    leased: bool = False
    refresh: bool = False
    """Read the session's waiting messages from the store before serving more (a shared lease only)."""
    taken: set[int] = field(default_factory=set)
    """Inbound seqs queued from the store or served: a message both read and queued here is served once."""

    def put(self, item: Place | _Job) -> None:
        self.items.append(item)
        self.wakeup.set()

    def waiting_places(self) -> int:
        """The places that hold, or may still hold, a message: one given back (a duplicate, a failed store)
        stays in the queue until the worker skips it, but takes no room (a platform redelivering a queued message
        during a long reply would otherwise fill the queue with nothing)."""
        return sum(1 for item in self.items if isinstance(item, Place) and not item.given_back)


class SessionManager:
    def __init__(self, store: Store, executor: ConversationExecutor, supervisor: TaskSupervisor,
                 settings: CoreSettings, *, leases: SessionLeases | None = None,
                 takeover: Takeover | None = None) -> None:
        self._store = store
        self._executor = executor
        self._supervisor = supervisor
        self._settings = settings
        self._leases: SessionLeases = leases or LocalLeases()
        self._takeover = takeover
        self._active: dict[str, _ActiveSession] = {}
        self._closing = False

    @property
    def active_count(self) -> int:
        """Sessions with a worker, idle ones included (a worker waits ``session_idle_seconds`` for more)."""
        return len(self._active)

    def busy_count(self) -> int:
        """Sessions with work (a turn or a job running, or messages waiting): the metrics' active sessions."""
        return sum(1 for s in self._active.values() if s.busy or s.waiting_places() or s.cancel is not None)

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

    def holds(self, key: str) -> bool:
        """Whether this process serves ``key`` now (its worker holds the session's lease)."""
        s = self._active.get(key)
        return bool(s and s.leased and self._leases.holds(key))

    def wake(self, key: str) -> None:
        """Stored messages may wait for ``key``: read them (when this process holds the lease, or can take it).

        Raises SupervisorClosedError when shutting down."""
        if self._closing:
            return
        session = self._session(key)
        session.refresh = True
        session.wakeup.set()

    def lost(self, keys: Sequence[str]) -> None:
        """The leases of ``keys`` are lost (``SessionLeases.renew``): their running turns are abandoned
        (they commit and deliver nothing more: the next holder closes each with its interrupted notice) and
        their workers start nothing more (the next holder finds the queued messages in the store)."""
        for key in keys:
            session = self._active.get(key)
            if session is not None:
                log.warning("lost the lease of %s; its turn and queued messages are left to the next holder", key)
                if session.cancel is not None:
                    session.cancel.abandon()
                session.items.clear()
                session.refresh = False
                session.wakeup.set()

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

    def schedule(self, key: str, name: str, job: Job, *, take_waiting: bool = False,
                 forward: Callable[[], Awaitable[None]] | None = None, sent_at: float | None = None) -> None:
        """Run ``job`` in ``key``'s order, after everything queued so far. With ``take_waiting`` the messages
        queued so far are taken out of the queue and handed to the job instead of being served (if the job
        fails, they are served after all); with a shared lease, the session's messages stored by other
        processes received before ``sent_at`` are read first and taken too. When another process holds the
        lease, ``forward`` is called instead (to reach the holder)."""
        session = self._session(key)
        if take_waiting and self._leases.shared:
            session.refresh = True
        taken: list[Place] = []
        if take_waiting:
            kept = [item for item in session.items if not isinstance(item, Place)]
            taken = [item for item in session.items if isinstance(item, Place)]
            session.items = collections.deque(kept)
        session.put(_Job(name, job, taken, forward, sent_at if take_waiting else None))

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
        shared = self._leases.shared
        try:
            while not self._closing:
                if not session.items and not session.refresh:
                    if shared:  # idle: the lease goes at once, so any process can serve what comes next
                        if not session.leased:
                            return  # no await between the check and the removal
                        await self._release(session)
                        continue
                    session.wakeup.clear()
                    try:
                        async with asyncio.timeout(self._settings.session_idle_seconds):  # no task per wait
                            await session.wakeup.wait()
                    except TimeoutError:
                        if not session.items:  # no await between this check and the removal
                            return
                    continue
                if not session.leased:
                    if not await self._take_lease(session):
                        return
                    continue
                if shared and not self._leases.holds(session.key):
                    return  # lost: what is queued is stored; the next holder serves it
                if session.refresh:
                    session.refresh = False
                    await self._refresh(session)
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
                    # messages stored by other processes meanwhile are read before the next one is served
                    session.refresh = shared
            if session.leased and (not shared or self._leases.holds(session.key)):
                await self._run_jobs_left(session)
        finally:
            if self._active.get(session.key) is session:
                del self._active[session.key]
            # Whatever is still queued (shutdown) is stored: the next start resumes it.

    async def _take_lease(self, session: _ActiveSession) -> bool:
        """Take the session's lease before serving it; False when another process holds it (the queue went
        to that process) or it could not be asked for (the queue stays stored for the sweeper)."""
        if not self._leases.shared:
            session.leased = True
            return True
        while any(isinstance(i, Place) and i.pending for i in session.items):
            for item in list(session.items):  # every message is stored before the lease is asked for
                if isinstance(item, Place):
                    await item.admitted()
        session.items = collections.deque(i for i in session.items if not isinstance(i, Place) or i.filled)
        if not session.items and not session.refresh:
            return True  # nothing to serve after all (duplicates): idle, unleased
        try:
            granted = await self._leases.acquire(session.key)
        except Exception as exc:
            log.warning("could not ask for the lease of %s: %s; its messages wait in the store", session.key, exc)
            granted = False
        if granted:
            session.leased = True
            session.refresh = True
            if self._takeover is not None:
                try:
                    await self._takeover.take(session.key)
                except Exception:
                    log.exception("taking over %s failed", session.key)
            return True
        # the holder reads the stored messages after its current turn, or this process after it releases
        forwards = [item.forward for item in session.items if isinstance(item, _Job) and item.forward is not None]
        session.items.clear()
        session.refresh = False
        try:
            for forward in forwards:
                await forward()
        except Exception as exc:
            log.warning("could not reach the holder of %s: %s", session.key, exc)
        return False

    async def _refresh(self, session: _ActiveSession) -> None:
        """Queue the session's stored messages not queued here yet, in arrival order."""
        if self._takeover is None:
            return
        try:
            waiting = await self._takeover.waiting(session.key)
        except Exception as exc:
            log.warning("reading the waiting messages of %s failed: %s", session.key, exc)
            return
        queued = {f[1] for i in session.items if isinstance(i, Place) and (f := i.filled) is not None}
        loaded: list[Place | StoredJob] = []
        for item in waiting:
            seq = item.seq if isinstance(item, StoredJob) else item[1]
            if seq in session.taken or seq in queued:
                continue
            session.taken.add(seq)
            if isinstance(item, StoredJob):
                loaded.append(item)
                continue
            place = Place(loaded=True)
            place.fill(*item)
            loaded.append(place)
        # a /new queued here takes those received before it: they belong to the conversation it ends
        job = next((i for i in session.items if isinstance(i, _Job) and i.sent_at is not None), None)
        for entry in loaded:
            if isinstance(entry, StoredJob):
                self._place_stored_job(session, entry)
                continue
            admitted = entry.filled
            if job is not None and job.sent_at is not None and admitted is not None \
                    and admitted[0].received_at <= job.sent_at:
                job.taken.append(entry)
            else:
                session.items.append(entry)

    @staticmethod
    def _place_stored_job(session: _ActiveSession, stored: StoredJob) -> None:
        """Queue a stored job in its place by inbound seq: it takes the stored messages before it (they
        belong to the conversation a /new ends) and runs before those after it."""
        def before(item: Place | _Job) -> bool:
            return isinstance(item, Place) and (f := item.filled) is not None and f[1] < stored.seq

        taken = [item for item in session.items if isinstance(item, Place) and before(item)]
        kept = [item for item in session.items if not before(item)]
        at = next((i for i, item in enumerate(kept) if isinstance(item, Place)), len(kept))
        kept.insert(at, _Job(stored.name, stored.run, taken))
        session.items = collections.deque(kept)

    async def _release(self, session: _ActiveSession) -> None:
        """Give the lease back (the worker's own step, so it never races the next ``acquire`` here), then
        read the store once more: a message stored while this process held the lease was refused the lease
        in its own process and waits for this one."""
        session.leased = False
        try:
            await self._leases.release(session.key)
            # (one this worker took already stays taken: a message whose turn failed to begin is not tried
            # again and again here; the sweeper wakes its session anew)
            if any(r.seq not in session.taken for r in await self._store.waiting_inbound(key=session.key)):
                session.refresh = True
        except Exception as exc:  # the lease runs out by itself; the sweeper finds what waits
            log.warning("releasing the lease of %s failed: %s", session.key, exc)

    async def _serve(self, session: _ActiveSession, place: Place) -> None:
        admitted = await place.admitted()
        if admitted is None or self._closing:
            return
        envelope, inbound = admitted
        if self._leases.shared and not place.loaded:  # (SQLite may number a later message like a served one)
            if inbound in session.taken:
                return  # read from the store and queued already
            session.taken.add(inbound)
        session.cancel = CancelSignal()
        try:
            ended = await self._executor.execute(envelope, session.cancel, session.context, inbound=inbound)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("turn in %s failed unexpectedly", session.key)
            return
        finally:
            session.cancel = None
        if ended == SERVED_ELSEWHERE and self._takeover is not None and self._leases.holds(session.key):
            # served by the turn of the process this one took the session over from, which wrote it after
            # this one's takeover looked: that turn was left running there, so it is closed now, with its
            # notice, in the message's place (not once this process lets the session go)
            try:
                await self._takeover.take(session.key)
            except Exception:
                log.exception("taking over %s failed", session.key)

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

    async def _run_jobs_left(self, session: _ActiveSession) -> None:
        """Shutdown: the jobs still queued (a ``/new`` waiting for the reply it stopped, a too-old notice) answer
        what a user already sent and are short: they are carried out now, within the shutdown's bound (a
        ``/new`` is not stored: left, it would be lost). The messages still queued stay stored."""
        jobs = [item for item in session.items if isinstance(item, _Job)]
        session.items = collections.deque(item for item in session.items if not isinstance(item, _Job))
        for job in jobs:
            session.busy = True
            try:
                await self._run_job(session, job)
            finally:
                session.busy = False

    def stop_starting(self) -> None:
        """Shutdown begins: start no new turn, while the running ones go on. Whatever is queued stays stored
        (the next start resumes it); a worker ends once its current item and the jobs queued are done."""
        self._closing = True
        for session in self._active.values():
            session.wakeup.set()  # an idle worker ends now rather than at its idle timeout

    async def shutdown(self, timeout: float) -> None:
        """Stop running turns (their terminal state is delivered once) and wait at most ``timeout`` for the
        workers. Queued messages stay stored for the next start."""
        self._closing = True
        workers = []
        for session in list(self._active.values()):
            if session.cancel is not None:
                session.cancel.shutdown()
            elif session.worker is not None:
                session.worker.cancel()  # idle, or waiting for a place or a job: nothing to finish
            if session.worker is not None:
                workers.append(session.worker)
        if workers:
            await asyncio.wait(workers, timeout=timeout)
