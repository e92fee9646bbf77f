"""The Store contract: the same tests against every backend (SQLite, and PostgreSQL on a throwaway cluster
started by the tests), so any difference in behaviour between them fails here.

What only one backend has (SQLite's WAL mode and group commit, its migrations from older files) is tested
in that backend's own file; this one speaks only through the ``Store`` protocol, except for reading trace
records back, which the product never does.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from core.agent.subagents import CHILD_GLOB, CHILD_MARK
from core.messages import AttachmentRef, MessageSource, NewMessage, ToolCall
from core.sqlite_store import SqliteStore
from core.store import (
    AttachmentRecord,
    InboundServedError,
    StaleStateError,
    Store,
    StoreError,
    TurnEndedError,
    UnknownMessageError,
)
from tests.support.store import FakeClock, user

KEY = "telegram:chat:1"


def assistant(text: str, turn_id: str | None = None) -> NewMessage:
    return NewMessage(role="assistant", content=text, source=MessageSource(kind="assistant", turn_id=turn_id))


@dataclass
class Backend:
    name: str
    make: Callable[[Callable[[], float]], Store]
    """A new store object on this test's database (the same database every time)."""
    traces: Callable[[str], Awaitable[list[tuple[int, str, str, dict[str, Any]]]]]
    """(seq, turn_id, kind, payload) of a session's trace records, oldest first, read as an operator would."""


def _sqlite(tmp_path: Any) -> Backend:
    path = tmp_path / "data" / "chat.db"

    async def traces(key: str) -> list[tuple[int, str, str, dict[str, Any]]]:
        with sqlite3.connect(path) as conn:
            found = conn.execute("SELECT seq, turn_id, kind, payload FROM traces WHERE session_key = ? ORDER BY seq",
                                 (key,)).fetchall()
        return [(s, t, k, json.loads(p)) for s, t, k, p in found]

    return Backend("sqlite", lambda clock: SqliteStore(path, clock=clock), traces)


def _postgresql(dsn: str) -> Backend:
    import asyncpg

    from core.postgresql.store import PostgresqlStore

    async def traces(key: str) -> list[tuple[int, str, str, dict[str, Any]]]:
        conn = await asyncpg.connect(dsn)
        try:
            found = await conn.fetch("SELECT seq, turn_id, kind, payload FROM traces WHERE session_key = $1"
                                     " ORDER BY seq", key)
        finally:
            await conn.close()
        return [(r[0], r[1], r[2], json.loads(r[3])) for r in found]

    return Backend("postgresql", lambda clock: PostgresqlStore(dsn, pool_size=4, clock=clock), traces)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    if request.param == "sqlite":
        return _sqlite(tmp_path)
    return _postgresql(request.getfixturevalue("postgres").fresh_dsn())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    s = backend.make(time.time)
    await s.open()
    yield s
    await s.close()


async def reopened(backend: Backend, clock: Callable[[], float] = time.time) -> Store:
    s = backend.make(clock)
    await s.open()
    return s


# --------------------------------------------------------------------------------------------- sessions


async def test_get_or_create_session_defaults_and_is_idempotent(store: Store) -> None:
    created = await store.get_or_create_session(KEY, default_title="Hello")
    assert (created.title, created.title_is_default) == ("Hello", True)
    assert (created.generation, created.state_version, created.history_revision) == (0, 0, 0)
    assert (created.revision_seq, created.context_start_seq) == (0, 0)
    assert await store.get_or_create_session(KEY, default_title="Other") == created
    assert await store.get_session("missing") is None


async def test_list_sessions_order_prefix_and_exclusion(backend: Backend, clock: FakeClock) -> None:
    store = await reopened(backend, clock)
    try:
        for key in ("web:a_1", "web:ab1", "web%x", "slack:1", "web:B", f"web:a_1{CHILD_MARK}0123456789ab"):
            clock.now += 1
            await store.get_or_create_session(key)
        clock.now += 1
        await store.rename("web:ab1", "renamed")  # the most recent update comes first
        assert {s.key for s in await store.list_sessions(prefix="web:a_")} == {
            "web:a_1", f"web:a_1{CHILD_MARK}0123456789ab"}
        assert {s.key for s in await store.list_sessions(prefix="web%")} == {"web%x"}
        assert [s.key for s in await store.list_sessions(exclude_glob=CHILD_GLOB)] == [
            "web:ab1", "web:B", "slack:1", "web%x", "web:a_1"]
        assert len(await store.list_sessions(limit=2)) == 2
        assert {s.key for s in await store.list_sessions(exclude_glob="web:[a-b]*")} == {"web%x", "slack:1", "web:B"}
        assert {s.key for s in await store.list_sessions(exclude_glob="*?1")} == {
            "web%x", "web:B", f"web:a_1{CHILD_MARK}0123456789ab"}
        clock.now += 1
        for key in ("b", "a", "B", "é"):  # a tie on updated_at: keys in byte order
            await store.get_or_create_session(key)
        assert [s.key for s in await store.list_sessions(limit=4)] == ["B", "a", "b", "é"]
    finally:
        await store.close()


