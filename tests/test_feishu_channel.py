"""The Feishu channel end to end: the real chain (SQLite, the OpenAI SDK against the fake LLM) and the real
FeishuChannel (lark-oapi) against the fake Open API, receiving over the long connection (the real
``lark.ws.Client`` against the fake) and over the webhook (signed, encrypted requests). Each test asserts
what the chat shows."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import ssl
from collections.abc import AsyncIterator
from typing import Any

import pytest

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import PlatformError
from channels.common.throttle import Throttle
from channels.feishu import approvals
from channels.feishu.api import MAX_IN_FLIGHT
from tests.browser.server import RecordingTool, registry
from tests.fakes.feishu import FakeFeishu, FakeLongConnection
from tests.fakes.feishu.harness import CHAT, FeishuHarness, every_mode, feishu_harness
from tests.fakes.feishu.openapi import card_buttons, card_text
from tests.fakes.openai_server import Function, Hang, HttpError, Text, ToolCalls
from tests.support.clock import ManualClock
from tests.support.subagents import COUNTER, FINAL, counter_route

ANSWER = "The capital of France is **Paris**, a city on the Seine."



pytest_generate_tests = every_mode  # each test on `feishu_bridge` runs over the long connection and the webhook


async def test_a_reply_streams_into_one_card_and_ends_closed(feishu_bridge, fake_openai, fake_feishu):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    t = await feishu_bridge()
    asked = await t.say("capital of France?")
    # streaming, unfinished
    await t.wait_for(lambda: fake_feishu.cards and next(iter(fake_feishu.cards.values())).streaming)
    hold.set()
    await t.settle()
    [msg] = fake_feishu.shown(CHAT)
    assert msg.parent_id == asked.message_id  # a reply to the user's message
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming
    assert card.sequences == sorted(set(card.sequences))
    assert fake_feishu.count("message.reply") == 1 and fake_feishu.count("message.create") == 0
    assert fake_feishu.count("card.create") == 1
    assert fake_feishu.count("card.settings") == 0 and fake_feishu.count("card.batch_update") == 1  # closed in one call
    assert fake_feishu.count("reaction.create") == 0  # the card is the working sign


async def test_the_card_shows_at_once_before_any_text_as_the_working_sign(feishu_bridge, fake_openai, fake_feishu):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=0))  # the model says nothing until released
    t = await feishu_bridge()
    asked = await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.shown(CHAT))
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert msg.parent_id == asked.message_id and card is not None and card.streaming and card.text == "…"
    assert not fake_feishu.messages[asked.message_id].reactions
    hold.set()
    await t.settle()
    assert [fake_feishu.card_of(m).text for m in fake_feishu.shown(CHAT)] == [ANSWER]  # the same card, finished
    assert every_card_closed(fake_feishu) and fake_feishu.count("card.create") == 1


def said(request: dict[str, Any]) -> list[str]:
    """What the model was told the user said, oldest first (the runtime context left out)."""
    return [str(m["content"]).split("\n\n[Runtime context]")[0] for m in request["messages"] if m["role"] == "user"]


def every_card_closed(fake: FakeFeishu) -> bool:
    return all(not c.streaming for c in fake.cards.values())


# ---- receiving: dedupe, policy, threads, commands -----------------------------------------------------


async def test_a_redelivered_event_gets_no_second_reply_also_after_a_restart(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text(ANSWER), Text("Second answer, should never be asked for"))
    t = await feishu_bridge()
    msg, payload = t.event("capital of France?")
    await t.deliver(payload)
    await t.settle()
    await t.deliver(payload)  # Feishu pushes the same event again (no ack in time)
    _, again = t.event("capital of France?", message=msg)  # and the same message under a new event id
    await t.deliver(again)
    await t.settle()
    assert len(fake_openai.requests) == 1
    assert t.texts() == [ANSWER]
    await t.close()

    t2 = await feishu_bridge()  # a restart on the same database
    await t2.deliver(payload)
    await t2.settle()
    assert len(fake_openai.requests) == 1
    assert t2.texts() == [ANSWER]


async def test_a_group_message_without_a_mention_is_ignored_under_mention(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("answered"))
    t = await feishu_bridge()
    await t.say("talking among ourselves", mention=False)
    await t.settle()
    assert fake_openai.requests == [] and t.texts() == []
    await t.say("now you", mention=True)
    await t.settle()
    assert t.texts() == ["answered"]
    assert said(fake_openai.requests[0]) == ["now you"]  # the bot's mention removed


async def test_a_p2p_message_needs_no_mention_and_group_policy_all_answers_everything(
        feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("in private"), Text("in the group"))
    t = await feishu_bridge(group_policy="all")
    fake_feishu.chat("oc_p2p", "p2p")
    await t.say("hello", chat="oc_p2p", chat_type="p2p")
    await t.settle()
    await t.say("hello all", mention=False)
    await t.settle()
    assert t.texts("oc_p2p") == ["in private"] and t.texts() == ["in the group"]


async def test_a_thread_reply_continues_the_threads_session(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("first in thread"), Text("second in thread"), Text("in the chat"))
    t = await feishu_bridge()
    first = await t.say("start a topic", thread=True)
    await t.settle()
    await t.say("and more", parent=first)  # a reply inside that thread
    await t.settle()
    await t.say("back in the main chat")
    await t.settle()
    keys = sorted(s.key for s in await t.core.list_sessions())
    thread = fake_feishu.messages[first.message_id].thread_id
    assert keys == [f"feishu:{CHAT}", f"feishu:{CHAT}:{thread}"]
    assert said(fake_openai.requests[1]) == ["start a topic", "and more"]
    assert said(fake_openai.requests[2]) == ["back in the main chat"]


async def test_allow_from_by_user_id_and_our_own_messages_are_ignored(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("for bob"))
    t = await feishu_bridge(allow_from=("u_bob",))
    await t.say("from alice")  # alice's user_id is u_alice
    _, own = t.event("from the bot itself", sender=fake_feishu.bot_open_id)
    await t.deliver(own)
    _, bob = t.event("from bob", sender="ou_bob", sender_user_id="u_bob")
    await t.deliver(bob)
    await t.settle()
    assert [said(r) for r in fake_openai.requests] == [["from bob"]]
    assert t.texts() == ["for bob"]


@pytest.mark.parametrize("mention", [True, False])
async def test_commands_work_as_text_with_and_without_a_mention(feishu_bridge, fake_openai, fake_feishu, mention):
    t = await feishu_bridge(group_policy="all")
    await t.say("/help", mention=mention)
    await t.settle()
    [shown] = t.texts()
    assert "/stop" in shown and "/new" in shown and "/compact" in shown
    assert fake_openai.requests == []


async def test_stop_closes_the_streaming_card_with_the_partial_answer(feishu_bridge, fake_openai, fake_feishu):
    hold = asyncio.Event()
    fake_openai.script(Text("Partial answer that goes on and on", hold=hold, hold_after=30))
    t = await feishu_bridge()
    await t.say("tell me a story")
    await t.wait_for(lambda: fake_feishu.cards)
    await t.say("/stop")
    await t.settle()
    hold.set()
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == "Partial answer that goes on an\n\n⏹ Stopped."
    assert every_card_closed(fake_feishu)


async def test_a_model_failure_closes_the_card_with_the_notice(feishu_bridge, fake_openai, fake_feishu):
    # the model goes silent mid-answer (the card is streaming by then); the retry is refused for good
    fake_openai.script(Hang(5, after_text="Some words before it breaks"), HttpError.auth(), HttpError.auth())
    t = await feishu_bridge(core={"request_timeout": 1.0})  # the silence that ends the first attempt
    await t.say("go")
    await t.settle()
    assert fake_feishu.cards and every_card_closed(fake_feishu)
    [msg] = fake_feishu.shown(CHAT)
    assert fake_feishu.card_of(msg) is not None
    assert "rejected the bridge's credentials" in fake_feishu.text_of(msg)


# ---- webhook only: what Feishu's console and an attacker send ------------------------------------------


@pytest.fixture
async def hook(tmp_path, fake_openai, fake_feishu) -> AsyncIterator[FeishuHarness]:
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook")
    yield t
    await t.close()


async def test_url_verification_is_answered_plain_and_encrypted(hook):
    sender = hook.sender
    assert sender is not None
    for key in ("", None):  # plain (an app without encryption sends it so), then encrypted with the app's key
        sent = await sender.send(sender.url_verification(challenge="abc123"), encrypt_with=key, sign=False)
        assert sent.status == 200 and sent.json() == {"challenge": "abc123"}
    wrong = await sender.send(sender.url_verification(token="not-the-token", challenge="x"), sign=False)
    assert wrong.status == 401 and "x" not in wrong.text


@pytest.mark.parametrize("forgery", [
    {"token": "vt_wrong"},
    {"bad_signature": True},
    {"undecryptable": True},
    {"encrypt_with": "another-apps-key"},
    {"sign": False},
    {"timestamp": "1000000000"},  # a signed request from 2001: a replay
])
async def test_forged_or_replayed_requests_are_rejected_without_a_model_request(hook, fake_openai, forgery):
    sender = hook.sender
    assert sender is not None
    token = forgery.pop("token", None)
    _, payload = hook.event("hello")
    if token:
        payload["header"]["token"] = token
    sent = await sender.send(payload, **forgery)
    assert sent.status == 401
    assert "token" not in sent.text.lower() and "sign" not in sent.text.lower()
    await hook.settle()
    assert fake_openai.requests == [] and hook.texts() == []


async def test_a_body_over_the_cap_is_refused_before_it_is_read(tmp_path, fake_openai, fake_feishu):
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook", max_body_bytes=4096)
    try:
        assert t.sender is not None
        sent = await t.sender.send(t.event("x" * 5000)[1])
        assert sent.status == 413
        assert fake_openai.requests == []
        assert t.channel.state() == "webhook"
    finally:
        await t.close()


# ---- the sink -----------------------------------------------------------------------------------------


def long_reply() -> str:
    parts = []
    for i in range(64):
        parts.append(f"## 第 {i} 节\n\n这是第 {i} 节的说明文字，足够长，才有意义。Some prose for section {i}. " * 3)
        parts.append(f"```python\ndef section_{i}():\n    return {i} * 2  # a comment with < and >\n```")
        parts.append("| a | b |\n|---|---|\n" + "".join(f"| {i}.{j} | {j * i} |\n" for j in range(4)))
    text = "\n\n".join(parts)
    assert len(text) >= 20_000
    return text


@pytest.mark.parametrize("arrival", ["streamed", "in_two_bursts"])
async def test_a_20000_character_reply_arrives_complete_across_closed_cards(
        feishu_bridge, fake_openai, fake_feishu, arrival):
    reply = long_reply()
    if arrival == "streamed":
        fake_openai.script(Text(reply, chunk_size=400, delay=0.005))
    else:  # a part fills up before its streaming card is open: that part is sent as a finished card
        fake_openai.script(Text(reply, chunk_size=len(reply) // 2 + 1))
    t = await feishu_bridge()
    await t.say("write a lot")
    await t.settle(timeout=30)
    shown = fake_feishu.shown(CHAT)
    assert len(shown) >= 2
    assert all(m.msg_type == "interactive" for m in shown)  # cards only: no part falls back to plain text
    streamed = [c for c in map(fake_feishu.card_of, shown) if c is not None]  # the CardKit cards among them
    assert all(not c.streaming for c in streamed)
    for c in streamed:
        assert c.sequences == sorted(set(c.sequences))
    joined = "".join(fake_feishu.text_of(m) for m in shown)
    def squash(s):
        return "".join(s.replace("```python", "").replace("```", "").replace("&#60;", "<").split())
    assert squash(joined) == squash(reply)  # every word, in order, once
    assert fake_feishu.count("message.create") == 0  # every card replies to the user's message


async def test_a_rate_limit_on_the_final_update_waits_out_the_reset_then_shows_the_answer_once(
        feishu_bridge, fake_openai, fake_feishu):
    clock = ManualClock()
    fake_feishu.clock = lambda: clock.t  # the fake stamps calls with the same (virtual) time
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    t = await feishu_bridge(clock=clock, core={"delivery_wait_timeout": 3.0})
    limited = fake_feishu.rate_limit("card.batch_update", reset=30)  # the call that closes the card
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.cards)
    hold.set()
    await t.settle(timeout=20)
    assert limited.hits == 1
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming
    refused = next(c for c in fake_feishu.calls_to("card.batch_update") if c.code == 99991400)
    after = fake_feishu.calls[fake_feishu.calls.index(refused) + 1:]
    assert after and all(c.at >= refused.at + 30 for c in after)  # nothing reached the chat before the reset
    assert len(fake_openai.requests) == 1


async def test_a_chat_frequency_limit_pauses_and_retries(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge()
    fake_feishu.chat_rate_limit("message.reply")
    await t.say("capital of France?")
    await t.settle()
    assert t.texts() == [ANSWER]
    assert len([c for c in fake_feishu.calls_to("message.reply") if c.code == 0]) == 1


async def test_a_send_whose_answer_was_lost_is_retried_with_its_uuid_and_posts_once(
        feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge()
    fake_feishu.fail("message.reply", status=502, code=1500, apply_first=True)  # carried out, the answer lost
    await t.say("capital of France?")
    await t.settle()
    assert t.texts() == [ANSWER]
    replies = fake_feishu.calls_to("message.reply")
    assert len(replies) == 2 and replies[0].body["uuid"] == replies[1].body["uuid"]


async def test_a_lost_send_repeated_with_its_uuid_after_the_turn_ended_still_shows_the_whole_answer(
        feishu_bridge, fake_openai, fake_feishu):
    # streaming by messages (CardKit refused): the first message, with the first words, is posted but its answer
    # is lost, and the turn ends while it is on its way. Feishu answers the repeat (the same uuid) with the
    # message first posted, which shows those first words: the repeat must not be taken for the final.
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await feishu_bridge(core={"request_timeout": 30.0})
    fake_feishu.fail("card.create", status=400, code=99991672, msg="no permission: cardkit:card:write", times=100)
    fake_feishu.fail("message.reply", status=502, code=1500, apply_first=True, hang=2.0)  # posted, the answer lost
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.count("message.reply") == 1)  # on its way
    hold.set()  # the model's last words: the turn is over before the send fails
    await t.settle()
    assert t.texts() == [ANSWER]
    replies = fake_feishu.calls_to("message.reply")
    assert len(replies) == 2 and replies[0].body["uuid"] == replies[1].body["uuid"]  # posted once


async def test_a_revoked_tenant_token_is_refreshed_once_and_the_reply_arrives(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("first"), Text("second"))
    t = await feishu_bridge()
    await t.say("one")
    await t.settle()
    fake_feishu.revoke_tokens()
    await t.say("two")
    await t.settle()
    assert t.texts() == ["first", "second"]
    assert fake_feishu.count("token") == 2


# ---- the §15 fallback matrix --------------------------------------------------------------------------


async def test_cardkit_refused_streams_into_a_card_message_instead(feishu_bridge, fake_openai, fake_feishu):
    thinking = asyncio.Event()  # the model says nothing for a while: the working sign shows meanwhile
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.02, hold=thinking, hold_after=0))
    t = await feishu_bridge()
    fake_feishu.fail("card.create", status=400, code=99991672, msg="no permission: cardkit:card:write", times=100)
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.count("card.create") == 1)
    thinking.set()
    await t.settle()
    assert t.texts() == [ANSWER]
    [msg] = fake_feishu.shown(CHAT)
    assert msg.msg_type == "interactive" and fake_feishu.card_of(msg) is None  # a JSON card message
    assert fake_feishu.count("card.create") == 1  # refused once: not asked again for this reply
    # without a card to show at once, the working sign is a reaction on the user's message, removed at the end
    assert fake_feishu.count("reaction.create") == 1
    await t.wait_for(lambda: fake_feishu.count("reaction.delete") == 1)
    assert not any(m.reactions for m in fake_feishu.messages.values())


async def test_a_final_update_failing_for_good_falls_back_once_with_a_note_on_the_card(
        feishu_bridge, fake_openai, fake_feishu):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await feishu_bridge()
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.cards and fake_feishu.shown(CHAT))
    # every update of the answer is refused for good (the note that closes the card is not)
    fake_feishu.fail("element.content", status=400, code=300313, msg="refused", times=100)
    fake_feishu.fail("card.batch_update", status=400, code=300313, msg="refused", times=100,
              when=lambda c: "continues in the message below" not in c.body.get("actions", ""))
    hold.set()
    await t.settle()
    shown = fake_feishu.shown(CHAT)
    assert len(shown) == 2
    card = fake_feishu.card_of(shown[0])
    assert card is not None and not card.streaming and "continues in the message below" in card.text
    assert "capital" not in card.text  # the words it streamed are in the post below: not shown twice
    assert shown[1].msg_type == "post" and fake_feishu.text_of(shown[1]) == ANSWER.replace("**", "")


@pytest.mark.parametrize("recall", ["allowed", "refused"])
async def test_when_the_note_is_refused_too_the_card_is_recalled_so_its_words_show_once(
        feishu_bridge, fake_openai, fake_feishu, recall):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await feishu_bridge()
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.cards and fake_feishu.shown(CHAT)
                     and next(iter(fake_feishu.cards.values())).text == ANSWER[:30])
    # the card can no longer be changed at all: neither the final content nor the "answer below" note
    fake_feishu.fail("element.content", status=400, code=300313, msg="refused", times=100)
    fake_feishu.fail("card.batch_update", status=400, code=300313, msg="refused", times=100)
    if recall == "refused":
        fake_feishu.fail("message.delete", status=400, code=230026, msg="no permission to recall", times=100)
    hold.set()
    await t.settle()
    shown = fake_feishu.shown(CHAT)
    assert fake_feishu.text_of(shown[-1]) == ANSWER.replace("**", "")  # the whole answer, once, below
    if recall == "allowed":
        assert len(shown) == 1  # the card with the answer's first words is gone
    else:  # nothing more can be done: the card stays as it was, its first words above the answer
        assert len(shown) == 2 and fake_feishu.card_of(shown[0]).text == ANSWER[:30]


async def test_a_card_that_cannot_be_sent_falls_back_to_one_plain_reply(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge()
    fake_feishu.fail("message.reply", status=400, code=230002, msg="bot not in chat", times=100,
              when=lambda c: c.body.get("msg_type") == "interactive")
    await t.say("capital of France?")
    await t.settle()
    shown = fake_feishu.shown(CHAT)
    assert [m.msg_type for m in shown] == ["post"]
    assert fake_feishu.text_of(shown[0]) == ANSWER.replace("**", "")


async def test_while_every_request_slot_is_taken_live_updates_are_left_out_and_the_end_shows_it_all(
        feishu_bridge, fake_openai, fake_feishu):
    """Under load every request slot of the channel is taken: a live update would only wait behind them, and the
    next one (or the close) supersedes it, so none is queued; the close waits its turn and shows the whole
    answer."""
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    # the model's pause outlasts the set-up below, and the held requests outlast the waits for it
    t = await feishu_bridge(core={"request_timeout": 30.0}, request_timeout=60.0)
    await t.say("capital of France?")
    # the card is in the chat and shows all the model said before its pause: no call is left to make (a card
    # still to be sent, or a live update that started just as the held requests below took the slots, would
    # wait for a slot, as the close should alone)
    await t.wait_for(lambda: fake_feishu.shown(CHAT) and fake_feishu.cards
                     and next(iter(fake_feishu.cards.values())).text == ANSWER[:30])
    api = t.channel.api
    gate = fake_feishu.hold("reaction.create")
    others = [fake_feishu.user_message(CHAT, f"other {i}") for i in range(MAX_IN_FLIGHT)]
    taking = [asyncio.create_task(api.react(m.message_id, "OK")) for m in others]  # every slot, held
    try:
        await t.wait_for(lambda: api.busy and not api.waiting and fake_feishu.in_flight == MAX_IN_FLIGHT, timeout=30)
        updates = fake_feishu.count("element.content")
        hold.set()  # the rest of the answer streams while no slot is free
        await t.wait_for(lambda: api.waiting == 1, timeout=30)  # the close waits for a slot, nothing else does
    finally:
        gate.set()
        await asyncio.gather(*taking)
    await t.settle()
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming
    assert fake_feishu.count("element.content") == updates  # no live update was queued behind the held requests


async def test_a_turn_that_starts_while_every_request_slot_is_taken_spends_one_call_on_its_answer(
        feishu_bridge, fake_openai, fake_feishu):
    """Overloaded from the start: no card is opened early and no live update is made (each would only wait
    behind the requests in flight); the answer arrives whole, as one card message, in one call."""
    fake_openai.script(Text(ANSWER, chunk_size=4))
    t = await feishu_bridge()
    api = t.channel.api
    gate = fake_feishu.hold("reaction.create")
    others = [fake_feishu.user_message(CHAT, f"other {i}") for i in range(MAX_IN_FLIGHT)]
    taking = [asyncio.create_task(api.react(m.message_id, "OK")) for m in others]  # every slot, held
    try:
        await t.wait_for(lambda: api.busy and not api.waiting and fake_feishu.in_flight == MAX_IN_FLIGHT, timeout=30)
        before = len(fake_feishu.calls)
        asked = await t.say("capital of France?")
        await t.wait_for(lambda: api.waiting == 1, timeout=30)  # the answer waits for a slot, nothing else does
    finally:
        gate.set()
        await asyncio.gather(*taking)
    await t.settle()
    [msg] = fake_feishu.shown(CHAT)
    assert msg.parent_id == asked.message_id and msg.msg_type == "interactive"
    assert fake_feishu.text_of(msg) == ANSWER
    assert [c.route for c in fake_feishu.calls[before:] if c.route != "reaction.create"] == ["message.reply"]


async def test_transient_final_failures_then_success_send_no_fallback(feishu_bridge, fake_openai, fake_feishu):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    t = await feishu_bridge()
    fake_feishu.fail("card.batch_update", status=503, code=1500, times=2)
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.cards)
    hold.set()
    await t.settle()
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming
    assert [m.msg_type for m in fake_feishu.shown(CHAT)] == ["interactive"]
    assert len(fake_feishu.calls_to("card.batch_update")) == 3  # two transient failures, then the close


async def test_healthz_state_follows_the_channel(feishu_bridge):
    t = await feishu_bridge()
    assert t.channel.state() == ("connected" if t.mode == "websocket" else "webhook")
    await t.channel.stop()
    assert t.channel.state() == "stopped"


# ---- approvals ----------------------------------------------------------------------------------------

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_F1"])


def approval_cards(fake: FakeFeishu, chat: str = CHAT) -> list[Any]:
    return [m for m in fake.shown(chat) if m.msg_type == "interactive" and card_buttons(m.content)]


async def approval(t: FeishuHarness) -> Any:
    await t.wait_for(lambda: approval_cards(t.fake))
    [msg] = approval_cards(t.fake)
    return msg


def button(msg: Any, label: str) -> Any:
    return next(value for text, value in card_buttons(msg.content) if label in text)


async def test_the_requester_allows_on_the_card_and_the_answer_arrives(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    asked = await t.say("how many apples do I have?")
    msg = await approval(t)
    assert msg.parent_id == asked.message_id
    assert "lookup" in fake_feishu.text_of(msg) and "apples" in fake_feishu.text_of(msg)
    assert tool.calls == []
    # the answer card (shown since the turn began) says what it waits for
    await t.wait_for(
        lambda: [c for c in fake_feishu.cards.values() if c.streaming and "waiting for approval" in c.text])

    answer = await t.press(button(msg, "Allow"), message_id=msg.message_id)
    assert answer["toast"]["content"] == approvals.ALLOWED
    assert "Allowed by u\\_alice" in card_text(answer["card"]["data"])  # escaped as card markdown
    assert card_buttons(answer["card"]["data"]) == []  # the decided card has no buttons
    await t.settle()
    assert tool.calls == [{"query": "apples"}]
    # once, in the turn's card: above the approval card when that card came first, below it otherwise
    assert fake_feishu.texts(CHAT).count("You have 42 apples.") == 1
    assert every_card_closed(fake_feishu)


async def test_a_strangers_press_is_refused_and_a_late_press_is_no_longer_pending(
        feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("Not counted."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    await t.say("count my apples")
    msg = await approval(t)
    stranger = await t.press(button(msg, "Allow"), message_id=msg.message_id, operator="ou_mallory",
                             operator_user_id="u_mallory")
    assert stranger == approvals.toast("warning", approvals.NOT_YOURS)
    assert tool.calls == []

    denied = await t.press(button(msg, "Deny"), message_id=msg.message_id)
    assert denied["toast"]["content"] == approvals.DENIED
    await t.settle()
    assert tool.calls == []
    late = await t.press(button(msg, "Allow"), message_id=msg.message_id)
    # no longer pending, and the card pressed (its buttons still showing there) is replaced by how it ended
    assert late["toast"] == approvals.toast("info", approvals.GONE)["toast"]
    assert "Denied by u\\_alice" in card_text(late["card"]["data"]) and card_buttons(late["card"]["data"]) == []


async def test_an_allowed_user_may_decide_for_someone_else(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("Counted."))
    t = await feishu_bridge(core={"tools": registry(tool)}, allow_from=("u_alice", "u_admin"))
    await t.say("count my apples")
    msg = await approval(t)
    answer = await t.press(button(msg, "Allow"), message_id=msg.message_id, operator="ou_admin",
                           operator_user_id="u_admin")
    assert answer["toast"]["content"] == approvals.ALLOWED
    await t.settle()
    assert tool.calls == [{"query": "apples"}]


async def test_stop_marks_the_pending_approval_card_as_ended(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("unused"))
    t = await feishu_bridge(core={"tools": registry(tool)})
    await t.say("count my apples")
    msg = await approval(t)
    await t.say("/stop")
    await t.settle()
    await t.wait_for(lambda: not card_buttons(fake_feishu.messages[msg.message_id].content))
    assert "stopped before a decision" in fake_feishu.text_of(fake_feishu.messages[msg.message_id])
    assert every_card_closed(fake_feishu)
    assert tool.calls == []


# ---- the connection and the token -----------------------------------------------------------------------


async def test_requests_in_flight_are_capped_and_waiting_a_turn_does_not_time_a_call_out(fake_feishu):
    """lark-oapi builds a new HTTP client, with a TLS context of its own, for every request, so the channel
    caps the requests in flight (memory would otherwise grow with every request waiting for the CPU). The Open
    API answers slowly here (a second each): eight reactions at once reach it at most two at a time, and every
    one lands although the last waits three seconds or more for its turn, longer than its call's bound (three
    seconds, for the answer alone)."""
    from channels.feishu.api import FeishuApi
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=5, max_in_flight=2)
    calls = Calls(Throttle(), CallPolicy(attempts=1, timeout=3.0))
    messages = [fake_feishu.user_message(CHAT, f"hi {i}") for i in range(8)]
    await api.token()
    fake_feishu.delays["reaction.create"] = 1.0
    await asyncio.gather(*(calls.call(lambda m=m: api.react(m.message_id, "Typing")) for m in messages))
    assert all(fake_feishu.messages[m.message_id].reactions for m in messages)
    assert fake_feishu.max_in_flight <= 2


async def test_sends_that_reach_feishu_late_and_together_stay_within_the_apps_limit(fake_feishu):
    """A send reaches Feishu some time after it leaves: lark-oapi builds a client for it, the loop gets round to
    it. Under load those delays bunch sends that left at the pace. Here Feishu takes none in until the test
    lets them all in together: a hundred sends to a hundred chats still never make one second of Feishu's see
    more than its 50, and each is sent once."""
    from channels.feishu.api import FeishuApi
    fake_feishu.enforce_limits(app_sends=50)
    asked = []
    for i in range(100):
        fake_feishu.chat(f"oc_late{i}", "p2p")
        asked.append(fake_feishu.user_message(f"oc_late{i}", "hi"))
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=10,
                    max_in_flight=64)
    await api.token()
    gate = fake_feishu.hold("message.reply")
    sends = asyncio.gather(*(api.send(m.chat_id, "text", json.dumps({"text": "hello"}), f"late-{i}",
                                      reply_to=m.message_id) for i, m in enumerate(asked)),
                           return_exceptions=True)
    for _ in range(1000):  # every send the bridge lets go is waiting at Feishu's door (at most 10 s)
        if fake_feishu.in_flight >= 50:
            break
        await asyncio.sleep(0.01)
    gate.set()
    results = await asyncio.wait_for(sends, 20)
    assert [r for r in results if isinstance(r, BaseException)] == []
    replies = fake_feishu.calls_to("message.reply")
    assert len(replies) == 100 and all(c.status == 200 for c in replies)


async def test_a_send_takes_its_budget_slot_only_when_it_goes_out_not_while_it_queues(fake_feishu):
    """Sends queued for a request slot would otherwise each hold a slot of the app's budget taken long before they
    go out, and reach Feishu in a burst over its limit once the slots free up."""
    from channels.feishu.api import FeishuApi
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=5, max_in_flight=1)
    await api.token()
    asked = fake_feishu.user_message(CHAT, "hi")
    gate = fake_feishu.hold("reaction.create")
    taking = asyncio.create_task(api.react(asked.message_id, "OK"))  # the only slot, held
    paced: list[int] = []

    async def pace() -> None:
        paced.append(fake_feishu.in_flight)

    try:
        for _ in range(500):
            if api.busy:
                break
            await asyncio.sleep(0.01)
        sending = asyncio.create_task(api.send(CHAT, "text", json.dumps({"text": "x"}), "send-1", pace=pace))
        for _ in range(500):
            if api.waiting:
                break
            await asyncio.sleep(0.01)
        assert api.waiting == 1 and paced == []  # queued for the slot: no budget slot taken yet
    finally:
        gate.set()
        await taking
    await sending
    assert paced == [0]  # taken once, when the send had the slot and nothing else was in flight
    assert fake_feishu.texts(CHAT)[-1] == "x"


async def test_the_sdks_clients_left_in_reference_cycles_are_freed_between_collections(fake_feishu):
    """lark-oapi's client of each request is left in a reference cycle with its TLS context (about a MiB) and its
    socket, and ``chatbridge run`` makes the collector's passes rare. With the collector off altogether here,
    forty requests in a row still leave far fewer than forty TLS contexts alive: the channel frees them itself."""
    from channels.feishu.api import FeishuApi
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=5)
    messages = [fake_feishu.user_message(CHAT, f"hi {i}") for i in range(40)]
    await api.token()
    gc.collect()
    gc.disable()
    try:
        before = sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects())  # other tests' may be alive
        for m in messages:
            await api.react(m.message_id, "Typing")
        added = sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects()) - before
    finally:
        gc.enable()
    assert all(fake_feishu.messages[m.message_id].reactions for m in messages)
    assert added < 20


async def test_the_tenant_token_is_fetched_without_blocking_the_event_loop(fake_feishu):
    from channels.feishu.api import FeishuApi
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=5)
    fake_feishu.fail("token", hang=0.5, status=500, code=1500)  # the Open Platform is slow, then fails once
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    running = asyncio.create_task(ticker())
    try:
        with pytest.raises(PlatformError):
            await api.token()  # the slow, failed fetch
        assert ticks >= 20  # the loop kept running while the token request waited
        assert await api.token()  # and the next one succeeds
    finally:
        running.cancel()


async def test_the_long_connection_comes_back_after_a_drop(tmp_path, fake_openai, fake_feishu):
    fake_openai.script(Text("before"), Text("after"))
    async with FakeLongConnection(fake_feishu.app_id, fake_feishu.app_secret) as conn:
        t = await feishu_harness(tmp_path, fake_openai, fake_feishu, conn=conn)
        try:
            await t.say("one")
            await t.settle()
            conn.disconnect()
            await conn.wait_connected(1, opened=2, timeout=10)
            await t.wait_for(lambda: t.channel.state() == "connected")
            ack = await t.deliver(t.event("two")[1])
            assert ack.code == 200 and not ack.data  # a message is acknowledged with an empty answer
            await t.settle()
            assert t.texts() == ["before", "after"]
        finally:
            await t.close()


@pytest.mark.parametrize("how", ["client_error", "reconnects_run_out"])
async def test_a_long_connection_lark_oapi_gave_up_on_is_opened_again(tmp_path, fake_openai, fake_feishu, how):
    # lark-oapi stops reconnecting for good, inside its own task, after an answer it takes for a client error
    # or once the server's reconnect count is spent; start() goes on blocking, and nothing received again
    fake_openai.script(Text("after"))
    async with FakeLongConnection(fake_feishu.app_id, fake_feishu.app_secret) as conn:
        if how == "reconnects_run_out":
            conn.reconnect_count = 2
        t = await feishu_harness(tmp_path, fake_openai, fake_feishu, conn=conn, reconnect_timeout=1.0,
                                 watch_interval=0.05)
        try:
            conn.refuse = 10003 if how == "client_error" else 1
            before = conn.endpoint_requests
            conn.disconnect()
            await conn.wait_for(lambda: conn.endpoint_requests > before, 5)
            await asyncio.sleep(0.5)  # lark-oapi has given up by now (its reconnect interval here: 0.05 s)
            conn.refuse = 0  # Feishu answers again
            await conn.wait_connected(1, opened=2, timeout=10)
            await t.wait_for(lambda: t.channel.state() == "connected")
            ack = await t.deliver(t.event("are you back?")[1])
            assert ack.code == 200
            await t.settle()
            assert t.texts() == ["after"]
        finally:
            await t.close()


def runs_sdk_code(task: asyncio.Task[object]) -> bool:
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and "lark_oapi" in code.co_filename


async def test_the_long_connection_runs_nothing_on_the_bridges_loop(tmp_path, fake_openai, fake_feishu):
    # lark-oapi's client starts a task on the current loop when it is built: built on the bridge's loop, it
    # cleared the SDK thread's frame cache from the bridge's thread, and stayed there after the client stopped
    async with FakeLongConnection(fake_feishu.app_id, fake_feishu.app_secret) as conn:
        t = await feishu_harness(tmp_path, fake_openai, fake_feishu, conn=conn)
        try:
            assert [task for task in asyncio.all_tasks() if runs_sdk_code(task)] == []
        finally:
            await t.close()


async def test_a_press_delivered_twice_decides_once(feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("Counted."))
    t = await feishu_bridge(core={"tools": registry(tool)})
    await t.say("count my apples")
    msg = await approval(t)
    first = await t.press(button(msg, "Deny"), message_id=msg.message_id, event_id="ev_press_1")
    again = await t.press(button(msg, "Deny"), message_id=msg.message_id, event_id="ev_press_1")
    assert first["toast"]["content"] == approvals.DENIED
    # pushed again because its answer was lost: answered as it ended, with the decided card
    assert again["toast"] == approvals.toast("info", approvals.DENIED)["toast"]
    assert card_buttons(again["card"]["data"]) == []
    await t.settle()
    assert tool.calls == []


# ---- when core cannot take a message --------------------------------------------------------------------


async def test_webhook_answers_503_for_a_message_core_could_not_store_and_takes_the_retry(
        tmp_path, fake_openai, fake_feishu):
    from tests.test_admission import FlakyStore
    fake_openai.script(Text("stored the second time"))
    store = FlakyStore(tmp_path / "chat.db")
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook", core={"store": store})
    try:
        store.fail_admissions = 1
        _, payload = t.event("hello")
        assert (await t.deliver(payload)).status == 503  # Feishu sends it again
        assert (await t.deliver(payload)).status == 200
        await t.settle()
        assert t.texts() == ["stored the second time"]
    finally:
        await t.close()


async def test_the_long_connection_acks_a_message_only_once_core_stored_it(tmp_path, fake_openai, fake_feishu):
    """The ack tells Feishu never to push the event again: sent before the message is stored, a crash in
    between would lose it without a word. A message core could not store is left unacknowledged, and the
    push Feishu then makes again is answered, once."""
    from tests.test_admission import FlakyStore
    fake_openai.script(Text("answered"), Text("answered too"))
    store = FlakyStore(tmp_path / "chat.db")
    async with FakeLongConnection(fake_feishu.app_id, fake_feishu.app_secret) as conn:
        t = await feishu_harness(tmp_path, fake_openai, fake_feishu, conn=conn, core={"store": store}, submit_wait=30.0)
        try:
            gate = store.admission_gate = asyncio.Event()  # core is slow to store the message
            first = conn.push(t.event("first")[1])
            await t.wait_for(lambda: store.at_gate == 1, timeout=10)
            assert conn.acks_for(first) == []  # not stored yet: not acknowledged either
            gate.set()
            assert (await conn.wait_ack(first, timeout=10)).code == 200
            await t.settle()
            assert t.texts() == ["answered"]

            store.admission_gate = None
            store.fail_admissions = 1  # the write fails (a full disk, a crash on the way)
            second = conn.push(t.event("second")[1])
            assert (await conn.wait_ack(second, timeout=10)).code == 500  # so Feishu pushes it again
            conn.redeliver(second)
            assert (await conn.wait_ack(second, count=2, timeout=10)).code == 200
            await t.settle()
            assert t.texts() == ["answered", "answered too"]
        finally:
            await t.close()


async def test_a_split_reply_whose_last_card_fails_resends_only_the_missing_part(
        feishu_bridge, fake_openai, fake_feishu):
    reply = long_reply()
    hold = asyncio.Event()
    fake_openai.script(Text(reply, chunk_size=400, hold=hold, hold_after=2000))
    t = await feishu_bridge()

    def later_card(call: Any) -> bool:  # the first card is shown; every later one is refused
        return call.body.get("msg_type") == "interactive" and any(m.msg_type == "interactive"
                                                                   for m in fake_feishu.shown(CHAT))

    fake_feishu.fail("message.reply", status=400, code=230013, msg="refused", times=1000, when=later_card)
    await t.say("write a lot")
    await t.wait_for(lambda: fake_feishu.cards)  # the first card streams
    hold.set()
    await t.settle(timeout=30)
    shown = fake_feishu.shown(CHAT)
    assert len(shown) >= 2 and shown[0].msg_type == "interactive"
    first = fake_feishu.card_of(shown[0])
    assert first is not None and not first.streaming
    posts = shown[1:]
    assert all(m.msg_type == "post" for m in posts)  # the fallback: only what the chat does not show

    def sections(text: str) -> list[str]:
        return re.findall(r"第 (\d+) 节|section_(\d+)", text)

    shown_text = first.text + "".join(fake_feishu.text_of(m) for m in posts)
    assert sections(shown_text) == sections(reply)  # every part once, in order: the first card's is not resent


async def test_the_plain_fallback_waits_out_a_rate_limit_and_arrives_once(feishu_bridge, fake_openai, fake_feishu):
    clock = ManualClock()
    fake_feishu.clock = lambda: clock.t
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge(clock=clock)
    fake_feishu.fail("message.reply", status=400, code=230013, msg="refused", times=1000,
              when=lambda c: c.body.get("msg_type") == "interactive")  # no card can be shown here
    limited = fake_feishu.rate_limit("message.reply", reset=45, when=lambda c: c.body.get("msg_type") == "post")
    await t.say("capital of France?")
    await t.settle(timeout=20)
    assert limited.hits == 1
    assert [fake_feishu.text_of(m) for m in fake_feishu.shown(CHAT)] == [ANSWER.replace("**", "")]
    refused = next(c for c in fake_feishu.calls_to("message.reply") if c.code == 99991400)
    after = [c for c in fake_feishu.calls[fake_feishu.calls.index(refused) + 1:] if c.route == "message.reply"]
    assert after and all(c.at >= refused.at + 45 for c in after)


async def test_a_card_past_feishus_ten_minute_streaming_limit_still_ends_with_the_full_answer(
        feishu_bridge, fake_openai, fake_feishu):
    now = [0.0]
    fake_feishu.clock = lambda: now[0]
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    t = await feishu_bridge()
    await t.say("capital of France?")
    await t.wait_for(lambda: fake_feishu.cards)
    now[0] += 601  # Feishu turns streaming off by itself after ten minutes
    hold.set()
    await t.settle()
    [msg] = fake_feishu.shown(CHAT)
    card = fake_feishu.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming


# ---- subagents ----------------------------------------------------------------------------------------


async def test_a_subagents_approval_is_shown_with_its_label_and_decided_on_the_card(
        feishu_bridge, fake_openai, fake_feishu):
    tool = RecordingTool("lookup", result="42")
    fake_openai.default = Function(counter_route)
    t = await feishu_bridge(core={"tools": registry(tool), "subagents": COUNTER})
    await t.say("how many apples?")
    msg = await approval(t)
    assert "subagent counter: TASK count apples" in fake_feishu.text_of(msg)
    status = "⏳ counter: TASK count apples · waiting for approval: lookup"
    # the card shows the child's step
    await t.wait_for(lambda: any(status in c.text for c in fake_feishu.cards.values()))
    answer = await t.press(button(msg, "Allow"), message_id=msg.message_id)
    assert answer["toast"]["content"] == approvals.ALLOWED
    await t.settle()
    assert tool.calls == [{"query": "apples"}]
    # once, in the turn's card: above the approval card when that card came first, below it otherwise
    assert fake_feishu.texts(CHAT).count(FINAL) == 1
    assert every_card_closed(fake_feishu)


async def test_a_burst_of_chats_is_answered_within_the_apps_send_limit(tmp_path, fake_openai, fake_feishu):
    """Feishu refuses an app's sends past its per-second limit (the fake enforces it). Six chats writing at
    once are each answered once, in their card, without one refusal: the channel paces its sends under the
    app's budget (one a second here, the fake allows three, so scheduling delays cannot crowd them together).
    Core waits for the queue of sends (``delivery_wait_timeout``; the harness's three seconds would not)."""
    fake_openai.default = Text("Hello there.")
    fake_feishu.enforce_limits(app_sends=3, chat_sends=100, card_updates=100)
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook", app_sends_per_second=1,
                             core={"delivery_wait_timeout": 60.0})
    chats = [f"oc_burst{i}" for i in range(6)]
    try:
        for chat in chats:
            fake_feishu.chat(chat, "p2p")
        await asyncio.gather(*(t.say("hi", chat=chat, chat_type="p2p") for chat in chats))
        await t.settle(timeout=60)
    finally:
        await t.close()
    assert [c.route for c in fake_feishu.calls_to("message.create", "message.reply") if c.status != 200] == []
    assert {chat: t.texts(chat) for chat in chats} == {chat: ["Hello there."] for chat in chats}
    assert every_card_closed(fake_feishu)


