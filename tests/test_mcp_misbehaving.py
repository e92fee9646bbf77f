"""MCP servers that misbehave: one that ignores being asked to stop, one whose answers are not valid JSON-RPC,
one that writes junk to its stdout, one that is stuck when its caller gives up, and tool names and schemas
that cannot be used as they are. What the operator and the model see of each.

The servers are ``tests/mcp_servers/listing_server.py`` (JSON-RPC by hand, so it can break the protocol).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.tools.base import ToolContext
from core.tools.mcp import McpManager, McpServerConfig, McpTool, McpToolError
from tests.support.process import alive

LISTING_SERVER = Path(__file__).parent / "mcp_servers" / "listing_server.py"
CTX = ToolContext(session_key="s", turn_id="t", call_id="c")


def listing(name: str, tools: list[str], *, call_timeout: float = 30.0, **env: str) -> McpServerConfig:
    return McpServerConfig(name=name, command=sys.executable, args=(str(LISTING_SERVER),), call_timeout=call_timeout,
                           approval="auto", env={"LISTING_TOOLS": json.dumps(tools), **env})


def tool(manager: McpManager, name: str) -> McpTool:
    [found] = [t for t in manager.tools() if t.spec.name == name]
    return found


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``cond`` (bounded: a server starting takes a while on a loaded machine)."""
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 - a process, a log record: nothing to wait on but a look
            await asyncio.sleep(0.02)




def _logged(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> bool:
    return any(r.name == logger and r.getMessage() == text for r in caplog.records)


async def test_a_close_cut_short_with_a_call_in_flight_leaves_no_server_running(caplog) -> None:
    # the server ignores SIGTERM and is busy with a call: stopping it takes longer than the close may wait, so
    # the close cancels its task. That cancel used to cut the stop short, and the server ran on after the bridge
    caplog.set_level(logging.INFO, logger="core.tools.mcp.lst")
    manager = McpManager()
    assert await manager.start([listing("lst", ["pid", "block"], LISTING_IGNORE_TERM="1")]) == []
    pid = int(await tool(manager, "lst__pid").run({}, CTX))
    call = asyncio.create_task(tool(manager, "lst__block").run({}, CTX))
    try:
        await until(lambda: _logged(caplog, "core.tools.mcp.lst", "blocking"))
        began = time.monotonic()
        await manager.aclose(timeout=0.5)
        assert time.monotonic() - began < 5.0
        await until(lambda: not alive(pid), timeout=5.0)
        await asyncio.wait({call}, timeout=5.0)
        assert call.done()
    finally:
        call.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_a_tool_whose_schema_refers_to_nothing_is_still_called_and_the_turn_answered(
        tmp_path: Path, fake_openai, caplog) -> None:
    # the schema passes the metaschema check, but its "$ref" points nowhere (a server that left out its
    # "$defs"): checking a call's arguments against it raised, and the whole turn failed to start
    from core.tools.base import ToolRegistry
    from tests.fakes.openai_server import Text, ToolCalls
    from tests.support.harness import make_harness

    dangling = '{"type": "object", "properties": {"q": {"$ref": "#/$defs/Query"}}}'
    manager = McpManager()
    assert await manager.start([listing("lst", ["lookup"], LISTING_SCHEMA=dangling)]) == []
    registry = ToolRegistry()
    registry.extend(manager.tools())
    h = await make_harness(tmp_path, fake_openai, tools=registry)
    try:
        fake_openai.script(ToolCalls([("lst__lookup", '{"q": "x"}')], ids=["call_1"]), Text("Found it."),
                           ToolCalls([("lst__lookup", '{"q": "y"}')], ids=["call_2"]), Text("Found that too."))
        await h.say("look it up")
        await h.settle()
        await h.say("and that")
        await h.settle()
        assert h.platform.visible("c1")[-2:] == ["Found it.", "Found that too."]
        tool_outputs = [m["content"] for m in fake_openai.requests[-1]["messages"] if m.get("role") == "tool"]
        assert tool_outputs == ["lookup", "lookup"]
        warnings = [r.getMessage() for r in caplog.records if r.name == "core.tools.arguments"]
        assert warnings == ["tool lst__lookup has a parameters schema whose reference '/$defs/Query' cannot be "
                            "resolved; its calls are checked only for a JSON object"]
    finally:
        await h.core.shutdown()
        await manager.aclose()


def _config_with(tmp_path: Path, fake_openai, servers: str):  # type: ignore[no-untyped-def]
    from bridge.config import load_config
    from tests.support.ports import free_port

    path = tmp_path / "chatbridge.toml"
    path.write_text(f"""
[bridge]
data_dir = {json.dumps(str(tmp_path / "data"))}
[llm]
provider = "openai"
model = "fake"
base_url = {json.dumps(fake_openai.base_url)}
api_key = "sk-abc"
[web]
port = {free_port()}
{servers}""")
    return path, load_config(path, env={})


async def test_two_servers_whose_tools_get_the_same_full_name_keep_the_first_and_the_bridge_runs(
        tmp_path: Path, fake_openai, caplog, capsys) -> None:
    # server "a"'s tool "b__c" and server "a__b"'s tool "c" are both a__b__c: `chatbridge check` said OK, and
    # `chatbridge run` then stopped on "tool 'a__b__c' registered twice"
    from bridge.app import run_app
    from bridge.mcp import check_mcp_servers

    server = f"command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(LISTING_SERVER))}]"
    path, config = _config_with(tmp_path, fake_openai, f"""
[[agent.mcp_servers]]
name = "a"
{server}
env = {{ LISTING_TOOLS = '["b__c", "other"]' }}
[[agent.mcp_servers]]
name = "a__b"
{server}
env = {{ LISTING_TOOLS = '["c", "d"]' }}
""")
    warning = "MCP server a__b: skipping tool 'c' (a__b__c is already the name of a tool of server a)"
    lines, ok = await check_mcp_servers(config)
    assert ok
    assert [line for line in lines if "OK" in line] == ["  a (" + sys.executable + "): OK, 2 tools: a__b__c, a__other",
                                                        "  a__b (" + sys.executable + "): OK, 1 tools: a__b__d"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [warning]

    stop = asyncio.Event()
    started = asyncio.Event()
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop, on_started=started.set))
    try:
        await asyncio.wait({task, asyncio.create_task(started.wait())}, timeout=30,
                           return_when=asyncio.FIRST_COMPLETED)
        assert started.is_set(), "the bridge did not start"
    finally:
        stop.set()
        code = await asyncio.wait_for(task, 30)
    assert code == 0
    assert f"WARNING core.tools.mcp: {warning}\n" in capsys.readouterr().err  # the bridge's own log


