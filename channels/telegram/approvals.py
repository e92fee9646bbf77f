"""Tool approvals on Telegram: an inline keyboard (Allow / Deny) under an approval request.

When a turn's snapshot shows a new pending approval, its sink posts it in the turn's chat (and forum
topic): the tool's name and every argument, with the two buttons under the last message. The arguments that
say what the call does (``ShownArgument.key``, e.g. fetch_url's URL) are shown whole, split over several
messages if they do not fit Telegram's limit in one; only the other arguments are shortened, marked, when
the whole request would not fit one message. A button's ``callback_data`` is
``ap:<ref>:<a|d>``, where ``ref`` is a random token that maps to (session key, tool call id): in the memory
of the process that posted the request, and in its open-requests record in the store
(``channels.common.open_approvals``), saved before the buttons are shown. It stays far below Telegram's
64-byte limit whatever the call id looks like.

Who may press is core's rule (``core.agent.deciders``: the user whose message started the turn or, when
``allow_from`` is a list rather than "*", a user on it; the channel hands core its ``allow_from`` once).
A press goes to the channel host's ``decide`` as the presser's id and username; a press core refuses gets
an alert and nothing changes. The callback query is always answered (a press whose decision could not be made,
core or the relay failing, is answered "please press again" and changes nothing), and after a decision the
message is edited to show it (the edit carries no keyboard, which removes it). An approval that ends without
a press (timed out, the turn stopped) is edited the same way by the sink; a press the bridge no longer
knows (after a restart, or once the turn ended) is answered "no longer pending" and its keyboard removed.
A press that lands after the approval ended but before the sink marked it (the sink still busy with a slow
edit or a 429 pause) does not know how it ended: its message says "no longer pending" at once (no sink may
ever come: one aborted marks nothing), and the sink's line, the real end, replaces that when it comes. The
edits of one request are made one at a time, each showing the newest line, so the real end is what stays.

The Bot API has no idempotency key, so the message with the keyboard is never sent twice: when its post's
outcome is unknown (Telegram may have shown it, its answer did not come), the request stays pending without a
message id, and the first press on it says which message it is (``query.message``): the press decides, and the
id is saved for a restart to close. A press on a message other than the one the request knows (a second copy,
however it came about) decides too, and that copy shows the decision as well.

Several processes on one database: the process that receives a press (the one polling the bot, or
whichever took the webhook request) may not be the one that posted the request, whose turn holds the
approval. It finds the request by its ref in the posting process's record (also one saved before the post,
without the message id yet: the ref and the chat suffice) and decides through ``host.decide``, which forwards
the decision to the holder (``core.agent.approval_relay``); it answers the callback query, and the holder's
sink edits the message once to show how the approval ended (the presser's name comes with the decision). A
message the record does not name as the request's is edited by the receiving process itself. The keyboard of
a request that has a record is never removed while it may be pending.

A request is remembered here (and kept in the record) while it is open, however many newer ones were posted:
only requests that ended are forgotten past ``MAX_REMEMBERED``.

Approvals do not outlive the process (a restart ends the turn that waited for them), but their buttons
would: so every posted request that has not ended is also kept in the channel's durable state, and the next
start edits each one to say it was denied by the restart, before the first update is read; with several
processes, those of a process that died are closed by one live process (``channels.common.open_approvals``).
A close Telegram refuses (the edit and the removal of the keyboard both fail) keeps the record, to be tried
again; a press on such a request meanwhile is answered "no longer pending" and closes it.
A button nobody can act on never looks live.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from aiogram.methods import AnswerCallbackQuery, EditMessageReplyMarkup, EditMessageText
from aiogram.types import CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup, Message

from channels.common.errors import PlatformError
from channels.common.open_approvals import RESTARTED, OpenApprovals, Record
from channels.common.splitter import utf16_len
from channels.telegram.adapter import sender_name, vouched_username
from channels.telegram.render import MESSAGE_LIMIT
from core.host import Decider, DecideResult
from core.snapshot import ShownArgument

if TYPE_CHECKING:
    from channels.telegram.channel import TelegramChannel

log = logging.getLogger(__name__)

PREFIX = "ap"
CODES: dict[str, Literal["allow", "deny"]] = {"a": "allow", "d": "deny"}
MAX_REMEMBERED = 1024
"""Requests that ended kept in memory (a late press on one is answered "already allowed"); open ones are all kept."""

NOT_YOURS = "Only the person who asked, or a user allowed to use this bot, can decide this."
GONE = "This request is no longer pending."
PRESS_NOT_TAKEN = "Your press could not be taken just now; please press again."
NO_LONGER_PENDING = "⌛ No longer pending."
"""What a press that found the request ended shows, until the sink shows how it ended (if it ever does)."""
OUTCOME_ROOM = 200
"""Room kept free in the last message for the outcome line an edit appends ("✅ Allowed by <name>")."""
MIN_SHOWN = 60
"""Characters an unimportant argument keeps at least when the request is too long for one message."""


@dataclass
class PendingApproval:
    ref: str
    session_key: str
    call_id: str
    tool_name: str
    requested_by: str | None
    chat_id: int
    parts: tuple[str, ...] = ()
    """The request's message texts; the last one carries the keyboard and, after an edit, the outcome."""
    message_id: int | None = None
    outcome: str | None = None
    """"allowed" or "denied" after a press; "ended" when it ended otherwise (timed out, stopped, turn over: the
    sink's line); "gone" when a press found it ended before the sink marked it (the sink's line still replaces
    the press's "no longer pending")."""
    origin: tuple[str, ...] = ()
    """A subagent's request (``run_subagent``): the child sessions it came through; the press names them."""
    line: str | None = None
    """The outcome line its message is to show (the newest way it ended)."""
    shown: str | None = None
    """The outcome line last edited onto its message."""
    editing: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    """Held while its message is edited to show an outcome: those edits are made one at a time."""

    def ends(self, outcome: str, line: str) -> None:
        """It ended (``outcome``) and its message is to show ``line`` (``ApprovalButtons.show_outcome``). Set
        together, without a pause, so a check of ``outcome`` and the line it leads to cannot be split."""
        self.outcome, self.line = outcome, line


