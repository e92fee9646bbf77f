"""The one connection that writes.

Every write is one SQL statement (``core.sqlite.writes``), run through aiosqlite's public API in autocommit
mode: the statement is the transaction, so a write is atomic without BEGIN/COMMIT round trips, and one that
fails leaves nothing behind. aiosqlite runs a connection's calls one at a time, in the order they were made,
on its own thread, so writes never interleave and the event loop never waits on SQLite.

``write`` returns the statement's rows (its RETURNING clause), fetched in the same call, which also ends the
statement and so commits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import aiosqlite

from core.sqlite.errors import store_errors

Params = Sequence[Any] | Mapping[str, Any]
Row = tuple[Any, ...]
"""Rows come back as plain tuples (no row factory): columns are read by position, in the order selected."""


class Writer:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def write(self, op: str, sql: str, params: Params = ()) -> list[Row]:
        """Run one write statement; its rows. A caller cancelled while it runs does not stop it: the write
        lands (or fails) as if it had waited."""
        with store_errors(op):
            return cast(list[Row], await self._conn.execute_fetchall(sql, params))

    async def close(self) -> None:
        """Writes already made complete first (aiosqlite closes after its queued calls)."""
        await self._conn.close()