async def test_bump_generation_creates_and_increments(store: Store) -> None:
    assert await store.bump_generation(KEY) == 1
    assert await store.bump_generation(KEY) == 2
    session = await store.get_session(KEY)
    assert session is not None and session.generation == 2


# --------------------------------------------------------------------------------------------- revisions


async def test_commits_form_contiguous_deltas_covering_every_message_once(store: Store) -> None:
    first_user, record = await store.append_message(KEY, user("hi"))
    assert (first_user.seq, record.state_version) == (1, 1)
    first = await store.commit_turn(KEY, [assistant("hello")], expect_generation=0, expect_state_version=1)
    assert first.history_revision == 1 and first.state_version == 2 and first.inserted == 1
    assert [(m.seq, m.role, m.content) for m in first.messages] == [(1, "user", "hi"), (2, "assistant", "hello")]

    await store.append_message(KEY, user("weather?"))
    turn = [
        NewMessage(role="assistant", content="", source=MessageSource(kind="assistant"),
                   tool_calls=(ToolCall(id="c1", name="weather", arguments='{"city": "Oslo"}'),)),
        NewMessage(role="tool", content="rain", source=MessageSource(kind="tool"), tool_call_id="c1"),
        assistant("It rains."),
    ]
    second = await store.commit_turn(KEY, turn, expect_generation=0, expect_state_version=3)
    assert second.history_revision == 2 and second.inserted == 3
    assert [m.seq for m in second.messages] == [3, 4, 5, 6]
    assert second.messages[0].content == "weather?"

    empty = await store.commit_turn(KEY, [], expect_generation=None, expect_state_version=None)
    assert (empty.history_revision, empty.messages, empty.state_version) == (3, (), 4)

    revision, history = await store.history(KEY)
    assert revision == 3
    assert [m for r in (first, second, empty) for m in r.messages] == history
    assert history[3].tool_calls == turn[0].tool_calls and history[4].tool_call_id == "c1"
    session = await store.get_session(KEY)
    assert session is not None
    assert (session.state_version, session.history_revision, session.revision_seq) == (4, 3, 6)


async def test_stale_generation_writes_nothing(store: Store) -> None:
    await store.append_message(KEY, user("hi"))
    await store.bump_generation(KEY)
    before = await store.get_session(KEY)
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("late")], expect_generation=0, expect_state_version=None)
    assert await store.get_session(KEY) == before
    assert [m.content for m in (await store.history(KEY))[1]] == ["hi"]
    nxt, _ = await store.append_message(KEY, user("next"))
    assert nxt.seq == 2


async def test_stale_state_version_writes_nothing(store: Store) -> None:
    _, rec = await store.append_message(KEY, user("one"))
    await store.append_message(KEY, user("two"))
    before = await store.get_session(KEY)
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("late")], expect_generation=0, expect_state_version=rec.state_version)
    assert await store.get_session(KEY) == before
    assert [m.content for m in (await store.history(KEY))[1]] == ["one", "two"]


async def test_a_commit_on_a_missing_session_creates_it_only_when_its_expectations_hold(store: Store) -> None:
    with pytest.raises(StaleStateError):
        await store.commit_turn("fresh", [assistant("x")], expect_generation=5, expect_state_version=None)
    assert await store.get_session("fresh") is None
    result = await store.commit_turn("fresh", [assistant("x")], expect_generation=0, expect_state_version=0)
    assert (result.history_revision, result.state_version, [m.seq for m in result.messages]) == (1, 1, [1])


async def test_history_revision_is_consistent_with_messages(store: Store) -> None:
    assert await store.history(KEY) == (0, [])
    await store.append_message(KEY, user("q1"))
    await store.commit_turn(KEY, [assistant("a1")], expect_generation=None, expect_state_version=None)
    await store.append_message(KEY, user("q2"))  # not committed yet: included, revision unchanged
    revision, messages = await store.history(KEY)
    assert revision == 1 and [m.content for m in messages] == ["q1", "a1", "q2"]
    revision, newest = await store.history(KEY, limit=2)
    assert (revision, [m.seq for m in newest]) == (1, [2, 3])


