"""Subagent cards on the chat page in headless Chromium: one collapsible card per child session under the
reply being written (its live text, its tools, its pending approval with Allow / Deny, its final state),
brought back after a reload from ``task_state`` while the turn runs and from the history once it is over
(opening a finished card loads the child's own conversation)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from core.settings import SubagentSettings
from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.server import RecordingTool, registry, start_web_chat
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Function, Text, ToolCalls
from tests.support.subagents import first_user_text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")


async def test_child_cards_live_approval_reload_and_history(browser, tmp_path, fake_openai):
    from playwright.async_api import expect

    tool = RecordingTool("lookup", result="42 apples")
    pears_hold = asyncio.Event()

    def route(body):
        results = [m for m in body["messages"] if m["role"] == "tool"]
        task = first_user_text(body)
        if not task.startswith("TASK"):
            if results:
                return Text("Apples **42**, pears 5.")
            return ToolCalls([("run_subagent", json.dumps({"task": "TASK apples"})),
                              ("run_subagent", json.dumps({"task": "TASK pears"}))],
                             text="Asking two helpers.", ids=["call_1", "call_2"])
        if task.startswith("TASK apples"):
            return Text("There are 42 apples.") if results else \
                ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_L"])
        return Text("Counting pears: 5 pears.", chunk_size=4, hold=pears_hold, hold_after=9)

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, tools=registry(tool), subagents=SubagentSettings(enabled=True))
    try:
        page = await open_page(browser, chat.base_url + "/")
        await send(page, "count the fruit")

        cards = page.locator("#live .subagent")
        await expect(cards).to_have_count(2)
        apples, pears = cards.nth(0), cards.nth(1)
        await expect(apples.locator("summary")).to_contain_text("subagent: TASK apples")
        await expect(pears.locator(".body")).to_have_text("Counting ")  # its live text, held mid-way
        approval = apples.locator(".approval")  # the child's approval sits in its card
        await expect(approval).to_have_count(1)
        await expect(approval.locator(".q")).to_contain_text("(asked by subagent TASK apples)")
        await expect(page.locator("#live > div > div > .approval")).to_have_count(0)
        await page.screenshot(path=str(ARTIFACTS / "20-subagent-cards.png"))

        # collapsible, and it stays as the user left it while events arrive
        await pears.locator("summary").click()
        await expect(pears).not_to_have_attribute("open", "")

        # a reload while both run: task_state brings the cards, the text so far and the approval back
        await page.reload()
        await page.wait_for_selector("body[data-ready='1']")
        await expect(cards).to_have_count(2)
        await expect(cards.nth(1).locator(".body")).to_have_text("Counting ")
        await expect(cards.nth(0).locator(".approval")).to_have_count(1)
        assert tool.calls == []

        await cards.nth(0).locator(".approval button.allow").click()
        await expect(cards.nth(0).locator("summary .state")).to_have_text("completed")
        await expect(cards.nth(0).locator(".body")).to_have_text("There are 42 apples.")
        await expect(cards.nth(0).locator(".tools li.done")).to_have_text(["lookup — done"])
        assert tool.calls == [{"query": "apples"}]
        await expect(cards.nth(1).locator("summary .state")).to_have_text("running")
        pears_hold.set()

        # the turn is over: the history shows both children as closed cards with their answers
        done = page.locator("#messages .subagent:not(#live .subagent)")
        await expect(page.locator("#live .msg")).to_have_count(0)
        await expect(done).to_have_count(2)
        await expect(done.locator("summary .state")).to_have_text(["completed", "completed"])
        await expect(page.locator("#messages .msg.assistant:not(.live):not(.calls-only) strong")).to_have_text("42")

        # after a reload, from history alone; opening a card loads the child's own conversation
        await page.reload()
        await page.wait_for_selector("body[data-ready='1']")
        await expect(done).to_have_count(2)
        first = done.nth(0)
        await expect(first).not_to_have_attribute("open", "")
        await expect(first.locator(".body")).to_have_text("There are 42 apples.")
        await first.locator("summary").click()
        conversation = first.locator(".child-history")
        await expect(conversation.locator(".msg.user")).to_have_text(["TASK apples"])
        await expect(conversation.locator(".tool-result")).to_have_text(["lookup → 42 apples"])
        await expect(conversation.locator(".msg.assistant:not(.calls-only)")).to_have_text(["There are 42 apples."])
        await expect(first.locator(":scope > .body")).to_be_hidden()  # shown once, at the end of its conversation
        await page.screenshot(path=str(ARTIFACTS / "21-subagent-history.png"))
    finally:
        await chat.close()
