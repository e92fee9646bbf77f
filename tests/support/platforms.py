"""Driving a real ``chatbridge run`` through the platform fakes the same way on every platform, for the suites
that run one process against Telegram, Slack and Feishu at once (crash, soak).

Each ``Platform`` says how its ``[channels.<name>]`` table looks, sends a user's message the way the platform
delivers it (and again, the way the platform redelivers one), knows whether the bridge acknowledged every
delivery, and reads back what the chat shows: for each message sent (known by an id in its text), the
terminal things shown in answer to it, ``"answer"`` (the finished, formatted reply ending ``END <id>``) or
``"notice"`` (a restart or shutdown notice). A preview a crash cut off is neither.

Where each platform says which message a bot message answers:
- Telegram: in a group, every bot message replies to the user's message;
- Slack: a channel @mention is answered in a thread rooted at it; later messages of that thread queue
  behind it in the same conversation, and a notice in the thread belongs to the thread's first message
  (the only one a crash can cut off while the others wait);
- Feishu: every reply quotes (``parent_id``) the user's message;
- the web chat: a conversation's history (what its page loads) lists each answer or notice after the
  message it answers; the reply being written and the approvals waiting are in the conversation stream's
  opening ``task_state`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
from aiohttp import web

from tests.fakes.feishu import FakeFeishu, FakeLongConnection, WebhookSender
from tests.fakes.feishu.events import Mention, message_event
from tests.fakes.feishu.openapi import Message as FeishuMessage
from tests.fakes.feishu.openapi import card_buttons
from tests.fakes.slack import EventSender, FakeSlack
from tests.fakes.slack.server import Message as SlackMessage
from tests.fakes.slack.socket import Envelope
from tests.fakes.telegram import FakeTelegram
from tests.support.process import open_approvals

INTERRUPTED = "⚠️ The bridge restarted while answering your last message. Please send it again."
TOO_OLD = "too old to answer"
STOPPED = "⏹ Stopped: the bridge is shutting down"  # how a reply cut short by a shutdown ends, in its own message
RESTARTED = "Denied: the bridge restarted"  # Feishu escapes the full stop in card Markdown
FEISHU_TOKEN = "vt_crash_verification_token"
FEISHU_KEY = "ek_crash_encrypt_key"

Ending = Literal["answer", "notice"]
REFRESH_EVERY = 0.25
"""Seconds between two reads of what the web chat shows while a test polls it (each read is a few requests)."""


def ends_with_id(text: str, ident: str) -> bool:
    """The text ends with ``END <ident>`` (however the platform shows the bold ``END``)."""
    return re.search(rf"END\**\s+{re.escape(ident)}$", text.rstrip()) is not None


def is_notice(text: str) -> bool:
    return INTERRUPTED in text or TOO_OLD in text or STOPPED in text


async def healthz(port: int) -> dict[str, Any]:
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as resp:
            body = await resp.json()
            return body if isinstance(body, dict) else {}
    except (aiohttp.ClientError, ValueError):
        return {}


async def one_origin(routes: dict[str, str]) -> tuple[web.AppRunner, str]:
    """One origin in front of several fakes (Feishu serves the Open API and the long connection's endpoint on
    the same domain): each path prefix is forwarded to its fake."""
    async def forward(request: web.Request) -> web.Response:
        base = next(url for prefix, url in routes.items() if request.path.startswith(prefix))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as s, s.request(
                request.method, base + request.path_qs, headers=headers, data=await request.read()) as resp:
            return web.Response(status=resp.status, body=await resp.read(),
                                content_type=resp.content_type or "application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclass
class Delivery:
    """One delivery of a user's message to the bridge (a redelivery is another ``Delivery`` of the same body)."""

    ident: str
    body: Any
    ref: Any = None
    """The platform's handle: a Slack envelope, a Feishu long-connection frame id, a Telegram update id."""
    status: int | None = None
    """HTTP modes: the bridge's answer (None: no answer yet, or the connection broke)."""
    task: asyncio.Task[None] | None = None
    retries: int = 0
    """HTTP modes: how many times it was sent again (Slack's ``X-Slack-Retry-Num``)."""
    sent_at: float = field(default_factory=time.monotonic)
    """When it was last sent (Slack and Feishu deliver an event again when no ack came in time)."""


