"""Benchmark: N concurrent streaming chats end to end, on each platform's fake, the product against a floor.

Every piece runs in a process of its own on 127.0.0.1: the fake OpenAI-compatible model (each reply
``--chunks`` chunks, one every ``--chunk-ms`` ms; ``--llm-processes`` processes serve its port), the platform
(the fake Telegram Bot API, the fake Slack with Socket Mode, the fake Feishu Open API with a webhook sender,
or for the web chat a client that opens each conversation's event stream and posts to it), and the pipeline
measured:

- product: ``chatbridge run`` with a generated config (SQLite, core, the channel, its SDK);
- minimal: the floor, receive → stream from the same model fake (the same ``openai`` SDK call) →
  send/edit through the same throttle (``channels.common.throttle``, the same scopes, intervals and bursts;
  the end takes the chat's burst as the product's does) with the same SDK, and nothing else: no
  persistence, no core, no formatting.

Each pipeline gets ``--chats`` chats that each send one message at once; a turn's latency runs from the
message being available to the bridge (queued on the platform, or posted) to the whole reply being visible on
the platform fake (measured there). CPU seconds and peak RSS are the measured process's own, from
/proc/<pid>/stat and VmHWM of /proc/<pid>/status; platform calls and 429s are counted by the fake, which
enforces its platform's published rate limits (on Telegram the calls are also printed by method).

    python -m tests.bench.e2e                                 # every platform, 100 and 1000 chats
    python -m tests.bench.e2e --quick                         # every platform, 50 chats, 100 chunks
    python -m tests.bench.e2e --platform web --chats 100      # one platform, one size
    python -m tests.bench.e2e --latency 80                    # latency unloaded: 80 turns one at a time

``--latency`` measures what the product adds to a turn's latency where nothing saturates the machine: each
pipeline gets its turns one at a time (the next message once the reply is whole), product and floor
alternating, each on a platform fake of its own; besides the whole turn it times its parts (the message
available → the model's request received → the model's last byte → the reply visible, the model fake and the
platform fake on one clock) and prints the product's p50/p99, the floor's, and the added p50 with a 95 %
bootstrap interval over the paired turns. ``--floor-gate N``: the floor too holds its first message until
the answer has N characters, as the product's first-message gate does (24).

Prints figures; asserts nothing about speed. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench.streaming import (  # noqa: E402
    cpu_seconds,
    peak_rss_mib,
    reply_text,
    serve_llm,
    squash,
    start_child,
    stop_child,
    until_stdin_closes,
)
from tests.support.ports import free_port  # noqa: E402

PLATFORMS = ("telegram", "slack", "feishu", "web")
READY = {"polling", "connected", "webhook", "serving", "ready"}
"""The /healthz states of a channel that receives."""
SLACK_UPDATES_PER_MINUTE = 6000
"""The Slack workspace's budget of message updates in this benchmark (both the product's pacing and the
fake's enforcement); Slack's published floor for chat.update is 50 a minute, which no workspace could share
among 1,000 chats streaming at once."""
FEISHU_TOKEN = "vt_bench_verification_token"
FEISHU_KEY = "ek_bench_encrypt_key"
CHAT_PREFIX = {"telegram": "", "slack": "D", "feishu": "oc_", "web": "s"}
"""Chat ids as each platform spells them (a Telegram chat id is a number)."""
LLM_PROCESSES = 4
"""Processes of the fake model: one process streams a few thousand chunks a second on a shared machine (its
fair share of the CPU), less than 100 chats at 300 chunks in 3 s ask for."""
WEB_UPDATE_INTERVAL = 0.05  # channels.web.channel.UPDATE_INTERVAL


# ---- the platform side: what each platform shows, and when ----------------------------------------------


class Board:
    """When each chat's message was available, when the first of its reply was visible and when its whole
    reply was."""

    def __init__(self) -> None:
        self.expected = ""
        self.queued: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}

    def check(self, chat: str, shown: Callable[[], str]) -> None:
        if chat not in self.queued or chat in self.done:
            return
        text = squash(shown())
        if text and chat not in self.first:
            self.first[chat] = time.monotonic()
        if text == self.expected:
            self.done[chat] = time.monotonic()

    def report(self, chats: list[str], shown: Callable[[str], str]) -> dict[str, Any]:
        unfinished = [c for c in chats if c not in self.done]
        return {"done": len(chats) - len(unfinished),
                "latencies": [self.done[c] - self.queued[c] for c in chats if c in self.done],
                "unfinished": {c: shown(c)[-300:] for c in unfinished[:2]}}


class Side:
    """One platform's fake in this process. ``inject`` makes one user message available to the pipeline;
    ``counts`` is (platform calls, 429s answered) since ``reset``."""

    def __init__(self, board: Board) -> None:
        self.board = board

    async def start(self) -> dict[str, str]:
        raise NotImplementedError

    async def inject(self, chat: str, target: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Anything of its own still open (the fake servers end with the process)."""

    def reset(self) -> None:
        raise NotImplementedError

    def shown(self, chat: str) -> str:
        """What the chat shows of the bot's replies."""
        raise NotImplementedError

    def counts(self) -> tuple[int, int]:
        raise NotImplementedError

    def limited_by(self) -> dict[str, int]:
        """The 429s by method and budget, where the fake tells them apart."""
        return {}

    def by_method(self) -> dict[str, int]:
        """The platform calls counted in ``counts`` by method, where the fake records them."""
        return {}


class TelegramSide(Side):
    async def start(self) -> dict[str, str]:
        from tests.fakes.telegram.server import FakeTelegram

        board = self.board

        side = self

        class Fake(FakeTelegram):
            async def _m_sendMessage(self, p: dict[str, Any]) -> dict[str, Any]:
                result = await super()._m_sendMessage(p)
                board.check(str(p["chat_id"]), lambda: side.shown(str(p["chat_id"])))
                return result

            async def _m_editMessageText(self, p: dict[str, Any]) -> dict[str, Any]:
                result = await super()._m_editMessageText(p)
                board.check(str(p["chat_id"]), lambda: side.shown(str(p["chat_id"])))
                return result

        self.fake = Fake()
        self.fake.enforce_limits()
        await self.fake.start()
        return {"url": self.fake.base_url, "token": self.fake.token}

    async def inject(self, chat: str, target: str) -> None:
        self.fake.user_message("go", chat_id=int(chat), user_id=int(chat))
        self.board.queued[chat] = time.monotonic()

    def reset(self) -> None:
        self.fake.calls = []
        self.fake.limited = 0
        self.fake.limited_by.clear()

    def shown(self, chat: str) -> str:
        return "".join(m.text for m in self.fake.messages(int(chat)))

    def counts(self) -> tuple[int, int]:
        return sum(c.method != "getUpdates" for c in self.fake.calls), self.fake.limited

    def limited_by(self) -> dict[str, int]:
        return {f"{method} per {budget}": n for (method, budget), n in self.fake.limited_by.items()}

    def by_method(self) -> dict[str, int]:
        return dict(collections.Counter(c.method for c in self.fake.calls if c.method != "getUpdates"))


