"""Telegram with several chatbridge processes on one PostgreSQL database.

Long polling, with three ``chatbridge run`` processes on one PostgreSQL database: exactly one
polls the bot (the others stand by, healthy), and when it is SIGKILLed with updates pending, another takes
over from the saved offset: no update is lost, none is answered twice, and the bot never has two pollers
at once (Telegram would end one with 409 Conflict; the fake does the same and counts it).

The kill is placed at the worst moment: the leader has stored and answered a batch but not yet saved its
offset (the test holds the offset's row lock, so the save waits), and a further update waits at Telegram.
The new leader therefore fetches the answered batch again: core's dedupe must drop it.

Webhook mode, with two processes (two cores in this one, each with its own store pool): both take updates,
a retry that lands on the other process is answered once, and a process that stops leaves the webhook
registered for the other."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from channels.telegram.channel import SECRET_HEADER
from channels.telegram.settings import WEBHOOK_PATH
from tests.fakes.openai_server import FakeOpenAI, Function, Text, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness
from tests.support.ports import free_port
from tests.support.postgres import PostgresCluster
from tests.support.process import BridgeProcess, fetched_past, postgresql_config, wait_for


def write_config(directory: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, dsn: str, port: int) -> Path:
    return postgresql_config(directory, dsn=dsn, llm=fake_openai.base_url, port=port, model="fake-model", extra=f"""
