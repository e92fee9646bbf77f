"""A group upgraded to a supergroup: Telegram gives the supergroup a new chat id, and the conversation goes on
there. Its messages continue the group's session (the model gets the history, a /stop stops the reply begun in
the group) and are answered in the new chat, and the move is kept across a restart, whether the channel learnt
it from Telegram's service messages or from a reply Telegram redirected.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram) against
the fake Bot API, whose ``migrate`` upgrades a group. Assertions are what the chats show and what the model
was sent."""

from __future__ import annotations

import asyncio

from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import Text
from tests.fakes.telegram.harness import telegram_harness

OLD, NEW = -777, -100777


def sent_texts(body: dict) -> list[str]:
    """The text of every user and assistant message the model was sent."""
    texts = []
    for message in body["messages"]:
        if message["role"] in ("user", "assistant"):
            content = message["content"]
            texts.append(content if isinstance(content, str)
                         else "".join(p.get("text", "") for p in content if isinstance(p, dict)))
    return texts


async def test_stop_in_the_new_supergroup_stops_the_reply_begun_in_the_group_and_the_session_survives_a_restart(
        tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text("The whole answer, to the end.", hold=hold, hold_after=8), Text("You asked me something."))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("tell me a long story", chat_id=OLD, chat_type="group")
        tg.migrate(OLD, NEW)  # upgraded before the reply could reach the group: Telegram redirects it
        await t.wait_for(lambda: tg.visible(NEW))  # the reply's first words, in the new chat
        tg.user_message("/stop", chat_id=NEW, chat_type="supergroup")
        await t.wait_for(lambda: any("Stopped" in text for text in tg.visible(NEW)))
        hold.set()
        await t.settle()
        assert "Nothing is running." not in tg.visible(NEW)
        assert "The whole answer, to the end." not in tg.visible(NEW)
    finally:
        hold.set()
        await t.close()

    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")  # the move was kept
    try:
        assert t.channel.client.moved == {OLD: NEW}
        tg.user_message("what did I ask?", chat_id=NEW, chat_type="supergroup")
        await t.settle()
        assert "tell me a long story" in sent_texts(fake_openai.requests[-1])[0]
        assert tg.visible(NEW)[-1] == "You asked me something."
    finally:
        await t.close()


async def test_after_the_upgrade_notice_the_conversation_goes_on_in_the_supergroup(tmp_path, fake_openai, tg):
    fake_openai.script(Text("Hello Bob."), Text("Your name is Bob."))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("my name is Bob", chat_id=OLD, chat_type="group")
        await t.settle()
        tg.migrate(OLD, NEW)
        # Telegram's service messages for the upgrade, one in each chat
        tg.user_message(None, chat_id=OLD, chat_type="group", extra={"migrate_to_chat_id": NEW})
        tg.user_message(None, chat_id=NEW, chat_type="supergroup", extra={"migrate_from_chat_id": OLD})
        await t.settle()
    finally:
        await t.close()
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("what is my name?", chat_id=NEW, chat_type="supergroup")
        await t.settle()
        [_, request] = fake_openai.requests
        texts = sent_texts(request)
        assert texts[0].endswith("my name is Bob") and texts[1] == "Hello Bob."
        assert tg.visible(NEW) == ["Your name is Bob."]
        assert tg.visible(OLD) == ["Hello Bob."]
    finally:
        await t.close()


class FailingMoveWrite(SqliteStore):
    """The first write of a group's upgrade fails (a locked database)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.failed = False

    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        if name.startswith("migrated:") and not self.failed:
            self.failed = True
            raise StoreError("sqlite store: set_channel_state failed (OperationalError: database is locked)")
        await super().set_channel_state(channel, name, value)


async def test_an_upgrade_notice_that_could_not_be_kept_is_fetched_again(tmp_path, fake_openai, tg):
    store = FailingMoveWrite(tmp_path / "chat.db")
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all", core={"store": store})
    try:
        notice = tg.user_message(None, chat_id=NEW, chat_type="supergroup", extra={"migrate_from_chat_id": OLD})
        await t.settle()
        assert store.failed
        offsets = [int(c.params.get("offset") or 0) for c in tg.calls if c.method == "getUpdates"]
        assert offsets[:2] == [0, 0] and offsets[-1] == notice["update_id"] + 1  # fetched again, then confirmed
        assert await t.channel.host.get_state(f"migrated:{NEW}") == str(OLD)
    finally:
        await t.close()
