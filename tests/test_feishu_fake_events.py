"""The webhook sender through lark-oapi's own dispatcher (decryption, token and signature checks), and the
long-connection fake through the real ``lark.ws.Client`` on its own thread (events, card callbacks, acks,
redelivery, split frames, pings, reconnects)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import lark_oapi as lark
import pytest
from aiohttp import web
from lark_oapi.event.callback.model.p2_card_action_trigger import P2CardActionTrigger, P2CardActionTriggerResponse

from tests.fakes.feishu import FakeLongConnection, WebhookSender, WsClientThread, events
from tests.fakes.feishu.events import Mention

TOKEN = "vt_0123456789abcdef"
KEY = "ek_secret_key_for_tests"
APP = "cli_test_events"


@dataclass
class Received:
    messages: list[lark.im.v1.P2ImMessageReceiveV1] = field(default_factory=list)
    presses: list[P2CardActionTrigger] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)
    fail_next: int = 0

    def on_message(self, data: lark.im.v1.P2ImMessageReceiveV1) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("handler failed")
        self.messages.append(data)

    def on_press(self, data: P2CardActionTrigger) -> P2CardActionTriggerResponse:
        self.presses.append(data)
        value = data.event.action.value if data.event and data.event.action else None
        return P2CardActionTriggerResponse({"toast": {"type": "success", "content": f"got {value}"}})

    def dispatcher(self, encrypt_key: str = "", token: str = "") -> lark.EventDispatcherHandler:
        return (lark.EventDispatcherHandler.builder(encrypt_key, token)
                .register_p2_im_message_receive_v1(self.on_message)
                .register_p2_card_action_trigger(self.on_press).build())


# ---- webhook -----------------------------------------------------------------------------------------


@pytest.fixture
async def webhook() -> AsyncIterator[tuple[WebhookSender, Received, WebhookSender]]:
    """An aiohttp endpoint that hands each request to lark-oapi's dispatcher (off the loop: it is
    synchronous), a sender with the app's keys, and one with no encrypt key for the plain-mode app."""
    received = Received()
    encrypted = received.dispatcher(KEY, TOKEN)
    plain = received.dispatcher("", TOKEN)

    async def handle(request: web.Request) -> web.Response:
        raw = lark.RawRequest()
        raw.uri = request.path
        raw.body = await request.read()
        raw.headers = dict(request.headers)
        dispatcher = encrypted if request.path == "/encrypted" else plain
        resp = await asyncio.to_thread(dispatcher.do, raw)
        return web.Response(status=resp.status_code, body=resp.content, content_type="application/json")

    app = web.Application()
    app.router.add_post("/encrypted", handle)
    app.router.add_post("/plain", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield (WebhookSender(f"{base}/encrypted", TOKEN, APP, KEY), received,
               WebhookSender(f"{base}/plain", TOKEN, APP))
    finally:
        await runner.cleanup()


async def test_an_encrypted_signed_event_reaches_the_handler_with_its_fields(webhook):
    sender, received, _ = webhook
    event = sender.message("@_user_1 hello there", chat_type="group", message_id="om_abc", event_id="ev_1",
                           mentions=[Mention("chatbridge", "ou_bot")], root_id="om_root", parent_id="om_root")
    sent = await sender.send(event)
    assert sent.status == 200 and sent.json() == {"msg": "success"}
    [got] = received.messages
    assert got.header.event_id == "ev_1" and got.header.token == TOKEN
    message = got.event.message
    assert (message.message_id, message.chat_type, message.root_id) == ("om_abc", "group", "om_root")
    assert message.mentions[0].key == "@_user_1" and message.mentions[0].id.open_id == "ou_bot"
    assert got.event.sender.sender_id.open_id == events.DEFAULT_USER


async def test_url_verification_plain_and_encrypted_echo_the_challenge(webhook):
    sender, _, plain = webhook
    for s in (sender, plain):
        sent = await s.send(s.url_verification(challenge="c-123"))
        assert (sent.status, sent.json()) == (200, {"challenge": "c-123"})


@pytest.mark.parametrize("attack", ["wrong_token", "bad_signature", "other_key", "undecryptable", "unsigned"])
async def test_forged_requests_are_refused_before_any_handler_runs(webhook, attack):
    sender, received, _ = webhook
    options: dict[str, Any] = {"bad_signature": attack == "bad_signature", "undecryptable": attack == "undecryptable",
                               "sign": attack != "unsigned"}
    if attack == "other_key":
        options["encrypt_with"] = "not-the-app-key"
    event = sender.message("hi", token="forged" if attack == "wrong_token" else None)
    sent = await sender.send(event, **options)
    assert sent.status == 500
    assert received.messages == []


async def test_a_plain_event_with_a_wrong_token_is_refused(webhook):
    _, received, plain = webhook
    assert (await plain.send(plain.message("hi", token="forged"))).status == 500
    assert (await plain.send(plain.message("hi"))).status == 200
    assert len(received.messages) == 1


async def test_a_card_callback_over_the_webhook_answers_with_the_handlers_toast(webhook):
    sender, received, _ = webhook
    sent = await sender.send(sender.card_action({"ap": "r1", "d": "allow"}, message_id="om_card", chat_id="oc_1"))
    assert sent.status == 200
    assert sent.json() == {"toast": {"type": "success", "content": "got {'ap': 'r1', 'd': 'allow'}"}}
    [press] = received.presses
    assert press.event.context.open_message_id == "om_card" and press.event.operator.open_id == events.DEFAULT_USER


# ---- long connection ---------------------------------------------------------------------------------


@dataclass
class Running:
    fake: FakeLongConnection
    received: Received
    thread: WsClientThread


@pytest.fixture
async def longconn() -> AsyncIterator[Running]:
    received = Received()
    async with FakeLongConnection(APP, "app-secret", ping_interval=0.1) as fake:
        client = lark.ws.Client(APP, "app-secret", event_handler=received.dispatcher(), domain=fake.base_url,
                                log_level=lark.LogLevel.ERROR)
        thread = WsClientThread(client).start()
        try:
            await fake.wait_connected()
            yield Running(fake, received, thread)
        finally:
            await thread.astop()
        assert thread.error is None


def push_message(fake: FakeLongConnection, text: str, **kw: Any) -> str:
    return fake.push(events.message_event(text, token="", app_id=APP, **kw))


async def test_an_event_runs_the_handler_on_the_clients_thread_and_is_acked(longconn):
    mid = push_message(longconn.fake, "hello", message_id="om_1")
    ack = await longconn.fake.wait_ack(mid)
    assert ack.code == 200 and ack.data is None and ack.biz_rt is not None
    assert [m.event.message.message_id for m in longconn.received.messages] == ["om_1"]
    assert longconn.received.threads == {"lark-ws-client"}  # never the test's event loop thread


async def test_a_card_callback_arrives_on_the_same_connection_and_its_response_rides_on_the_ack(longconn):
    mid = longconn.fake.push(events.card_action_event({"d": "deny"}, token="", app_id=APP, message_id="om_c",
                                                      chat_id="oc_1"))
    ack = await longconn.fake.wait_ack(mid)
    assert ack.code == 200 and ack.data == {"toast": {"type": "success", "content": "got {'d': 'deny'}"}}


async def test_a_failing_handler_acks_500_and_the_redelivered_event_is_handled(longconn):
    longconn.received.fail_next = 1
    mid = push_message(longconn.fake, "again", message_id="om_r", event_id="ev_r")
    assert (await longconn.fake.wait_ack(mid)).code == 500
    longconn.fake.redeliver(mid)
    assert (await longconn.fake.wait_ack(mid, count=2)).code == 200
    [got] = longconn.received.messages
    assert (got.header.event_id, got.event.message.message_id) == ("ev_r", "om_r")


async def test_a_payload_split_over_frames_is_reassembled(longconn):
    text = "long " * 2000
    mid = push_message(longconn.fake, text, message_id="om_split")
    # split frames are acked once (the last part completes the payload)
    assert (await longconn.fake.wait_ack(mid)).code == 200
    mid2 = longconn.fake.push(events.message_event(text, token="", app_id=APP, message_id="om_parts"), parts=3)
    await longconn.fake.wait_ack(mid2)
    assert [m.event.message.message_id for m in longconn.received.messages] == ["om_split", "om_parts"]
    assert '"long long' in longconn.received.messages[1].event.message.content


async def test_pings_are_answered_and_a_dropped_connection_is_reopened(longconn):
    fake = longconn.fake
    await fake.wait_pings(2)
    fake.disconnect()
    await fake.wait_connected(opened=2)
    assert fake.endpoint_requests == 2  # the client asks the endpoint for a fresh URL
    mid = push_message(fake, "after reconnect", message_id="om_after")
    assert (await fake.wait_ack(mid)).code == 200


async def test_a_busy_endpoint_is_retried_until_it_accepts(longconn):
    fake = longconn.fake
    fake.refuse = 1  # "system busy": the SDK keeps trying
    fake.disconnect()
    await fake.wait_for(lambda: fake.endpoint_requests >= 3, 5.0, "retries")
    fake.refuse = 0
    await fake.wait_connected(opened=2)
    mid = push_message(fake, "after the busy spell", message_id="om_after_busy")
    assert (await fake.wait_ack(mid)).code == 200
    assert longconn.received.messages[-1].event.message.message_id == "om_after_busy"