async def test_history_pages_backwards_from_a_message_id(store: Store) -> None:
    for i in range(7):
        await store.append_message(KEY, user(f"q{i}"))
        await store.commit_turn(KEY, [assistant(f"a{i}")], expect_generation=None, expect_state_version=None)
    revision, newest = await store.history(KEY, limit=5)
    assert revision == 7 and [m.content for m in newest] == ["a4", "q5", "a5", "q6", "a6"]
    pages, page = [newest], newest
    while page:
        _, page = await store.history(KEY, limit=5, before=page[0].id)
        pages.insert(0, page)
    assert [m.content for p in pages for m in p] == [x for i in range(7) for x in (f"q{i}", f"a{i}")]
    assert [len(p) for p in pages] == [0, 4, 5, 5]
    other, _ = await store.append_message("other", user("elsewhere"))
    for foreign in (other.id, "no-such-id"):
        with pytest.raises(UnknownMessageError):
            await store.history(KEY, before=foreign)
    with pytest.raises(UnknownMessageError):
        await store.history("never-created", before=newest[0].id)


async def test_new_context_excludes_old_messages_but_history_keeps_them(store: Store) -> None:
    await store.append_message(KEY, user("old question"))
    await store.commit_turn(KEY, [assistant("old answer")], expect_generation=0, expect_state_version=1)
    before = await store.get_session(KEY)
    assert before is not None
    fresh = await store.new_context(KEY)
    assert fresh.context_start_seq == 2
    assert (fresh.generation, fresh.state_version) == (before.generation + 1, before.state_version + 1)
    assert await store.context_messages(KEY, limit=50) == (fresh.state_version, [])
    await store.append_message(KEY, user("new 1"))
    await store.append_message(KEY, user("new 2"))
    _, last = await store.append_message(KEY, user("new 3"))
    version, context = await store.context_messages(KEY, limit=2)
    assert [m.content for m in context] == ["new 2", "new 3"]
    assert version == last.state_version == fresh.state_version + 3
    assert [m.content for m in (await store.history(KEY))[1]] == [
        "old question", "old answer", "new 1", "new 2", "new 3"]
    assert await store.context_messages("never-created", limit=5) == (0, [])


# --------------------------------------------------------------------------------------------- titles


async def test_rename_beats_automatic_title(store: Store) -> None:
    session = await store.get_or_create_session(KEY)
    assert await store.set_title_if_default(KEY, "Auto 1", expect_generation=session.generation)
    assert await store.set_title_if_default(KEY, "Auto 2", expect_generation=session.generation)
    await store.rename(KEY, "Mine")
    assert not await store.set_title_if_default(KEY, "Auto 3", expect_generation=session.generation)
    renamed = await store.get_session(KEY)
    assert renamed is not None and (renamed.title, renamed.title_is_default) == ("Mine", False)


async def test_automatic_title_with_moved_generation_is_refused(store: Store) -> None:
    session = await store.get_or_create_session(KEY)
    await store.bump_generation(KEY)
    assert not await store.set_title_if_default(KEY, "Late", expect_generation=session.generation)
    current = await store.get_session(KEY)
    assert current is not None and current.title == "New chat"
    assert not await store.set_title_if_default("missing", "x", expect_generation=0)


# --------------------------------------------------------------------------------------------- dedupe, inbound


async def test_dedupe_survives_reopen_and_ttl_expiry_readmits(backend: Backend, clock: FakeClock) -> None:
    store = await reopened(backend, clock)
    try:
        assert await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert not await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert await store.mark_event_processed("slack", "e1", ttl_seconds=100)
    finally:
        await store.close()
    store = await reopened(backend, clock)
    try:
        clock.now += 99
        assert not await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert await store.event_seen("telegram", "e1")
        clock.now += 2  # the TTL ran out
        assert not await store.event_seen("telegram", "e1")
        assert await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert not await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
    finally:
        await store.close()