[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
edit_interval_ms = 100
""")


async def telegram_state(port: int) -> str | None:
    """The Telegram channel's state on the process's ``/healthz`` (None while it does not answer)."""
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            body: Any = await resp.json()
            return str(body["channels"]["telegram"]) if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError, KeyError):
        return None


def answers(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.text for m in tg.messages(chat) if not m.deleted]


async def test_one_process_polls_and_another_takes_over_after_a_sigkill_losing_nothing_answering_nothing_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, postgres: PostgresCluster) -> None:
    import asyncpg

    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    dsn = postgres.fresh_dsn()
    ports = [free_port() for _ in range(3)]
    bridges = [BridgeProcess(write_config(tmp_path / f"p{i}", fake_openai, tg, dsn, ports[i]), tmp_path / f"p{i}.log")
               for i in range(3)]
    await asyncio.gather(*(b.start() for b in bridges))
    holder: asyncpg.Connection | None = None
    try:
        async def states() -> list[str | None]:
            return list(await asyncio.gather(*(telegram_state(p) for p in ports)))

        async def one_polls_two_stand_by() -> bool:
            return sorted(map(str, await states())) == ["polling", "standby", "standby"]

        await wait_for(one_polls_two_stand_by, bridges, what="one process polling, two standing by", timeout=240)
        leader = (await states()).index("polling")

        m1 = tg.user_message("m1", chat_id=1)
        await wait_for(lambda: answers(tg, 1) == ["echo: m1"], bridges, what="m1 answered", timeout=60)
        await wait_for(lambda: fetched_past(tg, m1["update_id"]), bridges, what="m1's offset confirmed", timeout=60)

        # The leader's next offset save waits on this row lock: it stores and answers m2 and m3, then hangs
        # before saving the offset past them, and does not fetch m4.
        holder = await asyncpg.connect(dsn)
        await holder.execute("BEGIN")
        assert await holder.fetchval("SELECT value FROM channel_state WHERE channel = 'telegram'"
                                     " AND name LIKE 'offset:%' FOR UPDATE") == str(m1["update_id"] + 1)
        m2, _ = tg.user_message("m2", chat_id=2), tg.user_message("m3", chat_id=3)
        await wait_for(lambda: answers(tg, 2) == ["echo: m2"] and answers(tg, 3) == ["echo: m3"], bridges,
                       what="m2 and m3 answered by the leader", timeout=60)
        blocked = "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
        holder_pid = holder.get_server_pid()

        async def offset_save_waits() -> bool:
            assert holder is not None
            return bool(await holder.fetch(blocked, holder_pid))

        await wait_for(offset_save_waits, bridges, what="the leader's offset save waits", timeout=60)
        tg.user_message("m4", chat_id=4)  # pending at Telegram when the leader dies

        killed_at = time.monotonic()  # before the wait for its exit: the new leader may poll while it is reaped
        await bridges[leader].kill()
        # The server notices a vanished client only when it next talks to it, so the dead leader's save would
        # still land once the row is free (which is harmless, but would spare the new leader the re-fetch
        # this test is about); end it as a server with client_connection_check_interval would.
        for row in await holder.fetch(blocked, holder_pid):
            await holder.fetchval("SELECT pg_terminate_backend($1)", row["pid"])
        await holder.execute("ROLLBACK")
        await holder.close()
        holder = None

        survivors = [p for i, p in enumerate(ports) if i != leader]
        await wait_for(lambda: answers(tg, 4) == ["echo: m4"], bridges, what="m4 answered by the new leader",
                       timeout=60)
        polls_after = [c for c in tg.calls if c.method == "getUpdates" and c.at > killed_at]
        print(f"\ntelegram polling taken over {polls_after[0].at - killed_at:.3f}s after the leader's SIGKILL")
        # the new leader started from the offset saved before m2: it fetched m2 and m3 again
        assert int(polls_after[0].params.get("offset") or 0) == m2["update_id"]
        await asyncio.sleep(1.0)  # anything answered twice would show by now

        for chat in (1, 2, 3, 4):
            assert answers(tg, chat) == [f"echo: m{chat}"]  # each message answered exactly once
        assert len(fake_openai.requests) == 4
        assert tg.conflicts == 0  # never two pollers at once
        assert sorted(map(str, await asyncio.gather(*(telegram_state(p) for p in survivors)))) == [
            "polling", "standby"]
        for i, bridge in enumerate(bridges):
            if i != leader:
                assert await bridge.stop() == 0
                assert "Traceback" not in bridge.log(), bridge.log()
    finally:
        if holder is not None:
            await holder.close()
        for bridge in bridges:
            await bridge.stop()


async def test_webhook_mode_takes_updates_in_every_process_and_one_that_stops_leaves_the_webhook_to_the_other(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, postgres: PostgresCluster) -> None:
    from core.postgresql.leader import PostgresqlLeadership
    from core.postgresql.store import PostgresqlStore

    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    dsn = postgres.fresh_dsn()
    processes: list[TelegramHarness] = []
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    try:
        for i in range(2):
            t = await telegram_harness(
                tmp_path / f"p{i}", fake_openai, tg, mode="webhook", webhook_url="https://bot.example.com/telegram/webhook",
                webhook_secret="s3cret", core={"store": PostgresqlStore(dsn, pool_size=2),
                                               "leadership": PostgresqlLeadership(dsn)})
            processes.append(t)
            app = web.Application()
            t.channel.routes(app)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}{WEBHOOK_PATH}")
        first = tg.user_message("w1", chat_id=11, enqueue=False)
        second = tg.user_message("w2", chat_id=12, enqueue=False)
        async with aiohttp.ClientSession() as http:
            async def post(url: str, update: dict[str, Any]) -> int:
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    return resp.status

            assert await post(urls[0], first) == 200
            await processes[0].wait_for(lambda: answers(tg, 11) == ["echo: w1"], timeout=30)
            assert await post(urls[1], first) == 200  # Telegram's retry, landing on the other process
            await processes[0].channel.stop()
            assert tg.webhook is not None  # still registered: the other process receives through it
            assert await post(urls[1], second) == 200
            await processes[1].wait_for(lambda: answers(tg, 12) == ["echo: w2"], timeout=30)
        for t in processes:
            await t.h.settle()
        assert answers(tg, 11) == ["echo: w1"] and answers(tg, 12) == ["echo: w2"]  # each once
        assert len(fake_openai.requests) == 2
        assert tg.count("getUpdates") == 0
    finally:
        for t in processes:
            await t.close()
        for runner in runners:
            await runner.cleanup()
