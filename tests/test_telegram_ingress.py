"""Inbound Telegram: groups and forum topics, group policy, allow_from, media, edits, commands, dedupe
across restarts, webhook mode, drafts, and keeping the bot token out of logs and errors."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiogram.types import Message

from channels.telegram.adapter import AllowList, BotIdentity, normalize
from channels.telegram.channel import SECRET_HEADER
from core.envelope import TurnTarget
from core.messages import MessageSource, NewMessage
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import Function, Text, image_parts, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness
from tests.support.media import jpeg

GROUP = -100777



def mention(tg: FakeTelegram, text_before: str = "") -> tuple[str, list[dict]]:
    at = f"@{tg.username}"
    return f"{text_before}{at} what is 2+2?", [{"type": "mention", "offset": len(text_before), "length": len(at)}]


async def test_forum_topic_is_its_own_session_and_replies_stay_in_the_topic(tmp_path, fake_openai, tg):
    fake_openai.script(Text("Answer in topic seven."), Text("Answer in topic nine."))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        text, ents = mention(tg)
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup", thread_id=7)
        await t.settle()
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup", thread_id=9)
        await t.settle()
        [a, b] = tg.messages(GROUP)
        assert (a.text, a.thread_id) == ("Answer in topic seven.", 7)
        assert (b.text, b.thread_id) == ("Answer in topic nine.", 9)
        assert a.reply_to is not None  # in groups the reply quotes the user's message
        assert all(c.params.get("message_thread_id") in (7, 9) for c in tg.calls_to(GROUP))
        keys = {s.key for s in await t.core.list_sessions(prefix="telegram:")}
        assert keys == {f"telegram:{GROUP}:7", f"telegram:{GROUP}:9"}
        assert last_user_text(fake_openai.requests[0]).startswith("what is 2+2?")  # mention stripped
    finally:
        await t.close()


async def test_group_message_without_mention_is_ignored_but_a_reply_to_the_bot_is_answered(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("first"), Text("second"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("just chatting among humans", chat_id=GROUP, chat_type="supergroup")
        await t.settle()
        assert fake_openai.requests == [] and tg.messages(GROUP) == []
        text, ents = mention(tg)
        tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="group")
        await t.settle()
        [first] = tg.messages(GROUP)
        tg.user_message("and why?", chat_id=GROUP, chat_type="group",
                        reply_to=tg.bot_message(GROUP, first.message_id))
        await t.settle()
        assert [m.text for m in tg.messages(GROUP)] == ["first", "second"]
        assert len(fake_openai.requests) == 2
    finally:
        await t.close()


@pytest.mark.parametrize(("policy", "answered"), [("all", True), ("off", False)])
async def test_group_policy_all_and_off(tmp_path, fake_openai, tg, policy, answered):
    fake_openai.script(Text("hello group"))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy=policy)
    try:
        tg.user_message("no mention here", chat_id=GROUP, chat_type="supergroup")
        await t.settle()
        assert bool(fake_openai.requests) is answered
    finally:
        await t.close()


@pytest.mark.parametrize("allow", [("42", "@bob"), ()])
async def test_user_outside_allow_from_never_reaches_the_model(tmp_path, fake_openai, tg, allow):
    t = await telegram_harness(tmp_path, fake_openai, tg, allow_from=allow)
    try:
        tg.user_message("let me in", user_id=777, username="alice")
        await t.settle()
        assert fake_openai.requests == [] and tg.visible(555) == []
    finally:
        await t.close()


@pytest.mark.parametrize("allow", [("777",), ("@Alice",), ("alice",), ("*",)])
async def test_allow_from_matches_ids_and_usernames_with_or_without_at(tmp_path, fake_openai, tg, allow):
    fake_openai.script(Text("welcome"))
    t = await telegram_harness(tmp_path, fake_openai, tg, allow_from=allow)
    try:
        tg.user_message("let me in", user_id=777, username="alice")
        await t.settle()
        assert tg.visible(555) == ["welcome"]
    finally:
        await t.close()


async def test_captions_and_media_reach_the_model_and_edits_are_ignored(tmp_path, fake_openai, tg):
    fake_openai.script(Text("nice picture"))
    tg.add_file("big", jpeg(1280, 960))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        update = tg.user_message(caption="what is this?", photo=True)
        tg.user_message("what is this? (edited)", edited=True, message_id=update["message"]["message_id"])
        await t.settle()
        assert len(fake_openai.requests) == 1
        sent = last_user_text(fake_openai.requests[0])
        assert sent.startswith("what is this?") and len(image_parts(fake_openai.requests[0])) == 1
        assert tg.visible(555) == ["nice picture"]
    finally:
        await t.close()


async def test_commands_are_registered_and_help_answers(tmp_path, fake_openai, tg):
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        assert [c["command"] for c in tg.commands] == ["stop", "new", "help", "compact"]
        tg.user_message(f"/help@{tg.username}")
        await t.settle()
        [shown] = tg.visible(555)
        assert "/stop" in shown and fake_openai.requests == []
    finally:
        await t.close()


async def test_redelivered_update_is_answered_once_also_after_a_restart(tmp_path, fake_openai, tg):
    fake_openai.script(Text("only once"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        first = tg.user_message("hello")
        await t.settle()
        # Telegram re-delivers the same message under a new update_id
        again = tg.user_message("hello", message_id=first["message"]["message_id"])
        await t.settle()
    finally:
        await t.close()
    stored = again["update_id"] + 1
    # restart on the same database: the persisted offset means nothing is fetched twice
    tg.user_message("hello", message_id=first["message"]["message_id"])
    fake_openai.script(Text("fresh"))
    t2 = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        polls = [c for c in tg.calls if c.method == "getUpdates"]
        assert any(int(c.params.get("offset") or 0) == stored for c in polls)
        await t2.settle()
        tg.user_message("new question")
        await t2.settle()
        assert tg.visible(555) == ["only once", "fresh"]
        assert len(fake_openai.requests) == 2
    finally:
        await t2.close()


async def test_reply_targets_survive_a_restart_also_those_written_before_the_context_was_typed(
        tmp_path, fake_openai, tg):
    """Turns a crash left running are reported in their chat: the forum topic and the quoted message come
    from the persisted target, whether this build wrote it or the one before (no topic in its context)."""
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    old_row = TurnTarget.model_validate({
        "channel": "telegram", "chat_id": str(GROUP), "session_key": f"telegram:{GROUP}:7", "sender_id": "777",
        "thread": {"thread_id": "7"}, "channel_context": {"data": {"chat_type": "supergroup", "message_id": 42}}})
    text, ents = mention(tg)
    update = tg.user_message(text, entities=ents, chat_id=GROUP, chat_type="supergroup", thread_id=9,
                             message_id=43, enqueue=False)
    envelope = normalize(Message.model_validate(update["message"]), BotIdentity(tg.bot_id, tg.username),
                         allow=AllowList(["*"]), group_policy="mention")
    assert envelope is not None
    new_row = envelope.target()  # as this build persists it
    asked = NewMessage(role="user", content=text, source=MessageSource(kind="user_input"))
    await store.append_message(old_row.session_key, asked, begin_turn=("t-old", old_row.model_dump_json()))
    await store.append_message(new_row.session_key, asked, begin_turn=("t-new", new_row.model_dump_json()))
    await store.close()
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        notices = tg.messages(GROUP)
        assert sorted((m.thread_id, m.reply_to) for m in notices) == [(7, 42), (9, 43)]
        assert all("restarted" in m.text for m in notices)
    finally:
        await t.close()


async def test_webhook_mode_checks_the_secret_and_answers(tmp_path, fake_openai, tg):
    fake_openai.script(Text("via webhook"))
    t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    url = await t.serve_webhook()
    try:
        assert tg.webhook is not None and tg.webhook["secret_token"] == "s3cret"
        update = tg.user_message("hi by webhook", enqueue=False)
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=update, headers={SECRET_HEADER: "wrong"}) as resp:
                assert resp.status == 401
            for _ in range(2):  # Telegram retries: the second delivery is a duplicate
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    assert resp.status == 200
        await t.wait_for(lambda: tg.visible(555))
        await t.h.settle()
        assert tg.visible(555) == ["via webhook"] and len(fake_openai.requests) == 1
        assert tg.count("getUpdates") == 0
        await t.channel.stop()
        assert tg.webhook is None  # deleted at stop
    finally:
        await t.close()


class GatedAdmissions(SqliteStore):
    """Storing an inbound message waits for ``gate`` and fails while ``failures`` is above zero."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = asyncio.Event()
        self.gate.set()
        self.failures = 0

    async def admit_inbound(self, channel, event_id, payload, *, ttl_seconds, key=None):  # type: ignore[override]
        await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise StoreError("sqlite store: admit_inbound failed (OperationalError: database is locked)")
        return await super().admit_inbound(channel, event_id, payload, ttl_seconds=ttl_seconds, key=key)