def request_parts(tool_name: str, arguments: Sequence[ShownArgument], limit: int = MESSAGE_LIMIT,
                  label: str | None = None) -> list[str]:
    """The approval request as message texts, each within ``limit`` (the last with room for the outcome).

    Key arguments are never shortened; when the whole request does not fit one message, the others are
    cut to an equal share of the room left (at least ``MIN_SHOWN`` characters each), and what still does
    not fit one message is split over several, nothing dropped."""
    budget = max(limit - OUTCOME_ROOM, 64)
    header = f"🔧 Approval needed: {tool_name}"
    if label:  # a subagent asks: say which one (its profile and task), so the chat knows whose call it is
        header += f"\n🤖 asked by subagent {label}"
    lines = [header, *(f"{a.name}={a.value}" for a in arguments if a.key)]
    others = [a for a in arguments if not a.key]
    full = [f"{a.name}={a.value}" for a in others]
    if utf16_len("\n".join([*lines, *full])) <= budget:
        return ["\n".join([*lines, *full])]
    room = budget - utf16_len("\n".join(lines)) - len(others)
    share = max(MIN_SHOWN, room // len(others)) if others else 0
    lines += [_shortened(a, share) for a in others]
    return _split_exactly("\n".join(lines), budget, f"🔧 {tool_name}, continued:")


def _shortened(argument: ShownArgument, units: int) -> str:
    """The argument's line in at most ``units`` UTF-16 units, its cut marked (the marker counts too)."""
    line = f"{argument.name}={argument.value}"
    if utf16_len(line) <= units:
        return line
    room = max(units - utf16_len(f"… ({len(line)} more characters not shown)"), 1)
    keep = line[:room]
    while len(keep) > 1 and utf16_len(keep) > room:
        keep = keep[:-1]
    return f"{keep}… ({len(line) - len(keep)} more characters not shown)"


def _split_exactly(text: str, limit: int, continued: str) -> list[str]:
    """Lines packed into parts of at most ``limit`` UTF-16 units; a longer line is cut anywhere. Unlike the
    reply splitter, no whitespace is dropped at a cut: what the person approves is shown exactly."""
    parts: list[str] = []
    current = ""
    fresh = f"{continued}\n"
    for line in text.split("\n"):
        candidate = f"{current}\n{line}" if current else line
        if utf16_len(candidate) <= limit:
            current = candidate
            continue
        if utf16_len(fresh + line) <= limit:  # it fits a message of its own: start one
            parts.append(current)
            current = fresh + line
            continue
        current = f"{current}\n" if current else current  # too long for any message: cut it anywhere
        for char in line:
            if utf16_len(current) + utf16_len(char) > limit:
                parts.append(current)
                current = fresh
            current += char
    parts.append(current)
    return parts


def _record(entry: PendingApproval) -> Record:
    """What a restart needs to close the request, and a press in another process to decide it."""
    record: Record = {"ref": entry.ref, "session": entry.session_key, "call": entry.call_id,
                      "by": entry.requested_by, "chat_id": entry.chat_id, "tool": entry.tool_name,
                      "text": entry.parts[-1]}
    if entry.origin:
        record["origin"] = list(entry.origin)
    if entry.message_id is not None:  # shown: a restart can close it
        record["message_id"] = entry.message_id
    return record


def outcome_text(entry: PendingApproval, line: str) -> str:
    """The last part of the request with how it ended appended (the edit that removes the keyboard)."""
    last = entry.parts[-1] if entry.parts else f"🔧 Approval needed: {entry.tool_name}"
    return f"{last}\n\n{line[:OUTCOME_ROOM - 4]}"


def presser(query: CallbackQuery) -> Decider:
    """Who pressed, for core: their id, the username Telegram vouches for, and the name the chat shows."""
    user = query.from_user
    username = vouched_username(user)
    return Decider(str(user.id), (username,) if username else (), sender_name(user))


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
        self._open = OpenApprovals(channel.host, self._open_records)
        channel.host.set_deciders(channel.settings.allow_from)

    # ---- what a restart must close ------------------------------------------------------------------

    async def posted(self, entry: PendingApproval) -> None:
        """The request is about to be shown (``message_id`` None) or is shown with its buttons: remember it
        durably until it ends (so a press that reaches another process finds it)."""
        await self._save()

    async def close_left_over(self) -> None:
        """Start-up: every request a previous process left with live buttons says the restart denied it."""
        await self._open.close_left_over(self._close)

    async def _close(self, item: Record) -> bool:
        """Close one request a previous process left: True once it shows the restart denied it, or at least no
        longer has its keyboard (or is gone); False when Telegram refused both edits (the record is kept and the
        close tried again)."""
        chat_id, message_id = int(item["chat_id"]), int(item["message_id"])
        entry = PendingApproval("", "", "", str(item["tool"]), None, chat_id, (str(item["text"]),), message_id)
        return await self._edit_outcome(chat_id, message_id, outcome_text(entry, RESTARTED))

    def _open_records(self) -> list[Record]:
        return [_record(e) for e in self._by_ref.values() if e.outcome is None and e.parts]

    async def _find(self, ref: str) -> PendingApproval | None:
        """A request another process posted (or this one, before it was forgotten), from its record."""
        item = await self._open.find(lambda r: r.get("ref") == ref)
        if item is None:
            return None
        try:
            origin = item.get("origin") or []
            by = item.get("by")
            shown = item.get("message_id")
            return PendingApproval(ref, str(item["session"]), str(item["call"]), str(item["tool"]),
                                   None if by is None else str(by), int(item["chat_id"]), (str(item["text"]),),
                                   None if shown is None else int(shown), origin=tuple(str(o) for o in origin))
        except (KeyError, TypeError, ValueError):
            return None  # not readable: nothing anyone can press on

    async def _save(self) -> None:
        await self._open.save()

    def register(self, session_key: str, call_id: str, tool_name: str, arguments: Sequence[ShownArgument],
                 requested_by: str | None, chat_id: int, *, origin: tuple[str, ...] = (),
                 label: str | None = None) -> PendingApproval:
        entry = PendingApproval(secrets.token_urlsafe(9), session_key, call_id, tool_name, requested_by, chat_id,
                                tuple(request_parts(tool_name, arguments, self._channel.limit, label)),
                                origin=origin)
        self._by_ref[entry.ref] = entry
        self._forget_ended()
        return entry

    def _forget_ended(self) -> None:
        """Past ``MAX_REMEMBERED``, forget the oldest requests that ended. An open one is never forgotten, however
        old: a press on it must still decide it, and the record (made from what is remembered) must keep it for a
        restart to close."""
        excess = len(self._by_ref) - MAX_REMEMBERED
        if excess > 0:
            for ref in [r for r, e in self._by_ref.items() if e.outcome is not None][:excess]:
                del self._by_ref[ref]

    def get(self, ref: str) -> PendingApproval | None:
        return self._by_ref.get(ref)

    def _same_chat(self, chat_id: int, entry: PendingApproval) -> bool:
        """Whether a message in ``chat_id`` may be ``entry``'s (its chat, or the supergroup it became)."""
        return chat_id == entry.chat_id or self._channel.client.moved.get(entry.chat_id) == chat_id

    def _other_copy(self, message: Message | None, entry: PendingApproval) -> Message | None:
        """The pressed message when it is not the one ``entry`` knows as its own (a copy whose post was
        answered too late, or the request's message before its post's answer told where it is)."""
        if message is None or (entry.message_id is not None and message.message_id == entry.message_id
                               and self._same_chat(message.chat.id, entry)):
            return None
        return message

    async def on_press(self, query: CallbackQuery) -> None:
        """Handle one callback query: always answered, at most one decision."""
        parsed = parse(query.data)
        if parsed is None:
            await self._answer(query)
            return
        ref, decision = parsed
        entry = self._by_ref.get(ref)
        message = query.message if isinstance(query.message, Message) else None
        if entry is None:
            # Posted by another process (or forgotten here): its record says what the press decides, whether or
            # not it has the message id yet (the poster saves it once Telegram answered the post).
            elsewhere = await self._find(ref)
            if elsewhere is not None and (message is None or self._same_chat(message.chat.id, elsewhere)):
                await self._press_elsewhere(query, elsewhere, decision, message)
                return
        if entry is not None and entry.message_id is None and message is not None \
                and self._same_chat(message.chat.id, entry):
            # The post's answer never came (its outcome unknown): the press says where the request is shown.
            entry.message_id = message.message_id
            if entry.outcome is None:
                try:
                    await self._save()  # a restart can close it now
                except Exception as exc:  # the press still decides; the id goes with the next save
                    log.warning("could not record where the approval request for %s is shown: %s",
                                entry.tool_name, exc)
        if entry is None or entry.outcome is not None:
            decided = entry is not None and entry.outcome in ("allowed", "denied")
            await self._answer(query, f"Already {entry.outcome}." if entry is not None and decided else GONE)
            if message is not None:
                await self._drop_keyboard(message.chat.id, message.message_id)
            return
        copy = self._other_copy(message, entry)
        result = await self._decide(query, entry, decision)
        if result is None:
            return
        if result is DecideResult.REFUSED:
            await self._answer(query, NOT_YOURS, alert=True)
            return
        if result is DecideResult.NOT_PENDING:
            # It ended before this press. Unless the sink marked it meanwhile (or a press decided it), how it
            # ended is the sink's to say; the message says "no longer pending" at once (without its buttons)
            # in case no sink comes, and the sink's line replaces it when it does (``TelegramPrompts.ended``).
            first = entry.outcome is None
            if first:
                entry.ends("gone", NO_LONGER_PENDING)
            await self._answer(query, GONE)
            if first:
                await self.show_outcome(entry)
            if copy is not None:
                await self._drop_keyboard(copy.chat.id, copy.message_id)
            return
        who = sender_name(query.from_user)
        mark = "✅ Allowed" if decision == "allow" else "❌ Denied"
        entry.ends("allowed" if decision == "allow" else "denied", f"{mark} by {who}")
        await self._answer(query, "Allowed" if decision == "allow" else "Denied")
        await self.show_outcome(entry)
        if copy is not None:  # a second copy of the request: it shows the decision too, without buttons
            await self._edit_outcome(copy.chat.id, copy.message_id, outcome_text(entry, f"{mark} by {who}"))

    async def _press_elsewhere(self, query: CallbackQuery, entry: PendingApproval,
                               decision: Literal["allow", "deny"], message: Message | None) -> None:
        """A press on a request another process posted: decided where the approval is pending; the message
        is left to the posting process's sink, which shows how the approval ended once. A message that process
        may not know as the request's (its record has no message id yet, or names another) is edited here."""
        result = await self._decide(query, entry, decision)
        if result is None:
            return
        copy = self._other_copy(message, entry)
        if result is DecideResult.REFUSED:
            await self._answer(query, NOT_YOURS, alert=True)
        elif result is DecideResult.NOT_PENDING:
            await self._answer(query, GONE)
            if any(r.get("ref") == entry.ref for r in self._open.left_over) and entry.message_id is not None:
                # left by this process's last run, its close failed so far: close it now
                await self._edit_outcome(entry.chat_id, entry.message_id, outcome_text(entry, RESTARTED))
            if copy is not None and entry.message_id is not None:  # a second copy (the poster edits its own)
                await self._drop_keyboard(copy.chat.id, copy.message_id)
        else:
            await self._answer(query, "Allowed" if decision == "allow" else "Denied")
            if copy is not None:
                mark = "✅ Allowed" if decision == "allow" else "❌ Denied"
                await self._edit_outcome(copy.chat.id, copy.message_id,
                                         outcome_text(entry, f"{mark} by {sender_name(query.from_user)}"))

    async def _decide(self, query: CallbackQuery, entry: PendingApproval,
                      decision: Literal["allow", "deny"]) -> DecideResult | None:
        """The press's decision, from core (forwarded to the process holding the approval); None when it could
        not be made (core or the relay failed): the press is answered "please press again" and nothing changed,
        rather than Telegram's spinner turning until the client gives up."""
        try:
            return await self._channel.host.decide(entry.session_key, entry.call_id, decision,
                                                   decided_by=presser(query), origin=entry.origin)
        except Exception as exc:
            log.warning("a press on the approval for %s could not be decided (%s): the user was told to press "
                        "again", entry.tool_name, exc, exc_info=exc)
            await self._answer(query, PRESS_NOT_TAKEN)
            return None

    async def show_outcome(self, entry: PendingApproval) -> None:
        """Edit the approval message to show how it ended (``entry.line``); the edit has no keyboard, so the
        buttons go. It answers a press, so it goes at once (honouring a 429 pause, without waiting for a pace
        slot). One request's edits go one at a time, each with the newest line, and a line already shown is not
        edited again: whichever of a press's "no longer pending" and the sink's line comes first, the sink's
        stays."""
        if entry.ref:  # one of this run's: it is no longer open
            await self._save()
        async with entry.editing:
            line = entry.line
            if entry.message_id is None or line is None or line == entry.shown:
                return
            entry.shown = line
            await self._edit_outcome(entry.chat_id, entry.message_id, outcome_text(entry, line))

    async def _edit_outcome(self, chat_id: int, message_id: int, text: str) -> bool:
        """Edit one approval message to ``text`` without its keyboard (failing that, remove the keyboard). True
        when no live button is left on it (edited, already so, or the message is gone)."""
        try:
            await self._channel.client.call(EditMessageText(
                chat_id=chat_id, message_id=message_id, text=text, parse_mode=None),
                chat=str(chat_id), paced=False)
            return True
        except PlatformError as exc:
            if exc.kind == "not_found":
                return True
            log.info("could not show the approval outcome in chat %s: %s", chat_id, exc)
        return await self._drop_keyboard(chat_id, message_id)

    async def _drop_keyboard(self, chat_id: int, message_id: int) -> bool:
        """Remove a message's keyboard; True when none is left (removed, already gone, or no such message)."""
        try:
            await self._channel.client.call(EditMessageReplyMarkup(chat_id=chat_id, message_id=message_id),
                                            chat=str(chat_id), paced=False)
            return True
        except PlatformError as exc:
            log.debug("could not remove an approval keyboard in chat %s: %s", chat_id, exc)
            return exc.kind == "not_found"

    async def _answer(self, query: CallbackQuery, text: str | None = None, *, alert: bool = False) -> None:
        try:
            await self._channel.client.call(AnswerCallbackQuery(
                callback_query_id=query.id, text=text, show_alert=alert or None))
        except PlatformError as exc:
            log.debug("answerCallbackQuery failed: %s", exc)
