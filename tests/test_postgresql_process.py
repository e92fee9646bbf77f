"""``chatbridge run`` with ``[store] backend = "postgresql"``, as real processes against the test cluster: two
processes starting together on an empty database migrate it once, and a conversation held over the web
chat survives a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.fakes.openai_server import FakeOpenAI, Text
from tests.support.ports import free_port
from tests.support.postgres import PostgresCluster
from tests.support.process import BridgeProcess, get_json, postgresql_config, wait_for


async def waiting_for_the_migration_lock(dsn: str) -> int:
    import asyncpg

    from core.postgresql.schema import MIGRATION_LOCK

    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                                       " AND objid = $1", MIGRATION_LOCK))
    finally:
        await conn.close()


async def test_two_processes_on_an_empty_database_migrate_once_and_history_survives_a_restart(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    import asyncpg

    from core.postgresql.schema import MIGRATION_LOCK, MIGRATIONS
    from core.postgresql.store import database_schema_version

    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    bridges = [BridgeProcess(postgresql_config(tmp_path / f"p{i}", dsn=f"${{CHATBRIDGE_TEST_DSN:-{dsn}}}",
                                               llm=fake_openai.base_url, port=ports[i],
                                               api_key="sk-postgresql-process"),
                             tmp_path / f"p{i}.log")
               for i in range(2)]
    # Hold the migration lock while both start, so both reach it before either migrates: then they
    # really start together, and the one that waits finds the work done.
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
        await asyncio.gather(*(b.start() for b in bridges))

        async def both_waiting() -> bool:
            return await waiting_for_the_migration_lock(dsn) == 2
        await wait_for(both_waiting, bridges)
        assert await database_schema_version(dsn) == 0
        await holder.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    finally:
        await holder.close()
    try:
        async def both_up() -> bool:
            return all([await get_json(f"http://127.0.0.1:{p}/healthz") for p in ports])
        await wait_for(both_up, bridges)
        assert await database_schema_version(dsn) == len(MIGRATIONS)
        assert await bridges[1].stop() == 0
        for bridge in bridges:
            assert "ERROR" not in bridge.log() and "Traceback" not in bridge.log(), bridge.log()

        fake_openai.script(Text("Kept on the PostgreSQL server."))
        base = f"http://127.0.0.1:{ports[0]}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/api/sessions") as resp:
                assert resp.status == 201
                sid = (await resp.json())["id"]
            async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "where is this kept?"}) as resp:
                assert resp.status == 202

        async def answered() -> bool:
            body = await get_json(f"{base}/api/sessions/{sid}/history")
            return bool(body) and len(body["messages"]) == 2
        await wait_for(answered, bridges)
        before = await get_json(f"{base}/api/sessions/{sid}/history")
        assert await bridges[0].stop() == 0

        again = await BridgeProcess(bridges[0].config, tmp_path / "again.log").start()
        bridges.append(again)

        async def up_again() -> bool:
            return bool(await get_json(f"{base}/healthz"))
        await wait_for(up_again, bridges)
        after = await get_json(f"{base}/api/sessions/{sid}/history")
        assert [(m["role"], m["content"]) for m in after["messages"]] == [
            ("user", "where is this kept?"), ("assistant", "Kept on the PostgreSQL server.")]
        assert after == before
        assert not (tmp_path / "p0" / "data" / "chatbridge.db").exists()  # nothing went to SQLite
        assert "ERROR" not in again.log() and "Traceback" not in again.log(), again.log()
    finally:
        for bridge in bridges:
            await bridge.stop()
