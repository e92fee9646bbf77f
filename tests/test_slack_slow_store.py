"""Slack, a store slower than Slack's 3 s: the event handler stops waiting for it (and does not acknowledge),
the message is stored all the same, and it is answered once — Slack's redelivery finds it a duplicate."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.openai_server import Text
from tests.fakes.slack.harness import slack_harness
from tests.support.store import SlowAnswerStore


@pytest.mark.parametrize("mode", ["socket", "http"])
async def test_a_message_stored_after_the_handler_gave_up_is_answered_once(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("answered"))
    store = SlowAnswerStore(tmp_path / "chat.db")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"store": store}, submit_timeout=0.2)
    try:
        body = fake_slack.user_message("please answer me")
        store.gate = asyncio.Event()
        first = await t.deliver(body, ack_timeout=1.0)
        assert store.held == 1
        assert not first.acked  # the handler stopped waiting: Slack will send the event again
        store.gate.set()
        store.gate = None
        await t.wait_for(lambda: fake_slack.visible("D0ALICE") == ["answered"])
        again = await t.redeliver(first, body)
        assert again.acked  # a duplicate now
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["answered"]
        assert len(fake_openai.requests) == 1
        assert await store.waiting_inbound() == []
    finally:
        await t.close()
