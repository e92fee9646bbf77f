"""The whole bridge as ``chatbridge run`` starts it (``run_app`` from a config file), in this event loop, with
the web chat and Telegram in webhook mode against the fakes — for tests of what the HTTP server as a whole
does (every route, every secret), which a test wiring the pieces by hand could miss."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bridge.app import run_app
from bridge.config import AppConfig, load_config
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram import FakeTelegram
from tests.support.ports import free_port

TG_TOKEN = "424242:AAF-tgSECRET_0123456789abcdefghijkl"
WEB_TOKEN = "web-AUTHSECRET-0123456789abcdef"
WEBHOOK_SECRET = "hookSECRET_0123456789abcdef"
LLM_KEY = "sk-live-LLMSECRET0123456789abcdef"
MCP_SECRET = "mcp-ENVSECRET-3133731337"
SECRETS = {"llm api_key": LLM_KEY, "telegram token": TG_TOKEN, "web auth_token": WEB_TOKEN,
           "telegram webhook_secret": WEBHOOK_SECRET, "mcp env": MCP_SECRET}
ENV = {"LLM_KEY": LLM_KEY, "TG_TOKEN": TG_TOKEN, "WEB_TOKEN": WEB_TOKEN, "HOOK_SECRET": WEBHOOK_SECRET,
       "MCP_SECRET": MCP_SECRET}
ECHO_SERVER = Path(__file__).resolve().parent.parent / "mcp_servers" / "echo_server.py"
AUTH = {"Authorization": f"Bearer {WEB_TOKEN}"}


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_text(tmp_path: Path, fake: FakeOpenAI, tg: FakeTelegram, port: int, *, allow_from: str = '["*"]',
                mcp: bool = False, extra: str = "", web: str = "") -> str:
    import sys

    server = f"""
[[agent.mcp_servers]]
name = "echo"
command = {_toml_str(sys.executable)}
args = [{_toml_str(str(ECHO_SERVER))}]
env = {{ API_TOKEN = "${{MCP_SECRET}}" }}
approval = "auto"
""" if mcp else ""
    return f"""
[bridge]
data_dir = {_toml_str(str(tmp_path / 'data'))}
log_level = "debug"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake.base_url}"
api_key = "${{LLM_KEY}}"
request_timeout = 2
retry_delays = [0.01]
[web]
port = {port}
auth_token = "${{WEB_TOKEN}}"
{web}
[channels.telegram]
enabled = true
token = "${{TG_TOKEN}}"
api_base = "{tg.base_url}"
mode = "webhook"
webhook_url = "https://bot.example.com/telegram/webhook"
webhook_secret = "${{HOOK_SECRET}}"
allow_from = {allow_from}
edit_interval_ms = 100
{extra}
{server}
"""


@dataclass
class RunningBridge:
    base: str
    config: AppConfig
    path: Path
    stop: asyncio.Event
    task: asyncio.Task[int]
    http: aiohttp.ClientSession
    tg: FakeTelegram
    fake: FakeOpenAI
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def webhook(self) -> str:
        return f"{self.base}/telegram/webhook"

    async def close(self) -> int:
        self.stop.set()
        try:
            return await asyncio.wait_for(self.task, 20)
        finally:
            await self.http.close()


async def start_bridge(tmp_path: Path, fake: FakeOpenAI, tg: FakeTelegram, **kw: Any) -> RunningBridge:
    port = free_port()
    path = tmp_path / "chatbridge.toml"
    path.write_text(config_text(tmp_path, fake, tg, port, **kw))
    config = load_config(path, env=ENV)
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop))
    http = aiohttp.ClientSession()
    base = f"http://127.0.0.1:{port}"
    bridge = RunningBridge(base, config, path, stop, task, http, tg, fake)
    for _ in range(500):
        if task.done():
            raise AssertionError(f"the bridge exited with {task.result()}")
        try:
            async with http.get(f"{base}/healthz") as resp:
                if resp.status == 200 and (await resp.json())["channels"].get("telegram") == "webhook":
                    return bridge
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.02)
    await bridge.close()
    raise AssertionError("the bridge did not come up")


async def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