async def test_an_update_core_could_not_store_is_fetched_again_and_answered_once(tmp_path, fake_openai, tg):
    fake_openai.script(Text("answered"))
    store = GatedAdmissions(tmp_path / "chat.db")
    store.failures = 1
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"store": store})
    try:
        update = tg.user_message("please keep me")
        await t.settle()
        offsets = [int(c.params.get("offset") or 0) for c in tg.calls if c.method == "getUpdates"]
        # the failed update was not confirmed: the next poll asked for it again
        assert offsets[:3] == [0, 0, update["update_id"] + 1]
        assert tg.visible(555) == ["answered"] and len(fake_openai.requests) == 1
    finally:
        await t.close()


async def test_webhook_answers_only_after_the_message_is_stored(tmp_path, fake_openai, tg):
    fake_openai.script(Text("via webhook"))
    store = GatedAdmissions(tmp_path / "chat.db")
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"store": store}, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    url = await t.serve_webhook()
    headers = {SECRET_HEADER: "s3cret"}
    try:
        update = tg.user_message("hi by webhook", enqueue=False)
        async with aiohttp.ClientSession() as http:
            store.failures = 1
            async with http.post(url, json=update, headers=headers) as resp:
                assert resp.status == 503  # not stored: Telegram delivers it again
            store.gate.clear()
            delivery = asyncio.create_task(http.post(url, json=update, headers=headers))
            await asyncio.sleep(0.2)
            assert not delivery.done()  # no 200 while the message is not stored yet
            store.gate.set()
            async with await delivery as resp:
                assert resp.status == 200
        await t.wait_for(lambda: tg.visible(555))
        await t.h.settle()
        assert tg.visible(555) == ["via webhook"] and len(fake_openai.requests) == 1
    finally:
        await t.close()


