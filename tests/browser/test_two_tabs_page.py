"""Two open tabs of one conversation in headless Chromium: what one tab sends while a reply is being written
shows in the other at once (greyed, from the live ``message_queued`` event, with no reconnect) and once; the
answer to a command concerns only the tab that sent it."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.browser.conftest import CHROMIUM
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

HELP = "list the commands"  # in core's /help answer


async def test_a_message_queued_in_one_tab_shows_at_once_in_the_other_and_help_only_in_its_own(browser, chat,
                                                                                              fake_openai):
    from playwright.async_api import expect

    hold = asyncio.Event()
    fake_openai.script(Text("first reply, held here then done", chunk_size=4, hold=hold, hold_after=12),
                       Text("second reply", chunk_size=3))
    tab_a = await open_page(browser, chat.base_url + "/")
    sid = await tab_a.evaluate("window.chatbridge.app.session")
    tab_b = await open_page(browser, f"{chat.base_url}/#{sid}")
    streams: list[str] = []
    tab_b.on("request", lambda r: streams.append(r.url) if "/stream" in r.url else None)

    await send(tab_a, "msg A")
    await expect(tab_b.locator("#live .msg.assistant.live")).to_contain_text("first reply")
    await send(tab_a, "msg B")
    await expect(tab_b.locator(".msg.user.pending")).to_have_text(["msg A", "msg B"])  # running, queued
    assert streams == []  # told live, not by a reconnect's task_state

    await send(tab_a, "/help")
    await expect(tab_a.locator("#messages .notice")).to_contain_text([HELP])

    hold.set()
    for tab in (tab_a, tab_b):
        await expect(tab.locator("#messages .msg.assistant:not(.live)")).to_have_text(
            ["first reply, held here then done", "second reply"])
        await expect(tab.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)
        await expect(tab.locator("#messages .msg.user")).to_have_text(["msg A", "msg B"])
    await expect(tab_b.locator("#messages .notice")).to_have_count(0)  # the help notice came before the replies
    await expect(tab_a.locator("#messages .notice")).to_have_count(1)