async def test_an_admitted_message_waits_until_served_and_keeps_its_mark(backend: Backend,
                                                                          clock: FakeClock) -> None:
    store = await reopened(backend, clock)
    try:
        first = await store.admit_inbound("telegram", "555:1", '{"n": 1}', ttl_seconds=100)
        second = await store.admit_inbound("web", None, '{"n": 2}', ttl_seconds=100)
        assert first is not None and second is not None and first < second
        assert await store.admit_inbound("telegram", "555:1", '{"n": 1}', ttl_seconds=100) is None
        assert await store.event_seen("telegram", "555:1") and not await store.event_seen("telegram", "555:2")
        waiting = await store.waiting_inbound()
        assert [(r.seq, r.payload, r.admitted_at) for r in waiting] == [
            (first, '{"n": 1}', clock.now), (second, '{"n": 2}', clock.now)]
        await store.append_message(KEY, user("one"), begin_turn=("t1", "{}"), serves=first)
    finally:
        await store.close()
    store = await reopened(backend, clock)
    try:
        assert [r.seq for r in await store.waiting_inbound()] == [second]
        clock.now += 99
        assert await store.event_seen("telegram", "555:1")  # served, the mark stays for its TTL
        assert await store.admit_inbound("telegram", "555:1", "{}", ttl_seconds=100) is None
        clock.now += 2
        assert not await store.event_seen("telegram", "555:1")
        assert await store.admit_inbound("telegram", "555:1", "{}", ttl_seconds=100) is not None
    finally:
        await store.close()


async def test_waiting_messages_are_found_by_session_and_after_a_seq(store: Store) -> None:
    a1 = await store.admit_inbound("web", "a-1", '{"a": 1}', ttl_seconds=100, key="web:a")
    b1 = await store.admit_inbound("web", None, '{"b": 1}', ttl_seconds=100, key="web:b")
    a2 = await store.admit_inbound("web", None, '{"a": 2}', ttl_seconds=100, key="web:a")
    assert a1 is not None and b1 is not None and a2 is not None
    assert [r.payload for r in await store.waiting_inbound(key="web:a")] == ['{"a": 1}', '{"a": 2}']
    assert [r.seq for r in await store.waiting_inbound(key="web:a", after_seq=a1)] == [a2]
    assert [r.seq for r in await store.waiting_inbound(key="web:b")] == [b1]
    assert await store.waiting_inbound(key="web:none") == []
    assert [r.seq for r in await store.waiting_inbound()] == [a1, b1, a2]
    await store.append_message("web:a", user("one"), begin_turn=("t1", "{}"), serves=a1)
    assert [r.seq for r in await store.waiting_inbound(key="web:a")] == [a2]


async def test_a_waiting_message_keeps_its_mark_past_its_ttl(backend: Backend, clock: FakeClock) -> None:
    store = await reopened(backend, clock)
    try:
        seq = await store.admit_inbound("telegram", "e1", "{}", ttl_seconds=10)
        clock.now += 60
        assert await store.admit_inbound("telegram", "e2", "{}", ttl_seconds=10) is not None
        assert await store.admit_inbound("telegram", "e1", "{}", ttl_seconds=10) is None
        assert seq in [r.seq for r in await store.waiting_inbound()]
    finally:
        await store.close()


async def test_finished_inbound_keeps_its_mark_and_forgotten_inbound_frees_its_event(store: Store) -> None:
    done = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    gone = await store.admit_inbound("web", "c-2", "{}", ttl_seconds=100)
    assert done is not None and gone is not None
    await store.finish_inbound([done])
    await store.forget_inbound(gone)
    assert await store.waiting_inbound() == []
    assert await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100) is None
    assert await store.admit_inbound("web", "c-2", "{}", ttl_seconds=100) is not None


async def test_new_context_drops_the_waiting_messages_it_is_given(store: Store) -> None:
    dropped = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    kept = await store.admit_inbound("web", None, "{}", ttl_seconds=100)
    assert dropped is not None and kept is not None
    await store.new_context(KEY, drop_inbound=[dropped])
    assert [r.seq for r in await store.waiting_inbound()] == [kept]
    assert await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100) is None


async def test_finishing_messages_says_which_were_still_waiting(store: Store) -> None:
    """Two processes finishing the same message (each to answer it with a notice): the first finishes it."""
    marked = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100, key=KEY)
    plain = await store.admit_inbound("web", None, "{}", ttl_seconds=100, key=KEY)
    assert marked is not None and plain is not None
    assert await store.finish_inbound([marked, plain]) == sorted([marked, plain])
    assert await store.finish_inbound([marked, plain]) == []
    assert await store.waiting_inbound(key=KEY) == [] and await store.event_seen("web", "c-1")


async def test_a_stored_new_is_carried_out_once(store: Store) -> None:
    """A forwarded ``/new`` stored with the session's messages, read as waiting by two processes: the first
    ``new_context`` carrying it out serves it (and the messages it drops), the second writes nothing."""
    dropped = await store.admit_inbound("web", None, "{}", ttl_seconds=100, key=KEY)
    command = await store.admit_inbound("web", None, '{"command": "new"}', ttl_seconds=100, key=KEY)
    assert dropped is not None and command is not None
    first = await store.new_context(KEY, drop_inbound=[dropped], serves=command)
    with pytest.raises(InboundServedError):
        await store.new_context(KEY, drop_inbound=[dropped], serves=command)
    assert (await store.get_or_create_session(KEY)).generation == first.generation
    assert await store.waiting_inbound(key=KEY) == []


