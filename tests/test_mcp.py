"""MCP client: real MCP servers (tests/mcp_servers/echo_server.py, written with the SDK) over stdio and
streamable HTTP, started from config, their tools listed, called, failing and timing out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from core.supervisor import TaskSupervisor
from core.tools.base import ToolContext, ToolRegistry
from core.tools.mcp import McpManager, McpServerConfig, McpToolError, McpToolSource, result_text
from tests.support.ports import free_port

ECHO_SERVER = Path(__file__).parent / "mcp_servers" / "echo_server.py"
LISTING_SERVER = Path(__file__).parent / "mcp_servers" / "listing_server.py"
CTX = ToolContext(session_key="s", turn_id="t", call_id="c")


def echo_config(name: str = "echo", **kw: object) -> McpServerConfig:
    return McpServerConfig(name=name, command=sys.executable, args=(str(ECHO_SERVER),), **kw)  # type: ignore[arg-type]


@pytest.fixture
async def echo() -> AsyncIterator[McpManager]:
    manager = McpManager()
    failures = await manager.start([echo_config(call_timeout=1.0)])
    assert failures == []
    try:
        yield manager
    finally:
        await manager.aclose()


def tool(manager: McpManager, name: str):  # type: ignore[no-untyped-def]
    found = [t for t in manager.tools() if t.spec.name == name]
    assert found, f"no tool {name} in {[t.spec.name for t in manager.tools()]}"
    return found[0]


# ---- stdio -----------------------------------------------------------------------------------------------


async def test_stdio_lists_prefixed_tools_with_schemas(echo: McpManager) -> None:
    names = sorted(t.spec.name for t in echo.tools())
    assert names == ["echo__add", "echo__big", "echo__crash", "echo__echo", "echo__env", "echo__fail",
                     "echo__pid", "echo__sleep", "echo__stderr", "echo__stderr_env"]
    add = tool(echo, "echo__add")
    assert add.spec.description == "Add two integers."
    assert add.spec.parameters["type"] == "object"
    assert set(add.spec.parameters["properties"]) == {"a", "b"}
    assert sorted(add.spec.parameters["required"]) == ["a", "b"]
    assert add.approval == "ask"
    [status] = echo.statuses
    assert status.ok and status.name == "echo" and "echo__add" in status.tools


async def test_a_servers_error_that_speaks_of_a_timeout_reaches_the_model_as_the_servers_error() -> None:
    # the server answers at once with its own error, which mentions a timeout of its upstream: the model must
    # read that, not "timed out after 60s (call_timeout_seconds)", which would make it wait and retry in vain
    manager = McpManager()
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(LISTING_SERVER),),
                             env={"LISTING_TOOLS": '["fetch"]',
                                  "LISTING_ERRORS": '{"fetch": "upstream API call timed out after 3s"}'})
    assert await manager.start([config]) == []
    try:
        with pytest.raises(McpToolError) as failure:
            await tool(manager, "lst__fetch").run({}, CTX)
        assert "upstream API call timed out after 3s" in str(failure.value)
        assert "call_timeout_seconds" not in str(failure.value)
    finally:
        await manager.aclose()


async def test_tools_no_model_could_be_offered_are_left_out_and_the_rest_work() -> None:
    # a server may list one name twice, or a name that is valid MCP but longer, with its server's prefix, than
    # the 64 characters the model APIs take: offered, the first stopped the bridge from starting (the registry
    # refuses a name twice) and the second would fail every request to the model
    long_name = "x" * 60
    names = ["lookup", "lookup", long_name, "y" * (64 - len("lst__"))]
    manager = McpManager()
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(LISTING_SERVER),),
                             env={"LISTING_TOOLS": json.dumps(names)})
    assert await manager.start([config]) == []
    try:
        offered = sorted(t.spec.name for t in manager.tools())
        assert offered == ["lst__lookup", "lst__" + "y" * 59]
        registry = ToolRegistry()
        registry.extend(manager.tools())
        assert all(len(spec.name) <= 64 for spec in registry.specs())
        assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
    finally:
        await manager.aclose()


async def test_call_returns_the_tool_text(echo: McpManager) -> None:
    assert await tool(echo, "echo__echo").run({"text": "hello, MCP"}, CTX) == "hello, MCP"
    assert await tool(echo, "echo__add").run({"a": 2, "b": 40}, CTX) == "42"


async def test_concurrent_calls_are_served_side_by_side(echo: McpManager) -> None:
    texts = await asyncio.gather(*(tool(echo, "echo__echo").run({"text": f"n{i}"}, CTX) for i in range(5)))
    assert texts == [f"n{i}" for i in range(5)]


async def test_error_result_raises(echo: McpManager) -> None:
    with pytest.raises(McpToolError, match="this tool always fails"):
        await tool(echo, "echo__fail").run({}, CTX)
    # The server is still usable afterwards.
    assert await tool(echo, "echo__echo").run({"text": "still here"}, CTX) == "still here"


async def test_call_timeout_raises_and_the_server_keeps_working(echo: McpManager) -> None:
    with pytest.raises(McpToolError, match=r"echo__sleep timed out after 1s \(call_timeout_seconds\)"):
        await tool(echo, "echo__sleep").run({"seconds": 30}, CTX)
    assert await tool(echo, "echo__echo").run({"text": "after"}, CTX) == "after"


async def test_env_reaches_the_server_process() -> None:
    manager = McpManager()
    assert await manager.start([echo_config(env={"ECHO_TOKEN": "tok-123"})]) == []
    try:
        assert await tool(manager, "echo__env").run({"name": "ECHO_TOKEN"}, CTX) == "tok-123"
    finally:
        await manager.aclose()


async def test_missing_command_is_reported_and_the_others_work(tmp_path: Path) -> None:
    manager = McpManager()
    broken = McpServerConfig(name="broken", command=str(tmp_path / "no-such-server"),
                             env={"API_TOKEN": "secret-in-env-42"})
    exits = McpServerConfig(name="exits", command=sys.executable, args=("-c", "raise SystemExit(3)"))
    failures = await manager.start([broken, echo_config(), exits])
    try:
        assert len(failures) == 2
        assert failures[0].startswith("broken: command not found: ")
        assert "no-such-server" in failures[0]
        assert failures[1] == "exits: the server exited with status 3"
        assert not any("secret-in-env-42" in f for f in failures)
        assert {t.spec.name.split("__")[0] for t in manager.tools()} == {"echo"}
        assert [s.ok for s in manager.statuses] == [False, True, False]
        assert manager.states() == {"broken": "failed", "echo": "connected", "exits": "failed"}
        assert await tool(manager, "echo__echo").run({"text": "ok"}, CTX) == "ok"
    finally:
        await manager.aclose()


async def test_startup_timeout_is_reported() -> None:
    # A process that never speaks MCP: it reads stdin and says nothing.
    silent = McpServerConfig(name="silent", command=sys.executable,
                             args=("-c", "import sys; sys.stdin.read()"),
                             startup_timeout=0.5)
    manager = McpManager()
    failures = await manager.start([silent])
    await manager.aclose()
    assert failures == ["silent: no answer within 0.5s (startup_timeout_seconds)"]
    assert manager.tools() == []


async def test_closed_source_refuses_calls() -> None:
    supervisor = TaskSupervisor("mcp")
    source = McpToolSource(echo_config(), spawn=supervisor.spawn)
    tools = await source.start()
    echo_tool = next(t for t in tools if t.remote_name == "echo")
    await source.aclose()
    assert not source.connected
    with pytest.raises(McpToolError, match="not connected"):
        await echo_tool.run({"text": "x"}, CTX)


async def test_policy_and_registry() -> None:
    manager = McpManager()
    assert await manager.start([echo_config(approval="auto")]) == []
    try:
        registry = ToolRegistry(default_policy="ask", overrides={"echo__fail": "deny"})
        registry.extend(manager.tools())
        assert registry.policy("echo__echo") == "auto"
        assert "echo__fail" not in [s.name for s in registry.specs()]
    finally:
        await manager.aclose()


def test_config_checks_and_secret_scrubbing() -> None:
    with pytest.raises(ValueError, match="exactly one of command and url"):
        McpServerConfig(name="x")
    with pytest.raises(ValueError, match="exactly one of command and url"):
        McpServerConfig(name="x", command="a", url="http://h/mcp")
    with pytest.raises(ValueError, match="letters, digits"):
        McpServerConfig(name="bad name", command="a")
    cfg = McpServerConfig(name="h", url="https://user:pw-777@example.test:8443/mcp?key=qs-secret")
    assert cfg.target() == "https://example.test:8443/mcp"
    assert cfg.scrub("x key=qs-secret pw-777") == "x *** ***"


def test_result_text_describes_non_text_blocks() -> None:
    from mcp.types import CallToolResult, EmbeddedResource, ImageContent, TextContent, TextResourceContents

    result = CallToolResult(content=[
        TextContent(text="first"),
        ImageContent(data="aGVsbG8h", mime_type="image/png"),
        EmbeddedResource(resource=TextResourceContents(uri="file:///a.txt", text="inside")),
        TextContent(text="last"),
    ])
    assert result_text(result) == "first\n[image image/png, about 6 bytes, not shown]\ninside\nlast"
    assert result_text(CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'


# ---- large results ---------------------------------------------------------------------------------------


async def test_a_huge_stdio_result_is_read_only_up_to_the_bound_and_keeps_its_head(echo: McpManager) -> None:
    from core.tools.mcp_stdio import MAX_MESSAGE_BYTES

    big = tool(echo, "echo__big")
    big_source = big._source  # type: ignore[attr-defined]
    big_source.config = dataclasses.replace(big_source.config, call_timeout=60.0)
    text = await big.run({"size": 10_000_000}, CTX)
    note, _, head = text.partition("\n")
    assert note.startswith("[The tool's result was ") and note.endswith(
        f"bytes; only its first {MAX_MESSAGE_BYTES:,} bytes were read. It begins:]")
    assert int(note.split()[4].replace(",", "")) > 10_000_000  # the size the server sent
    assert head.startswith("0123456789" * 100)
    assert len(head) < MAX_MESSAGE_BYTES  # the rest was never kept
    # the server and the session are fine afterwards
    assert await tool(echo, "echo__echo").run({"text": "after"}, CTX) == "after"


async def test_a_stray_line_on_a_servers_stdout_is_logged_with_the_servers_name(
        caplog: pytest.LogCaptureFixture) -> None:
    manager = McpManager()
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(LISTING_SERVER),),
                             env={"LISTING_TOOLS": '["chatty", "lookup"]'}, call_timeout=30.0)
    assert await manager.start([config]) == []
    try:
        with caplog.at_level("WARNING", logger="core.tools.mcp_stdio"):
            assert await tool(manager, "lst__chatty").run({}, CTX) == "chatty"
        warnings = [r.getMessage() for r in caplog.records if "JSON-RPC" in r.getMessage()]
        assert warnings == ["MCP server 'lst' wrote a line to its stdout that is not a JSON-RPC message (24 bytes; "
                            "a server must log to stderr)"]
        assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
    finally:
        await manager.aclose()


async def test_a_huge_result_whose_id_comes_last_keeps_its_head_too() -> None:
    # servers written with the TypeScript SDK (the filesystem server of the README's example) write the
    # answer's id after the result: an oversized one must still be matched to its call, not left to time out
    manager = McpManager()
    config = McpServerConfig(name="lst", command=sys.executable, args=(str(LISTING_SERVER),),
                             env={"LISTING_TOOLS": '["big", "lookup"]'}, call_timeout=30.0)
    assert await manager.start([config]) == []
    try:
        text = await tool(manager, "lst__big").run({"size": 6_000_000}, CTX)
        note, _, head = text.partition("\n")
        assert note.startswith("[The tool's result was ")
        assert head.startswith("0123456789" * 100)
        assert await tool(manager, "lst__lookup").run({}, CTX) == "lookup"
    finally:
        await manager.aclose()


def test_salvage_takes_no_boolean_for_an_id_and_reads_an_id_written_last() -> None:
    from core.tools.mcp_stdio import salvage

    head = b'{"jsonrpc": "2.0", "id": true, "result": {"content": [{"type": "text", "text": "abc'
    assert salvage(head, 10_000_000) is None  # dropped (logged), not a validation error out of the reader
    head = b'{"result": {"content": [{"type": "text", "text": "abc'
    rebuilt = salvage(head, 10_000_000, b'xyz"}], "isError": false}, "jsonrpc": "2.0", "id": "req-7"}')
    assert rebuilt.message.id == "req-7"


def test_salvage_rebuilds_a_cut_message_from_its_head() -> None:
    import json

    from mcp.types import JSONRPCError, JSONRPCResponse

    from core.tools.mcp_stdio import CUT_META, salvage

    full = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {
        "content": [{"text": "héllo " * 1000, "type": "text"}], "structuredContent": {"result": "x"}}},
        ensure_ascii=False).encode()
    message = salvage(full[:2001], len(full)).message  # cut inside a two-byte character
    assert isinstance(message, JSONRPCResponse) and message.id == 7
    note, text = (block["text"] for block in message.result["content"])
    assert note == f"[The tool's result was {len(full):,} bytes; only its first 2,001 bytes were read. It begins:]"
    assert ("héllo " * 1000).startswith(text) and len(text) > 1500
    assert message.result["isError"] is True and message.result["_meta"] == {CUT_META: len(full)}

    listing = json.dumps({"jsonrpc": "2.0", "id": "a", "result": {"tools": [{"name": "x" * 5000}]}}).encode()
    error = salvage(listing[:100], len(listing)).message
    assert isinstance(error, JSONRPCError) and error.id == "a" and "more than the 100" in error.error.message
    assert salvage(b'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "xx', 10**7) is None


# ---- streamable HTTP -------------------------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(ECHO_SERVER), "--http"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "PORT <n>" once it listens, or "" if it died
        if not line.startswith("PORT "):
            pytest.skip(f"the mcp SDK could not serve streamable HTTP here (server said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_streamable_http_lists_and_calls(http_server: str) -> None:
    manager = McpManager()
    failures = await manager.start([McpServerConfig(name="web", url=http_server, approval="deny")])
    try:
        assert failures == []
        assert "web__echo" in [t.spec.name for t in manager.tools()]
        assert tool(manager, "web__echo").approval == "deny"
        assert await tool(manager, "web__add").run({"a": 1, "b": 2}, CTX) == "3"
        with pytest.raises(McpToolError, match="always fails"):
            await tool(manager, "web__fail").run({}, CTX)
    finally:
        await manager.aclose()


async def test_streamable_http_results_are_bounded(http_server: str) -> None:
    from core.tools.mcp_stdio import MAX_MESSAGE_BYTES

    manager = McpManager()
    assert await manager.start([McpServerConfig(name="web", url=http_server)]) == []
    try:
        big = tool(manager, "web__big")
        # twice over a megabyte on the wire (text and structured content), within the bound: read whole
        assert len(await big.run({"size": 1_000_000}, CTX)) == 1_000_000
        with pytest.raises(McpToolError, match=f"exceeded the {MAX_MESSAGE_BYTES} byte limit"):
            await big.run({"size": 3_000_000}, CTX)  # past it: not read further, the call fails at once
        assert await tool(manager, "web__echo").run({"text": "after"}, CTX) == "after"
    finally:
        await manager.aclose()


async def test_http_refused_connection_is_reported() -> None:
    port = free_port()  # a port that was free a moment ago: nothing listens there
    manager = McpManager()
    failures = await manager.start([McpServerConfig(name="gone", url=f"http://127.0.0.1:{port}/mcp?token=qs-9",
                                                    startup_timeout=5)])
    await manager.aclose()
    assert len(failures) == 1
    assert failures[0].startswith("gone: ")
    assert "qs-9" not in failures[0]


async def test_a_cancelled_caller_cancels_its_request(echo: McpManager) -> None:
    call = asyncio.create_task(tool(echo, "echo__sleep").run({"seconds": 30}, CTX))
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await tool(echo, "echo__echo").run({"text": "next"}, CTX) == "next"


# ---- chatbridge check ------------------------------------------------------------------------------------


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_check_lists_tools_and_fails_for_a_broken_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.cli import main

    monkeypatch.setenv("ECHO_SECRET", "env-secret-31337")
    path = tmp_path / "c.toml"
    path.write_text(f"""
