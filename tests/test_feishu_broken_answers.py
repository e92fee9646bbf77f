"""Feishu answers that are not what lark-oapi expects: a gateway's own answer (an HTTP error whose JSON has no
``code``, a body that is not JSON or not of the answer's shape), a send that may have been carried out before
it failed, and a card Feishu would not render. None of them leaves a stale card that still looks live, shows
the answer twice, or switches streaming cards off for the next replies.

The real chain and the real FeishuChannel (lark-oapi) against the fake Open API; each test asserts what the chat
shows: the bot's messages, each card's text and whether it still streams.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.feishu.harness import CHAT
from tests.fakes.openai_server import Text
from tests.test_feishu_card_end import shown

ANSWER = "The capital of France is **Paris**, a city on the Seine."
NO_CARDKIT = {"status": 400, "code": 99991672, "msg": "no permission: cardkit:card:write", "times": 100}


BROKEN = {
    "a gateway's JSON without a code": {"status": 502, "raw_body": '{"message": "Bad Gateway"}'},
    "a JSON list": {"status": 502, "raw_body": "[]"},
    "JSON null": {"status": 200, "raw_body": "null"},
}


@pytest.mark.parametrize("answer", list(BROKEN))
async def test_a_card_whose_end_is_answered_with_a_broken_answer_does_not_stay_live_and_unfinished(
        feishu_bridge, fake_openai, fake_feishu, answer):
    # the card streams the first words; then every call that would finish it gets an answer lark-oapi cannot
    # take for an error (or cannot read at all): the reply must not end there, frozen mid-word and still live
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=30))
    t = await feishu_bridge()
    try:
        await t.say("capital of France?")
        await t.wait_for(lambda: any(streaming for _, streaming in shown(fake_feishu)))
        for route in ("card.batch_update", "element.content"):
            fake_feishu.fail(route, times=10, **BROKEN[answer])  # type: ignore[arg-type]
        hold.set()
        await t.settle(timeout=30)
        messages = shown(fake_feishu)
        assert not any(streaming for _, streaming in messages), messages
        assert "The capital of France is Paris, a city on the Seine." in [text for text, _ in messages]
    finally:
        await t.close()


async def test_a_reply_feishu_posted_before_an_internal_error_is_shown_once(feishu_bridge, fake_openai, fake_feishu):
    # streaming cards are off, so the answer is one post; Feishu posts it and answers 500 / code 1500 (internal
    # error) every time: the repeats carry the same uuid (Feishu answers them with the first message), and no
    # fallback under a new uuid follows a send that may have been carried out
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge()
    try:
        fake_feishu.fail("card.create", **NO_CARDKIT)  # type: ignore[arg-type]
        fake_feishu.fail("message.reply", status=500, code=1500, apply_first=True, times=10)
        await t.say("capital of France?")
        await t.settle(timeout=30)
        assert len(fake_feishu.shown(CHAT)) == 1
    finally:
        await t.close()


async def test_one_reply_feishu_cannot_render_as_a_card_leaves_cards_on_for_the_next(feishu_bridge, fake_openai,
                                                                                     fake_feishu):
    # the model is slow to start, so each turn opens its streaming card at once as the working sign ("…")
    first, second = asyncio.Event(), asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=first), Text("Lyon is the second city of France, on the Rhône.", hold=second))
    t = await feishu_bridge()
    try:
        fake_feishu.fail("card.create", status=400, code=200220, msg="Failed to generate card content", times=1)
        await t.say("capital of France?")
        await t.wait_for(lambda: fake_feishu.count("card.create") == 1)
        first.set()
        await t.settle(timeout=30)
        await t.say("and the second city?")
        await t.wait_for(lambda: fake_feishu.count("card.create") == 2)  # the next reply streams in a card again
        second.set()
        await t.settle(timeout=30)
        assert shown(fake_feishu)[-1] == ("Lyon is the second city of France, on the Rhône.", False)
    finally:
        first.set()
        second.set()
        await t.close()


async def test_a_card_whose_post_never_got_an_answer_does_not_stay_live_beside_the_answer(feishu_bridge, fake_openai,
                                                                                          fake_feishu):
    # the streaming card is posted, but every answer to its post comes too late: the card's message id is never
    # known, and the answer goes out as a post below it; the card, in the chat all the same, must stop looking live
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=0))
    t = await feishu_bridge(call_timeout=0.5)
    try:
        fake_feishu.fail("message.reply", hang=1.0, apply_first=True, times=50,
                         when=lambda c: "card_id" in str((c.body or {}).get("content")))
        await t.say("capital of France?")
        await t.wait_for(lambda: fake_feishu.count("message.reply") >= 1)
        hold.set()
        await t.settle(timeout=30)
        messages = shown(fake_feishu)
        assert not any(streaming for _, streaming in messages), messages
        assert messages[-1][0] == "The capital of France is Paris, a city on the Seine."
    finally:
        hold.set()
        await t.close()


async def test_an_answer_sent_again_after_its_delivery_was_left_unsure_is_not_shown_twice(feishu_bridge, fake_openai,
                                                                                          fake_feishu):
    # the reply's card is refused, and its plain fallback is posted but every answer to it is an internal
    # error: the turn stays undelivered, and the next start sends it again. Under the same uuid (derived from the
    # user's message and the part), Feishu answers that with the message already posted
    fake_openai.script(Text(ANSWER))
    t = await feishu_bridge()
    try:
        fake_feishu.fail("card.create", **NO_CARDKIT)  # type: ignore[arg-type]
        fake_feishu.fail("message.reply", status=400, code=230001, msg="refused", times=10,
                         when=lambda c: (c.body or {}).get("msg_type") == "interactive")
        fake_feishu.fail("message.reply", status=500, code=1500, apply_first=True, times=3,
                         when=lambda c: (c.body or {}).get("msg_type") == "post")
        await t.say("capital of France?")
        await t.settle(timeout=30)
        assert len(fake_feishu.shown(CHAT)) == 1
        [undelivered] = await t.core.store.undelivered_turns(0)
        await t.core.redeliver(undelivered)  # what the next start does
        assert len(fake_feishu.shown(CHAT)) == 1
        assert await t.core.store.undelivered_turns(0) == []
    finally:
        await t.close()