async def test_a_failed_write_serves_nothing(store: Store) -> None:
    seq = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    await store.append_message(KEY, user("first"), begin_turn=("t1", "{}"))
    with pytest.raises(StoreError):
        await store.append_message(KEY, user("second"), begin_turn=("t1", "{}"), serves=seq)
    assert [r.seq for r in await store.waiting_inbound()] == [seq]
    assert [m.content for m in (await store.history(KEY))[1]] == ["first"]


async def test_a_message_is_served_once(store: Store) -> None:
    """A write serving a message no longer waiting (served, or dropped) writes nothing: no user message, no
    turn record (two processes that both read it as waiting: tests/test_postgresql_store.py)."""
    served = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100, key=KEY)
    dropped = await store.admit_inbound("web", None, "{}", ttl_seconds=100, key=KEY)
    assert served is not None and dropped is not None
    await store.append_message(KEY, user("once"), begin_turn=("t1", "{}"), serves=served)
    with pytest.raises(InboundServedError):
        await store.append_message(KEY, user("once"), begin_turn=("t2", "{}"), serves=served)
    await store.forget_inbound(dropped)
    with pytest.raises(InboundServedError):
        await store.append_message(KEY, user("dropped"), begin_turn=("t3", "{}"), serves=dropped)
    assert [m.content for m in (await store.history(KEY))[1]] == ["once"]
    assert [t.turn_id for t in await store.close_interrupted_turns()] == ["t1"]
    assert await store.event_seen("web", "c-1")


# --------------------------------------------------------------------------------------------- turns, traces


async def test_close_interrupted_turns_returns_running_turns_once(store: Store) -> None:
    await store.append_message(KEY, user("1"), begin_turn=("t1", '{"chat": 1}'))
    await store.append_message(KEY, user("2"), begin_turn=("t2", '{"chat": 2}'))
    await store.append_message("other", user("3"), begin_turn=("t3", "{}"))
    await store.end_turn("t2", "completed")
    await store.end_turn("t2", "failed")  # a turn that ended keeps its first final state
    interrupted = await store.close_interrupted_turns()
    assert [(t.turn_id, t.state, t.target_json) for t in interrupted] == [
        ("t1", "interrupted", '{"chat": 1}'), ("t3", "interrupted", "{}")]
    assert all(t.ended_at is not None for t in interrupted)
    assert await store.close_interrupted_turns() == []


async def test_close_interrupted_turns_of_one_session_leaves_the_others_running(store: Store) -> None:
    await store.append_message(KEY, user("1"), begin_turn=("t1", '{"chat": 1}'))
    await store.append_message("other", user("2"), begin_turn=("t2", "{}"))
    [closed] = await store.close_interrupted_turns(key=KEY)
    assert (closed.turn_id, closed.state) == ("t1", "interrupted")
    assert await store.close_interrupted_turns(key=KEY) == []
    assert [t.turn_id for t in await store.close_interrupted_turns()] == ["t2"]


async def test_close_interrupted_turns_of_one_session_and_its_subagents(store: Store) -> None:
    child, grandchild = f"{KEY}{CHILD_MARK}0123456789ab", f"{KEY}{CHILD_MARK}0123456789ab{CHILD_MARK}ba9876543210"
    await store.append_message(KEY, user("1"), begin_turn=("t1", "{}"))
    await store.append_message(child, user("2"), begin_turn=("t2", "{}"))
    await store.append_message(grandchild, user("3"), begin_turn=("t3", "{}"))
    await store.append_message(f"{KEY}x{CHILD_MARK}0123456789ab", user("4"), begin_turn=("t4", "{}"))  # not a child
    closed = await store.close_interrupted_turns(key=KEY, prefix=KEY + CHILD_MARK)
    assert [(t.turn_id, t.session_key) for t in closed] == [("t1", KEY), ("t2", child), ("t3", grandchild)]
    assert [t.turn_id for t in await store.close_interrupted_turns()] == ["t4"]