@pytest.mark.parametrize(("name", "why"), [
    ("not_an_object", 'its "result" is a JSON string, not an object'),
    ("no_jsonrpc", 'it lacks "jsonrpc": "2.0"'),
    ("truncated", "the line ends before its JSON does"),
])
async def test_an_answer_that_is_not_valid_json_rpc_fails_its_call_at_once_with_the_reason(
        name: str, why: str, caplog) -> None:
    # the answer carries the call's id, but the SDK drops what it cannot parse: the call used to wait its whole
    # timeout, and the model was told that the tool "timed out"
    manager = McpManager()
    assert await manager.start([listing("lst", [name, "lookup"], call_timeout=60.0)]) == []
    try:
        async with asyncio.timeout(10):
            with pytest.raises(McpToolError) as info:
                await tool(manager, f"lst__{name}").run({}, CTX)
            assert str(info.value) == (f"MCP tool lst__{name} failed: MCP error: the server's answer is not valid "
                                       f"JSON-RPC: {why}")
            assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"  # the session goes on
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and warnings[0].startswith("MCP server 'lst' answered request ")
        assert warnings[0].endswith(f"with a message that is not valid JSON-RPC ({why}); the request fails with that")
    finally:
        await manager.aclose()


async def test_junk_on_a_servers_stdout_is_one_warning_then_a_count(caplog) -> None:
    # a server printing its debug output to stdout wrote one warning per line into the log
    caplog.set_level(logging.WARNING, logger="core.tools.mcp_stdio")
    manager = McpManager()
    assert await manager.start([listing("lst", ["junk"])]) == []
    try:
        assert await tool(manager, "lst__junk").run({"lines": 1000}, CTX) == "junk"
        assert [r.getMessage() for r in caplog.records if r.name == "core.tools.mcp_stdio"] == [
            "MCP server 'lst' wrote a line to its stdout that is not a JSON-RPC message (13 bytes; a server must "
            "log to stderr)"]
    finally:
        await manager.aclose()
    assert [r.getMessage() for r in caplog.records if r.name == "core.tools.mcp_stdio"][1:] == [
        "MCP server 'lst' wrote 999 more lines to its stdout that are not JSON-RPC messages (1000 in all on this "
        "connection)"]


