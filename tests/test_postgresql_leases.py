"""Session leases on the test cluster (``core.postgresql.leases``): one holder at a time, taken over only once
expired (the expiry is moved into the past in the database, instead of waiting for it), lost when another
process took it, given back at close; and the sessions a sweeper must take over. Over them, processes'
liveness (``core.processes``): a live process is never claimed, a dead one by one live process at a time, and
one whose liveness lapsed while it lived (its renewals did not reach the database for longer than the ttl) is
alive again at its next beat, also when another process had claimed its place meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from core.agent.subagents import CHILD_GLOB, CHILD_MARK
from core.messages import MessageSource, NewMessage
from core.postgresql.leases import PostgresqlLeases
from core.postgresql.store import PostgresqlStore
from core.processes import Processes
from tests.support.postgres import PostgresCluster

KEY = "web:one"


@pytest.fixture
async def dsn(postgres: PostgresCluster) -> AsyncIterator[str]:
    dsn = postgres.fresh_dsn()
    store = PostgresqlStore(dsn)  # creates the tables
    await store.open()
    await store.close()
    yield dsn


async def opened(dsn: str) -> PostgresqlLeases:
    leases = PostgresqlLeases(dsn, ttl=30, exclude_glob=CHILD_GLOB)
    await leases.open()
    return leases


async def expire_all(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE leases SET expires_at = clock_timestamp() - interval '1 second'")
    finally:
        await conn.close()


async def test_one_holder_at_a_time_until_it_releases(dsn: str) -> None:
    a, b = await opened(dsn), await opened(dsn)
    try:
        assert await a.acquire(KEY) and a.holds(KEY)
        assert not await b.acquire(KEY) and not b.holds(KEY)
        assert await b.held_elsewhere(KEY) and not await a.held_elsewhere(KEY)
        assert await a.acquire(KEY)  # the holder may ask again
        assert await b.acquire("web:two")  # other sessions are free
        await a.release(KEY)
        assert not a.holds(KEY)
        assert await b.acquire(KEY)
    finally:
        await a.close()
        await b.close()


async def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_lost_it(dsn: str) -> None:
    a, b = await opened(dsn), await opened(dsn)
    try:
        assert await a.acquire(KEY) and await a.acquire("web:kept")
        assert await a.renew() == []
        await expire_all(dsn)  # a stopped renewing for longer than the ttl
        assert await b.acquire(KEY)
        assert await a.renew() == [KEY]  # the other one, not taken by anyone, is renewed
        assert not a.holds(KEY) and a.holds("web:kept")
        assert not await a.acquire(KEY)
    finally:
        await a.close()
        await b.close()


async def test_close_gives_every_lease_back(dsn: str) -> None:
    a, b = await opened(dsn), await opened(dsn)
    try:
        assert await a.acquire(KEY) and await a.acquire("web:two")
        await a.close()
        assert await b.acquire(KEY) and await b.acquire("web:two")
    finally:
        await b.close()


async def test_orphans_are_sessions_with_work_and_no_live_lease(dsn: str) -> None:
    store = PostgresqlStore(dsn)
    await store.open()
    a = await opened(dsn)
    try:
        user = NewMessage(role="user", content="q", source=MessageSource(kind="user_input"))
        await store.admit_inbound("web", None, "{}", ttl_seconds=60, key="web:waiting")
        await store.append_message("web:running", user, begin_turn=("t1", "{}"))
        await store.append_message(f"web:running{CHILD_MARK}0123456789ab", user, begin_turn=("t2", "{}"))
        await store.append_message("web:undelivered", user, begin_turn=("t3", "{}"))
        await store.commit_turn("web:undelivered", [], expect_generation=None, expect_state_version=None,
                                end_turn=("t3", "completed"))
        await store.append_message("web:delivered", user, begin_turn=("t4", "{}"))
        await store.commit_turn("web:delivered", [], expect_generation=None, expect_state_version=None,
                                end_turn=("t4", "completed"))
        await store.mark_delivered("t4")
        assert sorted(await a.orphans(limit=10)) == ["web:running", "web:waiting"]  # no delivery, no child
        assert await a.acquire("web:running")
        assert await a.orphans(limit=10) == ["web:waiting"]
        assert len(await a.orphans(limit=1)) == 1
        await expire_all(dsn)
        assert sorted(await a.orphans(limit=10)) == ["web:running", "web:waiting"]
        # a subagent's turn left running after its parent's was closed: its conversation has work
        await store.close_interrupted_turns(key="web:running", prefix="web:running" + CHILD_MARK)
        nested = f"web:child-left{CHILD_MARK}0123456789ab{CHILD_MARK}ba9876543210"
        await store.append_message(nested, user, begin_turn=("t5", "{}"))
        assert sorted(await a.orphans(limit=10)) == ["web:child-left", "web:waiting"]
    finally:
        await a.close()
        await store.close()


async def test_a_renewal_the_database_does_not_answer_loses_the_lease_at_its_deadline_not_later(dsn: str) -> None:
    """A holder cut off from the database (here: its renewal waits on a row lock another session keeps) must
    learn by its deadline that it lost the lease, because from then on another process may take it."""
    leases = PostgresqlLeases(dsn, ttl=1.0)
    await leases.open()
    blocker = await asyncpg.connect(dsn)
    try:
        assert await leases.acquire(KEY)
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM leases WHERE name = $1 FOR UPDATE", KEY)
            async with asyncio.timeout(30):  # a bound on a hang, not a measure: the deadline is 1 s away
                assert await leases.renew() == [KEY]
            assert not leases.holds(KEY)
    finally:
        await blocker.close()
        await leases.close()


async def test_a_lease_given_back_and_taken_again_while_a_renewal_is_on_its_way_is_not_lost(dsn: str) -> None:
    """A worker gives its idle conversation's lease back and takes it again for the next message while the
    heartbeat's renewal waits on the server (here: on a row lock of another lease, which it updates first);
    the renewal then finds the old row gone. The lease taken again still holds: nothing is abandoned."""
    first, again = "web:a-first", "web:b-again"  # the renewal's index scan reaches ``first`` first
    leases = await opened(dsn)
    blocker = await asyncpg.connect(dsn)
    try:
        assert await leases.acquire(first) and await leases.acquire(again)
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM leases WHERE name = $1 FOR UPDATE", first)
            renewal = asyncio.create_task(leases.renew())
            deadline = asyncio.get_running_loop().time() + 10
            while not await blocker.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"):
                assert asyncio.get_running_loop().time() < deadline, "the renewal never reached the server"
                await asyncio.sleep(0.02)
            await leases.release(again)
            assert await leases.acquire(again)
        assert await renewal == []
        assert leases.holds(first) and leases.holds(again)
        assert await leases.renew() == []  # and it is renewed from now on
    finally:
        await blocker.close()
        await leases.close()


@pytest.fixture
async def trio(dsn: str) -> AsyncIterator[list[tuple[Processes, PostgresqlLeases]]]:
    made = []
    for node in ("a", "b", "c"):
        leases = PostgresqlLeases(dsn, ttl=30)
        await leases.open()
        processes = Processes(leases, node)
        await processes.announce()
        made.append((processes, leases))
    yield made
    for _, leases in made:
        await leases.close()


async def beat(processes: Processes, leases: PostgresqlLeases) -> None:
    """One heartbeat as ``core.failover`` runs it: renew every lease, then mind this process's liveness."""
    await processes.renewed(await leases.renew())


