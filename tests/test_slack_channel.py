"""The Slack channel end to end: the real chain (SQLite, the OpenAI SDK against the fake LLM) and the real
SlackChannel (slack-bolt, slack_sdk) against the fake Slack, in Socket Mode and in HTTP mode. Each test
asserts what the Slack conversation shows and what the model was sent."""

from __future__ import annotations

import asyncio
import re

import pytest

from channels.common.open_approvals import OPEN_APPROVALS as OPEN_STATE
from channels.common.splitter import open_fence
from channels.slack.channel import GONE, NOT_YOURS
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import HttpError, Text, ToolCalls
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import slack_harness
from tests.fakes.slack.server import Message
from tests.support.clock import ManualClock
from tests.test_metrics import value
from tests.test_telegram_ingress import GatedAdmissions

ANSWER = "The capital of France is **Paris**, a city on the Seine."
MODES = pytest.mark.parametrize("mode", ["socket", "http"])


@MODES
async def test_a_dm_is_answered_once_with_the_formatted_answer(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        d = await t.deliver(fake_slack.user_message("capital of France?"))
        assert d.acked
        await t.settle()
        [msg] = fake_slack.messages("D0ALICE")
        assert msg.thread_ts is None  # a DM's top-level message is answered at the top level
        assert msg.shown == ANSWER  # the markdown block: Slack renders the Markdown itself
        assert msg.text == "The capital of France is *Paris*, a city on the Seine."  # mrkdwn fallback
        assert fake_slack.count("chat.postMessage") == 1
        assert not any(m.reactions for m in fake_slack.channels["D0ALICE"].values())  # thinking reaction removed
        assert fake_slack.count("reactions.add") == 1
    finally:
        await t.close()


@MODES
async def test_a_message_after_the_start_is_answered_when_slack_refuses_auth_test(tmp_path, fake_openai, fake_slack,
                                                                                  mode):
    # the channel asked auth.test once before receiving; bolt's own authorization asked again for the first
    # event, and a refusal there acknowledged the event with an error text and dropped it: no answer, ever
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("auth.test", status=429, error="ratelimited", retry_after=30)
        assert (await t.deliver(fake_slack.user_message("capital of France?"))).acked
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("auth.test") == 1  # the channel's own, before it received anything
    finally:
        await t.close()


@MODES
async def test_a_burst_of_messages_after_the_start_asks_slack_who_the_bot_is_once(tmp_path, fake_openai, fake_slack,
                                                                                  mode):
    chats = [f"D0U{i}" for i in range(10)]
    for i, chat in enumerate(chats):
        fake_slack.add_user(f"U0U{i}", f"user{i}", f"User {i}")
        fake_slack.add_channel(chat, "im")
    fake_openai.script(*(Text(ANSWER) for _ in chats))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await asyncio.gather(*(t.deliver(fake_slack.user_message("go", channel=chat, user=f"U0U{i}"))
                               for i, chat in enumerate(chats)))
        await t.settle()
        assert all(fake_slack.visible(chat) == [ANSWER] for chat in chats)
        assert fake_slack.count("auth.test") == 1  # was one more for every event that came before bolt's answer
    finally:
        await t.close()


async def test_an_event_before_the_bot_knows_who_it_is_is_left_for_slack_to_send_again(tmp_path, fake_openai,
                                                                                        fake_slack):
    fake_openai.script(Text(ANSWER))
    answer = fake_slack.hold("auth.test")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "http", start=False)
    try:
        await t.channel.start()
        await t.wait_for(lambda: fake_slack.count("auth.test") == 1)
        body = fake_slack.user_message("capital of France?")
        assert not (await t.deliver(body)).acked  # 500: Slack sends it again
        answer.set()
        await asyncio.wait_for(t.channel.ready.wait(), 5)
        assert (await t.deliver(body, retry_num=1)).acked
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("auth.test") == 1
    finally:
        answer.set()
        await t.close()


async def test_the_model_is_asked_while_the_thinking_reaction_is_still_on_its_way(tmp_path, fake_openai, fake_slack):
    # the reaction's call runs beside the turn instead of in front of it; the answer waits for it to land, and
    # the reaction is taken down after the answer, never before it is up
    release = fake_slack.hold("reactions.add")
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"sink_open_timeout": 60.0})
    try:
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.wait_for(lambda: t.h.commits())  # the whole answer was written while the reaction call hung
        assert len(fake_openai.requests) == 1 and fake_slack.count("reactions.add") == 1
        assert fake_slack.messages("D0ALICE") == []
        release.set()
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        methods = [c.method for c in fake_slack.calls if c.method in ("reactions.add", "chat.postMessage",
                                                                       "reactions.remove")]
        assert methods == ["reactions.add", "chat.postMessage", "reactions.remove"]
        assert not any(m.reactions for m in fake_slack.channels["D0ALICE"].values())
    finally:
        await t.close()


async def test_an_answer_without_a_word_shows_its_notice_once(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text(""))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        await t.deliver(fake_slack.user_message("say nothing"))
        await t.settle()
        [msg] = fake_slack.messages("D0ALICE")
        assert msg.shown.startswith("⚠️ The model finished without writing an answer.")
        assert not any(m.reactions for m in fake_slack.channels["D0ALICE"].values())  # thinking reaction removed
    finally:
        await t.close()


def said(message: dict) -> str:
    """What the user wrote, as the model was sent it (without the runtime context core appends)."""
    return str(message["content"]).split("\n\n[Runtime context]")[0]


def replies_in(slack: FakeSlack, channel: str, thread_ts=...) -> list[str]:
    return slack.visible(channel, thread_ts=thread_ts)


# ---- dedupe ----------------------------------------------------------------------------------------------


@MODES
async def test_a_redelivered_event_gets_one_reply_also_after_a_restart(tmp_path, fake_openai, fake_slack, mode):
    """HTTP: a retry with X-Slack-Retry-Num: 1 and the same event_id; Socket Mode: the same envelope again."""
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    body = fake_slack.user_message("capital of France?")
    try:
        first = await t.deliver(body)
        again = await t.redeliver(first, body)
        assert first.acked and again.acked
        await t.settle()
        assert replies_in(fake_slack, "D0ALICE") == [ANSWER]
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()
    platform = t.h.platform
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, platform=platform)  # same database
    try:
        again = await t.redeliver(first, body)
        assert again.acked
        await t.settle()
        assert replies_in(fake_slack, "D0ALICE") == [ANSWER]
        assert len(fake_openai.requests) == 1  # the model was not asked again
    finally:
        await t.close()


