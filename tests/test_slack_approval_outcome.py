"""An approval whose outcome Slack did not take (``chat.update`` failing) never keeps live-looking buttons for
good: the request stays in the open-requests record, a later press on its buttons shows the outcome on the
message, and a restart shows the outcome it had (not "the bridge restarted"); a restart whose own close fails
keeps the record and closes it on a later try (``channels.common.open_approvals``). The real channel (slack-bolt,
slack_sdk) against the fake Slack."""

from __future__ import annotations

import asyncio
import json

import pytest

from channels.common import open_approvals
from channels.common.open_approvals import OPEN_APPROVALS as OPEN_STATE
from channels.slack.channel import GONE
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import SlackHarness, slack_harness

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_S1"])


def approval_messages(slack: FakeSlack, channel: str) -> list:
    """The bot's messages that show live approval buttons."""
    return [m for m in slack.messages(channel) if any(b.get("type") == "actions" for b in m.blocks)]


def is_approval_update(params: dict) -> bool:
    return "Approval needed" in str(params.get("text"))


async def quiet(t: SlackHarness) -> None:
    """The turn and every follow-up of a press (the message updates) are over."""
    await t.settle()
    await t.wait_for(lambda: not any(task.get_name().startswith(("slack:approval", "slack:gone", "approval-ended"))
                                     for task in asyncio.all_tasks()), timeout=10)


async def open_records(t: SlackHarness) -> list[dict]:
    return json.loads(await t.channel.host.get_state(OPEN_STATE) or "[]")

async def no_records_left(t: SlackHarness, timeout: float = 5.0) -> None:
    """The open-requests record empties (soon after the last close: it is rewritten then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await open_records(t):
        assert loop.time() < deadline, "the open-requests record still holds requests"
        await asyncio.sleep(0.02)



async def decided_while_slack_refused_the_update(t: SlackHarness, slack: FakeSlack, tool: RecordingTool):
    """Alice allows; every update of the request fails meanwhile (the press's, and the turn's end's): the tool
    ran, the message still shows Allow / Deny."""
    await t.deliver(slack.user_message("how many apples do I have?"))
    await t.wait_for(lambda: approval_messages(slack, "D0ALICE"))
    [msg] = approval_messages(slack, "D0ALICE")
    failing = slack.fail("chat.update", status=500, when=is_approval_update, times=1000)
    assert (await t.press(slack.press(msg, "Allow"))).acked
    await quiet(t)
    assert tool.calls == [{"query": "apples"}]
    assert approval_messages(slack, "D0ALICE") == [msg]  # Slack refused every update so far
    return msg, failing


async def test_a_press_on_buttons_whose_outcome_update_failed_shows_the_outcome(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=0.5)
    try:
        msg, failing = await decided_while_slack_refused_the_update(t, fake_slack, tool)
        failing.times = 0  # Slack takes updates again
        again = fake_slack.press(fake_slack.message("D0ALICE", msg.ts), "Deny")
        assert (await t.press(again)).acked
        await quiet(t)
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0ALICE", GONE)]
        assert approval_messages(fake_slack, "D0ALICE") == []  # the press showed the outcome on the message
        shown = fake_slack.message("D0ALICE", msg.ts).shown
        assert "Allowed by <@U0ALICE>" in shown and "lookup" in shown
        assert tool.calls == [{"query": "apples"}]  # decided once
        await no_records_left(t)
    finally:
        await t.close()


async def test_a_press_reaching_a_process_that_did_not_post_the_buttons_shows_the_recorded_outcome(
        tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=0.5)
    try:
        msg, failing = await decided_while_slack_refused_the_update(t, fake_slack, tool)
        failing.times = 0
        t.channel.prompts_by_call.clear()  # as in a process that did not post it: only the record knows the outcome
        again = fake_slack.press(fake_slack.message("D0ALICE", msg.ts), "Deny")
        assert (await t.press(again)).acked
        await quiet(t)
        assert approval_messages(fake_slack, "D0ALICE") == []
        assert "Allowed by <@U0ALICE>" in fake_slack.message("D0ALICE", msg.ts).shown
        assert tool.calls == [{"query": "apples"}]
    finally:
        await t.close()


async def test_a_restart_shows_the_outcome_an_update_failed_to_show(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=0.5)
    try:
        msg, failing = await decided_while_slack_refused_the_update(t, fake_slack, tool)
        # the request stays recorded, with how it ended, until its message shows it
        left_open = await t.channel.host.get_state(OPEN_STATE)
        buttons = msg.blocks
    finally:
        await t.close()
    failing.times = 0
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", platform=t.h.platform, start=False)
    try:
        msg.blocks = buttons  # as a crash leaves it
        await t.channel.host.set_state(OPEN_STATE, left_open or "[]")
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 10)
        assert approval_messages(fake_slack, "D0ALICE") == []
        shown = fake_slack.message("D0ALICE", msg.ts).shown
        assert "Allowed by <@U0ALICE>" in shown and "restarted" not in shown  # how it ended, not the restart
        await no_records_left(t)
    finally:
        await t.close()
    assert tool.calls == [{"query": "apples"}]


async def test_a_restart_whose_close_fails_keeps_the_record_and_closes_it_later(
        tmp_path, fake_openai, fake_slack, monkeypatch):
    monkeypatch.setattr(open_approvals, "RETRY", (0.3,), raising=False)
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=0.5)
    try:
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: approval_messages(fake_slack, "D0ALICE"))
        [msg] = approval_messages(fake_slack, "D0ALICE")
        buttons = msg.blocks
        left_open = None
        for _ in range(250):  # the record is written once Slack answered the post
            left_open = await t.channel.host.get_state(OPEN_STATE)
            if left_open and msg.ts in left_open:
                break
            await asyncio.sleep(0.02)
        assert left_open and msg.ts in left_open
    finally:
        hold.set()
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", platform=t.h.platform, start=False,
                            call_timeout=0.5)
    try:
        msg.blocks = buttons  # as a crash leaves it
        await t.channel.host.set_state(OPEN_STATE, left_open)
        failing = fake_slack.fail("chat.update", status=500, when=is_approval_update, times=1000)
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 10)
        assert approval_messages(fake_slack, "D0ALICE") == [msg]  # the close failed: buttons still shown
        failing.times = 0
        # the record was kept, and its close is tried again: the buttons go
        await t.wait_for(lambda: not approval_messages(fake_slack, "D0ALICE"), timeout=5)
        assert "the bridge restarted" in fake_slack.message("D0ALICE", msg.ts).shown
        await no_records_left(t)  # forgotten once closed
    finally:
        await t.close()
    assert tool.calls == []


@pytest.mark.parametrize("error", ["message_not_found", "channel_not_found"])
async def test_a_close_slack_can_never_carry_out_is_not_kept(tmp_path, fake_openai, fake_slack, error):
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", start=False, call_timeout=0.5)
    try:
        record = {"channel": "D0ALICE", "thread_ts": None, "ts": "1700000000.000100", "tool": "lookup",
                  "arguments": "", "value": "{}", "at": 0.0}
        await t.channel.host.set_state(OPEN_STATE, json.dumps([record]))
        fake_slack.fail("chat.update", error, when=is_approval_update, times=1000)
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 10)
        await no_records_left(t)
    finally:
        await t.close()