async def test_private_chat_streams_as_a_draft_then_sends_the_final_once(tmp_path, fake_openai, tg):
    answer = "A long streamed answer " * 8
    fake_openai.script(Text(answer, chunk_size=10, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, stream_transport="auto")
    try:
        tg.user_message("stream please")
        await t.settle()
        assert tg.draft_calls >= 2
        assert tg.visible(555) == [answer.strip()]
        assert tg.count("editMessageText") == 0 and tg.count("sendMessage") == 1
    finally:
        await t.close()


async def test_rejected_drafts_fall_back_to_edits(tmp_path, fake_openai, tg):
    tg.drafts_supported = False
    answer = "A long streamed answer " * 8
    fake_openai.script(Text(answer, chunk_size=10, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, stream_transport="draft")
    try:
        tg.user_message("stream please")
        await t.settle()
        assert tg.visible(555) == [answer.strip()]
        assert tg.count("editMessageText") >= 1 and t.channel.drafts_rejected
    finally:
        await t.close()


async def test_the_bot_token_never_reaches_logs_or_errors(tmp_path, fake_openai, tg, caplog):
    caplog.set_level(logging.DEBUG)
    fake_openai.script(Text("x" * 40))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("sendMessage", status=403, description=f"Forbidden: token {tg.token} rejected", times=10)
        tg.fail("sendChatAction", status=500, description="Internal Server Error", times=10)
        tg.user_message("hi")
        await t.settle()
        assert tg.count("sendMessage") >= 2
    finally:
        await t.close()
    assert caplog.records
    assert tg.token not in caplog.text
    assert "TEST-secret-token" not in caplog.text


class RefusesOne(SqliteStore):
    """Storing the inbound message with ``refused`` in it fails once."""

    def __init__(self, path, refused: str) -> None:
        super().__init__(path)
        self.refused = refused

    async def admit_inbound(self, channel, event_id, payload, *, ttl_seconds, key=None):  # type: ignore[override]
        if self.refused and self.refused in payload:
            self.refused = ""
            raise StoreError("sqlite store: admit_inbound failed (OperationalError: database is locked)")
        return await super().admit_inbound(channel, event_id, payload, ttl_seconds=ttl_seconds, key=key)


async def test_a_batch_is_confirmed_up_to_the_update_core_could_not_store(tmp_path, fake_openai, tg):
    fake_openai.default = Function(lambda body: Text("answer to " + last_user_text(body).split()[0]))
    first = tg.user_message("one", chat_id=501)
    second = tg.user_message("two", chat_id=502)
    tg.user_message("three", chat_id=503)  # queued before polling starts: the three come in one batch
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"store": RefusesOne(tmp_path / "chat.db", "two")})
    try:
        await t.settle()
        offsets = [int(c.params.get("offset") or 0) for c in tg.calls if c.method == "getUpdates"]
        # the first was stored and confirmed; the refused one and the one after it were asked for again
        assert offsets[:2] == [0, first["update_id"] + 1] and second["update_id"] == first["update_id"] + 1
        assert [tg.visible(c) for c in (501, 502, 503)] == [["answer to one"], ["answer to two"],
                                                             ["answer to three"]]
        assert len(fake_openai.requests) == 3
    finally:
        await t.close()


