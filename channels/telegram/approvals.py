"""Tool approvals on Telegram: an inline keyboard (Allow / Deny) under an approval request.

When a turn's snapshot shows a new pending approval, its sink posts one message in the turn's chat (and
forum topic): the tool's name and arguments, with the two buttons. A button's ``callback_data`` is
``ap:<ref>:<a|d>``, where ``ref`` is a random token that maps, in memory, to (session key, tool call id);
it stays far below Telegram's 64-byte limit whatever the call id looks like.

A press is honoured only from the user whose message started the turn (``ApprovalRequest.requested_by``)
or, when ``allow_from`` is a list rather than "*", from a user on it; anyone else gets an alert and nothing
changes. A decision goes to ``ChatCore.decide``; the callback query is always answered, and the message is
edited to show the decision (the edit carries no keyboard, which removes it). An approval that ends without
a press (timed out, the turn stopped) is edited the same way by the sink; a press the bridge no longer
knows (after a restart, or once the turn ended) is answered "no longer pending" and its keyboard removed.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from aiogram.methods import AnswerCallbackQuery, EditMessageReplyMarkup, EditMessageText
from aiogram.types import CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup, Message, User

from channels.common.errors import PlatformError
from channels.telegram.adapter import sender_name

if TYPE_CHECKING:
    from channels.telegram.channel import TelegramChannel

log = logging.getLogger(__name__)

PREFIX = "ap"
CODES: dict[str, Literal["allow", "deny"]] = {"a": "allow", "d": "deny"}
MAX_REMEMBERED = 1024

NOT_YOURS = "Only the person who asked, or a user allowed to use this bot, can decide this."
GONE = "This request is no longer pending."


@dataclass
class PendingApproval:
    ref: str
    session_key: str
    call_id: str
    tool_name: str
    arguments: str
    requested_by: str | None
    chat_id: int
    message_id: int | None = None
    outcome: str | None = None
    """"allowed" or "denied" after a press; "ended" when it ended otherwise (timed out, stopped, turn over)."""


def request_text(tool_name: str, arguments: str) -> str:
    lines = [f"🔧 Approval needed: {tool_name}"]
    if arguments:
        lines.append(arguments)
    return "\n".join(lines)


def keyboard(ref: str) -> InlineKeyboardMarkup:
    return InlineKeyboardMarkup(inline_keyboard=[[
        InlineKeyboardButton(text="✅ Allow", callback_data=f"{PREFIX}:{ref}:a"),
        InlineKeyboardButton(text="❌ Deny", callback_data=f"{PREFIX}:{ref}:d")]])


def parse(data: str | None) -> tuple[str, Literal["allow", "deny"]] | None:
    parts = (data or "").split(":")
    if len(parts) != 3 or parts[0] != PREFIX or parts[2] not in CODES:
        return None
    return parts[1], CODES[parts[2]]


class ApprovalButtons:
    """The approval messages this process has posted, and the presses on their buttons."""

    def __init__(self, channel: TelegramChannel) -> None:
        self._channel = channel
        self._by_ref: OrderedDict[str, PendingApproval] = OrderedDict()

    def register(self, session_key: str, call_id: str, tool_name: str, arguments: str, requested_by: str | None,
                 chat_id: int) -> PendingApproval:
        entry = PendingApproval(secrets.token_urlsafe(9), session_key, call_id, tool_name, arguments,
                                requested_by, chat_id)
        self._by_ref[entry.ref] = entry
        while len(self._by_ref) > MAX_REMEMBERED:
            self._by_ref.popitem(last=False)
        return entry

    def get(self, ref: str) -> PendingApproval | None:
        return self._by_ref.get(ref)

    def may_decide(self, user: User, entry: PendingApproval) -> bool:
        if entry.requested_by is not None and str(user.id) == entry.requested_by:
            return True
        allow = self._channel.allow
        return not allow.everyone and allow.allows(user)

    async def on_press(self, query: CallbackQuery) -> None:
        """Handle one callback query: always answered, at most one decision."""
        parsed = parse(query.data)
        if parsed is None:
            await self._answer(query)
            return
        ref, decision = parsed
        entry = self._by_ref.get(ref)
        message = query.message if isinstance(query.message, Message) else None
        if entry is None or entry.outcome is not None:
            decided = entry is not None and entry.outcome in ("allowed", "denied")
            await self._answer(query, f"Already {entry.outcome}." if entry is not None and decided else GONE)
            if message is not None:
                await self._drop_keyboard(message.chat.id, message.message_id)
            return
        if not self.may_decide(query.from_user, entry):
            await self._answer(query, NOT_YOURS, alert=True)
            return
        decided = self._channel.core.decide(entry.session_key, entry.call_id, decision,
                                            decided_by=str(query.from_user.id))
        if not decided:
            entry.outcome = "ended"
            await self._answer(query, GONE)
            await self.show_outcome(entry, "⌛ No longer pending.")
            return
        who = sender_name(query.from_user)
        entry.outcome = "allowed" if decision == "allow" else "denied"
        await self._answer(query, "Allowed" if decision == "allow" else "Denied")
        mark = "✅ Allowed" if decision == "allow" else "❌ Denied"
        await self.show_outcome(entry, f"{mark} by {who}")

    async def show_outcome(self, entry: PendingApproval, line: str) -> None:
        """Edit the approval message to show how it ended; the edit has no keyboard, so the buttons go.
        It answers a press, so it goes at once (honouring a 429 pause, without waiting for a pace slot)."""
        if entry.message_id is None:
            return
        text = f"{request_text(entry.tool_name, entry.arguments)}\n\n{line}"
        try:
            await self._channel.client.call(EditMessageText(
                chat_id=entry.chat_id, message_id=entry.message_id, text=text, parse_mode=None),
                chat=str(entry.chat_id), paced=False)
        except PlatformError as exc:
            log.info("could not show the approval outcome in chat %s: %s", entry.chat_id, exc)
            await self._drop_keyboard(entry.chat_id, entry.message_id)

    async def _drop_keyboard(self, chat_id: int, message_id: int) -> None:
        try:
            await self._channel.client.call(EditMessageReplyMarkup(chat_id=chat_id, message_id=message_id),
                                            chat=str(chat_id), paced=False)
        except PlatformError as exc:
            log.debug("could not remove an approval keyboard in chat %s: %s", chat_id, exc)

    async def _answer(self, query: CallbackQuery, text: str | None = None, *, alert: bool = False) -> None:
        try:
            await self._channel.client.call(AnswerCallbackQuery(
                callback_query_id=query.id, text=text, show_alert=alert or None))
        except PlatformError as exc:
            log.debug("answerCallbackQuery failed: %s", exc)
