"""The one connection that writes, and group commit.

Every write is one SQL statement in autocommit mode, run through aiosqlite's public API: the statement is
the transaction, so a write is atomic without BEGIN/COMMIT round trips, and one that fails leaves nothing
behind. Each round trip to aiosqlite's thread and each WAL commit costs, so writes are batched: they queue
while a statement runs, and the next batch merges them, every session write into one statement, every
admission into another and every delivery mark into a third (``core.sqlite.writes``). A busy store thus
pays one round trip, one temporary table and one commit per batch rather than per write; an idle one sends
each write at once. A merged statement that fails is retried write by write, so a write still fails alone.
Other writes run as they are.

A write made while the writer is idle runs at once in its caller's task. Writes made while a statement is
under way queue, and one task of the store's own serves the queue (its results go to many callers, so no
caller's cancellation may stop it). That task runs under the store's own supervisor, as aiosqlite's thread
belongs to the store: it starts with the connection and ends when the store closes, after every write
queued before. It is not under core's supervisor on purpose: core ends its tasks before it closes the
store, and the writes those tasks made must still land.

A write whose caller is cancelled before its batch starts never happens; once its statement is on its way,
it lands (or fails) as if the caller had waited.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import aiosqlite

from core.sqlite import writes
from core.sqlite.errors import store_errors
from core.sqlite.writes import Admission, SessionWrite
from core.store import StoreError
from core.supervisor import TaskSupervisor

Params = Sequence[Any] | Mapping[str, Any]
Row = tuple[Any, ...]
"""Rows come back as plain tuples (no row factory): columns are read by position, in the order selected."""

MAX_MERGED = 256
"""Writes merged into one statement, at most. A burst of new conversations (a thousand chats writing at once)
lands in a few statements, so its turns start together: at 64 a statement the user messages of a thousand
chats landed over 6.7 s on a busy 2-core host, at 256 within 1.3 s (``tests.bench.e2e``, Slack at 1,000 chats).
With ``MAX_PARAMS`` the padded statement stays under 24,000 bound values."""
MAX_PARAMS = 16_000
"""Bound values in one merged statement, at most (SQLite allows 32,766); a larger write runs alone."""


Kind = Literal["session", "admission", "delivery", "statement"]
"""What a write is: the first three kinds are merged with others of their kind, a statement runs as it is."""


@dataclass(slots=True, eq=False)
class _Write:
    kind: Kind
    payload: Any
    future: asyncio.Future[Any]


class Writer:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._queue: collections.deque[_Write] = collections.deque()
        self._wake = asyncio.Event()
        self._busy = False
        """A statement is under way (in a caller or in the writer's task): new writes queue."""
        self._closing = False
        self._supervisor = TaskSupervisor("sqlite-store")  # see the module docstring; close() ends it
        self._task = self._supervisor.spawn("sqlite-writer", self._serve())

    async def write(self, op: str, sql: str, params: Params = ()) -> list[Row]:
        """Run one write statement, as it is; its rows (RETURNING)."""
        return cast(list[Row], await self._submit(op, "statement", (sql, params)))

    async def session_write(self, op: str, write: SessionWrite) -> list[Row]:
        """Run one session write (merged with others); its rows (``writes.RETURNING``), none when its
        expectations did not hold."""
        return cast(list[Row], await self._submit(op, "session", write))

    async def admit(self, op: str, admission: Admission) -> int | None:
        """Keep one inbound message (merged with others); its seq, or None when its event was marked."""
        return cast(int | None, await self._submit(op, "admission", admission))

    async def mark_delivered(self, op: str, turn_id: str, at: float) -> None:
        """Record that a turn's terminal content is visible (merged with others)."""
        await self._submit(op, "delivery", (turn_id, at))

    async def close(self) -> None:
        """Writes already made complete first."""
        self._closing = True
        self._wake.set()
        await self._task
        await self._supervisor.shutdown(0)
        await self._conn.close()

    async def _submit(self, op: str, kind: Kind, payload: Any) -> Any:
        if self._closing:
            raise StoreError(f"sqlite store: {op} called while the store is closed")
        item = _Write(kind, payload, asyncio.get_running_loop().create_future())
        if self._busy or self._queue:
            self._queue.append(item)
            self._wake.set()
        else:  # idle: run it here, and let the writer's task know when it is done
            self._busy = True
            try:
                await self._run_batch({kind: [item]})
            finally:
                self._busy = False
                if self._queue:
                    self._wake.set()
        with store_errors(op):
            return await item.future

    # ---- the writer's task

    async def _serve(self) -> None:
        while True:
            if self._busy or not self._queue:
                if self._closing and not self._busy and not self._queue:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            self._busy = True
            try:
                await self._run_batch(self._take())
            finally:
                self._busy = False

    async def _run_batch(self, batch: dict[Kind, list[_Write]]) -> None:
        try:
            if admissions := batch.get("admission"):
                await self._admissions(admissions)
            if sessions := batch.get("session"):
                await self._sessions(sessions)
            if deliveries := batch.get("delivery"):
                await self._deliveries(deliveries)
            for item in batch.get("statement", ()):
                sql, params = item.payload
                await self._run(item, sql, params)
        except Exception as exc:  # a defect here must not stop every later write
            for items in batch.values():
                for item in items:
                    _settle(item, exc=exc)

    def _take(self) -> dict[Kind, list[_Write]]:
        """The next batch: what is queued, up to the merge limits; two writes of one session never share a
        statement (each is computed from the session as it was), so the second waits for the next batch."""
        sessions: list[_Write] = []
        admissions: list[_Write] = []
        deliveries: list[_Write] = []
        statements: list[_Write] = []
        keys: set[str] = set()
        params = 0
        while self._queue:
            item = self._queue[0]
            if item.future.done():  # its caller was cancelled: it never happens
                self._queue.popleft()
                continue
            if item.kind == "session":
                write: SessionWrite = item.payload
                size = 19 + 9 * len(write.messages)
                if sessions and (write.key in keys or len(sessions) == MAX_MERGED or params + size > MAX_PARAMS):
                    break
                keys.add(write.key)
                params += size
                sessions.append(item)
            elif item.kind == "admission" or item.kind == "delivery":
                merged = admissions if item.kind == "admission" else deliveries
                if len(merged) == MAX_MERGED:
                    break
                merged.append(item)
            else:
                statements.append(item)
            self._queue.popleft()
        return {"session": sessions, "admission": admissions, "delivery": deliveries, "statement": statements}

    async def _sessions(self, items: list[_Write]) -> None:
        sql, params = writes.session_writes([item.payload for item in items])
        try:
            found = await self._conn.execute_fetchall(sql, params)
        except Exception as exc:
            await self._alone(items, self._sessions, exc)
            return
        by_write: list[list[Row]] = [[] for _ in items]
        for row in found:
            if row[0] >= 0:
                by_write[row[0]].append(row)
        for item, rows in zip(items, by_write, strict=True):
            _settle(item, rows)

    async def _admissions(self, items: list[_Write]) -> None:
        admissions = [cast(Admission, item.payload) for item in items]
        sql, params = writes.admissions(admissions)
        try:
            found = await self._conn.execute_fetchall(sql, params)
        except Exception as exc:
            await self._alone(items, self._admissions, exc)
            return
        for item, seq in zip(items, writes.admitted(admissions, cast(list[Row], found)), strict=True):
            _settle(item, seq)

    async def _deliveries(self, items: list[_Write]) -> None:
        sql, params = writes.deliveries([cast(tuple[str, float], item.payload) for item in items])
        try:
            await self._conn.execute_fetchall(sql, params)
        except Exception as exc:
            await self._alone(items, self._deliveries, exc)
            return
        for item in items:
            _settle(item)

    async def _alone(self, items: list[_Write], run: Any, exc: Exception) -> None:
        """A merged statement failed: each write again on its own, so only the one at fault fails."""
        if len(items) == 1:
            _settle(items[0], exc=exc)
            return
        for item in items:
            await run([item])

    async def _run(self, item: _Write, sql: str, params: Params) -> None:
        try:
            found = await self._conn.execute_fetchall(sql, params)
        except Exception as exc:
            _settle(item, exc=exc)
            return
        _settle(item, list(found))


def _settle(item: _Write, result: Any = None, *, exc: BaseException | None = None) -> None:
    if item.future.done():  # its caller was cancelled meanwhile; the write landed (or failed) regardless
        return
    if exc is not None:
        item.future.set_exception(exc)
    else:
        item.future.set_result(result)