async def test_after_a_call_on_a_stuck_server_is_given_up_on_the_next_fails_soon_and_the_server_comes_back(
        monkeypatch, caplog) -> None:
    # a user's /stop of a call that hung cancels it; the server, stuck, answered nothing more, but only a call
    # that timed out was followed by a ping: the next call waited out its whole timeout as well
    import core.tools.mcp as mcp_module
    from core.tools.mcp import RestartPolicy

    monkeypatch.setattr(mcp_module, "PING_SECONDS", 0.5)
    caplog.set_level(logging.INFO, logger="core.tools.mcp.lst")
    manager = McpManager(restart=RestartPolicy(first_delay=0.1))
    assert await manager.start([listing("lst", ["block", "lookup"], call_timeout=60.0)]) == []
    try:
        [source] = manager.sources()
        call = asyncio.create_task(tool(manager, "lst__block").run({}, CTX))
        await until(lambda: _logged(caplog, "core.tools.mcp.lst", "blocking"))
        call.cancel()  # what a /stop does to the turn's tool call
        await asyncio.wait({call}, timeout=5)
        async with asyncio.timeout(10):
            with pytest.raises(McpToolError) as info:
                await tool(manager, "lst__lookup").run({}, CTX)
        assert "the server stopped answering (a call was given up on, then a ping within 0.5s)" in str(info.value)
        await until(lambda: source.state == "connected")
        assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
    finally:
        await manager.aclose()


async def test_healthz_answers_starting_while_the_mcp_servers_start(tmp_path: Path, fake_openai) -> None:
    # the web server listened only once the MCP servers had started (up to their startup_timeout_seconds):
    # until then a monitor's probe was refused, though the README promised 503 "starting"
    import aiohttp

    from bridge.app import run_app

    go = tmp_path / "go"
    path, config = _config_with(tmp_path, fake_openai, f"""
[[agent.mcp_servers]]
name = "slow"
command = {json.dumps(sys.executable)}
args = [{json.dumps(str(LISTING_SERVER))}]
env = {{ LISTING_TOOLS = '["lookup"]', LISTING_WAIT_FOR = {json.dumps(str(go))} }}
""")
    base = f"http://127.0.0.1:{config.web.port}"
    stop = asyncio.Event()
    started = asyncio.Event()
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop, on_started=started.set))
    try:
        async with aiohttp.ClientSession() as http:
            async def get(route: str) -> tuple[int, dict[str, object]] | None:
                try:
                    async with http.get(base + route) as response:
                        return response.status, await response.json()
                except aiohttp.ClientConnectionError:
                    return None

            async with asyncio.timeout(15):  # the MCP server is held: the bridge cannot have started meanwhile
                while (health := await get("/healthz")) is None:
                    assert not task.done()
                    await asyncio.sleep(0.05)
            assert health == (503, {"status": "starting", "channels": {}, "mcp_servers": {"slow": "starting"}})
            assert await get("/api/sessions") == (503, {"error": "chatbridge is starting; try again in a moment"})
            assert not started.is_set()
            go.touch()
            await asyncio.wait_for(started.wait(), 15)
            health = await get("/healthz")
            assert health is not None and health[0] == 200
    finally:
        go.touch()
        stop.set()
        code = await asyncio.wait_for(task, 30)
    assert code == 0
