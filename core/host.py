"""What a channel may ask of the rest of chatbridge: the host it is handed instead of the core.

Every platform channel gets a :class:`ChannelHost`, bound to its name:

- ``submit(envelope)`` hands one normalised inbound message to core; it returns once core has stored it
  with its dedupe mark (so it is answered even after a crash), or recognised it as a duplicate of an earlier
  one by the envelope's ``event_id``, or refused it as busy; a channel acknowledges the platform (commits
  an offset, answers a webhook) only after it returns;
- ``decide(...)`` answers a pending tool approval of one of this channel's sessions on behalf of a user;
  core decides whether that user may (``core.agent.deciders``: the sender of the turn's message, or a user
  the allow list given to ``set_deciders`` names) and says so in its answer, which the channel only
  translates for the platform ("not yours", "no longer pending"). With several processes on one store, an
  approval another process holds is decided there (``ChatCore.decide_anywhere``), so the answer is awaited;
- ``spawn(name, coro)`` runs work as a supervised task (bounded shutdown; a failed spawn raises);
- ``get_state`` / ``set_state`` keep small durable values across restarts (a polling offset, a cursor);
  ``state_names(prefix)`` lists the names of those values that begin with ``prefix`` and ``delete_state``
  forgets one (values kept per process, such as each process's open approval requests);
- ``processes`` says which of the processes sharing the store are alive (``core.processes``), so that
  what a dead one left on the platform is cleaned up by one live process, and never what a live one shows;
- ``mark_seen(key)`` is durable dedupe on the channel's own keys (e.g. a Slack ``event_id`` on top of the
  envelope's (channel, ts)), kept for the dedupe TTL. For an inbound message prefer the envelope's
  ``event_id``, which core records together with the message itself; ``mark_seen`` is for keys that must
  be recognised before or apart from that (button presses, retries of events that never become messages).
- ``count_call(result)`` counts one attempt of a platform call for ``GET /metrics``.
- ``lead(name)`` waits until this process is the one that receives through ``name`` (a transport the
  platform allows one consumer of, such as Telegram long polling of one bot) and returns the held lead
  (``core.leadership``); with one process it is granted at once. ``shared`` says whether other processes
  on the same database receive for this channel too.

The web chat is itself a client of the sessions (it lists them, reads history, renames, stops, and fans
core events out to browsers), so it gets a :class:`SessionHost`: the same host plus exactly those reads
and writes, restricted to its own sessions, and the files of its sessions: ``upload`` stores a file ahead of
the message that carries it (a ``MediaItem`` with its ``attachment_id``), under the same caps and checks as
a downloaded attachment, and ``attachment`` finds a stored file of one of its sessions (to serve it).

A channel whose messages carry files it must download implements ``core.media.fetch.AttachmentSource``;
core calls it during the turn, never while the channel is acknowledging the message (so for a message stored
before a restart, after the restart, from the stored ``MediaItem`` alone).

``submit`` raises and ``spawn`` raises :class:`ShuttingDownError` once shutdown has begun, and ``submit``
raises :class:`AdmissionError` when core could not store the message: the channel tells the platform to
redeliver (a 503, an offset left alone) or tells the sender, never drops the message silently. Nothing
marks a refused message as seen, so the redelivery is accepted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from core.agent.deciders import AllowEntries, Decider, DecideResult
from core.envelope import InboundEnvelope
from core.events import CoreEvent
from core.leadership import Lead
from core.media.library import Refusal as AttachmentRefused
from core.messages import AttachmentRef, ChatMessage
from core.metrics import CallResult
from core.processes import Processes
from core.relay import Relay
from core.router import AdmissionError, SubmitResult
from core.store import AttachmentRecord, SessionRecord
from core.supervisor import ShuttingDownError

if TYPE_CHECKING:
    from core.runtime import ChatCore

__all__ = [
    "AdmissionError",
    "AttachmentRefused",
    "ChannelHost",
    "CoreHost",
    "DecideResult",
    "Decider",
    "MediaLimits",
    "Processes",
    "SessionHost",
    "ShuttingDownError",
    "SubmitResult",
]

T = TypeVar("T")
Decision = Literal["allow", "deny"]


class ChannelHost(Protocol):
    @property
    def channel(self) -> str:
        """The name of the channel this host serves."""
        ...

    async def submit(self, envelope: InboundEnvelope) -> SubmitResult:
        """Hand one inbound message to core; returns after core stored it (or dropped a duplicate, or refused
        it as busy). ShuttingDownError / AdmissionError: not accepted, do not acknowledge it."""
        ...

    def set_deciders(self, allow_from: Iterable[str] | AllowEntries) -> None:
        """The users (ids or names, as in the channel's ``allow_from``) who may decide any approval of this
        channel besides the sender of the turn's message; ``"*"`` names nobody. Until set: only the sender.
        A channel that can tell its ids from its names passes an ``AllowEntries``, so that a name never
        matches an id (``core.agent.deciders``); a plain list matches each entry against both."""
        ...

    async def decide(self, session_key: str, tool_call_id: str, decision: Decision,
                     decided_by: Decider | str | None, *, origin: Sequence[str] = ()) -> DecideResult:
        """Answer a pending approval on behalf of ``decided_by`` (a bare string is a user id): DECIDED,
        REFUSED (this user may not decide it; it stays pending) or NOT_PENDING (decided, timed out, over).
        ``origin``: the request's own (``ApprovalRequest.origin``) when a child session of ``session_key``
        asks (``run_subagent``). With several processes on one store, an approval pending in another
        process is decided there (``ChatCore.decide_anywhere``): the answer may take up to a few seconds."""
        ...

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a supervised task; raises ShuttingDownError once shutdown has begun."""
        ...

    async def get_state(self, name: str) -> str | None:
        """A small durable value of this channel (None when never set)."""
        ...

    async def set_state(self, name: str, value: str) -> None: ...

    async def state_names(self, prefix: str) -> list[str]:
        """The names of this channel's durable values that begin with ``prefix``, sorted."""
        ...

    async def delete_state(self, name: str) -> None: ...

    @property
    def processes(self) -> Processes:
        """Which processes sharing the store are alive, this one's id among them (``core.processes``)."""
        ...

    async def mark_seen(self, key: str) -> bool:
        """Record ``key`` durably for the dedupe TTL; True when it is new, False when seen before."""
        ...

    def count_call(self, result: CallResult) -> None:
        """Count one attempt of a platform call for ``GET /metrics``: ``"ok"``, ``"rate_limited"`` (a 429)
        or ``"error"``. The shared call policy (``channels.common.calls``) counts every attempt it makes."""
        ...

    @property
    def shared(self) -> bool:
        """True when other processes on the same database run this channel too: what this process registered
        with the platform for receiving (a webhook) serves them as well, so stopping must not undo it."""
        ...

    async def lead(self, name: str) -> Lead:
        """Wait until this process leads this channel's ``name`` (never a secret: it may be logged); cancel to
        give up waiting."""
        ...


class SessionHost(ChannelHost, Protocol):
    """A channel whose users browse their sessions themselves (the web chat). Keys are this channel's."""

    async def list_sessions(self) -> list[SessionRecord]:
        """This channel's conversations, most recent first (subagent sessions are shown in their parents)."""
        ...

    async def create_session(self, key: str) -> SessionRecord: ...

    async def rename(self, key: str, title: str) -> str:
        """A user rename: always wins over the automatic title. Returns the title as stored."""
        ...

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """(history_revision, the newest ``limit`` messages, or those just older than message ``before``);
        ``core.store.UnknownMessageError`` when ``before`` is not a message of ``key``."""
        ...

    async def stop(self, key: str) -> bool:
        """Stop the running turn of ``key`` (False when none runs)."""
        ...

    def subscribe(self, listener: Callable[[CoreEvent], None]) -> Callable[[], None]:
        """Follow core events (history deltas, titles); returns the unsubscribe function."""
        ...

    def media_limits(self) -> MediaLimits:
        """The caps every attachment is held to (``[media] max_bytes``, ``max_files``)."""
        ...

    def relay(self) -> Relay | None:
        """Messages between this channel's instances in the other processes sharing the store (``core.relay``,
        topic ``channel.<name>``); None when this process shares the store with nobody."""
        ...

    async def upload(self, key: str, name: str | None, chunks: AsyncIterator[bytes]) -> AttachmentRef:
        """Store one file for session ``key`` (its message follows); raises AttachmentRefused with the reason
        in a few words (too large, not safe to open, no media store), keeping nothing."""
        ...

    async def attachment(self, key: str, attachment_id: str) -> tuple[AttachmentRecord, Path] | None:
        """A stored attachment of session ``key`` and its file; None when it is not that session's or gone."""
        ...


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_bytes: int
    max_files: int


class CoreHost:
    """Both host interfaces over one ChatCore, for the channel named ``channel``.

    A channel can only speak for itself: its envelopes must carry its name, and the sessions it touches
    are those whose keys start with ``"<channel>:"``.
    """

    def __init__(self, core: ChatCore, channel: str) -> None:
        self._core = core
        self._channel = channel
        self._prefix = f"{channel}:"
        self._dedupe_namespace = f"{channel}:channel-keys"  # apart from the envelopes' event ids

    @property
    def channel(self) -> str:
        return self._channel

    def _own(self, key: str) -> str:
        if not key.startswith(self._prefix):
            raise ValueError(f"channel {self._channel!r} cannot act on session {key!r}")
        return key

    async def submit(self, envelope: InboundEnvelope) -> SubmitResult:
        if envelope.channel != self._channel:
            raise ValueError(f"channel {self._channel!r} cannot submit as {envelope.channel!r}")
        return await self._core.submit(envelope)

    def set_deciders(self, allow_from: Iterable[str] | AllowEntries) -> None:
        self._core.set_deciders(self._channel, allow_from)  # an AllowEntries is itself a list of its entries

    async def decide(self, session_key: str, tool_call_id: str, decision: Decision,
                     decided_by: Decider | str | None, *, origin: Sequence[str] = ()) -> DecideResult:
        return await self._core.decide_anywhere(self._own(session_key), tool_call_id, decision, decided_by,
                                                channel=self._channel, origin=origin)

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        return self._core.supervisor.spawn(name, coro)

    async def get_state(self, name: str) -> str | None:
        return await self._core.store.get_channel_state(self._channel, name)

    async def set_state(self, name: str, value: str) -> None:
        await self._core.store.set_channel_state(self._channel, name, value)

    async def state_names(self, prefix: str) -> list[str]:
        return await self._core.store.channel_state_names(self._channel, prefix)

    async def delete_state(self, name: str) -> None:
        await self._core.store.delete_channel_state(self._channel, name)

    @property
    def processes(self) -> Processes:
        return self._core.processes

    async def mark_seen(self, key: str) -> bool:
        return await self._core.store.mark_event_processed(
            self._dedupe_namespace, key, ttl_seconds=self._core.settings.dedupe_ttl_seconds)

    def count_call(self, result: CallResult) -> None:
        self._core.metrics.platform_call(self._channel, result)

    @property
    def shared(self) -> bool:
        return self._core.leadership.shared

    async def lead(self, name: str) -> Lead:
        return await self._core.leadership.acquire(f"{self._channel}:{name}")

    # ---- SessionHost -------------------------------------------------------------------------------

    async def list_sessions(self) -> list[SessionRecord]:
        return await self._core.list_sessions(prefix=self._prefix, subagents=False)

    async def create_session(self, key: str) -> SessionRecord:
        return await self._core.create_session(self._own(key))

    async def rename(self, key: str, title: str) -> str:
        return await self._core.rename(self._own(key), title)

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        return await self._core.history(self._own(key), limit=limit, before=before)

    async def stop(self, key: str) -> bool:
        return await self._core.stop(self._own(key))

    def subscribe(self, listener: Callable[[CoreEvent], None]) -> Callable[[], None]:
        return self._core.events.subscribe(listener)

    def relay(self) -> Relay | None:
        return self._core.relay(f"channel.{self._channel}")

    def media_limits(self) -> MediaLimits:
        s = self._core.settings
        return MediaLimits(s.media_max_bytes, s.media_max_files)

    async def upload(self, key: str, name: str | None, chunks: AsyncIterator[bytes]) -> AttachmentRef:
        return await self._core.upload(self._own(key), name, chunks)

    async def attachment(self, key: str, attachment_id: str) -> tuple[AttachmentRecord, Path] | None:
        return await self._core.attachment(self._own(key), attachment_id)
