"""A Telegram message that replies to another one: the model is told what it replies to (the quoted message's
text, and whose it is), in that turn and in later ones — before, it saw only "is that right?" and had to guess.
Driven through the fake Bot API; what is asserted is what the model was sent."""

from __future__ import annotations

from tests.fakes.openai_server import Text, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness

GROUP = -100777


def other_users_message(text: str, *, message_id: int = 900) -> dict:
    return {"message_id": message_id, "date": 0, "chat": {"id": GROUP, "type": "supergroup"},
            "from": {"id": 888, "is_bot": False, "first_name": "Bob", "username": "bob"}, "text": text}


def mention(tg: FakeTelegram, words: str) -> tuple[str, list[dict]]:
    at = f"@{tg.username}"
    return f"{at} {words}", [{"type": "mention", "offset": 0, "length": len(at)}]


async def test_a_reply_to_another_users_message_shows_the_model_what_it_replies_to(tmp_path, fake_openai, tg):
    fake_openai.script(Text("Yes, 5 pm."), Text("Room 4."))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        text, ents = mention(tg, "is that right?")
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup",
                        reply_to=other_users_message("The meeting moved to 5 pm."))
        await t.settle()
        sent = last_user_text(fake_openai.requests[0])
        assert sent.startswith('[In reply to Bob: "The meeting moved to 5 pm."]\nis that right?'), sent
        text, ents = mention(tg, "and where?")
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup")
        await t.settle()
        # the earlier question keeps its quote in the context of later turns
        users = [m["content"] for m in fake_openai.requests[1]["messages"] if m["role"] == "user"]
        assert users[0].startswith('[In reply to Bob: "The meeting moved to 5 pm."]\nis that right?')
        assert not users[1].startswith("[In reply to")
    finally:
        await t.close()


async def test_a_reply_to_the_bots_own_answer_says_which_answer(tmp_path, fake_openai, tg):
    fake_openai.script(Text("First: apples. Second: pears."), Text("Pears are sweeter."))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("name two fruits")
        await t.settle()
        [answer] = tg.messages(555)
        tg.user_message("why this one?", reply_to=tg.bot_message(555, answer.message_id))
        await t.settle()
        sent = last_user_text(fake_openai.requests[1])
        assert sent.startswith('[In reply to your message: "First: apples. Second: pears."]\nwhy this one?'), sent
    finally:
        await t.close()


async def test_a_long_quote_is_cut_and_a_forum_topics_own_start_is_no_quote(tmp_path, fake_openai, tg):
    fake_openai.script(Text("ok"), Text("ok"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        text, ents = mention(tg, "summarise")
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup",
                        reply_to=other_users_message("word " * 1000))
        await t.settle()
        sent = last_user_text(fake_openai.requests[0])
        quote = sent.split("]\n", 1)[0]
        assert quote.endswith('…"') and len(quote) < 1100, quote
        # in a forum every message "replies" to its topic's first message: that is not a quote
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup", thread_id=7,
                        reply_to=other_users_message("Topic: fruit", message_id=7))
        await t.settle()
        assert last_user_text(fake_openai.requests[1]).startswith("summarise")
    finally:
        await t.close()
