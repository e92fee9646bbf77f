"""Tool approvals on the chat page in headless Chromium: the fake model asks for a tool whose policy is
"ask", the page shows Allow / Deny, a click disables both, and the turn goes on with the tool's result or
its denial."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.server import RecordingTool, registry, start_web_chat
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Text, ToolCalls

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_P1"])


@pytest.fixture
def tool():
    return RecordingTool("lookup", result="42 apples")


@pytest.fixture
async def chat(tmp_path, fake_openai, tool):
    wc = await start_web_chat(tmp_path, fake_openai, tools=registry(tool))
    try:
        yield wc
    finally:
        await wc.close()


async def hold_decisions(page) -> tuple[asyncio.Event, list[dict]]:
    """Hold the page's approval POSTs until the returned event is set (so the disabled state can be seen)."""
    release = asyncio.Event()
    posted: list[dict] = []

    async def handler(route):
        posted.append(route.request.post_data_json)
        await release.wait()
        await route.continue_()

    await page.route("**/approvals/**", handler)
    return release, posted


async def test_approve_a_tool_call(browser, chat, fake_openai, tool):
    from playwright.async_api import expect

    answer_hold = asyncio.Event()
    fake_openai.script(ASK, Text("You have **42** apples.", chunk_size=4, hold=answer_hold, hold_after=8))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "How many apples do I have?")

    approval = page.locator("#live .approval")
    await expect(approval).to_have_count(1)
    await expect(approval.locator(".q strong")).to_have_text("lookup")
    await expect(approval.locator(".args")).to_have_text('query="apples"')
    await expect(page.locator("#live .tools li")).to_have_text(["lookup — awaiting approval: query=\"apples\""])
    assert tool.calls == []

    # a reload while it waits: task_state brings the pending approval back
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    await expect(approval).to_have_count(1)
    await page.screenshot(path=str(ARTIFACTS / "08-approval-pending.png"))

    release, posted = await hold_decisions(page)
    await approval.locator("button.allow").click()
    await expect(approval.locator("button.allow")).to_be_disabled()
    await expect(approval.locator("button.deny")).to_be_disabled()
    await expect(approval.locator(".chosen")).to_have_text("Allowing…")
    assert tool.calls == []
    release.set()
    assert posted == [{"decision": "allow"}]

    # the tool runs, its status shows, the answer streams in
    await expect(approval).to_have_count(0)
    await expect(page.locator("#live .tools li.done")).to_have_text(["lookup — done: 42 apples"])
    await expect(page.locator("#live .msg.assistant .body")).to_contain_text("You have")
    assert tool.calls == [{"query": "apples"}]
    answer_hold.set()
    done = page.locator("#messages .msg.assistant:not(.live):not(.calls-only)")
    await expect(done).to_have_count(1)
    await expect(done.locator("strong")).to_have_text("42")
    await expect(page.locator(".tool-result")).to_have_text(["lookup → 42 apples"])
    await expect(page.locator("#live .msg")).to_have_count(0)
    await page.screenshot(path=str(ARTIFACTS / "09-approval-allowed.png"))
    assert tool.calls == [{"query": "apples"}]


async def test_deny_a_tool_call(browser, chat, fake_openai, tool):
    from playwright.async_api import expect

    answer_hold = asyncio.Event()
    fake_openai.script(ASK, Text("Understood, I did not look it up.", chunk_size=4, hold=answer_hold,
                                 hold_after=4))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "How many apples do I have?")
    approval = page.locator("#live .approval")
    await expect(approval).to_have_count(1)

    release, posted = await hold_decisions(page)
    await approval.locator("button.deny").click()
    await expect(approval.locator("button.allow")).to_be_disabled()
    await expect(approval.locator(".chosen")).to_have_text("Denying…")
    release.set()

    await expect(approval).to_have_count(0)
    await expect(page.locator("#live .tools li.denied")).to_have_text(
        ["lookup — denied: Tool call denied by user."])
    answer_hold.set()
    await expect(page.locator("#messages .msg.assistant:not(.live):not(.calls-only)")).to_have_text(
        ["Understood, I did not look it up."])
    await expect(page.locator(".tool-result.denied")).to_have_text(["lookup → Tool call denied by user."])
    await page.screenshot(path=str(ARTIFACTS / "10-approval-denied.png"))
    assert posted == [{"decision": "deny"}]
    assert tool.calls == []
