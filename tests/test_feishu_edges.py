"""Edges of the Feishu channel an operator or a user would run into: a replayed webhook request dressed up to
look unstamped, events the bridge does not handle, a reply to an unreadable message that could not be sent,
and one rate-limited token fetch counted once in /metrics. The real FeishuChannel (lark-oapi) against the fake
Open API, receiving over the long connection and over the webhook.

A signed webhook request used to be checked for freshness only when it carried a timestamp, while lark-oapi signs
over timestamp + nonce with a missing header read as "": the old timestamp moved to the front of the nonce
verified, and an old captured request was answered as new. An event without a handler was answered 401 (the
webhook) or 500 (the long connection), so Feishu pushed it again for hours. An unreadable message was marked as
told before the reply was sent, and acknowledged whatever became of the reply: a reply that failed was never
tried again. A 429 on the token fetch several calls waited on was counted once per waiting call."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Throttle
from core.metrics import CallResult
from tests.fakes.feishu import events
from tests.fakes.feishu.harness import CHAT, TOKEN, FeishuHarness, every_mode, feishu_harness
from tests.fakes.feishu.webhook import NONCE, SIGNATURE, TIMESTAMP, Sent
from tests.fakes.openai_server import Text

pytest_generate_tests = every_mode  # each test on `feishu_bridge` runs over the long connection and the webhook

P2P = "oc_p2p_edges"
UNREADABLE = "I can't read this kind of message ({kind}) yet; please send it as text."
NOT_HANDLED = ("im.message.recalled_v1", "im.message.message_read_v1", "im.chat.member.bot.added_v1")


@pytest.fixture
async def hook(tmp_path, fake_openai, fake_feishu) -> AsyncIterator[FeishuHarness]:
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook")
    yield t
    await t.close()


async def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers) as r:
        return r.status


# ---- the webhook's signature ------------------------------------------------------------------------------


@pytest.mark.parametrize("dressed", ["timestamp in the nonce", "timestamp empty", "timestamp not digits"])
async def test_an_old_signed_request_replayed_without_its_timestamp_is_refused(hook, fake_openai, dressed):
    fake_openai.script(Text("answered a stale request"))
    sender = hook.sender
    assert sender is not None
    _, payload = hook.event("hello from 2001")
    body, headers = sender.request(payload, timestamp="1000000000")  # captured 25 years ago
    assert await post(sender.url, body, headers) == 401  # as sent: stale
    replay = {k: v for k, v in headers.items() if k != TIMESTAMP}
    if dressed == "timestamp in the nonce":
        replay[NONCE] = headers[TIMESTAMP] + headers[NONCE]  # signs the same bytes
    elif dressed == "timestamp empty":
        replay[TIMESTAMP] = ""
        replay[NONCE] = headers[TIMESTAMP] + headers[NONCE]
    else:
        replay[TIMESTAMP] = "1e9"  # a number, but not the digits it was signed with
    assert await post(sender.url, body, replay) == 401
    await hook.settle()
    assert fake_openai.requests == [] and hook.texts() == []

    fresh = await sender.send(hook.event("hello from today")[1])  # signed now: answered
    assert fresh.status == 200
    await hook.settle()
    assert hook.texts() == ["answered a stale request"]


# ---- events the bridge does not handle -------------------------------------------------------------------


def not_handled(t: FeishuHarness, event_type: str, token: str = TOKEN) -> dict[str, object]:
    return {"schema": "2.0", "header": events.header(event_type, token=token, app_id=t.fake.app_id),
            "event": {"message_id": "om_gone", "chat_id": CHAT}}


async def test_events_the_bridge_does_not_handle_are_acknowledged_and_logged_once(
        feishu_bridge, fake_openai, fake_feishu, caplog):
    caplog.set_level(logging.INFO, logger="channels.feishu.channel")
    t = await feishu_bridge()
    for event_type in NOT_HANDLED + NOT_HANDLED:  # each type twice
        answer = await t.deliver(not_handled(t, event_type))
        if isinstance(answer, Sent):
            assert (answer.status, answer.json()) == (200, {"msg": "ignored"}), event_type
        else:
            assert answer.code == 200, event_type  # acknowledged: Feishu does not push it again
    for event_type in NOT_HANDLED:
        said = [r for r in caplog.records if r.levelno == logging.INFO and event_type in r.getMessage()]
        assert len(said) == 1, event_type
    await t.settle()
    assert fake_openai.requests == [] and t.texts() == []


async def test_an_event_the_bridge_does_not_handle_with_a_wrong_token_or_signature_is_still_refused(hook):
    sender = hook.sender
    assert sender is not None
    wrong_token = await sender.send(not_handled(hook, "im.message.recalled_v1", token="vt_wrong"))
    assert wrong_token.status == 401
    bad_signature = await sender.send(not_handled(hook, "im.message.recalled_v1"), bad_signature=True)
    assert bad_signature.status == 401
    unsigned = await sender.send(not_handled(hook, "im.message.recalled_v1"), sign=False)
    assert unsigned.status == 401
    body, headers = sender.request(not_handled(hook, "im.message.recalled_v1"))
    del headers[SIGNATURE]
    assert await post(sender.url, body, headers) == 401


# ---- a message it cannot read, whose reply could not be sent ----------------------------------------------


def acknowledged(answer: object) -> bool:
    return answer.status == 200 if isinstance(answer, Sent) else getattr(answer, "code", None) == 200


async def test_a_reply_to_an_unreadable_message_that_failed_leaves_it_unacknowledged_and_the_next_push_tells(
        feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge()
    down = [fake_feishu.fail(route, times=1000) for route in ("message.reply", "message.create")]
    msg, payload = t.event("", chat=P2P, chat_type="p2p", message_type="merge_forward",
                           content=json.dumps({"content": "Merged and Forwarded Message"}))
    first = await t.deliver(payload)
    await t.settle()
    assert sum(f.hits for f in down) >= 1 and t.texts(P2P) == []
    assert not acknowledged(first)  # Feishu pushes it again
    fake_feishu.faults.clear()  # Feishu is back

    again = await t.deliver(payload)
    await t.settle()
    assert acknowledged(again)
    assert t.texts(P2P) == [UNREADABLE.format(kind="merge_forward")]
    [notice] = fake_feishu.shown(P2P)
    assert notice.parent_id == msg.message_id

    third = await t.deliver(payload)  # pushed once more (the ack was lost): not told twice
    await t.settle()
    assert acknowledged(third) and t.texts(P2P) == [UNREADABLE.format(kind="merge_forward")]
    assert fake_openai.requests == []


# ---- /metrics -----------------------------------------------------------------------------------------


async def test_one_429_on_the_token_fetch_several_calls_wait_on_is_counted_once(fake_feishu):
    """Two calls find the token expired at once and wait on the one fetch; Feishu answers it 429. /metrics
    counts one rate-limited attempt for that one answer, and an ``ok`` for each call that then went through."""
    from channels.feishu.api import FeishuApi
    api = FeishuApi(fake_feishu.app_id, fake_feishu.app_secret, fake_feishu.base_url, timeout=5)
    counted: list[CallResult] = []
    calls = Calls(Throttle(), CallPolicy(initial_wait=0.01, max_wait=0.05, timeout=5.0), observe=counted.append)
    messages = [fake_feishu.user_message(CHAT, f"hi {i}") for i in range(2)]
    fake_feishu.rate_limit("token", reset=1, times=1)
    await asyncio.gather(*(calls.call(lambda m=m: api.react(m.message_id, "Typing")) for m in messages))
    answered_429 = [c for c in fake_feishu.calls if c.status == 429]
    assert [c.route for c in answered_429] == ["token"]
    assert counted.count("rate_limited") == len(answered_429) == 1
    assert counted.count("ok") == 2 and "error" not in counted
