"""IngressRouter: the front door of core. Acks fast, works after.

Duplicates (by the envelope's event_id, recorded durably) are dropped; commands run as their own
supervised tasks so a slow one never holds up another session; text goes to its session's queue, and a
full queue gets an immediate busy notice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from enum import Enum

from core.delivery import PlainSender
from core.envelope import InboundEnvelope
from core.failures import TurnFailurePresenter
from core.session import Admission, SessionManager
from core.settings import CoreSettings
from core.store import Store
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


class IngressRouter:
    def __init__(self, *, store: Store, sessions: SessionManager, plain: PlainSender,
                 presenter: TurnFailurePresenter, supervisor: TaskSupervisor, settings: CoreSettings,
                 new_context: Callable[[str], Awaitable[None]],
                 compact: Callable[[str], Awaitable[str]] | None = None) -> None:
        self._store = store
        self._sessions = sessions
        self._plain = plain
        self._presenter = presenter
        self._supervisor = supervisor
        self._settings = settings
        self._new_context = new_context
        self._compact = compact
        self._closed = False

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    async def submit(self, envelope: InboundEnvelope) -> SubmitResult:
        if self._closed:
            raise RouterClosedError("chatbridge is shutting down and accepts no new messages")
        if envelope.event_id is not None and not await self._first_delivery(envelope):
            return SubmitResult.DUPLICATE
        try:
            command = parse_command(envelope.content)
            if command is not None:
                self._supervisor.spawn(f"command:{command}:{envelope.key()}", self._command(command, envelope))
                return SubmitResult.COMMAND
            if self._sessions.enqueue(envelope) is Admission.BUSY:
                self._supervisor.spawn(f"busy:{envelope.key()}", self._plain.send(
                    envelope.target(), self._presenter.busy(self._settings.queue_capacity)))
                return SubmitResult.BUSY
            return SubmitResult.QUEUED
        except SupervisorClosedError as exc:
            raise RouterClosedError("chatbridge is shutting down and accepts no new messages") from exc

    async def _first_delivery(self, envelope: InboundEnvelope) -> bool:
        assert envelope.event_id is not None
        try:
            return await self._store.mark_event_processed(envelope.channel, envelope.event_id,
                                                          ttl_seconds=self._settings.dedupe_ttl_seconds)
        except Exception as exc:
            # Better a possible duplicate than a lost message.
            log.error("dedupe check failed for %s/%s: %s", envelope.channel, envelope.event_id, exc)
            return True

    async def _command(self, command: str, envelope: InboundEnvelope) -> None:
        key = envelope.key()
        target = envelope.target()
        if command == "stop":
            if not await self._sessions.stop(key):
                await self._plain.send(target, self._presenter.nothing_to_stop())
            # else: the stopped turn's own terminal message says so (never two terminal messages)
        elif command == "new":
            await self._sessions.stop(key)
            await self._new_context(key)
            await self._plain.send(target, self._presenter.new_context())
        elif command == "compact" and self._compact is not None:
            await self._plain.send(target, await self._compact(key))
        elif command == "help":
            await self._plain.send(target, self._presenter.help(COMMANDS))