@MODES
async def test_a_channel_mention_delivered_twice_is_answered_once_in_its_thread(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        as_mention, as_message = fake_slack.mention("capital of France?")
        assert as_mention["event_id"] != as_message["event_id"]
        ts = as_mention["event"]["ts"]
        assert (await t.deliver(as_mention)).acked
        assert (await t.deliver(as_message)).acked
        await t.settle()
        assert replies_in(fake_slack, "C0GENERAL", ts) == [ANSWER]  # in a thread rooted at the mention
        assert replies_in(fake_slack, "C0GENERAL", None) == []
        assert len(fake_openai.requests) == 1
        assert said(fake_openai.requests[0]["messages"][-1]) == "capital of France?"  # mention stripped
    finally:
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, platform=t.h.platform)
    try:  # the second event arriving only after a restart is still recognised
        assert (await t.deliver(as_message)).acked
        await t.settle()
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


# ---- HTTP mode: signatures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["bad", "missing", "old"])
async def test_an_unsigned_or_stale_request_is_refused_and_reaches_no_model(tmp_path, fake_openai, fake_slack, fault):
    import time as _time

    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "http")
    try:
        assert t.sender is not None
        body = fake_slack.user_message("capital of France?")
        if fault == "old":
            sent = await t.sender.event(body, timestamp=int(_time.time()) - 6 * 60)
        else:
            sent = await t.sender.event(body, signature=fault)
        assert sent.status == 401
        await t.settle()
        assert fake_openai.requests == []
        assert replies_in(fake_slack, "D0ALICE") == []
        ok = await t.sender.event(body)  # the same request, signed now: accepted
        assert ok.status == 200
        await t.settle()
        assert replies_in(fake_slack, "D0ALICE") == [ANSWER]
    finally:
        await t.close()


async def test_url_verification_is_answered(tmp_path, fake_openai, fake_slack):
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "http")
    try:
        assert t.sender is not None
        sent = await t.sender.url_verification("c-123")
        assert sent.status == 200 and sent.json()["challenge"] == "c-123"
    finally:
        await t.close()


# ---- what reaches core ----------------------------------------------------------------------------------


