"""Approvals decided through a process that does not run the turn, against a real PostgreSQL server: two
ChatCores, each with its web chat, its store and its bus on one database (two processes in all but the
pid). The holder decides by its own rule and its answer comes back to the process that was asked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp

from core.host import DecideResult
from tests.browser.server import RecordingTool, WebChat, open_stream, registry, start_web_chat
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls


async def two_processes(tmp_path: Path, fake: FakeOpenAI, dsn: str, tool: RecordingTool) -> list[WebChat]:
    from core.postgresql.bus import PostgresqlBus
    from core.postgresql.store import PostgresqlStore

    chats = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        chats.append(await start_web_chat(tmp_path / name, fake, tools=registry(tool),
                                          store=PostgresqlStore(dsn, pool_size=2), bus=PostgresqlBus(dsn)))
    return chats


async def test_a_decision_sent_to_another_process_reaches_the_turn_and_its_rule(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: Any) -> None:
    tool = RecordingTool("lookup", result="42 apples")
    a, b = await two_processes(tmp_path, fake_openai, postgres.fresh_dsn(), tool)
    try:
        fake_openai.script(ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_R1"]), Text("42 apples."))
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{b.base_url}/api/sessions") as resp:
                sid = (await resp.json())["id"]
            sse = await open_stream(http, b.base_url, sid)
            async with http.post(f"{b.base_url}/api/sessions/{sid}/messages", json={"text": "apples?"}) as resp:
                assert resp.status == 202
            await sse.until(lambda e: e.name == "approval_request")
            host_a = a.core.host_for("web")
            key = f"web:{sid}"
            # not pending in A: forwarded to B, where only the asker (or a named user) may decide
            assert await host_a.decide(key, "call_R1", "allow", decided_by="mallory") is DecideResult.REFUSED
            assert tool.calls == []
            started = time.monotonic()
            assert await host_a.decide(key, "call_NONE", "allow", decided_by="web-user") is DecideResult.NOT_PENDING
            print(f"\nNOT_PENDING after {time.monotonic() - started:.2f} s (nobody holds it)")
            async with http.post(f"{a.base_url}/api/sessions/{sid}/approvals/call_R1",
                                 json={"decision": "allow"}) as resp:
                assert resp.status == 200
            await sse.until(lambda e: e.name == "turn" and e.data["state"] == "completed")
            assert tool.calls == [{"query": "apples"}]
            # decided: a second decision through either process finds nothing pending
            async with http.post(f"{a.base_url}/api/sessions/{sid}/approvals/call_R1",
                                 json={"decision": "deny"}) as resp:
                assert resp.status == 404
            sse.resp.close()
    finally:
        await a.close()
        await b.close()
