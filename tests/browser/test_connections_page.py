"""How many connections the chat page holds, and how its one event stream comes back.

Chromium opens at most 6 HTTP/1.1 connections per host, shared by all its tabs; an open event stream keeps
one. A page holds one EventSource (its session's stream, which carries the conversation-list feed too), so
several tabs still leave room for the page's requests. That stream is reopened after an error answer (a
bridge restarting answers 503 for a moment), and the conversation list with it. Headless Chromium against a
real web chat; every wait is bounded."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tests.browser.conftest import CHROMIUM
from tests.browser.test_chat_page import send
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

WAIT = 10.0

FETCH_SESSIONS = """async () => {
    const ctl = new AbortController(); const t = setTimeout(() => ctl.abort(), 5000);
    try { const r = await fetch('/api/sessions', {signal: ctl.signal}); return 'ok ' + r.status; }
    catch (e) { return 'failed: ' + e.name; } finally { clearTimeout(t); }
}"""


async def open_tab(browser: Any, url: str) -> Any:
    page = await browser.new_page()
    page.set_default_timeout(WAIT * 1000)
    await page.goto(url)
    await page.wait_for_selector("body[data-ready='1']")
    return page


async def until(pred: Any, timeout: float = WAIT) -> None:
    """Wait (bounded) for the server to get where the test needs it; polling, as the server's reaper does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_four_tabs_of_one_chat_still_send_and_fetch(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text("answered in the fourth tab", chunk_size=4))
    first = await open_tab(browser, chat.base_url + "/")
    sid = await first.evaluate("window.chatbridge.app.session")
    tabs = [first] + [await open_tab(browser, f"{chat.base_url}/#{sid}") for _ in range(3)]
    await until(lambda: chat.channel.server.slots.open == 4)  # one event stream per tab
    last = tabs[-1]
    await send(last, "from the fourth tab")
    for page in (last, first):
        await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["answered in the fourth tab"])
    assert await first.evaluate(FETCH_SESSIONS) == "ok 200"
    assert chat.channel.server.slots.open == 4


async def stream_open(page: Any) -> None:
    await page.wait_for_function("() => window.chatbridge.app.stream.readyState === EventSource.OPEN")


async def test_after_503_answers_the_stream_comes_back_with_the_conversation_list(browser, chat, http):
    from playwright.async_api import expect

    server = chat.channel.server
    p1 = await open_tab(browser, chat.base_url + "/")
    p2 = await open_tab(browser, chat.base_url + "/")
    for page in (p1, p2):
        await stream_open(page)
    # the bridge restarts (with a token, or behind a proxy): the chat answers 503 "starting" for a moment
    server.key_loaded = False
    chat.channel.close_connections()  # the old process's streams end
    for page in (p1, p2):  # each browser retried, got the 503 and gave up; the page retries on its own
        await expect(page.locator("#status")).to_have_text("disconnected; retrying…", timeout=WAIT * 1000)
    server.key_loaded = True
    for page in (p1, p2):  # back on a stream
        await stream_open(page)
    async with http.post(f"{chat.base_url}/api/sessions") as r:  # a conversation begun elsewhere
        assert r.status == 201
        new_id = (await r.json())["id"]
    for page in (p1, p2):
        await expect(page.locator(f"#sessions li[data-id='{new_id}']")).to_have_count(1)


async def test_a_conversation_that_moved_on_while_the_stream_was_away_is_marked_unread(browser, chat, fake_openai,
                                                                                      http):
    from playwright.async_api import expect

    fake_openai.script(Text("answered while the first tab was away", chunk_size=4))
    page = await open_tab(browser, chat.base_url + "/")
    async with http.post(f"{chat.base_url}/api/sessions") as r:
        other = (await r.json())["id"]
    await expect(page.locator(f"#sessions li[data-id='{other}']")).to_have_count(1)
    await stream_open(page)
    asked, reopen = asyncio.Event(), asyncio.Event()

    async def held_once(route: Any) -> None:  # the browser's reconnect waits (a slow proxy, a flaky network)
        if not asked.is_set():
            asked.set()
            await reopen.wait()
        await route.continue_()

    await page.route("**/api/sessions/*/stream?*", held_once)
    chat.channel.close_connections()
    await asyncio.wait_for(asked.wait(), WAIT)
    async with http.post(f"{chat.base_url}/api/sessions/{other}/messages", json={"text": "meanwhile"}) as r:
        assert r.status == 202
    await until_history(http, chat.base_url, other, "answered while the first tab was away")
    await expect(page.locator(f"#sessions li[data-id='{other}']")).not_to_have_class("unread")
    reopen.set()
    await expect(page.locator(f"#sessions li[data-id='{other}']")).to_have_class("unread")
    await expect(page.locator("#sessions li.unread")).to_have_count(1)


async def until_history(http: Any, base: str, sid: str, text: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
            if any(m["content"] == text for m in (await resp.json())["messages"]):
                return
        assert asyncio.get_running_loop().time() < deadline, "the answer was not committed in time"
        await asyncio.sleep(0.05)
