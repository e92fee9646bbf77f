"""No secret leaves the bridge: with every kind of secret configured (the LLM API key, the Telegram bot token and
webhook secret, the web auth_token, an MCP server's environment), the bridge is run through failures that
carry secrets towards the user or the log — the provider rejecting the key and quoting it back, an MCP server
writing its secret to stderr, Telegram and web turns that end in errors — and then every log line, every
message the chats show, the web history and its event stream, and ``chatbridge check`` are searched for each
secret."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from bridge.cli import main as cli_main
from bridge.config import load_config
from bridge.logs import configure_logging
from channels.telegram.channel import SECRET_HEADER
from core.tools.mcp import McpManager, McpServerConfig
from tests.browser.server import open_stream
from tests.fakes.openai_server import HttpError, Text, ToolCalls
from tests.fakes.telegram import FakeTelegram
from tests.support.bridge_process import AUTH, ENV, SECRETS, TG_TOKEN, WEBHOOK_SECRET, start_bridge, until
from tests.support.ports import free_port

CHAT = 555


def leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


async def test_no_secret_reaches_a_log_line_a_chat_or_check(tmp_path, fake_openai, capfd, monkeypatch):
    fake_openai.script(
        HttpError.auth(),  # Telegram's first message: "Incorrect API key provided: <the key>"
        ToolCalls([("echo__stderr_env", '{"name": "API_TOKEN"}')], ids=["call_env"]),  # the MCP server prints it
        Text("the tool ran"),
        HttpError.auth(),  # the web chat's message
    )
    async with FakeTelegram(token=TG_TOKEN) as tg:
        bridge = await start_bridge(tmp_path, fake_openai, tg, mcp=True, extra="[agent]\ntitles = false\n")
        http, base = bridge.http, bridge.base
        try:
            first = tg.user_message("hello", enqueue=False)
            async with http.post(bridge.webhook, json=first, headers={SECRET_HEADER: WEBHOOK_SECRET}) as resp:
                assert resp.status == 200
            await until(lambda: tg.visible(CHAT))
            second = tg.user_message("run the tool", enqueue=False)
            async with http.post(bridge.webhook, json=second, headers={SECRET_HEADER: WEBHOOK_SECRET}) as resp:
                assert resp.status == 200
            await until(lambda: tg.visible(CHAT)[-1] == "the tool ran", timeout=20)
            # a wrong webhook secret and a wrong token, answered without echoing what was expected
            async with http.post(bridge.webhook, json=first, headers={SECRET_HEADER: "nope"}) as resp:
                assert resp.status == 401 and not leaks(await resp.text())
            async with http.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"}) as resp:
                assert resp.status == 401 and not leaks(await resp.text())

            async with http.post(f"{base}/api/sessions", headers=AUTH, json={}) as resp:
                sid = (await resp.json())["id"]
            sse = await open_stream(http, base, sid, headers=AUTH)
            async with http.post(f"{base}/api/sessions/{sid}/messages", headers=AUTH,
                                 json={"text": "hello from the web"}) as resp:
                assert resp.status == 202
            await sse.until(lambda e: e.name == "turn_committed")
            sse.resp.close()
            async with http.get(f"{base}/api/sessions/{sid}/history", headers=AUTH) as resp:
                history = await resp.text()
            async with http.get(f"{base}/healthz") as resp:
                health = await resp.text()
            async with http.get(f"{base}/metrics", headers=AUTH) as resp:
                metrics = await resp.text()
        finally:
            assert await bridge.close() == 0
        shown = json.dumps([(m.text, m.entities, m.reply_markup) for m in tg.messages(CHAT)], ensure_ascii=False)

    # the failures did show in the chats (so the search below searched something)
    assert "credentials" in shown and "credentials" in history
    assert len(fake_openai.requests) == 4
    sse_text = b"".join(e.raw for e in sse.events).decode()
    for name, text in (("telegram chat", shown), ("web history", history), ("web event stream", sse_text),
                       ("/healthz", health), ("/metrics", metrics)):
        assert not leaks(text), (name, leaks(text))

    logged = capfd.readouterr()
    log = logged.err + logged.out
    assert "Incorrect API key provided: ***" in log  # the provider's answer is logged, with the key masked
    assert "API_TOKEN is ***" in log  # and the MCP server's stderr
    assert not leaks(log), leaks(log)

    # `chatbridge check` on the same config, with the secrets in the environment as an operator sets them
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(cli_main, ["check", "-c", str(bridge.path)]) == 0  # it runs its own loop
    checked = capfd.readouterr()
    assert "config OK" in checked.out and "echo__echo" in checked.out
    assert not leaks(checked.out + checked.err), leaks(checked.out + checked.err)


async def test_the_credentials_in_an_http_mcp_servers_url_reach_neither_check_nor_the_log(tmp_path, capfd):
    """An HTTP MCP server takes a key only in its URL (user info, or the query): ``check`` shows the URL without
    them, and the log masks them (the MCP SDK's debug line names the endpoint it connects to)."""
    password, key = "hunter2-mcp-pass", "mcp-query-key-42"
    url = f"http://bob:{password}@127.0.0.1:{free_port()}/mcp?key={key}"
    path = tmp_path / "chatbridge.toml"
    path.write_text(f'[bridge]\nlog_level = "debug"\n[llm]\nprovider = "openai"\nmodel = "m"\n'
                    f'base_url = "http://127.0.0.1:9/v1"\n[[agent.mcp_servers]]\nname = "h"\nurl = "{url}"\n'
                    f'startup_timeout_seconds = 2\n')
    await asyncio.to_thread(cli_main, ["check", "-c", str(path)])  # the server is unreachable: check says so
    checked = capfd.readouterr()
    out = checked.out + checked.err
    assert "127.0.0.1" in out and "/mcp" in out
    assert password not in out and key not in out

    config = load_config(path, env={})
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("debug", config.secret_values(), stream=stream)
    try:
        manager = McpManager()
        await manager.start([McpServerConfig(name="h", url=url, startup_timeout=2.0)])
        await manager.aclose()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    log = stream.getvalue()
    assert "127.0.0.1" in log  # the endpoint was logged
    assert password not in log and key not in log
