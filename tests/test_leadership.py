"""Leadership (``core.leadership``): one holder of a name at a time, in one process (``LocalLeadership``) and
across processes on one PostgreSQL database (``core.postgresql.leader``, against the test cluster): a waiter
gets the lead when the holder releases it, when the holder's connection is cut, and when the holding
process is killed; a holder whose connection is cut notices and stops; ``run_as_leader`` runs its work only
while the lead is held."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from core.leadership import Lead, Leadership, LocalLeadership, run_as_leader
from tests.support.postgres import PostgresCluster
from tests.support.process import ROOT

NAME = "telegram:polling:123456"


async def until(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` (sync or async) until true; a bound on a hang, never a measure of speed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        result = cond()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: not reached")


# ---- the advisory lock as the server shows it ---------------------------------------------------------------


async def lock_rows(dsn: str, name: str) -> list[tuple[int, bool]]:
    """(pid, granted) of every session holding or waiting for the advisory lock of ``name``."""
    import asyncpg

    from core.postgresql.leader import lock_key

    key = lock_key(name) & 0xFFFF_FFFF_FFFF_FFFF
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
                                " AND classid::bigint = $1 AND objid::bigint = $2", key >> 32, key & 0xFFFF_FFFF)
        return [(int(r["pid"]), bool(r["granted"])) for r in rows]
    finally:
        await conn.close()


async def terminate(dsn: str, pid: int) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()


def postgresql_leadership(dsn: str, **kw: Any) -> Leadership:
    from core.postgresql.leader import PostgresqlLeadership

    options: dict[str, Any] = {"wait_slice": 0.2, "check_interval": 0.1, "check_timeout": 5.0, "retry_max_wait": 0.2}
    options.update(kw)
    return PostgresqlLeadership(dsn, **options)


@pytest.fixture(params=["local", "postgresql"])
async def two_processes(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Leadership, Leadership, str]]:
    """Two processes' leaderships over one store (for SQLite there is only one process: one object)."""
    if request.param == "local":
        local = LocalLeadership()
        yield local, local, ""
        return
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    dsn = cluster.fresh_dsn()
    yield postgresql_leadership(dsn), postgresql_leadership(dsn), dsn


async def test_a_name_has_one_holder_and_the_waiter_takes_it_when_released(
        two_processes: tuple[Leadership, Leadership, str]) -> None:
    first, second, dsn = two_processes
    held = await first.acquire(NAME)
    other = await second.acquire("telegram:polling:999")  # another name is independent
    waiting = asyncio.ensure_future(second.acquire(NAME))
    if dsn:
        await until(lambda: _waits(dsn), "the second process waits for the lock")
    else:
        await asyncio.sleep(0.05)
    assert not waiting.done()
    await held.release()
    taken = await asyncio.wait_for(waiting, 20)
    assert taken.name == NAME
    watching = asyncio.ensure_future(taken.watch())
    await asyncio.sleep(0.3)  # several probes of a healthy connection
    assert not watching.done()  # a held lead is not lost
    watching.cancel()
    for lead in (taken, other):
        await lead.release()
        await lead.release()  # idempotent


async def _waits(dsn: str) -> bool:
    rows = await lock_rows(dsn, NAME)
    return sorted(granted for _, granted in rows) == [False, True]


async def test_a_cancelled_waiter_leaves_nothing_behind(postgres: PostgresCluster) -> None:
    dsn = postgres.fresh_dsn()
    first, second, third = (postgresql_leadership(dsn) for _ in range(3))
    held = await first.acquire(NAME)
    waiting = asyncio.ensure_future(second.acquire(NAME))
    await until(lambda: _waits(dsn), "the second process waits")
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await until(lambda: _only_holder(dsn), "the cancelled waiter's session is gone")
    await held.release()
    lead = await asyncio.wait_for(third.acquire(NAME), 20)  # the lock went to the third, not to a ghost
    assert [granted for _, granted in await lock_rows(dsn, NAME)] == [True]
    await lead.release()
    await until(lambda: _no_rows(dsn), "released")


async def _only_holder(dsn: str) -> bool:
    return [granted for _, granted in await lock_rows(dsn, NAME)] == [True]


async def _no_rows(dsn: str) -> bool:
    return await lock_rows(dsn, NAME) == []


async def test_a_holder_whose_connection_is_cut_notices_and_the_waiter_takes_over(postgres: PostgresCluster) -> None:
    dsn = postgres.fresh_dsn()
    first, second = postgresql_leadership(dsn), postgresql_leadership(dsn)
    held = await first.acquire(NAME)
    [(holder_pid, _)] = await lock_rows(dsn, NAME)
    watching = asyncio.ensure_future(held.watch())
    waiting = asyncio.ensure_future(second.acquire(NAME))
    await until(lambda: _waits(dsn), "the second process waits")
    await terminate(dsn, holder_pid)  # the server ends the holder's session, as a cut connection does
    await asyncio.wait_for(watching, 20)  # the holder learns it lost the lead
    taken = await asyncio.wait_for(waiting, 20)
    [(pid, granted)] = await lock_rows(dsn, NAME)
    assert granted and pid != holder_pid
    await held.release()  # after the loss: harmless
    await taken.release()