@MODES
async def test_a_thread_follow_up_without_mention_continues_the_thread_and_its_session(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("Paris."), Text("About two million people."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        as_mention, _ = fake_slack.mention("capital of France?")
        root = as_mention["event"]["ts"]
        await t.deliver(as_mention)
        await t.settle()
        follow = fake_slack.user_message("and how many live there?", channel="C0GENERAL", thread_ts=root)
        assert (await t.deliver(follow)).acked
        await t.settle()
        assert replies_in(fake_slack, "C0GENERAL", root) == ["Paris.", "About two million people."]
        second = fake_openai.requests[1]["messages"]
        assert [said(m) for m in second if m["role"] != "system"] == [
            "capital of France?", "Paris.", "and how many live there?"]  # the same session
    finally:
        await t.close()


@MODES
async def test_channel_messages_without_mention_bots_and_edits_are_ignored(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        plain = fake_slack.user_message("just chatting", channel="C0GENERAL")
        thread = fake_slack.user_message("in someone else's thread", channel="C0GENERAL",
                                    thread_ts=plain["event"]["ts"])
        edit = fake_slack.edit_event("C0GENERAL", plain["event"]["ts"], "edited")
        fake_slack.add_user("U0OTHERBOT", "otherbot", "Other Bot", is_bot=True, bot_id="B0OTHER")
        other_bot = fake_slack.event_callback({"type": "message", "channel": "D0ALICE", "channel_type": "im",
                                          "user": "U0OTHERBOT", "bot_id": "B0OTHER", "text": "beep",
                                          "ts": fake_slack.next_ts()})
        own = fake_slack.bot_echo(Message("D0ALICE", fake_slack.next_ts(), "my own words", user=fake_slack.bot_user_id,
                                     bot_id=fake_slack.bot_id))
        for body in (plain, thread, edit, other_bot, own):
            assert (await t.deliver(body)).acked  # acknowledged, so Slack does not deliver them again
        await t.settle()
        assert fake_openai.requests == []
        assert fake_slack.count("chat.postMessage") == 0
    finally:
        await t.close()


async def test_group_policy_all_answers_channel_messages_and_off_ignores_mentions(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", group_policy="all")
    try:
        body = fake_slack.user_message("capital of France?", channel="C0GENERAL")
        await t.deliver(body)
        await t.settle()
        assert replies_in(fake_slack, "C0GENERAL", body["event"]["ts"]) == [ANSWER]
    finally:
        await t.close()
    t = await slack_harness(tmp_path / "off", fake_openai, fake_slack, "socket", group_policy="off")
    try:
        mention, _ = fake_slack.mention("capital of France?")
        await t.deliver(mention)
        await t.settle()
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()


async def test_allow_from_by_username_lets_alice_in_and_keeps_bob_out(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", allow_from=("@alice",))
    try:
        await t.deliver(fake_slack.user_message("hello from bob", channel="D0BOB", user="U0BOB"))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert len(fake_openai.requests) == 1
        assert said(fake_openai.requests[0]["messages"][-1]) == "capital of France?"
        assert replies_in(fake_slack, "D0BOB") == []
    finally:
        await t.close()


# ---- commands ------------------------------------------------------------------------------------------


@MODES
async def test_commands_as_message_text_in_a_dm_and_as_a_mention_in_a_thread(tmp_path, fake_openai, fake_slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text("Counting " + "one two three " * 50, hold=hold, hold_after=30))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await t.deliver(fake_slack.user_message("help"))
        await t.settle()
        assert "/stop" in replies_in(fake_slack, "D0ALICE")[-1]  # the command list
        mention, _ = fake_slack.mention("count to a thousand")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.wait_for(lambda: replies_in(fake_slack, "C0GENERAL", root))
        stop, _ = fake_slack.mention("stop", thread_ts=root)
        assert (await t.deliver(stop)).acked
        await t.settle()
        assert len(fake_openai.requests) == 1  # "stop" was not sent to the model
        assert replies_in(fake_slack, "C0GENERAL", root) == ["Counting one two three one two\n\n⏹ Stopped."]
    finally:
        hold.set()
        await t.close()


# ---- approvals -----------------------------------------------------------------------------------------

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_S1"])


def approval_messages(slack: FakeSlack, channel: str) -> list:
    return [m for m in slack.messages(channel) if any(b.get("type") == "actions" for b in m.blocks)]


@MODES
async def test_the_requester_allows_a_stranger_is_refused_and_a_late_press_is_no_longer_pending(
        tmp_path, fake_openai, fake_slack, mode):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"tools": registry(tool)})
    try:
        mention, _ = fake_slack.mention("how many apples do I have?")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.wait_for(lambda: approval_messages(fake_slack, "C0GENERAL"))
        [msg] = approval_messages(fake_slack, "C0GENERAL")
        assert msg.thread_ts == root
        assert "lookup" in msg.shown and "apples" in msg.shown and "<@U0ALICE>" in msg.shown

        assert (await t.press(fake_slack.press(msg, "Allow", user="U0BOB"))).acked  # not Bob's call
        await t.wait_for(lambda: fake_slack.ephemerals)
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0BOB", NOT_YOURS)]
        assert tool.calls == []
        assert approval_messages(fake_slack, "C0GENERAL") == [msg]  # still pending, buttons still there

        press = fake_slack.press(msg, "Allow", user="U0ALICE")
        late = fake_slack.press(msg, "Deny", user="U0ALICE")  # pressed later, on a screen not yet refreshed
        assert (await t.press(press)).acked
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert approval_messages(fake_slack, "C0GENERAL") == []  # the decision replaced the buttons
        assert "Allowed by <@U0ALICE>" in fake_slack.message("C0GENERAL", msg.ts).shown
        assert replies_in(fake_slack, "C0GENERAL", root)[-1] == "You have 42 apples."

        assert (await t.press(late)).acked
        await t.wait_for(lambda: len(fake_slack.ephemerals) == 2)
        assert fake_slack.ephemerals[-1].text == GONE
        assert tool.calls == [{"query": "apples"}]
        redelivered = await t.press(press)  # the first press delivered again: ignored
        assert redelivered.acked
        await t.settle()
        assert len(fake_slack.ephemerals) == 2
    finally:
        await t.close()


async def test_an_approval_that_times_out_shows_how_it_ended(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("I could not look it up."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket",
                            core={"tools": registry(tool), "approval_timeout": 0.3})
    try:
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: approval_messages(fake_slack, "D0ALICE"))
        [msg] = approval_messages(fake_slack, "D0ALICE")
        await t.settle()
        assert approval_messages(fake_slack, "D0ALICE") == []
        assert "nobody decided in time" in fake_slack.message("D0ALICE", msg.ts).shown
        assert tool.calls == []
    finally:
        await t.close()


# ---- long replies, native streaming, rate limits -----------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def words(text: str) -> list[str]:
    """The words of a reply, fence lines left out (a split closes and reopens code blocks)."""
    return [w for line in text.splitlines() if not _FENCE.match(line) for w in line.split()]


def long_answer(size: int = 20_000) -> str:
    parts, n = [], 0
    while sum(len(p) for p in parts) < size:
        n += 1
        parts.append(f"Paragraph {n}: " + " ".join(f"word{n}_{i}" for i in range(40)))
        if n % 3 == 0:
            parts.append("```python\n" + "\n".join(f"x_{n}_{i} = {i} * 2  # line {i}" for i in range(30)) + "\n```")
    return "\n\n".join(parts)


@MODES
async def test_a_20000_character_reply_with_code_arrives_complete(tmp_path, fake_openai, fake_slack, mode):
    answer = long_answer()
    assert len(answer) >= 20_000
    fake_openai.script(Text(answer, chunk_size=400, delay=0.005))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await t.deliver(fake_slack.user_message("write a lot"))
        await t.settle(20)
        shown = fake_slack.visible("D0ALICE")
        assert len(shown) >= 6
        assert words("\n".join(shown)) == words(answer)  # nothing lost, nothing twice
        for message in fake_slack.messages("D0ALICE"):
            assert open_fence(message.shown) is None  # every code block closed in its own message
            assert len(message.text) <= 4000
    finally:
        await t.close()


@MODES
async def test_a_native_stream_in_a_thread_rolls_over_and_ends_formatted(tmp_path, fake_openai, fake_slack, mode):
    answer = long_answer(9_000)
    fake_openai.script(Text(answer, chunk_size=150, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, stream_transport="auto")
    try:
        mention, _ = fake_slack.mention("write a lot")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.settle(20)
        assert fake_slack.count("chat.startStream") >= 2  # the stream moved on to a new message at the limit
        assert fake_slack.count("chat.appendStream") >= 2
        messages = fake_slack.messages("C0GENERAL", thread_ts=root)
        assert not any(m.streaming for m in messages)
        assert words("\n".join(m.shown for m in messages)) == words(answer)
        assert all(m.blocks and m.blocks[0]["type"] == "markdown" for m in messages)  # the final rendering
        start = fake_slack.calls_to("chat.startStream")[0].params
        assert (start["recipient_user_id"], start["recipient_team_id"]) == ("U0ALICE", "T0TEAM")
    finally:
        await t.close()


@MODES
async def test_a_native_stream_that_expires_mid_reply_ends_with_the_whole_answer_once(
        tmp_path, fake_openai, mode):
    answer = "Here is a slow answer. " + " ".join(f"step{i}." for i in range(120))
    async with FakeSlack(stream_max_age=0.4) as fake_slack:  # Slack closes streams after a while
        fake_openai.script(Text(answer, chunk_size=12, delay=0.02))
        t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, stream_transport="auto")
        try:
            mention, _ = fake_slack.mention("go slowly")
            root = mention["event"]["ts"]
            await t.deliver(mention)
            await t.settle(20)
            failed = [c for c in fake_slack.calls if c.error == "message_not_in_streaming_state"]
            assert failed  # the stream did expire mid-reply
            assert fake_slack.visible("C0GENERAL", thread_ts=root) == [answer]
        finally:
            await t.close()


@MODES
async def test_a_dm_streams_natively_in_a_thread_when_asked_to(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, stream_transport="native")
    try:
        body = fake_slack.user_message("capital of France?")
        await t.deliver(body)
        await t.settle()
        assert fake_slack.count("chat.startStream") == 1
        assert fake_slack.visible("D0ALICE", thread_ts=body["event"]["ts"]) == [ANSWER]
        assert fake_slack.visible("D0ALICE", thread_ts=None) == []
    finally:
        await t.close()


async def test_a_workspace_that_refuses_streaming_gets_updates_instead(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01), Text("Second answer."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", stream_transport="auto")
    try:
        fake_slack.fail("chat.startStream", error="missing_scope", times=5)
        mention, _ = fake_slack.mention("capital of France?")
        await t.deliver(mention)
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=mention["event"]["ts"]) == [ANSWER]
        second, _ = fake_slack.mention("again")
        await t.deliver(second)
        await t.settle()
        assert fake_slack.count("chat.startStream") == 1  # not tried again
        assert fake_slack.visible("C0GENERAL", thread_ts=second["event"]["ts"]) == ["Second answer."]
    finally:
        await t.close()


@MODES
async def test_a_429_on_the_final_update_pauses_the_channel_for_retry_after_and_shows_the_answer_once(
        tmp_path, fake_openai, mode):
    clock = ManualClock()  # the throttle's clock: a 30 s pause passes without waiting 30 s; same code path
    async with FakeSlack(clock=clock.now) as fake_slack:
        fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
        t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, clock=clock)
        try:
            fake_slack.fail("chat.update", status=429, retry_after=30, when=lambda p: bool(p.get("blocks")))
            await t.deliver(fake_slack.user_message("capital of France?"))
            await t.settle()
            limited = next(c for c in fake_slack.calls if c.status == 429)
            later = fake_slack.calls[fake_slack.calls.index(limited) + 1:]
            to_channel = [c for c in later if c.channel == "D0ALICE"]
            assert to_channel and all(c.at >= limited.at + 30 for c in to_channel)
            assert fake_slack.visible("D0ALICE") == [ANSWER]
            metrics = t.core.metrics.render().decode()  # every Web API attempt is counted for /metrics
            assert value(metrics, "chatbridge_platform_calls_total", channel="slack", result="rate_limited") == 1
        finally:
            await t.close()


# ---- DESIGN.md §2 / seed §15: what the chat shows when delivery fails ---------------------------------------

MRKDWN = "The capital of France is *Paris*, a city on the Seine."


def final_updates(slack: FakeSlack) -> list:
    return [c for c in slack.calls_to("chat.update") if c.params.get("blocks")]


@MODES
async def test_a_refused_thinking_reaction_leaves_one_reply_without_live_updates(tmp_path, fake_openai, fake_slack,
                                                                                 mode):
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("reactions.add", error="not_in_channel")
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("chat.postMessage") == 1 and fake_slack.count("chat.update") == 0
    finally:
        await t.close()


@MODES
async def test_a_deleted_preview_is_replaced_by_exactly_one_fallback(tmp_path, fake_openai, fake_slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.wait_for(lambda: fake_slack.messages("D0ALICE"))
        fake_slack.messages("D0ALICE")[0].deleted = True  # the user deletes the preview
        hold.set()
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("chat.postMessage") == 2
    finally:
        await t.close()


@MODES
async def test_a_final_update_failing_permanently_leaves_the_answer_once(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("chat.update", error="cant_update_message", when=lambda p: bool(p.get("blocks")))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]  # the stale preview deleted, one fallback
        assert len(final_updates(fake_slack)) == 1  # permanent: not retried
        assert fake_slack.count("chat.delete") == 1 and fake_slack.count("chat.postMessage") == 2
    finally:
        await t.close()


@MODES
async def test_transient_final_failures_then_success_send_no_fallback(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("chat.update", status=503, body="<html>Service Unavailable</html>", times=2,
                   when=lambda p: bool(p.get("blocks")))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert [c.status for c in final_updates(fake_slack)] == [503, 503, 200]
        assert fake_slack.count("chat.postMessage") == 1
    finally:
        await t.close()


@MODES
async def test_a_final_update_that_keeps_failing_is_tried_three_times_then_replaced_by_one_fallback(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("chat.update", error="internal_error", times=100, when=lambda p: bool(p.get("blocks")))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert len(final_updates(fake_slack)) == 3  # one retry policy: three tries in all
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("chat.delete") == 1 and fake_slack.count("chat.postMessage") == 2
    finally:
        await t.close()


@MODES
async def test_a_final_update_whose_answer_was_lost_is_repeated_harmlessly(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:  # Slack did the update, then the answer was lost: the repeat shows the same state, no fallback
        fake_slack.fail("chat.update", status=503, body="<html>oops</html>", apply_first=True,
                   when=lambda p: bool(p.get("blocks")))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert [c.status for c in final_updates(fake_slack)] == [503, 200]
        assert fake_slack.count("chat.postMessage") == 1
    finally:
        await t.close()


@MODES
async def test_a_refused_markdown_block_is_shown_as_mrkdwn_text_once(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("chat.update", error="invalid_blocks", times=10, when=lambda p: bool(p.get("blocks")))
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        [msg] = fake_slack.messages("D0ALICE")
        assert (msg.text, msg.blocks) == (MRKDWN, [])
        assert fake_slack.count("chat.postMessage") == 1
    finally:
        await t.close()


@MODES
async def test_a_failed_turn_shows_its_notice_once(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(HttpError.auth())
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await t.deliver(fake_slack.user_message("hi"))
        await t.settle()
        [shown] = fake_slack.visible("D0ALICE")
        assert "rejected the bridge's credentials" in shown
        assert fake_slack.count("chat.postMessage") == 1
    finally:
        await t.close()


# ---- Socket Mode connection ----------------------------------------------------------------------------


async def test_socket_mode_reconnects_on_refresh_and_on_a_drop_and_keeps_answering(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text("One."), Text("Two."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        assert t.channel.state() == "connected"
        await fake_slack.socket.disconnect("refresh_requested")
        await fake_slack.socket.wait_connected(2)
        assert (await t.deliver(fake_slack.user_message("first"))).acked
        await t.settle()
        await fake_slack.socket.drop()
        await fake_slack.socket.wait_connected(3)
        assert (await t.deliver(fake_slack.user_message("second"))).acked
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["One.", "Two."]
        await t.wait_for(lambda: t.channel.state() == "connected")
        assert fake_slack.socket.issued == 3  # a fresh apps.connections.open for each connection
    finally:
        await t.close()


# ---- slash commands, thinking, the workspace budget --------------------------------------------------------


@MODES
async def test_slash_commands_work_in_a_dm_and_explain_the_mention_in_a_channel(
        tmp_path, fake_openai, fake_slack, mode):
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        assert (await t.deliver(fake_slack.slash_command("/help"), kind="slash_commands")).acked
        await t.settle()
        [shown] = fake_slack.visible("D0ALICE")
        assert "/stop" in shown and "/compact" in shown
        in_channel = fake_slack.slash_command("/stop", channel="C0GENERAL")
        assert (await t.deliver(in_channel, kind="slash_commands")).acked
        await t.wait_for(lambda: fake_slack.responses)
        assert "mention me" in fake_slack.responses[0]["text"]
        assert fake_openai.requests == []
    finally:
        await t.close()


async def test_thinking_shows_as_a_thread_status_or_a_reaction_and_is_cleared(tmp_path, fake_openai, fake_slack):
    hold = asyncio.Event()
    fake_openai.script(Text("Paris.", hold=hold, hold_after=0), Text("Yes."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        mention, _ = fake_slack.mention("capital of France?")
        await t.deliver(mention)
        await t.wait_for(lambda: fake_slack.statuses)
        assert fake_slack.statuses[0]["status"] == "is thinking…"
        hold.set()
        await t.settle()
        assert fake_slack.statuses[-1]["status"] == ""  # cleared at the end
        fake_slack.fail("assistant.threads.setStatus", error="not_allowed", times=10)  # not an AI-app thread
        again, _ = fake_slack.mention("sure?", thread_ts=mention["event"]["ts"])
        await t.deliver(again)
        await t.settle()
        assert fake_slack.count("reactions.add") == 1 and fake_slack.count("reactions.remove") == 1
        assert not fake_slack.message("C0GENERAL", again["event"]["ts"]).reactions
    finally:
        hold.set()
        await t.close()


async def test_a_quick_answer_shows_no_thinking_reaction_and_a_slow_one_shows_it_until_done(
        tmp_path, fake_openai, fake_slack):
    hold = asyncio.Event()
    # a generous delay, so the quick answer is shown sooner even on a loaded host
    fake_openai.script(Text(ANSWER), Text(ANSWER, hold=hold, hold_after=0))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", thinking_delay=2.0)
    try:
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("reactions.add") == 0  # shown at once: a reaction would come and go for nothing
        asked = fake_slack.user_message("and again?")
        await t.deliver(asked)
        await t.wait_for(lambda: fake_slack.count("reactions.add") == 1)  # nothing to show two seconds in
        assert fake_slack.message("D0ALICE", asked["event"]["ts"]).reactions == {"hourglass_flowing_sand": ["U0BOT"]}
        hold.set()
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER, ANSWER]
        assert not fake_slack.message("D0ALICE", asked["event"]["ts"]).reactions  # taken down when done
    finally:
        hold.set()
        await t.close()


async def test_a_rate_limited_thinking_reaction_holds_up_no_reply(tmp_path, fake_openai, fake_slack):
    # reactions.add has a limit of its own (Tier 3, per workspace): its 429 pauses that method, not the
    # workspace's message writes, or every conversation's reply would freeze for the reaction's Retry-After
    fake_slack.rate_limit("reactions.add", per="workspace", limit=1, window=600.0, retry_after=60)
    fake_openai.script(Text(ANSWER), Text(ANSWER), Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        await t.deliver(fake_slack.user_message("one"))
        await t.settle()
        await t.deliver(fake_slack.user_message("two", channel="D0BOB", user="U0BOB"))
        await t.wait_for(lambda: fake_slack.visible("D0BOB") == [ANSWER])  # not a minute later
        assert [c.status for c in fake_slack.calls_to("reactions.add")] == [200, 429]
        await t.settle()
        await t.deliver(fake_slack.user_message("three"))
        await t.wait_for(lambda: fake_slack.visible("D0ALICE") == [ANSWER, ANSWER])
        await t.settle()
        assert fake_slack.count("reactions.add") == 2  # paused: the third turn did not try
        assert not any(m.reactions for ch in ("D0ALICE", "D0BOB") for m in fake_slack.channels[ch].values())
    finally:
        await t.close()


async def test_thinking_indicators_stay_within_the_workspaces_budget(tmp_path, fake_openai, fake_slack):
    # each indicator is two calls of a tiered method; when several conversations wait at once only as many
    # show one as the workspace's budget has room for, and every answer still shows
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=0), Text(ANSWER, hold=hold, hold_after=0))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", thinking_delay=0.05,
                            thinking_interval=600.0)
    try:
        await asyncio.gather(t.deliver(fake_slack.user_message("one")),
                             t.deliver(fake_slack.user_message("two", channel="D0BOB", user="U0BOB")))
        await t.wait_for(lambda: len(fake_openai.requests) == 2 and fake_slack.count("reactions.add") >= 1)
        await asyncio.sleep(0.3)  # both well past their delay
        assert fake_slack.count("reactions.add") == 1
        hold.set()
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER] and fake_slack.visible("D0BOB") == [ANSWER]
        assert fake_slack.count("reactions.remove") == 1
        assert not any(m.reactions for ch in ("D0ALICE", "D0BOB") for m in fake_slack.channels[ch].values())
    finally:
        hold.set()
        await t.close()


async def test_replies_in_two_channels_share_the_workspace_update_budget(tmp_path, fake_openai, fake_slack):
    # chat.update is limited per workspace (Tier 3), not per conversation: two replies streaming at once in two
    # DMs must together stay under it. Here the fake refuses two updates within 0.2 s anywhere in the
    # workspace, and the channel runs with one update per 0.4 s for the workspace (0.1 s per conversation).
    fake_slack.rate_limit("chat.update", per="workspace", limit=1, window=0.2)
    text = " ".join(f"word{i}" for i in range(300))
    fake_openai.script(Text(text, chunk_size=15, delay=0.02), Text(text, chunk_size=15, delay=0.02))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", workspace_interval=0.4)
    try:
        await asyncio.gather(t.deliver(fake_slack.user_message("one")),
                             t.deliver(fake_slack.user_message("two", channel="D0BOB", user="U0BOB")))
        await t.settle(20)
        updates = fake_slack.calls_to("chat.update")
        assert {c.channel for c in updates} == {"D0ALICE", "D0BOB"}  # both streamed by updates
        assert [c for c in updates if c.status != 200] == []  # paced under the workspace limit: never refused
        assert fake_slack.visible("D0ALICE") == [text] and fake_slack.visible("D0BOB") == [text]
    finally:
        await t.close()


async def test_updates_that_reach_slack_late_and_together_stay_within_the_workspaces_limit(
        tmp_path, fake_openai, fake_slack):
    # the workspace paces updates at Slack's limit itself, by when they leave; Slack counts them as they arrive.
    # Here Slack takes no update in until the test lets them all in together (as a busy bridge or network bunches
    # them): the updates as Slack counts them stay within its limit, so no 429 pauses every conversation
    fake_slack.rate_limit("chat.update", per="workspace", limit=3, window=1.0)
    chats = ["D0ALICE", "D0BOB", "D0U2", "D0U3", "D0U4"]
    for i, chat in enumerate(chats[2:], 2):
        fake_slack.add_user(f"U0U{i}", f"user{i}", f"User {i}")
        fake_slack.add_channel(chat, "im")
    text = " ".join(f"word{i}" for i in range(300))
    fake_openai.script(*(Text(text, chunk_size=15, delay=0.02) for _ in chats))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", workspace_interval=1 / 3,
                            workspace_updates=(3, 1.0))
    held = fake_slack.hold("chat.update")
    try:
        users = ["U0ALICE", "U0BOB", "U0U2", "U0U3", "U0U4"]
        await asyncio.gather(*(t.deliver(fake_slack.user_message("go", channel=c, user=u))
                               for c, u in zip(chats, users, strict=True)))
        await t.wait_for(lambda: fake_slack.count("chat.update") >= 3)
        await asyncio.sleep(0.7)  # at the workspace's pace, more would have left meanwhile
        held.set()
        await t.settle(30)
        updates = fake_slack.calls_to("chat.update")
        assert [c for c in updates if c.status != 200] == []
        assert all(fake_slack.visible(c) == [text] for c in chats)
    finally:
        held.set()
        await t.close()


async def test_the_end_of_a_reply_shows_at_once_not_at_the_conversations_next_slot(tmp_path, fake_openai, fake_slack):
    # live updates keep the conversation's pace (one call per 30 s here); the end takes one call ahead of it,
    # so the whole answer shows as soon as it is written, not an interval later
    rest = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=rest, hold_after=28))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", chat_interval=30.0,
                            core={"request_timeout": 30.0})
    try:
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.wait_for(lambda: fake_slack.count("chat.postMessage") == 1)  # the first message shows the beginning
        rest.set()
        await t.wait_for(lambda: [m.shown for m in fake_slack.messages("D0ALICE")] == [ANSWER], timeout=10)
        assert [c.method for c in fake_slack.calls if c.method in ("chat.postMessage", "chat.update")] == \
            ["chat.postMessage", "chat.update"]
    finally:
        await t.close()


# ---- acknowledged only once stored -------------------------------------------------------------------------


@MODES
async def test_an_event_core_could_not_store_is_not_acknowledged_and_its_redelivery_is_answered_once(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("kept"))
    store = GatedAdmissions(tmp_path / "chat.db")
    store.failures = 1
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"store": store})
    try:
        body = fake_slack.user_message("please keep me")
        first = await t.deliver(body, ack_timeout=1.0)
        assert not first.acked  # Slack will deliver it again
        if first.sent is not None:
            assert first.sent.status >= 500
        assert fake_openai.requests == []
        again = await t.redeliver(first, body)
        assert again.acked
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["kept"] and len(fake_openai.requests) == 1
    finally:
        await t.close()


@MODES
async def test_a_slash_command_that_could_not_be_taken_tells_the_user_to_try_again(tmp_path, fake_openai, fake_slack,
                                                                                   mode):
    # Slack never sends a slash command again. Acknowledged before it was taken, a command whose taking failed
    # (here: who the user is could not be learned in time, users.info hanging) was lost without a word; now the
    # acknowledgement itself says it was not taken, and the next try works
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, allow_from=("@alice",), submit_timeout=0.5)
    answer = fake_slack.hold("users.info")
    try:
        first = await t.deliver(fake_slack.slash_command("/help"), kind="slash_commands")
        assert first.acked
        if mode == "socket":
            [ack] = fake_slack.socket.acks[first.envelope.envelope_id]
            said = (ack.payload or {}).get("text", "")
        else:
            said = first.sent.text
        assert "/help could not be taken just now; please try again." in said
        await t.settle()
        assert fake_slack.visible("D0ALICE") == []
        answer.set()
        again = await t.deliver(fake_slack.slash_command("/help"), kind="slash_commands")
        assert again.acked
        await t.settle()
        [shown] = fake_slack.visible("D0ALICE")
        assert "/stop" in shown
    finally:
        answer.set()
        await t.close()


@MODES
async def test_an_event_is_acknowledged_only_after_its_message_is_stored(tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("stored first"))
    store = GatedAdmissions(tmp_path / "chat.db")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"store": store})
    try:
        store.gate.clear()
        delivery = asyncio.create_task(t.deliver(fake_slack.user_message("hi")))
        await asyncio.sleep(0.3)
        assert not delivery.done()
        if mode == "socket":
            assert not any(fake_slack.socket.acks.values())  # no ack while the message is not stored
        store.gate.set()
        assert (await delivery).acked
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["stored first"]
    finally:
        await t.close()


