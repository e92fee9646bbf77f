"""The Slack fakes, driven by the real slack_sdk and slack-bolt clients: every Web API method the channel uses, the
error shapes Slack answers with, stream expiry, Socket Mode envelopes/acks/reconnects, and signed HTTP events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncApp
from slack_sdk.errors import SlackApiError
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web.async_client import AsyncWebClient

from tests.fakes.slack import EventSender, FakeSlack


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def web_client(slack: FakeSlack, token: str | None = None, **kw: Any) -> AsyncWebClient:
    kw.setdefault("retry_handlers", [])
    return AsyncWebClient(token=token or slack.bot_token, base_url=slack.base_url, **kw)


async def api_error(coro: Any) -> SlackApiError:
    with pytest.raises(SlackApiError) as info:
        await coro
    return info.value


# ---- Web API ---------------------------------------------------------------------------------------------


async def test_auth_and_token_errors_come_back_as_slack_api_errors(fake_slack: FakeSlack) -> None:
    me = await web_client(fake_slack).auth_test()
    assert (me["user_id"], me["bot_id"], me["team_id"]) == (fake_slack.bot_user_id, fake_slack.bot_id, "T0TEAM")

    bad = await api_error(web_client(fake_slack, token="xoxb-not-ours").auth_test())
    assert bad.response["error"] == "invalid_auth" and bad.response.status_code == 200
    missing = await api_error(AsyncWebClient(base_url=fake_slack.base_url).auth_test())
    assert missing.response["error"] == "not_authed"
    wrong_kind = await api_error(web_client(fake_slack, token=fake_slack.app_token).chat_postMessage(
        channel="D0ALICE", text="hi"))
    assert wrong_kind.response["error"] == "not_allowed_token_type"
    assert fake_slack.calls[0].token == fake_slack.bot_token  # sent as Authorization: Bearer


async def test_post_update_delete_show_what_a_user_sees(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    posted = await client.chat_postMessage(channel="D0ALICE", text="draft")
    ts = posted["ts"]
    await client.chat_update(channel="D0ALICE", ts=ts, text="fin", blocks=[{"type": "markdown", "text": "**final**"}])
    assert fake_slack.visible("D0ALICE") == ["**final**"]
    await client.chat_update(channel="D0ALICE", ts=ts, text="plain again")  # text alone drops the blocks
    message = fake_slack.message("D0ALICE", ts)
    assert (message.shown, message.blocks) == ("plain again", [])
    with pytest.warns(UserWarning, match="top-level `text`"):  # slack_sdk warns, Slack accepts it
        await client.chat_update(channel="D0ALICE", ts=ts, blocks=[{"type": "markdown", "text": "md"}])
    assert (message.text, message.shown) == ("plain again", "md")  # blocks alone keep the text
    assert [text for text, _ in message.edits] == ["draft", "fin", "plain again"]

    await client.chat_delete(channel="D0ALICE", ts=ts)  # slack_sdk sends this one as query parameters
    assert fake_slack.visible("D0ALICE") == []
    gone = await api_error(client.chat_update(channel="D0ALICE", ts=ts, text="x"))
    assert gone.response["error"] == "message_not_found"
    assert (await api_error(client.chat_delete(channel="D0ALICE", ts=ts))).response["error"] == "message_not_found"
    assert (await api_error(client.chat_postMessage(channel="C0NOPE", text="x"))).response["error"] \
        == "channel_not_found"


async def test_threads_and_history(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    root = fake_slack.mention("hello")[1]["event"]["ts"]
    await client.chat_postMessage(channel="C0GENERAL", text="answer", thread_ts=root)
    assert fake_slack.visible("C0GENERAL", thread_ts=root) == ["answer"]
    assert fake_slack.visible("C0GENERAL", thread_ts=None) == []
    replies = await client.conversations_replies(channel="C0GENERAL", ts=root)
    assert [m["text"] for m in replies["messages"]] == ["<@U0BOT> hello", "answer"]
    user = await client.users_info(user="U0ALICE")
    assert user["user"]["name"] == "alice"
    assert (await api_error(client.users_info(user="U0NOBODY"))).response["error"] == "user_not_found"


async def test_message_limits_as_slack_enforces_them(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    ts = (await client.chat_postMessage(channel="D0ALICE", text="x"))["ts"]
    await client.chat_update(channel="D0ALICE", ts=ts, text="a" * 4000)
    too_long = await api_error(client.chat_update(channel="D0ALICE", ts=ts, text="a" * 4001))
    assert too_long.response["error"] == "msg_too_long"

    big = await client.chat_postMessage(channel="D0ALICE", text="b" * 40_001)  # posted, but cut
    assert len(fake_slack.message("D0ALICE", big["ts"]).text) == 40_000
    assert big["response_metadata"]["warnings"] == ["message_truncated"]

    md = await client.chat_postMessage(channel="D0ALICE", markdown_text="**bold**")
    assert fake_slack.message("D0ALICE", md["ts"]).blocks == [{"type": "markdown", "text": "**bold**"}]
    conflict = await api_error(client.chat_postMessage(channel="D0ALICE", markdown_text="x", text="y"))
    assert conflict.response["error"] == "markdown_text_conflict"
    halves = [{"type": "markdown", "text": "c" * 6000}, {"type": "markdown", "text": "c" * 6001}]
    blocks_long = await api_error(client.chat_postMessage(channel="D0ALICE", text="t", blocks=halves))
    assert blocks_long.response["error"] == "msg_blocks_too_long"
    bad = await api_error(client.chat_postMessage(channel="D0ALICE", text="t", blocks=[{"type": "nonsense"}]))
    assert bad.response["error"] == "invalid_blocks"
    with pytest.warns(UserWarning):
        empty = await api_error(client.chat_postMessage(channel="D0ALICE"))
    assert empty.response["error"] == "no_text"


async def test_only_the_bots_messages_can_be_changed(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    users_ts = fake_slack.user_message("mine")["event"]["ts"]
    assert (await api_error(client.chat_update(channel="D0ALICE", ts=users_ts, text="x"))).response["error"] \
        == "cant_update_message"
    assert (await api_error(client.chat_delete(channel="D0ALICE", ts=users_ts))).response["error"] \
        == "cant_delete_message"


async def test_reactions_status_and_ephemeral(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    ts = fake_slack.user_message("question")["event"]["ts"]
    await client.reactions_add(channel="D0ALICE", name="hourglass_flowing_sand", timestamp=ts)
    assert fake_slack.message("D0ALICE", ts).reactions == {"hourglass_flowing_sand": ["U0BOT"]}
    again = await api_error(client.reactions_add(channel="D0ALICE", name="hourglass_flowing_sand", timestamp=ts))
    assert again.response["error"] == "already_reacted"
    await client.reactions_remove(channel="D0ALICE", name="hourglass_flowing_sand", timestamp=ts)
    assert fake_slack.message("D0ALICE", ts).reactions == {}
    none = await api_error(client.reactions_remove(channel="D0ALICE", name="hourglass_flowing_sand", timestamp=ts))
    assert none.response["error"] == "no_reaction"

    await client.assistant_threads_setStatus(channel_id="D0ALICE", thread_ts=ts, status="is thinking…")
    assert fake_slack.statuses[-1]["status"] == "is thinking…"
    bad_thread = await api_error(client.assistant_threads_setStatus(channel_id="D0ALICE", thread_ts="1.2", status="x"))
    assert bad_thread.response["error"] == "invalid_thread_ts"

    await client.chat_postEphemeral(channel="C0GENERAL", user="U0BOB", text="not yours")
    assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0BOB", "not yours")]
    assert fake_slack.visible("C0GENERAL") == []  # nobody else sees it


# ---- native streaming ---------------------------------------------------------------------------------------


async def test_stream_start_append_stop(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    ts = fake_slack.user_message("tell me")["event"]["ts"]
    started = await client.chat_startStream(channel="D0ALICE", thread_ts=ts, markdown_text="Hel")
    sts = started["ts"]
    await client.chat_appendStream(channel="D0ALICE", ts=sts, markdown_text="lo **wor")
    conflict = await api_error(client.chat_update(channel="D0ALICE", ts=sts, text="x"))
    assert conflict.response["error"] == "streaming_state_conflict"
    await client.chat_stopStream(channel="D0ALICE", ts=sts, markdown_text="ld**")
    assert fake_slack.visible("D0ALICE", thread_ts=ts) == ["Hello **world**"]
    after = await api_error(client.chat_appendStream(channel="D0ALICE", ts=sts, markdown_text="more"))
    assert after.response["error"] == "message_not_in_streaming_state"
    await client.chat_update(channel="D0ALICE", ts=sts, text="edited after the stream")  # allowed again


async def test_the_sdk_stream_helper_drives_the_fake(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    ts = fake_slack.user_message("tell me")["event"]["ts"]
    stream = await client.chat_stream(channel="D0ALICE", thread_ts=ts, buffer_size=8)
    for piece in ("one ", "two ", "three ", "four"):
        await stream.append(markdown_text=piece)
    await stream.stop()
    assert fake_slack.visible("D0ALICE", thread_ts=ts) == ["one two three four"]
    assert fake_slack.count("chat.startStream") == 1 and fake_slack.count("chat.stopStream") == 1


async def test_streams_in_channels_need_a_recipient(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    root = fake_slack.mention("hi")[0]["event"]["ts"]
    missing = await api_error(client.chat_startStream(channel="C0GENERAL", thread_ts=root, markdown_text="x"))
    assert missing.response["error"] == "missing_recipient_user_id"
    await client.chat_startStream(channel="C0GENERAL", thread_ts=root, markdown_text="x",
                                  recipient_user_id="U0ALICE", recipient_team_id="T0TEAM")


@pytest.mark.parametrize("idle", [True, False])
async def test_an_idle_or_old_stream_is_closed_server_side(idle: bool) -> None:
    clock = FakeClock()
    async with FakeSlack(clock=clock, stream_idle_timeout=300, stream_max_age=600) as slack:
        client = web_client(slack)
        ts = slack.user_message("long job")["event"]["ts"]
        sts = (await client.chat_startStream(channel="D0ALICE", thread_ts=ts, markdown_text="part one"))["ts"]
        if idle:
            clock.t += 301
        else:
            for _ in range(6):  # busy all along, up to the maximum age
                clock.t += 100
                await client.chat_appendStream(channel="D0ALICE", ts=sts, markdown_text=".")
            clock.t += 1
        expired = await api_error(client.chat_appendStream(channel="D0ALICE", ts=sts, markdown_text=" part two"))
        assert expired.response["error"] == "message_not_in_streaming_state"
        stopped = await api_error(client.chat_stopStream(channel="D0ALICE", ts=sts))
        assert stopped.response["error"] == "message_not_in_streaming_state"
        message = slack.message("D0ALICE", sts)
        assert message.stream == "expired" and "part two" not in message.shown
        await client.chat_update(channel="D0ALICE", ts=sts, text="part one part two")  # finished by an edit
        assert slack.visible("D0ALICE", thread_ts=ts) == ["part one part two"]


# ---- error shapes and fault injection ------------------------------------------------------------------------


async def test_rate_limit_is_a_429_with_retry_after(fake_slack: FakeSlack) -> None:
    fake_slack.fail("chat.update", status=429, retry_after=30)
    client = web_client(fake_slack)
    ts = (await client.chat_postMessage(channel="D0ALICE", text="x"))["ts"]
    err = await api_error(client.chat_update(channel="D0ALICE", ts=ts, text="y"))
    assert err.response.status_code == 429
    assert err.response["error"] == "ratelimited"
    assert err.response.headers["Retry-After"] == "30"
    assert fake_slack.count("chat.update") == 1  # the SDK's default handlers do not retry a 429


async def test_switchable_per_channel_rate_rule() -> None:
    clock = FakeClock()
    async with FakeSlack(clock=clock) as slack:
        slack.rate_limit("chat.update", per="channel", limit=1, window=1.0, retry_after=1)
        client = web_client(slack)
        ts = (await client.chat_postMessage(channel="D0ALICE", text="x"))["ts"]
        other = (await client.chat_postMessage(channel="D0BOB", text="x"))["ts"]
        await client.chat_update(channel="D0ALICE", ts=ts, text="1")
        await client.chat_update(channel="D0BOB", ts=other, text="1")  # another channel: its own budget
        limited = await api_error(client.chat_update(channel="D0ALICE", ts=ts, text="2"))
        assert limited.response.status_code == 429 and limited.response.headers["Retry-After"] == "1"
        clock.t += 1.0
        await client.chat_update(channel="D0ALICE", ts=ts, text="2")
        assert slack.message("D0ALICE", ts).text == "2"


async def test_published_tiers_limit_the_whole_workspace() -> None:
    clock = FakeClock()
    async with FakeSlack(clock=clock) as slack:
        slack.enforce_tiers()
        client = web_client(slack)
        posted = []
        for channel in ("D0ALICE", "D0BOB"):
            posted.append((channel, (await client.chat_postMessage(channel=channel, text="x"))["ts"]))
        second = await api_error(client.chat_postMessage(channel="D0ALICE", text="again"))
        assert second.response.status_code == 429  # one post per second per channel
        for i in range(50):  # Tier 3: 50 per minute, counted across channels
            channel, ts = posted[i % 2]
            await client.chat_update(channel=channel, ts=ts, text=str(i))
        over = await api_error(client.chat_update(channel="D0BOB", ts=posted[1][1], text="51"))
        assert over.response.status_code == 429 and over.response.headers["Retry-After"] == "30"
        clock.t += 60
        await client.chat_update(channel="D0BOB", ts=posted[1][1], text="51")


async def test_server_errors_hangs_and_lost_responses(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack, timeout=0.3)
    fake_slack.fail("chat.postMessage", status=503, body="<html>Service Unavailable</html>")
    err = await api_error(client.chat_postMessage(channel="D0ALICE", text="x"))
    assert err.response.status_code == 503

    fake_slack.fail("chat.postMessage", hang=1.0)
    with pytest.raises(TimeoutError):
        await client.chat_postMessage(channel="D0ALICE", text="slow")

    fake_slack.fail("chat.postMessage", error="internal_error", apply_first=True)
    lost = await api_error(client.chat_postMessage(channel="D0ALICE", text="done anyway"))
    assert lost.response["error"] == "internal_error"
    assert fake_slack.visible("D0ALICE") == ["done anyway"]  # carried out, though the caller saw a failure


async def test_faults_by_nth_call_and_predicate(fake_slack: FakeSlack) -> None:
    client = web_client(fake_slack)
    fake_slack.fail("chat.postMessage", error="msg_too_long", nth=2)
    fake_slack.fail("chat.postMessage", error="channel_not_found", when=lambda p: p.get("channel") == "D0BOB",
                    times=5)
    await client.chat_postMessage(channel="D0ALICE", text="1")
    assert (await api_error(client.chat_postMessage(channel="D0ALICE", text="2"))).response["error"] == "msg_too_long"
    await client.chat_postMessage(channel="D0ALICE", text="3")
    bob = await api_error(client.chat_postMessage(channel="D0BOB", text="x"))
    assert bob.response["error"] == "channel_not_found"


async def test_a_dropped_connection_is_retried_by_the_sdk_unless_handlers_are_off(fake_slack: FakeSlack) -> None:
    fake_slack.fail("chat.postMessage", drop=True)
    default = AsyncWebClient(token=fake_slack.bot_token, base_url=fake_slack.base_url)
    await default.chat_postMessage(channel="D0ALICE", text="once")
    assert fake_slack.count("chat.postMessage") == 2  # slack_sdk's default ConnectionErrorRetryHandler resent it

    fake_slack.fail("chat.postMessage", drop=True)
    with pytest.raises(aiohttp.ClientError):
        await web_client(fake_slack).chat_postMessage(channel="D0ALICE", text="never twice")
    assert fake_slack.count("chat.postMessage") == 3


# ---- Socket Mode -----------------------------------------------------------------------------------------------


@pytest.fixture
async def socket_client(fake_slack: FakeSlack) -> AsyncIterator[tuple[SocketModeClient, list[SocketModeRequest]]]:
    client = SocketModeClient(app_token=fake_slack.app_token, web_client=web_client(fake_slack), ping_interval=0.2)
    received: list[SocketModeRequest] = []

    async def listener(c: Any, req: SocketModeRequest) -> None:
        received.append(req)
        await c.send_socket_mode_response(SocketModeResponse(envelope_id=req.envelope_id, payload={"seen": True}))

    client.socket_mode_request_listeners.append(listener)
    await client.connect()
    yield client, received
    await client.close()


async def test_socket_mode_envelopes_acks_and_redelivery(
        fake_slack: FakeSlack, socket_client: tuple[SocketModeClient, list[SocketModeRequest]]) -> None:
    _, received = socket_client
    conn = await fake_slack.socket.wait_connected()
    assert conn.number == 1 and fake_slack.socket.issued == 1
    env = await fake_slack.socket.deliver(fake_slack.user_message("hi"))
    ack = await fake_slack.socket.wait_acked(env)
    assert ack.payload == {"seen": True}
    assert received[0].payload["event"]["text"] == "hi" and received[0].retry_attempt == 0

    await fake_slack.socket.redeliver(env, reason="timeout")
    await fake_slack.socket.wait_acked(env, count=2)
    assert (received[1].envelope_id, received[1].retry_attempt, received[1].retry_reason) == \
        (env.envelope_id, 1, "timeout")


async def test_socket_mode_reconnects_on_disconnect_and_on_drop(
        fake_slack: FakeSlack, socket_client: tuple[SocketModeClient, list[SocketModeRequest]]) -> None:
    _, received = socket_client
    await fake_slack.socket.wait_connected()
    await fake_slack.socket.disconnect("refresh_requested")
    second = await fake_slack.socket.wait_connected(2)
    assert second.number == 2 and fake_slack.socket.issued == 2  # a new URL from apps.connections.open
    env = await fake_slack.socket.deliver(fake_slack.user_message("after refresh"))
    await fake_slack.socket.wait_acked(env)
    assert fake_slack.socket.acks[env.envelope_id][0].connection == 2

    await fake_slack.socket.drop()
    third = await fake_slack.socket.wait_connected(3, timeout=10)
    env = await fake_slack.socket.deliver(fake_slack.user_message("after drop"))
    ack = await fake_slack.socket.wait_acked(env, timeout=10)
    assert ack.connection == third.number
    assert [r.payload["event"]["text"] for r in received] == ["after refresh", "after drop"]


async def test_a_socket_ticket_opens_one_connection(fake_slack: FakeSlack) -> None:
    url = fake_slack.socket.issue_url()
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            hello = await ws.receive_json()
            assert hello["type"] == "hello"
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(url)
        assert info.value.status == 401


async def test_bolt_socket_mode_handler_receives_and_acks(fake_slack: FakeSlack) -> None:
    app = AsyncApp(client=web_client(fake_slack))
    seen: list[dict[str, Any]] = []
    done = asyncio.Event()

    @app.event("message")
    async def on_message(event: dict[str, Any], request: Any) -> None:
        seen.append({"text": event["text"], "retry": request.headers.get("x-slack-retry-num")})
        done.set()

    @app.event("app_mention")
    async def on_mention(event: dict[str, Any]) -> None:
        seen.append({"mention": event["text"]})

    handler = AsyncSocketModeHandler(app, fake_slack.app_token, ping_interval=0.2)
    await handler.connect_async()  # returns once connected; start_async() would sleep forever
    try:
        env = await fake_slack.socket.deliver(fake_slack.user_message("hello bolt"))
        ack = await fake_slack.socket.wait_acked(env)
        await asyncio.wait_for(done.wait(), 5)
        assert ack.payload is None  # an events_api ack carries no payload
        assert seen == [{"text": "hello bolt", "retry": ["0"]}]
        assert fake_slack.count("auth.test") == 1  # bolt's single-team authorization, once
    finally:
        await handler.close_async()


async def test_bolt_over_socket_mode_acks_actions_and_commands_with_payloads(fake_slack: FakeSlack) -> None:
    app = AsyncApp(client=web_client(fake_slack))
    decided: list[tuple[str, str]] = []

    @app.action("approve")
    async def on_approve(ack: Any, body: dict[str, Any], respond: Any) -> None:
        await ack()
        decided.append((body["user"]["id"], body["actions"][0]["value"]))
        await respond(text="Only the person who asked can decide.", response_type="ephemeral",
                      replace_original=False)

    @app.command("/stop")
    async def on_stop(ack: Any, command: dict[str, Any]) -> None:
        await ack(text=f"Stopping ({command['user_id']})")

    handler = AsyncSocketModeHandler(app, fake_slack.app_token, ping_interval=0.2)
    await handler.connect_async()
    try:
        posted = await web_client(fake_slack).chat_postMessage(channel="C0GENERAL", text="Approve?", blocks=[
            {"type": "actions", "block_id": "ap", "elements": [
                {"type": "button", "action_id": "approve", "value": "ref-9",
                 "text": {"type": "plain_text", "text": "Allow"}}]}])
        press = fake_slack.press(fake_slack.message("C0GENERAL", posted["ts"]), "Allow", user="U0BOB")
        env = await fake_slack.socket.deliver(press, "interactive")
        await fake_slack.socket.wait_acked(env)
        await wait_until(lambda: bool(fake_slack.responses))
        assert decided == [("U0BOB", "ref-9")]
        assert fake_slack.responses[0]["text"] == "Only the person who asked can decide."
        assert fake_slack.responses[0]["response_type"] == "ephemeral"

        command = await fake_slack.socket.deliver(fake_slack.slash_command("/stop"), "slash_commands")
        ack = await fake_slack.socket.wait_acked(command)
        assert ack.payload == {"text": "Stopping (U0ALICE)"}
    finally:
        await handler.close_async()


# ---- HTTP mode (signed requests into bolt's aiohttp adapter) -------------------------------------------------


@pytest.fixture
async def bolt_http(fake_slack: FakeSlack) -> AsyncIterator[tuple[EventSender, list[Any]]]:
    app = AsyncApp(client=web_client(fake_slack), signing_secret=fake_slack.signing_secret)
    seen: list[Any] = []

    @app.event("message")
    async def on_message(event: dict[str, Any], request: Any) -> None:
        seen.append(("message", event["text"], request.headers.get("x-slack-retry-num")))

    @app.action("approve")
    async def on_approve(ack: Any, body: dict[str, Any]) -> None:
        await ack()
        seen.append(("action", body["actions"][0]["value"], body["user"]["id"]))

    async def slack_events(request: web.Request) -> web.Response:
        return await to_aiohttp_response(await app.async_dispatch(await to_bolt_request(request)))

    web_app = web.Application()
    web_app.router.add_post("/slack/events", slack_events)
    runner = web.AppRunner(web_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield EventSender(f"http://127.0.0.1:{port}/slack/events", fake_slack.signing_secret), seen
    await runner.cleanup()


async def wait_until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_bolt_http_accepts_signed_events_and_answers_url_verification(
        fake_slack: FakeSlack, bolt_http: tuple[EventSender, list[Any]]) -> None:
    sender, seen = bolt_http
    challenge = await sender.url_verification("abc123")
    assert challenge.status == 200 and challenge.json() == {"challenge": "abc123"}

    payload = fake_slack.user_message("over http")
    assert (await sender.event(payload)).status == 200
    assert (await sender.event(payload, retry_num=1, retry_reason="http_timeout")).status == 200
    await wait_until(lambda: len(seen) == 2)
    assert seen == [("message", "over http", None), ("message", "over http", ["1"])]


@pytest.mark.parametrize("how", ["bad", "missing", "stale"])
async def test_bolt_http_rejects_unsigned_or_stale_requests(
        fake_slack: FakeSlack, bolt_http: tuple[EventSender, list[Any]], how: str) -> None:
    sender, seen = bolt_http
    payload = fake_slack.user_message("forged")
    if how == "stale":
        sent = await sender.event(payload, timestamp=int(time.time()) - 6 * 60)
    else:
        sent = await sender.event(payload, signature=how)  # type: ignore[arg-type]
    assert sent.status == 401
    await asyncio.sleep(0.05)
    assert seen == []


async def test_bolt_http_interactivity_payloads(
        fake_slack: FakeSlack, bolt_http: tuple[EventSender, list[Any]]) -> None:
    sender, seen = bolt_http
    client = web_client(fake_slack)
    posted = await client.chat_postMessage(channel="D0ALICE", text="Approve?", blocks=[
        {"type": "actions", "block_id": "ap", "elements": [
            {"type": "button", "action_id": "approve", "value": "ref-1",
             "text": {"type": "plain_text", "text": "Allow"}}]}])
    press = fake_slack.press(fake_slack.message("D0ALICE", posted["ts"]), "Allow", user="U0BOB")
    sent = await sender.interaction(press)
    assert sent.status == 200
    await wait_until(lambda: bool(seen))
    assert seen == [("action", "ref-1", "U0BOB")]
