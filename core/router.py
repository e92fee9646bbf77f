"""IngressRouter: the front door of core. Accepts durably, works after.

A text message takes its place in its session's queue, then is stored (``Store.admit_inbound``: the message
and its dedupe mark in one transaction) before ``submit`` returns, so a channel acknowledges to its platform
only what a crash cannot lose; the session worker serves it in arrival order, and a restart resumes it.
Duplicates (by the envelope's event_id) are dropped; a full queue gets an immediate busy notice and marks
nothing, so the same message may be sent again. Commands run as their own supervised tasks so a slow one
never holds up another session, except ``/new``, which runs in its session's order and ends the
conversation for the messages still waiting before it. A message with attachments is never a command (a
photo captioned "/new" is a message, answered with its photo).

Storing a message, or recording a command's event and then starting the command, runs as a task of its own
that the caller only waits for: a channel that must answer its platform in time (Slack: 3 s) may stop waiting
on a slow disk, and what was recorded is then carried out all the same, since the platform's redelivery will
find it a duplicate. A redelivery that arrives while the first delivery is still being stored waits for that
one's outcome rather than competing with it (for a place in a full queue, say).

With several processes on one database (``core.failover``) a message is stored by whichever process
received it and served by the one holding its session's lease; ``/stop`` and ``/new`` for a session held
by another process are forwarded to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from enum import Enum

from core.delivery import PlainSender
from core.envelope import InboundEnvelope
from core.failover import SessionFailover
from core.failures import TurnFailurePresenter
from core.session import Admitted, Job, Place, SessionManager
from core.settings import CoreSettings
from core.store import InboundServedError, Store
from core.supervisor import ShuttingDownError, SupervisorClosedError, TaskSupervisor

log = logging.getLogger(__name__)

COMMANDS: dict[str, str] = {
    "stop": "stop the reply in progress",
    "new": "start a fresh conversation (earlier messages stay in the history)",
    "help": "list the commands",
    "compact": "summarize the conversation so far to free the model's context",
}

_COMMAND_RE = re.compile(r"^/([A-Za-z][A-Za-z0-9_]*)(?:@\S+)?\s*$")


def parse_command(text: str) -> str | None:
    """The command name of a message that is exactly one known command (``/stop``, ``/stop@bot``)."""
    m = _COMMAND_RE.match(text.strip())
    if m and m.group(1).lower() in COMMANDS:
        return m.group(1).lower()
    return None


class SubmitResult(Enum):
    QUEUED = "queued"
    BUSY = "busy"
    DUPLICATE = "duplicate"
    COMMAND = "command"


class RouterClosedError(ShuttingDownError):
    """The router no longer accepts input (shutting down). Channels tell the sender."""


class AdmissionError(RuntimeError):
    """The message could not be stored, so it was not accepted and nothing marks it as seen. A channel
    must not acknowledge it to its platform (keep the polling offset, answer a webhook with a non-2xx
    status), so that it is delivered again, or must tell the sender to send it again."""


Outcome = SubmitResult | AdmissionError | ShuttingDownError
"""What an admission task ends with: ``submit``'s result, or the error it raises."""


