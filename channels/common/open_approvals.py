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
(``Processes.claim``); a live process's are never touched. A press on a closed button later finds nothing
pending and is answered "no longer pending" by the platform's own press handling.

A record is forgotten only once its request is closed: ``close`` says whether it was (True; also when there
was nothing left to close), and one whose edit failed (the platform down, a 5xx) stays recorded — a left-over
of this process's own among the records it saves (``save``), a dead process's under that process's name — and
is tried again: in the background after ``RETRY`` seconds (each in turn, again from the first after a round
in which every close succeeded), and on every sweep while the store is shared. Whatever is still open after
the last of those waits is closed by the next start. Until then a press on such a button still finds its
record, and the platform's press handling shows the outcome on it.

Finding: a press may reach a process other than the one that posted the request (the one receiving the
platform's presses while another runs the turn). ``find`` looks through every process's records for the
one the button names, which says what the press decides (``core.host.ChannelHost.decide`` forwards it to the
process holding the approval). So a record is saved before its buttons are shown, and again once the
platform said where they are.

The platform supplies the records of its open requests and how to close one from its record; a record it
cannot read (a ``KeyError``, ``TypeError`` or ``ValueError`` while closing) is skipped, and its own
platform errors are its business (logged, never raised: it answers False, and the record is kept).
Unreadable state never keeps a channel from starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar

from core.processes import Processes

log = logging.getLogger(__name__)

OPEN_APPROVALS = "open_approvals"
RESTARTED = "⛔ Denied: the bridge restarted."

RETRY: tuple[float, ...] = (1.0, 2.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds between the background tries of the closes that failed (about nine minutes in all)."""

Record = dict[str, Any]
Close = Callable[[Record], Awaitable[bool]]
"""Closes one request from its record: True once it shows it ended (or nothing is left to close), False when
the platform refused the edit (it is kept, and tried again). Raises ``KeyError``, ``TypeError`` or
``ValueError`` for a record it cannot read (which is dropped)."""
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


async def _close_all(records: Iterable[Any], close: Close) -> list[Record]:
    """Close each request; the records of those whose close failed (a record ``close`` cannot read is dropped:
    no later try would read it either)."""
    kept: list[Record] = []
    for item in records:
        try:
            if not await close(item):
                kept.append(item)
        except (KeyError, TypeError, ValueError):
            continue
        except Exception as exc:  # a platform's own errors are its business; one that escapes: try again
            log.warning("closing an approval request left open failed: %s", exc)
            kept.append(item)
    return kept


class OpenApprovals:
    def __init__(self, state: ChannelState, records: Callable[[], list[Record]]) -> None:
        """``records``: the records of the requests this process posted that are still open, now."""
        self._state = state
        self._records = records
        self._left: list[Record] = []
        """Requests an earlier run of this process left open whose close failed so far (saved with ours)."""
        self._saving = asyncio.Lock()
        self._sweeping: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return state_name(self._state.processes.id)

    @property
    def left_over(self) -> list[Record]:
        """The records of the requests an earlier run left open that could not be closed yet."""
        return list(self._left)

    async def save(self) -> None:
        """Record the open requests as they are now (call it whenever one is posted or ends)."""
        async with self._saving:  # one writer at a time, each writing the newest state
            try:
                await self._state.set_state(self.name, json.dumps(self._records() + self._left))
            except Exception as exc:
                log.warning("could not record the open approval requests: %s", exc)

    async def close_left_over(self, close: Close) -> None:
        """Start-up: ``close`` every request this process's previous run, or a process no longer alive, left
        open (each shows ``RESTARTED``); while the store is shared, keep closing those of processes that die;
        and try again, in the background, those whose close failed."""
        failed = await self._close_left(close, own=True)
        processes = self._state.processes
        if (processes.shared or failed) and self._sweeping is None:
            self._sweeping = self._state.spawn(
                f"{self._state.channel}:approvals:sweep",
                self._sweep(close, processes.ttl if processes.shared else None, failed=failed))

    async def _sweep(self, close: Close, every: float | None, *, failed: bool) -> None:
        """``every``: the lease ttl while the store is shared (look for processes that died), None alone (only
        the failed closes are tried again, ``RETRY``)."""
        tries = 0
        while True:
            if failed and tries < len(RETRY):
                wait = RETRY[tries] if every is None else min(RETRY[tries], every)
                tries += 1
            elif every is not None:
                wait = every
            else:
                if failed:
                    log.warning("%d approval request(s) left open could not be closed; the next start tries "
                                "again", len(self._left))
                return
            await asyncio.sleep(wait)
            failed = await self._retry_own(close)
            failed = await self._close_left(close, own=False) or failed
            if not failed:
                tries = 0

    async def _close_left(self, close: Close, *, own: bool) -> bool:
        """Close what the last run (``own``) and the processes no longer alive left open; True when some close
        failed (and its record was kept)."""
        processes = self._state.processes
        try:
            names = await self._state.state_names(OPEN_APPROVALS)
        except Exception as exc:  # unreadable state must not keep the channel from starting
            log.warning("could not list the approval requests left open: %s", exc)
            return False
        failed = False
        for name in names:
            process = process_of(name)
            if process is None:
                continue
            if process == processes.id:
                if own:
                    failed = await self._close_own(name, close) or failed
                continue
            try:
                if not await processes.claim(process):
                    continue  # alive, or another process is closing its requests
            except Exception as exc:
                log.warning("could not tell whether process %s is gone: %s", process, exc)
                continue
            try:
                left = _records(await self._state.get_state(name))
                kept = await _close_all(left, close)
                if kept:
                    await self._state.set_state(name, json.dumps(kept))  # tried again later
                    failed = True
                else:
                    await self._state.delete_state(name)
                if len(left) > len(kept):
                    log.info("closed %d approval request(s) left open by process %s, which is gone",
                             len(left) - len(kept), process)
                if kept:
                    log.warning("could not close %d approval request(s) left open by process %s yet", len(kept),
                                process)
            except Exception as exc:
                log.warning("could not close the approval requests left by process %s: %s", process, exc)
            finally:
                try:
                    await processes.unclaim(process)
                except Exception as exc:  # its claim expires on its own
                    log.debug("could not release the claim on process %s: %s", process, exc)
        return failed

    async def _close_own(self, name: str, close: Close) -> bool:
        """The requests this process's previous run left: closed, or kept (True) to be tried again."""
        try:
            left = _records(await self._state.get_state(name))
        except Exception as exc:  # unreadable state must not keep the channel from starting
            log.warning("could not read the approvals left open by the last run: %s", exc)
            return False
        if not left:
            return False
        self._left = await _close_all(left, close)
        if len(left) > len(self._left):
            log.info("closed %d approval request(s) left open by the last run", len(left) - len(self._left))
        if self._left:
            log.warning("could not close %d approval request(s) left open by the last run yet; trying again",
                        len(self._left))
        await self.save()
        return bool(self._left)

    async def _retry_own(self, close: Close) -> bool:
        """Try again the closes of the last run's requests that failed; True when some still failed."""
        if not self._left:
            return False
        before = len(self._left)
        self._left = await _close_all(self._left, close)
        if len(self._left) < before:
            log.info("closed %d approval request(s) left open by the last run", before - len(self._left))
            await self.save()
        return bool(self._left)

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