async def test_the_lead_of_a_killed_process_passes_to_a_waiter(postgres: PostgresCluster) -> None:
    dsn = postgres.fresh_dsn()
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, dsn, NAME, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None
        assert (await asyncio.wait_for(holder.stdout.readline(), 30)).strip() == b"leading"
        waiting = asyncio.ensure_future(postgresql_leadership(dsn).acquire(NAME))
        await until(lambda: _waits(dsn), "this process waits")
        holder.send_signal(signal.SIGKILL)  # no code of the holder runs: the server sees its connection drop
        await holder.wait()
        lead = await asyncio.wait_for(waiting, 20)
        await lead.release()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


HOLDER = """
import asyncio, sys
from core.postgresql.leader import PostgresqlLeadership

async def main():
    lead = await PostgresqlLeadership(sys.argv[1]).acquire(sys.argv[2])
    print("leading", flush=True)
    await asyncio.sleep(3600)
    await lead.release()

asyncio.run(main())
"""


async def test_acquire_keeps_trying_while_the_database_cannot_be_reached(
        postgres: PostgresCluster, caplog: pytest.LogCaptureFixture) -> None:
    import asyncpg

    name = f"t_late_{os.getpid()}"
    # not created yet: every connection attempt fails (the password is ignored by the test cluster's trust auth)
    dsn = postgres.dsn(name).replace("postgres@", "postgres:hunter2-secret@")
    waiting = asyncio.ensure_future(postgresql_leadership(dsn).acquire(NAME))
    await asyncio.sleep(0.5)  # several failed attempts
    assert not waiting.done()
    admin = await asyncpg.connect(postgres.dsn())
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    lead = await asyncio.wait_for(waiting, 20)
    await lead.release()
    assert f"waiting for the lead of {NAME}" in caplog.text  # the operator sees why it waits...
    assert "hunter2" not in caplog.text  # ...never the password


class ScriptedLead:
    """A lead whose loss the test decides (to drive ``run_as_leader``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lost = asyncio.Event()
        self.released = False

    async def watch(self) -> None:
        await self.lost.wait()

    async def release(self) -> None:
        self.released = True


async def test_run_as_leader_works_only_while_the_lead_is_held() -> None:
    leads: asyncio.Queue[ScriptedLead] = asyncio.Queue()
    given: list[ScriptedLead] = []
    states: list[bool] = []
    runs: list[str] = []
    stop_working = asyncio.Event()

    async def acquire() -> Lead:
        lead = await leads.get()
        given.append(lead)
        return lead

    async def work() -> None:
        runs.append("started")
        try:
            await stop_working.wait()
        except asyncio.CancelledError:
            runs.append("cancelled")
            raise
        runs.append("returned")

    running = asyncio.ensure_future(run_as_leader(acquire, work, on_change=states.append))
    await asyncio.sleep(0.05)
    assert runs == [] and states == []  # no lead, no work
    leads.put_nowait(ScriptedLead("a"))
    await until(lambda: runs == ["started"], "work starts with the lead")
    assert states == [True]
    given[0].lost.set()  # the lead is lost: the work stops at once, the lead is let go
    await until(lambda: runs == ["started", "cancelled"], "work cancelled")
    await until(lambda: given[0].released, "released")
    assert states == [True, False]
    await asyncio.sleep(0.05)
    assert runs == ["started", "cancelled"]  # standing by: no work until the lead is held again
    leads.put_nowait(ScriptedLead("b"))
    await until(lambda: runs[-1] == "started", "work starts again with the new lead")
    stop_working.set()  # work that ends by itself ends the loop and releases the lead
    await asyncio.wait_for(running, 5)
    assert runs == ["started", "cancelled", "started", "returned"]
    assert states == [True, False, True, False]
    assert given[1].released


async def test_run_as_leader_cancelled_releases_the_lead_and_a_failure_propagates() -> None:
    lead = ScriptedLead("a")

    async def acquire() -> Lead:
        return lead

    running = asyncio.ensure_future(run_as_leader(acquire, lambda: asyncio.Event().wait(), on_change=lambda _: None))
    await asyncio.sleep(0.05)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert lead.released

    async def broken() -> None:
        raise RuntimeError("boom")

    again = ScriptedLead("b")

    async def acquire_again() -> Lead:
        return again

    with pytest.raises(RuntimeError, match="boom"):
        await run_as_leader(acquire_again, broken, on_change=lambda _: None)
    assert again.released
