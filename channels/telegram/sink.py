"""TelegramSink: one turn's live reply in one chat (or forum topic).

Streaming: nothing is posted until the answer has ``first_chars`` characters or ``first_delay`` seconds
have passed (a typing action shows meanwhile); then a flush task reconciles the newest snapshot into
messages, one call per ``edit_interval`` per chat at most (latest wins; ``update`` never waits). In
private chats the unfinished tail can stream as a ``sendMessageDraft`` preview instead of edits
(``stream_transport``); a rejected draft falls back to edits for good. The final reconcile renders
Markdown into entities (plain text if Telegram rejects them) and leaves the chat showing the whole
answer exactly once.

A pending tool approval in a snapshot is posted at once as its own message with Allow / Deny buttons
(``channels.telegram.approvals``); one that ends without a press is edited to say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiogram.methods import DeleteMessage, EditMessageText, SendChatAction, SendMessage, SendMessageDraft
from aiogram.types import MessageEntity, ReplyParameters

from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.reconciler import Reconciler
from channels.common.splitter import utf16_len
from channels.telegram import render
from channels.telegram.approvals import PendingApproval, keyboard
from channels.telegram.context import TelegramContext
from core.agent.approvals import DENIED_BY_TIMEOUT
from core.channel import SinkError
from core.envelope import TurnTarget
from core.snapshot import TurnSnapshot

if TYPE_CHECKING:
    from channels.telegram.channel import TelegramChannel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a turn's messages go: the chat, its forum topic, and the user message to reply to."""

    chat_id: int
    thread_id: int | None
    chat_type: str
    reply_to_message_id: int | None

    @property
    def key(self) -> str:
        return str(self.chat_id)

    @classmethod
    def of(cls, target: TurnTarget) -> Destination:
        ctx = TelegramContext.of(target)
        return cls(int(target.chat_id), ctx.topic_id, ctx.chat_type, None if ctx.private else ctx.message_id)


def entities(part: Part) -> list[MessageEntity] | None:
    return [MessageEntity(**dict(e)) for e in part.formatting] or None


class MessageOps:
    """The reconciler's three calls, as Bot API methods for one destination. Each call takes its own slot
    of the chat's pace (``edit_interval``), so a step that freezes one message and starts the next costs
    two slots, and no two calls reach a chat closer together than the interval."""

    def __init__(self, channel: TelegramChannel, dest: Destination) -> None:
        self._client = channel.client
        self._throttle = channel.throttle
        self._dest = dest
        self._replied = False

    async def send(self, part: Part) -> str:
        d = self._dest
        reply = None
        if d.reply_to_message_id and not self._replied:
            reply = ReplyParameters(message_id=d.reply_to_message_id, allow_sending_without_reply=True)
        await self._throttle.reserve(d.key)
        msg = await self._client.call(SendMessage(
            chat_id=d.chat_id, text=part.text, entities=entities(part), message_thread_id=d.thread_id,
            reply_parameters=reply, parse_mode=None, link_preview_options=None), chat=d.key)
        assert msg is not None
        self._replied = True
        return str(msg.message_id)

    async def edit(self, message_id: str, part: Part) -> None:
        d = self._dest
        await self._throttle.reserve(d.key)
        await self._client.call(EditMessageText(
            chat_id=d.chat_id, message_id=int(message_id), text=part.text, entities=entities(part),
            parse_mode=None), chat=d.key)

    async def delete(self, message_id: str) -> None:
        await self._throttle.reserve(self._dest.key)
        try:
            await self._client.call(DeleteMessage(chat_id=self._dest.chat_id, message_id=int(message_id)),
                                    chat=self._dest.key)
        except PlatformError as exc:
            if exc.kind != "not_found":  # already gone is what we wanted
                raise


