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


def said(message: dict) -> str:
    """What the user wrote, as the model was sent it (without the runtime context core appends)."""
    return str(message["content"]).split("\n\n[Runtime context]")[0]


def replies_in(slack: FakeSlack, channel: str, thread_ts=...) -> list[str]:
    return slack.visible(channel, thread_ts=thread_ts)


# ---- dedupe ----------------------------------------------------------------------------------------------


@MODES
async def test_a_redelivered_event_gets_one_reply_also_after_a_restart(tmp_path, fake_openai, slack, mode):
    """HTTP: a retry with X-Slack-Retry-Num: 1 and the same event_id; Socket Mode: the same envelope again."""
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    body = slack.user_message("capital of France?")
    try:
        first = await t.deliver(body)
        again = await t.redeliver(first, body)
        assert first.acked and again.acked
        await t.settle()
        assert replies_in(slack, "D0ALICE") == [ANSWER]
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()
    platform = t.h.platform
    t = await slack_harness(tmp_path, fake_openai, slack, mode, platform=platform)  # same database
    try:
        again = await t.redeliver(first, body)
        assert again.acked
        await t.settle()
        assert replies_in(slack, "D0ALICE") == [ANSWER]
        assert len(fake_openai.requests) == 1  # the model was not asked again
    finally:
        await t.close()


@MODES
async def test_a_channel_mention_delivered_twice_is_answered_once_in_its_thread(tmp_path, fake_openai, slack, mode):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    try:
        as_mention, as_message = slack.mention("capital of France?")
        assert as_mention["event_id"] != as_message["event_id"]
        ts = as_mention["event"]["ts"]
        assert (await t.deliver(as_mention)).acked
        assert (await t.deliver(as_message)).acked
        await t.settle()
        assert replies_in(slack, "C0GENERAL", ts) == [ANSWER]  # in a thread rooted at the mention
        assert replies_in(slack, "C0GENERAL", None) == []
        assert len(fake_openai.requests) == 1
        assert said(fake_openai.requests[0]["messages"][-1]) == "capital of France?"  # mention stripped
    finally:
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, slack, mode, platform=t.h.platform)
    try:  # the second event arriving only after a restart is still recognised
        assert (await t.deliver(as_message)).acked
        await t.settle()
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


# ---- HTTP mode: signatures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["bad", "missing", "old"])
async def test_an_unsigned_or_stale_request_is_refused_and_reaches_no_model(tmp_path, fake_openai, slack, fault):
    import time as _time

    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, "http")
    try:
        assert t.sender is not None
        body = slack.user_message("capital of France?")
        if fault == "old":
            sent = await t.sender.event(body, timestamp=int(_time.time()) - 6 * 60)
        else:
            sent = await t.sender.event(body, signature=fault)
        assert sent.status == 401
        await t.settle()
        assert fake_openai.requests == []
        assert replies_in(slack, "D0ALICE") == []
        ok = await t.sender.event(body)  # the same request, signed now: accepted
        assert ok.status == 200
        await t.settle()
        assert replies_in(slack, "D0ALICE") == [ANSWER]
    finally:
        await t.close()


async def test_url_verification_is_answered(tmp_path, fake_openai, slack):
    t = await slack_harness(tmp_path, fake_openai, slack, "http")
    try:
        assert t.sender is not None
        sent = await t.sender.url_verification("c-123")
        assert sent.status == 200 and sent.json()["challenge"] == "c-123"
    finally:
        await t.close()


# ---- what reaches core ----------------------------------------------------------------------------------


@MODES
async def test_a_thread_follow_up_without_mention_continues_the_thread_and_its_session(
        tmp_path, fake_openai, slack, mode):
    fake_openai.script(Text("Paris."), Text("About two million people."))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    try:
        as_mention, _ = slack.mention("capital of France?")
        root = as_mention["event"]["ts"]
        await t.deliver(as_mention)
        await t.settle()
        follow = slack.user_message("and how many live there?", channel="C0GENERAL", thread_ts=root)
        assert (await t.deliver(follow)).acked
        await t.settle()
        assert replies_in(slack, "C0GENERAL", root) == ["Paris.", "About two million people."]
        second = fake_openai.requests[1]["messages"]
        assert [said(m) for m in second if m["role"] != "system"] == [
            "capital of France?", "Paris.", "and how many live there?"]  # the same session
    finally:
        await t.close()


@MODES
async def test_channel_messages_without_mention_bots_and_edits_are_ignored(tmp_path, fake_openai, slack, mode):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    try:
        plain = slack.user_message("just chatting", channel="C0GENERAL")
        thread = slack.user_message("in someone else's thread", channel="C0GENERAL",
                                    thread_ts=plain["event"]["ts"])
        edit = slack.edit_event("C0GENERAL", plain["event"]["ts"], "edited")
        slack.add_user("U0OTHERBOT", "otherbot", "Other Bot", is_bot=True, bot_id="B0OTHER")
        other_bot = slack.event_callback({"type": "message", "channel": "D0ALICE", "channel_type": "im",
                                          "user": "U0OTHERBOT", "bot_id": "B0OTHER", "text": "beep",
                                          "ts": slack.next_ts()})
        for body in (plain, thread, edit, other_bot):
            assert (await t.deliver(body)).acked  # acknowledged, so Slack does not deliver them again
        await t.settle()
        assert fake_openai.requests == []
        assert slack.count("chat.postMessage") == 0
    finally:
        await t.close()


async def test_group_policy_all_answers_channel_messages_and_off_ignores_mentions(tmp_path, fake_openai, slack):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, "socket", group_policy="all")
    try:
        body = slack.user_message("capital of France?", channel="C0GENERAL")
        await t.deliver(body)
        await t.settle()
        assert replies_in(slack, "C0GENERAL", body["event"]["ts"]) == [ANSWER]
    finally:
        await t.close()
    t = await slack_harness(tmp_path / "off", fake_openai, slack, "socket", group_policy="off")
    try:
        mention, _ = slack.mention("capital of France?")
        await t.deliver(mention)
        await t.settle()
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


async def test_allow_from_by_username_lets_alice_in_and_keeps_bob_out(tmp_path, fake_openai, slack):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, slack, "socket", allow_from=("@alice",))
    try:
        await t.deliver(slack.user_message("hello from bob", channel="D0BOB", user="U0BOB"))
        await t.deliver(slack.user_message("capital of France?"))
        await t.settle()
        assert len(fake_openai.requests) == 1
        assert said(fake_openai.requests[0]["messages"][-1]) == "capital of France?"
        assert replies_in(slack, "D0BOB") == []
    finally:
        await t.close()


# ---- commands ------------------------------------------------------------------------------------------


@MODES
async def test_commands_as_message_text_in_a_dm_and_as_a_mention_in_a_thread(tmp_path, fake_openai, slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text("Counting " + "one two three " * 50, hold=hold, hold_after=30))
    t = await slack_harness(tmp_path, fake_openai, slack, mode)
    try:
        await t.deliver(slack.user_message("help"))
        await t.settle()
        assert "/stop" in replies_in(slack, "D0ALICE")[-1]  # the command list
        mention, _ = slack.mention("count to a thousand")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.wait_for(lambda: replies_in(slack, "C0GENERAL", root))
        stop, _ = slack.mention("stop", thread_ts=root)
        assert (await t.deliver(stop)).acked
        await t.settle()
        assert len(fake_openai.requests) == 1  # "stop" was not sent to the model
        assert replies_in(slack, "C0GENERAL", root) == ["Counting one two three one two\n\n⏹ Stopped."]
    finally:
        hold.set()
        await t.close()
