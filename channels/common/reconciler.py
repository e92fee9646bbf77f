"""Reconciling a ledger with the desired parts using the fewest platform calls.

Edit a part whose content changed, send a part that is missing, delete a surplus part. While streaming,
frozen parts (every message but the last, once the reply outgrew it) are left alone; the final reconcile
makes every message equal its final rendering. Each call repeats a target state ("message 2 shows X"),
never "append Y", so a retried reconcile cannot duplicate text; the ledger records only accepted calls.
A send carries an idempotency key that stays the same until that send is accepted, so a platform that
honours one (Feishu's ``uuid``) never posts a retried send twice. Such a platform answers a repeat with the
message first posted, showing what the first try carried, whatever the repeat carries: so a repeat carries
that same part again (the ledger then tells the truth), and an edit follows when the desired part has moved
on meanwhile (the turn may even have ended while the first try was on its way).

A new message may wait long for its slot (a bot's budget of new messages over all its chats), so what it
carries is decided when the slot comes, not when the reconcile began: ``apply``'s ``at_slot`` picks the part
then (the newest rendering), once per send, so every retry of it carries the same part under its key, and
the ledger records the part that was sent.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from typing import Protocol

from channels.common.errors import PlatformError
from channels.common.ledger import Ledger, Part


class ReconcileOps(Protocol):
    """The three calls a reconcile makes (already paced and retried). Raise ``PlatformError`` on failure."""

    async def send(self, content: Callable[[], Part], key: str) -> str:
        """Post a new message showing ``content()``, asked when the call is about to reach the platform (its
        slot came); returns the message's id."""
        ...

    async def edit(self, message_id: str, part: Part) -> None: ...

    async def delete(self, message_id: str) -> None: ...


class _Content:
    """What one send carries: ``booked`` unless ``decide`` picks another part, the first time the send's call asks
    (its slot came); from then on the same part, for every retry of the send."""

    def __init__(self, booked: Part, decide: Callable[[Part], Part] | None) -> None:
        self.part = booked
        self._decide = decide

    def __call__(self) -> Part:
        if self._decide is not None:
            self.part, self._decide = self._decide(self.part), None
        return self.part


class Reconciler:
    def __init__(self, ops: ReconcileOps, ledger: Ledger | None = None, *, honours_keys: bool = False) -> None:
        """``honours_keys``: the platform answers a repeated key with the first message (``idempotent_sends``)."""
        self.ops = ops
        self.ledger = ledger or Ledger()
        self.honours_keys = honours_keys
        self._tried: dict[int, tuple[str, Part | None]] = {}
        """Sends not accepted yet, by message index: the key, and the part the last try carried when it may
        have been carried out (None when the platform refused it: nothing was posted)."""

    def maybe_sent(self, index: int) -> bool:
        """Whether the last try of the send of message ``index``, not accepted, may have been carried out (it
        was not refused)."""
        tried = self._tried.get(index)
        return tried is not None and tried[1] is not None

    def pending(self, desired: list[Part], *, final: bool) -> bool:
        """Whether ``apply`` would make any call."""
        entries = self.ledger.entries
        if len(entries) > len(desired) and (final or any(not e.frozen for e in entries[len(desired):])):
            return True
        for i, part in enumerate(desired):
            if i >= len(entries):
                return True
            entry = entries[i]
            if entry.part.content != part.content and (final or not entry.frozen):
                return True
        return False

    async def apply(self, desired: list[Part], *, final: bool, open_last: bool = True,
                    at_slot: Callable[[int, Part], Part] | None = None) -> None:
        """Make the chat show ``desired``. While streaming (not ``final``), frozen messages are left alone
        and, once every call succeeded, every message but the last (all of them: ``open_last=False``) is
        frozen. ``at_slot(i, part)``: the part a new message ``i`` carries, asked when its send's slot came
        (``part`` is the one desired now)."""
        ledger = self.ledger
        for i, part in enumerate(desired):
            if i < len(ledger):
                entry = ledger.entries[i]
                if entry.part.content == part.content or (entry.frozen and not final):
                    continue
                try:
                    await self.ops.edit(entry.message_id, part)
                except PlatformError as exc:
                    if exc.kind == "not_found":  # the platform says it is gone: the ledger must not claim it
                        ledger.gone(i)
                    raise
                ledger.accepted_edit(i, part)
            else:
                tried = self._tried.get(i)
                key = tried[0] if tried is not None else uuid.uuid4().hex
                shows = tried[1] if tried is not None and self.honours_keys else None
                if shows is not None:
                    content = _Content(shows, None)  # what the chat shows if the earlier try was carried out
                else:
                    content = _Content(part, None if at_slot is None else partial(at_slot, i))
                try:
                    message_id = await self.ops.send(content, key)
                except BaseException as exc:
                    refused = isinstance(exc, PlatformError) and exc.kind != "transient" and not exc.outcome_unknown
                    self._tried[i] = (key, None if refused else content.part)
                    raise
                self._tried.pop(i, None)
                ledger.accepted_send(message_id, content.part)
                if shows is not None and content.part.content != part.content:
                    await self.ops.edit(message_id, part)
                    ledger.accepted_edit(i, part)
        # surplus messages (the reply got shorter, e.g. a retried model answer): newest first
        for i in range(len(ledger) - 1, len(desired) - 1, -1):
            if ledger.entries[i].frozen and not final:
                continue
            await self.ops.delete(ledger.entries[i].message_id)
            ledger.accepted_delete(i)
        if not final:
            ledger.freeze(len(ledger) - 1 if open_last else len(ledger))
