"""Every write of the SQLite store as SQL, each ONE statement, and how several writes become one statement.

One statement in autocommit mode is one atomic write and costs one round trip to aiosqlite's thread (the
only way to reach SQLite through its public API). So a write that touches several tables does it inside
SQLite: RETURNING hands back what the caller needs, UPSERT creates a session on first use, a WHERE makes the
generation/state_version check and the write one step, and triggers do the rest.

``session_write`` is the one door to a session's rows. It is a temporary view with INSTEAD OF triggers:
inserting into it *is* the write. A write inserts a *header* row (``idx`` -1: the session row as it will
be after the write, the turn record to open or close, trace records, inbound messages served) and one row
per new message (``idx`` 0, 1, ...). The inserting SELECT computes every value from the session as it is now
(``cur``) in the same statement, and keeps only the rows whose expectations hold: a stale write inserts no
row and returns none. A commit also selects the messages appended since the previous revision (``idx`` -2),
which no trigger takes, only so that RETURNING hands them back.

Several session writes, several admissions, and several delivery marks are *merged* into one statement
(``SessionWrite``, ``Admission``, ``deliveries``): each write's rows carry its number ``w``, so one round
trip, one temporary table and one WAL commit serve them all (group commit). A merged statement that fails
is retried write by write (``core.sqlite.writer``), so a write still fails alone. Statement shapes are
padded to powers of two (rows that match nothing), so SQLite's statement cache holds every shape in use.

Values travel as bound parameters and come back as rows, never through JSON text, which would lose data:
SQLite's JSON functions (3.40) cut a string at an embedded NUL and print a REAL with 15 digits. Trace
payloads are JSON already and travel as one JSON array; inbound seqs are integers.

The view and triggers are TEMP objects, created on the writer connection when it opens (``INSTALL``), so
they change with this code and never need a migration; ``core.sqlite.schema`` holds only the data.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.store_rows import MESSAGE_COLUMNS, SESSION_COLUMNS

MESSAGE_FIELDS = ("id", "role", "content", "tool_calls", "tool_call_id", "source", "received_at")
"""A new message's bound values, in this order (``seq``, ``session_key`` and ``created_at`` come from the
write)."""
_TURN_COLUMNS = ("begin_turn", "turn_target", "end_turn", "turn_state", "traced_turn", "traces", "trace_seq",
                 "inbound_done")
_VIEW = ("w", "idx", *SESSION_COLUMNS, "seq", *MESSAGE_FIELDS, "message_created_at", *_TURN_COLUMNS)

_UPSERT_SESSION = (
    f"INSERT INTO sessions ({', '.join(SESSION_COLUMNS)})"
    f" VALUES ({', '.join(f'NEW.{c}' for c in SESSION_COLUMNS)})"
    f" ON CONFLICT (key) DO UPDATE SET"
    f" {', '.join(f'{c} = excluded.{c}' for c in SESSION_COLUMNS if c not in ('key', 'created_at'))}"
)

INSTALL = f"""
CREATE TEMP VIEW session_write AS SELECT {', '.join(f'NULL AS {c}' for c in _VIEW)};

-- the header row: the session after the write, then (each only when given) its turn record, trace and
-- served inbound messages; a trigger whose WHEN is false costs next to nothing, a statement that does
-- nothing costs a statement
CREATE TEMP TRIGGER session_write_header INSTEAD OF INSERT ON session_write WHEN NEW.idx = -1 BEGIN
    {_UPSERT_SESSION};
END;
CREATE TEMP TRIGGER session_write_turn_begins INSTEAD OF INSERT ON session_write
WHEN NEW.idx = -1 AND NEW.begin_turn IS NOT NULL BEGIN
    INSERT INTO turns (turn_id, session_key, state, target_json, started_at)
    VALUES (NEW.begin_turn, NEW.key, 'running', NEW.turn_target, NEW.updated_at);
END;
CREATE TEMP TRIGGER session_write_turn_ends INSTEAD OF INSERT ON session_write
WHEN NEW.idx = -1 AND NEW.end_turn IS NOT NULL BEGIN
    UPDATE turns SET state = NEW.turn_state, ended_at = NEW.updated_at
    WHERE turn_id = NEW.end_turn AND state = 'running';
