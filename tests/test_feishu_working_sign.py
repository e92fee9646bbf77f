"""While a message's files download, before its turn has a card, Feishu shows the working reaction on the user's
message (``FeishuChannel.working``): the real FeishuChannel (lark-oapi) against the fake Open API, whose message
resources a test holds, the real core and its media store. The turn's sink takes the reaction over: it goes once
the turn's card shows (where CardKit is refused, the reaction is the turn's sign: it stays until the end), and
none is left behind by the answer or a /stop."""

from __future__ import annotations

import asyncio
import json

from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.harness import P2P, FeishuHarness, every_mode
from tests.fakes.feishu.openapi import Message
from tests.fakes.openai_server import Text
from tests.support.media import jpeg

WORKING = ["Typing"]

pytest_generate_tests = every_mode  # each test on `feishu_bridge` runs over the long connection and the webhook


def image_message(fake: FakeFeishu) -> Message:
    msg = fake.user_message(P2P, chat_type="p2p", msg_type="image", content={"image_key": "img_v3_a"})
    fake.add_resource(msg, "img_v3_a", jpeg(), kind="image", content_type="image/jpeg")
    return msg


async def push(t: FeishuHarness, msg: Message) -> None:
    """Push the user's message (as the mode receives it), without waiting for its answer."""
    _, payload = t.event("", message=msg, chat=P2P, chat_type="p2p", mention=False, message_type=msg.msg_type,
                         content=json.dumps(msg.content, ensure_ascii=False))
    await t.deliver(payload)


def reactions(msg: Message) -> list[str]:
    return list(msg.reactions.values())


async def image_downloading(t: FeishuHarness, fake: FakeFeishu) -> Message:
    """A p2p image message, pushed; returned once the working reaction shows on it and its download is in
    flight (``message_resource.get`` held by the test)."""
    msg = image_message(fake)
    await push(t, msg)
    await t.wait_for(lambda: reactions(msg) == WORKING and fake.in_flight == 1)
    return msg


async def test_the_working_reaction_shows_while_an_image_downloads_and_goes_when_the_card_shows(
        feishu_bridge, fake_openai, fake_feishu):
    held = fake_feishu.hold("message_resource.get")
    answer = asyncio.Event()
    fake_openai.script(Text("a red square", hold=answer, hold_after=0))
    t = await feishu_bridge()
    try:
        msg = await image_downloading(t, fake_feishu)
        assert fake_openai.requests == [] and t.texts(P2P) == []  # still downloading
        held.set()
        # the model is asked and holds its answer: the turn's card ("…") is its sign now, the reaction went
        await t.wait_for(lambda: fake_feishu.count("card.create") == 1 and reactions(msg) == [])
        assert len(fake_openai.requests) == 1
        answer.set()
        await t.settle()
        assert t.texts(P2P) == ["a red square"]
        assert reactions(msg) == [] and fake_feishu.count("reaction.create") == 1
    finally:
        held.set()
        answer.set()


async def test_where_cardkit_is_refused_the_turn_keeps_the_reaction_until_its_answer(
        feishu_bridge, fake_openai, fake_feishu):
    fake_feishu.fail("card.create", status=400, code=99991672, msg="no permission: cardkit:card:write", times=100)
    held = fake_feishu.hold("message_resource.get")
    t = await feishu_bridge()
    try:
        msg = await image_downloading(t, fake_feishu)
        held.set()
        await t.settle()
        assert t.texts(P2P) == ["ok"]
        assert reactions(msg) == []
        # the turn took the download's reaction over: one added, one removed
        assert fake_feishu.count("reaction.create") == 1 and fake_feishu.count("reaction.delete") == 1
    finally:
        held.set()


async def test_a_stop_during_the_download_leaves_no_working_reaction(feishu_bridge, fake_openai, fake_feishu):
    held = fake_feishu.hold("message_resource.get")
    t = await feishu_bridge()
    try:
        msg = await image_downloading(t, fake_feishu)
        _, stop = t.event("/stop", chat=P2P, chat_type="p2p", mention=False)
        await t.deliver(stop)
        await t.settle()
        assert fake_openai.requests == []  # stopped before the model was asked
        assert t.texts(P2P)  # the stopped reply says so
        assert reactions(msg) == []
    finally:
        held.set()


async def test_a_shutdown_during_the_download_leaves_no_working_reaction(feishu_bridge, fake_openai, fake_feishu):
    """The turn ends in its download (the next start answers the message): no sink ever takes the reaction
    over, and it is removed all the same."""
    held = fake_feishu.hold("message_resource.get")
    t = await feishu_bridge()
    try:
        msg = await image_downloading(t, fake_feishu)
        await t.close()
        assert t.texts(P2P) == [] and fake_openai.requests == []  # left to the next start
        assert reactions(msg) == [] and fake_feishu.count("reaction.delete") == 1
    finally:
        held.set()
