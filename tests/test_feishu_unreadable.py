"""Messages of a kind the Feishu channel cannot read (a forwarded conversation, a shared chat or contact, a
vote, a task, …) and the shared location it can. The real FeishuChannel (lark-oapi) against the fake Open API,
receiving over the long connection and over the webhook, the real chain behind it.

Such a message used to be acknowledged and never answered: the user heard nothing. Now its sender is told
once, in a private chat or when the message @mentions the bot in a group; a location becomes text the model
answers."""

from __future__ import annotations

import json
from typing import Any

from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.harness import CHAT, FeishuHarness, every_mode
from tests.fakes.feishu.openapi import Message
from tests.fakes.openai_server import Text

pytest_generate_tests = every_mode  # each test on `feishu_bridge` runs over the long connection and the webhook

UNREADABLE = "I can't read this kind of message ({kind}) yet; please send it as text."
P2P = "oc_p2p_unreadable"
KINDS: dict[str, dict[str, Any]] = {
    "merge_forward": {"content": "Merged and Forwarded Message"},
    "share_chat": {"chat_id": "oc_other"},
    "share_user": {"user_id": "ou_someone"},
    "vote": {"topic": "Lunch?", "options": ["yes", "no"]},
    "todo": {"task_id": "t_1", "summary": {"title": "", "content": []}},
}


def said(request: dict[str, Any]) -> list[str]:
    """What the model was told the user said, oldest first (the runtime context left out)."""
    return [str(m["content"]).split("\n\n[Runtime context]")[0] for m in request["messages"] if m["role"] == "user"]


def unreadable(t: FeishuHarness, kind: str, *, chat: str = P2P, chat_type: str = "p2p", mention: bool = True,
               message: Message | None = None, **kw: Any) -> tuple[Message, dict[str, Any]]:
    """A user's message of ``kind`` (a Feishu message type) and the event Feishu pushes for it."""
    return t.event("", chat=chat, chat_type=chat_type, mention=mention, message=message, message_type=kind,
                   content=json.dumps(KINDS.get(kind, {})), **kw)


def notices(fake: FakeFeishu, chat: str) -> list[Message]:
    return [m for m in fake.shown(chat) if "can't read this kind of message" in fake.text_of(m)]


async def test_each_kind_it_cannot_read_in_a_private_chat_is_answered_once_with_a_notice(
        feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge()
    asked = {}
    for kind in KINDS:
        msg, payload = unreadable(t, kind)
        asked[kind] = msg
        await t.deliver(payload)
    await t.settle()
    assert t.texts(P2P) == [UNREADABLE.format(kind=kind) for kind in KINDS]
    for notice, kind in zip(fake_feishu.shown(P2P), KINDS, strict=True):
        assert notice.parent_id == asked[kind].message_id  # a reply to the message it is about
    assert fake_openai.requests == []  # nothing reached the model or the history
    assert await t.core.list_sessions(prefix="feishu:") == []


async def test_a_message_it_cannot_read_pushed_again_is_told_once_also_after_a_restart(
        feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge()
    msg, payload = unreadable(t, "merge_forward")
    await t.deliver(payload)
    await t.settle()
    await t.deliver(payload)  # Feishu pushes the same event again (no ack in time)
    _, again = unreadable(t, "merge_forward", message=msg)  # and the same message under a new event id
    await t.deliver(again)
    await t.settle()
    assert t.texts(P2P) == [UNREADABLE.format(kind="merge_forward")]
    await t.close()

    t2 = await feishu_bridge()  # a restart on the same database
    await t2.deliver(payload)
    await t2.settle()
    assert t2.texts(P2P) == [UNREADABLE.format(kind="merge_forward")]
    assert fake_openai.requests == []


async def test_in_a_group_only_a_message_addressed_to_the_bot_is_told(feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge(group_policy="all")
    _, among_ourselves = unreadable(t, "share_chat", chat=CHAT, chat_type="group", mention=False)
    await t.deliver(among_ourselves)
    await t.settle()
    assert t.texts(CHAT) == []  # under "all" too: not a word for every card people share in a group
    asked, to_the_bot = unreadable(t, "share_chat", chat=CHAT, chat_type="group", mention=True)
    await t.deliver(to_the_bot)
    await t.settle()
    [notice] = notices(fake_feishu, CHAT)
    assert fake_feishu.text_of(notice) == UNREADABLE.format(kind="share_chat")
    assert notice.parent_id == asked.message_id
    assert fake_openai.requests == []


async def test_a_sender_not_allowed_is_told_nothing(feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge(allow_from=("u_bob",))
    _, payload = unreadable(t, "merge_forward")  # from alice (u_alice)
    await t.deliver(payload)
    await t.settle()
    assert t.texts(P2P) == [] and fake_openai.requests == []


async def test_a_shared_location_is_read_as_text_and_answered(feishu_bridge, fake_openai, fake_feishu):
    fake_openai.script(Text("That is the office."))
    t = await feishu_bridge()
    _, payload = t.event("", chat=P2P, chat_type="p2p", message_type="location",
                         content=json.dumps({"name": "Office", "longitude": "116.397", "latitude": "39.908"}))
    await t.deliver(payload)
    await t.settle()
    assert t.texts(P2P) == ["That is the office."]
    assert said(fake_openai.requests[0]) == ["[location] Office (latitude 39.908, longitude 116.397)"]
