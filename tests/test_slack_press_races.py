"""Slack presses and thread replies that race what they depend on, end to end (the real SlackChannel, slack-bolt
and slack_sdk against the fake Slack, a real ChatCore):

- a press that lands just after an approval timed out, while the reply's sink is still marking the request,
  leaves the message to the sink, which shows how it ended ("nobody decided in time"), not a bare "no longer
  pending";
- ``allow_from`` ids and usernames are matched each against its own kind when deciding an approval: a user
  whose username reads like an allowed id (``u0bob``) is not taken for Bob;
- a reply in a thread whose opening @mention is still being taken (its sender's ``users.info`` is slow) waits
  for the mention and is answered after it, instead of being dropped as a reply in a thread the bot never
  joined."""

from __future__ import annotations

import asyncio

import pytest

from channels.slack import sink as slack_sink
from channels.slack.channel import GONE, NOT_YOURS
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import SlackHarness, slack_harness

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_S1"])
MODES = pytest.mark.parametrize("mode", ["socket", "http"])


def approval_messages(slack: FakeSlack, channel: str) -> list:
    """The bot's messages that show live approval buttons."""
    return [m for m in slack.messages(channel) if any(b.get("type") == "actions" for b in m.blocks)]


PRESS_TASKS = ("slack:press", "slack:gone", "slack:not-yours", "slack:approval-")
"""The supervised tasks a press runs (its decision, its answer, the message's update)."""


async def no_task_named(t: SlackHarness, *prefixes: str) -> None:
    """Every supervised task whose name starts with one of ``prefixes`` is over."""
    await t.wait_for(lambda: not any(task.get_name().startswith(prefixes) for task in asyncio.all_tasks()),
                     timeout=10)


def said_to_model(fake_openai) -> list[str]:
    return [m["content"] for r in fake_openai.requests for m in r["messages"] if m["role"] == "user"]


async def test_a_press_just_after_the_timeout_shows_that_nobody_decided_in_time(
        tmp_path, fake_openai, fake_slack, monkeypatch):
    entered, release = asyncio.Event(), asyncio.Event()
    ended = slack_sink.SlackPrompts.ended

    async def late_ended(self, handle, line):  # the sink marks the timed-out request a moment late
        entered.set()
        await release.wait()
        await ended(self, handle, line)

    monkeypatch.setattr(slack_sink.SlackPrompts, "ended", late_ended)
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("I could not look it up."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket",
                            core={"tools": registry(tool), "approval_timeout": 0.5})
    try:
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: approval_messages(fake_slack, "D0ALICE"))
        [msg] = approval_messages(fake_slack, "D0ALICE")
        await asyncio.wait_for(entered.wait(), 5)  # timed out: the sink is about to mark it
        assert (await t.press(fake_slack.press(msg, "Allow"))).acked
        await t.wait_for(lambda: fake_slack.ephemerals)
        await no_task_named(t, *PRESS_TASKS)  # everything the press does is done
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0ALICE", GONE)]
        release.set()
        await t.settle()
        await no_task_named(t, *PRESS_TASKS, "approval-ended")
        shown = fake_slack.message("D0ALICE", msg.ts).shown
        assert "⌛ Denied: nobody decided in time." in shown
        assert "No longer pending" not in shown
        assert approval_messages(fake_slack, "D0ALICE") == []
        assert tool.calls == []
    finally:
        release.set()
        await t.close()


async def test_a_username_spelled_like_an_allowed_id_cannot_allow_a_call(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    fake_slack.add_user("U0EVE", "u0bob", "Eve")  # Eve's username reads like Bob's user id
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            allow_from=("U0ALICE", "U0BOB"))
    try:
        mention, _ = fake_slack.mention("how many apples do I have?")
        await t.deliver(mention)
        await t.wait_for(lambda: approval_messages(fake_slack, "C0GENERAL"))
        [msg] = approval_messages(fake_slack, "C0GENERAL")

        assert (await t.press(fake_slack.press(msg, "Allow", user="U0EVE"))).acked
        await t.wait_for(lambda: fake_slack.ephemerals)
        await no_task_named(t, *PRESS_TASKS)
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0EVE", NOT_YOURS)]
        assert tool.calls == []
        assert approval_messages(fake_slack, "C0GENERAL") == [msg]  # still pending, buttons still there

        assert (await t.press(fake_slack.press(msg, "Allow", user="U0BOB"))).acked  # Bob, by his id
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert "Allowed by <@U0BOB>" in fake_slack.message("C0GENERAL", msg.ts).shown
    finally:
        await t.close()