async def test_the_apps_rate_limit_on_a_send_pauses_every_chats_sends_however_long(tmp_path, fake_openai, fake_feishu):
    """Feishu answers a send past the app's limit with 99991400 and the seconds to wait (``x-ogw-ratelimit-reset``,
    often longer than one request may take). Every send of the app then waits that out, the other chat's too
    (the sends are a second apart here, so the other chat's would come during the pause), and the wait is not
    counted against a call's bound (two seconds here, the reset seven): each chat is answered once, in its
    card, and no send reaches the platform before the reset has passed."""
    fake_openai.default = Text("Hello there.")
    refusal = fake_feishu.rate_limit("message.reply", reset=7, nth=1)
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook", app_sends_per_second=1,
                             call_timeout=2.0, core={"delivery_wait_timeout": 60.0})
    chats = ["oc_paused0", "oc_paused1"]
    try:
        for chat in chats:
            fake_feishu.chat(chat, "p2p")
        await asyncio.gather(*(t.say("hi", chat=chat, chat_type="p2p") for chat in chats))
        await t.settle(timeout=60)
    finally:
        await t.close()
    assert refusal.hits == 1
    assert {chat: t.texts(chat) for chat in chats} == {chat: ["Hello there."] for chat in chats}
    sends = fake_feishu.calls_to("message.create", "message.reply")
    [refused] = [c for c in sends if c.status != 200]
    assert [c for c in sends if refused.at < c.at < refused.at + 7] == []
    assert every_card_closed(fake_feishu)


