"""The `run` wiring: health endpoint and clean shutdown, startup refusals, log redaction."""

from __future__ import annotations

import asyncio
import logging
import sys

import aiohttp

from bridge.app import run_app
from bridge.config import load_config
from bridge.logs import SecretRedactor
from tests.support.ports import free_port


def write_config(tmp_path, body: str):
    path = tmp_path / "chatbridge.toml"
    path.write_text(body)
    return path


async def test_run_serves_health_and_shuts_down_cleanly(tmp_path, fake_openai):
    port = free_port()
    path = write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
api_key = "sk-abc"
[web]
port = {port}
""")
    config = load_config(path)
    stop = asyncio.Event()
    started: list[bool] = []
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop,
                                       on_started=lambda: started.append(True)))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(500):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        body = await resp.json()
                        if resp.status == 200:
                            break
                        # the server listens before the channels start: until then it says so, never "ok"
                        assert (resp.status, body["status"]) == (503, "starting")
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("server did not come up")
        assert body == {"status": "ok", "channels": {"web": "serving"}}
        for _ in range(100):  # on_started follows the last channel's start
            if started:
                break
            await asyncio.sleep(0.02)
        assert started == [True]
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
    assert (tmp_path / "data" / "chatbridge.db").exists()


async def test_run_without_the_local_extra_explains_how_to_install_it_or_use_an_api(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # how Python marks a module as not importable
    config = load_config(write_config(tmp_path, f'[bridge]\ndata_dir = "{tmp_path}"\n[llm]\nprovider = "local"\n'))
    assert await run_app(config, config_path=None) == 3
    err = capsys.readouterr().err
    assert "provider = 'local'" in err and 'pip install -e ".[local]"' in err and "base_url" in err


async def test_run_refuses_enabled_channels_without_an_adapter(tmp_path, capsys, fake_openai, monkeypatch):
    from bridge.channels import FACTORIES

    monkeypatch.delitem(FACTORIES, "slack")  # a build without the Slack adapter
    config = load_config(write_config(tmp_path, f"""
[llm]
provider = "openai"
model = "m"
base_url = "{fake_openai.base_url}"
[channels.slack]
enabled = true
bot_token = "xoxb-abc"
app_token = "xapp-abc"
"""))
    assert await run_app(config, config_path=None) == 3
    err = capsys.readouterr().err
    assert "slack" in err and "xoxb-abc" not in err


async def test_healthz_answers_503_starting_until_every_channel_has_started():
    from aiohttp.test_utils import TestClient, TestServer

    from bridge.app import build_http_app

    started = asyncio.Event()
    async with TestClient(TestServer(build_http_app([], started=started))) as client:
        resp = await client.get("/healthz")
        assert (resp.status, resp.headers.get("Retry-After")) == (503, "1")
        assert await resp.json() == {"status": "starting", "channels": {}}
        started.set()
        resp = await client.get("/healthz")
        assert (resp.status, await resp.json()) == (200, {"status": "ok", "channels": {}})


def test_redactor_removes_secrets_from_messages_and_tracebacks():
    redactor = SecretRedactor(["sk-live-123", "hunter2"])
    try:
        raise RuntimeError("auth failed for key sk-live-123")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "using %s and %s", ("sk-live-123", "hunter2"),
                                   exc_info=__import__("sys").exc_info())
    redactor.filter(record)
    text = record.getMessage()
    assert "sk-live-123" not in text and "hunter2" not in text
    assert "***" in text and "auth failed" in text


async def test_run_offers_mcp_tools_from_the_config_and_survives_a_broken_server(tmp_path, fake_openai, capsys):
    from pathlib import Path

    from tests.fakes.openai_server import Text, ToolCalls

    echo_server = Path(__file__).parent / "mcp_servers" / "echo_server.py"
    port = free_port()
    path = write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[agent]
titles = false
[web]
port = {port}
[[agent.mcp_servers]]
name = "echo"
command = "{sys.executable}"
args = ["{echo_server}"]
approval = "auto"
[[agent.mcp_servers]]
name = "broken"
command = "{tmp_path / 'no-such-server'}"
startup_timeout_seconds = 5
""")
    fake_openai.script(ToolCalls([("echo__echo", '{"text": "hello from MCP"}')]), Text("The server said hello."))
    config = load_config(path)
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(500):
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        if resp.status == 200:
                            health = await resp.json()
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)  # refused, or 503 "starting" (it listens while the MCP servers start)
            # a server that failed to start is shown, and does not make the bridge unhealthy
            assert health == {"status": "ok", "channels": {"web": "serving"},
                              "mcp_servers": {"echo": "connected", "broken": "failed"}}
            async with http.post(f"{base}/api/sessions") as resp:
                sid = (await resp.json())["id"]
            async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "please echo"}) as resp:
                assert resp.status == 202
            for _ in range(500):
                async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
                    messages = (await resp.json())["messages"]
                if messages and messages[-1]["content"] == "The server said hello.":
                    break
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 20) == 0
    offered = [t["function"]["name"] for t in fake_openai.requests[0]["tools"]]
    assert "echo__echo" in offered and not any(name.startswith("broken__") for name in offered)
    tool_results = [m for m in fake_openai.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_results and "hello from MCP" in tool_results[0]["content"]
    assert [m["role"] for m in messages][-3:] == ["assistant", "tool", "assistant"]
    log_text = capsys.readouterr().err
    assert "MCP server broken" in log_text and "failed to start" in log_text