[[agent.mcp_servers]]
name = "echo"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
env = {{ TOKEN = "${{ECHO_SECRET}}", OTHER = "literal-secret-4242" }}

[[agent.mcp_servers]]
name = "broken"
command = {_toml_str(str(tmp_path / "bin" / "no-such-mcp-server"))}
env = {{ TOKEN = "${{ECHO_SECRET}}" }}
""")
    assert main(["check", "-c", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "config OK" in out
    assert "  echo (" in out
    assert ("OK, 10 tools: echo__echo, echo__add, echo__fail, echo__crash, echo__pid, echo__stderr, echo__stderr_env, "
            "echo__sleep, echo__big, echo__env") in out
    assert "  broken (" in out and "FAILED: command not found:" in out
    assert "1 of 2 MCP servers failed to start" in out
    for secret in ("env-secret-31337", "literal-secret-4242"):
        assert secret not in out and secret not in err


def test_check_ok_when_every_server_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.cli import main

    path = tmp_path / "c.toml"
    path.write_text(f"""
[[agent.mcp_servers]]
name = "one"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
""")
    assert main(["check", "-c", str(path)]) == 0
    out = capsys.readouterr().out
    assert "one__echo" in out and "all 1 MCP servers started" in out


def test_check_shows_what_a_failing_server_wrote_to_its_stderr(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.cli import main

    fail_starts = tmp_path / "fail-starts"
    fail_starts.write_text("1")
    path = tmp_path / "c.toml"
    path.write_text(f"""