async def test_a_long_plain_reply_taken_in_part_is_completed_later_without_repeating_the_part_shown(
        feishu_bridge, fake_openai, fake_feishu):
    # no card can be sent, so the answer goes as plain post messages, three of them; Feishu takes the first and
    # refuses the rest for a while: the later try sends only the two that are missing, each part shown once
    answer = "\n\n".join(f"Part {i} " + "text " * 2400 for i in range(3))
    fake_openai.script(Text(answer, chunk_size=2000))
    t = await feishu_bridge(core={"redelivery_delays": (0.2, 0.4, 0.8, 1.6)})
    fake_feishu.fail("message.reply", status=400, code=230002, msg="bot not in chat", times=1_000_000,
                     when=lambda c: c.body.get("msg_type") == "interactive")
    outage = [fake_feishu.fail(route, status=503, code=1500, times=1_000_000,
                               when=lambda c: c.body.get("msg_type") == "post" and "Part 0" not in c.body["content"])
              for route in ("message.reply", "message.create")]

    def refused() -> int:
        return sum(1 for c in fake_feishu.calls if (c.body or {}).get("msg_type") == "post" and c.status != 200)

    def parts() -> list[str]:
        return [fake_feishu.text_of(m)[:6] for m in fake_feishu.shown(CHAT)]

    await t.say("go")
    await t.settle()  # the first message was taken, the rest refused
    assert parts() == ["Part 0"]
    before = refused()
    await t.wait_for(lambda: refused() > before, timeout=10)  # a later try, refused as well
    for fault in outage:
        fault.times = 0
    await t.wait_for(lambda: len(parts()) >= 3, timeout=10)
    await t.wait_for(lambda: not any(x.get_name().startswith("redeliver:") for x in asyncio.all_tasks()),
                     timeout=10)
    assert parts() == ["Part 0", "Part 1", "Part 2"]  # each part once, in order
    assert " ".join(fake_feishu.text_of(m) for m in fake_feishu.shown(CHAT)).split() == answer.split()