async def test_a_press_after_a_restart_is_no_longer_pending_and_the_buttons_go(tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)})
    try:
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: approval_messages(fake_slack, "D0ALICE"))
        [msg] = approval_messages(fake_slack, "D0ALICE")
        press = fake_slack.press(msg, "Allow")
        buttons = msg.blocks
    finally:
        hold.set()
        await t.close()
    msg.blocks = buttons  # as if the process had died before it could mark the request
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "http", platform=t.h.platform)
    try:
        assert (await t.press(press)).acked
        await t.wait_for(lambda: fake_slack.ephemerals)
        assert fake_slack.ephemerals[-1].text == GONE
        await t.wait_for(lambda: not approval_messages(fake_slack, "D0ALICE"))
        assert "No longer pending" in fake_slack.message("D0ALICE", msg.ts).shown
        assert tool.calls == []
    finally:
        await t.close()


@MODES
async def test_the_tokens_never_reach_the_log(tmp_path, fake_openai, fake_slack, mode, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    fake_openai.script(Text(ANSWER))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        fake_slack.fail("chat.update", error="invalid_auth", times=10)
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
    finally:
        await t.close()
    for secret in (fake_slack.bot_token, fake_slack.app_token, fake_slack.signing_secret):
        assert secret not in caplog.text


@MODES
async def test_a_native_stream_rewound_by_a_retried_model_answer_shows_only_the_new_answer(
        tmp_path, fake_openai, fake_slack, mode):
    first = "A first attempt that the model will never finish, streamed for a while. " * 3
    answer = "The second attempt, complete and correct. " * 4
    never = asyncio.Event()  # the first attempt stalls mid-answer: core's request timeout retries it
    fake_openai.script(Text(first, chunk_size=20, delay=0.005, hold=never, hold_after=len(first) - 20),
                       Text(answer.strip(), chunk_size=10, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, stream_transport="auto",
                            core={"request_timeout": 1.0})  # the silence that ends the first attempt
    try:
        mention, _ = fake_slack.mention("answer me")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.settle()
        [start] = fake_slack.calls_to("chat.startStream")
        assert start.params["markdown_text"].startswith("A first attempt")  # it was on screen
        assert fake_slack.count("chat.stopStream") == 1  # a stream cannot take text back: ended, then updated
        [streamed] = [m for m in fake_slack.channels["C0GENERAL"].values() if m.stream]  # deleted or not
        appended = "".join(c.params["markdown_text"] for c in fake_slack.calls_to("chat.appendStream")
                           if c.params["ts"] == streamed.ts)
        assert "second attempt" not in appended  # never shown after the first attempt's words
        assert fake_slack.visible("C0GENERAL", thread_ts=root) == [answer.strip()]
    finally:
        await t.close()


@MODES
async def test_a_streamed_message_the_user_deleted_is_replaced_by_one_fallback(tmp_path, fake_openai, fake_slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, stream_transport="auto")
    try:
        mention, _ = fake_slack.mention("capital of France?")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        await t.wait_for(lambda: fake_slack.messages("C0GENERAL", thread_ts=root))
        fake_slack.messages("C0GENERAL", thread_ts=root)[0].deleted = True
        hold.set()
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=root) == [ANSWER]
    finally:
        await t.close()


@MODES
async def test_a_shared_file_is_downloaded_with_the_bot_token_and_read_by_the_model(
        tmp_path, fake_openai, fake_slack, mode):
    fake_openai.script(Text("It says 42."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        notes = fake_slack.add_file("F0NOTES", "notes.txt", "text/plain", b"The secret number is 42.\n")
        await t.deliver(fake_slack.user_message("what does it say?", files=[notes], subtype="file_share"))
        await t.settle()
        sent = str(fake_openai.requests[0]["messages"][-1]["content"])
        assert "what does it say?" in sent and "The secret number is 42." in sent
        assert fake_slack.downloads == [("F0NOTES", f"Bearer {fake_slack.bot_token}")]
        assert fake_slack.visible("D0ALICE") == ["It says 42."]
    finally:
        await t.close()


async def test_a_file_slack_does_not_hand_over_is_named_to_the_model_with_the_reason(tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text("I cannot open it."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        files = [{"id": "F0GONE", "name": "report.pdf", "mimetype": "application/pdf", "size": 2048}]
        await t.deliver(fake_slack.user_message("see this", files=files, subtype="file_share"))
        await t.settle()
        sent = said(fake_openai.requests[0]["messages"][-1])
        assert sent.startswith("see this") and "report.pdf" in sent and "could not be downloaded" in sent
        assert fake_slack.visible("D0ALICE")[-1] == "I cannot open it."
    finally:
        await t.close()


@MODES
async def test_a_slow_reply_in_one_dm_does_not_hold_up_another_dm_or_its_own_stop(
        tmp_path, fake_openai, fake_slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text("A long story that takes its time", hold=hold, hold_after=20), Text("Hi Bob."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        await t.deliver(fake_slack.user_message("tell me a story"))
        await t.wait_for(lambda: fake_slack.messages("D0ALICE"))
        await t.deliver(fake_slack.user_message("hello", channel="D0BOB", user="U0BOB"))
        await t.wait_for(lambda: fake_slack.visible("D0BOB") == ["Hi Bob."])
        await t.deliver(fake_slack.user_message("stop"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == ["A long story that ta\n\n⏹ Stopped."]
        [history] = [h for h in [await t.core.history(k.key) for k in await t.core.list_sessions()]
                     if any(m.content == "hello" for m in h[1])]
        assert history[1][0].source.from_user_id == "U0BOB"  # the sender is kept with the message
    finally:
        hold.set()
        await t.close()


async def test_shutdown_during_a_reply_leaves_one_terminal_message(tmp_path, fake_openai, fake_slack):
    hold = asyncio.Event()
    fake_openai.script(Text("Partial answer that goes on and on", hold=hold, hold_after=30))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        await t.deliver(fake_slack.user_message("tell me a story"))
        await t.wait_for(lambda: fake_slack.messages("D0ALICE"))
    finally:
        await t.close()
        hold.set()
    [shown] = fake_slack.visible("D0ALICE")
    assert shown.startswith("Partial answer that goes on an")
    assert fake_slack.count("chat.postMessage") == 1


@MODES
async def test_approval_buttons_left_by_a_crash_say_the_restart_denied_them(tmp_path, fake_openai, fake_slack, mode):
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"tools": registry(tool)})
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
        assert left_open and msg.ts in left_open  # remembered durably while it is open
    finally:
        hold.set()
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, platform=t.h.platform, start=False)
    try:
        # a crash leaves both the buttons and the record (a clean stop usually closes them): the next start
        # closes them
        msg.blocks = buttons
        await t.channel.host.set_state(OPEN_STATE, left_open)
        await t.channel.start()
        await t.wait_for(lambda: not approval_messages(fake_slack, "D0ALICE"))
        shown = fake_slack.message("D0ALICE", msg.ts).shown
        assert "the bridge restarted" in shown and "lookup" in shown
        await asyncio.wait_for(t.channel.ready.wait(), 10)  # the record is rewritten after the last update
        assert await t.channel.host.get_state(OPEN_STATE) == "[]"
    finally:
        await t.close()


def _asks(call: dict) -> bool:
    """The post of an approval request (a message with buttons)."""
    return "chatbridge.approval" in str(call.get("blocks") or "")


@pytest.mark.parametrize("where", ["dm", "thread"])
async def test_approval_buttons_posted_as_the_bridge_died_are_found_and_closed_at_the_next_start(
        tmp_path, fake_openai, fake_slack, where):
    # Slack shows the request but the bridge dies before its answer (the message's ts) arrives: the record saved
    # before the post is all the next start has. It finds the message by what its buttons carry.
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=60.0)
    channel = "D0ALICE" if where == "dm" else "C0GENERAL"
    try:
        posting = fake_slack.fail("chat.postMessage", when=_asks, apply_first=True, hang=60.0)
        if where == "dm":
            await t.deliver(fake_slack.user_message("how many apples do I have?"))
        else:
            await t.deliver(fake_slack.mention("how many apples do I have?")[0])
        await t.wait_for(lambda: approval_messages(fake_slack, channel) and posting.times == 0)
        [msg] = approval_messages(fake_slack, channel)
        buttons = msg.blocks
        left_open = None
        for _ in range(250):
            left_open = await t.channel.host.get_state(OPEN_STATE)
            if left_open and '"lookup"' in left_open:
                break
            await asyncio.sleep(0.02)
        assert left_open and '"lookup"' in left_open and msg.ts not in left_open  # recorded, its ts unknown
    finally:
        hold.set()
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", platform=t.h.platform, start=False)
    try:
        msg.blocks = buttons  # as the crash left it
        await t.channel.host.set_state(OPEN_STATE, left_open)
        await t.channel.start()
        await t.wait_for(lambda: not approval_messages(fake_slack, channel))
        shown = fake_slack.message(channel, msg.ts).shown
        assert "the bridge restarted" in shown and "lookup" in shown
        await asyncio.wait_for(t.channel.ready.wait(), 10)
        assert await t.channel.host.get_state(OPEN_STATE) == "[]"
    finally:
        await t.close()
    assert tool.calls == []


async def test_a_request_never_shown_before_the_bridge_died_is_dropped_at_the_next_start(
        tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=60.0)
    try:
        posting = fake_slack.fail("chat.postMessage", when=_asks, hang=60.0)  # never carried out
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: posting.times == 0)
        left_open = await t.channel.host.get_state(OPEN_STATE)
        assert left_open and '"lookup"' in left_open
    finally:
        hold.set()
        await t.close()
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", platform=t.h.platform, start=False)
    try:
        await t.channel.host.set_state(OPEN_STATE, left_open)
        updates = fake_slack.count("chat.update")
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 10)
        await t.wait_for(lambda: fake_slack.count("conversations.history") == 1)
        assert await t.channel.host.get_state(OPEN_STATE) == "[]"
        assert fake_slack.count("chat.update") == updates and approval_messages(fake_slack, "D0ALICE") == []
    finally:
        await t.close()


async def test_a_request_whose_answer_was_lost_is_found_and_closed_when_the_reply_ends(
        tmp_path, fake_openai, fake_slack):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)},
                            call_timeout=0.5)
    try:
        # Slack shows it, the answer comes too late: the post is not repeated (no idempotency key), it is found
        fake_slack.fail("chat.postMessage", when=_asks, apply_first=True, hang=3.0)
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: approval_messages(fake_slack, "D0ALICE"))
        [msg] = approval_messages(fake_slack, "D0ALICE")
        press = fake_slack.press(msg, "Allow")
        await t.wait_for(lambda: fake_slack.count("conversations.history") == 1)
        assert (await t.press(press)).acked
        await t.settle()
        assert "Allowed" in fake_slack.message("D0ALICE", msg.ts).shown  # the buttons went: the press is shown
        assert approval_messages(fake_slack, "D0ALICE") == []
        assert [m for m in fake_slack.messages("D0ALICE") if "lookup" in m.shown] == [msg]  # posted once
        assert len(tool.calls) == 1
    finally:
        await t.close()