async def test_a_live_process_is_never_claimed_and_a_dead_one_by_one_process(dsn: str, trio) -> None:
    (a, _), (b, b_leases), (c, _) = trio
    assert await b.alive("a") and await c.alive("a")
    assert not await b.claim("a")
    await b_leases.close()  # b stops: its liveness is given back
    assert not await a.alive("b")
    assert await a.claim("b")
    assert not await c.claim("b")  # one cleans up after it, not two
    await a.unclaim("b")
    assert await c.claim("b")


async def test_a_lapsed_liveness_is_taken_again_at_the_next_beat(dsn: str, trio) -> None:
    (a, a_leases), (b, _), _ = trio
    await expire_all(dsn)  # a's renewals did not reach the database for longer than the ttl
    assert not await b.alive("a")
    await beat(a, a_leases)
    assert await b.alive("a")
    assert not await b.claim("a")


async def test_a_lapsed_liveness_claimed_meanwhile_is_taken_again_once_the_claim_ends(dsn: str, trio) -> None:
    (a, a_leases), (b, _), (c, _) = trio
    await expire_all(dsn)
    assert await b.claim("a")  # b takes a for dead and cleans up after it
    await beat(a, a_leases)  # a learns it lost its liveness, but b holds it now (c sees it taken)
    await b.unclaim("a")
    await beat(a, a_leases)
    assert await b.alive("a") and await c.alive("a")
    assert not await c.claim("a")
