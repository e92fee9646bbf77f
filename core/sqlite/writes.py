"""Every write of the SQLite store, each ONE SQL statement.

One statement in autocommit mode is one atomic write, and costs one round trip to aiosqlite's thread (the
only way to reach SQLite through its public API). So a write that touches several tables does it inside
SQLite: RETURNING hands back what the caller needs, UPSERT creates a session on first use, a conditional
WHERE makes the generation/state_version check and the write one step, and triggers do the rest.

``session_write`` is the one door to a session's rows. It is a temporary view with INSTEAD OF triggers:
inserting into it *is* the write. A write inserts a *header* row (``idx`` -1: the session row as it will
be after the write, the turn record to open or close, trace records, inbound rows served) and one row per
new message (``idx`` 0, 1, ...). The inserting SELECT computes every value from the session as it is now
(``cur``) in the same statement, and filters on the caller's expectations: a stale write inserts no row and
returns none. RETURNING reports the header (the session after the write); a commit also selects the
messages appended since the previous revision as rows with ``idx`` -2, which no trigger takes, only so that
RETURNING hands them back. A statement that fails (a duplicate turn id, a constraint) leaves nothing
behind: SQLite rolls back the whole statement, triggers included.

Values travel as bound parameters and come back as rows, never through JSON text, which would lose data:
SQLite's JSON functions (3.40) cut a string at an embedded NUL and print a REAL with 15 digits. Trace
payloads are JSON already and travel as one JSON array.

The views and triggers are TEMP objects, created on the writer connection when it opens (``install``), so
they change with this code and never need a migration; ``core.sqlite.schema`` holds only the data.
"""

from __future__ import annotations

import functools

SESSION_COLUMNS = (
    "key", "title", "title_is_default", "generation", "state_version", "history_revision", "revision_seq",
    "context_start_seq", "next_seq", "created_at", "updated_at",
)
MESSAGE_FIELDS = ("id", "role", "content", "tool_calls", "tool_call_id", "source", "received_at")
"""A new message's bound values, in this order (``seq``, ``session_key`` and ``created_at`` come from the
write)."""
RETURNING = ("idx", *SESSION_COLUMNS, "seq", *MESSAGE_FIELDS, "message_created_at")
"""What every ``session_write`` returns per row: the header's columns 1-11 are the session after the write
(``SESSION_COLUMNS``); an appended message row's last ten are its ``MESSAGE_COLUMNS`` (``key`` standing
for ``session_key``)."""
MESSAGE_COLUMNS = (
    "id", "session_key", "seq", "role", "content", "tool_calls", "tool_call_id", "source", "received_at",
    "created_at",
)
_WRITE_COLUMNS = ("begin_turn", "turn_target", "end_turn", "turn_state", "traced_turn", "traces", "trace_seq",
                  "inbound_done")

_VIEW = (*RETURNING, *_WRITE_COLUMNS)

_UPSERT_SESSION = (
    f"INSERT INTO sessions ({', '.join(SESSION_COLUMNS)})"
    f" VALUES ({', '.join(f'NEW.{c}' for c in SESSION_COLUMNS)})"
    f" ON CONFLICT (key) DO UPDATE SET"
    f" {', '.join(f'{c} = excluded.{c}' for c in SESSION_COLUMNS if c not in ('key', 'created_at'))}"
)

INSTALL = f"""
CREATE TEMP VIEW session_write AS SELECT {', '.join(f'NULL AS {c}' for c in _VIEW)};

-- the header row: the session after the write, its turn record, trace and served inbound messages
CREATE TEMP TRIGGER session_write_header INSTEAD OF INSERT ON session_write WHEN NEW.idx = -1 BEGIN
    {_UPSERT_SESSION};
    INSERT INTO turns (turn_id, session_key, state, target_json, started_at)
        SELECT NEW.begin_turn, NEW.key, 'running', NEW.turn_target, NEW.updated_at WHERE NEW.begin_turn IS NOT NULL;
    UPDATE turns SET state = NEW.turn_state, ended_at = NEW.updated_at
        WHERE turn_id = NEW.end_turn AND state = 'running';
    INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)
        SELECT NEW.key, NEW.traced_turn, NEW.trace_seq + t.key + 1, json_extract(t.value, '$[0]'),
               json_extract(t.value, '$[1]'), NEW.updated_at
        FROM json_each(NEW.traces) AS t;
    UPDATE inbound SET envelope = NULL WHERE seq IN (SELECT value FROM json_each(NEW.inbound_done));
END;

-- a message row, inserted after the header (ORDER BY idx), so its session exists
CREATE TEMP TRIGGER session_write_message INSTEAD OF INSERT ON session_write WHEN NEW.idx >= 0 BEGIN
    INSERT INTO messages ({', '.join(MESSAGE_COLUMNS)})
    VALUES (NEW.id, NEW.key, NEW.seq, NEW.role, NEW.content, NEW.tool_calls, NEW.tool_call_id, NEW.source,
            NEW.received_at, NEW.message_created_at);
END;

-- a served inbound row keeps only its dedupe mark, until it expires; the next admission clears expired ones
-- (a row without an event id expires as it is admitted: it has no mark to keep)
CREATE TEMP TRIGGER inbound_expire BEFORE INSERT ON main.inbound BEGIN
    DELETE FROM inbound WHERE envelope IS NULL AND expires_at <= NEW.admitted_at;
END;
"""