async def test_a_turn_closed_as_interrupted_is_never_committed_after(store: Store) -> None:
    """A turn record closes once: after a takeover closed it (another process), the old holder's commit
    writes nothing; a commit that came first leaves the takeover nothing to close."""
    await store.append_message(KEY, user("1"), begin_turn=("t1", "{}"))
    await store.close_interrupted_turns(key=KEY)
    revision, before = await store.history(KEY)
    with pytest.raises(TurnEndedError):
        await store.commit_turn(KEY, [assistant("the answer", "t1")], expect_generation=None,
                                expect_state_version=None, end_turn=("t1", "completed"))
    assert await store.history(KEY) == (revision, before)
    await store.append_message(KEY, user("2"), begin_turn=("t2", "{}"))
    await store.commit_turn(KEY, [assistant("answer 2", "t2")], expect_generation=None,
                            expect_state_version=None, end_turn=("t2", "completed"))
    assert await store.close_interrupted_turns(key=KEY) == []
    assert [m.content for m in (await store.history(KEY))[1]] == ["1", "2", "answer 2"]


async def test_undelivered_turns_of_one_session_and_before_a_time(backend: Backend, clock: FakeClock) -> None:
    store = await reopened(backend, clock)
    try:
        for turn_id, key in (("t1", KEY), ("t2", "other"), ("t3", KEY)):
            clock.now += 10
            await store.append_message(key, user(turn_id), begin_turn=(turn_id, "{}"))
            await store.commit_turn(key, [assistant(f"answer {turn_id}", turn_id)], expect_generation=None,
                                    expect_state_version=None, end_turn=(turn_id, "completed"))
        since = clock.now - 100
        assert [u.turn.turn_id for u in await store.undelivered_turns(since, key=KEY)] == ["t1", "t3"]
        assert [u.turn.turn_id for u in await store.undelivered_turns(since, ended_before=clock.now - 5)] == [
            "t1", "t2"]
        assert [u.turn.turn_id for u in await store.undelivered_turns(since, key=KEY, ended_before=clock.now - 5)
                ] == ["t1"]
        assert [u.text for u in await store.undelivered_turns(since, key="other")] == ["answer t2"]
    finally:
        await store.close()


async def test_undelivered_turns_carry_their_answer_until_marked_delivered(store: Store, clock: FakeClock) -> None:
    start = time.time() - 1
    await store.append_message(KEY, user("q1"), begin_turn=("t1", '{"to": 1}'))
    await store.commit_turn(KEY, [assistant("the answer", "t1"), assistant("", "t1")], expect_generation=None,
                            expect_state_version=None, end_turn=("t1", "completed"))
    await store.append_message(KEY, user("q2"), begin_turn=("t2", "{}"))
    await store.commit_turn(KEY, [], expect_generation=None, expect_state_version=None, end_turn=("t2", "failed"))
    await store.append_message(KEY, user("q3"), begin_turn=("t3", "{}"))  # still running: not listed
    found = await store.undelivered_turns(start)
    assert [(u.turn.turn_id, u.turn.state, u.turn.target_json, u.text) for u in found] == [
        ("t1", "completed", '{"to": 1}', "the answer"), ("t2", "failed", "{}", None)]
    await store.mark_delivered("t1")
    await store.mark_delivered("t1")
    assert [u.turn.turn_id for u in await store.undelivered_turns(start)] == ["t2"]
    assert await store.undelivered_turns(time.time() + 60) == []


async def test_turn_record_opens_with_the_message_and_closes_with_the_commit(store: Store) -> None:
    await store.append_message(KEY, user("hi"), begin_turn=("t1", '{"channel": "x"}'))
    await store.commit_turn(KEY, [], expect_generation=None, expect_state_version=None, end_turn=("t1", "completed"))
    await store.append_message(KEY, user("again"), begin_turn=("t2", '{"channel": "x"}'))
    [left_running] = await store.close_interrupted_turns()
    assert left_running.turn_id == "t2" and left_running.target_json == '{"channel": "x"}'


async def test_traces_are_numbered_per_session_in_order(backend: Backend, store: Store) -> None:
    for i in range(3):
        await store.append_traces(KEY, "t1", [("step", {"i": i})])
    await store.append_traces("other", "t9", [("step", {"i": 99})])
    await store.append_traces(KEY, "t2", [("step", {"i": 3}), ("step", {"i": 4})])
    assert [(s, t, p["i"]) for s, t, _, p in await backend.traces(KEY)] == [
        (1, "t1", 0), (2, "t1", 1), (3, "t1", 2), (4, "t2", 3), (5, "t2", 4)]
    assert [(s, t) for s, t, _, _ in await backend.traces("other")] == [(1, "t9")]