END;
CREATE TEMP TRIGGER session_write_trace INSTEAD OF INSERT ON session_write
WHEN NEW.idx = -1 AND NEW.traces IS NOT NULL BEGIN
    INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)
    SELECT NEW.key, NEW.traced_turn, NEW.trace_seq + t.key + 1, json_extract(t.value, '$[0]'),
           json_extract(t.value, '$[1]'), NEW.updated_at
    FROM json_each(NEW.traces) AS t;
END;
CREATE TEMP TRIGGER session_write_inbound INSTEAD OF INSERT ON session_write
WHEN NEW.idx = -1 AND NEW.inbound_done IS NOT NULL BEGIN
    UPDATE inbound SET envelope = NULL WHERE seq IN (SELECT value FROM json_each(NEW.inbound_done));
END;

-- a message row; rows are inserted in (w, idx) order, so its session's header came first
CREATE TEMP TRIGGER session_write_message INSTEAD OF INSERT ON session_write WHEN NEW.idx >= 0 BEGIN
    INSERT INTO messages ({', '.join(MESSAGE_COLUMNS)})
    VALUES (NEW.id, NEW.key, NEW.seq, NEW.role, NEW.content, NEW.tool_calls, NEW.tool_call_id, NEW.source,
            NEW.received_at, NEW.message_created_at);
END;

-- a served inbound row keeps only its dedupe mark, until it expires; each admission clears expired ones
-- (a row without an event id expires as it is admitted: it has no mark to keep)
CREATE TEMP TRIGGER inbound_expire BEFORE INSERT ON main.inbound BEGIN
    DELETE FROM inbound WHERE envelope IS NULL AND expires_at <= NEW.admitted_at;
END;
"""

# --------------------------------------------------------------------------------------------- session writes

MessageValues = tuple[Any, ...]
"""A new message's values in ``MESSAGE_FIELDS`` order."""


@dataclass(slots=True, eq=False)
class SessionWrite:
    """One write of a session's rows: how its counters move, what it inserts, and its expectations.

    The counters are deltas applied to the session as it is when the statement runs."""

    key: str
    now: float
    default_title: str
    messages: Sequence[MessageValues] = ()
    add_version: int = 0
    add_revision: int = 0
    add_generation: int = 0
    fresh_context: bool = False
    """``/new``: the context starts after the last message so far."""
    expect_generation: int | None = None
    expect_state_version: int | None = None
    begin_turn: tuple[str, str] | None = None
    """(turn_id, target_json) of a turn to open."""
    end_turn: tuple[str, str] | None = None
    """(turn_id, final state) of a running turn to close."""
    trace: tuple[str, str] | None = None
    """(turn_id, trace records as ``core.sqlite.rows.traces_json``)."""
    inbound_done: str | None = None
    """JSON array of inbound seqs this write serves."""
    expect_waiting: int | None = None
    """An inbound seq that must still be waiting (served by no earlier write)."""
    appended: bool = False
    """Report the messages stored since the previous revision (a commit)."""

    def params(self, w: int) -> tuple[Any, ...]:
        """The ``p`` row of this write (``_P`` order)."""
        begin, end, trace = self.begin_turn, self.end_turn, self.trace
        return (w, self.key, self.default_title, self.now, len(self.messages), self.add_version, self.add_revision,
                self.add_generation, self.fresh_context, self.expect_generation, self.expect_state_version,
                begin[0] if begin else None, begin[1] if begin else None, end[0] if end else None,
                end[1] if end else None, trace[0] if trace else None, trace[1] if trace else None,
                self.inbound_done, self.expect_waiting, self.appended)


_P = ("w", "key", "default_title", "now", "add_seq", "add_version", "add_revision", "add_generation", "fresh_context",
      "expect_generation", "expect_state_version", "begin_turn", "turn_target", "end_turn", "turn_state", "traced_turn",
      "traces", "inbound_done", "expect_waiting", "appended")
_NOTHING = (None, None, "", 0.0, 0, 0, 0, 0, False, -1, None, None, None, None, None, None, None, None, None, False)
"""A padding ``p`` row: expects generation -1, which no session has, so it writes nothing."""
_NO_MESSAGE = (-1, 0, *(None for _ in MESSAGE_FIELDS))
"""A padding message row: it belongs to no write (``w`` -1)."""

