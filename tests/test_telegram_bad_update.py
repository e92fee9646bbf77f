"""One update the channel's own code fails on does not end Telegram long polling: it is logged (without
the bot token) and skipped, the messages after it are answered, and it is not fetched again after a
restart. The real Telegram channel (aiogram) against the fake Bot API, the real chain behind it."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from channels.telegram.channel import SECRET_HEADER, WEBHOOK_PATH
from tests.fakes.openai_server import Text
from tests.fakes.telegram.harness import telegram_harness

CHAT = 555



async def test_an_update_the_handler_fails_on_is_skipped_and_the_next_message_is_answered(
        tmp_path, fake_openai, tg, caplog):
    caplog.set_level(logging.DEBUG, logger="channels.telegram")
    fake_openai.script(Text("an answer"), Text("a fresh answer"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        # a chat type the adapter does not know: typing the reply's context raises
        bad = tg.user_message("from a new kind of chat", chat_id=-4242, chat_type="business")
        tg.user_message("hello")
        await t.settle()
        assert tg.visible(CHAT) == ["an answer"]
        assert len(fake_openai.requests) == 1
        assert tg.visible(-4242) == []
        skipped = [r for r in caplog.records if r.levelno == logging.ERROR and "skipped" in r.getMessage()]
        assert len(skipped) == 1 and str(bad["update_id"]) in skipped[0].getMessage()
        assert tg.token not in caplog.text
        offset = await t.channel.host.get_state(t.channel.offset_key)
        assert offset is not None and int(offset) > bad["update_id"]
    finally:
        await t.close()

    seen = len(tg.calls)
    t = await telegram_harness(tmp_path, fake_openai, tg)  # after a restart the bad update is not fetched again
    try:
        tg.user_message("and again")
        await t.settle()
        assert tg.visible(CHAT) == ["an answer", "a fresh answer"]
        later = [c for c in tg.calls[seen:] if c.method == "getUpdates"]
        assert all(int(c.params.get("offset") or 0) > bad["update_id"] for c in later)
        assert len(fake_openai.requests) == 2
    finally:
        await t.close()


async def test_a_webhook_update_the_handler_fails_on_is_answered_200_and_the_next_message_is_answered(
        tmp_path, fake_openai, tg):
    # a 500 would make Telegram send the same update again and again
    fake_openai.script(Text("via webhook"))
    t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    app = web.Application()
    t.channel.routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}{WEBHOOK_PATH}"
    try:
        bad = tg.user_message("from a new kind of chat", chat_id=-4242, chat_type="business", enqueue=False)
        good = tg.user_message("hello", enqueue=False)
        async with aiohttp.ClientSession() as http:
            for update in (bad, good):
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    assert resp.status == 200
        await t.wait_for(lambda: tg.visible(CHAT))
        await t.h.settle()
        assert tg.visible(CHAT) == ["via webhook"] and len(fake_openai.requests) == 1
    finally:
        await t.close()
        await runner.cleanup()
