"""MCP servers come back: a real server (tests/mcp_servers/echo_server.py, the official SDK) killed, crashing
or failing to start again, over stdio and streamable HTTP, while its tools stay listed and answer that it is
restarting; the backoff between attempts (tenacity) grows and is capped; ``/healthz`` shows each server's
state without failing for it; what a server writes to its stderr is logged with secrets masked.

The pause between restart attempts is a :class:`Gate` the test holds and releases, so nothing here depends on
how long a restart takes on a busy machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from core.tools.base import ToolContext, ToolRegistry
from core.tools.mcp import McpManager, McpServerConfig, McpTool, McpToolError, RestartPolicy
from tests.support.process import alive

ECHO_SERVER = Path(__file__).parent / "mcp_servers" / "echo_server.py"
CTX = ToolContext(session_key="s", turn_id="t", call_id="c")
SERVER_LOG = "core.tools.mcp.echo"


def echo_config(name: str = "echo", **kw: object) -> McpServerConfig:
    return McpServerConfig(name=name, command=sys.executable, args=(str(ECHO_SERVER),), **kw)  # type: ignore[arg-type]


def tool(manager: McpManager, name: str) -> McpTool:
    [found] = [t for t in manager.tools() if t.spec.name == name]
    return found


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait for ``cond`` (bounded in time: a server starting takes a while on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


class Gate:
    """The restart policy's ``sleep``: records each pause the policy asks for, and lets it pass only when the
    test says so (``release``), or at once when ``auto``."""

    def __init__(self, *, auto: bool = False) -> None:
        self.delays: list[float] = []
        self.auto = auto
        self._passes: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        if self.auto:
            await asyncio.sleep(0)
            return
        await self._passes.get()

    def release(self) -> None:
        self._passes.put_nowait(None)


def policy(gate: Gate, *, stable_after: float = 3600.0) -> RestartPolicy:
    return RestartPolicy(first_delay=1.0, max_delay=8.0, stable_after=stable_after, sleep=gate.sleep)


@pytest.fixture
async def gate() -> Gate:
    return Gate()


@pytest.fixture
async def echo(gate: Gate) -> AsyncIterator[McpManager]:
    manager = McpManager(restart=policy(gate))
    assert await manager.start([echo_config(call_timeout=10.0)]) == []
    try:
        yield manager
    finally:
        gate.release()  # a pause still held must not hold up the close
        await manager.aclose()


# ---- stdio ------------------------------------------------------------------------------------------------


async def test_a_killed_server_answers_that_it_is_restarting_then_comes_back(echo, gate, caplog) -> None:
    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    [source] = echo.sources()
    assert await tool(echo, "echo__echo").run({"text": "before"}, CTX) == "before"
    pid = int(await tool(echo, "echo__pid").run({}, CTX))

    os.kill(pid, signal.SIGKILL)
    await until(lambda: gate.delays == [1.0])  # noticed at once, though nobody was calling it
    assert source.state == "restarting"
    with pytest.raises(McpToolError) as info:
        await tool(echo, "echo__echo").run({"text": "meanwhile"}, CTX)
    assert str(info.value).startswith("MCP tool echo__echo is unavailable: its server 'echo' is restarting (the "
                                      f"server exited with status {-signal.SIGKILL}; next attempt in 1s)")
    assert [t.spec.name for t in echo.tools()].count("echo__echo") == 1  # still listed meanwhile

    gate.release()
    await until(lambda: source.state == "connected")
    assert await tool(echo, "echo__echo").run({"text": "after"}, CTX) == "after"
    assert int(await tool(echo, "echo__pid").run({}, CTX)) != pid  # a new process
    messages = [r.getMessage() for r in caplog.records if r.name == "core.tools.mcp"]
    assert f"MCP server echo went away: the server exited with status {-signal.SIGKILL}; bringing it back" in messages
    assert "MCP server echo is back (restart 1): 10 tools" in messages




async def test_a_server_whose_helper_holds_its_output_open_is_still_noticed_gone_and_its_helper_ends(gate) -> None:
    # a helper the server started inherited its stdout: when the server dies the pipe stays open, so the end of
    # the stream never says so. Unnoticed, the server looked connected and every call waited its whole timeout;
    # and stopping the bridge left the helper running
    listing = Path(__file__).parent / "mcp_servers" / "listing_server.py"
    manager = McpManager(restart=policy(gate))
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(listing),), call_timeout=30.0,
                             env={"LISTING_TOOLS": '["pid", "helper", "lookup"]', "LISTING_HELPER": "1"})
    assert await manager.start([config]) == []
    helpers: list[int] = []
    try:
        try:
            [source] = manager.sources()
            pid = int(await tool(manager, "lst__pid").run({}, CTX))
            helpers.append(int(await tool(manager, "lst__helper").run({}, CTX)))
            os.kill(pid, signal.SIGKILL)
            await until(lambda: source.state == "restarting")
            with pytest.raises(McpToolError) as info:
                await tool(manager, "lst__lookup").run({}, CTX)
            assert "is restarting" in str(info.value)
            gate.release()
            await until(lambda: source.state == "connected")
            assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
            helpers.append(int(await tool(manager, "lst__helper").run({}, CTX)))
        finally:
            gate.release()
            await manager.aclose()
        # each helper ended with its server's connection: the killed one's, and the one stopped at the close
        await until(lambda: not any(alive(helper) for helper in helpers), timeout=10)
    finally:
        for helper in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


async def test_a_server_that_stopped_answering_anything_is_restarted(gate) -> None:
    # a call timed out and the server does not answer a ping either: it is stuck (not a slow tool), and would
    # otherwise stay "connected" with every later call waiting its whole timeout
    listing = Path(__file__).parent / "mcp_servers" / "listing_server.py"
    manager = McpManager(restart=policy(gate))
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(listing),), call_timeout=1.0,
                             env={"LISTING_TOOLS": '["block", "lookup"]'})
    assert await manager.start([config]) == []
    try:
        [source] = manager.sources()
        with pytest.raises(McpToolError, match="timed out"):
            await tool(manager, "lst__block").run({}, CTX)
        await until(lambda: source.state == "restarting")
        with pytest.raises(McpToolError, match="is restarting"):
            await tool(manager, "lst__lookup").run({}, CTX)
        gate.release()
        await until(lambda: source.state == "connected")
        assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
    finally:
        gate.release()
        await manager.aclose()


async def test_a_call_cut_short_by_the_crash_fails_at_once_with_the_reason(echo, gate) -> None:
    with pytest.raises(McpToolError) as info:
        await tool(echo, "echo__crash").run({}, CTX)
    assert str(info.value) == ("MCP tool echo__crash failed: the server exited with status 1 during the call; "
                               "the server is being restarted")
    gate.release()
    [source] = echo.sources()
    await until(lambda: source.state == "connected")
    assert await tool(echo, "echo__add").run({"a": 1, "b": 1}, CTX) == "2"


async def test_restart_attempts_back_off_doubling_up_to_the_cap_until_the_server_starts(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    fail_starts = tmp_path / "fail-starts"
    gate = Gate(auto=True)
    manager = McpManager(restart=policy(gate))
    assert await manager.start([echo_config(env={"ECHO_FAIL_STARTS": str(fail_starts)})]) == []
    try:
        [source] = manager.sources()
        fail_starts.write_text("4")  # the next four starts fail at once
        with pytest.raises(McpToolError):
            await tool(manager, "echo__crash").run({}, CTX)
        await until(lambda: source.state == "connected" and fail_starts.read_text() == "0")
        # the crash, then four failed starts: each pause twice the one before, never above max_delay
        assert gate.delays == [1.0, 2.0, 4.0, 8.0, 8.0]
        failed = [r.getMessage() for r in caplog.records if "restart attempt" in r.getMessage()]
        assert failed == [f"MCP server echo: restart attempt {n} failed: the server exited with status 2; next "
                          f"attempt in {delay:g}s" for n, delay in ((1, 2.0), (2, 4.0), (3, 8.0), (4, 8.0))]
        said = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG]
        assert said.count("failing this start on purpose (0 more to fail)") == 1  # its stderr, as it went
        assert await tool(manager, "echo__echo").run({"text": "back"}, CTX) == "back"
    finally:
        await manager.aclose()


async def test_after_a_healthy_session_the_first_attempt_is_at_once(tmp_path) -> None:
    gate = Gate(auto=True)
    manager = McpManager(restart=policy(gate, stable_after=0.0))
    assert await manager.start([echo_config()]) == []
    try:
        [source] = manager.sources()
        with pytest.raises(McpToolError):
            await tool(manager, "echo__crash").run({}, CTX)
        await until(lambda: source.state == "connected")
        assert gate.delays == []  # no pause before the first attempt; later ones would back off
        assert await tool(manager, "echo__echo").run({"text": "again"}, CTX) == "again"
    finally:
        await manager.aclose()


async def test_closing_ends_a_pause_between_attempts_and_no_attempt_follows(tmp_path) -> None:
    manager = McpManager(restart=RestartPolicy(first_delay=3600.0, max_delay=3600.0, stable_after=3600.0))
    assert await manager.start([echo_config()]) == []
    [source] = manager.sources()
    echo_tool = tool(manager, "echo__echo")
    with pytest.raises(McpToolError):
        await tool(manager, "echo__crash").run({}, CTX)
    await until(lambda: source.state == "restarting")
    await asyncio.wait_for(manager.aclose(timeout=5.0), 10)  # not an hour
    assert source.state == "stopped"
    with pytest.raises(McpToolError, match="not connected"):
        await echo_tool.run({"text": "x"}, CTX)


# ---- stderr ----------------------------------------------------------------------------------------------


async def _echo_with_secret(tmp_path: Path, secret: str) -> McpManager:
    """The echo server started from a config whose ``env`` holds ``secret`` (as ``API_TOKEN``)."""
    from bridge.config import load_config
    from bridge.mcp import start_mcp_servers

    path = tmp_path / "chatbridge.toml"
    path.write_text(f"""
