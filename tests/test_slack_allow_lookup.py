"""``allow_from`` naming people by username, when Slack does not say who someone is. The real SlackChannel
(slack-bolt, slack_sdk) against the fake Slack, in Socket Mode and in HTTP mode, with the real chain behind it.

A username is matched through ``users.info``. One failed lookup (a 503, a 429, no answer in time) made the
allowed user's message count as "not allowed": the event was acknowledged, so Slack never sent it again, and
nobody was told. A lookup that failed now means "unknown": the event is left unacknowledged and Slack's
redelivery is answered; a slash command (which Slack never sends again) is answered "please try again". Only a
definite mismatch drops a message."""

from __future__ import annotations

from typing import Any

import pytest

from channels.slack.sdk_log import NAME as BOLT_LOG
from tests.fakes.openai_server import Text
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import Delivery, SlackHarness, slack_harness

MODES = pytest.mark.parametrize("mode", ["socket", "http"])
FAILURES = pytest.mark.parametrize("failure", ["503", "429", "no answer"])


def said(request: dict[str, Any]) -> str:
    """What the user wrote, as the model was sent it (without the runtime context core appends)."""
    return str(request["messages"][-1]["content"]).split("\n\n[Runtime context]")[0]


def fail_users_info_once(slack: FakeSlack, failure: str) -> None:
    if failure == "503":
        slack.fail("users.info", status=503, error="service_unavailable")
    elif failure == "429":
        slack.fail("users.info", status=429, error="ratelimited", retry_after=1)
    else:
        slack.fail("users.info", hang=2.0)  # past the channel's call timeout (0.5 s here), inside Slack's 3 s


async def not_acknowledged(t: SlackHarness, slack: FakeSlack, body: dict[str, Any],
                           caplog: pytest.LogCaptureFixture) -> Delivery:
    """Deliver ``body`` while who its sender is cannot be learned, and check it is left for Slack to send again.
    HTTP: the answer is an error. Socket Mode: once the channel is done with the envelope (it was acknowledged,
    or its listener failed, which slack-bolt logs), it was not acknowledged."""
    if t.mode == "http":
        first = await t.deliver(body)
        assert first.sent is not None and first.sent.status >= 500  # Slack retries it
        return first
    envelope = await slack.socket.deliver(body)

    def listener_failed() -> bool:
        return any(r.name == BOLT_LOG and "Failed to run listener" in r.getMessage() for r in caplog.records)

    await t.wait_for(lambda: slack.socket.acked(envelope) or listener_failed())
    assert not slack.socket.acked(envelope)
    return Delivery(False, envelope=envelope)


async def redeliver(t: SlackHarness, slack: FakeSlack, first: Delivery, body: dict[str, Any]) -> None:
    """Slack sends the unacknowledged event again: it is taken, and (Socket Mode) acknowledged once in all."""
    if t.mode == "http":
        again = await t.deliver(body, retry_num=1)
        assert again.acked
        return
    assert first.envelope is not None
    await slack.socket.redeliver(first.envelope)
    await slack.socket.wait_acked(first.envelope)
    await t.settle()
    assert len(slack.socket.acks[first.envelope.envelope_id]) == 1  # the redelivery's: the first was left


