"""``chatbridge run`` with ``[channels.feishu] enabled = true``, as a real process against the Feishu fakes: over
the long connection (the process imports lark-oapi before its event loop starts, so the SDK's client runs on
its own thread) and over the webhook on the [web] server; ``/healthz`` names the channel's state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.feishu import FakeFeishu, FakeLongConnection, WebhookSender
from tests.fakes.feishu.events import Mention, message_event
from tests.fakes.feishu.harness import CHAT, KEY, TOKEN
from tests.fakes.feishu.openapi import card_buttons
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
from tests.support.platforms import one_origin
from tests.support.ports import free_port
from tests.support.process import BridgeProcess, open_approvals


def config(tmp_path: Path, llm: str, port: int, feishu: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{llm}"
api_key = "sk-feishu-process"
[web]
port = {port}
[channels.feishu]
enabled = true
{feishu}""")
    return path


async def wait_for(cond: Callable[[], Any], bridge: BridgeProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not reached; log:\n{bridge.log()}")


async def healthz(port: int) -> Any:
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as resp:
            return await resp.json()
    except aiohttp.ClientError:
        return None


async def test_run_answers_over_the_long_connection(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Text("Hello from the process."))
    async with FakeFeishu() as fake, FakeLongConnection(fake.app_id, fake.app_secret) as conn:
        fake.chat(CHAT)
        runner, origin = await one_origin({"/open-apis/": fake.base_url, "/callback/": conn.base_url})
        port = free_port()
        path = config(tmp_path, fake_openai.base_url, port,
                      f'app_id = "{fake.app_id}"\napp_secret = "{fake.app_secret}"\ndomain = "{origin}"\n')
        bridge = await BridgeProcess(path, tmp_path / "bridge.log").start()
        try:
            async def connected() -> bool:
                body = await healthz(port)
                return bool(body) and body["channels"].get("feishu") == "connected" and conn.connected == 1
            await wait_for(connected, bridge)
            msg = fake.user_message(CHAT, "hi")
            frame = conn.push(message_event("@_user_1 hi", token="", app_id=fake.app_id, chat_id=CHAT,
                                            message_id=msg.message_id,
                                            mentions=[Mention(fake.bot_name, fake.bot_open_id)]))
            assert (await conn.wait_ack(frame, timeout=10)).code == 200

            async def answered() -> bool:
                return fake.texts(CHAT) == ["Hello from the process."]
            await wait_for(answered, bridge)
            assert await bridge.stop() == 0
        finally:
            await bridge.stop()
            await runner.cleanup()


async def test_run_answers_over_the_webhook(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Text("Hello over the webhook."))
    async with FakeFeishu() as fake:
        fake.chat(CHAT)
        port = free_port()
        path = config(tmp_path, fake_openai.base_url, port,
                      f'app_id = "{fake.app_id}"\napp_secret = "{fake.app_secret}"\ndomain = "{fake.base_url}"\n'
                      f'mode = "webhook"\nverification_token = "{TOKEN}"\nencrypt_key = "{KEY}"\n')
        bridge = await BridgeProcess(path, tmp_path / "bridge.log").start()
        try:
            async def serving() -> bool:
                body = await healthz(port)
                return bool(body) and body["channels"].get("feishu") == "webhook"
            await wait_for(serving, bridge)
            sender = WebhookSender(f"http://127.0.0.1:{port}/feishu/events", TOKEN, fake.app_id, KEY)
            msg = fake.user_message(CHAT, "hi")
            sent = await sender.send(sender.message("@_user_1 hi", chat_id=CHAT, message_id=msg.message_id,
                                                    mentions=[Mention(fake.bot_name, fake.bot_open_id)]))
            assert sent.status == 200

            async def answered() -> bool:
                return fake.texts(CHAT) == ["Hello over the webhook."] and all(
                    not c.streaming for c in fake.cards.values())
            await wait_for(answered, bridge)
            assert await bridge.stop() == 0
            assert KEY not in bridge.log() and fake.app_secret not in bridge.log()
        finally:
            await bridge.stop()


def asks(call: Any) -> bool:
    """The post of an approval card (a card with buttons)."""
    body = call.body or {}
    return body.get("msg_type") == "interactive" and bool(card_buttons(json.loads(body.get("content") or "{}")))


def age_open_approvals(data_dir: Path, seconds: float) -> None:
    """Make the open approval requests the last run recorded ``seconds`` older (as after a long outage)."""
    with contextlib.closing(sqlite3.connect(data_dir / "chatbridge.db")) as db, db:
        records = json.loads(open_approvals(data_dir, "feishu"))
        for record in records:
            record["at"] -= seconds
        db.execute("UPDATE channel_state SET value = ? WHERE channel = 'feishu' AND name = 'open_approvals'",
                   (json.dumps(records),))


@pytest.mark.parametrize("killed", ["once_its_card_was_recorded", "while_its_card_was_posted",
                                    "while_its_card_was_posted_over_an_hour_before_the_restart"])
async def test_an_approval_card_left_waiting_by_a_crash_shows_the_restart(tmp_path: Path, fake_openai: FakeOpenAI,
                                                                        killed: str) -> None:
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_A"]))
    async with FakeFeishu() as fake:
        fake.chat(CHAT)
        port = free_port()
        path = config(tmp_path, fake_openai.base_url, port,
                      f'app_id = "{fake.app_id}"\napp_secret = "{fake.app_secret}"\ndomain = "{fake.base_url}"\n'
                      f'mode = "webhook"\nverification_token = "{TOKEN}"\nencrypt_key = "{KEY}"\n'
                      '[agent]\ntitles = false\ntool_approval = { current_time = "ask" }\n')
        sender = WebhookSender(f"http://127.0.0.1:{port}/feishu/events", TOKEN, fake.app_id, KEY)

        def request() -> Any:
            return next((m for m in fake.shown(CHAT) if m.msg_type == "interactive" and card_buttons(m.content)),
                        None)

        bridge = await BridgeProcess(path, tmp_path / "bridge.log").start()
        try:
            async def serving() -> bool:
                body = await healthz(port)
                return bool(body) and body["channels"].get("feishu") == "webhook"
            await wait_for(serving, bridge)
            posting = fake.fail("message.reply", when=asks, hang=20.0, apply_first=True) \
                if killed.startswith("while_its_card_was_posted") else None
            msg = fake.user_message(CHAT, "what time is it?")
            sent = await sender.send(sender.message("@_user_1 what time is it?", chat_id=CHAT,
                                                    message_id=msg.message_id,
                                                    mentions=[Mention(fake.bot_name, fake.bot_open_id)]))
            assert sent.status == 200

            async def recorded() -> bool:
                if posting is not None:  # recorded as being posted; the post's answer still on its way
                    return posting.hits == 1 and '"current_time"' in open_approvals(tmp_path / "data", "feishu")
                return request() is not None and "message_id" in open_approvals(tmp_path / "data", "feishu")
            await wait_for(recorded, bridge)
            await bridge.kill()
        finally:
            await bridge.stop()
        if posting is not None:  # Feishu shows the card; the bridge never learnt its message id
            assert request() is not None and "message_id" not in open_approvals(tmp_path / "data", "feishu")
        asked = request()
        allow = card_buttons(asked.content)[0][1]
        outage = killed.endswith("over_an_hour_before_the_restart")
        if outage:  # Feishu has forgotten the post's uuid: posting it again would show a second card
            age_open_approvals(tmp_path / "data", 2 * 3600)
            fake.clock = lambda: time.monotonic() + 2 * 3600

        again = await BridgeProcess(path, tmp_path / "bridge.log").start()
        try:
            async def closed() -> bool:
                shown = fake.messages[asked.message_id]
                return not card_buttons(shown.content) and "the bridge restarted" in fake.text_of(shown)
            async def warned() -> bool:
                return "could not be found to close" in again.log()
            if outage:  # the card cannot be found: it is left as it is, and a press on it still changes nothing
                await wait_for(warned, again)
            else:
                await wait_for(closed, again)
            late = await sender.send(sender.card_action(allow, message_id=asked.message_id, chat_id=CHAT))
            assert late.status == 200 and "no longer pending" in late.text
        finally:
            assert await again.stop() == 0
        assert len(fake_openai.requests) == 1  # the tool never ran: nothing asked the model again
        assert [m.message_id for m in fake.shown(CHAT) if "current_time" in fake.text_of(m)] == [asked.message_id]