@pytest.mark.parametrize("fault", ["rate_limited", "server_error_once_posted"])
async def test_an_approval_post_tried_again_is_shown_once(tmp_path, fake_openai, fake_slack, fault):
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket", core={"tools": registry(tool)})
    try:
        if fault == "rate_limited":  # refused: nothing was posted, so nothing is looked for
            fake_slack.fail("chat.postMessage", when=_asks, status=429, retry_after=1)
        else:  # Slack carried it out and answered 500: the next try finds it instead of posting it again
            fake_slack.fail("chat.postMessage", when=_asks, status=500, apply_first=True)
        await t.deliver(fake_slack.user_message("how many apples do I have?"))
        await t.wait_for(lambda: len([c for c in fake_slack.calls_to("chat.postMessage") if _asks(c.params)])
                         + fake_slack.count("conversations.history") >= 2)
        for _ in range(250):  # the request's ts is recorded once the post has an answer
            if '"ts": "' in (await t.channel.host.get_state(OPEN_STATE) or ""):
                break
            await asyncio.sleep(0.02)
        assert '"ts": "' in (await t.channel.host.get_state(OPEN_STATE) or "")
        assert len(approval_messages(fake_slack, "D0ALICE")) == 1
        assert fake_slack.count("conversations.history") == (0 if fault == "rate_limited" else 1)
    finally:
        hold.set()
        await t.close()


