"""History on the chat page in headless Chromium: a failed turn's notice survives a reload, older messages
load when the conversation is scrolled to the top (the part being read stays in place), and the page's
history mirror follows the same paging rules as tests/support/history_mirror.py."""

from __future__ import annotations

import os

import pytest

from core.messages import MessageSource, NewMessage
from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import HttpError, Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")


async def test_a_failed_turns_notice_stays_after_a_reload(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(HttpError.auth(), Text("fine now"))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "hello?")
    notice = page.locator("#messages .notice", has_text="rejected the bridge's credentials")
    await expect(notice).to_have_count(1)
    await expect(page.locator("#live .msg")).to_have_count(0)
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    await expect(page.locator("#messages .msg.user")).to_have_text(["hello?"])
    await expect(notice).to_have_count(1)
    await send(page, "and now?")  # the next answer comes after it; the notice is still there once
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["fine now"])
    await expect(notice).to_have_count(1)
    await page.screenshot(path=str(ARTIFACTS / "12-failed-turn-after-reload.png"))


async def test_older_messages_load_at_the_top_and_the_reading_position_stays(browser, chat, fake_openai):
    from playwright.async_api import expect

    page = await open_page(browser, chat.base_url + "/")
    sid = await page.evaluate("window.chatbridge.app.session")
    key = f"web:{sid}"
    for i in range(125):  # 250 messages: more than two pages of 100
        await chat.core.store.append_message(key, NewMessage(role="user", content=f"question {i}",
                                                             source=MessageSource(kind="user_input")))
        await chat.core.store.commit_turn(key, [NewMessage(role="assistant", content=f"answer **{i}**",
                                                           source=MessageSource(kind="assistant"))],
                                          expect_generation=None, expect_state_version=None)
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    msgs = page.locator("#messages .msg")
    await expect(msgs).to_have_count(100)
    await expect(msgs.last).to_have_text("answer 124")
    assert await page.evaluate("window.chatbridge.app.stats.olderPages") == 0

    for expected in (200, 250):
        first = msgs.first
        first_id = await first.get_attribute("data-id")
        await page.evaluate("document.getElementById('messages').scrollTop = 0")
        y_before = (await page.locator(f"[data-id='{first_id}']").bounding_box())["y"]
        await expect(msgs).to_have_count(expected)
        y_after = (await page.locator(f"[data-id='{first_id}']").bounding_box())["y"]
        assert abs(y_after - y_before) < 2  # what was on screen stays on screen
    await expect(page.locator("#older")).to_be_hidden()  # nothing older is left
    texts = await msgs.all_inner_texts()
    assert texts == [t for i in range(125) for t in (f"question {i}", f"answer {i}")]
    assert await page.evaluate("window.chatbridge.app.stats.olderPages") == 2
    await page.screenshot(path=str(ARTIFACTS / "13-older-messages.png"))


async def test_the_page_mirror_pages_like_the_reference(browser, chat):
    page = await open_page(browser, chat.base_url + "/")
    result = await page.evaluate("""() => {
        const msg = (i) => ({id: "m" + i});
        const ids = (m) => m.messages.map((x) => x.id);
        const m = new window.chatbridge.HistoryMirror();
        const r = {};
        m.loadFull("s1", 9, [msg(7), msg(8), msg(9)], true);
        r.a = m.loadOlder("s1", "m7", [msg(4), msg(5), msg(6)], true);
        r.late = m.loadOlder("s1", "m7", [msg(1), msg(2), msg(3)], false);
        r.other = m.loadOlder("s2", "m4", [msg(1)], false);
        r.b = m.loadOlder("s1", "m4", [msg(2), msg(3), msg(4)], false);
        r.ids1 = ids(m); r.more1 = m.hasMore;
        const f = new window.chatbridge.HistoryMirror();
        f.loadFull("s1", 5, [msg(4), msg(5)], true);
        f.loadOlder("s1", "m4", [msg(2), msg(3)], true);
        f.loadFull("s1", 6, [msg(5), msg(6)], true);
        r.ids2 = ids(f); r.more2 = f.hasMore;
        f.loadFull("s1", 9, [msg(8), msg(9)], true);
        r.ids3 = ids(f);
        f.loadFull("s2", 1, [msg(8)], false);
        r.ids4 = ids(f); r.more4 = f.hasMore;
        return r;
    }""")
    assert result == {"a": True, "late": False, "other": False, "b": True,
                      "ids1": [f"m{i}" for i in range(2, 10)], "more1": False,
                      "ids2": ["m2", "m3", "m4", "m5", "m6"], "more2": True,
                      "ids3": ["m8", "m9"], "ids4": ["m8"], "more4": False}


async def test_a_stream_the_browser_gave_up_on_is_reopened_and_history_refetched(browser, chat, fake_openai):
    import aiohttp
    from playwright.async_api import expect

    fake_openai.script(Text("answered while the page was cut off"))
    page = await open_page(browser, chat.base_url + "/")
    sid = await page.evaluate("window.chatbridge.app.session")
    refused = []

    async def proxy_502_once(route):  # what a reverse proxy answers while the bridge restarts
        if not refused:
            refused.append(route.request.url)
            await route.fulfill(status=502, body="bad gateway")
        else:
            await route.continue_()

    await page.route("**/api/sessions/*/stream?*", proxy_502_once)
    chat.channel.close_connections()  # the stream drops; the browser's reconnect gets the 502
    # the browser retries after the stream's 2 s, gets the 502 and gives up; the page tries again 3 s later
    await expect(page.locator("#status")).to_have_text("disconnected; retrying…", timeout=15_000)
    async with aiohttp.ClientSession() as http:  # meanwhile the conversation moves on elsewhere
        async with http.post(f"{chat.base_url}/api/sessions/{sid}/messages", json={"text": "from elsewhere"}) as r:
            assert r.status == 202
    await expect(page.locator("#messages .msg.assistant")).to_have_text(["answered while the page was cut off"],
                                                                        timeout=15_000)
    await expect(page.locator("#messages .msg.user")).to_have_text(["from elsewhere"])
    await expect(page.locator("#status")).to_have_text("")
    assert len(refused) == 1