class Platform:
    """What the suites need of one platform; see the module docstring."""

    name: str
    state_up: tuple[str, ...]
    """``/healthz`` states of this channel that mean it receives."""
    call_timeout: float = 30.0
    """The channel's ``call_timeout_seconds`` (the bridge's bound on one platform call; 30, the default, unless
    a suite sets it lower): a call left hanging by ``fault(timeout=True)`` hangs longer than this."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.idents: list[str] = []

    def config(self) -> str:
        raise NotImplementedError

    async def up(self, health: dict[str, Any]) -> bool:
        """The bridge receives from this platform (after a start or a restart)."""
        return health.get("channels", {}).get(self.name) in self.state_up

    def restarted(self) -> None:
        """The bridge process was replaced: wait for a new connection before pushing anything."""

    async def refresh(self, *, now: bool = False) -> None:
        """Read what the platform shows, where that takes requests (the web chat's); the other methods then
        answer from what was read. The fakes' platforms show their state at once. Polling callers read at
        most every ``REFRESH_EVERY`` seconds; ``now``: read at once."""

    async def say(self, ident: str, text: str, *, head: str | None = None, wait: bool = True) -> Delivery:
        """Deliver a user's message ``text`` (carrying ``ident``); ``head``: the ident of the message it follows
        in the same conversation (None: it starts one). ``wait``: until the bridge acknowledged it."""
        raise NotImplementedError

    def acked(self, delivery: Delivery) -> bool:
        raise NotImplementedError

    async def redeliver(self, delivery: Delivery, *, wait: bool = True) -> Delivery:
        """The platform delivers the same event again (it got no ack, or sends it once more anyway); ``wait``:
        until the bridge acknowledged it."""
        raise NotImplementedError

    def confirmed(self) -> bool:
        """The bridge acknowledged every delivery: the platform would not deliver any of them again."""
        return all(self.acked(d) for d in self.deliveries)

    def endings(self) -> dict[str, list[Ending]]:
        raise NotImplementedError

    def settled(self) -> bool:
        """Every message sent has ended (answered or given a notice)."""
        return all(self.endings().values())

    def previewing(self, ident: str) -> bool:
        """An unfinished reply to ``ident`` is shown."""
        raise NotImplementedError

    def approval(self, ident: str) -> str | None:
        """The id of the approval request shown in answer to ``ident``, if one with buttons is shown."""
        raise NotImplementedError

    def approval_recorded(self, data_dir: Path, request: str) -> bool:
        return request in open_approvals(data_dir, self.name)

    def approval_closed_by_restart(self, request: str) -> bool:
        raise NotImplementedError

    def live_buttons(self) -> int:
        """How many approval requests still show buttons."""
        raise NotImplementedError

    def describe(self) -> str:
        """What the chat shows, for a failure message."""
        raise NotImplementedError

    def fault(self, rng: random.Random, *, timeout: bool = False) -> str | None:
        """Make the platform misbehave once (a 429 with retry_after, a 5xx, a dropped connection; with
        ``timeout``, maybe a call that hangs past the bridge's bound on a call), unless an earlier fault is
        still pending; returns what was injected."""
        raise NotImplementedError

    async def poke(self, rng: random.Random) -> str | None:
        """A transport fault of the receiving side (a dropped connection), where the platform has one."""
        return None


# ---- Telegram ----------------------------------------------------------------------------------------------


class TelegramPlatform(Platform):
    name = "telegram"
    state_up = ("polling",)

    def __init__(self, tg: FakeTelegram, groups: list[int]) -> None:
        super().__init__()
        self.tg = tg
        self.groups = groups
        self.sent: dict[tuple[int, int], str] = {}  # (chat, user message id) → ident (ids count per chat)
        self.chat_of: dict[str, int] = {}

    def config(self) -> str:
        return f"""
[channels.telegram]
enabled = true
token = "{self.tg.token}"
api_base = "{self.tg.base_url}"
edit_interval_ms = 100
group_policy = "all"
call_timeout_seconds = {self.call_timeout:g}
"""

    async def say(self, ident: str, text: str, *, head: str | None = None, wait: bool = True,
                  chat: int | None = None) -> Delivery:
        chat = chat if chat is not None else (self.chat_of[head] if head else self.groups[0])
        update = self.tg.user_message(text, chat_id=chat, chat_type="group")
        self.sent[(chat, update["message"]["message_id"])] = ident
        self.chat_of[ident] = chat
        self.idents.append(ident)
        d = Delivery(ident, update, ref=update["update_id"])
        self.deliveries.append(d)
        return d

    def acked(self, delivery: Delivery) -> bool:
        # the bridge polled past the update: Telegram will never deliver it again
        return any(c.method == "getUpdates" and int(c.params.get("offset") or 0) > delivery.ref
                   for c in self.tg.calls)

    def confirmed(self) -> bool:
        return not self.deliveries or self.acked(self.deliveries[-1])

    async def redeliver(self, delivery: Delivery, *, wait: bool = True) -> Delivery:
        return delivery  # Telegram never delivers a confirmed update again

    def _shown(self) -> list[tuple[str, Any]]:
        """(the ident it answers, message) for every bot message answering one of ours."""
        return [(self.sent[(chat, m.reply_to)], m) for chat in self.groups for m in self.tg.messages(chat)
                if not m.deleted and (chat, m.reply_to) in self.sent]

    def endings(self) -> dict[str, list[Ending]]:
        found: dict[str, list[Ending]] = {ident: [] for ident in self.idents}
        for ident, m in self._shown():
            if ends_with_id(m.text, ident) and "**" not in m.text:  # formatted: the finished answer
                found[ident].append("answer")
            elif is_notice(m.text):
                found[ident].append("notice")
        return found

    def previewing(self, ident: str) -> bool:
        return any(i == ident and "word" in m.text and "END" not in m.text for i, m in self._shown())

    def approval(self, ident: str) -> str | None:
        return next((str(m.message_id) for i, m in self._shown() if m.buttons and i == ident), None)

    def approval_recorded(self, data_dir: Path, request: str) -> bool:
        return f'"message_id": {request}' in open_approvals(data_dir, self.name)

    def approval_closed_by_restart(self, request: str) -> bool:
        m = next(m for _, m in self._shown() if str(m.message_id) == request)
        return not m.buttons and RESTARTED in m.text

    def live_buttons(self) -> int:
        return sum(1 for chat in self.groups for m in self.tg.messages(chat) if m.buttons and not m.deleted)

    def describe(self) -> str:
        return "\n".join(f"telegram {m.message_id} reply_to={m.reply_to} ({i}): {m.text[-70:]!r}"
                         for i, m in self._shown())

    def fault(self, rng: random.Random, *, timeout: bool = False) -> str | None:
        if any(f.times > 0 for f in self.tg.faults):
            return None
        method = rng.choice(["sendMessage", "editMessageText", "sendChatAction"])
        kind = rng.choice(["429", "5xx"])
        if kind == "429":
            self.tg.fail(method, status=429, description="Too Many Requests: retry after 1", retry_after=1)
        else:
            self.tg.fail(method, status=502, description="Bad Gateway")
        return f"telegram {method} {kind}"


# ---- Slack -------------------------------------------------------------------------------------------------


class SlackPlatform(Platform):
    """Slack in Socket Mode (envelopes over the fake's websocket, redelivered with ``retry_attempt``) or HTTP
    mode (signed POSTs to ``/slack/events``, retried with ``X-Slack-Retry-Num``). A conversation is a thread
    in a channel, started by an @mention (delivered twice, as Slack does: ``app_mention`` and ``message``)."""

    name = "slack"

    def __init__(self, slack: FakeSlack, mode: Literal["socket", "http"], web_port: int,
                 channels: tuple[str, ...] = ("C0GENERAL",)) -> None:
        super().__init__()
        self.slack = slack
        self.mode = mode
        self.state_up = ("connected",) if mode == "socket" else ("serving",)
        self.sender = EventSender(f"http://127.0.0.1:{web_port}/slack/events", slack.signing_secret, timeout=15)
        self.channels = channels
        for channel in channels:
            if channel not in slack.channel_types:
                slack.add_channel(channel, "channel")
        self.thread_of: dict[str, tuple[str, str]] = {}  # ident → (channel, thread ts)
        self.heads: dict[tuple[str, str], str] = {}  # (channel, thread ts) → the ident that began it
        self._connections = 0

    def config(self) -> str:
        # the workspace's update budget raised from the default 50 a minute (as the end-to-end benchmark does):
        # no suite here is about it (tests/test_slack_channel.py paces it), and at 50 a minute the replies of a
        # dozen Slack conversations took a minute to drain
        return f"""
[channels.slack]
enabled = true
mode = "{self.mode}"
bot_token = "{self.slack.bot_token}"
app_token = "{self.slack.app_token}"
signing_secret = "{self.slack.signing_secret}"
api_base = "{self.slack.base_url}"
update_interval_ms = 100
workspace_updates_per_minute = 1200
call_timeout_seconds = {self.call_timeout:g}
"""

    async def up(self, health: dict[str, Any]) -> bool:
        if not await super().up(health):
            return False
        # Socket Mode: the new process's connection is open (the fake sends envelopes on the newest one)
        return self.mode == "http" or (len(self.slack.socket.connections) > self._connections
                                       and self.slack.socket.current is not None)

    def restarted(self) -> None:
        self._connections = len(self.slack.socket.connections)

    async def _deliver(self, d: Delivery, *, retry_num: int | None, wait: bool) -> None:
        if self.mode == "socket":
            before = len(self.slack.socket.acks.get(d.ref.envelope_id, [])) if d.ref is not None else 0
            if d.ref is None:
                d.ref = await self.slack.socket.deliver(d.body)
            else:
                await self.slack.socket.redeliver(d.ref)
            if wait:
                await self.slack.socket.wait_acked(d.ref, timeout=20, count=before + 1)
            return

        async def post() -> None:
            d.status = None
            try:
                sent = await self.sender.event(d.body, retry_num=retry_num)
            except (aiohttp.ClientError, TimeoutError):
                return  # the bridge died before it answered: Slack will retry
            d.status = sent.status

        d.task = asyncio.create_task(post())
        if wait:
            await d.task
            assert d.status == 200, f"Slack event answered {d.status}"

    async def say(self, ident: str, text: str, *, head: str | None = None, wait: bool = True,
                  channel: str | None = None) -> Delivery:
        if head is None:
            channel = channel or self.channels[0]
            as_mention, as_message = self.slack.mention(text, channel=channel)
            ts = as_message["event"]["ts"]
            self.thread_of[ident] = (channel, ts)
            self.heads[(channel, ts)] = ident
            bodies = [as_mention, as_message]
        else:
            channel, ts = self.thread_of[head]
            body = self.slack.user_message(text, channel=channel, thread_ts=ts)
            self.thread_of[ident] = (channel, ts)
            bodies = [body]
        self.idents.append(ident)
        last = None
        for body in bodies:
            last = Delivery(ident, body)
            self.deliveries.append(last)
            await self._deliver(last, retry_num=None, wait=wait)
        assert last is not None
        return last

    def acked(self, delivery: Delivery) -> bool:
        if self.mode == "socket":
            return isinstance(delivery.ref, Envelope) and self.slack.socket.acked(delivery.ref)
        return delivery.status == 200

    async def redeliver(self, delivery: Delivery, *, wait: bool = True) -> Delivery:
        delivery.sent_at = time.monotonic()
        if self.mode == "socket":
            await self._deliver(delivery, retry_num=None, wait=wait)
            return delivery
        delivery.retries += 1
        await self._deliver(delivery, retry_num=delivery.retries, wait=wait)
        return delivery

    def _thread(self, channel: str, ts: str) -> list[SlackMessage]:
        return self.slack.messages(channel, thread_ts=ts)

    def endings(self) -> dict[str, list[Ending]]:
        found: dict[str, list[Ending]] = {ident: [] for ident in self.idents}
        for (channel, ts), head in self.heads.items():
            members = [i for i, where in self.thread_of.items() if where == (channel, ts)]
            for m in self._thread(channel, ts):
                final = not m.streaming and any(b.get("type") == "markdown" for b in m.blocks)
                ident = next((i for i in members if ends_with_id(m.shown, i)), None)
                if ident is not None and final:
                    found[ident].append("answer")
                elif is_notice(m.shown):
                    found[head].append("notice")
        return found

    def previewing(self, ident: str) -> bool:
        return any("word" in m.shown and "END" not in m.shown for m in self._thread(*self.thread_of[ident]))

    def approval(self, ident: str) -> str | None:
        for m in self._thread(*self.thread_of[ident]):
            if any(b.get("type") == "actions" for b in m.blocks):
                return m.ts
        return None

    def approval_recorded(self, data_dir: Path, request: str) -> bool:
        return f'"ts": "{request}"' in open_approvals(data_dir, self.name)

    def approval_closed_by_restart(self, request: str) -> bool:
        m = next(m for c in self.channels for m in self.slack.messages(c) if m.ts == request)
        return not any(b.get("type") == "actions" for b in m.blocks) and RESTARTED in m.shown

    def live_buttons(self) -> int:
        return sum(1 for c in self.channels for m in self.slack.messages(c)
                   if any(b.get("type") == "actions" for b in m.blocks))

    def describe(self) -> str:
        return "\n".join(f"slack {c}/{m.thread_ts} {m.ts} stream={m.stream}: {m.shown[-70:]!r}"
                         for c in self.channels for m in self.slack.messages(c))

    def fault(self, rng: random.Random, *, timeout: bool = False) -> str | None:
        if any(f.times > 0 for f in self.slack.faults):
            return None
        method = rng.choice(["chat.postMessage", "chat.update", "chat.startStream", "chat.appendStream"])
        kind = rng.choice(["429", "5xx", "drop"] + (["timeout"] if timeout else []))
        if kind == "429":
            self.slack.fail(method, "ratelimited", status=429, retry_after=1)
        elif kind == "5xx":
            self.slack.fail(method, "internal_error", status=503, body="<html>503 Service Unavailable</html>")
        elif kind == "timeout":
            self.slack.fail(method, hang=self.call_timeout + 10)  # longer than the call's own timeout
        else:
            self.slack.fail(method, drop=True)
        return f"slack {method} {kind}"

    async def poke(self, rng: random.Random) -> str | None:
        if self.mode != "socket" or self.slack.socket.current is None:
            return None
        await self.slack.socket.drop()  # the SDK reconnects by itself
        return "slack socket dropped"


# ---- Feishu ------------------------------------------------------------------------------------------------


class FeishuPlatform(Platform):
    """Feishu over the long connection (frames pushed by the fake, acked by lark-oapi's client, pushed again
    with the same frame id) or the webhook (encrypted, signed POSTs to ``/feishu/events``, sent again with the
    same event). Conversations are group chats; every message @mentions the bot."""

    name = "feishu"

    def __init__(self, fake: FakeFeishu, mode: Literal["websocket", "webhook"], web_port: int,
                 chats: tuple[str, ...] = ("oc_crash0001",), conn: FakeLongConnection | None = None,
                 origin: str = "") -> None:
        super().__init__()
        assert (mode == "websocket") == (conn is not None)
        self.fake = fake
        self.mode = mode
        self.conn = conn
        self.origin = origin or fake.base_url
        self.state_up = ("connected",) if mode == "websocket" else ("webhook",)
        self.sender = WebhookSender(f"http://127.0.0.1:{web_port}/feishu/events", FEISHU_TOKEN, fake.app_id,
                                    FEISHU_KEY)
        self.chats = chats
        for chat in chats:
            fake.chat(chat)
        self.sent: dict[str, str] = {}  # user message id → ident
        self.chat_of: dict[str, str] = {}
        self._connections = 0

    def config(self) -> str:
        webhook = (f'mode = "webhook"\nverification_token = "{FEISHU_TOKEN}"\nencrypt_key = "{FEISHU_KEY}"\n'
                   if self.mode == "webhook" else "")
        return f"""
[channels.feishu]
enabled = true
app_id = "{self.fake.app_id}"
app_secret = "{self.fake.app_secret}"
domain = "{self.origin}"
stream_interval_ms = 100
call_timeout_seconds = {self.call_timeout:g}
{webhook}"""

    async def up(self, health: dict[str, Any]) -> bool:
        if not await super().up(health):
            return False
        return self.conn is None or (self.conn.connections_opened > self._connections and self.conn.connected > 0)

    def restarted(self) -> None:
        if self.conn is not None:
            self._connections = self.conn.connections_opened

    async def _deliver(self, d: Delivery, *, wait: bool) -> None:
        conn = self.conn
        if conn is not None:
            def acks() -> int:
                return sum(1 for a in conn.acks_for(d.ref) if a.code == 200) if d.ref is not None else 0
            before = acks()
            if d.ref is None:
                d.ref = conn.push(d.body)
            else:
                conn.redeliver(d.ref)
            if wait:
                await conn.wait_for(lambda: acks() > before, 20, f"ack of {d.ident}")
            return

        async def post() -> None:
            d.status = None
            try:
                sent = await self.sender.send(d.body)
            except (aiohttp.ClientError, TimeoutError):
                return  # the bridge died before it answered: Feishu will deliver it again
            d.status = sent.status

        d.task = asyncio.create_task(post())
        if wait:
            await d.task
            assert d.status == 200, f"Feishu event answered {d.status}"

    async def say(self, ident: str, text: str, *, head: str | None = None, wait: bool = True,
                  chat: str | None = None) -> Delivery:
        chat = chat or (self.chat_of[head] if head else self.chats[0])
        msg = self.fake.user_message(chat, text)
        body = message_event(f"@_user_1 {text}", token=FEISHU_TOKEN, app_id=self.fake.app_id, chat_id=chat,
                             message_id=msg.message_id, mentions=[Mention(self.fake.bot_name, self.fake.bot_open_id)])
        self.sent[msg.message_id] = ident
        self.chat_of[ident] = chat
        self.idents.append(ident)
        d = Delivery(ident, body)
        self.deliveries.append(d)
        await self._deliver(d, wait=wait)
        return d

    def acked(self, delivery: Delivery) -> bool:
        if self.conn is not None:
            return delivery.ref is not None and any(a.code == 200 for a in self.conn.acks_for(delivery.ref))
        return delivery.status == 200

    async def redeliver(self, delivery: Delivery, *, wait: bool = True) -> Delivery:
        delivery.sent_at = time.monotonic()
        if self.conn is None:
            delivery.retries += 1
        await self._deliver(delivery, wait=wait)
        return delivery

    def _shown(self) -> list[FeishuMessage]:
        return [m for chat in self.chats for m in self.fake.shown(chat) if m.parent_id in self.sent]

    def _streaming(self, m: FeishuMessage) -> bool:
        card = self.fake.card_of(m)
        return card is not None and card.streaming

    def endings(self) -> dict[str, list[Ending]]:
        found: dict[str, list[Ending]] = {ident: [] for ident in self.idents}
        for m in self._shown():
            assert m.parent_id is not None
            ident = self.sent[m.parent_id]
            text = self.fake.text_of(m)
            if ends_with_id(text, ident) and not self._streaming(m):
                found[ident].append("answer")
            elif is_notice(text):
                found[ident].append("notice")
        return found

    def previewing(self, ident: str) -> bool:
        return any(m.parent_id is not None and self.sent[m.parent_id] == ident and "word" in self.fake.text_of(m)
                   and "END" not in self.fake.text_of(m) for m in self._shown())

    def _buttons(self, m: FeishuMessage) -> bool:
        return m.msg_type == "interactive" and bool(card_buttons(m.content))

    def approval(self, ident: str) -> str | None:
        return next((m.message_id for m in self._shown()
                     if self._buttons(m) and m.parent_id is not None and self.sent[m.parent_id] == ident), None)

    def approval_recorded(self, data_dir: Path, request: str) -> bool:
        return f'"message_id": "{request}"' in open_approvals(data_dir, self.name)

    def approval_closed_by_restart(self, request: str) -> bool:
        m = self.fake.messages[request]
        return not self._buttons(m) and RESTARTED in self.fake.text_of(m)

    def live_buttons(self) -> int:
        return sum(1 for chat in self.chats for m in self.fake.shown(chat) if self._buttons(m))

    def describe(self) -> str:
        return "\n".join(f"feishu {m.message_id} parent={m.parent_id} streaming={self._streaming(m)}: "
                         f"{self.fake.text_of(m)[-70:]!r}" for m in self._shown())

    def fault(self, rng: random.Random, *, timeout: bool = False) -> str | None:
        if any(f.times > 0 for f in self.fake.faults):
            return None
        route = rng.choice(["message.reply", "card.create", "element.content", "card.settings"])
        kind = rng.choice(["429", "5xx"] + (["timeout"] if timeout else []))
        if kind == "429":
            self.fake.rate_limit(route, reset=1)
        elif kind == "5xx":
            self.fake.fail(route, status=502, raw_body="<html>502 Bad Gateway</html>")
        else:
            self.fake.fail(route, hang=self.call_timeout + 10)  # longer than the request's own timeout
        return f"feishu {route} {kind}"

    async def poke(self, rng: random.Random) -> str | None:
        if self.conn is None or not self.conn.connected:
            return None
        self.conn.disconnect()  # lark-oapi's client reconnects through the endpoint again
        return "feishu long connection dropped"


# ---- the web chat ------------------------------------------------------------------------------------------


async def whole_history(http: aiohttp.ClientSession, base: str, sid: str, *,
                        page_size: int = 1000) -> list[dict[str, Any]]:
    """Every message of web session ``sid``, oldest first: the history API gives the newest page, and the
    ones before a message on request, until ``has_more`` says none remain."""
    messages: list[dict[str, Any]] = []
    params = {"limit": str(page_size)}
    for _ in range(10_000):
        async with http.get(f"{base}/api/sessions/{sid}/history", params=params) as resp:
            assert resp.status == 200, resp.status
            page = await resp.json()
        messages[:0] = page["messages"]
        if not page["has_more"] or not page["messages"]:
            return messages
        params = {"limit": str(page_size), "before": str(page["messages"][0]["id"])}
    raise AssertionError(f"the history of {sid} did not end")


class WebPlatform(Platform):
    """The web chat through its HTTP API, as the page uses it: a message is posted with a ``client_id`` (the
    page's retry of a post that got no answer sends the same one again, and must never get a second
    answer); a conversation is a web session, begun by its head message. What each shows is read by
    ``refresh``: the history, and the opening ``task_state`` of the conversation's event stream."""

    name = "web"
    state_up = ("serving",)
    ACCEPTED = ("queued", "duplicate")
    """The answers meaning the message is stored (``duplicate``: it was, by an earlier post of it)."""

    def __init__(self, web_port: int) -> None:
        super().__init__()
        self.base = f"http://127.0.0.1:{web_port}"
        self.session_of: dict[str, str] = {}  # ident → web session id
        self.answers: dict[int, list[str]] = {}  # id(delivery) → the status of each post that got one
        self.history: dict[str, list[dict[str, Any]]] = {}  # session → messages, as last read
        self.task_state: dict[str, dict[str, Any]] = {}  # session → its stream's opening task_state
        self.asked: dict[str, tuple[str, int]] = {}  # approval call id → (session, restarts when it was asked)
        self.pressed: dict[str, int] = {}  # call id → the HTTP status of a press after a restart
        self.restarts = 0
        self.read_at = -REFRESH_EVERY

    def config(self) -> str:
        return ""  # the web chat is served on [web] port whenever the bridge runs

    def restarted(self) -> None:
        self.restarts += 1
        self.read_at = -REFRESH_EVERY  # nothing read before the restart is news

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http, \
                http.post(self.base + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def _deliver(self, d: Delivery, *, wait: bool) -> None:
        async def post() -> None:
            try:
                status, answer = await self._post(f"/api/sessions/{d.ref}/messages", d.body)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return  # no answer (the bridge died, or is not up yet): the page sends it again
            d.status = status
            if status == 202:
                self.answers.setdefault(id(d), []).append(answer["status"])

        d.task = asyncio.create_task(post())
        if wait:
            await d.task
            assert self.acked(d), f"web: {d.ident} answered {d.status} {self.answers.get(id(d))}"

    async def say(self, ident: str, text: str, *, head: str | None = None, wait: bool = True) -> Delivery:
        if head is None:
            status, created = await self._post("/api/sessions", {})
            assert status == 201, (status, created)
            self.session_of[ident] = created["id"]
        else:
            self.session_of[ident] = self.session_of[head]
        self.idents.append(ident)
        d = Delivery(ident, {"text": text, "client_id": ident}, ref=self.session_of[ident])
        self.deliveries.append(d)
        await self._deliver(d, wait=wait)
        return d

    def acked(self, delivery: Delivery) -> bool:
        return any(a in self.ACCEPTED for a in self.answers.get(id(delivery), []))

    async def redeliver(self, delivery: Delivery, *, wait: bool = True) -> Delivery:
        stored = self.acked(delivery)
        delivery.sent_at = time.monotonic()
        delivery.retries += 1
        await self._deliver(delivery, wait=wait)
        if wait and stored:  # a resend of a stored message is recognised, across a restart too
            assert self.answers[id(delivery)][-1] == "duplicate", (delivery.ident, self.answers[id(delivery)])
        return delivery

    async def refresh(self, *, now: bool = False) -> None:
        if not now and time.monotonic() - self.read_at < REFRESH_EVERY:
            return
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            for sid in dict.fromkeys(self.session_of.values()):
                self.history[sid] = await whole_history(http, self.base, sid)
                async with http.get(f"{self.base}/api/sessions/{sid}/stream") as resp:
                    assert resp.status == 200, resp.status
                    async for line in resp.content:  # the opening task_state is the first data line
                        if line.startswith(b"data: "):
                            self.task_state[sid] = json.loads(line[len(b"data: "):])
                            break
            for call_id, (sid, asked_in) in self.asked.items():
                if asked_in < self.restarts and call_id not in self.pressed:  # a late press, after the restart
                    async with http.post(f"{self.base}/api/sessions/{sid}/approvals/{call_id}",
                                         json={"decision": "allow"}) as resp:
                        self.pressed[call_id] = resp.status
        self.read_at = time.monotonic()

    def _turns(self) -> list[tuple[str, dict[str, Any]]]:
        """(the ident it answers, message) for every assistant message of the history: it answers the user
        message before it."""
        found = []
        for sid in dict.fromkeys(self.session_of.values()):
            current = None
            for m in self.history.get(sid, []):
                if m["role"] == "user":
                    said = re.search(r"\b(?:ask|slow|quick|say) (\S+)", m["content"])
                    current = said.group(1) if said else None
                elif m["role"] == "assistant" and m["content"] and current is not None:
                    found.append((current, m))
        return found

    def endings(self) -> dict[str, list[Ending]]:
        found: dict[str, list[Ending]] = {ident: [] for ident in self.idents}
        for ident, m in self._turns():
            if m["kind"] == "notice" and is_notice(m["content"]):
                found.setdefault(ident, []).append("notice")
            elif m["kind"] == "assistant" and ends_with_id(m["content"], ident):
                found.setdefault(ident, []).append("answer")
        return found

    def _running(self, ident: str) -> dict[str, Any] | None:
        turn = self.task_state.get(self.session_of[ident], {}).get("turn")
        return turn if isinstance(turn, dict) else None

    def previewing(self, ident: str) -> bool:
        turn = self._running(ident)
        return turn is not None and "word" in turn["text"] and "END" not in turn["text"]

    def approval(self, ident: str) -> str | None:
        sid = self.session_of[ident]
        waiting = self.task_state.get(sid, {}).get("approvals") or []
        if not waiting:
            return None
        call_id = str(waiting[0]["call_id"])
        self.asked.setdefault(call_id, (sid, self.restarts))
        return call_id

    def approval_recorded(self, data_dir: Path, request: str) -> bool:
        return True  # nothing to record: the page's approval card comes from the running turn alone

    def approval_closed_by_restart(self, request: str) -> bool:
        sid, _ = self.asked[request]
        waiting = [a["call_id"] for a in self.task_state.get(sid, {}).get("approvals") or []]
        # the card is gone (nothing waits), and a late press answers that nothing with that id waits (404)
        return request not in waiting and self.pressed.get(request) == 404

    def live_buttons(self) -> int:
        return sum(len(state.get("approvals") or []) for state in self.task_state.values())

    def describe(self) -> str:
        return "\n".join(f"web {sid} {m['role']}/{m['kind']}: {m['content'][-70:]!r}"
                         for sid, messages in self.history.items() for m in messages)


@contextlib.asynccontextmanager
async def feishu_fakes(mode: Literal["websocket", "webhook"]
                       ) -> AsyncIterator[tuple[FakeFeishu, FakeLongConnection | None, str]]:
    """The Feishu fakes for ``mode``: the Open API, and for the long connection its fake behind one origin
    with the Open API (the bridge has one ``domain`` for both). Yields (Open API, long connection, origin)."""
    async with FakeFeishu() as fake:
        if mode == "webhook":
            yield fake, None, fake.base_url
            return
        async with FakeLongConnection(fake.app_id, fake.app_secret) as conn:
            runner, origin = await one_origin({"/open-apis/": fake.base_url, "/callback/": conn.base_url})
            try:
                yield fake, conn, origin
            finally:
                await runner.cleanup()


@dataclass
class Bridge:
    """The platforms one ``chatbridge run`` serves, and the ``[web]`` port it listens on."""

    platforms: list[Platform]
    port: int

    def config(self) -> str:
        return "".join(p.config() for p in self.platforms)

    async def up(self) -> bool:
        health = await healthz(self.port)
        if not health:
            return False
        for p in self.platforms:
            if not await p.up(health):
                return False
        return True

    def restarted(self) -> None:
        for p in self.platforms:
            p.restarted()

    async def refresh(self, *, now: bool = False) -> None:
        for p in self.platforms:
            await p.refresh(now=now)

    def endings(self) -> dict[str, dict[str, list[Ending]]]:
        return {p.name: p.endings() for p in self.platforms}

    def settled(self) -> bool:
        return all(p.settled() for p in self.platforms)

    def confirmed(self) -> bool:
        return all(p.confirmed() for p in self.platforms)

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.platforms)