async def test_an_allowed_username_still_decides(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            allow_from=("U0ALICE", "@Bob"))
    try:
        mention, _ = fake_slack.mention("how many apples do I have?")
        await t.deliver(mention)
        await t.wait_for(lambda: approval_messages(fake_slack, "C0GENERAL"))
        [msg] = approval_messages(fake_slack, "C0GENERAL")
        assert (await t.press(fake_slack.press(msg, "Allow", user="U0BOB"))).acked  # Bob, by his username
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert fake_slack.ephemerals == []
    finally:
        await t.close()


class ThreadReads:
    """Signals when the channel first reads whether a thread was joined (a reply asking whether it is addressed)."""

    def __init__(self, t: SlackHarness) -> None:
        self.read = asyncio.Event()
        host = t.channel.host
        get_state = host.get_state

        async def reading(name: str) -> str | None:
            value = await get_state(name)
            if name.startswith("thread:"):
                self.read.set()
            return value

        host.get_state = reading  # type: ignore[method-assign]


@MODES
async def test_a_thread_reply_while_its_mention_is_still_being_taken_is_answered(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("Paris."), Text("About two million people."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        reads = ThreadReads(t)
        gate = fake_slack.hold("users.info")  # Slack answers who Alice is slowly
        mention, _ = fake_slack.mention("capital of France?")
        root = mention["event"]["ts"]
        first = asyncio.create_task(t.deliver(mention))
        await t.wait_for(lambda: fake_slack.count("users.info") == 1)  # the mention waits for users.info
        follow = fake_slack.user_message("and how many live there?", channel="C0GENERAL", thread_ts=root)
        second = asyncio.create_task(t.deliver(follow))
        await asyncio.wait_for(reads.read.wait(), 5)  # the reply found the thread not (yet) joined
        gate.set()
        assert (await first).acked and (await second).acked
        await t.settle()
        said = said_to_model(fake_openai)
        assert said[0].startswith("capital of France?")  # the mention first, then the reply
        assert any("how many live there" in s for s in said[1:])
        assert fake_slack.visible("C0GENERAL", thread_ts=root)[-1] == "About two million people."
    finally:
        await t.close()


async def test_a_thread_reply_waits_for_a_refused_mention_and_is_not_answered(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text("unused"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", allow_from=("@bob",))
    try:
        reads = ThreadReads(t)
        gate = fake_slack.hold("users.info")
        mention, _ = fake_slack.mention("capital of France?")  # Alice is not on allow_from
        root = mention["event"]["ts"]
        first = asyncio.create_task(t.deliver(mention))
        await t.wait_for(lambda: fake_slack.count("users.info") == 1)
        follow = fake_slack.user_message("and how many live there?", channel="C0GENERAL", thread_ts=root,
                                         user="U0BOB")
        second = asyncio.create_task(t.deliver(follow))
        await asyncio.wait_for(reads.read.wait(), 5)
        gate.set()
        assert (await first).acked and (await second).acked
        await t.settle()
        assert fake_openai.requests == []  # the thread was never joined: Bob's reply is not addressed to the bot
        assert fake_slack.visible("C0GENERAL", thread_ts=root) == []
    finally:
        await t.close()


async def test_a_press_on_a_request_no_sink_will_mark_takes_its_buttons_away(tmp_path, fake_openai, fake_slack):
    # the request is posted, but its answer never comes back, nor can the conversation be read to find it: the
    # sink never learns it was shown, so nothing but a press can say it ended
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("I could not look it up."))
    fake_slack.fail("chat.postMessage", apply_first=True, drop=True, times=1000,
                    when=lambda p: "Approval needed" in str(p.get("text")))
    fake_slack.fail("conversations.history", status=500, times=1000)
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", call_timeout=0.5,
                            core={"tools": registry(tool), "approval_timeout": 0.5})
    try:
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.settle()  # the request timed out unanswered; the turn is over
        assert fake_slack.visible("D0ALICE")[-1] == "I could not look it up."
        msg = approval_messages(fake_slack, "D0ALICE")[0]
        assert (await t.press(fake_slack.press(msg, "Allow"))).acked
        await t.wait_for(lambda: fake_slack.ephemerals)
        await no_task_named(t, *PRESS_TASKS)
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0ALICE", GONE)]
        assert "No longer pending" in fake_slack.message("D0ALICE", msg.ts).shown  # its buttons are gone
        assert tool.calls == []
    finally:
        await t.close()
