"""The chat page in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; no browser download)
against a real web chat: ChatCore + web channel, with the fake OpenAI server as the model.

Screenshots go to test-artifacts/ (gitignored). The ``browser`` fixture is in conftest.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

HOSTILE = ('Safe **bold** and `<b>code</b>` <img src=x onerror="window.__pwned=1">\n'
           '<script>window.__pwned=2</script> [click](javascript:window.__pwned=3) '
           '[ok](https://example.org/?a=1&b="2") "quotes" & <svg onload=window.__pwned=4>')


async def open_page(context, url):
    page = await context.new_page()
    await page.goto(url)
    await page.wait_for_selector("body[data-ready='1']")
    return page


async def send(page, text):
    await page.fill("#input", text)
    await page.press("#input", "Enter")


async def test_send_stream_stop_reload_and_safe_markdown(browser, chat, fake_openai):
    from playwright.async_api import expect

    hold = asyncio.Event()
    stop_hold = asyncio.Event()
    fake_openai.script(
        Text("The answer is **forty-two**, and here is why: it streams.", chunk_size=4, hold=hold, hold_after=14),
        Text(HOSTILE, chunk_size=7),
        Text("This reply will be stopped before it ends", chunk_size=3, hold=stop_hold, hold_after=10),
    )
    page = await open_page(browser, chat.base_url + "/")

    # 1. a streamed reply: the live bubble shows the first part while the model holds, then the whole answer
    await send(page, "What is the answer?")
    await expect(page.locator(".msg.user.pending, .msg.user").first).to_have_text("What is the answer?")
    live = page.locator("#live .msg.assistant.live")
    await expect(live).to_contain_text("The answer is")
    await expect(live).not_to_contain_text("here is why")
    await expect(page.locator("#stop")).to_be_visible()
    await page.screenshot(path=str(ARTIFACTS / "01-streaming.png"))
    hold.set()
    done = page.locator("#messages .msg.assistant:not(.live)")
    await expect(done).to_have_count(1)
    await expect(done.first.locator("strong")).to_have_text("forty-two")
    await expect(page.locator("#stop")).to_be_hidden()
    await expect(page.locator(".msg.user.pending")).to_have_count(0)
    await page.screenshot(path=str(ARTIFACTS / "02-answered.png"))

    # 2. hostile model output is shown as text, never run
    await send(page, "show me markup")
    await expect(done).to_have_count(2)
    hostile = done.nth(1)
    await expect(hostile).to_contain_text('<img src=x onerror="window.__pwned=1">')
    await expect(hostile).to_contain_text("<script>window.__pwned=2</script>")
    assert await page.evaluate("window.__pwned") is None
    assert await hostile.locator("img, script, svg").count() == 0
    assert await hostile.locator("strong").inner_text() == "bold"
    assert await hostile.locator("code").inner_text() == "<b>code</b>"
    links = hostile.locator("a")
    assert await links.count() == 1
    assert await links.first.get_attribute("href") == "https://example.org/?a=1&b=%222%22"  # quotes encoded
    assert await links.first.get_attribute("rel") == "noopener noreferrer nofollow"
    await page.screenshot(path=str(ARTIFACTS / "03-hostile-markdown.png"))

    # 3. stop a reply
    await send(page, "long story please")
    await expect(live).to_contain_text("This reply")
    await page.click("#stop")
    await expect(page.locator(".notice", has_text="Stopped")).to_have_count(1)
    await expect(page.locator("#stop")).to_be_hidden()
    await expect(page.locator("#live .msg")).to_have_count(0)
    stop_hold.set()
    await page.screenshot(path=str(ARTIFACTS / "04-stopped.png"))

    # 4. reload: the history is back, in order (the stopped reply kept as a partial)
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    await expect(page.locator("#messages .msg")).to_have_count(6)
    texts = await page.locator("#messages .msg").all_inner_texts()
    assert texts[0] == "What is the answer?" and "forty-two" in texts[1]
    assert texts[4] == "long story please" and texts[5].startswith("This reply")
    assert await page.locator("#messages .msg.partial").count() == 1
    await expect(page.locator(".notice", has_text="Stopped")).to_have_count(1)  # kept in history
    assert await page.evaluate("window.__pwned") is None
    await page.screenshot(path=str(ARTIFACTS / "05-reloaded.png"))


async def test_an_answer_without_a_word_shows_its_notice_once_live_and_after_a_reload(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text(""))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "say nothing")
    notice = page.locator("#messages", has_text="finished without writing an answer")
    await expect(notice).to_have_count(1)
    await expect(page.locator("#stop")).to_be_hidden()
    for reloaded in (False, True):
        if reloaded:
            await page.reload()
            await page.wait_for_selector("body[data-ready='1']")
        await expect(page.locator(".notice", has_text="finished without writing an answer")).to_have_count(1)
        await expect(page.locator("#messages .msg")).to_have_count(1)  # the question; no empty answer bubble
        await expect(page.locator("#messages .msg.user")).to_have_text("say nothing")


async def test_history_mirror_rules_in_the_page(browser, chat):
    page = await open_page(browser, chat.base_url + "/")
    result = await page.evaluate("""() => {
        const m = new window.chatbridge.HistoryMirror();
        const r = [];
        m.loadFull("a", 1, [{id: "1"}, {id: "2"}]);
        r.push(m.applyDelta("a", 2, [{id: "3"}, {id: "4"}]));   // contiguous
        r.push(m.applyDelta("a", 2, [{id: "3"}, {id: "4"}]));   // repeated revision
        r.push(m.applyDelta("a", 3, [{id: "4"}, {id: "5"}]));   // overlapping ids
        r.push(m.applyDelta("a", 5, [{id: "9"}]));              // gap
        r.push(m.applyDelta("a", 6, [{id: "10"}]));             // still waiting for that one fetch
        r.push(m.applyDelta("b", 7, [{id: "x"}]));              // another session
        return {r, ids: m.messages.map(x => x.id), rev: m.revision, unread: [...m.unread]};
    }""")
    assert result["r"] == ["applied", "duplicate", "applied", "needs_full_fetch", "duplicate", "marked_unread"]
    assert result["ids"] == ["1", "2", "3", "4", "5"] and result["rev"] == 3 and result["unread"] == ["b"]


async def test_gap_fetches_once_two_tabs_share_a_stream_and_other_sessions_get_unread(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text("first reply", chunk_size=3), Text("second reply", chunk_size=3),
                       Text("reply in the other chat", chunk_size=3))
    a = await open_page(browser, chat.base_url + "/")
    sid = await a.evaluate("window.chatbridge.app.session")
    b = await open_page(browser, f"{chat.base_url}/#{sid}")
    await send(a, "hello from tab a")
    for page in (a, b):  # the second tab sees the same reply
        await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["first reply"])

    # a revision gap (the page believes it missed a commit) costs exactly one full fetch, and no duplicates
    before = await a.evaluate("window.chatbridge.app.stats.fullFetches")
    await a.evaluate("window.chatbridge.app.mirror.revision -= 1")
    await send(a, "again")
    await expect(a.locator("#messages .msg.assistant:not(.live)")).to_have_text(["first reply", "second reply"])
    assert await a.evaluate("window.chatbridge.app.stats.fullFetches") == before + 1
    assert await a.locator("#messages .msg").count() == 4
    assert await b.evaluate("window.chatbridge.app.stats.fullFetches") == 1  # tab b applied plain deltas

    # tab b opens a new chat and talks there; tab a marks that chat unread and keeps its own messages
    await b.click("#new-chat")
    await expect(b.locator("#messages .msg")).to_have_count(0)
    other = await b.evaluate("window.chatbridge.app.session")
    assert other != sid
    await send(b, "hello in another chat")
    await expect(b.locator("#messages .msg.assistant:not(.live)")).to_have_text(["reply in the other chat"])
    await expect(a.locator(f"#sessions li[data-id='{other}']")).to_have_class("unread")
    assert await a.locator("#messages .msg").count() == 4
    # rename from tab b reaches tab a's list
    await b.click("#rename")
    await b.fill("#title-input", "Weekend plans")
    await b.press("#title-input", "Enter")
    await expect(a.locator(f"#sessions li[data-id='{other}'] .t")).to_have_text("Weekend plans")
    # opening it clears the mark and loads its history
    await a.click(f"#sessions li[data-id='{other}']")
    await expect(a.locator("#messages .msg.assistant")).to_have_text(["reply in the other chat"])
    await expect(a.locator(f"#sessions li[data-id='{other}']")).not_to_have_class("unread")
    await a.screenshot(path=str(ARTIFACTS / "06-two-sessions.png"))


async def test_phone_sized_screen(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text("A short answer that fits on a phone.\n\n- one\n- two", chunk_size=5))
    page = await browser.new_page()
    await page.set_viewport_size({"width": 390, "height": 844})
    await page.goto(chat.base_url + "/")
    await page.wait_for_selector("body[data-ready='1']")
    await expect(page.locator("#sidebar")).not_to_be_in_viewport()
    await send(page, "hi from a phone")
    await expect(page.locator("#messages .msg.assistant li")).to_have_count(2)
    box = await page.locator("#composer").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
    await page.click("#toggle-sidebar")
    await expect(page.locator("#sidebar")).to_be_in_viewport(ratio=1)
    await page.screenshot(path=str(ARTIFACTS / "07-phone.png"))
