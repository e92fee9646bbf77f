"""Approval requests a restart must close, for every platform with approval buttons.

Approvals do not outlive the process (a restart ends the turn that waited for them), but their buttons
would. So every posted request that has not ended is kept in the channel's durable state
(``open_approvals``, a JSON list with one record per request, shaped by the platform), rewritten whenever
that set changes; and the next start edits each one left there to say the restart denied it (``RESTARTED``),
before the channel reads its first input, so a button nobody can act on never looks live. A press on such
a button later finds nothing pending in the new process and is answered "no longer pending" by the
platform's own press handling.

The platform supplies the records of its open requests and how to close one from its record; a record it
cannot read (a ``KeyError``, ``TypeError`` or ``ValueError`` while closing) is skipped, and its own
platform errors are its business (logged, never raised). Unreadable state never keeps a channel from
starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

OPEN_APPROVALS = "open_approvals"
RESTARTED = "⛔ Denied: the bridge restarted."

Record = dict[str, Any]


class ChannelState(Protocol):
    """The part of ``core.host.ChannelHost`` this needs: the channel's small durable values."""

    async def get_state(self, name: str) -> str | None: ...

    async def set_state(self, name: str, value: str) -> None: ...


class OpenApprovals:
    def __init__(self, state: ChannelState, records: Callable[[], list[Record]]) -> None:
        """``records``: the records of the requests this process posted that are still open, now."""
        self._state = state
        self._records = records
        self._saving = asyncio.Lock()

    async def save(self) -> None:
        """Record the open requests as they are now (call it whenever one is posted or ends)."""
        async with self._saving:  # one writer at a time, each writing the newest state
            try:
                await self._state.set_state(OPEN_APPROVALS, json.dumps(self._records()))
            except Exception as exc:
                log.warning("could not record the open approval requests: %s", exc)

    async def close_left_over(self, close: Callable[[Record], Awaitable[None]]) -> None:
        """Start-up: ``close`` every request a previous process left open (it shows ``RESTARTED``)."""
        try:
            raw = await self._state.get_state(OPEN_APPROVALS)
            left = json.loads(raw) if raw else []
        except Exception as exc:  # unreadable state must not keep the channel from starting
            log.warning("could not read the approvals left open by the last run: %s", exc)
            return
        for item in left if isinstance(left, list) else []:
            try:
                await close(item)
            except (KeyError, TypeError, ValueError):
                continue
        if left:
            log.info("closed %d approval request(s) left open by the last run", len(left))
            await self.save()
