"""The web chat across two real ``chatbridge run`` processes on one PostgreSQL database: a browser connected
to process A sees, in order and under A's own monotonic event ids, every event of a turn process B runs
(turn progress, its approval request, the history delta, the title); the approval is decided through A's
web API and reaches the turn on B (the tool runs, the answer arrives); a lost bus connection tells A's
browsers to resynchronise, and the turns that follow still reach them. The fan-out latency (B's browser
to A's browser) is printed, never asserted."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.browser.server import Event, open_stream, seq_of
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
from tests.support.cluster import Cluster, Follower, assert_monotonic
from tests.support.postgres import PostgresCluster
from tests.support.process import wait_for

ECHO_SERVER = Path(__file__).resolve().parent / "mcp_servers" / "echo_server.py"
MCP_ECHO = f"""
[[agent.mcp_servers]]
name = "echo"
command = "{sys.executable}"
args = ["{ECHO_SERVER}"]
approval = "ask"
"""


def shown(events: list[Event]) -> list[tuple[str, Any]]:
    return [(e.name, e.data) for e in events]


async def listeners(dsn: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                       " AND pid <> pg_backend_pid() AND query LIKE 'LISTEN%'"))
    finally:
        await conn.close()


async def terminate_listeners(dsn: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return len(await conn.fetch("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                                    "current_database() AND pid <> pg_backend_pid() AND query LIKE 'LISTEN%'"))
    finally:
        await conn.close()


async def test_a_browser_on_one_process_follows_and_approves_a_turn_another_process_runs(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    dsn = postgres.fresh_dsn()
    cluster = Cluster(tmp_path, fake_openai, dsn, 2, titles=True, extra=MCP_ECHO)
    bridges = cluster.bridges
    a, b = cluster.base(0), cluster.base(1)
    followers: list[Follower] = []
    try:
        await cluster.start()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{a}/api/sessions") as resp:
                sid = (await resp.json())["id"]
            at_a = Follower(await open_stream(http, a, sid))
            at_b = Follower(await open_stream(http, b, sid))
            followers += [at_a, at_b]
            await at_a.until(lambda e: e.name == "task_state")
            await at_b.until(lambda e: e.name == "task_state")

            fake_openai.script(ToolCalls([("echo__echo", '{"text": "42 apples"}')], ids=["call_F1"]),
                               Text("The basket holds 42 apples, as the tool says.", chunk_size=3, delay=0.01),
                               Text("Apple count"))
            async with http.post(f"{b}/api/sessions/{sid}/messages", json={"text": "how many apples?"}) as resp:
                assert resp.status == 202
            asked = await at_a.until(lambda e: e.name == "approval_request")
            request = at_a.events[asked].data
            assert (request["call_id"], request["tool_name"]) == ("call_F1", "echo__echo")

            async with http.post(f"{a}/api/sessions/{sid}/approvals/call_F1", json={"decision": "allow"}) as resp:
                assert (resp.status, await resp.json()) == (200, {"call_id": "call_F1", "decision": "allow"})
            titled_a = await at_a.until(lambda e: e.name == "session_title")
            await at_b.until(lambda e: e.name == "session_title")

            # A's browser saw exactly what B's did, in the same order, under A's own ids
            assert shown(at_a.events[:titled_a + 1]) == shown(at_b.events)
            assert_monotonic(at_a.events)
            assert seq_of(at_a.events[0].id)[0] != seq_of(at_b.events[0].id)[0]
            turns = [e.data for e in at_a.events if e.name == "turn"]
            text = ""
            for t in turns:
                text = t["replace"] if "replace" in t else text + t.get("append", "")
            assert text == "The basket holds 42 apples, as the tool says." and turns[-1]["state"] == "completed"
            committed = next(e.data for e in at_a.events if e.name == "turn_committed")
            assert [m["role"] for m in committed["messages"]] == ["user", "assistant", "tool", "assistant"]
            assert committed["messages"][2]["content"] == "42 apples"  # the tool ran, on B
            assert at_a.events[titled_a].data == {"session_id": sid, "title": "Apple count"}

            # the fan-out delay, per event: A's browser against B's (printed, never asserted)
            delays = [(ta - tb) * 1000 for (ta, _), (tb, _) in zip(at_a.arrived[1:], at_b.arrived[1:], strict=False)]
            print(f"\nweb fan-out over LISTEN/NOTIFY, {len(delays)} events: p50 {statistics.median(delays):.1f} ms, "
                  f"max {max(delays):.1f} ms")

            # a lost bus connection: A's browser is told to resynchronise, and later turns still reach it
            seen = len(at_a.events)
            assert await terminate_listeners(dsn) == 2
            resync = await at_a.until(lambda e: e.name == "resync_required", after=seen)
            state = await at_a.until(lambda e: e.name == "task_state", after=resync)
            assert at_a.events[state].data["turn"] is None
            fake_openai.script(Text("Still here."))

            async def listening_again() -> bool:
                return await listeners(dsn) == 2
            await wait_for(listening_again, bridges)
            async with http.post(f"{b}/api/sessions/{sid}/messages", json={"text": "still there?"}) as resp:
                assert resp.status == 202
            again = await at_a.until(lambda e: e.name == "turn_committed", after=state)
            assert at_a.events[again].data["messages"][-1]["content"] == "Still here."
            assert_monotonic(at_a.events)

            # a reconnect to A with B's last event id cannot replay there: resync_required, then task_state
            moved = await open_stream(http, a, sid, last_event_id=at_b.events[-1].id)
            first, second = await moved.next(), await moved.next()
            assert (first.name, second.name) == ("resync_required", "task_state")
            moved.resp.close()
        for bridge in bridges:
            assert "Traceback" not in bridge.log(), bridge.log()
    finally:
        for follower in followers:
            await follower.close()
        await cluster.stop()