class IngressRouter:
    def __init__(self, *, store: Store, sessions: SessionManager, plain: PlainSender,
                 presenter: TurnFailurePresenter, supervisor: TaskSupervisor, settings: CoreSettings,
                 new_context: Callable[[str, Sequence[int], float, int | None], Awaitable[None]],
                 compact: Callable[[str], Awaitable[str]] | None = None,
                 failover: SessionFailover | None = None) -> None:
        self._store = store
        self._sessions = sessions
        self._plain = plain
        self._presenter = presenter
        self._supervisor = supervisor
        self._settings = settings
        self._new_context = new_context
        """``/new``: (session key, the waiting inbound messages it ends, when ``/new`` was received, the
        stored ``/new`` it carries out or None); raises InboundServedError when that was carried out already."""
        self._compact = compact
        self._failover = failover
        self._closed = False
        self._pending: dict[tuple[str, str], asyncio.Task[Outcome]] = {}
        """The admissions under way, by (channel, event_id): a redelivery meanwhile waits for its outcome."""
        self._admitting = 0
        self._admitted = asyncio.Event()
        self._admitted.set()

    def close(self) -> None:
        self._closed = True

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for messages being stored when input closed: each then ends accepted
        or refused, never half-way with the store gone."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._admitted.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    async def submit(self, envelope: InboundEnvelope) -> SubmitResult:
        """Hand one inbound message to core; returns only once the outcome is final:

        - QUEUED: the message is durably stored with its dedupe mark and will be answered (after a crash
          too: the next start resumes it);
        - DUPLICATE: its event_id was seen before; nothing changed;
        - BUSY: its session's queue is full; the sender is told, and nothing marks the message as seen;
        - COMMAND: a command was started (commands are not resumed after a crash).

        Raises RouterClosedError while shutting down and AdmissionError when the message could not be
        stored; in both cases nothing marks it as seen and the channel must not acknowledge it. A caller
        cancelled while the message is being stored does not cut the storing short: once stored, the message
        is queued and answered; once a command's event is recorded, the command is carried out (a redelivery
        then finds either a duplicate). A delivery of an event whose first delivery is still being stored
        waits for that: DUPLICATE once it is stored, or taken as a new message when storing it failed."""
        if self._closed:
            raise RouterClosedError("chatbridge is shutting down and accepts no new messages")
        if await self._stored_meanwhile(envelope):
            return SubmitResult.DUPLICATE
        try:
            # a message with attachments is never a command: "/new" as a photo's caption would lose the photo
            command = parse_command(envelope.content) if not envelope.media else None
            if command is not None:
                if envelope.event_id is None:  # nothing to record first, so nothing a caller's cancellation cuts
                    return self._start_command(command, envelope)
                admission = self._supervisor.spawn(f"admit:{command}:{envelope.key()}",
                                                   self._admit_command(command, envelope))
            else:
                place = self._sessions.reserve(envelope.key())
                if place is None:
                    return await self._busy(envelope)
                try:
                    admission = self._supervisor.spawn(f"admit:{envelope.key()}", self._admit(envelope, place))
                except SupervisorClosedError:
                    place.give_back()
                    raise
        except SupervisorClosedError as exc:
            raise RouterClosedError("chatbridge is shutting down and accepts no new messages") from exc
        self._track(envelope, admission)
        # The caller may give up waiting (a channel that must answer its platform in time): the admission
        # goes on and settles the message's place itself, so a message that gets stored is also served, and
        # a command whose event is recorded is also carried out.
        result = await asyncio.shield(admission)
        if isinstance(result, Exception):
            raise result
        return result

    async def _stored_meanwhile(self, envelope: InboundEnvelope) -> bool:
        """Whether a delivery of the same event, being stored when this one came, got stored (or its command
        started). A redelivery must not compete with it: for a place in a full queue it would be told busy,
        and sent again by the user, though the first delivery is answered. One that failed to store marks
        nothing, so this delivery is then taken as a new message."""
        if envelope.event_id is None:
            return False
        event = (envelope.channel, envelope.event_id)
        while (pending := self._pending.get(event)) is not None:
            try:
                result = await asyncio.shield(pending)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if pending.cancelled() and current is not None and not current.cancelling():
                    # the admission was cancelled at shutdown, this caller was not
                    raise RouterClosedError("chatbridge is shutting down and accepts no new messages") from None
                raise
            if not isinstance(result, Exception):
                return True
            if self._pending.get(event) is pending:
                del self._pending[event]
        return False

    def _track(self, envelope: InboundEnvelope, admission: asyncio.Task[Outcome]) -> None:
        if envelope.event_id is None:
            return
        event = (envelope.channel, envelope.event_id)
        self._pending[event] = admission

        def forget(task: asyncio.Task[Outcome]) -> None:
            if self._pending.get(event) is task:
                del self._pending[event]

        admission.add_done_callback(forget)

    @contextlib.contextmanager
    def _storing(self) -> Iterator[None]:
        """An admission under way, for ``drain``."""
        self._admitting += 1
        self._admitted.clear()
        try:
            yield
        finally:
            self._admitting -= 1
            if not self._admitting:
                self._admitted.set()

    async def _admit(self, envelope: InboundEnvelope, place: Place) -> Outcome:
        """Store the message and settle its place, as one step: a message stored is queued (its place
        filled), one not stored gives its place back. Runs as a task of its own, so a caller cancelled
        while the message is being stored cannot leave it stored but unserved until the next start."""
        try:
            with self._storing():
                inbound = await self._store.admit_inbound(envelope.channel, envelope.event_id,
                                                          envelope.model_dump_json(),
                                                          ttl_seconds=self._settings.dedupe_ttl_seconds,
                                                          key=envelope.key())
        except Exception as exc:
            place.give_back()
            log.error("storing an inbound message of %s failed: %s", envelope.key(), exc)
            error = AdmissionError("the message could not be stored")
            error.__cause__ = exc
            return error
        except BaseException:
            place.give_back()  # cancelled at shutdown: a write already on its way is answered at the next start
            raise
        if inbound is None:
            place.give_back()
            return SubmitResult.DUPLICATE
        place.fill(envelope, inbound)
        return SubmitResult.QUEUED

    async def _busy(self, envelope: InboundEnvelope) -> SubmitResult:
        if envelope.event_id is not None:
            try:
                if await self._store.event_seen(envelope.channel, envelope.event_id):
                    return SubmitResult.DUPLICATE  # a redelivery of a message that is queued already
            except Exception as exc:
                log.warning("dedupe check failed for %s/%s: %s", envelope.channel, envelope.event_id, exc)
        self._supervisor.spawn(f"busy:{envelope.key()}", self._plain.send(
            envelope.target(), self._presenter.busy(self._settings.queue_capacity)))
        return SubmitResult.BUSY

    async def _admit_command(self, command: str, envelope: InboundEnvelope) -> Outcome:
        """Record the command's event, then start the command, as one step. Runs as a task of its own: a
        caller cancelled once the record had landed would otherwise leave the command recorded but never
        carried out, and the platform's redelivery, finding it recorded, dropped: a /stop lost while the
        reply goes on."""
        with self._storing():
            first = await self._first_delivery(envelope)
        if not first:
            return SubmitResult.DUPLICATE
        try:
            return self._start_command(command, envelope)
        except SupervisorClosedError as exc:
            error = RouterClosedError("chatbridge is shutting down and accepts no new messages")
            error.__cause__ = exc
            return error

    def _start_command(self, command: str, envelope: InboundEnvelope) -> SubmitResult:
        """Raises SupervisorClosedError when shutting down."""
        if command == "new":
            self.new_here(envelope)
        else:
            self._supervisor.spawn(f"command:{command}:{envelope.key()}", self._command(command, envelope))
        return SubmitResult.COMMAND

    def new_here(self, envelope: InboundEnvelope) -> None:
        """``/new``: stop the reply being written; the context starts afresh once that turn has ended, in the
        session's order, and the messages still waiting before /new are not answered. When another process
        holds the session, it goes there."""
        key = envelope.key()
        self._sessions.cancel_running(key)
        forward = functools.partial(self._failover.forward_new, envelope) if self._failover is not None else None
        self._sessions.schedule(key, "new", functools.partial(self._new_conversation, envelope),
                                take_waiting=True, forward=forward, sent_at=envelope.received_at)

    async def stop_here(self, envelope: InboundEnvelope) -> None:
        """``/stop`` for a session this process serves."""
        if not await self._sessions.stop(envelope.key()):
            await self._plain.send(envelope.target(), self._presenter.nothing_to_stop())
        # else: the stopped turn's own terminal message says so (never two terminal messages)

    async def _first_delivery(self, envelope: InboundEnvelope) -> bool:
        assert envelope.event_id is not None
        try:
            return await self._store.mark_event_processed(envelope.channel, envelope.event_id,
                                                          ttl_seconds=self._settings.dedupe_ttl_seconds)
        except Exception as exc:
            # Better a possible duplicate than a lost command.
            log.error("dedupe check failed for %s/%s: %s", envelope.channel, envelope.event_id, exc)
            return True

    def stored_job(self, command: str, envelope: InboundEnvelope, seq: int) -> Job | None:
        """The job of a command another process stored for this session (``SessionFailover.forward_new``):
        a ``/new`` whose record ``seq`` is finished with the context reset; None for any other."""
        if command != "new":
            return None
        return functools.partial(self._new_conversation, envelope, record=seq)

    async def _new_conversation(self, envelope: InboundEnvelope, dropped: Sequence[Admitted], *,
                                record: int | None = None) -> None:
        try:
            await self._new_context(envelope.key(), [inbound for _, inbound in dropped], envelope.received_at,
                                     record)
        except InboundServedError:  # a stored /new both holders read as waiting (core.executor): told once
            log.warning("a /new in %s was carried out by another process; nothing to do here", envelope.key())
            return
        await self._plain.send(envelope.target(), self._presenter.new_context(unanswered=len(dropped)))

    async def _command(self, command: str, envelope: InboundEnvelope) -> None:
        target = envelope.target()
        if command == "stop":
            if self._failover is not None and not self._sessions.holds(envelope.key()) \
                    and await self._failover.forward_stop(envelope.key(), envelope):
                return  # the holder stops it, or says there is nothing to stop
            await self.stop_here(envelope)
        elif command == "compact" and self._compact is not None:
            await self._plain.send(target, await self._compact(envelope.key()))
        elif command == "help":
            await self._plain.send(target, self._presenter.help(COMMANDS))
