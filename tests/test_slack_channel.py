"""The Slack channel end to end: the real chain (SQLite, the OpenAI SDK against the fake LLM) and the real
SlackChannel (slack-bolt, slack_sdk) against the fake Slack, in Socket Mode and in HTTP mode. Each test
asserts what the Slack conversation shows and what the model was sent."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.openai_server import Text
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import slack_harness

ANSWER = "The capital of France is **Paris**, a city on the Seine."
MODES = pytest.mark.parametrize("mode", ["socket", "http"])


@pytest.fixture
async def slack():
    async with FakeSlack() as fake:
        yield fake


@MODES
async def test_a_dm_is_answered_once_with_the_formatted_answer(tmp_path, fake_openai, slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    try:
        d = await t.deliver(slack.user_message("capital of France?"))
        assert d.acked
        await t.settle()
        [msg] = slack.messages("D0ALICE")
        assert msg.thread_ts is None  # a DM's top-level message is answered at the top level
        assert msg.shown == ANSWER  # the markdown block: Slack renders the Markdown itself
        assert msg.text == "The capital of France is *Paris*, a city on the Seine."  # mrkdwn fallback
        assert slack.count("chat.postMessage") == 1
        assert not any(m.reactions for m in slack.channels["D0ALICE"].values())  # thinking reaction removed
        assert slack.count("reactions.add") == 1
    finally:
        await t.close()
