"""Approval requests a restart must close, for every platform with approval buttons, and the requests of
every process a press may need to find.

Approvals do not outlive the process (a restart ends the turn that waited for them), but their buttons
would. So every posted request that has not ended is kept in the channel's durable state, rewritten whenever
that set changes: a JSON list with one record per request, shaped by the platform, under a name of the
process's own (``open_approvals:<process id>``; ``open_approvals`` for a process alone on its database,
``core.processes``). Processes sharing one store therefore never overwrite each other's records.

Closing: a request is closed by editing it to say the restart denied it (``RESTARTED``), so a button nobody
can act on never looks live. At start, before the channel reads its first input, a process closes the
requests it left itself (alone on its database: the previous run's) and those of every process that is
no longer alive; while several processes share the store, it looks again every lease ``ttl`` for
processes that died since. A dead process's records are closed by the one process that claims it
(``Processes.claim``), then forgotten; a live process's are never touched. A press on a closed button later
finds nothing pending and is answered "no longer pending" by the platform's own press handling.

Finding: a press may reach a process other than the one that posted the request (the one receiving the
platform's presses while another runs the turn). ``find`` looks through every process's records for the
one the button names, which says what the press decides (``core.host.ChannelHost.decide`` forwards it to the
process holding the approval). So a record is saved before its buttons are shown, and again once the
platform said where they are.

The platform supplies the records of its open requests and how to close one from its record; a record it
cannot read (a ``KeyError``, ``TypeError`` or ``ValueError`` while closing) is skipped, and its own
platform errors are its business (logged, never raised). Unreadable state never keeps a channel from
starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from core.processes import Processes

log = logging.getLogger(__name__)

OPEN_APPROVALS = "open_approvals"
RESTARTED = "⛔ Denied: the bridge restarted."

Record = dict[str, Any]
Close = Callable[[Record], Awaitable[None]]
T = TypeVar("T")


class ChannelState(Protocol):
    """The part of ``core.host.ChannelHost`` this needs: the channel's small durable values, which
    processes are alive, and supervised tasks."""

    @property
    def channel(self) -> str: ...

    async def get_state(self, name: str) -> str | None: ...

    async def set_state(self, name: str, value: str) -> None: ...

    async def state_names(self, prefix: str) -> list[str]: ...

    async def delete_state(self, name: str) -> None: ...

    @property
    def processes(self) -> Processes: ...

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]: ...


def state_name(process: str) -> str:
    """Where the process ``process`` keeps its open requests."""
    return f"{OPEN_APPROVALS}:{process}" if process else OPEN_APPROVALS


def process_of(name: str) -> str | None:
    """The process whose records a state name holds; None for a name that is not such a record."""
    if name == OPEN_APPROVALS:
        return ""
    head, sep, process = name.partition(":")
    return process if head == OPEN_APPROVALS and sep and process else None


def _records(raw: str | None) -> list[Any]:
    left = json.loads(raw) if raw else []
    return left if isinstance(left, list) else []


class OpenApprovals:
    def __init__(self, state: ChannelState, records: Callable[[], list[Record]]) -> None:
        """``records``: the records of the requests this process posted that are still open, now."""
        self._state = state
        self._records = records
        self._saving = asyncio.Lock()
        self._sweeping: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return state_name(self._state.processes.id)

    async def save(self) -> None:
        """Record the open requests as they are now (call it whenever one is posted or ends)."""
        async with self._saving:  # one writer at a time, each writing the newest state
            try:
                await self._state.set_state(self.name, json.dumps(self._records()))
            except Exception as exc:
                log.warning("could not record the open approval requests: %s", exc)

    async def close_left_over(self, close: Close) -> None:
        """Start-up: ``close`` every request this process's previous run, or a process no longer alive, left
        open (each shows ``RESTARTED``); while the store is shared, keep closing those of processes that die."""
        await self._close_left(close, own=True)
        processes = self._state.processes
        if processes.shared and self._sweeping is None:
            self._sweeping = self._state.spawn(f"{self._state.channel}:approvals:sweep",
                                               self._sweep(close, processes.ttl))

    async def _sweep(self, close: Close, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await self._close_left(close, own=False)

    async def _close_left(self, close: Close, *, own: bool) -> None:
        processes = self._state.processes
        try:
            names = await self._state.state_names(OPEN_APPROVALS)
        except Exception as exc:  # unreadable state must not keep the channel from starting
            log.warning("could not list the approval requests left open: %s", exc)
            return
        for name in names:
            process = process_of(name)
            if process is None:
                continue
            if process == processes.id:
                if own:
                    await self._close_own(name, close)
                continue
            try:
                if not await processes.claim(process):
                    continue  # alive, or another process is closing its requests
            except Exception as exc:
                log.warning("could not tell whether process %s is gone: %s", process, exc)
                continue
            try:
                closed = await self._close_all(name, close)
                await self._state.delete_state(name)
                if closed:
                    log.info("closed %d approval request(s) left open by process %s, which is gone", closed,
                             process)
            except Exception as exc:
                log.warning("could not close the approval requests left by process %s: %s", process, exc)
            finally:
                try:
                    await processes.unclaim(process)
                except Exception as exc:  # its claim expires on its own
                    log.debug("could not release the claim on process %s: %s", process, exc)

    async def _close_own(self, name: str, close: Close) -> None:
        try:
            closed = await self._close_all(name, close)
        except Exception as exc:  # unreadable state must not keep the channel from starting
            log.warning("could not read the approvals left open by the last run: %s", exc)
            return
        if closed:
            log.info("closed %d approval request(s) left open by the last run", closed)
            await self.save()

    async def _close_all(self, name: str, close: Close) -> int:
        left = _records(await self._state.get_state(name))
        for item in left:
            try:
                await close(item)
            except (KeyError, TypeError, ValueError):
                continue
        return len(left)

    async def find(self, match: Callable[[Record], bool]) -> Record | None:
        """The first open request, of any process, that ``match`` accepts (None when none does, or the state
        cannot be read)."""
        try:
            names = [n for n in await self._state.state_names(OPEN_APPROVALS) if process_of(n) is not None]
            values = await asyncio.gather(*(self._state.get_state(n) for n in names))
        except Exception as exc:
            log.warning("could not read the open approval requests: %s", exc)
            return None
        for raw in values:
            try:
                left = _records(raw)
            except ValueError:
                continue
            for item in left:
                if isinstance(item, dict) and match(item):
                    return item
        return None