@pytest.mark.parametrize("timed_out", ["fallback", "live_final"])
async def test_a_post_that_timed_out_is_found_in_the_conversation_instead_of_posted_again(
        tmp_path, fake_openai, fake_slack, timed_out):
    # Slack carries every post out but answers too late: the client times out, so each may have been shown.
    # chat.postMessage takes no idempotency key, so the post carries one in its metadata, and the next try reads
    # the conversation first: it finds the message and posts nothing more — nor does a fallback or a background
    # try after it.
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, call_timeout=0.3,
                            core={"redelivery_delays": (0.05, 0.05, 0.05)})
    try:
        fake_slack.fail("reactions.add", error="channel_not_found")  # no live updates: the final only
        if timed_out == "fallback":  # the final is refused: the plain fallback is the first post that lands
            fake_slack.fail("chat.postMessage", error="is_archived")
        fake_slack.fail("chat.postMessage", error="internal_error", apply_first=True, hang=30.0, times=1_000_000)
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        await t.wait_for(lambda: not any(x.get_name().startswith("redeliver:") for x in asyncio.all_tasks()),
                         timeout=10)
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert fake_slack.count("chat.postMessage") == (2 if timed_out == "fallback" else 1)
        assert fake_slack.count("conversations.history") == 1
        assert await t.core.store.undelivered_turns(0) == []
    finally:
        await t.close()


