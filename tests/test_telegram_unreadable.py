"""Updates aiogram cannot read whole, and receiving that outlasts a store that fails for a moment. The real
Telegram channel (aiogram) against the fake Bot API, the real chain behind it: what each chat shows, what the
model was asked, what the log says."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web

from channels.telegram.channel import SECRET_HEADER, WEBHOOK_PATH
from core.host import SessionHost
from tests.fakes.openai_server import Text
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness

CHAT = 555
FUTURE_ORIGIN = {"forward_origin": {"type": "hidden_bot", "date": 1}}
"""A forward origin of a kind aiogram's models do not know (as a later Bot API release may add)."""
SECRET = "s3cret"


def user_text(request: dict[str, Any]) -> str:
    return str(request["messages"][-1]["content"])


async def test_a_message_with_a_field_aiogram_cannot_read_is_answered_and_does_not_hold_up_the_batch(
        tmp_path, fake_openai, tg, caplog):
    # aiogram reads getUpdates' answer as one list: one refused update failed the whole batch, which was
    # fetched again and refused again, and no chat was answered (the warning quoted every message in it)
    caplog.set_level(logging.WARNING)
    fake_openai.script(Text("one"), Text("two"), Text("three"))
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False)
    try:
        tg.user_message("before, in confidence")
        odd = tg.user_message("forwarded", chat_id=556, extra=FUTURE_ORIGIN)
        tg.user_message("after", chat_id=557)
        await t.channel.start()
        await t.wait_for(lambda: len(fake_openai.requests) == 3)
        await t.settle()
        # the batch's chats are handed over at once, so which of them the model answered first varies
        assert sorted(tg.visible(CHAT) + tg.visible(556) + tg.visible(557)) == ["one", "three", "two"]
        assert all(len(tg.visible(chat)) == 1 for chat in (CHAT, 556, 557))
        assert sorted(user_text(r).split("\n\n")[0] for r in fake_openai.requests) == [
            "after", "before, in confidence", "forwarded"]
        offset = await t.channel.host.get_state(t.channel.offset_key)
        assert offset is not None and int(offset) > odd["update_id"]
        told = [r.getMessage() for r in caplog.records if str(odd["update_id"]) in r.getMessage()]
        assert told and "message.forward_origin" in told[0]
        assert "in confidence" not in caplog.text and "getUpdates failed" not in caplog.text
    finally:
        await t.close()


async def test_an_update_whose_message_cannot_be_read_is_skipped_and_the_rest_answered(
        tmp_path, fake_openai, tg, caplog):
    fake_openai.script(Text("fine"))
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False)
    try:
        unreadable = tg.user_message("no date", chat_id=556, extra={"date": "yesterday"})
        tg.user_message("hello")
        await t.channel.start()
        await t.wait_for(lambda: tg.visible(CHAT) == ["fine"])
        await t.settle()
        assert len(fake_openai.requests) == 1 and tg.visible(556) == []
        skipped = [r for r in caplog.records if r.levelno == logging.ERROR and "skipped" in r.getMessage()]
        assert len(skipped) == 1 and str(unreadable["update_id"]) in skipped[0].getMessage()
        assert "message.date" in skipped[0].getMessage() and "yesterday" not in caplog.text
        offset = await t.channel.host.get_state(t.channel.offset_key)
        assert offset is not None and int(offset) > unreadable["update_id"]
    finally:
        await t.close()


async def webhook_site(t: TelegramHarness) -> tuple[web.AppRunner, str]:
    app = web.Application()
    t.channel.routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}{WEBHOOK_PATH}"


async def post(url: str, update: dict[str, Any]) -> int:
    async with aiohttp.ClientSession() as http, \
            http.post(url, json=update, headers={SECRET_HEADER: SECRET}) as resp:
        return resp.status


async def test_a_webhook_message_with_a_field_aiogram_cannot_read_is_answered(tmp_path, fake_openai, tg):
    # it was answered 400, and Telegram gives up on an update after a few refusals
    fake_openai.script(Text("read it"))
    t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret=SECRET)
    runner, url = await webhook_site(t)
    try:
        assert await post(url, tg.user_message("forwarded", extra=FUTURE_ORIGIN, enqueue=False)) == 200
        await t.wait_for(lambda: tg.visible(CHAT) == ["read it"])
        assert user_text(fake_openai.requests[0]).startswith("forwarded")
    finally:
        await t.close()
        await runner.cleanup()


async def test_a_webhook_message_before_the_bot_knows_who_it_is_is_left_for_telegram_to_send_again(
        tmp_path, fake_openai, tg):
    # the web server listens before the channel's set-up (getMe) is done; a message then was answered 200 and
    # dropped, with nothing in the log
    fake_openai.script(Text("now"))
    release = tg.hold("getMe")
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret=SECRET)
    runner, url = await webhook_site(t)
    try:
        await t.channel.start()
        update = tg.user_message("hello during start-up", enqueue=False)
        assert await post(url, update) == 503
        release.set()
        await asyncio.wait_for(t.channel.ready.wait(), 5)
        assert await post(url, update) == 200  # Telegram's next try
        await t.wait_for(lambda: tg.visible(CHAT) == ["now"])
        assert len(fake_openai.requests) == 1
    finally:
        release.set()
        await t.close()
        await runner.cleanup()


class FlakyOffsets:
    """The channel's host whose store fails its first offset write (or read): a locked SQLite file, a
    PostgreSQL failover."""

    def __init__(self, host: SessionHost, *, fail: str) -> None:
        self.host = host
        self.fail = fail
        self.failed: list[str] = []

    async def get_state(self, name: str) -> str | None:
        if self.fail == "read" and name.startswith("offset") and not self.failed:
            self.failed.append("read")
            raise RuntimeError("database is locked")
        return await self.host.get_state(name)

    async def set_state(self, name: str, value: str) -> None:
        if self.fail == "write" and name.startswith("offset") and not self.failed:
            self.failed.append(value)
            raise RuntimeError("database is locked")
        await self.host.set_state(name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)


async def test_polling_outlasts_an_offset_write_that_fails(tmp_path, fake_openai, tg):
    # the failure ended the polling task for good, while /healthz went on saying all was well
    fake_openai.script(Text("a1"), Text("a2"))
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False)
    flaky = FlakyOffsets(t.channel.host, fail="write")
    t.channel.host = flaky  # type: ignore[assignment]
    try:
        await t.channel.start()
        tg.user_message("first")
        await t.wait_for(lambda: tg.visible(CHAT) == ["a1"] and flaky.failed)
        tg.user_message("second, after the hiccup")
        await t.wait_for(lambda: tg.visible(CHAT) == ["a1", "a2"])
        assert t.channel.state() == "polling"
        offset = await t.channel.host.get_state(t.channel.offset_key)
        assert offset is not None and int(offset) > int(flaky.failed[0])  # written with the next batch
    finally:
        await t.close()


async def test_polling_starts_once_the_offset_can_be_read(tmp_path, fake_openai, tg):
    fake_openai.script(Text("a1"))
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False)
    flaky = FlakyOffsets(t.channel.host, fail="read")
    t.channel.host = flaky  # type: ignore[assignment]
    try:
        await t.channel.start()
        tg.user_message("first")
        await t.wait_for(lambda: tg.visible(CHAT) == ["a1"])
        assert flaky.failed == ["read"] and t.channel.state() == "polling"
    finally:
        await t.close()