async def test_a_commit_carries_its_turn_trace_and_a_stale_one_writes_none(backend: Backend, store: Store) -> None:
    await store.append_message(KEY, user("q"))
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=99,
                                trace=("t1", [("request_begin", {})]))
    assert await backend.traces(KEY) == []
    await store.append_traces(KEY, "t0", [("earlier", {})])
    await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1,
                            trace=("t1", [("request_begin", {"n": 1}), ("request_end", {"status": "completed"})]))
    assert await backend.traces(KEY) == [(1, "t0", "earlier", {}), (2, "t1", "request_begin", {"n": 1}),
                                         (3, "t1", "request_end", {"status": "completed"})]


async def test_a_trace_payload_json_cannot_hold_never_fails_the_commit(backend: Backend, store: Store) -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    await store.append_message(KEY, user("q"))
    result = await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1,
                                     trace=("t1", [("odd", circular), ("fine", {"when": object, "nul": "\x00"})]))
    assert [m.content for m in result.messages] == ["q", "a"]
    records = await backend.traces(KEY)
    assert records[0][3] == {"unencodable_payload": True}
    assert records[1][3]["when"].startswith("<class") and records[1][3]["nul"] == "\x00"


# --------------------------------------------------------------------------------------------- other state


async def test_channel_state_is_durable_and_overwritable(backend: Backend) -> None:
    store = await reopened(backend)
    assert await store.get_channel_state("telegram", "offset") is None
    await store.set_channel_state("telegram", "offset", "41")
    await store.set_channel_state("telegram", "offset", "42")
    await store.close()
    store = await reopened(backend)
    try:
        assert await store.get_channel_state("telegram", "offset") == "42"
        assert await store.get_channel_state("slack", "offset") is None
    finally:
        await store.close()


async def test_channel_state_names_are_listed_by_exact_prefix_and_a_value_can_be_forgotten(backend: Backend) -> None:
    store = await reopened(backend)
    try:
        for name in ("open:b", "open", "open:a", "opened", "Open:c", "offset", "open%", "x_open:d"):
            await store.set_channel_state("telegram", name, "[]")
        await store.set_channel_state("slack", "open:z", "[]")
        # a prefix is matched as it is: no pattern characters, no case folding, no other channel's names
        assert await store.channel_state_names("telegram", "open:") == ["open:a", "open:b"]
        assert await store.channel_state_names("telegram", "open") == ["open", "open%", "open:a", "open:b", "opened"]
        assert await store.channel_state_names("telegram", "open_") == []
        assert await store.channel_state_names("telegram", "%") == []
        assert await store.channel_state_names("web", "") == []
        await store.delete_channel_state("telegram", "open:a")
        await store.delete_channel_state("telegram", "never-set")
        assert await store.get_channel_state("telegram", "open:a") is None
        assert await store.channel_state_names("telegram", "open:") == ["open:b"]
        assert await store.get_channel_state("slack", "open:z") == "[]"
    finally:
        await store.close()


async def test_attachments_are_claimed_and_expire(store: Store) -> None:
    def record(i: str, at: float, claimed: bool) -> AttachmentRecord:
        return AttachmentRecord(id=i, session_key=KEY, kind="image", name=f"{i}.png", content_type="image/png",
                                size=10, created_at=at, claimed=claimed)

    await store.add_attachment(record("a", 100.0, False))
    await store.add_attachment(record("b", 100.0, False))
    await store.add_attachment(record("c", 300.0, True))
    assert await store.get_attachment("a") == record("a", 100.0, False)
    assert await store.get_attachment("missing") is None
    await store.claim_attachments(["b"])
    assert await store.drop_unclaimed_attachments(KEY, before=200.0) == ["a"]
    assert await store.drop_unclaimed_attachments("other", before=1e12) == []
    assert sorted(await store.drop_expired_attachments(200.0)) == ["b"]
    assert await store.get_attachment("c") == record("c", 300.0, True)
    with pytest.raises(StoreError):
        await store.add_attachment(record("c", 400.0, True))


# --------------------------------------------------------------------------------------------- concurrency


async def test_concurrent_appends_get_distinct_seqs(store: Store) -> None:
    results = await asyncio.gather(*(store.append_message(KEY, user(f"m{i}")) for i in range(20)))
    assert sorted(m.seq for m, _ in results) == list(range(1, 21))
    assert sorted(r.state_version for _, r in results) == list(range(1, 21))
    assert sorted(m.seq for m in (await store.history(KEY))[1]) == list(range(1, 21))