class SlackSide(Side):
    WRITES = ("chat.postMessage", "chat.update", "chat.appendStream", "chat.stopStream", "chat.startStream")

    async def start(self) -> dict[str, str]:
        from tests.fakes.slack.server import FakeSlack

        board = self.board
        side = self

        class Fake(FakeSlack):
            def _reply(self, call: Any, body: dict[str, Any], status: int = 200,
                       headers: dict[str, str] | None = None) -> Any:
                response = super()._reply(call, body, status, headers)
                channel = str(call.params.get("channel") or "")
                if body.get("ok") and call.method in SlackSide.WRITES and channel in board.queued:
                    board.check(channel, lambda: side.shown(channel))
                return response

        self.fake = Fake()
        await self.fake.start()
        # Slack's limits: chat.postMessage about once a second per channel; message updates within the
        # workspace's budget (raised here from Slack's floor, see SLACK_UPDATES_PER_MINUTE)
        self.fake.rate_limit("chat.postMessage", per="channel", limit=1, window=1.0)
        self.fake.rate_limit("chat.update", per="workspace", limit=SLACK_UPDATES_PER_MINUTE, window=60.0)
        # the thinking indicator's methods at Slack's floors for their tiers (per workspace)
        for method, per_minute in (("reactions.add", 50), ("reactions.remove", 20),
                                   ("assistant.threads.setStatus", 50)):
            self.fake.rate_limit(method, per="workspace", limit=per_minute, window=60.0, retry_after=30)
        return {"url": self.fake.base_url, "bot_token": self.fake.bot_token, "app_token": self.fake.app_token}

    async def inject(self, chat: str, target: str) -> None:
        self.fake.add_channel(chat, "im")
        body = self.fake.user_message("go", channel=chat, user=f"U{chat}")
        self.board.queued[chat] = time.monotonic()
        await self.fake.socket.deliver(body, timeout=30)

    def reset(self) -> None:
        self.fake.calls = []

    def shown(self, chat: str) -> str:
        return "".join(m.shown for m in self.fake.channels.get(chat, {}).values() if m.from_bot and not m.deleted)

    def counts(self) -> tuple[int, int]:
        calls = self._counted()
        return len(calls), sum(c.status == 429 for c in calls)

    def by_method(self) -> dict[str, int]:
        return dict(collections.Counter(c.method for c in self._counted()))

    def _counted(self) -> list[Any]:
        """Every Web API call of the run but the Socket Mode connection's own (``auth.test`` counts: before the
        channel authorized events itself, slack-bolt called it for every event of a burst, 0.58 a turn)."""
        return [c for c in self.fake.calls if c.method != "apps.connections.open"]


class FeishuSide(Side):
    async def start(self) -> dict[str, str]:
        from tests.fakes.feishu.openapi import FakeFeishu

        board = self.board
        side = self

        class Fake(FakeFeishu):
            chat_of: dict[str, str] = {}  # noqa: RUF012  (message or card id → chat)
            bot_messages: dict[str, list[str]] = {}  # noqa: RUF012

            def _run(self, call: Any, handler: Any, match: dict[str, str], auth: bool) -> Any:
                data = super()._run(call, handler, match, auth)
                chat = self._chat_of(call, match, data)
                if chat is not None and chat in board.queued:
                    board.check(chat, lambda: side.shown(chat))
                return data

            def _chat_of(self, call: Any, match: dict[str, str], data: Any) -> str | None:
                if call.route in ("message.create", "message.reply") and isinstance(data, dict):
                    message = self.messages.get(str(data.get("message_id")))
                    if message is None:
                        return None
                    self.bot_messages.setdefault(message.chat_id, []).append(message.message_id)
                    card = (message.content.get("data") or {}).get("card_id") if message.content.get(
                        "type") == "card" else None
                    if card:
                        self.chat_of[str(card)] = message.chat_id
                    return message.chat_id
                if "message_id" in match and match["message_id"] in self.messages:
                    return self.messages[match["message_id"]].chat_id
                if "card_id" in match:
                    return self.chat_of.get(match["card_id"])
                return None

        self.fake = Fake().start()
        self.fake.enforce_limits()
        self.senders: dict[str, Any] = {}
        return {"url": self.fake.base_url, "app_id": self.fake.app_id, "app_secret": self.fake.app_secret}

    async def inject(self, chat: str, target: str) -> None:
        from tests.fakes.feishu.webhook import WebhookSender

        sender = self.senders.get(target)
        if sender is None:
            sender = self.senders[target] = WebhookSender(target, FEISHU_TOKEN, self.fake.app_id, FEISHU_KEY)
        user = f"ou_{chat}"
        self.fake.chat(chat, "p2p", user_open_id=user)
        msg = self.fake.user_message(chat, "go", chat_type="p2p", open_id=user)
        payload = sender.message("go", chat_id=chat, chat_type="p2p", message_id=msg.message_id, sender_open_id=user)
        self.board.queued[chat] = time.monotonic()
        sent = await sender.send(payload)
        if sent.status != 200:
            print(f"feishu webhook answered {sent.status}", file=sys.stderr)

    def reset(self) -> None:
        with self.fake._lock:
            self.fake.calls = []

    def shown(self, chat: str) -> str:
        fake = self.fake
        with fake._lock:
            return "".join(fake.text_of(fake.messages[m]) for m in fake.bot_messages.get(chat, ())
                           if not fake.messages[m].deleted)

    def counts(self) -> tuple[int, int]:
        calls = self._counted()
        return len(calls), sum(c.status == 429 or c.code == 230020 for c in calls)

    def by_method(self) -> dict[str, int]:
        return dict(collections.Counter(c.route for c in self._counted()))

    def _counted(self) -> list[Any]:
        return [c for c in self.fake.calls_to() if c.route not in ("token", "bot.info")]

    def limited_by(self) -> dict[str, int]:
        from tests.fakes.feishu.openapi import SENDS

        def budget(call: Any) -> str:
            return "chat" if call.code == 230020 else "app" if call.route in SENDS else "card"

        return dict(collections.Counter(f"{c.route} per {budget(c)}" for c in self._counted()
                                        if c.status == 429 or c.code == 230020))