[[agent.mcp_servers]]
name = "flaky"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
env = {{ ECHO_FAIL_STARTS = {_toml_str(str(fail_starts))} }}
""")
    assert main(["check", "-c", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "  flaky (" in out and "FAILED: the server exited with status 2" in out
    assert "INFO core.tools.mcp.flaky: failing this start on purpose (0 more to fail)" in err


# ---- end to end: config → core → model ---------------------------------------------------------------


async def test_mcp_tool_from_config_is_approved_through_the_core_and_its_output_reaches_the_model(
        tmp_path: Path) -> None:
    from bridge.config import load_config
    from bridge.mcp import start_mcp_servers
    from core.channel import TurnFeed
    from core.llm.openai_provider import OpenAIProvider
    from core.runtime import ChatCore
    from core.snapshot import TurnSnapshot
    from core.sqlite_store import SqliteStore
    from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
    from tests.support.channel import TestChannel, TestSink
    from tests.support.harness import API_KEY, FAST

    path = tmp_path / "chatbridge.toml"
    path.write_text(f"""
[[agent.mcp_servers]]
name = "echo"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
""")
    config = load_config(path, env={})
    assert config.agent.mcp_servers[0].approval == "ask"
    manager = await start_mcp_servers(config)
    snapshots: list[TurnSnapshot] = []

    class RecordingSink(TestSink):
        async def follow(self, turn: TurnFeed) -> None:
            class Recorded:  # every snapshot the sink pulls is recorded
                @property
                def snapshot(self) -> TurnSnapshot:
                    snapshots.append(turn.snapshot)
                    return snapshots[-1]

                def changed(self, *, urgent_only: bool = False) -> asyncio.Future[None]:
                    return turn.changed(urgent_only=urgent_only)

            await super().follow(Recorded())

    class RecordingChannel(TestChannel):
        async def open_sink(self, target):  # type: ignore[no-untyped-def]
            sink = RecordingSink(self, target)
            self.sinks.append(sink)
            return sink

    async with FakeOpenAI() as fake:
        fake.script(ToolCalls([("echo__echo", '{"text": "hello from MCP"}')], ids=["call_mcp_1"]),
                    Text("The server said hello."))
        registry = ToolRegistry(default_policy=config.agent.approval)
        registry.extend(manager.tools())
        core = ChatCore(store=SqliteStore(tmp_path / "chat.db"), settings=FAST, tools=registry,
                        provider=OpenAIProvider(model="fake-model", base_url=fake.base_url, api_key=API_KEY,
                                                request_timeout=FAST.request_timeout))
        channel = RecordingChannel()
        core.add_channel(channel)
        await core.start()
        try:
            await core.submit(channel.envelope("please echo"))
            for _ in range(500):  # bounded: until the approval is asked for
                asking = [s for s in snapshots if s.approvals]
                if asking:
                    break
                await asyncio.sleep(0.01)
            assert asking, "no approval was asked for"
            [request] = asking[-1].approvals
            assert (request.call_id, request.tool_name) == ("call_mcp_1", "echo__echo")
            assert core.decide(asking[-1].session_key, "call_mcp_1", "allow", "u1")
            for _ in range(500):
                if len(fake.requests) >= 2 and channel.platform.visible("c1")[-1:] == ["The server said hello."]:
                    break
                await asyncio.sleep(0.01)
        finally:
            await core.shutdown()
            await manager.aclose()
    assert len(fake.requests) == 2
    offered = [t["function"]["name"] for t in fake.requests[0]["tools"]]
    assert "echo__echo" in offered
    tool_messages = [m for m in fake.requests[1]["messages"] if m.get("role") == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [("call_mcp_1", "hello from MCP")]