_CURRENT = """cur AS (
    SELECT w.key AS key, COALESCE(s.title, :default_title) AS title,
           COALESCE(s.title_is_default, 1) AS title_is_default, COALESCE(s.generation, 0) AS generation,
           COALESCE(s.state_version, 0) AS state_version, COALESCE(s.history_revision, 0) AS history_revision,
           COALESCE(s.revision_seq, 0) AS revision_seq, COALESCE(s.context_start_seq, 0) AS context_start_seq,
           COALESCE(s.next_seq, 1) AS next_seq, COALESCE(s.created_at, :now) AS created_at
    FROM (SELECT :key AS key) AS w LEFT JOIN sessions AS s ON s.key = w.key)"""
"""The session as it is now, or a new session's defaults: what every value of a write is computed from."""


def _session_write(messages: int, *, session: dict[str, str], write: dict[str, str], where: str = "",
                   appended: bool = False) -> str:
    """The statement inserting one header row and ``messages`` message rows into ``session_write``.

    ``session`` gives new values for session columns (SQL over ``cur``, the session now); the others are kept
    (``updated_at`` becomes ``:now``). ``write`` gives the header's other columns; unnamed ones are NULL.
    Message ``i`` is bound as ``:id_i``, ``:role_i``, ... (``MESSAGE_FIELDS``). ``appended`` adds the rows
    of messages stored since the previous revision (``idx`` -2)."""
    rows = [f"(-1, {', '.join('NULL' for _ in MESSAGE_FIELDS)})"]
    rows += [f"({i}, {', '.join(f':{f}_{i}' for f in MESSAGE_FIELDS)})" for i in range(messages)]
    values = {c: session.get(c, f"cur.{c}") for c in SESSION_COLUMNS}
    values["updated_at"] = ":now"
    header = [f"CASE WHEN new.idx = -1 THEN {write[c]} END" if c in write else "NULL" for c in _WRITE_COLUMNS]
    sql = (
        f"WITH {_CURRENT},\n"
        f"new (idx, {', '.join(MESSAGE_FIELDS)}) AS (VALUES {', '.join(rows)})\n"
        f"INSERT INTO session_write ({', '.join(_VIEW)})\n"
        f"SELECT new.idx, {', '.join(values.values())}, cur.next_seq + new.idx,"
        f" {', '.join(f'new.{f}' for f in MESSAGE_FIELDS)}, :now, {', '.join(header)}\n"
        f"FROM cur, new {where}\n"
    )
    if appended:
        sql += (
            f"UNION ALL SELECT -2, {', '.join(values.values())}, m.seq,"
            f" {', '.join(f'm.{f}' for f in MESSAGE_FIELDS)}, m.created_at, {', '.join('NULL' for _ in header)}\n"
            f"FROM cur JOIN messages AS m ON m.session_key = cur.key AND m.seq > cur.revision_seq {where}\n"
        )
    return sql + f"ORDER BY 1\nRETURNING {', '.join(RETURNING)}"


APPEND_MESSAGE = _session_write(
    1,
    session={"state_version": "cur.state_version + 1", "next_seq": "cur.next_seq + 1"},
    write={"begin_turn": ":begin_turn", "turn_target": ":turn_target", "inbound_done": ":inbound_done"},
)
"""One message, state_version +1 (no revision); optionally opens a turn and marks an inbound row served."""


@functools.cache
def commit_turn(messages: int) -> str:
    """``messages`` new messages and one history revision, only if the expectations hold; the turn record
    closes and its trace lands in the same statement. Rows with ``idx`` -2 are the messages stored since the
    previous revision that this commit did not insert."""
    return _session_write(
        messages,
        session={
            "next_seq": f"cur.next_seq + {messages}",
            "state_version": f"cur.state_version + {1 if messages else 0}",
            "history_revision": "cur.history_revision + 1",
            "revision_seq": f"cur.next_seq + {messages - 1}",
        },
        write={
            "end_turn": ":end_turn", "turn_state": ":turn_state", "traced_turn": ":traced_turn", "traces": ":traces",
            "trace_seq": "(SELECT COALESCE(MAX(seq), 0) FROM traces WHERE session_key = cur.key)",
        },
        where="WHERE (:expect_generation IS NULL OR cur.generation = :expect_generation)"
              " AND (:expect_state_version IS NULL OR cur.state_version = :expect_state_version)",
        appended=True,
    )


NEW_CONTEXT = _session_write(
    0,
    session={"context_start_seq": "cur.next_seq - 1", "generation": "cur.generation + 1",
             "state_version": "cur.state_version + 1"},
    write={"inbound_done": ":inbound_done"},
)
"""A fresh model context (older messages stay in history); inbound rows dropped with it are marked served."""

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

ADMIT_INBOUND = """
INSERT INTO inbound (channel, event_id, envelope, admitted_at, expires_at) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (channel, event_id) DO NOTHING
RETURNING seq"""
"""Keeps an inbound message (or, with a NULL envelope, only its dedupe mark); no row back = seen before."""

FINISH_INBOUND = "UPDATE inbound SET envelope = NULL WHERE seq IN (SELECT value FROM json_each(?))"

FORGET_INBOUND = "DELETE FROM inbound WHERE seq = ?"

END_TURN = "UPDATE turns SET state = ?, ended_at = ? WHERE turn_id = ? AND state = 'running'"

CLOSE_INTERRUPTED_TURNS = """
UPDATE turns SET state = 'interrupted', ended_at = ? WHERE state = 'running'
RETURNING turn_id, session_key, state, target_json, started_at, ended_at"""

SET_CHANNEL_STATE = """
INSERT INTO channel_state (channel, name, value, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (channel, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"""

APPEND_TRACES = """
INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)
SELECT :key, :turn_id, base.seq + t.key + 1, json_extract(t.value, '$[0]'), json_extract(t.value, '$[1]'), :now
FROM json_each(:traces) AS t, (SELECT COALESCE(MAX(seq), 0) AS seq FROM traces WHERE session_key = :key) AS base"""
