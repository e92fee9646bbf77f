"""The ClusterBus on both implementations: notes reach every subscriber of their topic in every process,
in order; bad notes are refused; a lost listening connection comes back and reports the gap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from core.bus import MAX_PAYLOAD_BYTES, BusError, ClusterBus, LocalBus

BOUND = 10.0  # how long a test waits for a note before it fails (a bound, never a measurement)


class Inbox:
    def __init__(self) -> None:
        self.notes: asyncio.Queue[str] = asyncio.Queue()

    def __call__(self, payload: str) -> None:
        self.notes.put_nowait(payload)

    async def next(self) -> str:
        return await asyncio.wait_for(self.notes.get(), BOUND)

    async def take(self, n: int) -> list[str]:
        return [await self.next() for _ in range(n)]


@pytest.fixture(params=["local", "postgresql"])
async def make_bus(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], Any]]:
    """Makes opened buses; with PostgreSQL every bus is a process of its own on one database."""
    opened: list[ClusterBus] = []
    if request.param == "local":
        def make() -> Any:
            return LocalBus()
    else:
        from core.postgresql.bus import PostgresqlBus

        dsn = request.getfixturevalue("postgres").fresh_dsn()

        def make() -> Any:
            return PostgresqlBus(dsn, reconnect_wait_max=0.2)

    async def opened_bus() -> ClusterBus:
        bus = make()
        await bus.open()
        opened.append(bus)
        return bus

    yield opened_bus
    for bus in opened:
        await bus.close()


async def test_a_note_reaches_the_subscribers_of_its_topic_in_order(make_bus: Callable[[], Any]) -> None:
    bus = await make_bus()
    inbox, other, gone = Inbox(), Inbox(), Inbox()
    bus.subscribe("inbound", inbox)
    bus.subscribe("stop", other)
    unsubscribe = bus.subscribe("inbound", gone)
    unsubscribe()
    for i in range(50):
        await bus.publish("inbound", f"session-{i} ünïcødé\n2nd line")
    await bus.publish("stop", "s")
    assert await inbox.take(50) == [f"session-{i} ünïcødé\n2nd line" for i in range(50)]
    assert await other.next() == "s"
    assert inbox.notes.empty() and gone.notes.empty()


async def test_bad_notes_are_refused_with_a_clear_error(make_bus: Callable[[], Any]) -> None:
    bus = await make_bus()
    with pytest.raises(ValueError, match="topic"):
        await bus.publish("Not A Topic", "x")
    with pytest.raises(ValueError, match="at most"):
        await bus.publish("web", "x" * (MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ValueError, match="NUL"):
        await bus.publish("web", "a\x00b")
    with pytest.raises(ValueError, match="topic"):
        bus.subscribe("", Inbox())
    inbox = Inbox()
    bus.subscribe("web", inbox)
    await bus.publish("web", "é" * (MAX_PAYLOAD_BYTES // 2))  # the biggest note that fits
    assert await inbox.next() == "é" * (MAX_PAYLOAD_BYTES // 2)


async def test_a_failing_subscriber_does_not_keep_the_note_from_the_others(make_bus: Callable[[], Any]) -> None:
    bus = await make_bus()
    inbox = Inbox()

    def broken(payload: str) -> None:
        raise RuntimeError("boom")

    bus.subscribe("web", broken)
    bus.subscribe("web", inbox)
    await bus.publish("web", "1")
    await bus.publish("web", "2")
    assert await inbox.take(2) == ["1", "2"]


async def test_notes_cross_processes_both_ways(postgres: Any) -> None:
    from core.postgresql.bus import PostgresqlBus

    dsn = postgres.fresh_dsn()
    a, b = PostgresqlBus(dsn), PostgresqlBus(dsn)
    await a.open()
    await b.open()
    try:
        at_a, at_b = Inbox(), Inbox()
        a.subscribe("stop", at_a)
        b.subscribe("stop", at_b)
        await a.publish("stop", "from a")
        await b.publish("stop", "from b")
        assert sorted(await at_a.take(2)) == ["from a", "from b"]
        assert sorted(await at_b.take(2)) == ["from a", "from b"]
    finally:
        await a.close()
        await b.close()


async def _terminate(dsn: str, where: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return len(await conn.fetch(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    f"WHERE datname = current_database() AND pid <> pg_backend_pid() AND {where}"))
    finally:
        await conn.close()


async def test_a_lost_listening_connection_comes_back_and_reports_the_gap(postgres: Any) -> None:
    from core.postgresql.bus import PostgresqlBus

    dsn = postgres.fresh_dsn()
    bus = PostgresqlBus(dsn, reconnect_wait_max=0.2)
    await bus.open()
    try:
        inbox, gaps = Inbox(), Inbox()
        bus.subscribe("inbound", inbox)
        bus.on_gap(lambda: gaps("gap"))
        await bus.publish("inbound", "before")
        assert await inbox.next() == "before"
        assert await _terminate(dsn, "query LIKE 'LISTEN%'") == 1
        assert await gaps.next() == "gap"
        await bus.publish("inbound", "after")
        assert await inbox.next() == "after"
    finally:
        await bus.close()


async def test_a_publish_on_a_lost_connection_goes_out_on_a_new_one(postgres: Any) -> None:
    from core.postgresql.bus import PostgresqlBus

    dsn = postgres.fresh_dsn()
    bus = PostgresqlBus(dsn)
    await bus.open()
    try:
        inbox = Inbox()
        bus.subscribe("stop", inbox)
        await bus.publish("stop", "1")
        assert await inbox.next() == "1"
        assert await _terminate(dsn, "query LIKE '%pg_notify%'") == 1
        await bus.publish("stop", "2")
        assert await inbox.next() == "2"
    finally:
        await bus.close()


async def test_an_unreachable_server_is_a_clear_error_without_the_password(postgres: Any) -> None:
    from core.postgresql.bus import PostgresqlBus

    bus = PostgresqlBus(f"postgresql://postgres:s3cret-pw@127.0.0.1:{postgres.port + 1}/nowhere")
    assert "s3cret" not in repr(bus)
    with pytest.raises(BusError) as caught:
        await bus.open()
    assert "s3cret" not in str(caught.value)
    with pytest.raises(BusError):
        await bus.publish("stop", "x")
