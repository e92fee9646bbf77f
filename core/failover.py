"""SessionFailover: several processes on one database serve each session in exactly one of them.

``core.leases`` says which process runs a session's worker; this module is what the processes do about it
(with ``LocalLeases`` — one process per database — none of it runs, and start-up stays as it was):

- **Heartbeat**: every held lease is renewed every ``ttl / 3`` in one statement; when renewals fail, one
  more beat comes at the first lease's deadline. A session whose lease was lost (``core.leases`` says
  exactly when) abandons its running turn and starts nothing more (``SessionManager.lost``); the new
  holder closes that turn with its interrupted notice. The turn record is the fence: a commit that finds
  it closed by the new holder writes nothing (``Store.commit_turn``), and a takeover finds nothing to close
  when the old holder's commit came first, so a chat sees one terminal outcome either way. The process's
  own liveness (``core.processes``) is one of these leases, taken again when it was lost.
- **Takeover** (``take``, called by a worker that was just granted a lease): a turn still recorded as
  running for that session belonged to a holder that died or lost the lease (and abandoned the turn): it
  is closed as interrupted and its notice sent — by the one process holding the lease, so once. The turns
  of its subagents (child sessions, which ran inside it) are closed with it, each with the notice in its
  own history (the chat is told once, for the parent). The session's undelivered turns are sent again,
  but only those that ended more than ``settle`` seconds ago: until then the process that ran the turn may
  still be retrying it (``core.redelivery``).
- **Waiting messages** (``waiting``): the session's stored messages, whichever process admitted them;
  one too old to answer gets its notice instead, in the session's order.
- **Signals** over the cluster bus (``core.bus``): ``/stop`` and ``/new`` sent to a process
  that does not hold the session are forwarded to the holder (``session.stop``, ``session.new``). Messages
  need no signal: a holder reads the store after each turn and once more after releasing its lease.
  A forwarded command is durable: it is stored with the session's messages first (``StoredCommand``), and
  the signal only tells the holder to act on it now. A signal can be missed (the bus says so afterwards,
  ``ClusterBus.on_gap``: notes sent while the holder's listening connection was down are gone), so after a
  gap the holder reads the commands stored for the sessions it serves and acts on them as on their
  signals: a ``/stop`` sent then still stops the reply being written. (The other way, the sender repeating
  the signal until the holder acknowledges it, would need the very channel that failed, for as long as
  it fails; the stored command also reaches a holder that lets the session go or dies before it heard.)

  - A stored ``/stop`` is carried out once, by whoever finishes its record (``Store.finish_inbound``): the
    holder on its signal or after a gap, stopping the running turn; else the session's next reader between
    turns (``waiting``: the turn it was sent for has ended), answering that nothing runs.
  - A stored ``/new`` comes back from ``waiting`` as a job in its place, taking the messages before it;
    its signal (or a gap) only makes the holder stop the reply being written and read the store. A holder
    that dies as the signal is sent leaves it to the process that takes the session over, which applies
    it in order. It is carried out once: ``Store.new_context`` takes it only while it still waits
    (``InboundServedError``), like a message.
- **Sweeper**: every ``ttl / 2`` the sessions with work (waiting messages, a turn left running — its own or a
  subagent's) and no live lease are woken here; whichever process gets the lease takes them over. That is what
  moves a dead holder's sessions; at start-up it runs at once, instead of the recovery of every session a
  single process does (which would close the turns other live processes are running). A turn that only waits
  for its delivery does not wake its session (a platform that keeps refusing it would be tried every sweep):
  it is sent when its session is next taken over.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from core.agent.subagents import CHILD_MARK
from core.bus import ClusterBus
from core.envelope import InboundEnvelope
from core.leases import SessionLeases
from core.processes import Processes
from core.session import Job, SessionManager, StoredJob, Waiting
from core.settings import CoreSettings
from core.store import Store, TurnRecord, UndeliveredTurn
from core.supervisor import ShuttingDownError, TaskSupervisor

log = logging.getLogger(__name__)

STOP = "session.stop"
NEW = "session.new"

SEEN_NOTES = 1024
"""Note ids remembered, so a note delivered twice is acted on once."""

SWEEP_LIMIT = 100
"""Sessions woken per sweep; the next sweep takes the rest."""


class StoredCommand(BaseModel):
    """A command stored with a session's messages for the process that serves the session (a forwarded
    ``/stop`` or ``/new``). Its JSON is not an envelope's: a process that does not know it drops it as
    unreadable rather than answering it as a message."""

    model_config = ConfigDict(frozen=True)

    command: Literal["new", "stop"]
    envelope: InboundEnvelope | None
    """The command as received; None for a ``/stop`` that came without one (a web page's stop button)."""

    @classmethod
    def read(cls, payload: str) -> StoredCommand | None:
        try:
            return cls.model_validate_json(payload)
        except ValueError:
            return None


class Recovery(Protocol):
    """What ChatCore does for a session taken over (the same steps its start-up does for every session)."""

    async def interrupted(self, turn: TurnRecord) -> None: ...

    async def redeliver(self, item: UndeliveredTurn) -> None: ...

    async def too_old(self, envelope: InboundEnvelope, seq: int, age: float) -> None: ...

    async def stop_here(self, envelope: InboundEnvelope) -> None:
        """``/stop`` forwarded to this process (the holder)."""
        ...

    def stored_job(self, command: str, envelope: InboundEnvelope, seq: int) -> Job | None:
        """The job a stored command stands for (a forwarded ``/new``; it finishes record ``seq`` itself), or
        None when there is none."""
        ...


class SessionFailover:
    def __init__(self, *, store: Store, leases: SessionLeases, settings: CoreSettings, supervisor: TaskSupervisor,
                 recovery: Recovery, bus: ClusterBus | None = None, processes: Processes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._leases = leases
        self._settings = settings
        self._supervisor = supervisor
        self._recovery = recovery
        self._bus = bus
        self._processes = processes
        self._clock = clock
        self.sessions: SessionManager | None = None
        self._unsubscribe: list[Callable[[], None]] = []
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._taken: set[str] = set()
        """Sessions whose lease this process was granted (``take``) and may still hold: where a gap may have
        hidden a command (kept to those it holds at every heartbeat)."""
        self.settle = sum(settings.redelivery_delays) + 2 * leases.ttl
        """Seconds after its end before another process sends an undelivered turn again."""

    @property
    def shared(self) -> bool:
        return self._leases.shared

    def _manager(self) -> SessionManager:
        assert self.sessions is not None, "SessionFailover.sessions is set by ChatCore"
        return self.sessions

    async def start(self) -> None:
        """Subscribe to the signals, start the heartbeat and the sweeper (which sweeps at once)."""
        if self._bus is not None:
            self._unsubscribe = [self._bus.subscribe(STOP, self._on_stop),
                                 self._bus.subscribe(NEW, self._on_new),
                                 self._bus.on_gap(self._on_gap)]
        self._supervisor.spawn("leases:heartbeat", self._heartbeat())
        self._supervisor.spawn("leases:sweeper", self._sweeper())

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    # -- what a worker calls (core.session.Takeover)

    async def take(self, key: str) -> None:
        self._taken.add(key)
        # the session's own turn and its subagents' (they ran inside it, in the same process); the subagents'
        # notices first, so once the chat is told (the parent's notice) every child's history says so too
        closed = await self._store.close_interrupted_turns(key=key, prefix=key + CHILD_MARK)
        for turn in sorted(closed, key=lambda t: t.session_key == key):
            log.info("taking over %s: its turn %s was left running by a process that stopped", turn.session_key,
                     turn.turn_id)
            await self._recovery.interrupted(turn)
        now = self._clock()
        for item in await self._store.undelivered_turns(now - self._settings.resume_max_age, key=key,
                                                        ended_before=now - self.settle):
            await self._recovery.redeliver(item)

    async def waiting(self, key: str) -> list[Waiting]:
        now = self._clock()
        fresh: list[Waiting] = []
        for record in await self._store.waiting_inbound(key=key):
            try:
                envelope = InboundEnvelope.model_validate_json(record.payload)
            except ValueError:
                stored = StoredCommand.read(record.payload)
                if stored is not None and stored.command == "stop":
                    # read between turns: the turn it was sent for ended before the holder acted on it
                    await self._stop(key, record.seq, stored.envelope)
                    continue
                job = self._stored_job(stored, record.seq) if stored is not None else None
                if job is not None:  # a command is applied whatever its age: it answers nothing
                    fresh.append(job)
                    continue
                log.warning("inbound message %s is unreadable and is dropped", record.seq)
                await self._store.finish_inbound([record.seq])
                continue
            age = now - envelope.received_at
            if age <= self._settings.resume_max_age:
                fresh.append((envelope, record.seq))
            else:
                await self._recovery.too_old(envelope, record.seq, age)
        return fresh

    def _stored_job(self, stored: StoredCommand, seq: int) -> StoredJob | None:
        if stored.envelope is None:
            return None
        job = self._recovery.stored_job(stored.command, stored.envelope, seq)
        return StoredJob(stored.command, job, seq) if job is not None else None

    # -- commands sent to a process that does not hold the session

    async def forward_stop(self, key: str, envelope: InboundEnvelope | None = None) -> bool:
        """Stop ``key``'s turn in the live process that holds the session (True: sent there; the holder stops
        it, or answers ``envelope``'s chat that nothing runs); False when no other process holds it. The stop
        is stored with the session's messages first, then the holder is told (see the module docstring)."""
        if self._bus is None or not await self._leases.held_elsewhere(key):
            return False
        stored = StoredCommand(command="stop", envelope=envelope)
        channel = envelope.channel if envelope is not None else key.partition(":")[0]
        seq = await self._store.admit_inbound(channel, None, stored.model_dump_json(),
                                              ttl_seconds=self._settings.dedupe_ttl_seconds, key=key)
        await self._publish(STOP, key, envelope, seq)
        return True

    async def forward_new(self, envelope: InboundEnvelope) -> None:
        """``/new`` for a session another process holds (its worker was refused the lease here): stored with
        the session's messages, so whichever process serves the session next applies it in its place (the
        holder, or the one that takes over if the holder dies meanwhile), then the holder is told to stop
        the reply being written and read it."""
        stored = StoredCommand(command="new", envelope=envelope)
        await self._store.admit_inbound(envelope.channel, None, stored.model_dump_json(),
                                        ttl_seconds=self._settings.dedupe_ttl_seconds, key=envelope.key())
        if self._bus is not None:
            await self._publish(NEW, envelope.key(), None)

    async def _publish(self, topic: str, key: str, envelope: InboundEnvelope | None, seq: int | None = None) -> None:
        assert self._bus is not None
        note = {"id": uuid.uuid4().hex, "key": key,
                "envelope": envelope.model_dump_json() if envelope is not None else None, "seq": seq}
        await self._bus.publish(topic, json.dumps(note))

    # -- signals from the other processes (a note may come twice: its id is remembered)

    def _on_stop(self, payload: str) -> None:
        note = self._note(payload)
        if note is None:
            return
        key, envelope, seq = note
        if not self._manager().holds(key):
            return  # (the stored stop waits for the session's next reader)
        if seq is not None:
            self._spawn(f"command:stop:{key}", self._stop(key, seq, envelope))
        elif envelope is not None:  # (a process of an older version stored nothing)
            self._spawn(f"command:stop:{key}", self._recovery.stop_here(envelope))
        else:
            self._spawn(f"command:stop:{key}", self._manager().stop(key))

    def _on_new(self, payload: str) -> None:
        note = self._note(payload)
        if note is not None:
            self._new_waits(note[0])

    def _new_waits(self, key: str) -> None:
        if self._manager().holds(key):  # (else its lease is free: the store is read by whoever takes it)
            self._manager().cancel_running(key)
            self._wake(key)

    async def _stop(self, key: str, seq: int, envelope: InboundEnvelope | None) -> None:
        """Carry out the ``/stop`` stored as ``seq``, unless that was done already (its signal came twice, or
        after a gap, or the session's next reader took it first)."""
        if not await self._store.finish_inbound([seq]):
            return
        if envelope is not None:
            await self._recovery.stop_here(envelope)
        else:
            await self._manager().stop(key)

    def _on_gap(self) -> None:
        self._spawn("commands:after-gap", self._missed(sorted(self._taken)))

    async def _missed(self, keys: list[str]) -> None:
        """After a gap in the bus: act on the commands stored for the sessions served here, as their signals,
        which may have been missed, would have."""
        for key in keys:
            if not self._manager().holds(key):
                continue
            try:
                for record in await self._store.waiting_inbound(key=key):
                    stored = StoredCommand.read(record.payload)
                    if stored is None:
                        continue
                    if stored.command == "stop":
                        await self._stop(key, record.seq, stored.envelope)
                    else:
                        self._new_waits(key)
            except Exception as exc:  # the holder still reads the store after the turn
                log.warning("reading the commands stored for %s after a gap in the bus failed: %s", key, exc)

    def _note(self, payload: str) -> tuple[str, InboundEnvelope | None, int | None] | None:
        try:
            note = json.loads(payload)
            note_id, key, raw, seq = str(note["id"]), str(note["key"]), note["envelope"], note.get("seq")
            envelope = InboundEnvelope.model_validate_json(raw) if raw is not None else None
            seq = int(seq) if seq is not None else None
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("an unreadable session note was ignored")
            return None
        if note_id in self._seen:
            return None
        self._seen[note_id] = None
        while len(self._seen) > SEEN_NOTES:
            self._seen.popitem(last=False)
        return key, envelope, seq

    def _wake(self, key: str) -> None:
        try:
            self._manager().wake(key)
        except ShuttingDownError:
            pass

    def _spawn(self, name: str, work: Awaitable[object]) -> None:
        async def run() -> None:
            await work

        try:
            self._supervisor.spawn(name, run())
        except ShuttingDownError:
            pass

    # -- loops

    async def _heartbeat(self) -> None:
        while True:
            # a beat every ttl / 3, and one at the first lease's deadline when renewals keep failing: a lease
            # is lost then, and its turn must stop before another process may take the session over
            await asyncio.sleep(min(self._leases.ttl / 3, self._leases.remaining()))
            try:
                lost = await self._leases.renew()
            except Exception as exc:  # the next beat tries again; holds() says no once the ttl ran out
                log.warning("renewing the session leases failed: %s", exc)
                continue
            if lost:
                self._manager().lost(lost)
            self._taken = {key for key in self._taken if self._manager().holds(key)}
            if self._processes is not None:
                try:
                    await self._processes.renewed(lost)
                except Exception as exc:  # the next beat tries again
                    log.warning("taking this process's liveness again failed: %s", exc)

    async def _sweeper(self) -> None:
        while True:
            try:
                for key in await self._leases.orphans(limit=SWEEP_LIMIT):
                    self._wake(key)
            except Exception as exc:
                log.warning("looking for sessions without a holder failed: %s", exc)
            await asyncio.sleep(self._leases.ttl / 2)