RETURNING = ("w", "idx", *SESSION_COLUMNS, *MESSAGE_COLUMNS)
"""What a session write returns per row: ``w``, ``idx``, then the session after the write (header rows,
else NULL), then an appended message's columns (``idx`` -2 rows, else NULL)."""
SESSION_AT = 2
MESSAGE_AT = 2 + len(SESSION_COLUMNS)


def session_writes(writes: Sequence[SessionWrite]) -> tuple[str, list[Any]]:
    """One statement (and its parameters) for ``writes``, which must be on different sessions. Write ``i``
    is ``w`` = i in the returned rows."""
    m = sum(len(write.messages) for write in writes)
    k_rows, m_rows = _padded(len(writes)), _padded(m) if m else 0
    params: list[Any] = []
    for w, write in enumerate(writes):
        params.extend(write.params(w))
    params.extend(_NOTHING * (k_rows - len(writes)))
    for w, write in enumerate(writes):
        for idx, message in enumerate(write.messages):
            params.append(w)
            params.append(idx)
            params.extend(message)
    params.extend(_NO_MESSAGE * (m_rows - m))
    return _session_writes_sql(k_rows, m_rows), params


def _padded(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.cache
def _session_writes_sql(k_rows: int, m_rows: int) -> str:
    row = f"({', '.join('?' for _ in _P)})"
    message_row = f"({', '.join('?' for _ in range(2 + len(MESSAGE_FIELDS)))})"
    after = {  # the session after the write, from the session now (cur) and the write's deltas
        "key": "cur.key", "title": "cur.title", "title_is_default": "cur.title_is_default",
        "generation": "cur.generation + cur.add_generation",
        "state_version": "cur.state_version + cur.add_version",
        "history_revision": "cur.history_revision + cur.add_revision",
        "revision_seq": "CASE WHEN cur.add_revision THEN cur.next_seq + cur.add_seq - 1 ELSE cur.revision_seq END",
        "context_start_seq": "CASE WHEN cur.fresh_context THEN cur.next_seq - 1 ELSE cur.context_start_seq END",
        "next_seq": "cur.next_seq + cur.add_seq", "created_at": "cur.created_at", "updated_at": "cur.now",
    }
    # ... and the turn it closes, when recorded, still runs (a turn record is closed once), and the message
    # it must serve still waits (a message is served once)
    holds = ("(cur.expect_generation IS NULL OR cur.generation = cur.expect_generation)"
             " AND (cur.expect_state_version IS NULL OR cur.state_version = cur.expect_state_version)"
             " AND (cur.end_turn IS NULL OR NOT EXISTS"
             " (SELECT 1 FROM turns WHERE turn_id = cur.end_turn AND state <> 'running'))"
             " AND (cur.expect_waiting IS NULL OR EXISTS"
             " (SELECT 1 FROM inbound WHERE seq = cur.expect_waiting AND envelope IS NOT NULL))")
    no_session = ", ".join("NULL" for _ in SESSION_COLUMNS[1:])
    no_turn = ", ".join("NULL" for _ in _TURN_COLUMNS)
    sql = [
        f"WITH p ({', '.join(_P)}) AS (VALUES {', '.join([row] * k_rows)}),",
        "cur AS (SELECT p.*, COALESCE(s.title, p.default_title) AS title,"
        " COALESCE(s.title_is_default, 1) AS title_is_default, COALESCE(s.generation, 0) AS generation,"
        " COALESCE(s.state_version, 0) AS state_version, COALESCE(s.history_revision, 0) AS history_revision,"
        " COALESCE(s.revision_seq, 0) AS revision_seq, COALESCE(s.context_start_seq, 0) AS context_start_seq,"
        " COALESCE(s.next_seq, 1) AS next_seq, COALESCE(s.created_at, p.now) AS created_at"
        " FROM p LEFT JOIN sessions AS s ON s.key = p.key)"
        + (f", new (w, idx, {', '.join(MESSAGE_FIELDS)}) AS (VALUES {', '.join([message_row] * m_rows)})"
           if m_rows else ""),
        f"INSERT INTO session_write ({', '.join(_VIEW)})",
        # the header of each write whose expectations hold
        f"SELECT cur.w, -1, {', '.join(after.values())}, NULL, {', '.join('NULL' for _ in MESSAGE_FIELDS)}, NULL,"
        " cur.begin_turn, cur.turn_target, cur.end_turn, cur.turn_state, cur.traced_turn, cur.traces,"
        " CASE WHEN cur.traces IS NOT NULL THEN (SELECT COALESCE(MAX(seq), 0) FROM traces WHERE session_key = cur.key)"
        f" END, cur.inbound_done FROM cur WHERE {holds}",
    ]
    if m_rows:  # its new messages
        sql.append(f"UNION ALL SELECT cur.w, new.idx, cur.key, {no_session}, cur.next_seq + new.idx,"
                   f" {', '.join(f'new.{f}' for f in MESSAGE_FIELDS)}, cur.now, {no_turn}"
                   f" FROM cur JOIN new ON new.w = cur.w WHERE {holds}")
    # the messages a commit reports besides its own (no trigger takes these rows)
    sql.append(f"UNION ALL SELECT cur.w, -2, cur.key, {no_session}, m.seq,"
               f" {', '.join(f'm.{f}' for f in MESSAGE_FIELDS)}, m.created_at, {no_turn}"
               " FROM cur JOIN messages AS m ON m.session_key = cur.key"
               f" AND m.seq > cur.revision_seq WHERE cur.appended AND {holds}")
    header = [f"CASE WHEN idx = -1 THEN {c} END" for c in SESSION_COLUMNS]
    as_view = {"session_key": "key", "created_at": "message_created_at"}  # the view's names for them
    appended = [f"CASE WHEN idx = -2 THEN {as_view.get(c, c)} END" for c in MESSAGE_COLUMNS]
    sql.append(f"ORDER BY 1, 2 RETURNING w, idx, {', '.join(header)}, {', '.join(appended)}")
    return "\n".join(sql)


# --------------------------------------------------------------------------------------------- admissions


@dataclass(slots=True, eq=False)
class Admission:
    """One inbound message (or, with no envelope, only its dedupe mark) to keep."""

    channel: str
    event_id: str | None
    envelope: str | None
    admitted_at: float
    expires_at: float
    session_key: str | None = None


def admissions(items: Sequence[Admission]) -> tuple[str, list[Any]]:
    """One statement for ``items``: each row inserted unless its (channel, event_id) is marked already."""
    rows = _padded(len(items))
    params: list[Any] = []
    for a in items:
        params.extend((a.channel, a.event_id, a.envelope, a.admitted_at, a.expires_at, a.session_key))
    params.extend((None, None, None, 0.0, 0.0, None) * (rows - len(items)))
    return _admissions_sql(rows), params


@functools.cache
def _admissions_sql(rows: int) -> str:
    # WHERE keeps the padding rows out, and lets the upsert follow a SELECT
    return ("INSERT INTO inbound (channel, event_id, envelope, admitted_at, expires_at, session_key)"
            f" SELECT * FROM (VALUES {', '.join(['(?, ?, ?, ?, ?, ?)'] * rows)}) WHERE column1 IS NOT NULL"
            " ON CONFLICT (channel, event_id) DO NOTHING RETURNING seq, channel, event_id")


def admitted(items: Sequence[Admission], returned: Sequence[tuple[Any, ...]]) -> list[int | None]:
    """Each item's seq, or None when its event was marked already (by an earlier row or this statement).
    Rows are inserted in order, so the inserted items take the returned seqs in ascending order."""
    marked = {(r[1], r[2]) for r in returned if r[2] is not None}
    seqs = iter(sorted(r[0] for r in returned))
    taken: set[tuple[str, str]] = set()
    result: list[int | None] = []
    for a in items:
        if a.event_id is None:
            result.append(next(seqs))
        elif (a.channel, a.event_id) in marked and (a.channel, a.event_id) not in taken:
            taken.add((a.channel, a.event_id))
            result.append(next(seqs))
        else:
            result.append(None)
    return result


# --------------------------------------------------------------------------------------------- delivery marks


def deliveries(marks: Sequence[tuple[str, float]]) -> tuple[str, list[Any]]:
    """One statement recording ``marks`` (turn id, when it was delivered); a turn marked already keeps its mark."""
    rows = _padded(len(marks))
    params: list[Any] = [value for mark in marks for value in mark]
    params.extend((None, 0.0) * (rows - len(marks)))
    return _deliveries_sql(rows), params


@functools.cache
def _deliveries_sql(rows: int) -> str:
    return ("INSERT INTO deliveries (turn_id, delivered_at)"
            f" SELECT * FROM (VALUES {', '.join(['(?, ?)'] * rows)}) WHERE column1 IS NOT NULL"
            " ON CONFLICT (turn_id) DO NOTHING")


# --------------------------------------------------------------------------------------------- the others

BUMP_GENERATION = """
INSERT INTO sessions (key, title, generation, created_at, updated_at) VALUES (:key, :default_title, 1, :now, :now)
ON CONFLICT (key) DO UPDATE SET generation = generation + 1, updated_at = excluded.updated_at
RETURNING generation"""

CREATE_SESSION = f"""
INSERT INTO sessions (key, title, created_at, updated_at) VALUES (:key, :default_title, :now, :now)
ON CONFLICT (key) DO UPDATE SET key = excluded.key
RETURNING {', '.join(SESSION_COLUMNS)}"""
"""Creates the session if it is missing; the no-op update on conflict makes RETURNING report an existing row."""

RENAME = """
INSERT INTO sessions (key, title, title_is_default, created_at, updated_at) VALUES (:key, :title, 0, :now, :now)
ON CONFLICT (key) DO UPDATE SET title = excluded.title, title_is_default = 0, updated_at = excluded.updated_at"""

SET_TITLE_IF_DEFAULT = """
UPDATE sessions SET title = :title, updated_at = :now
WHERE key = :key AND title_is_default = 1 AND generation = :expect_generation
RETURNING 1"""

FINISH_INBOUND = ("UPDATE inbound SET envelope = NULL WHERE seq IN (SELECT value FROM json_each(?))"
                  " AND envelope IS NOT NULL RETURNING seq")

FORGET_INBOUND = "DELETE FROM inbound WHERE seq = ?"

END_TURN = "UPDATE turns SET state = ?, ended_at = ? WHERE turn_id = ? AND state = 'running'"


# The terminal message of each turn that ended after :since (and before :before; of :key only, unless it is
# NULL) and was not delivered: its answer, or its notice.
UNDELIVERED_TURNS = """
SELECT t.turn_id, t.session_key, t.state, t.target_json, t.started_at, t.ended_at,
       (SELECT m.content FROM messages m
         WHERE m.session_key = t.session_key AND json_extract(m.source, '$.turn_id') = t.turn_id
           AND m.role = 'assistant' AND m.content != ''
         ORDER BY m.seq DESC LIMIT 1)
FROM turns t
WHERE t.ended_at > :since AND t.ended_at < :before AND t.state IN ('completed', 'failed', 'cancelled')
  AND (:key IS NULL OR t.session_key = :key)
  AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.turn_id = t.turn_id)
ORDER BY t.ended_at"""

CLOSE_INTERRUPTED_TURNS = """
UPDATE turns SET state = 'interrupted', ended_at = :now WHERE state = 'running' AND (:key IS NULL OR session_key = :key
    OR (:prefix IS NOT NULL AND substr(session_key, 1, length(:prefix)) = :prefix))
RETURNING turn_id, session_key, state, target_json, started_at, ended_at"""

SET_CHANNEL_STATE = """
INSERT INTO channel_state (channel, name, value, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (channel, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"""

ADD_ATTACHMENT = """
INSERT INTO attachments (id, session_key, kind, name, content_type, size, created_at, claimed)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)"""

CLAIM_ATTACHMENTS = "UPDATE attachments SET claimed = 1 WHERE id IN (SELECT value FROM json_each(?))"

DROP_UNCLAIMED_ATTACHMENTS = """
DELETE FROM attachments WHERE session_key = ? AND claimed = 0 AND created_at < ?
RETURNING id"""

DROP_EXPIRED_ATTACHMENTS = "DELETE FROM attachments WHERE created_at < ? RETURNING id"

APPEND_TRACES = """
INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)
SELECT :key, :turn_id, base.seq + t.key + 1, json_extract(t.value, '$[0]'), json_extract(t.value, '$[1]'), :now
FROM json_each(:traces) AS t, (SELECT COALESCE(MAX(seq), 0) AS seq FROM traces WHERE session_key = :key) AS base"""
