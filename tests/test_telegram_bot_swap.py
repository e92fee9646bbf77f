"""One data_dir, another bot: the operator replaces the bot token by another bot's (or points a second bridge
config at the same database). The polling offset and the dedupe keys belong to the bot they were written for,
so the new bot's first messages are neither skipped (its update ids are below the old bot's offset) nor
swallowed as duplicates (its message ids repeat the old bot's in the same chat); the old bot, back again,
carries on from its own offset. A database written before offsets were kept per bot is read once.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram) against
two fake Bot APIs; the assertions are what each chat shows and what the model was sent."""

from __future__ import annotations

import itertools

import pytest

from channels.telegram.channel import LEGACY_OFFSET_KEY, offset_key
from tests.fakes.openai_server import Text, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness

CHAT = 555


def polled_offsets(tg: FakeTelegram) -> list[int]:
    return [int(c.params.get("offset") or 0) for c in tg.calls if c.method == "getUpdates"]


@pytest.mark.parametrize("first_update_id", [10, 5000], ids=["update_ids_below_the_old_offset", "above_it"])
async def test_another_bot_on_the_same_data_dir_answers_its_first_messages(tmp_path, fake_openai, tg,
                                                                            first_update_id):
    fake_openai.script(Text("old bot 1"), Text("old bot 2"), Text("new bot 1"), Text("new bot 2"),
                       Text("new bot 3"), Text("old bot 3"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("hello old bot")  # chat 555, message 1
        last = tg.user_message("again")  # message 2
        await t.settle()
        assert tg.visible(CHAT) == ["old bot 1", "old bot 2"]
    finally:
        await t.close()
    old_offset = last["update_id"] + 1

    async with FakeTelegram(token="999999:OTHER-bot-token-abcdefghijklmnop", bot_id=999999,
                            username="other_bot") as tg2:
        # a younger bot's update ids are far below the old bot's offset; an older one's above it (then only
        # the message ids, the same as the old bot's in this chat, could make its messages look seen)
        tg2._update_ids = itertools.count(first_update_id)
        t2 = await telegram_harness(tmp_path, fake_openai, tg2)
        try:
            tg2.user_message("hello new bot")  # chat 555, message 1: the old bot's first message id here
            await t2.settle()
            tg2.user_message("second to new bot")  # message 2
            tg2.user_message("third to new bot")  # message 3
            await t2.settle()
            assert tg2.visible(CHAT) == ["new bot 1", "new bot 2", "new bot 3"]
            assert [last_user_text(r).split("\n\n")[0] for r in fake_openai.requests[2:]] == [
                "hello new bot", "second to new bot", "third to new bot"]
            assert polled_offsets(tg2)[0] == 0  # it did not start from the old bot's position
        finally:
            await t2.close()

    # the old bot again: it carries on from its own offset, and its next message is answered
    seen = len(tg.calls)
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("back to the old bot")
        await t.settle()
        first_poll = next(c for c in tg.calls[seen:] if c.method == "getUpdates")
        assert int(first_poll.params.get("offset") or 0) == old_offset
        assert tg.visible(CHAT) == ["old bot 1", "old bot 2", "old bot 3"]
        assert len(fake_openai.requests) == 6
    finally:
        await t.close()


async def test_the_offset_of_a_database_written_before_offsets_were_per_bot_is_taken_over_once(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("the new message"))
    t = await telegram_harness(tmp_path, fake_openai, tg, start=False)
    try:
        handled = tg.user_message("answered before the upgrade")  # confirmed in the old offset, still at Telegram
        await t.channel.host.set_state(LEGACY_OFFSET_KEY, str(handled["update_id"] + 1))
        await t.channel.start()
        tg.user_message("after the upgrade")
        await t.settle()
        assert polled_offsets(tg)[0] == handled["update_id"] + 1
        assert tg.visible(CHAT) == ["the new message"] and len(fake_openai.requests) == 1
        assert await t.channel.host.get_state(LEGACY_OFFSET_KEY) is None  # taken over: no other bot reads it
        assert int(await t.channel.host.get_state(offset_key(tg.bot_id)) or 0) > handled["update_id"] + 1
    finally:
        await t.close()
