"""A reply cut off before its end takes its thinking indicator down: the real SlackChannel (slack_sdk,
slack-bolt) against the fake Slack, the real core. The user's message shows the ⏳ reaction; the reply's first
message is held by Slack while the bridge shuts down with a short bound, so the shutdown aborts the sink
instead of waiting for its end. No ⏳ stays on the message.

Before the fix only the end of a reply (``SlackSink.finish``) took the indicator down, not an abort."""

from __future__ import annotations

import asyncio

from tests.fakes.openai_server import Text
from tests.fakes.slack.harness import slack_harness

DM = "D0ALICE"
THINKING = {"hourglass_flowing_sand": ["U0BOT"]}


async def test_a_reply_cut_off_by_the_shutdown_leaves_no_thinking_reaction(tmp_path, fake_openai, fake_slack):
    answer = asyncio.Event()
    fake_openai.script(Text("The first words of a long answer", hold=answer, hold_after=15))
    posted = fake_slack.hold("chat.postMessage")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core={"shutdown_timeout": 1.0})
    try:
        asked = fake_slack.user_message("tell me a story")
        await t.deliver(asked)
        # thinking, and the reply's first message on its way (Slack holds it)
        await t.wait_for(lambda: fake_slack.message(DM, asked["event"]["ts"]).reactions == THINKING
                         and fake_slack.count("chat.postMessage") == 1)
        await t.close()  # the shutdown's bound runs out while the reply is being written: its sink is aborted
        assert not fake_slack.message(DM, asked["event"]["ts"]).reactions
    finally:
        answer.set()
        posted.set()
        await t.close()