@pytest.mark.parametrize("code", ["rate_limited", "ratelimited"])
async def test_a_rate_limit_slack_answers_as_an_error_code_is_waited_out(tmp_path, fake_openai, fake_slack, code):
    # chat.postMessage answers {"ok": false, "error": "rate_limited"} (HTTP 200) when an app posts too much to a
    # channel: a pause, as for a 429, then the answer shows — not a refusal that gives the reply up
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core={"redelivery_delays": ()})
    try:
        fake_slack.fail("reactions.add", error="channel_not_found")  # no live updates: the final only
        fake_slack.fail("chat.postMessage", error=code, times=2)
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [ANSWER]
        assert await t.core.store.undelivered_turns(0) == []
    finally:
        await t.close()


MAYBE_POSTED = {
    "internal_error": {"error": "internal_error"},
    "fatal_error": {"error": "fatal_error"},
    "500": {"status": 500},
    "504 page": {"status": 504, "body": "<html><h1>504 Gateway Time-out</h1></html>"},
    "cut-off answer": {"status": 200, "body": '{"ok": true, "channel": "D0ALICE", "ts": "17',
                       "content_type": "application/json"},
    "not JSON": {"status": 200, "body": "ok", "content_type": "text/plain"},
}


@pytest.mark.parametrize("answer", list(MAYBE_POSTED))
@pytest.mark.parametrize("where", ["dm", "thread"])
async def test_a_reply_slack_posted_before_failing_is_shown_once(tmp_path, fake_openai, fake_slack, answer, where):
    # Slack posts the message, then answers with a failure that leaves open whether it did (it documents
    # internal_error and fatal_error so): posting again would show it twice, and a live preview posted that way
    # would stay beside the answer. Each try after such a failure finds the message first.
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket")
    try:
        fake_slack.fail("chat.postMessage", apply_first=True, times=10, **MAYBE_POSTED[answer])  # type: ignore[arg-type]
        if where == "dm":
            await t.deliver(fake_slack.user_message("capital of France?"))
            await t.settle()
            assert fake_slack.visible("D0ALICE") == [ANSWER]
        else:
            as_mention, _ = fake_slack.mention("capital of France?")
            await t.deliver(as_mention)
            await t.settle()
            assert replies_in(fake_slack, "C0GENERAL", as_mention["event"]["ts"]) == [ANSWER]
        assert fake_slack.count("chat.postMessage") == 1  # posted once, then found
        assert fake_slack.count("conversations.history") + fake_slack.count("conversations.replies") >= 1
        assert await t.core.store.undelivered_turns(0) == []
    finally:
        await t.close()


