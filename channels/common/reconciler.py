"""Reconciling a ledger with the desired parts using the fewest platform calls.

Edit a part whose content changed, send a part that is missing, delete a surplus part. While streaming,
frozen parts (every message but the last, once the reply outgrew it) are left alone; the final reconcile
makes every message equal its final rendering. Each call repeats a target state ("message 2 shows X"),
never "append Y", so a retried reconcile cannot duplicate text; the ledger records only accepted calls.
A send carries an idempotency key that stays the same until that send is accepted, so a platform that
honours one (Feishu's ``uuid``) never posts a retried send twice.
"""

from __future__ import annotations

import uuid
from typing import Protocol

from channels.common.errors import PlatformError
from channels.common.ledger import Ledger, Part


class ReconcileOps(Protocol):
    """The three calls a reconcile makes (already paced and retried). Raise ``PlatformError`` on failure."""

    async def send(self, part: Part, key: str) -> str:
        """Post a new message; returns its id."""
        ...

    async def edit(self, message_id: str, part: Part) -> None: ...

    async def delete(self, message_id: str) -> None: ...


class Reconciler:
    def __init__(self, ops: ReconcileOps, ledger: Ledger | None = None) -> None:
        self.ops = ops
        self.ledger = ledger or Ledger()
        self._keys: dict[int, str] = {}

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

    async def apply(self, desired: list[Part], *, final: bool, open_last: bool = True) -> None:
        """Make the chat show ``desired``. While streaming (not ``final``), frozen messages are left alone
        and, once every call succeeded, every message but the last (all of them: ``open_last=False``) is
        frozen."""
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
                key = self._keys.setdefault(i, uuid.uuid4().hex)
                message_id = await self.ops.send(part, key)
                del self._keys[i]
                ledger.accepted_send(message_id, part)
        # surplus messages (the reply got shorter, e.g. a retried model answer): newest first
        for i in range(len(ledger) - 1, len(desired) - 1, -1):
            if ledger.entries[i].frozen and not final:
                continue
            await self.ops.delete(ledger.entries[i].message_id)
            ledger.accepted_delete(i)
        if not final:
            ledger.freeze(len(ledger) - 1 if open_last else len(ledger))