class TelegramSink:
    def __init__(self, channel: TelegramChannel, target: TurnTarget, dest: Destination, *, draft: bool) -> None:
        self.channel = channel
        self.target = target
        self.dest = dest
        self.draft = draft
        self.draft_id = secrets.randbelow(2**31 - 2) + 1
        self.reconciler = Reconciler(MessageOps(channel, dest))
        self._clock = channel.throttle.clock
        self._opened = self._clock.now()
        self._typing_at = -1e9
        self._lock = asyncio.Lock()
        self._plain_final = False
        self._pending: list[Part] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._finishing = False
        self.aborted = False
        self._asked: dict[str, tuple[PendingApproval, asyncio.Task[None] | None]] = {}

    @property
    def ledger(self):  # type: ignore[no-untyped-def]
        return self.reconciler.ledger

    # ---- TurnSink ------------------------------------------------------------------------------

    async def typing(self) -> None:
        """Show "typing…" (lasts about 5 s on Telegram; repeated while nothing is visible)."""
        if self.channel.throttle.paused_for(self.dest.key) > 0:
            return
        self._typing_at = self._clock.now()
        await self.channel.client.call(SendChatAction(chat_id=self.dest.chat_id, action="typing",
                                                      message_thread_id=self.dest.thread_id), chat=self.dest.key)

    async def update(self, snapshot: TurnSnapshot) -> None:
        """Note the newest state and make sure a flush is on its way; never waits for the chat's pace."""
        self._sync_approvals(snapshot)
        if self.aborted or self._finishing:
            return
        parts = render.stream_parts(snapshot.text, self.channel.limit)
        settings = self.channel.settings
        if not len(self.ledger) and not self._draft_shown:
            young = self._clock.now() - self._opened < settings.first_delay
            if not parts or (young and utf16_len(snapshot.text) < settings.first_chars):
                if self._clock.now() - self._typing_at > 4.0:
                    await self._quietly(self.typing())
                return
        self._pending = parts
        if self._flusher is None or self._flusher.done():
            try:
                self._flusher = self.channel.host.spawn(
                    f"telegram:flush:{snapshot.turn_id}", self._flush())
            except Exception:  # shutting down: the final reconcile still repeats the whole state
                self._flusher = None

    async def _flush(self) -> None:
        """Show the newest pending parts whenever the chat's pace allows (latest wins)."""
        key = self.dest.key
        throttle = self.channel.throttle
        while self._pending is not None and not self._finishing:
            if throttle.paused_for(key) > 0:
                return  # a 429 pauses the chat; a later snapshot or the final repeats the whole state
            await throttle.wait_for_slot(key)
            parts, self._pending = self._pending, None
            if parts is None or self._finishing:
                return
            async with self._lock:
                if not self._stream_pending(parts):
                    continue
                try:
                    await self._stream(parts)
                except PlatformError as exc:
                    log.info("live update in chat %s failed (the final repeats it): %s", key, exc)

    async def finish(self, snapshot: TurnSnapshot) -> None:
        self._finishing = True
        self._sync_approvals(snapshot)  # a terminal snapshot has none pending: the keyboards go
        flusher = self._flusher
        if flusher is not None and not flusher.done():
            if self._lock.locked():
                await asyncio.shield(flusher)  # a call in flight: let it land, so the ledger stays true
            else:
                flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flusher
        async with self._lock:
            parts = self._final(snapshot)
            if not self.reconciler.pending(parts, final=True) and not self._draft_shown:
                return  # already showing it: finish is idempotent
            left = self.channel.throttle.paused_for(self.dest.key)
            if left > 0:  # no call may reach this chat before the 429 pause is over
                raise SinkError(f"chat paused by a 429 for {left:.1f}s more", transient=True, retry_after=left)
            try:
                await self.reconciler.apply(parts, final=True)
            except PlatformError as exc:
                if exc.kind == "permanent":
                    await self._remove_stale(parts)
                if exc.kind != "format":
                    raise self._sink_error(exc) from None
                log.warning("Telegram rejected the formatted reply (%s); sending it as plain text", exc)
                self._plain_final = True
                try:
                    await self.reconciler.apply(render.plain_parts(parts), final=True)
                except PlatformError as exc2:
                    raise self._sink_error(exc2) from None
            self._draft_shown = False  # the real messages replace the draft preview

    async def _remove_stale(self, parts: list[Part]) -> None:
        """The final edit can never succeed (e.g. the message is too old to edit): delete the previews that
        do not show their final part, so the core's single fallback (which sends exactly the parts the ledger
        says are missing) leaves the chat showing the answer once, not next to a stale preview."""
        ops = self.reconciler.ops
        for index in range(len(self.ledger) - 1, -1, -1):
            entry = self.ledger.entries[index]
            if entry.gone or (index < len(parts) and self.ledger.shows(index, parts[index])):
                continue
            try:
                await ops.delete(entry.message_id)
            except PlatformError as exc:
                log.warning("could not delete a stale preview on Telegram: %s", exc)
                continue
            self.ledger.gone(index)

    async def abort(self) -> None:
        self.aborted = True
        flusher = self._flusher
        if flusher is not None and not flusher.done():
            flusher.cancel()

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        missing = self.ledger.missing(self._final(snapshot))
        return "\n\n".join(p.source for p in missing)

    # ---- approvals -----------------------------------------------------------------------------

    def _sync_approvals(self, snapshot: TurnSnapshot) -> None:
        """Post new pending approvals; mark those that ended without a press. Never waits."""
        pending = {a.call_id for a in snapshot.approvals}
        for request in snapshot.approvals:
            if request.call_id not in self._asked:
                entry = self.channel.approval_buttons.register(
                    snapshot.session_key, request.call_id, request.tool_name, request.arguments,
                    request.requested_by or self.target.sender_id, self.dest.chat_id)
                self._asked[request.call_id] = (entry, self._spawn(f"telegram:approval:{request.call_id}",
                                                                   self._post_approval(entry)))
        for call_id, (entry, posting) in self._asked.items():
            if call_id not in pending and entry.outcome is None:
                entry.outcome = "ended"
                self._spawn(f"telegram:approval-ended:{call_id}",
                            self._show_ended(entry, posting, _ended_line(snapshot, call_id)))

    async def _post_approval(self, entry: PendingApproval) -> None:
        d = self.dest
        reply = ReplyParameters(message_id=d.reply_to_message_id, allow_sending_without_reply=True) \
            if d.reply_to_message_id else None
        msg = None
        try:
            # A request longer than one message comes in parts; the keyboard goes under the last one only
            # once every part is shown, so nobody decides on half of the arguments.
            for i, text in enumerate(entry.parts):
                last = i == len(entry.parts) - 1
                await self.channel.throttle.reserve(d.key)
                msg = await self.channel.client.call(SendMessage(
                    chat_id=d.chat_id, text=text, parse_mode=None, message_thread_id=d.thread_id,
                    reply_parameters=reply if i == 0 else None, reply_markup=keyboard(entry.ref) if last else None),
                    chat=d.key)
        except PlatformError as exc:
            log.warning("could not post the approval request for %s in chat %s: %s", entry.tool_name, d.key, exc)
            return
        if msg is not None:
            entry.message_id = msg.message_id

    async def _show_ended(self, entry: PendingApproval, posting: asyncio.Task[None] | None, line: str) -> None:
        if posting is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(posting)
        await self.channel.approval_buttons.show_outcome(entry, line)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        try:
            return self.channel.host.spawn(name, coro)
        except Exception:  # shutting down
            return None

    # ---- internals -----------------------------------------------------------------------------

    _draft_shown = False

    def _final(self, snapshot: TurnSnapshot) -> list[Part]:
        parts = render.final_parts(snapshot, self.channel.limit)
        return render.plain_parts(parts) if self._plain_final else parts

    def _stream_pending(self, parts: list[Part]) -> bool:
        if self.draft:
            return True  # the draft tail changes with every snapshot that reached us
        return self.reconciler.pending(parts, final=False)

    async def _stream(self, parts: list[Part]) -> None:
        if self.draft:
            try:
                # finished parts become real messages; the unfinished tail streams as a draft preview
                await self.reconciler.apply(parts[:-1], final=False)
                d = self.dest
                await self.channel.throttle.reserve(d.key)
                await self.channel.client.call(SendMessageDraft(
                    chat_id=d.chat_id, draft_id=self.draft_id, text=parts[-1].text, message_thread_id=d.thread_id,
                    parse_mode=None), chat=d.key)
                self._draft_shown = True
                return
            except PlatformError as exc:
                if exc.transient or exc.kind == "not_found":
                    raise
                log.info("sendMessageDraft rejected in chat %s (%s); streaming by edits instead", self.dest.key, exc)
                self.draft = False
                self.channel.drafts_rejected = True
        await self.reconciler.apply(parts, final=False)

    def _sink_error(self, exc: PlatformError) -> SinkError:
        return SinkError(str(exc), transient=exc.transient, retry_after=exc.retry_after)

    async def _quietly(self, step: object) -> None:
        try:
            await step  # type: ignore[misc]
        except PlatformError as exc:
            log.debug("typing action failed: %s", exc)


def _ended_line(snapshot: TurnSnapshot, call_id: str) -> str:
    """How an approval ended without a press on this message, from the tool's status in ``snapshot``."""
    tool = next((t for t in snapshot.tools if t.call_id == call_id), None)
    if tool is not None and tool.status == "denied" and tool.summary == DENIED_BY_TIMEOUT:
        return "⌛ Denied: nobody decided in time."
    if tool is not None and tool.status in ("running", "done"):
        return "✅ Allowed."
    return "⏹ The reply was stopped before a decision."  # /stop denies what is pending
