"""Commands in a group with several bots: ``/help@other_bot``, ``/new@other_bot`` and ``/stop@other_bot`` are
meant for the other bot, and ours neither answers, resets nor stops anything for them; our own ``@name`` and
a bare command keep working.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram) against
the fake Bot API; the assertions are what the group sees and what the model was sent."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.openai_server import Text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness

GROUP = -100777


def command(tg: FakeTelegram, text: str, *, chat_id: int = GROUP, chat_type: str = "supergroup") -> dict:
    head = text.split()[0]
    return tg.user_message(text, chat_id=chat_id, chat_type=chat_type,
                           entities=[{"type": "bot_command", "offset": 0, "length": len(head)}])


def contents(body: dict) -> list[tuple[str, str]]:
    """The conversation the model was sent: (role, first line of the text), system prompt left out."""
    out = []
    for m in body["messages"]:
        if m["role"] == "system":
            continue
        content = m["content"]
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        out.append((m["role"], text.split("\n")[0]))
    return out


@pytest.mark.parametrize("policy", ["all", "mention"])
async def test_help_and_new_for_another_bot_are_left_to_it(tmp_path, fake_openai, tg, policy):
    fake_openai.script(Text("hello group"), Text("still here"))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy=policy)
    try:
        at = f"@{tg.username}"
        tg.user_message(f"{at} hi all", chat_id=GROUP, chat_type="supergroup",
                        entities=[{"type": "mention", "offset": 0, "length": len(at)}])
        await t.settle()
        command(tg, "/help@some_other_bot")
        command(tg, "/new@some_other_bot")
        command(tg, "/new@Some_Other_Bot now")  # with words after it: still the other bot's
        command(tg, "/start@some_other_bot")  # a command we do not have: not text for our model either
        await t.settle()
        assert tg.visible(GROUP) == ["hello group"]  # no help, no "new conversation" notice
        tg.user_message(f"{at} and now?", chat_id=GROUP, chat_type="supergroup",
                        entities=[{"type": "mention", "offset": 0, "length": len(at)}])
        await t.settle()
        assert tg.visible(GROUP) == ["hello group", "still here"]
        assert len(fake_openai.requests) == 2
        # the conversation was not reset: the model still sees the first exchange, and nothing of the commands
        assert contents(fake_openai.requests[1]) == [
            ("user", "hi all"), ("assistant", "hello group"), ("user", "and now?")]
    finally:
        await t.close()


async def test_our_own_name_and_a_bare_command_still_work_in_a_group(tmp_path, fake_openai, tg):
    fake_openai.script(Text("first answer"), Text("fresh answer"))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("hi all", chat_id=GROUP, chat_type="supergroup")
        await t.settle()
        command(tg, f"/help@{tg.username}")
        await t.settle()
        [_, shown] = tg.visible(GROUP)
        assert "/stop" in shown  # the help text
        command(tg, "/new")
        await t.settle()
        tg.user_message("hello again", chat_id=GROUP, chat_type="supergroup")
        await t.settle()
        assert tg.visible(GROUP)[-1] == "fresh answer"
        assert contents(fake_openai.requests[-1]) == [("user", "hello again")]  # /new started afresh
    finally:
        await t.close()


async def test_stop_for_another_bot_does_not_stop_our_reply(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text("The whole answer, to the end.", hold=hold, hold_after=8))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("tell me", chat_id=GROUP, chat_type="supergroup")
        await t.wait_for(lambda: len(fake_openai.requests) == 1)  # the reply is being written
        command(tg, "/stop@other_bot")
        await t.wait_for(t.consumed)  # fetched and handed over (or left out) while the reply waits
        hold.set()
        await t.settle()
        assert tg.visible(GROUP) == ["The whole answer, to the end."]
    finally:
        hold.set()
        await t.close()


async def test_our_stop_still_stops_the_reply(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text("The whole answer, to the end.", hold=hold, hold_after=8))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("tell me", chat_id=GROUP, chat_type="supergroup")
        await t.wait_for(lambda: len(fake_openai.requests) == 1)
        command(tg, f"/stop@{tg.username}")
        await t.settle()
        assert "The whole answer, to the end." not in tg.visible(GROUP)
    finally:
        hold.set()
        await t.close()


async def test_a_command_for_another_bot_in_a_private_chat_is_left_out_too(tmp_path, fake_openai, tg):
    fake_openai.script(Text("first answer"), Text("second answer"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("hello")
        await t.settle()
        command(tg, "/new@some_other_bot", chat_id=555, chat_type="private")
        command(tg, "/help@some_other_bot", chat_id=555, chat_type="private")
        tg.user_message("and again")
        await t.settle()
        assert tg.visible(555) == ["first answer", "second answer"]
        assert contents(fake_openai.requests[1]) == [
            ("user", "hello"), ("assistant", "first answer"), ("user", "and again")]
    finally:
        await t.close()