async def test_of_two_commits_expecting_the_same_state_exactly_one_lands(store: Store) -> None:
    await store.append_message(KEY, user("q"))  # state_version 1
    results = await asyncio.gather(
        *(store.commit_turn(KEY, [assistant(f"answer {i}")], expect_generation=0, expect_state_version=1)
          for i in range(2)), return_exceptions=True)
    landed = [r for r in results if not isinstance(r, BaseException)]
    assert len(landed) == 1 and sum(isinstance(r, StaleStateError) for r in results) == 1
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["q", landed[0].messages[-1].content]
    session = await store.get_session(KEY)
    assert session is not None and (session.state_version, session.history_revision) == (2, 1)


async def test_a_write_that_fails_part_way_leaves_nothing_and_others_land(store: Store) -> None:
    writes = [store.append_message(KEY, user(f"claims t1 ({i})"), begin_turn=("t1", "{}")) for i in range(2)]
    results = await asyncio.gather(*writes, store.append_message("other:chat", user("elsewhere")),
                                   return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], StoreError) and not isinstance(failed[0], StaleStateError)
    _, history = await store.history(KEY)
    assert len(history) == 1 and history[0].seq == 1  # the failed write's message row went with it
    session = await store.get_session(KEY)
    assert session is not None and session.state_version == 1
    assert [m.content for m in (await store.history("other:chat"))[1]] == ["elsewhere"]
    [running] = await store.close_interrupted_turns()
    assert running.turn_id == "t1"


# --------------------------------------------------------------------------------------------- round trip, errors


async def test_every_character_and_timestamp_round_trips_across_a_reopen(backend: Backend) -> None:
    source = MessageSource(kind="user_input", from_channel="telegram", from_user_id="u-42", reply_to="msg-7",
                           turn_id="turn-1", extra={"nested": [1, "x", None], "flag": True, "z": "\x00"},
                           attachments=(AttachmentRef(id="f1", kind="image", name="a.png", size=3,
                                                      content_type="image/png"),))
    store = await reopened(backend)
    await store.append_message(KEY, NewMessage(role="user", content="héllo 👋 nul \x00 inside", source=source,
                                               received_at=1_712_345_678.123_456_7))
    odd = NewMessage(role="tool", content="a\x00b 👋 \u2028 \"q\" \\", tool_call_id="call\x00x", received_at=1 / 3,
                     source=MessageSource(kind="tool", extra={"z": "\x00"}))
    result = await store.commit_turn(KEY, [odd, assistant("end")], expect_generation=0, expect_state_version=1)
    await store.close()
    store = await reopened(backend)
    try:
        _, history = await store.history(KEY)
    finally:
        await store.close()
    assert list(result.messages) == history
    assert history[0].content == "héllo 👋 nul \x00 inside" and history[0].source == source
    assert history[0].received_at == 1_712_345_678.123_456_7 and len(history[0].id) == 32
    assert (history[1].content, history[1].tool_call_id, history[1].received_at) == (
        odd.content, odd.tool_call_id, 1 / 3)


async def test_a_commit_of_many_messages_lands_whole(store: Store) -> None:
    await store.append_message(KEY, user("q"))
    result = await store.commit_turn(KEY, [assistant(f"part {i}") for i in range(500)], expect_generation=0,
                                     expect_state_version=1)
    assert [m.seq for m in result.messages] == list(range(1, 502))
    assert [m.content for m in (await store.history(KEY))[1]] == ["q", *(f"part {i}" for i in range(500))]


async def test_store_errors_never_carry_content(store: Store) -> None:
    await store.append_message(KEY, user("MSG-SECRET"), begin_turn=("t1", '{"secret": "TARGET-SECRET"}'))
    with pytest.raises(StoreError) as duplicate:
        await store.append_message(KEY, user("MSG-SECRET"), begin_turn=("t1", '{"secret": "TARGET-SECRET"}'))
    assert not isinstance(duplicate.value, StaleStateError)
    assert "SECRET" not in str(duplicate.value)
    await store.append_message(KEY, user("fine"), begin_turn=("t2", "{}"))  # the store is still usable
    with pytest.raises(StoreError) as unencodable:
        await store.rename(KEY, "bad \ud800 title")
    assert "cannot be encoded" in str(unencodable.value) and "\ud800" not in str(unencodable.value)
    with pytest.raises(StoreError):
        await store.append_message(KEY, user("lone \udfff half"))
    assert [m.content for m in (await store.history(KEY))[1]] == ["MSG-SECRET", "fine"]


async def test_a_closed_store_raises_store_error(backend: Backend) -> None:
    store = await reopened(backend)
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        await store.append_message(KEY, user("SECRET"))
    with pytest.raises(StoreError):
        await store.history(KEY)
