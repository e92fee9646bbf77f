"""A Feishu card press whose answer did not reach Feishu in time, or at all. Feishu pushes such a press again under
the same event id, and the user must still see how the request ended: a press pushed again after it was carried
out is answered with the decided card (its first answer, which carried that card, may have been lost on the way,
while the bridge believed the card showed it), and a press still being carried out when its answer is due is told
it was received, never "try again", and its card is then patched with the outcome. The real channel (lark-oapi)
against the fake Open Platform, over the long connection and the webhook."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from channels.feishu import approvals
from channels.feishu.channel import TRY_AGAIN
from core.sqlite_store import SqliteStore
from tests.browser.server import RecordingTool, registry
from tests.fakes.feishu.harness import CHAT, FeishuHarness, every_mode
from tests.fakes.feishu.openapi import FakeFeishu, card_buttons, card_text
from tests.fakes.openai_server import Text, ToolCalls

pytest_generate_tests = every_mode

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_F1"])


class SlowPressMarks(SqliteStore):
    """A busy disk for a press's dedupe mark: it is written only once ``gate`` is set."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = asyncio.Event()
        self.gate.set()

    async def mark_event_processed(self, channel: str, event_id: str, *, ttl_seconds: float) -> bool:
        if event_id.startswith("press:"):
            await self.gate.wait()
        return await super().mark_event_processed(channel, event_id, ttl_seconds=ttl_seconds)


def approval_cards(fake: FakeFeishu) -> list[Any]:
    """The bot's cards that show live Allow / Deny buttons."""
    return [m for m in fake.shown(CHAT) if m.msg_type == "interactive" and card_buttons(m.content)]


def button(msg: Any, label: str) -> Any:
    return next(value for text, value in card_buttons(msg.content) if label in text)


async def asked(t: FeishuHarness, fake: FakeFeishu) -> Any:
    await t.say("count my apples")
    await t.wait_for(lambda: approval_cards(fake))
    [msg] = approval_cards(fake)
    return msg


async def test_a_press_pushed_again_after_its_answer_was_lost_gets_the_decided_card(feishu_bridge, fake_openai,
                                                                                  fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    msg = await asked(t, fake_feishu)
    first = await t.press(button(msg, "Allow"), message_id=msg.message_id, event_id="ev_press_1")
    assert first["toast"]["content"] == approvals.ALLOWED and "card" in first
    await t.settle()
    # that answer (the toast and the decided card) never reached Feishu: the message still shows the buttons,
    # and Feishu pushes the same press again
    assert approval_cards(fake_feishu) == [msg]
    again = await t.press(button(msg, "Allow"), message_id=msg.message_id, event_id="ev_press_1")
    assert "card" in again, "a press pushed again only toasts: its card keeps live-looking buttons"
    assert again["toast"] == approvals.toast("success", approvals.ALLOWED)["toast"]  # the user's own decision
    decided = again["card"]["data"]
    assert card_buttons(decided) == [] and "Allowed by u\\_alice" in card_text(decided)
    await t.settle()
    assert tool.calls == [{"query": "apples"}]  # carried out once


async def test_a_denied_press_pushed_again_says_denied_with_its_card(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("Not counted."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    msg = await asked(t, fake_feishu)
    await t.press(button(msg, "Deny"), message_id=msg.message_id, event_id="ev_press_1")
    await t.settle()
    again = await t.press(button(msg, "Deny"), message_id=msg.message_id, event_id="ev_press_1")
    assert again["toast"] == approvals.toast("info", approvals.DENIED)["toast"]
    assert card_buttons(again["card"]["data"]) == [] and "Denied by u\\_alice" in card_text(again["card"]["data"])
    assert tool.calls == []


async def test_a_slow_press_is_told_it_was_received_and_its_card_then_shows_the_outcome(
        feishu_bridge, fake_openai, fake_feishu, tmp_path):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    store = SlowPressMarks(tmp_path / "chat.db")
    t = await feishu_bridge(core={"tools": registry(tool), "store": store}, press_wait=0.5)
    msg = await asked(t, fake_feishu)
    patches = fake_feishu.count("message.patch")
    store.gate.clear()  # the press's store write waits: its answer is due before it is decided
    try:
        first = await t.press(button(msg, "Allow"), message_id=msg.message_id, event_id="ev_slow")
        assert first["toast"]["content"] != TRY_AGAIN, "a press that goes on was told to try again"
        assert first == approvals.toast("info", approvals.RECEIVED)
        # Feishu pushes it again (the answer came late): still being carried out, so the same answer
        again = await t.press(button(msg, "Allow"), message_id=msg.message_id, event_id="ev_slow")
        assert again == approvals.toast("info", approvals.RECEIVED)
        assert approval_cards(fake_feishu) == [msg] and tool.calls == []
    finally:
        store.gate.set()
    # decided now: the card the late answer would have carried is patched onto the message
    await t.wait_for(lambda: not approval_cards(fake_feishu))
    assert fake_feishu.count("message.patch") > patches
    assert "Allowed by u\\_alice" in fake_feishu.text_of(fake_feishu.messages[msg.message_id])
    await t.settle()
    assert tool.calls == [{"query": "apples"}]


async def test_a_refused_press_pushed_again_is_refused_again(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    msg = await asked(t, fake_feishu)
    stranger = {"operator": "ou_mallory", "operator_user_id": "u_mallory", "event_id": "ev_mallory"}
    first = await t.press(button(msg, "Allow"), message_id=msg.message_id, **stranger)
    again = await t.press(button(msg, "Allow"), message_id=msg.message_id, **stranger)
    # the request is still pending: not "no longer pending", which would send the stranger away misinformed
    assert first == again == approvals.toast("warning", approvals.NOT_YOURS)
    assert approval_cards(fake_feishu) == [msg] and tool.calls == []
    # the person who asked still decides it
    mine = await t.press(button(msg, "Allow"), message_id=msg.message_id, event_id="ev_alice")
    assert mine["toast"]["content"] == approvals.ALLOWED
    await t.settle()
    assert tool.calls == [{"query": "apples"}]