class HoldsOne(SqliteStore):
    """Storing the inbound message with ``held`` in it waits for ``gate``."""

    def __init__(self, path, held: str) -> None:
        super().__init__(path)
        self.held = held
        self.gate = asyncio.Event()

    async def admit_inbound(self, channel, event_id, payload, *, ttl_seconds, key=None):  # type: ignore[override]
        if self.held in payload:
            await self.gate.wait()
        return await super().admit_inbound(channel, event_id, payload, ttl_seconds=ttl_seconds, key=key)


async def test_one_chat_whose_message_is_slow_to_store_does_not_hold_up_another_in_the_same_batch(
        tmp_path, fake_openai, tg):
    fake_openai.default = Function(lambda body: Text("answer to " + last_user_text(body).split()[0]))
    tg.user_message("slow", chat_id=701)
    tg.user_message("quick", chat_id=702)  # queued before polling starts: both come in one batch
    store = HoldsOne(tmp_path / "chat.db", "slow")
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"store": store})
    try:
        await t.wait_for(lambda: tg.visible(702) == ["answer to quick"])
        assert tg.visible(701) == []
        # the batch is confirmed only once every message of it is stored
        assert all(int(c.params.get("offset") or 0) == 0 for c in tg.calls if c.method == "getUpdates")
        store.gate.set()
        await t.settle()
        assert [tg.visible(c) for c in (701, 702)] == [["answer to slow"], ["answer to quick"]]
        assert len(fake_openai.requests) == 2
    finally:
        store.gate.set()
        await t.close()
