"""A real `chatbridge run` killed with SIGKILL while it streams a reply, then started again: the open page
reconnects with its old Last-Event-ID, is told to resync, and shows the "restarted" notice from history
(once), and the conversation goes on. Headless Chromium; the bridge runs as its own process, the fake model
in the test process, everything on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Text
from tests.support.ports import free_port

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

ROOT = Path(__file__).resolve().parents[2]


async def start_bridge(config: Path, log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge.cli", "run", "-c", str(config), cwd=str(ROOT),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)


async def wait_until_serving(base: str, proc: asyncio.subprocess.Process, timeout: float = 60) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout):
        while True:
            if proc.returncode is not None:
                raise AssertionError(f"the bridge exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{base}/healthz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)


async def stop_bridge(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def test_after_sigkill_mid_reply_and_a_restart_the_page_shows_the_interrupted_notice(
        browser, tmp_path, fake_openai):
    from playwright.async_api import expect

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "chatbridge.toml"
    config.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
api_key = "sk-test"
[web]
port = {port}
""")
    log = tmp_path / "bridge.log"
    fake_openai.script(Text("The first half of an answer, and the rest never comes", chunk_size=4,
                            hold=asyncio.Event(), hold_after=20))
    first = await start_bridge(config, log)
    second: asyncio.subprocess.Process | None = None
    try:
        await wait_until_serving(base, first)
        page = await open_page(browser, base + "/")
        await send(page, "tell me everything")
        live = page.locator("#live .msg.assistant.live")
        await expect(live).to_contain_text("The first half")
        fetches = await page.evaluate("window.chatbridge.app.stats.fullFetches")

        first.send_signal(signal.SIGKILL)  # no shutdown path runs: the turn stays 'running' on disk
        await first.wait()
        second = await start_bridge(config, log)
        await wait_until_serving(base, second)

        notice = page.locator("#messages .notice", has_text="restarted while answering")
        await expect(notice).to_have_count(1, timeout=20_000)
        assert await page.evaluate("window.chatbridge.app.stats.fullFetches") == fetches + 1  # resync → refetch
        await expect(live).to_have_count(0)
        await expect(page.locator("#messages .msg.user")).to_have_text(["tell me everything"])
        await page.screenshot(path=str(ARTIFACTS / "14-restart-notice.png"))

        fake_openai.script(Text("Here is all of it now."))
        await send(page, "please try again")
        await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["Here is all of it now."])
        await expect(notice).to_have_count(1)
        await page.reload()
        await page.wait_for_selector("body[data-ready='1']")
        await expect(notice).to_have_count(1)
    finally:
        for proc in (first, second):
            if proc is not None:
                await stop_bridge(proc)