class WebSide(Side):
    """The web chat's users: each opens its conversation's event stream, posts a message, reads the reply."""

    async def start(self) -> dict[str, str]:
        import aiohttp

        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None))
        self.tasks: set[asyncio.Task[None]] = set()
        self.calls = 0
        self.events = 0
        """``turn`` events the conversations received: the web chat's live updates (its edits)."""
        self.texts: dict[str, str] = {}
        return {}

    async def inject(self, chat: str, target: str) -> None:
        opened = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._converse(chat, target, opened))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        await opened

    async def _converse(self, chat: str, base: str, opened: asyncio.Future[None]) -> None:
        text = ""
        try:
            async with self.http.get(f"{base}/api/sessions/{chat}/stream") as stream:
                await stream.content.readuntil(b"\n\n")  # the first event: the stream is open
                self.board.queued[chat] = time.monotonic()
                async with self.http.post(f"{base}/api/sessions/{chat}/messages", json={"text": "go"}) as resp:
                    self.calls += 1
                    if resp.status != 202:
                        print(f"web chat answered {resp.status}", file=sys.stderr)
                opened.set_result(None)
                while chat not in self.board.done:
                    event = (await stream.content.readuntil(b"\n\n")).decode()
                    name = data = ""
                    for line in event.splitlines():
                        if line.startswith("event: "):
                            name = line[7:]
                        elif line.startswith("data: "):
                            data = line[6:]
                    if name != "turn" or not data:
                        continue
                    self.events += 1
                    body = json.loads(data)
                    text = body["replace"] if "replace" in body else text + body.get("append", "")
                    self.texts[chat] = text
                    self.board.check(chat, lambda: self.shown(chat))
        finally:
            if not opened.done():
                opened.set_result(None)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.http.close()

    def shown(self, chat: str) -> str:
        return self.texts.get(chat, "")

    def reset(self) -> None:
        self.calls = 0
        self.events = 0
        for task in self.tasks:  # the conversations of the pipeline measured before
            task.cancel()

    def counts(self) -> tuple[int, int]:
        return self.calls, 0

    def by_method(self) -> dict[str, int]:
        """Besides the posts: the ``turn`` events received, which are not calls (the pages read them)."""
        return {"messages posted": self.calls, "turn events received": self.events}


SIDES: dict[str, type[Side]] = {"telegram": TelegramSide, "slack": SlackSide, "feishu": FeishuSide,
                                "web": WebSide}


def serve_platform(platform: str) -> None:
    """The platform's fake with a control route: ``POST /queue`` makes messages available, ``POST /report``
    tells which replies are complete; prints ``{"control": ..., <the fake's addresses>}``."""
    from aiohttp import web

    async def main() -> None:
        board = Board()
        side = SIDES[platform](board)
        info = await side.start()

        async def queue(request: web.Request) -> web.Response:
            p = await request.json()
            board.expected = squash(p["expected"])
            side.reset()
            await asyncio.gather(*(side.inject(chat, p.get("target", "")) for chat in p["chats"]))
            return web.json_response({})

        async def report(request: web.Request) -> web.Response:
            p = await request.json()
            calls, limited = side.counts()
            return web.json_response({**board.report(p["chats"], side.shown), "calls": calls, "limited": limited,
                                      "limited_by": side.limited_by(),
                                      "by_method": side.by_method()})

        async def turn(request: web.Request) -> web.Response:
            """One message in one chat; answers once its whole reply is visible (or ``timeout`` has passed) with
            the moments it was available, its reply's first text shown and the whole reply shown
            (``time.monotonic()``, null when not shown)."""
            p = await request.json()
            chat = str(p["chat"])
            board.expected = squash(p["expected"])
            await side.inject(chat, p.get("target", ""))
            deadline = time.monotonic() + float(p["timeout"])
            while chat not in board.done and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            return web.json_response({"queued": board.queued[chat], "first": board.first.get(chat),
                                      "done": board.done.get(chat)})

        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/queue", queue)
        app.router.add_post("/report", report)
        app.router.add_post("/turn", turn)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print(json.dumps({"control": f"http://127.0.0.1:{port}", **info}), flush=True)
        try:
            await until_stdin_closes()
        finally:
            await side.close()
            await runner.cleanup()

    asyncio.run(main())


# ---- the product: chatbridge run --------------------------------------------------------------------------


def bridge_config(platform: str, data: Path, llm: str, fake: dict[str, str], port: int) -> str:
    head = f"""
[bridge]
data_dir = "{data}"
log_level = "warning"
[llm]
provider = "openai"
model = "bench"
base_url = "{llm}"
api_key = "sk-bench"
request_timeout = 120
[agent]
titles = false
queue_capacity = 4
[web]
port = {port}
max_streams = 5000
max_streams_per_client = 5000
"""
    if platform == "telegram":
        return head + f"""
[channels.telegram]
enabled = true
token = "{fake['token']}"
api_base = "{fake['url']}"
stream_transport = "edit"
"""
    if platform == "slack":
        return head + f"""
[channels.slack]
enabled = true
bot_token = "{fake['bot_token']}"
app_token = "{fake['app_token']}"
api_base = "{fake['url']}"
stream_transport = "update"
workspace_updates_per_minute = {SLACK_UPDATES_PER_MINUTE}
"""
    if platform == "feishu":
        return head + f"""
[channels.feishu]
enabled = true
app_id = "{fake['app_id']}"
app_secret = "{fake['app_secret']}"
domain = "{fake['url']}"
mode = "webhook"
verification_token = "{FEISHU_TOKEN}"
encrypt_key = "{FEISHU_KEY}"
"""
    return head


async def healthz_state(http: Any, port: int, platform: str) -> str | None:
    import aiohttp

    try:
        async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            body = await resp.json()
    except aiohttp.ClientError:
        return None
    if body.get("status") == "starting":  # listening, its channels not yet started
        return None
    return "ready" if platform == "web" else body.get("channels", {}).get(platform)


async def start_product(platform: str, llm: str, fake: dict[str, str], tmp: Path) -> tuple[Any, str]:
    """``chatbridge run`` for ``platform`` against the fakes; returns it once the channel receives, and the
    address messages go to (the web server, for the web chat and Feishu's webhook)."""
    import aiohttp

    from tests.support.process import BridgeProcess

    port = free_port()
    config = tmp / "chatbridge.toml"
    config.write_text(bridge_config(platform, tmp / "data", llm, fake, port))
    bridge = await BridgeProcess(config, tmp / "bridge.log").start()
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while await healthz_state(http, port, platform) not in READY:
            if time.monotonic() > deadline or bridge.proc.returncode is not None:
                await bridge.stop()
                raise SystemExit(f"the bridge did not come up:\n{bridge.log()[-3000:]}")
            await asyncio.sleep(0.1)
    target = f"http://127.0.0.1:{port}"
    return bridge, target + "/feishu/events" if platform == "feishu" else target