[[agent.mcp_servers]]
name = "echo"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
env = {{ API_TOKEN = "${{ECHO_SECRET}}" }}
""")
    return await start_mcp_servers(load_config(path, env={"ECHO_SECRET": secret}))


async def test_the_servers_stderr_is_logged_with_secrets_masked(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    manager = await _echo_with_secret(tmp_path, "tok-en-31337")
    try:
        assert await tool(manager, "echo__stderr_env").run({"name": "API_TOKEN"}, CTX) == "written"
        leaked = "sk-proj-Zq8vN3xK7pL2mR9tW4yB6cD1fG5hJ0"  # a credential that is no configured secret
        assert await tool(manager, "echo__stderr").run({"text": f"retrying with {leaked} now"}, CTX) == "written"
        await until(lambda: sum(r.name == SERVER_LOG for r in caplog.records) >= 2)
    finally:
        await manager.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG]
    assert "API_TOKEN is ***" in lines and "retrying with *** now" in lines
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == SERVER_LOG)
    assert not any("tok-en-31337" in r.getMessage() or leaked in r.getMessage() for r in caplog.records)


async def test_a_long_stderr_line_is_cut_and_said_so(echo, caplog) -> None:
    from core.tools.mcp_stdio import MAX_STDERR_LINE

    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    await tool(echo, "echo__stderr").run({"text": "x" * (MAX_STDERR_LINE + 500)}, CTX)
    await until(lambda: any(r.name == SERVER_LOG for r in caplog.records))
    [line] = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG]
    assert line == "x" * MAX_STDERR_LINE + "… (500 more bytes of this line not shown)"


async def test_a_secret_the_cut_of_a_long_stderr_line_runs_through_shows_nothing_of_it(tmp_path, caplog) -> None:
    # only a whole secret is masked: a line cut inside one would log its head
    from core.tools.mcp_stdio import MAX_STDERR_LINE

    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    secret = "tok-en-31337-abcdefghij"
    manager = await _echo_with_secret(tmp_path, secret)
    try:
        text = "x" * (MAX_STDERR_LINE - 10) + " " + secret + " and more"
        assert await tool(manager, "echo__stderr").run({"text": text}, CTX) == "written"
        await until(lambda: any(r.name == SERVER_LOG for r in caplog.records))
    finally:
        await manager.aclose()
    [line] = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG]
    assert line.startswith("x" * (MAX_STDERR_LINE - 10) + "… (")
    assert "tok-en" not in line and secret[:5] not in line


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- /healthz --------------------------------------------------------------------------------------------


async def test_healthz_shows_each_servers_state_and_stays_200_while_one_restarts(echo, gate) -> None:
    from bridge.app import build_http_app

    broken = McpManager()
    app = build_http_app([], echo)
    async with TestClient(TestServer(app)) as client:
        async def health() -> tuple[int, dict[str, object]]:
            resp = await client.get("/healthz")
            return resp.status, await resp.json()

        assert await health() == (200, {"status": "ok", "channels": {}, "mcp_servers": {"echo": "connected"}})
        pid = int(await tool(echo, "echo__pid").run({}, CTX))
        os.kill(pid, signal.SIGKILL)
        await until(lambda: gate.delays == [1.0])
        assert await health() == (200, {"status": "ok", "channels": {}, "mcp_servers": {"echo": "restarting"}})
        gate.release()
        [source] = echo.sources()
        await until(lambda: source.state == "connected")
        assert await health() == (200, {"status": "ok", "channels": {}, "mcp_servers": {"echo": "connected"}})
    async with TestClient(TestServer(build_http_app([], broken))) as client:
        resp = await client.get("/healthz")
        assert await resp.json() == {"status": "ok", "channels": {}}  # no MCP servers configured: no key


# ---- streamable HTTP -------------------------------------------------------------------------------------


class HttpServer:
    """The echo server over streamable HTTP in a process of its own, restartable on the same port."""

    def __init__(self) -> None:
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        args = [sys.executable, str(ECHO_SERVER), "--http"] + (["--port", str(self.port)] if self.port else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "PORT <n>" once it listens, or "" if it died
        if not line.startswith("PORT "):
            pytest.skip(f"the mcp SDK could not serve streamable HTTP here (server said {line!r})")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"


@pytest.fixture
def http_server() -> Iterator[HttpServer]:
    server = HttpServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_dropped_http_session_is_re_established_by_the_next_call(http_server, gate, caplog) -> None:
    caplog.set_level(logging.INFO, logger="core.tools.mcp")
    manager = McpManager(restart=policy(gate))
    assert await manager.start([McpServerConfig(name="web", url=http_server.url, call_timeout=10.0)]) == []
    try:
        [source] = manager.sources()
        assert await tool(manager, "web__echo").run({"text": "one"}, CTX) == "one"
        http_server.stop()
        http_server.start()  # the same address, a new process: our session is unknown there
        # the server answers 404 for the old session; the call never ran, so it is sent again once the
        # session is re-established — at once, without a pause, since the server is evidently there
        assert await tool(manager, "web__echo").run({"text": "two"}, CTX) == "two"
        assert source.state == "connected" and gate.delays == []
        messages = [r.getMessage() for r in caplog.records if r.name == "core.tools.mcp"]
        assert ("MCP server web went away: the server no longer knew the session (did it restart?); bringing it "
                "back") in messages
        assert "MCP server web is back (restart 1): 10 tools" in messages
    finally:
        await manager.aclose()


async def test_an_http_server_that_is_down_is_retried_until_it_is_back(http_server, gate) -> None:
    manager = McpManager(restart=policy(gate))
    assert await manager.start([McpServerConfig(name="web", url=http_server.url, call_timeout=10.0,
                                                startup_timeout=5.0)]) == []
    try:
        [source] = manager.sources()
        http_server.stop()
        with pytest.raises(McpToolError, match="the connection to its server ended during the call"):
            await tool(manager, "web__echo").run({"text": "lost"}, CTX)
        await until(lambda: gate.delays == [1.0])
        with pytest.raises(McpToolError, match="its server 'web' is restarting"):
            await tool(manager, "web__echo").run({"text": "down"}, CTX)
        gate.release()  # an attempt while it is still down: refused, and the next pause is longer
        await until(lambda: gate.delays == [1.0, 2.0])
        assert source.state == "restarting" and "cannot connect to http://127.0.0.1" in (source.reason or "")
        http_server.start()
        gate.release()
        await until(lambda: source.state == "connected")
        assert await tool(manager, "web__echo").run({"text": "up"}, CTX) == "up"
    finally:
        gate.release()
        await manager.aclose()


# ---- in a conversation -----------------------------------------------------------------------------------


async def test_a_server_killed_mid_conversation_the_model_hears_why_and_later_the_tool_works(
        tmp_path, fake_openai, gate) -> None:
    from tests.fakes.openai_server import Text, ToolCalls
    from tests.support.harness import make_harness

    manager = McpManager(restart=policy(gate))
    assert await manager.start([echo_config(approval="auto")]) == []
    registry = ToolRegistry()
    registry.extend(manager.tools())
    h = await make_harness(tmp_path, fake_openai, tools=registry)
    try:
        [source] = manager.sources()
        pid = int(await tool(manager, "echo__pid").run({}, CTX))
        fake_openai.script(ToolCalls([("echo__echo", '{"text": "first"}')], ids=["call_1"]), Text("It said first."))
        await h.say("echo first")
        await h.settle()

        os.kill(pid, signal.SIGKILL)
        await until(lambda: gate.delays == [1.0])
        fake_openai.script(ToolCalls([("echo__echo", '{"text": "second"}')], ids=["call_2"]),
                           Text("The echo server is restarting; try again soon."))
        await h.say("echo second")
        await h.settle()

        gate.release()
        await until(lambda: source.state == "connected")
        fake_openai.script(ToolCalls([("echo__echo", '{"text": "third"}')], ids=["call_3"]), Text("It said third."))
        await h.say("echo third")
        await h.settle()
    finally:
        await h.core.shutdown()
        await manager.aclose()

    def tool_result(request: dict[str, object]) -> str:
        [message] = [m for m in request["messages"] if m["role"] == "tool"][-1:]  # type: ignore[union-attr,index]
        return str(message["content"])  # type: ignore[index]

    assert len(fake_openai.requests) == 6
    assert tool_result(fake_openai.requests[1]) == "first"
    assert "MCP tool echo__echo is unavailable: its server 'echo' is restarting" in tool_result(fake_openai.requests[3])
    assert tool_result(fake_openai.requests[5]) == "third"
    # the tool was offered all along
    assert all("echo__echo" in [t["function"]["name"] for t in r["tools"]] for r in fake_openai.requests)
    assert h.platform.visible("c1") == ["It said first.", "The echo server is restarting; try again soon.",
                                        "It said third."]
