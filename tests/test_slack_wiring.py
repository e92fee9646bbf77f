"""``chatbridge run`` with ``[channels.slack] enabled = true``: the channel is built from its settings, answers
through the fake Slack in Socket Mode and in HTTP mode (``/slack/events`` on the [web] server), and
``/healthz`` reports its state — ``"error"`` (503) while Slack rejects the bot token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from bridge.app import run_app
from bridge.config import load_config
from tests.fakes.openai_server import Text
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.sender import EventSender
from tests.support.ports import free_port
from tests.test_app import write_config


@contextlib.asynccontextmanager
async def running(tmp_path, fake_openai, slack: FakeSlack, mode: str, *, bot_token: str | None = None
                  ) -> AsyncIterator[str]:
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
[channels.slack]
enabled = true
mode = "{mode}"
bot_token = "{bot_token or slack.bot_token}"
app_token = "{slack.app_token}"
signing_secret = "{slack.signing_secret}"
api_base = "{slack.base_url}"
""")
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(load_config(path), config_path=str(path), stop=stop))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(250):
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        await resp.read()
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
        yield base
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 20) == 0


async def health(base: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/healthz") as resp:
        return resp.status, await resp.json()


async def eventually(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


@pytest.mark.parametrize("mode", ["socket", "http"])
async def test_run_answers_on_slack_and_reports_its_state(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("Paris."))
    async with running(tmp_path, fake_openai, fake_slack, mode) as base:
        want = "connected" if mode == "socket" else "serving"

        async def up() -> bool:
            status, body = await health(base)
            return status == 200 and body["channels"].get("slack") == want
        await eventually(up)
        body = fake_slack.user_message("capital of France?")
        if mode == "socket":
            env = await fake_slack.socket.deliver(body)
            await fake_slack.socket.wait_acked(env)
        else:
            sent = await EventSender(f"{base}/slack/events", fake_slack.signing_secret).event(body)
            assert sent.status == 200

        async def answered() -> bool:
            return fake_slack.visible("D0ALICE") == ["Paris."]
        await eventually(answered)


async def test_a_rejected_bot_token_makes_healthz_answer_503_naming_slack(tmp_path, fake_openai, fake_slack):
    async with running(tmp_path, fake_openai, fake_slack, "socket", bot_token="xoxb-revoked") as base:
        async def failing() -> bool:
            status, body = await health(base)
            return status == 503 and body.get("failing") == ["slack"]
        await eventually(failing)
        assert fake_slack.calls_to("auth.test")[0].error == "invalid_auth"
