"""What a platform supplies to the shared live sink: its message operations and its rendering.

``MessageOps`` are one destination's raw platform calls (one attempt each, failures as ``PlatformError``;
pacing and retries are added by ``channels.common.calls``), with the platform's capability flags and the
throttle scopes its calls count against. A platform with a native stream (the web chat's SSE, Slack's
``chat.startStream``/``appendStream``, Telegram's draft preview) also returns one from ``stream()``: the
sink then shows the unfinished part of a reply through it, by appending what was added or replacing the
whole text when it no longer extends what the stream shows (a retried model request rewinds it).

``Renderer`` turns Markdown chunks (already split under the platform's limit) into message parts: plain
while streaming, formatted at the end. ``ApprovalPrompts`` posts a pending tool approval with its
buttons and marks one that ended without a press.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from channels.common.ledger import Part
from channels.common.splitter import Measure, utf8_len, utf16_len
from channels.common.throttle import Scope
from core.snapshot import ApprovalRequest, TurnSnapshot

Unit = Literal["utf16", "chars", "bytes"]
MEASURES: dict[Unit, Measure] = {"utf16": utf16_len, "chars": len, "bytes": utf8_len}


@dataclass(frozen=True, slots=True)
class Capabilities:
    limit: int | None = None
    """The most one message may hold, in ``unit``s; None: any length (nothing is split)."""
    unit: Unit = "chars"
    can_delete: bool = True
    """A stale preview can be deleted (else it is left, and counts as showing its words)."""
    idempotent_sends: bool = False
    """The platform honours a send's idempotency key, so a send whose outcome is unknown may be repeated."""
    native_stream: bool = False
    """``MessageOps.stream()`` returns a native stream for the unfinished part of a reply."""
    measure: Measure | None = None
    """A platform's own measure of a chunk against ``limit`` (replaces ``unit``'s): Feishu counts a card's
    markdown as the bytes of its JSON encoding."""


@dataclass(frozen=True, slots=True)
class TextChange:
    """How a stream's text differs from what it showed: ``text`` appended, or (``replace``) the whole text."""

    text: str
    replace: bool = False


class NativeStream(Protocol):
    shows_activity: bool
    """True when the stream also shows tool activity, approvals and the turn's state (it is then pushed on
    any change of the snapshot, not only of the text)."""

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        """Show ``text`` (the whole unfinished part) now; ``change`` says how it differs from what the stream
        showed (None: the text did not change). One attempt; raise PlatformError (kind ``unsupported`` when
        the platform refuses the stream here: the sink then edits messages instead, for good)."""
        ...

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        """End the stream with the terminal snapshot; ``part`` is the final rendering of what it streamed.
        Returns the id of a message that now shows ``part`` (the ledger records it), or None when the
        stream leaves nothing behind (the part is then sent as a message)."""
        ...

    def leftover(self) -> tuple[str, Part] | None:
        """The message the stream leaves in the chat and what it shows (its ``source``: the Markdown it
        shows of the reply), or None when it leaves none (a draft preview vanishes). Asked after an
        abort: what it shows counts as shown."""
        ...


@runtime_checkable
class MessageStream(Protocol):
    """A native stream that lives in an ordinary message of the chat (Slack's ``chat.startStream``), unlike a
    preview that vanishes once the reply is sent (Telegram's draft). The sink hands such a message over to its
    ledger, so edits take it over and nothing it shows is lost or shown twice:

    - ``handover``: when the reply outgrew one message, end the stream's message and return (its id, a part
      for what it shows); the sink's next edit makes it show its finished part, and the next ``push`` starts a
      new message for the rest;
    - ``leftover``: after the stream failed or was given up (it expired; the text was rewritten), the message it
      leaves and what it shows, or None; the sink edits it from then on (or deletes it before a fallback).
    """

    async def handover(self) -> tuple[str, Part] | None: ...

    def leftover(self) -> tuple[str, Part] | None: ...


class MessageOps(Protocol):
    """One destination's platform calls: one attempt each, raising ``PlatformError``."""

    capabilities: Capabilities
    scopes: tuple[Scope, ...]
    """The throttle scopes every call counts against (the chat first: a 429 pauses it by default)."""

    async def send(self, part: Part, key: str) -> str:
        """Post a new message (``key``: an idempotency key, the same for every retry of this send); returns
        its id."""
        ...

    async def edit(self, message_id: str, part: Part) -> None:
        """Make the message show ``part`` ("not modified" is success)."""
        ...

    async def delete(self, message_id: str) -> None:
        """Delete the message (one that is already gone is success)."""
        ...

    async def typing(self) -> None:
        """Show that a reply is being written (where the platform has such an indicator)."""
        ...

    def stream(self) -> NativeStream | None: ...


class Renderer(Protocol):
    def stream_part(self, source: str) -> Part:
        """A chunk of an unfinished reply as shown while streaming (plain: half-written markup cannot break)."""
        ...

    def final_part(self, source: str) -> Part:
        """A chunk of the finished reply, formatted (the plain source where formatting is not possible)."""
        ...

    def plain_part(self, source: str) -> Part:
        """A chunk as plain text, after the platform rejected its formatting."""
        ...


class ApprovalPrompts(Protocol):
    async def post(self, session_key: str, request: ApprovalRequest) -> Any:
        """Post the approval request with its buttons; returns a handle for ``ended`` (raise or return
        None when nothing could be posted: the sink then tells core, which denies the call at once, as one
        nobody could approve. A post that may have been shown, its outcome unknown, returns a handle or raises
        a ``PlatformError`` with ``outcome_unknown``: the request stays pending)."""
        ...

    async def ended(self, handle: Any, line: str) -> None:
        """The approval ended without a press on this prompt (timed out, stopped, decided elsewhere): show
        ``line`` and remove the buttons, unless a press already settled it."""
        ...


class PlainRenderer:
    """Rendering for platforms that show the Markdown source as it is (the web chat renders it itself)."""

    def stream_part(self, source: str) -> Part:
        return Part.plain(source)

    def final_part(self, source: str) -> Part:
        return Part.plain(source)

    def plain_part(self, source: str) -> Part:
        return Part.plain(source)