# ---- the floor: a minimal direct pipeline --------------------------------------------------------------


class Minimal:
    """receive → stream (the openai SDK, as the provider calls it) → show the newest text through the same
    throttle, split at the platform's limit; nothing stored, nothing formatted."""

    def __init__(self, llm: str, fake: dict[str, str], gate: int = 0) -> None:
        import openai

        from channels.common.throttle import Throttle

        self.fake = fake
        self.llm = openai.AsyncOpenAI(base_url=llm, api_key="bench", max_retries=0,
                                      http_client=openai.DefaultAioHttpClient(timeout=120))
        self.throttle = Throttle()
        self.gate = gate
        """Characters the answer needs before its first message (0: none, the floor as it is)."""
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stream(self, text: str, scopes: tuple[Any, ...], send: Callable[[str], Awaitable[None]]) -> None:
        """Stream the model's answer to ``text``; whenever the throttle gives ``scopes`` a slot, ``send`` the
        newest text if it changed (as the live sink pulls the newest snapshot when its slot comes)."""
        from channels.common.throttle import ending

        chunks = await self.llm.chat.completions.create(model="bench", messages=[{"role": "user", "content": text}],
                                                        stream=True)
        parts: list[str] = []
        shown = ""
        sending = False
        """A flush got its slot (it is no longer only waiting for it)."""

        async def flush() -> None:
            nonlocal shown, sending
            sending = False
            await self.throttle.reserve(scopes)
            sending = True
            whole = "".join(parts)
            if whole != shown:
                await send(whole)
                shown = whole

        flushing: asyncio.Future[None] | None = None
        async for chunk in chunks:
            for choice in chunk.choices:
                content = choice.delta.content
                if content:
                    parts.append(content)
            if parts and (flushing is None or flushing.done()) and (shown or sum(map(len, parts)) >= self.gate):
                flushing = asyncio.ensure_future(flush())
        if flushing is not None and not flushing.done() and not sending:
            flushing.cancel()  # still waiting for the next slot: the end goes at once instead, as the product's
        if flushing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await flushing
        if "".join(parts) != shown:
            with ending():  # the end takes the chat's burst, as the live sink's finish does
                await flush()

    async def run(self) -> str:
        raise NotImplementedError

    async def close(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.llm.close()


class MinimalTelegram(Minimal):
    async def run(self) -> str:
        from aiogram.exceptions import TelegramRetryAfter
        from aiogram.methods import EditMessageText, GetUpdates, SendMessage

        from channels.common.arrivals import ArrivalBudget
        from channels.common.throttle import Scope
        from channels.telegram.channel import BOT_SENDS_PER_SECOND
        from channels.telegram.client import BOT_SEND_LIMIT, CHAT_BURST
        from channels.telegram.factory import make_bot

        bot = make_bot(self.fake["token"], self.fake["url"])
        sender = make_bot(self.fake["token"], self.fake["url"])  # new messages on connections of their own
        bot_sends = (Scope("bot:sends", 1 / BOT_SENDS_PER_SECOND),)  # the channel's pace
        arrivals = ArrivalBudget(BOT_SEND_LIMIT)  # and never more than 30 reaching Telegram in a second, as the channel

        async def call(chat: int, method: Any) -> Any:
            send = isinstance(method, SendMessage)
            scope = (Scope(f"chat:{chat}", 1.0, CHAT_BURST),)
            for _ in range(20):
                try:
                    if not send:
                        return await bot(method)
                    async with arrivals.slot():
                        return await sender(method)
                except TelegramRetryAfter as exc:
                    self.throttle.pause(scope[0].key, exc.retry_after)
                await self.throttle.reserve(scope + bot_sends if send else scope)  # a retry takes a slot too
            raise RuntimeError("still rate limited")

        async def answer(chat: int) -> None:
            shown: list[tuple[int, str]] = []

            async def show(whole: str) -> None:
                pieces = [whole[i:i + 4096] for i in range(0, len(whole), 4096)]
                for i, piece in enumerate(pieces):
                    if i == len(shown):
                        await self.throttle.reserve(bot_sends)  # the bot's budget of new messages
                        msg = await call(chat, SendMessage(chat_id=chat, text=piece))
                        shown.append((msg.message_id, piece))
                    elif shown[i][1] != piece:
                        await call(chat, EditMessageText(chat_id=chat, message_id=shown[i][0], text=piece))
                        shown[i] = (shown[i][0], piece)

            await self.stream("go", (Scope(f"chat:{chat}", 1.0, CHAT_BURST),), show)

        async def poll() -> None:
            offset = None
            while True:
                updates = await bot(GetUpdates(offset=offset, timeout=10), request_timeout=20)
                for update in updates:
                    offset = update.update_id + 1
                    if update.message is not None and update.message.text:
                        self.spawn(answer(update.message.chat.id))

        self.spawn(poll())
        self.bots = (bot, sender)
        return ""

    async def close(self) -> None:
        await super().close()
        for bot in self.bots:
            await bot.session.close()


class MinimalSlack(Minimal):
    async def run(self) -> str:
        import aiohttp
        from slack_sdk.errors import SlackApiError
        from slack_sdk.socket_mode.aiohttp import SocketModeClient
        from slack_sdk.socket_mode.request import SocketModeRequest
        from slack_sdk.socket_mode.response import SocketModeResponse
        from slack_sdk.web.async_client import AsyncWebClient

        from channels.common.throttle import Scope
        from channels.slack.client import CHAT_BURST

        # one session for every call, as the product's client has (without one, slack_sdk opens a session
        # and a connection for each call)
        self.web_session = aiohttp.ClientSession()
        web = AsyncWebClient(token=self.fake["bot_token"], base_url=self.fake["url"], session=self.web_session)
        workspace = Scope("workspace", 60.0 / SLACK_UPDATES_PER_MINUTE)

        async def call(channel: str, method: str, **kw: Any) -> Any:
            scopes = (Scope(f"chat:{channel}", 1.0, CHAT_BURST), workspace)
            for _ in range(20):
                try:
                    return await web.api_call(method, json={"channel": channel, **kw})
                except SlackApiError as exc:
                    if exc.response.status_code != 429:
                        raise
                    self.throttle.pause(scopes[0].key, float(exc.response.headers.get("Retry-After", 1)))
                await self.throttle.reserve(scopes)
            raise RuntimeError("still rate limited")

        async def answer(channel: str) -> None:
            ts: str | None = None

            async def show(whole: str) -> None:
                nonlocal ts
                if ts is None:
                    ts = (await call(channel, "chat.postMessage", text=whole[:4000]))["ts"]
                else:
                    await call(channel, "chat.update", ts=ts, text=whole[:4000])

            await self.stream("go", (Scope(f"chat:{channel}", 1.0, CHAT_BURST), workspace), show)

        async def on_request(client: SocketModeClient, req: SocketModeRequest) -> None:
            await client.send_socket_mode_response(SocketModeResponse(envelope_id=req.envelope_id))
            event = req.payload.get("event") or {}
            if req.type == "events_api" and event.get("type") == "message" and not event.get("bot_id"):
                self.spawn(answer(str(event["channel"])))

        self.socket = SocketModeClient(app_token=self.fake["app_token"], web_client=web)
        self.socket.socket_mode_request_listeners.append(on_request)
        await self.socket.connect()
        return ""

    async def close(self) -> None:
        await self.socket.close()
        await self.web_session.close()
        await super().close()


class MinimalFeishu(Minimal):
    async def run(self) -> str:
        import httpx
        import lark_oapi as lark
        from aiohttp import web
        from lark_oapi.api.im.v1 import (
            ReplyMessageRequest,
            ReplyMessageRequestBody,
            UpdateMessageRequest,
            UpdateMessageRequestBody,
        )

        from channels.common.arrivals import ArrivalBudget
        from channels.common.throttle import Scope
        from channels.feishu.api import COLLECT_EVERY, MAX_IN_FLIGHT
        from channels.feishu.channel import APP_SENDS_PER_SECOND, CHAT_BURST

        app_sends = (Scope("app:send", 1 / APP_SENDS_PER_SECOND),)  # the app's pace of sends, as the channel's
        arrivals = ArrivalBudget(50)  # and never more than 50 reaching Feishu in a second, as the channel
        # lark-oapi builds an HTTP client (a TLS context) for every request and leaves it in a reference cycle:
        # requests in flight capped, and the cycles collected every COLLECT_EVERY requests, as the channel does
        # (without either the floor's RSS passed 2 GiB at 1,000 chats and its connects timed out)
        in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        requests = itertools.count(1)
        client = (lark.Client.builder().app_id(self.fake["app_id"]).app_secret(self.fake["app_secret"])
                  .domain(self.fake["url"]).timeout(30.0).log_level(lark.LogLevel.ERROR).build())  # as the channel's

        async def answer(chat: str, message_id: str) -> None:
            scope = (Scope(f"chat:{chat}", 0.5, CHAT_BURST),)
            sent: str | None = None

            async def call(request: Callable[[], Awaitable[Any]]) -> Any:
                for _ in range(20):
                    try:
                        async with in_flight:
                            resp = await request()
                    except (httpx.ConnectError, httpx.ConnectTimeout):
                        continue  # the request was never sent (connects timed out in the 1,000-chat burst): again
                    finally:
                        if next(requests) % COLLECT_EVERY == 0:
                            gc.collect(1)
                    if resp.code not in (99991400, 230020):  # Feishu's rate limits: pause the chat, try again
                        return resp
                    self.throttle.pause(scope[0].key, 1.0)
                    await self.throttle.reserve(scope)
                raise RuntimeError("still rate limited or not connecting")

            async def show(whole: str) -> None:
                nonlocal sent
                content = json.dumps({"text": whole})
                if sent is None:
                    body = ReplyMessageRequestBody.builder().msg_type("text").content(content).build()
                    reply = ReplyMessageRequest.builder().message_id(message_id).request_body(body).build()

                    async def send() -> Any:
                        await self.throttle.reserve(app_sends)
                        async with arrivals.slot():
                            return await client.im.v1.message.areply(reply)

                    sent = (await call(send)).data.message_id
                else:
                    body = UpdateMessageRequestBody.builder().msg_type("text").content(content).build()
                    update = UpdateMessageRequest.builder().message_id(sent).request_body(body).build()
                    await call(lambda: client.im.v1.message.aupdate(update))

            await self.stream("go", scope, show)

        def on_message(data: Any) -> None:
            message = data.event.message
            self.spawn(answer(message.chat_id, message.message_id))

        dispatcher = (lark.EventDispatcherHandler.builder(FEISHU_KEY, FEISHU_TOKEN)
                      .register_p2_im_message_receive_v1(on_message).build())

        async def events(request: web.Request) -> web.Response:
            raw = lark.RawRequest()
            raw.uri = request.path
            raw.body = await request.read()
            raw.headers = dict(request.headers)
            answer_ = dispatcher.do(raw)
            return web.Response(status=answer_.status_code or 200, body=answer_.content,
                                content_type="application/json")

        app = web.Application()
        app.router.add_post("/feishu/events", events)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}/feishu/events"

    async def close(self) -> None:
        await self.runner.cleanup()
        await super().close()