async def test_a_long_reply_taken_in_part_is_completed_later_without_repeating_the_part_shown(
        tmp_path, fake_openai, fake_slack):
    # the reply is three messages; Slack takes the first and refuses the rest for a while: the fallback and
    # the later try send only the two that are missing, so the conversation shows each part once, in order
    answer = "\n\n".join(f"Part {i} " + "text " * 600 for i in range(3))
    fake_openai.script(Text(answer, chunk_size=200))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core={"redelivery_delays": (0.2, 0.4, 0.8, 1.6)})
    try:
        fake_slack.fail("reactions.add", error="channel_not_found")  # no live updates: the final only
        outage = fake_slack.fail("chat.postMessage", status=503, times=1_000_000,
                                 when=lambda p: not str(p.get("text", "")).startswith("Part 0"))
        await t.deliver(fake_slack.user_message("go"))
        await t.settle()  # the first message was taken, the rest refused
        assert [x[:6] for x in fake_slack.visible("D0ALICE")] == ["Part 0"]
        refused = len([c for c in fake_slack.calls_to("chat.postMessage") if c.status != 200])
        await t.wait_for(lambda: len([c for c in fake_slack.calls_to("chat.postMessage") if c.status != 200])
                         > refused, timeout=10)  # a later try, refused as well
        outage.times = 0
        await t.wait_for(lambda: len(fake_slack.visible("D0ALICE")) >= 3, timeout=10)
        await t.wait_for(lambda: not any(x.get_name().startswith("redeliver:") for x in asyncio.all_tasks()),
                         timeout=10)
        shown = fake_slack.visible("D0ALICE")
        assert [x[:6] for x in shown] == ["Part 0", "Part 1", "Part 2"]  # each part once, in order
        assert " ".join(shown).split() == answer.split()
    finally:
        await t.close()
