"""The fake Bot API's rate limits, through the real aiogram client: past Telegram's published pace a message
call is answered 429 with ``retry_after``, and nothing is shown."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiogram.exceptions import TelegramRetryAfter
from aiogram.methods import EditMessageText, SendMessage

from channels.telegram.factory import make_bot
from tests.fakes.telegram import FakeTelegram


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as fake:
        fake.clock = lambda: 1000.0  # every call within one window, however slow the machine
        yield fake


async def test_one_chat_gets_a_short_burst_then_429_with_retry_after(tg: FakeTelegram) -> None:
    tg.enforce_limits(per_chat=3, window=3.0)
    bot = make_bot(tg.token, tg.base_url)
    try:
        first = await bot(SendMessage(chat_id=1, text="one"))
        await bot(EditMessageText(chat_id=1, message_id=first.message_id, text="one, edited"))
        await bot(SendMessage(chat_id=1, text="two"))
        with pytest.raises(TelegramRetryAfter) as caught:
            await bot(SendMessage(chat_id=1, text="three"))
        assert caught.value.retry_after == 1
        await bot(SendMessage(chat_id=2, text="another chat"))  # its own budget
    finally:
        await bot.session.close()
    assert tg.visible(1) == ["one, edited", "two"] and tg.visible(2) == ["another chat"]
    assert tg.limited == 1


async def test_new_messages_over_all_chats_are_limited_but_edits_are_not(tg: FakeTelegram) -> None:
    tg.enforce_limits(overall=5)
    bot = make_bot(tg.token, tg.base_url)
    try:
        sent = [await bot(SendMessage(chat_id=chat, text="hi")) for chat in range(5)]
        with pytest.raises(TelegramRetryAfter):
            await bot(SendMessage(chat_id=99, text="one too many"))
        for chat, message in enumerate(sent):
            await bot(EditMessageText(chat_id=chat, message_id=message.message_id, text="edited"))
    finally:
        await bot.session.close()
    assert tg.visible(99) == [] and all(tg.visible(chat) == ["edited"] for chat in range(5))