class MinimalWeb(Minimal):
    """POST a message → stream → ``turn`` events with the newest text on the conversation's event stream,
    at the web chat's pace (one per conversation every 50 ms)."""

    async def run(self) -> str:
        from aiohttp import web

        from channels.common.throttle import Scope

        streams: dict[str, asyncio.Queue[bytes]] = {}

        async def stream(request: web.Request) -> web.StreamResponse:
            sid = request.match_info["id"]
            queue = streams.setdefault(sid, asyncio.Queue())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"event: ready\ndata: {}\n\n")
            try:
                while True:
                    await resp.write(await queue.get())
            except ConnectionError:
                return resp

        async def post(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            body = await request.json()
            queue = streams.setdefault(sid, asyncio.Queue())
            sent = 0

            async def show(whole: str) -> None:
                nonlocal sent
                data = json.dumps({"append": whole[sent:]})
                sent = len(whole)
                queue.put_nowait(f"event: turn\ndata: {data}\n\n".encode())

            self.spawn(self.stream(str(body["text"]), (Scope(f"session:{sid}", WEB_UPDATE_INTERVAL),), show))
            return web.json_response({"status": "accepted"}, status=202)

        app = web.Application()
        app.router.add_get("/api/sessions/{id}/stream", stream)
        app.router.add_post("/api/sessions/{id}/messages", post)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        await self.runner.cleanup()
        for task in self.tasks:
            task.cancel()
        await super().close()


MINIMALS: dict[str, type[Minimal]] = {"telegram": MinimalTelegram, "slack": MinimalSlack,
                                      "feishu": MinimalFeishu, "web": MinimalWeb}


def serve_minimal(platform: str, llm: str, fake: dict[str, str], gate: int = 0) -> None:
    """The minimal pipeline in this process: prints the address messages go to (or "ready"), runs until stdin
    closes."""
    from bridge.gc_tuning import tune_gc

    async def main() -> None:
        pipeline = MINIMALS[platform](llm, fake, gate)
        target = await pipeline.run()
        tune_gc()  # as chatbridge run tunes it once it is up
        print(target or "ready", flush=True)
        await until_stdin_closes()
        for task in pipeline.tasks:
            task.cancel()
        await pipeline.close()

    asyncio.run(main())


# ---- where each pipeline's CPU goes (py-spy, when installed) -------------------------------------------

SDKS = {"openai": "openai SDK", "aiogram": "aiogram", "slack_sdk": "slack_sdk", "slack_bolt": "slack_bolt",
        "lark_oapi": "lark-oapi", "aiosqlite": "aiosqlite (SQLite)"}
"""The official SDKs whose inclusive share of the samples is printed: their own work and what they call."""
_FRAME_FILE = re.compile(r"\(([^()]*?):\d+\)$")
_WAITING = (re.compile(r"^\S*select \(selectors\.py:\d+\)$"), re.compile(r"^_connection_worker_thread \(aiosqlite/"))
"""Innermost frames of a thread that waits rather than works: the event loop in ``select`` and aiosqlite's
thread waiting for its next statement. py-spy cannot tell these from work here (they showed up in the samples
of an idle process), so they are left out; when aiosqlite's thread calls into SQLite the innermost frame is
the statement's own."""


def py_spy() -> str | None:
    found = Path(sys.executable).parent / "py-spy"
    return str(found) if found.exists() else shutil.which("py-spy")


def start_profile(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = py_spy()
    if exe is None:
        print("  (py-spy not found: no profile)", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "50", "--format", "raw", "--nonblocking",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(proc: subprocess.Popen[bytes] | None, out: Path) -> dict[str, float]:
    """Shares of the samples of work (waits left out, see ``_WAITING``): by the package of the innermost frame
    ("self"), and for each SDK every sample with one of its frames on the stack ("SDK incl.")."""
    if proc is None:
        return {}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not out.exists():
        return {}
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or any(w.match(stack.rsplit(";", 1)[-1]) for w in _WAITING):
            continue
        n = int(count)
        total += n
        packages = [_package(m.group(1)) for m in map(_FRAME_FILE.search, stack.split(";")) if m]
        if packages:
            own[packages[-1]] = own.get(packages[-1], 0) + n
        for sdk in {p for p in packages if p in SDKS}:
            inclusive[sdk] = inclusive.get(sdk, 0) + n
    if not total:
        return {}
    shares = {f"{SDKS[k]} incl.": v / total for k, v in inclusive.items()}
    shares.update({k: v / total for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:12]})
    return shares


def _package(path: str) -> str:
    """``core``, ``channels/feishu``, ``bridge``, a third-party package or a standard library module (py-spy
    names files relative to the import path they were found on)."""
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif Path(path).is_absolute() and Path(path).is_relative_to(ROOT):
        path = str(Path(path).relative_to(ROOT))
    parts = Path(path).parts
    if not parts:
        return "?"
    return "/".join(parts[:2]) if parts[0] == "channels" and len(parts) > 2 else parts[0].removesuffix(".py")


# ---- the run -------------------------------------------------------------------------------------------


async def control(http: Any, url: str, route: str, **body: Any) -> Any:
    async with http.post(f"{url}/{route}", json=body) as resp:
        return await resp.json()


async def measure(platform: str, pipeline: str, chats: int, first: int, llm: str, fake: dict[str, Any],
                  expected: str, timeout: float, profile: bool) -> dict[str, Any]:
    """One pipeline answering ``chats`` chats at once; its figures."""
    import aiohttp

    with tempfile.TemporaryDirectory() as tmp:
        if pipeline == "product":
            bridge, target = await start_product(platform, llm, fake, Path(tmp))
            assert bridge.proc is not None
            pid = bridge.proc.pid
        else:
            proc, line = start_child("tests.bench.e2e", "--serve-minimal", platform, "--llm", llm,
                                     "--fake", json.dumps(fake))
            pid, target = proc.pid, "" if line == "ready" else line
        names = [f"{CHAT_PREFIX[platform]}{first + i}" for i in range(chats)]
        profiler = start_profile(pid, Path(tmp) / "profile.txt") if profile else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            cpu0, started = cpu_seconds(pid), time.monotonic()
            await control(http, fake["control"], "queue", chats=names, expected=expected, target=target)
            deadline = started + timeout
            while True:
                await asyncio.sleep(0.25)
                report = await control(http, fake["control"], "report", chats=names)
                if report["done"] == chats or time.monotonic() > deadline:
                    break
            wall = time.monotonic() - started
            cpu = cpu_seconds(pid) - cpu0
            rss = peak_rss_mib(pid)
        shares = stop_profile(profiler, Path(tmp) / "profile.txt")
        # measured: ended at once (a graceful stop would wait out long polls and shutdown timeouts)
        if pipeline == "product":
            await bridge.kill()
        else:
            proc.kill()
            proc.wait()
    for chat, shown in report["unfinished"].items():
        print(f"  {platform} {pipeline}: chat {chat} shows only ...{shown!r}", flush=True)
    lat = sorted(report["latencies"]) or [float("nan")]
    return {"done": report["done"], "chats": chats, "wall": wall, "throughput": report["done"] / wall,
            "cpu_ms": cpu * 1000 / chats, "p50": statistics.median(lat), "p99": lat[int(0.99 * (len(lat) - 1))],
            "rss": rss, "calls": report["calls"] / chats, "limited": report["limited"],
            "limited_by": report["limited_by"], "by_method": report["by_method"], "profile": shares}


async def one_platform(platform: str, sizes: list[int], llm: str, expected: str, timeout: float,
                       profile: bool, rounds: int = 1) -> list[dict[str, Any]]:
    """Each size's product and floor, one after the other (the order alternating from one run to the next),
    ``rounds`` times."""
    fake_proc, line = start_child("tests.bench.e2e", "--serve-platform", platform)
    fake = json.loads(line)
    rows: list[dict[str, Any]] = []
    try:
        for round_ in range(rounds):
            for n, chats in enumerate(sizes):
                turn = (round_ * len(sizes) + n) % 2
                for pipeline in ("product", "minimal") if turn == 0 else ("minimal", "product"):
                    first = 1_000_000 * (1 + len(rows))  # chat ids no earlier run used
                    row = await measure(platform, pipeline, chats, first, llm, fake, expected, timeout, profile)
                    rows.append({"platform": platform, "pipeline": pipeline, "round": round_ + 1, **row})
                    print_row(rows[-1])
    finally:
        stop_child(fake_proc)
    return rows


def print_row(r: dict[str, Any]) -> None:
    lost = f"  LOST {r['chats'] - r['done']}" if r["done"] < r["chats"] else ""
    print(f"  {r['platform']:8s} {r['chats']:5d} chats  {r['pipeline']:7s}  {r['throughput']:7.1f} turns/s  "
          f"p50 {r['p50']:6.2f} s  p99 {r['p99']:6.2f} s  CPU {r['cpu_ms']:6.1f} ms/turn  "
          f"peak RSS {r['rss']:6.1f} MiB  {r['calls']:5.2f} calls/turn  429s {r['limited']}{lost}", flush=True)
    if r.get("limited_by"):
        print("      429s by budget: " + ", ".join(f"{k} {v}" for k, v in sorted(r["limited_by"].items())), flush=True)
    if r.get("by_method"):
        print("      calls/turn by method: " + ", ".join(
            f"{k} {v / r['chats']:.2f}" for k, v in sorted(r["by_method"].items(), key=lambda kv: -kv[1])), flush=True)
    if r.get("profile"):
        print("      CPU samples: " + ", ".join(f"{k} {v:.0%}" for k, v in r["profile"].items()), flush=True)


CPU_TARGET = 1.5
"""The product's CPU per turn at most this many times the floor's."""


def print_summary(rows: list[dict[str, Any]]) -> None:
    print("\nproduct against the floor (targets: CPU <= 1.5x, added p50 <= 20 ms, no lost reply, no 429, "
          "RSS <= 300 MiB at 1000 chats)")
    pairs: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        pairs.setdefault((r["platform"], r["chats"], r.get("round", 1)), {})[r["pipeline"]] = r
    ratios: dict[tuple[str, int], list[float]] = {}
    several = any(round_ > 1 for _, _, round_ in pairs)
    for (platform, chats, round_), pair in pairs.items():
        if len(pair) < 2:
            continue
        p, m = pair["product"], pair["minimal"]
        ratios.setdefault((platform, chats), []).append(p["cpu_ms"] / m["cpu_ms"])
        print(f"  {platform:8s} {chats:5d} chats: CPU/turn {p['cpu_ms'] / m['cpu_ms']:5.2f}x  "
              f"added p50 {1000 * (p['p50'] - m['p50']):+8.0f} ms  p99 {p['p99'] / m['p99']:5.2f}x  "
              f"RSS {p['rss']:6.1f} MiB ({p['rss'] / m['rss']:4.2f}x)  calls/turn {p['calls']:.2f} vs "
              f"{m['calls']:.2f}  lost {p['chats'] - p['done']}  429s {p['limited']}"
              f"{f'  (round {round_})' if several else ''}", flush=True)
    for (platform, chats), values in ratios.items():
        if len(values) > 1:
            within = sum(v <= CPU_TARGET for v in values)
            print(f"  {platform:8s} {chats:5d} chats: CPU/turn over {len(values)} rounds: median "
                  f"{statistics.median(values):.2f}x, {min(values):.2f}-{max(values):.2f}x, within "
                  f"{CPU_TARGET}x in {within} of {len(values)}", flush=True)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    llm_proc, llm = start_child("tests.bench.e2e", "--serve-llm", "--chunks", str(args.chunks),
                                "--chunk-ms", str(args.chunk_ms), "--llm-processes", str(args.llm_processes))
    rows: list[dict[str, Any]] = []
    try:
        for platform in args.platform:
            rows += await one_platform(platform, args.chats, llm, reply_text(args.chunks), args.timeout,
                                       args.profile, args.rounds)
    finally:
        stop_child(llm_proc)
    return rows


# ---- latency unsaturated: one turn at a time, product and floor alternating ------------------------------


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` as this benchmark takes it everywhere: the sorted value at index
    ``int(q * (n - 1))``; the median for ``q = 0.5`` (the mean of the middle two when ``n`` is even)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return statistics.median(ordered) if q == 0.5 else ordered[int(q * (len(ordered) - 1))]


def paired_interval(product: list[float], floor: list[float], q: float, resamples: int = 2000,
                    seed: int = 1) -> tuple[float, float]:
    """A 95 % bootstrap interval of ``quantile(product, q) - quantile(floor, q)``: the turns are resampled as
    pairs (the i-th product turn ran beside the i-th floor turn, so load that moved hit both), with a fixed
    seed so that a run prints the same interval for the same figures."""
    if len(product) != len(floor):
        raise ValueError(f"paired samples differ in length: {len(product)} and {len(floor)}")
    if not product:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(product)
    diffs = []
    for _ in range(resamples):
        picked = [rng.randrange(n) for _ in range(n)]
        diffs.append(quantile([product[i] for i in picked], q) - quantile([floor[i] for i in picked], q))
    diffs.sort()
    return diffs[int(0.025 * (resamples - 1))], diffs[int(0.975 * (resamples - 1))]


def model_spans(path: Path) -> list[tuple[float, float]]:
    """(received, ended) of every request the fake model streamed (``serve_llm``'s ``times`` file)."""
    if not path.exists():
        return []
    spans = []
    for line in path.read_text().splitlines():
        received, ended = line.split()
        spans.append((float(received), float(ended)))
    return spans


async def latency_platform(platform: str, turns: int, warmup: int, llm: str, times: Path, expected: str,
                           timeout: float, floor_gate: int = 0) -> dict[str, Any]:
    """``turns`` turns for each pipeline, one at a time, product and floor alternating (ABBA), each in a chat
    of its own; every pipeline has its own platform fake (two pipelines on one would take each other's
    updates). Each turn's moments: the message available, the model's request received and its stream ended
    (the model fake's clock), the first text and the whole reply visible (the platform fake's); one clock,
    ``time.monotonic()``, in every process."""
    import aiohttp

    fakes = {pipeline: start_child("tests.bench.e2e", "--serve-platform", platform) for pipeline in PIPELINES}
    samples: dict[str, list[dict[str, float]]] = {pipeline: [] for pipeline in PIPELINES}
    with tempfile.TemporaryDirectory() as tmp:
        bridge, product_target = await start_product(platform, llm, json.loads(fakes["product"][1]), Path(tmp))
        floor_proc, line = start_child("tests.bench.e2e", "--serve-minimal", platform, "--llm", llm,
                                       "--fake", fakes["minimal"][1], "--floor-gate", str(floor_gate))
        targets = {"product": product_target, "minimal": "" if line == "ready" else line}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
                for i in range(-warmup, turns):
                    order = PIPELINES if i % 2 == 0 else PIPELINES[::-1]
                    for pipeline in order:
                        number = 2_000_000 + 100_000 * PIPELINES.index(pipeline) + i + warmup
                        chat = f"{CHAT_PREFIX[platform]}{number}"
                        moments = await control(http, json.loads(fakes[pipeline][1])["control"], "turn", chat=chat,
                                                expected=expected, target=targets[pipeline], timeout=timeout)
                        if i < 0:
                            continue
                        if moments["done"] is None:
                            print(f"  {platform} {pipeline}: turn {i} not shown whole in {timeout:g} s", flush=True)
                            samples[pipeline].append({})
                            continue
                        within = [s for s in model_spans(times) if moments["queued"] <= s[0] <= moments["done"]]
                        sample = {"total": moments["done"] - moments["queued"]}
                        if len(within) == 1:  # one model request a turn, as it should be
                            received, ended = within[0]
                            sample["in"] = received - moments["queued"]
                            sample["first"] = moments["first"] - received
                            sample["out"] = moments["done"] - ended
                            sample["bridge"] = sample["total"] - (ended - received)
                        samples[pipeline].append(sample)
        finally:
            await bridge.kill()
            floor_proc.kill()
            floor_proc.wait()
            for proc, _ in fakes.values():
                stop_child(proc)
    return {"platform": platform, "turns": turns, "samples": samples}


PIPELINES = ("product", "minimal")
LATENCY_PARTS = (("total", "available → reply visible"), ("bridge", "the same less the model's stream"),
                 ("in", "available → model request"), ("first", "model request → first text"),
                 ("out", "model's end → reply visible"))
"""The parts of a turn printed: the whole; the whole less the model's stream (from its request received to
its last byte written, the same work for both pipelines, whose own jitter the whole carries); what comes
before the model is asked; from then to the first text shown (the first-message gate and the typing
indicator, in the product); what comes after the model's last byte."""


def print_latency(row: dict[str, Any]) -> None:
    platform, samples = row["platform"], row["samples"]
    for part, label in LATENCY_PARTS:
        # pairs where both turns gave the figure
        pairs = [(p[part], m[part]) for p, m in zip(samples["product"], samples["minimal"], strict=True)
                 if part in p and part in m]
        if not pairs:
            continue
        prod, floor = [p for p, _ in pairs], [m for _, m in pairs]
        lo50, hi50 = paired_interval(prod, floor, 0.5)
        added50 = quantile(prod, 0.5) - quantile(floor, 0.5)
        diffs = [p - m for p, m in pairs]
        print(f"  {platform:8s} {label:33s} product p50 {1000 * quantile(prod, 0.5):7.1f} ms  "
              f"p99 {1000 * quantile(prod, 0.99):7.1f}  floor p50 {1000 * quantile(floor, 0.5):7.1f}  "
              f"p99 {1000 * quantile(floor, 0.99):7.1f}  added p50 {1000 * added50:+7.1f} "
              f"(95% {1000 * lo50:+.1f} .. {1000 * hi50:+.1f})  "
              f"p99 {1000 * (quantile(prod, 0.99) - quantile(floor, 0.99)):+7.1f}  "
              f"paired diff IQR {1000 * quantile(diffs, 0.25):+.1f} .. {1000 * quantile(diffs, 0.75):+.1f}  "
              f"n {len(pairs)}", flush=True)
    lost = {pipeline: sum(not s for s in samples[pipeline]) for pipeline in PIPELINES}
    if any(lost.values()):
        print(f"  {platform:8s} not shown whole: product {lost['product']}, floor {lost['minimal']}", flush=True)


async def run_latency(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        times = Path(tmp) / "model_times"
        llm_proc, llm = start_child("tests.bench.e2e", "--serve-llm", "--chunks", str(args.chunks),
                                    "--chunk-ms", str(args.chunk_ms), "--llm-processes", str(args.llm_processes),
                                    "--model-times", str(times))
        try:
            for platform in args.platform:
                row = await latency_platform(platform, args.latency, args.warmup, llm, times,
                                             reply_text(args.chunks), args.timeout, args.floor_gate)
                rows.append(row)
                print_latency(row)
        finally:
            stop_child(llm_proc)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--platform", nargs="+", choices=PLATFORMS, default=list(PLATFORMS))
    parser.add_argument("--chats", type=int, nargs="+", default=None)
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--chunk-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="50 chats, 100 chunks")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each size's product and floor this many times, alternating which goes "
                             "first; prints each round's ratios and the median CPU ratio")
    parser.add_argument("--profile", action="store_true",
                        help="sample the product and the floor with py-spy and print where their CPU goes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the replies of one run")
    parser.add_argument("--llm-processes", type=int, default=LLM_PROCESSES,
                        help="processes serving the fake model's port (SO_REUSEPORT); "
                             f"{LLM_PROCESSES} unless given (python -m tests.bench.model_fake measures it alone)")
    parser.add_argument("--latency", type=int, metavar="TURNS",
                        help="latency unloaded: TURNS turns for each pipeline, one at a time, product and floor "
                             "alternating; prints p50/p99 of each part of a turn and the added latency")
    parser.add_argument("--warmup", type=int, default=2, help="--latency: turns of each pipeline not counted")
    parser.add_argument("--floor-gate", type=int, default=0, metavar="CHARS",
                        help="the floor holds its first message until the answer has CHARS characters "
                             "(the product's first-message gate: 24)")
    parser.add_argument("--serve-llm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-times", help=argparse.SUPPRESS)
    parser.add_argument("--serve-platform", choices=PLATFORMS, help=argparse.SUPPRESS)
    parser.add_argument("--serve-minimal", choices=PLATFORMS, help=argparse.SUPPRESS)
    parser.add_argument("--llm", help=argparse.SUPPRESS)
    parser.add_argument("--fake", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.chats = args.chats or ([50] if args.quick else [100, 1000])
    args.chunks = args.chunks or (100 if args.quick else 300)
    if args.serve_llm:
        serve_llm(args.chunks, args.chunk_ms, args.llm_processes, times=args.model_times)
        return []
    if args.serve_platform:
        serve_platform(args.serve_platform)
        return []
    if args.serve_minimal:
        serve_minimal(args.serve_minimal, args.llm, json.loads(args.fake), args.floor_gate)
        return []
    if args.latency:
        print(f"{args.latency} turns one at a time on each platform for the product and the floor, alternating; a "
              f"reply of {args.chunks} chunks, one every {args.chunk_ms:g} ms; "
              f"{f'the floor gated at {args.floor_gate} characters; ' if args.floor_gate else ''}"
              f"{os.cpu_count()} cores; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        started = time.monotonic()
        rows = asyncio.run(run_latency(args))
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; wall time "
              f"{time.monotonic() - started:.0f} s")
        return rows
    print(f"{' and '.join(map(str, args.chats))} chats at once on each platform, one message each, a reply of "
          f"{args.chunks} chunks ({len(reply_text(args.chunks))} characters), one every {args.chunk_ms:g} ms "
          f"from {args.llm_processes} model process{'es' if args.llm_processes > 1 else ''}; "
          f"{os.cpu_count()} cores", flush=True)
    started = time.monotonic()
    rows = asyncio.run(run(args))
    print_summary(rows)
    print(f"wall time {time.monotonic() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
