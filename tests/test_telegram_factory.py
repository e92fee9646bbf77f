"""`chatbridge run` with Telegram enabled: the factory wires the channel, /healthz reports it."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from bridge.app import run_app
from bridge.cli import main
from bridge.config import load_config
from tests.fakes.telegram import FakeTelegram
from tests.support.ports import free_port
from tests.test_app import write_config


async def test_run_with_telegram_polls_and_reports_health(tmp_path, fake_openai):
    port = free_port()
    async with FakeTelegram() as tg:
        config = load_config(write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[web]
port = {port}
[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
"""))
        stop, started = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run_app(config, config_path=None, stop=stop, on_started=started.set))
        try:
            # generous bounds: a loaded machine can take many seconds to import and start; the condition
            # waited for is what the test checks, not how fast it arrives
            async with asyncio.timeout(60):
                await started.wait()
            async with aiohttp.ClientSession() as http, asyncio.timeout(60):
                while True:
                    # the channel says "polling" once it leads the bot, a moment before its first getUpdates
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        if (await resp.json())["channels"].get("telegram") == "polling" \
                                and tg.count("getUpdates") >= 1:
                            break
                    await asyncio.sleep(0.02)
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 20) == 0


def test_webhook_mode_without_url_and_secret_is_refused_by_check_and_run(tmp_path, capsys, fake_openai):
    path = write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[channels.telegram]
enabled = true
token = "123:abc"
mode = "webhook"
""")
    for command in ("check", "run"):
        assert main([command, "-c", str(path)]) == 2, command
        out, err = capsys.readouterr()
        assert "channels.telegram.webhook_url: required in webhook mode" in err
        assert "channels.telegram.webhook_secret: required in webhook mode" in err
        assert "123:abc" not in out + err
    assert not (tmp_path / "data").exists()  # run never started


async def test_healthz_answers_503_naming_a_failing_channel_and_200_once_it_recovers(tmp_path, fake_openai):
    port = free_port()
    async with FakeTelegram() as tg:
        tg.fail("getMe", status=401, description="Unauthorized", times=1000)  # a revoked token, until fixed
        config = load_config(write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[web]
port = {port}
[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
"""))
        stop = asyncio.Event()
        task = asyncio.create_task(run_app(config, config_path=None, stop=stop))
        try:
            async with aiohttp.ClientSession() as http:
                async def health() -> tuple[int, dict]:
                    for _ in range(500):
                        try:
                            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                                return resp.status, await resp.json()
                        except aiohttp.ClientConnectionError:
                            await asyncio.sleep(0.02)
                    raise AssertionError("server did not come up")

                for _ in range(300):
                    status, body = await health()
                    if body["channels"].get("telegram") == "error":
                        break
                    await asyncio.sleep(0.02)
                assert (status, body) == (503, {"status": "error", "failing": ["telegram"],
                                                "channels": {"telegram": "error", "web": "serving"}})
                tg.faults.clear()  # the operator fixed the token: the channel's own retry recovers
                deadline = time.monotonic() + 60  # its backoff grows (1, 2, 5, ... s) while the token is bad
                while time.monotonic() < deadline:
                    status, body = await health()
                    if status == 200:
                        break
                    await asyncio.sleep(0.05)
                assert body == {"status": "ok", "channels": {"telegram": "polling", "web": "serving"}}
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 20) == 0


async def test_a_token_that_cannot_be_a_bot_token_stops_run_with_the_channels_own_message(
        tmp_path, capsys, fake_openai):
    config = load_config(write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[web]
port = {free_port()}
[channels.telegram]
enabled = true
token = "pasted-the-wrong-thing"
"""))
    assert await run_app(config, config_path=None) == 3
    err = capsys.readouterr().err
    assert "[channels.telegram] token is not a bot token" in err and "pasted-the-wrong-thing" not in err
