"""Telegram's side of the shared live sink: its message operations for one chat (or forum topic).

``TelegramOps`` sends, edits and deletes messages with the Bot API (one attempt each; pacing, 429 pauses
and retries are the shared call policy's, in the chat's scope of ``edit_interval``). In private chats the
unfinished tail of a reply can stream as a ``sendMessageDraft`` preview instead of edits
(``stream_transport``): that is Telegram's native stream, which always shows the whole tail (it replaces
the preview). A draft Telegram rejects falls back to edits for good. The final message replaces the
preview. Approval prompts are ``channels.telegram.approvals``' inline keyboards.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiogram.methods import DeleteMessage, EditMessageText, SendChatAction, SendMessage, SendMessageDraft
from aiogram.types import MessageEntity, ReplyParameters

from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.ops import Capabilities, NativeStream, TextChange
from channels.common.throttle import Scope
from channels.telegram.approvals import PendingApproval, keyboard
from channels.telegram.context import TelegramContext
from core.envelope import TurnTarget
from core.snapshot import ApprovalRequest, TurnSnapshot

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

    def reply(self) -> ReplyParameters | None:
        if not self.reply_to_message_id:
            return None
        return ReplyParameters(message_id=self.reply_to_message_id, allow_sending_without_reply=True)


def entities(part: Part) -> list[MessageEntity] | None:
    return [MessageEntity(**dict(e)) for e in part.formatting] or None


class TelegramOps:
    """``MessageOps`` for one destination."""

    def __init__(self, channel: TelegramChannel, dest: Destination, *, draft: bool) -> None:
        self._channel = channel
        self._client = channel.client
        self._dest = dest
        self._draft = draft
        self._replying: str | None = None
        """The message that quotes the user's message; a reply always shows one while any of it is shown."""
        self.capabilities = Capabilities(limit=channel.limit, unit="utf16", can_delete=True,
                                         idempotent_sends=False, native_stream=draft)
        self.scopes: tuple[Scope, ...] = (channel.client.scope(dest.key),)

    async def send(self, part: Part, key: str) -> str:
        d = self._dest
        msg = await self._client.once(SendMessage(
            chat_id=d.chat_id, text=part.text, entities=entities(part), message_thread_id=d.thread_id,
            reply_parameters=None if self._replying else d.reply(), parse_mode=None, link_preview_options=None))
        assert msg is not None
        if self._replying is None:
            self._replying = str(msg.message_id)
        return str(msg.message_id)

    async def edit(self, message_id: str, part: Part) -> None:
        d = self._dest
        await self._client.once(EditMessageText(
            chat_id=d.chat_id, message_id=int(message_id), text=part.text, entities=entities(part),
            parse_mode=None))

    async def delete(self, message_id: str) -> None:
        try:
            await self._client.once(DeleteMessage(chat_id=self._dest.chat_id, message_id=int(message_id)))
        except PlatformError as exc:
            if exc.kind != "not_found":  # already gone is what we wanted
                raise
        if message_id == self._replying:  # the next message sent quotes the user's message in its place
            self._replying = None

    async def typing(self) -> None:
        d = self._dest
        await self._client.once(SendChatAction(chat_id=d.chat_id, action="typing", message_thread_id=d.thread_id))

    def stream(self) -> NativeStream | None:
        return DraftStream(self._channel, self._dest) if self._draft else None


class DraftStream:
    """The unfinished tail of a reply as a ``sendMessageDraft`` preview (private chats)."""

    shows_activity = False

    def __init__(self, channel: TelegramChannel, dest: Destination) -> None:
        self._channel = channel
        self._dest = dest
        self._draft_id = secrets.randbelow(2**31 - 2) + 1

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        d = self._dest
        try:
            await self._channel.client.once(SendMessageDraft(
                chat_id=d.chat_id, draft_id=self._draft_id, text=text, message_thread_id=d.thread_id,
                parse_mode=None))
        except PlatformError as exc:
            if exc.transient or exc.kind == "not_found":
                raise
            self._channel.drafts_rejected = True
            raise PlatformError(f"sendMessageDraft rejected: {exc}", kind="unsupported") from None

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        return None  # the final message, sent next, replaces the preview

    def leftover(self) -> tuple[str, Part] | None:
        return None  # a draft is no message of the chat


class TelegramPrompts:
    """``ApprovalPrompts``: an approval request with Allow / Deny buttons, in the turn's chat and topic."""

    def __init__(self, channel: TelegramChannel, target: TurnTarget, dest: Destination) -> None:
        self._channel = channel
        self._target = target
        self._dest = dest

    async def post(self, session_key: str, request: ApprovalRequest) -> Any:
        d = self._dest
        buttons = self._channel.approval_buttons
        entry = buttons.register(
            session_key, request.call_id, request.tool_name, request.arguments,
            request.requested_by or self._target.sender_id, d.chat_id, origin=request.origin, label=request.label)
        await buttons.posted(entry)  # findable by a press in another process
        msg = None
        last = False
        # A request longer than one message comes in parts; the keyboard goes under the last one only once
        # every part is shown, so nobody decides on half of the arguments. The Bot API has no idempotency key:
        # the message with the keyboard is never sent again once a try's outcome is unknown (Telegram may
        # have shown it; a second copy would be a second live keyboard).
        try:
            for i, text in enumerate(entry.parts):
                last = i == len(entry.parts) - 1
                msg = await self._channel.client.call(SendMessage(
                    chat_id=d.chat_id, text=text, parse_mode=None, message_thread_id=d.thread_id,
                    reply_parameters=d.reply() if i == 0 else None,
                    reply_markup=keyboard(entry.ref) if last else None), chat=d.key, once_if_unsure=last)
        except PlatformError as exc:
            if last and exc.outcome_unknown:
                # Maybe shown, maybe not: the request stays open (a press on it decides, and its callback
                # query says which message it is) rather than being shown twice or denied while shown.
                log.info("no answer to the approval request for %s; it stays open: %s", entry.tool_name, exc)
                return entry
            entry.outcome = "ended"  # never shown with its buttons: nothing to find or close
            await buttons.posted(entry)
            raise
        except Exception:
            entry.outcome = "ended"
            await buttons.posted(entry)
            raise
        if msg is not None:
            entry.message_id = msg.message_id
            await buttons.posted(entry)
        return entry

    async def ended(self, handle: Any, line: str) -> None:
        entry: PendingApproval = handle
        # A press that decided showed its own outcome; one that only found it ended ("gone") did not know how,
        # so this line replaces its "no longer pending".
        if entry.outcome in (None, "gone"):
            entry.ends("ended", line)
            await self._channel.approval_buttons.show_outcome(entry)
