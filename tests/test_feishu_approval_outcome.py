"""A Feishu approval card never keeps live-looking buttons for good: when the patch showing how it ended fails, the
request stays in the open-requests record, a press on the card is answered "no longer pending" with the card as it
ended (the callback's answer replaces it), and the next start shows how it ended; a press decided after the SDK's
thread stopped waiting for its answer (``press_wait``) gets its card patched. The real channel (lark-oapi) against
the fake Open Platform, over the long connection and the webhook."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from channels.common import open_approvals
from channels.common.open_approvals import OPEN_APPROVALS
from channels.feishu import approvals
from tests.browser.server import RecordingTool, registry
from tests.fakes.feishu.harness import CHAT, FeishuHarness, every_mode
from tests.fakes.feishu.openapi import FakeFeishu, card_buttons, card_text
from tests.fakes.openai_server import Text, ToolCalls

pytest_generate_tests = every_mode

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_F1"])
TIMED_OUT = "nobody decided in time"


def approval_cards(fake: FakeFeishu) -> list[Any]:
    """The bot's cards that show live Allow / Deny buttons."""
    return [m for m in fake.shown(CHAT) if m.msg_type == "interactive" and card_buttons(m.content)]


def button(msg: Any, label: str) -> Any:
    return next(value for text, value in card_buttons(msg.content) if label in text)


async def quiet(t: FeishuHarness) -> None:
    await t.settle()
    await t.wait_for(lambda: not any(task.get_name().startswith(("approval-ended", "feishu:approvals"))
                                     for task in asyncio.all_tasks()), timeout=10)


async def records(t: FeishuHarness) -> list[dict[str, Any]]:
    return json.loads(await t.channel.host.get_state(OPEN_APPROVALS) or "[]")

async def no_records_left(t: FeishuHarness, timeout: float = 5.0) -> None:
    """The open-requests record empties (soon after the last close: it is rewritten then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await records(t):
        assert loop.time() < deadline, "the open-requests record still holds requests"
        await asyncio.sleep(0.02)



async def timed_out_while_feishu_refused_the_patch(feishu_bridge: Any, fake_feishu: FakeFeishu, **kw: Any):
    """Nobody decides; every patch of the card fails meanwhile: the card still shows Allow / Deny."""
    tool = RecordingTool("lookup", result="42 apples")
    t = await feishu_bridge(core={"tools": registry(tool), "approval_timeout": 0.5}, **kw)
    failing = fake_feishu.fail("message.patch", status=500, times=1000)
    await t.say("count my apples")
    await t.wait_for(lambda: approval_cards(fake_feishu))
    [msg] = approval_cards(fake_feishu)
    await quiet(t)
    assert failing.hits > 0 and approval_cards(fake_feishu) == [msg]  # Feishu refused the patch
    return t, tool, msg, failing


async def test_a_press_on_a_card_whose_ended_patch_failed_gets_the_ended_card(feishu_bridge, fake_openai,
                                                                               fake_feishu):
    fake_openai.script(ASK, Text("Nobody answered."))
    t, tool, msg, _ = await timed_out_while_feishu_refused_the_patch(feishu_bridge, fake_feishu)
    late = await t.press(button(msg, "Allow"), message_id=msg.message_id)
    assert late["toast"] == approvals.toast("info", approvals.GONE)["toast"]
    assert "card" in late, "a press on a live-looking card that is over only toasts: its buttons stay"
    ended = late["card"]["data"]
    assert card_buttons(ended) == [] and TIMED_OUT in card_text(ended) and "lookup" in card_text(ended)
    assert tool.calls == []
    await quiet(t)
    await no_records_left(t)  # the card shows how it ended: nothing left to close


async def test_a_restart_shows_how_a_request_ended_when_its_patch_had_failed(feishu_bridge, fake_openai,
                                                                              fake_feishu):
    fake_openai.script(ASK, Text("Nobody answered."))
    t, tool, msg, failing = await timed_out_while_feishu_refused_the_patch(feishu_bridge, fake_feishu)
    await t.close()
    failing.times = 0
    t2 = await feishu_bridge()  # the next start, on the same database
    await t2.wait_for(lambda: not approval_cards(fake_feishu))
    shown = fake_feishu.text_of(fake_feishu.messages[msg.message_id])
    assert TIMED_OUT in shown and "restarted" not in shown  # how it ended, not the restart
    await no_records_left(t2)
    assert tool.calls == []


async def test_a_restart_whose_close_fails_keeps_the_card_recorded_and_closes_it_later(
        feishu_bridge, fake_openai, fake_feishu, monkeypatch):
    monkeypatch.setattr(open_approvals, "RETRY", (0.3,), raising=False)
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    tool = RecordingTool("lookup", result="42 apples")
    t = await feishu_bridge(core={"tools": registry(tool)})
    await t.say("count my apples")
    await t.wait_for(lambda: approval_cards(fake_feishu))
    [msg] = approval_cards(fake_feishu)
    failing = fake_feishu.fail("message.patch", status=500, times=1000)  # Feishu down from here on
    hold.set()
    await t.close()  # the stop could not show that the request ended either
    assert approval_cards(fake_feishu) == [msg]

    t2 = await feishu_bridge()
    assert approval_cards(fake_feishu) == [msg]  # the close at the start failed: the card still looks live
    failing.times = 0
    await t2.wait_for(lambda: not approval_cards(fake_feishu))  # the record was kept, and tried again
    assert "lookup" in fake_feishu.text_of(fake_feishu.messages[msg.message_id])
    await no_records_left(t2)  # forgotten once closed
    assert tool.calls == []


async def test_a_press_decided_after_the_answer_was_given_up_on_gets_its_card_patched(feishu_bridge, fake_openai,
                                                                                       fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await feishu_bridge(core={"tools": registry(tool)}, press_wait=0.5)
    await t.say("count my apples")
    await t.wait_for(lambda: approval_cards(fake_feishu))
    [msg] = approval_cards(fake_feishu)
    host = t.channel.host
    real = host.mark_seen
    store_slow = asyncio.Event()

    async def slow_mark_seen(key: str) -> bool:  # a busy store: the press is decided only after press_wait
        if key.startswith("press:"):
            await store_slow.wait()
        return await real(key)

    host.mark_seen = slow_mark_seen  # type: ignore[method-assign]
    try:
        first = await t.press(button(msg, "Allow"), message_id=msg.message_id)
        # the SDK's thread answered without the decision: the press goes on, so not "try again"
        assert first == approvals.toast("info", approvals.RECEIVED)
    finally:
        host.mark_seen = real  # type: ignore[method-assign]
        store_slow.set()  # then the press goes on: decided after its answer was given up on
    await t.wait_for(lambda: not approval_cards(fake_feishu))  # the decided card, patched onto the message
    assert "Allowed by u\\_alice" in fake_feishu.text_of(fake_feishu.messages[msg.message_id])
    await quiet(t)
    assert tool.calls == [{"query": "apples"}]
    await no_records_left(t)
