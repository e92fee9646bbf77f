"""Reading the SQLite database directly, for what tests check and the product never reads back."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Trace:
    session_key: str
    turn_id: str
    seq: int
    kind: str
    payload: dict[str, Any]


def traces(db: Path, key: str) -> list[Trace]:
    """A session's trace records, oldest first."""
    with sqlite3.connect(db) as conn:
        found = conn.execute("SELECT session_key, turn_id, seq, kind, payload FROM traces WHERE session_key = ?"
                             " ORDER BY seq", (key,)).fetchall()
    return [Trace(k, t, s, kind, json.loads(p)) for k, t, s, kind, p in found]


def rows(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()
