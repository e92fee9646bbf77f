"""The PostgreSQL backend when the network fails without a word (``tests/support/pgproxy.py`` blackholes a
connection: nothing more gets through either way, nothing is closed) or the server's hang-up is not heard.

- The store (``core.postgresql.bounds``): a statement on a dead connection fails with StoreError in time and
  the next call works on a new connection; a process cut off inside a transaction does not keep its row locks
  (the server ends its session), so another process goes on with the conversation; a call that finds no free
  pooled connection, and ``close`` with an operation stuck, give up in time.
- Every failure is a StoreError, also asyncpg's internal protocol errors on a connection whose server hung up
  unheard (the store's and the leases' calls). The leases' calls are bounded too, and a renewal returns by its
  deadline.
- The bus: a listening connection cut off is found out by its heartbeat, comes back and reports the gap; a
  publish on a dead connection goes out on a new one in time instead of hanging every publish behind it.

Every bound here is small on purpose; each test waits at most ``BOUND`` seconds for anything (a bound on a
hang, never a measurement).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from core.messages import MessageSource, NewMessage
from core.postgresql.bounds import MIN_IDLE_IN_TRANSACTION, StoreBounds
from core.postgresql.bus import PostgresqlBus
from core.postgresql.errors import store_errors
from core.postgresql.leases import PostgresqlLeases
from core.postgresql.store import PostgresqlStore
from core.store import StoreError
from tests.support.pgproxy import PgProxy
from tests.support.postgres import PostgresCluster
from tests.support.store import user

KEY = "web:s1"
BOUND = 20.0

SMALL = StoreBounds(idle_in_transaction=0.5, lock_wait=2.0, command=2.5, acquire=3.0, close=8.0, server_timeout=3.0)
"""A cut-off transaction ends after 0.5 s on the server, well within the lock wait of the process behind it;
a silent connection is given up after 2.5 s (and as long again for asyncpg's cancellation of the statement)."""


def store(dsn: str, bounds: StoreBounds = SMALL, **kwargs: Any) -> PostgresqlStore:
    return PostgresqlStore(dsn, bounds=bounds, **kwargs)


def leases(dsn: str, *, ttl: float = 30.0, bounds: StoreBounds = SMALL) -> PostgresqlLeases:
    return PostgresqlLeases(dsn, ttl=ttl, bounds=bounds)


def bus(dsn: str) -> PostgresqlBus:
    return PostgresqlBus(dsn, reconnect_wait_max=0.2, heartbeat_interval=0.2, heartbeat_timeout=0.5,
                         send_timeout=0.5)


def answer(text: str, turn_id: str) -> NewMessage:
    return NewMessage(role="assistant", content=text, source=MessageSource(kind="assistant", turn_id=turn_id))


@pytest.fixture
def dsn(postgres: PostgresCluster) -> str:
    return postgres.fresh_dsn()


@pytest.fixture
async def proxy(postgres: PostgresCluster) -> AsyncIterator[PgProxy]:
    async with PgProxy(postgres.port) as proxy:
        yield proxy


async def within(awaitable: Any, what: str) -> Any:
    """``awaitable``'s result, or a failure when it is still waiting after ``BOUND`` seconds (it is then
    cancelled, but not waited for: a hang may not even end on cancellation)."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task}, timeout=BOUND)
    if not task.done():
        task.cancel()
        pytest.fail(f"{what}: still waiting after {BOUND:g}s")
    return task.result()


# -------------------------------------------------------------------------------------------------- the bounds


@pytest.mark.parametrize("ttl", [1.0, 10.0, 60.0, 600.0])
def test_the_bounds_keep_a_cut_off_transaction_shorter_than_a_lease(ttl: float) -> None:
    bounds = StoreBounds.for_lease(ttl)
    # a write queued behind a cut-off transaction outlasts it
    assert bounds.idle_in_transaction < bounds.lock_wait
    # the server ends a silent transaction, and one that was itself waiting for a lock, before the ttl (a
    # loaded process may wait 2.5 s between two statements of a sound transaction: a shorter lease has longer)
    assert bounds.idle_in_transaction + bounds.lock_wait < max(ttl, 4 * MIN_IDLE_IN_TRANSACTION)
    # a lock wait ends with the server's error, before the statement's deadline here
    assert bounds.command > bounds.lock_wait
    # and so does TCP, for a session cut off in the middle of a request
    assert bounds.server_timeout < ttl
    assert bounds.close >= bounds.acquire >= bounds.command
    settings = bounds.server_settings("chatbridge store")
    assert set(settings) >= {"idle_in_transaction_session_timeout", "lock_timeout", "tcp_keepalives_idle",
                             "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout"}


async def test_the_pooled_connections_start_with_the_bounds(dsn: str) -> None:
    s = store(dsn, StoreBounds.for_lease(10.0))
    await s.open()
    try:
        await s.get_session(KEY)
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                       " AND application_name = 'chatbridge store'") >= 1
        finally:
            await conn.close()
    finally:
        await s.close()


# -------------------------------------------------------------------------------------------------- the store


async def test_a_statement_on_a_silently_dead_connection_fails_in_time_and_the_next_call_works(
        dsn: str, proxy: PgProxy) -> None:
    s = store(proxy.route(dsn))
    await s.open()
    try:
        await s.get_or_create_session(KEY)
        proxy.blackhole_all()  # a NAT forgot the pooled connection
        with pytest.raises(StoreError, match="append_message"):
            await within(s.append_message(KEY, user("lost")), "append_message on a dead connection")
        message, _ = await within(s.append_message(KEY, user("kept")), "append_message on a new connection")
        assert [m.content for m in (await s.history(KEY))[1]] == ["kept"]
        assert message.content == "kept"
    finally:
        await within(s.close(), "close")


async def test_a_process_cut_off_inside_a_transaction_does_not_freeze_the_conversation(
        dsn: str, proxy: PgProxy) -> None:
    """A (through the proxy) is cut off right after its commit locked the session's row and the turn's; B must
    still close the turn and write to the session: the server ends A's silent transaction and its locks."""
    a, b = store(proxy.route(dsn)), store(dsn)
    await a.open()
    await b.open()
    try:
        await b.append_message(KEY, user("hi"), begin_turn=("t1", "{}"))
        proxy.cut_after("SELECT state FROM turns")
        committing = asyncio.create_task(a.commit_turn(
            KEY, [answer("never heard", "t1")], expect_generation=None, expect_state_version=None,
            end_turn=("t1", "completed")))
        [cut] = await within(_cut_links(proxy), "the cut")
        assert cut.blackholed
        closed = await within(b.close_interrupted_turns(key=KEY), "B closing the turn A left running")
        assert [t.turn_id for t in closed] == ["t1"]
        result = await within(b.commit_turn(KEY, [answer("interrupted", "t1")], expect_generation=None,
                                            expect_state_version=None), "B writing to the session")
        assert result.inserted == 1
        with pytest.raises(StoreError, match="commit_turn"):
            await within(committing, "A's commit on its dead connection")
        assert [m.content for m in (await b.history(KEY))[1]] == ["hi", "interrupted"]
    finally:
        await within(a.close(), "closing A")
        await within(b.close(), "closing B")


async def test_a_commit_whose_answer_is_lost_but_which_landed_is_a_success(dsn: str, proxy: PgProxy) -> None:
    """The server commits a turn's answer and the connection dies before its answer arrives: asyncpg cannot
    tell whether it landed. It is read back: the turn is completed, its answer once in history, no failure."""
    s = store(proxy.route(dsn))
    await s.open()
    try:
        await s.append_message(KEY, user("hi"), begin_turn=("t1", "{}"))
        proxy.cut_after("COMMIT;")  # (not "BEGIN ISOLATION LEVEL READ COMMITTED")
        result = await within(s.commit_turn(KEY, [answer("the answer", "t1")], expect_generation=None,
                                            expect_state_version=None, end_turn=("t1", "completed")),
                              "the commit whose answer was lost")
        assert [m.content for m in result.messages] == ["hi", "the answer"] and result.inserted == 1
        assert [(m.role, m.content) for m in (await s.history(KEY))[1]] == [("user", "hi"),
                                                                            ("assistant", "the answer")]
        assert await s.close_interrupted_turns(key=KEY) == []  # the turn is closed: nothing left running
    finally:
        await within(s.close(), "close")


async def test_a_message_whose_commit_answer_is_lost_but_which_landed_is_stored_once(
        dsn: str, proxy: PgProxy) -> None:
    """The same for the user's message: stored, so not refused (the user is never asked to send it again)."""
    s = store(proxy.route(dsn))
    await s.open()
    try:
        await s.get_or_create_session(KEY)
        proxy.cut_after("COMMIT;")  # (not "BEGIN ISOLATION LEVEL READ COMMITTED")
        message, _ = await within(s.append_message(KEY, user("hello"), begin_turn=("t1", "{}")),
                                  "the write whose answer was lost")
        assert message.content == "hello"
        assert [m.content for m in (await s.history(KEY))[1]] == ["hello"]
    finally:
        await within(s.close(), "close")


async def _cut_links(proxy: PgProxy) -> list[Any]:
    while not (cut := [link for link in proxy.links if link.blackholed]):  # noqa: ASYNC110 (the proxy's state)
        await asyncio.sleep(0.01)
    return cut


async def test_a_call_that_finds_no_free_connection_gives_up_in_time(dsn: str) -> None:
    s = store(dsn, StoreBounds(idle_in_transaction=5.0, lock_wait=30.0, command=40.0, acquire=0.5, close=50.0,
                               server_timeout=10.0), pool_size=1)
    await s.open()
    other = await asyncpg.connect(dsn)
    try:
        await s.get_or_create_session(KEY)
        async with other.transaction():
            await other.execute("LOCK TABLE sessions IN EXCLUSIVE MODE")  # the one pooled connection waits
            waiting = asyncio.create_task(s.append_message(KEY, user("waits for the lock")))
            deadline = time.monotonic() + BOUND
            while not await other.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"):
                assert time.monotonic() < deadline, "the write never reached the server"
                await asyncio.sleep(0.02)
            with pytest.raises(StoreError, match=r"get_session failed \(no connection"):
                await within(s.get_session(KEY), "get_session with every connection busy")
        message, _ = await within(waiting, "the write behind the lock")
        assert message.content == "waits for the lock"
    finally:
        await other.close()
        await within(s.close(), "close")


async def test_close_gives_up_on_an_operation_stuck_past_its_bound(dsn: str, proxy: PgProxy) -> None:
    s = store(proxy.route(dsn), StoreBounds(idle_in_transaction=5.0, lock_wait=5.0, command=300.0, acquire=300.0,
                                            close=0.5, server_timeout=10.0))
    await s.open()
    await s.get_or_create_session(KEY)
    proxy.blackhole_all()
    stuck = asyncio.create_task(s.get_session(KEY))
    await asyncio.sleep(0.1)  # under way (it could not end before 300 s either way)
    await within(s.close(), "close with an operation stuck")
    with pytest.raises(StoreError, match="get_session"):
        await within(stuck, "the operation close gave up on")


# ------------------------------------------------------------------------------------- every failure a StoreError


@pytest.mark.parametrize("error", [
    asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress"),
    asyncpg.ProtocolError("unexpected message"),
    asyncpg.exceptions.TargetServerAttributeNotMatched("not a primary"),
])
def test_every_asyncpg_failure_is_a_store_error(error: Exception) -> None:
    with pytest.raises(StoreError, match=f"get_session failed .*{type(error).__name__}") as caught:
        with store_errors("get_session"):
            raise error
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(KeyError):  # not the store's: passes through
        with store_errors("get_session"):
            raise KeyError("x")


async def _hang_up_unheard(dsn: str, proxy: PgProxy) -> None:
    """The server ends every other connection to the database (only the proxied ones are left); its goodbye
    reaches the client, the hang-up does not."""
    for link in proxy.links:
        link.hide_hangup = True
    admin = await asyncpg.connect(dsn)
    try:
        assert await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'") >= 1
    finally:
        await admin.close()
    gone = [link.server_hung_up.wait() for link in proxy.links if not link.blackholed]
    await within(asyncio.gather(*gone), "the server hanging up")
    await asyncio.sleep(0.1)  # the client reads the goodbye (were it slower, it would time out: a StoreError too)


async def test_a_store_call_on_a_connection_whose_server_hung_up_unheard_is_a_store_error(
        dsn: str, proxy: PgProxy) -> None:
    s = store(proxy.route(dsn), pool_size=1)
    await s.open()
    try:
        await s.get_or_create_session(KEY)
        await _hang_up_unheard(dsn, proxy)
        with pytest.raises(StoreError, match="get_session"):
            await within(s.get_session(KEY), "get_session on a connection the server ended")
        record = await within(s.get_session(KEY), "get_session on a new connection")
        assert record is not None and record.key == KEY
    finally:
        await within(s.close(), "close")


async def test_a_lease_renewal_on_a_connection_whose_server_hung_up_unheard_loses_nothing_yet(
        dsn: str, proxy: PgProxy) -> None:
    setup = store(dsn)
    await setup.open()  # the tables
    await setup.close()
    held = leases(proxy.route(dsn))
    await held.open()
    try:
        assert await held.acquire(KEY)
        await _hang_up_unheard(dsn, proxy)
        assert await within(held.renew(), "renewing on a connection the server ended") == []
        assert held.holds(KEY)  # a failed renewal within the ttl loses nothing
        assert await within(held.renew(), "renewing on a new connection") == []
        assert held.holds(KEY)
    finally:
        await within(held.close(), "closing the leases")


async def test_a_lease_call_on_a_silently_dead_connection_fails_in_time(dsn: str, proxy: PgProxy) -> None:
    setup = store(dsn)
    await setup.open()
    await setup.close()
    held = leases(proxy.route(dsn))
    await held.open()
    try:
        proxy.blackhole_all()
        with pytest.raises(StoreError, match="acquire lease"):
            await within(held.acquire(KEY), "acquiring a lease on a dead connection")
        assert await within(held.acquire(KEY), "acquiring it on a new connection")
    finally:
        await within(held.close(), "closing the leases")


async def test_a_lease_renewal_on_a_silently_dead_connection_returns_by_its_deadline(
        dsn: str, proxy: PgProxy) -> None:
    """The renewal gives up at the first lease's deadline (1 s), without waiting the 6 s more asyncpg takes to
    cancel the statement on the dead connection: the holder learns then that it lost the lease."""
    setup = store(dsn)
    await setup.open()
    await setup.close()
    held = leases(proxy.route(dsn), ttl=1.0, bounds=StoreBounds(
        idle_in_transaction=0.25, lock_wait=0.5, command=6.0, acquire=7.0, close=3.0, server_timeout=0.5))
    await held.open()
    try:
        assert await held.acquire(KEY)
        proxy.blackhole_all()
        started = time.monotonic()
        assert await within(held.renew(), "renewing on a dead connection") == [KEY]
        assert time.monotonic() - started < 3.0  # the deadline is 1 s away; cancelling the statement takes 6
        assert not held.holds(KEY)
    finally:
        await within(held.close(), "closing the leases")


# ------------------------------------------------------------------------------------------------------ the bus


class Inbox:
    def __init__(self) -> None:
        self.notes: asyncio.Queue[str] = asyncio.Queue()

    def __call__(self, payload: str) -> None:
        self.notes.put_nowait(payload)

    async def next(self, what: str) -> str:
        return str(await within(self.notes.get(), what))


async def test_a_listener_cut_off_silently_comes_back_and_reports_the_gap(dsn: str, proxy: PgProxy) -> None:
    a, b = bus(proxy.route(dsn)), bus(dsn)
    await a.open()
    await b.open()
    try:
        inbox, gaps = Inbox(), Inbox()
        a.subscribe("turns", inbox)
        a.on_gap(lambda: gaps("gap"))
        await b.publish("turns", "before")
        assert await inbox.next("the note before the cut") == "before"
        [listening] = proxy.links_that_sent("LISTEN")
        listening.blackhole()
        await b.publish("turns", "missed")  # never reaches a: what the gap is for
        assert await gaps.next("the gap after the listener was cut off") == "gap"
        await b.publish("turns", "after")
        assert await inbox.next("the note after the gap") == "after"
    finally:
        await a.close()
        await b.close()


async def test_a_publish_on_a_silently_dead_connection_goes_out_on_a_new_one_in_time(
        dsn: str, proxy: PgProxy) -> None:
    a, b = bus(proxy.route(dsn)), bus(dsn)
    await a.open()
    await b.open()
    try:
        inbox = Inbox()
        b.subscribe("stop", inbox)
        await a.publish("stop", "1")
        assert await inbox.next("the first note") == "1"
        [sending] = proxy.links_that_sent("pg_notify")
        sending.blackhole()
        # the one behind it waits for the send lock: neither may hang
        await within(asyncio.gather(a.publish("stop", "2"), a.publish("stop", "3")), "publishing")
        got = {await inbox.next("the notes after the cut") for _ in range(2)}
        assert got == {"2", "3"}
    finally:
        await a.close()
        await b.close()

