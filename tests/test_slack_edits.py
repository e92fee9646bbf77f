"""Slack edits are not answered, however old the message: editing a message that mentions the bot sends, beside
``message_changed``, a new ``app_mention`` with the original ts and an ``edited`` field, which the
``(channel, ts)`` dedupe catches only for ``dedupe_ttl_hours``. The real channel (slack-bolt, slack_sdk) against
the fake Slack, the store's clock moved past the dedupe TTL."""

from __future__ import annotations

from typing import Any

import pytest

from channels.slack.inbound import BotIdentity, normalize
from core.sqlite_store import SqliteStore
from tests.fakes.openai_server import Text
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import slack_harness
from tests.support.store import FakeClock

DAY = 24 * 3600.0


def edited(slack: FakeSlack, body: dict[str, Any], text: str) -> dict[str, Any]:
    """The event Slack sends again for an edited message: the original ts, the new text, an ``edited`` field
    and a new event_id (for ``app_mention``; a ``message`` edit comes as ``message_changed``)."""
    event = body["event"]
    slack.channels[event["channel"]][event["ts"]].text = text
    return slack.event_callback({**event, "text": text, "edited": {"user": event["user"], "ts": slack.next_ts()}})


@pytest.mark.parametrize("mode", ["socket", "http"])
async def test_an_answered_mention_edited_after_the_dedupe_ttl_is_not_answered_again(tmp_path, fake_openai,
                                                                                    fake_slack, mode):
    fake_openai.script(Text("Paris."), Text("a second answer"))
    clock = FakeClock()
    store = SqliteStore(tmp_path / "chat.db", clock=clock)
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"store": store})
    try:
        as_mention, as_message = fake_slack.mention("capital of France?")
        ts = as_mention["event"]["ts"]
        for body in (as_mention, as_message):
            assert (await t.deliver(body)).acked
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=ts) == ["Paris."]
        clock.now += 3 * DAY  # the mention's dedupe mark (48 h) has run out
        fixed = f"<@{fake_slack.bot_user_id}> capital of France, please?"
        assert (await t.deliver(edited(fake_slack, as_mention, fixed))).acked
        assert (await t.deliver(fake_slack.edit_event("C0GENERAL", ts, fixed))).acked
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=ts) == ["Paris."]
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


def test_an_event_carrying_edited_is_ignored() -> None:
    slack = FakeSlack()  # only its payload builders
    bot = BotIdentity(user_id=slack.bot_user_id, bot_id=slack.bot_id, team_id=slack.team_id)
    as_mention, as_message = slack.mention("capital of France?")
    dm = slack.user_message("hello")
    for body in (as_mention, as_message, dm):
        n = normalize(edited(slack, body, body["event"]["text"] + " (typo fixed)"), bot)
        assert (n.kind, n.ignore) == (None, "edited")
        assert normalize(body, bot).ignore is None  # the original is still answered