@MODES
@FAILURES
async def test_an_allowed_users_message_is_answered_after_slack_could_not_say_who_they_are(
        tmp_path, fake_openai, fake_slack, mode, failure, caplog):
    fake_openai.script(Text("hello alice"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",), call_timeout=0.5)
    try:
        fail_users_info_once(fake_slack, failure)
        body = fake_slack.user_message("first question")
        first = await not_acknowledged(t, fake_slack, body, caplog)
        assert fake_openai.requests == [] and fake_slack.visible("D0ALICE") == []
        await redeliver(t, fake_slack, first, body)
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["hello alice"]  # answered, once
        assert [said(r) for r in fake_openai.requests] == ["first question"]
        assert fake_slack.ephemerals == []
        # the log says why in one warning, without a traceback that would read as a crash
        assert not any(r.exc_info for r in caplog.records if r.name == BOLT_LOG)
    finally:
        await t.close()


@MODES
async def test_a_mention_in_a_channel_is_answered_after_slack_could_not_say_who_the_sender_is(
        tmp_path, fake_openai, fake_slack, mode, caplog):
    fake_openai.script(Text("hello channel"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        fail_users_info_once(fake_slack, "503")
        mention, _ = fake_slack.mention("a question for the bot")
        root = mention["event"]["ts"]
        first = await not_acknowledged(t, fake_slack, mention, caplog)
        await redeliver(t, fake_slack, first, mention)
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=root) == ["hello channel"]
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


@MODES
async def test_a_channel_message_not_for_the_bot_asks_slack_nothing_and_is_acknowledged(
        tmp_path, fake_openai, fake_slack, mode):
    # nothing to answer: who wrote it does not matter, so a failing users.info cannot hold it up
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        fake_slack.fail("users.info", status=503, error="service_unavailable", times=10)
        assert (await t.deliver(fake_slack.user_message("chatting among ourselves", channel="C0GENERAL"))).acked
        await t.settle()
        assert fake_slack.count("users.info") == 0 and fake_openai.requests == []
    finally:
        await t.close()


@MODES
async def test_a_user_slack_does_not_know_and_a_user_not_named_are_dropped_and_acknowledged(
        tmp_path, fake_openai, fake_slack, mode):
    # a definite answer: not allowed, so acknowledged (Slack need not send it again) and not answered
    fake_slack.add_channel("D0GHOST", "im")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        assert (await t.deliver(fake_slack.user_message("hello from bob", channel="D0BOB", user="U0BOB"))).acked
        assert (await t.deliver(fake_slack.user_message("boo", channel="D0GHOST", user="U0GHOST"))).acked
        await t.settle()
        assert fake_openai.requests == []
        assert fake_slack.visible("D0BOB") == [] and fake_slack.visible("D0GHOST") == []
    finally:
        await t.close()


@MODES
async def test_a_member_who_took_an_allowed_username_as_display_name_is_not_let_in(
        tmp_path, fake_openai, fake_slack, mode):
    # any member may call themselves "alice"; only the username (unique, not theirs to choose) names a person
    fake_slack.add_user("U0MALLORY", "mallory", "Mallory Example", display_name="alice")
    fake_slack.add_channel("D0MALLORY", "im")
    fake_openai.script(Text("hello alice"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        assert (await t.deliver(fake_slack.user_message("let me in", channel="D0MALLORY", user="U0MALLORY"))).acked
        assert (await t.deliver(fake_slack.user_message("hi", channel="D0ALICE", user="U0ALICE"))).acked
        await t.settle()
        assert [said(r) for r in fake_openai.requests] == ["hi"]
        assert fake_slack.visible("D0MALLORY") == [] and fake_slack.visible("D0ALICE") == ["hello alice"]
    finally:
        await t.close()


@MODES
async def test_a_slash_command_when_slack_could_not_say_who_sent_it_tells_the_user_to_try_again(
        tmp_path, fake_openai, fake_slack, mode):
    # Slack never sends a slash command again: acknowledged silently as "not allowed", it was lost without a word
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",))
    try:
        fail_users_info_once(fake_slack, "503")
        first = await t.deliver(fake_slack.slash_command("/help"), kind="slash_commands")
        assert first.acked
        if mode == "socket":
            assert first.envelope is not None
            [ack] = fake_slack.socket.acks[first.envelope.envelope_id]
            answer = (ack.payload or {}).get("text", "")
        else:
            assert first.sent is not None
            answer = first.sent.text
        assert "/help could not be taken just now; please try again." in answer
        await t.settle()
        assert fake_slack.visible("D0ALICE") == []
        again = await t.deliver(fake_slack.slash_command("/help"), kind="slash_commands")
        assert again.acked
        await t.settle()
        [shown] = fake_slack.visible("D0ALICE")
        assert "/stop" in shown  # the command list
    finally:
        await t.close()
