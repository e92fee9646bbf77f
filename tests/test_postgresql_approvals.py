"""Approval buttons with several ``chatbridge run`` processes on one PostgreSQL database.

A press reaches whichever process receives it (Telegram: the one polling the bot; Feishu and Slack:
whichever took the webhook request), not necessarily the one running the turn that waits for the decision.
Here process B runs the turn and posts the buttons, and every press goes to process A: A must find the
request, have B decide it by core's rule (a user not allowed to decide is refused, and nothing changes), the
tool runs in B, and the buttons show the outcome once. A process that starts never closes the buttons of
another live process; the buttons of a process that died are closed by a live one.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from tests.fakes.feishu import FakeFeishu, FakeLongConnection, WebhookSender
from tests.fakes.feishu.events import Mention, card_action_event, message_event
from tests.fakes.feishu.harness import CHAT as FEISHU_CHAT
from tests.fakes.feishu.harness import KEY, TOKEN
from tests.fakes.feishu.openapi import card_buttons
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
from tests.fakes.slack.sender import EventSender
from tests.fakes.slack.server import FakeSlack
from tests.fakes.telegram import FakeTelegram
from tests.support.platforms import one_origin
from tests.support.ports import free_port
from tests.support.postgres import PostgresCluster
from tests.support.process import BridgeProcess, postgresql_config, wait_for

ASK = '[agent]\ntitles = false\ntool_approval = { current_time = "ask" }\n'
RESTARTED = "⛔ Denied: the bridge restarted."
NOT_YOURS = "Only the person who asked, or a user allowed to use this bot, can decide this."



async def state_is(port: int, channel: str, expected: str) -> bool:
    """The channel's state on the process's ``/healthz`` is ``expected``."""
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            body: Any = await resp.json()
            return resp.status == 200 and body["channels"][channel] == expected
    except (aiohttp.ClientError, ValueError, KeyError):
        return False


def tool_ran(fake_openai: FakeOpenAI, call_id: str) -> bool:
    """The model was sent the tool's output for ``call_id``: the tool ran (a denied call's output says so)."""
    return any(m.get("role") == "tool" and m.get("tool_call_id") == call_id and "denied" not in str(m.get("content"))
               for r in fake_openai.requests for m in r.get("messages", []))


def asking(path: Path) -> Path:
    """The config at ``path`` with ``current_time`` asking for approval."""
    path.write_text(path.read_text().replace("[agent]\ntitles = false\n", ASK))
    return path


def telegram_config(directory: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, dsn: str, port: int) -> Path:
    return asking(postgresql_config(directory, dsn=dsn, llm=fake_openai.base_url, port=port, store="lease_seconds = 3",
                             extra=f"""
[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
edit_interval_ms = 100
"""))


async def fetch(dsn: str, query: str) -> list[asyncpg.Record]:
    """One query on the test cluster, on a connection of its own (as another process would)."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(query)
    finally:
        await conn.close()


async def test_a_telegram_press_polled_by_one_process_is_decided_by_the_process_running_the_turn(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, postgres: PostgresCluster) -> None:

    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_T1"]), Text("It is late."))
    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    a = BridgeProcess(telegram_config(tmp_path / "a", fake_openai, tg, dsn, ports[0]), tmp_path / "a.log")
    b = BridgeProcess(telegram_config(tmp_path / "b", fake_openai, tg, dsn, ports[1]), tmp_path / "b.log")
    bridges = [a, b]
    try:
        await b.start()  # alone: B polls, takes the message, runs its turn and posts the request
        await wait_for(lambda: state_is(ports[1], "telegram", "polling"), b, what="B polling", timeout=120)
        tg.user_message("what time is it?", chat_id=555)

        def request() -> Any:
            return next((m for m in tg.messages(555) if m.buttons), None)

        await wait_for(lambda: request() is not None, b, what="the approval request", timeout=60)
        asked = request()
        assert asked is not None and "current_time" in asked.text
        await a.start()
        await wait_for(lambda: state_is(ports[0], "telegram", "standby"), bridges, what="A standing by",
                       timeout=120)
        # B's polling lead ends (its lead connection is cut) while its turn goes on: A polls from now on
        cut = await fetch(dsn, "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                               " AND granted AND pid <> pg_backend_pid()")
        assert len(cut) == 1
        await wait_for(lambda: state_is(ports[0], "telegram", "polling"), bridges, what="A polling",
                       timeout=60)
        await wait_for(lambda: state_is(ports[1], "telegram", "standby"), bridges, what="B standing by",
                       timeout=60)
        shown = tg.chats[555][asked.message_id]
        assert shown.buttons  # A started, and left B's live request alone

        mallory = tg.press(555, asked.message_id, "✅ Allow", user_id=999, username="mallory")
        await wait_for(lambda: bool(tg.answers(mallory)), bridges, what="the refused press answered", timeout=30)
        assert tg.answers(mallory)[0].get("text") == NOT_YOURS and tg.answers(mallory)[0].get("show_alert")
        assert shown.buttons and not tool_ran(fake_openai, "call_T1")

        alice = tg.press(555, asked.message_id, "✅ Allow")  # the sender of the message
        await wait_for(lambda: "It is late." in [m.text for m in tg.messages(555)], bridges, what="the answer",
                       timeout=60)
        assert [x.get("text") for x in tg.answers(alice)] == ["Allowed"]
        assert tool_ran(fake_openai, "call_T1")
        assert not shown.buttons and shown.text.endswith("\n\n✅ Allowed by Alice")  # who pressed, as in one process
        await asyncio.sleep(1.0)  # a second edit would show by now
        edits = [c for c in tg.calls if c.method in ("editMessageText", "editMessageReplyMarkup")
                 and int(c.params.get("message_id") or 0) == asked.message_id]
        assert len(edits) == 1  # the outcome is shown once
        assert [m.text for m in tg.messages(555)].count("It is late.") == 1
        for bridge in bridges:
            assert await bridge.stop() == 0
            assert "Traceback" not in bridge.log(), bridge.log()
    finally:
        for bridge in bridges:
            await bridge.stop()


def feishu_config(directory: Path, fake_openai: FakeOpenAI, fake: FakeFeishu, dsn: str, port: int,
                  origin: str | None = None) -> Path:
    """A Feishu process in webhook mode or, given ``origin`` (serving the Open API and the long connection's
    endpoint: Feishu has one domain for both), receiving over the long connection."""
    receive = ("" if origin else
               f'mode = "webhook"\nverification_token = "{TOKEN}"\nencrypt_key = "{KEY}"\n')
    return asking(postgresql_config(directory, dsn=dsn, llm=fake_openai.base_url, port=port, store="lease_seconds = 3",
                             extra=f"""
[channels.feishu]
enabled = true
app_id = "{fake.app_id}"
app_secret = "{fake.app_secret}"
domain = "{origin or fake.base_url}"
{receive}"""))


def feishu_pair(tmp_path: Path, fake_openai: FakeOpenAI, fake: FakeFeishu, dsn: str,
                ports: list[int]) -> tuple[BridgeProcess, BridgeProcess, WebhookSender, WebhookSender]:
    """Two Feishu webhook processes A and B on one database (not started), and a sender to each."""
    a, b = (BridgeProcess(feishu_config(tmp_path / n, fake_openai, fake, dsn, p), tmp_path / f"{n}.log")
            for n, p in zip("ab", ports, strict=True))
    to_a, to_b = (WebhookSender(f"http://127.0.0.1:{p}/feishu/events", TOKEN, fake.app_id, KEY) for p in ports)
    return a, b, to_a, to_b


def approval_card(fake: FakeFeishu) -> Any:
    """The card asking for approval, while it has its buttons (None before and after)."""
    return next((m for m in fake.shown(FEISHU_CHAT) if m.msg_type == "interactive" and card_buttons(m.content)),
                None)


def card_patches(fake: FakeFeishu, message_id: str) -> int:
    return sum(1 for c in fake.calls_to("message.patch") if c.path.endswith(f"/{message_id}"))


async def answered_and_shown_once(fake: FakeFeishu, fake_openai: FakeOpenAI, bridges: list[BridgeProcess],
                                  card_id: str, call_id: str) -> None:
    """After an allowing press: the tool ran, the answer is shown, the card shows the outcome once with who
    pressed; then every process stops cleanly."""
    async def answered() -> bool:
        return any("It is late." in fake.text_of(m) for m in fake.shown(FEISHU_CHAT))
    await wait_for(answered, bridges, what="the answer", timeout=60)
    assert tool_ran(fake_openai, call_id)
    card = fake.messages[card_id]
    assert not card_buttons(card.content) and "Allowed by u\\_alice" in fake.text_of(card)  # who pressed
    await asyncio.sleep(1.0)  # a second update would show by now
    assert card_patches(fake, card_id) == 1  # the outcome is shown once
    for bridge in bridges:
        assert await bridge.stop() == 0
        assert "Traceback" not in bridge.log(), bridge.log()


async def test_a_feishu_press_taken_by_another_process_is_decided_by_the_process_running_the_turn(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_F1"]), Text("It is late."))
    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    async with FakeFeishu() as fake:
        fake.chat(FEISHU_CHAT)
        a, b, to_a, to_b = feishu_pair(tmp_path, fake_openai, fake, dsn, ports)
        bridges = [a, b]

        def request() -> Any:
            return approval_card(fake)

        try:
            await b.start()
            await wait_for(lambda: state_is(ports[1], "feishu", "webhook"), b, what="B serving",
                           timeout=120)
            msg = fake.user_message(FEISHU_CHAT, "what time is it?")
            sent = await to_b.send(to_b.message("@_user_1 what time is it?", chat_id=FEISHU_CHAT,
                                                message_id=msg.message_id,
                                                mentions=[Mention(fake.bot_name, fake.bot_open_id)]))
            assert sent.status == 200
            await wait_for(lambda: request() is not None, b, what="the approval card", timeout=60)
            asked = request()
            allow = card_buttons(asked.content)[0][1]
            await a.start()
            await wait_for(lambda: state_is(ports[0], "feishu", "webhook"), bridges, what="A serving",
                           timeout=120)
            await asyncio.sleep(0.5)  # A's start-up closing of left-over cards has run
            assert card_buttons(fake.messages[asked.message_id].content)  # B's live card was left alone
            assert card_patches(fake, asked.message_id) == 0

            refused = await to_a.send(to_a.card_action(allow, message_id=asked.message_id, chat_id=FEISHU_CHAT,
                                                       operator_open_id="ou_mallory", operator_user_id="u_mallory",
                                                       operator_union_id=None))
            assert refused.status == 200 and json.loads(refused.text)["toast"]["content"] == NOT_YOURS
            assert card_buttons(fake.messages[asked.message_id].content) and not tool_ran(fake_openai, "call_F1")

            started = time.monotonic()
            pressed = await to_a.send(to_a.card_action(allow, message_id=asked.message_id, chat_id=FEISHU_CHAT))
            print(f"\na press forwarded to the process running the turn answered in "
                  f"{time.monotonic() - started:.3f}s")
            assert pressed.status == 200 and json.loads(pressed.text)["toast"]["content"] == "Allowed"
            await answered_and_shown_once(fake, fake_openai, bridges, asked.message_id, "call_F1")
        finally:
            for bridge in bridges:
                await bridge.stop()


async def test_a_feishu_press_over_the_long_connection_of_another_process_is_decided_by_the_one_running_the_turn(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    """The long connection: Feishu pushes each event to one connection of the app (here the newest), so a press
    can reach a process that is not running the turn; the answer to the press goes back in its ack."""
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_W1"]), Text("It is late."))
    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    async with FakeFeishu() as fake, FakeLongConnection(fake.app_id, fake.app_secret) as conn:
        runner, origin = await one_origin({"/open-apis/": fake.base_url, "/callback/": conn.base_url})
        fake.chat(FEISHU_CHAT)
        a, b = (BridgeProcess(feishu_config(tmp_path / n, fake_openai, fake, dsn, p, origin),
                              tmp_path / f"{n}.log") for n, p in zip("ab", ports, strict=True))
        bridges = [a, b]

        async def press(value: Any, message_id: str, **operator: Any) -> Any:
            frame = conn.push(card_action_event(value, token=TOKEN, app_id=fake.app_id, message_id=message_id,
                                                chat_id=FEISHU_CHAT, **operator))
            ack = await conn.wait_ack(frame, timeout=30)
            assert ack.code == 200, ack
            return ack.data

        try:
            await b.start()
            await wait_for(lambda: state_is(ports[1], "feishu", "connected"), b, what="B connected", timeout=120)
            await conn.wait_connected(1, timeout=30)
            msg = fake.user_message(FEISHU_CHAT, "what time is it?")
            conn.push(message_event("@_user_1 what time is it?", token=TOKEN, app_id=fake.app_id,
                                    chat_id=FEISHU_CHAT, message_id=msg.message_id,
                                    mentions=[Mention(fake.bot_name, fake.bot_open_id)]))  # to B, the only one
            await wait_for(lambda: approval_card(fake) is not None, b, what="the approval card", timeout=60)
            asked = approval_card(fake)
            allow = card_buttons(asked.content)[0][1]
            await a.start()
            await wait_for(lambda: state_is(ports[0], "feishu", "connected"), bridges, what="A connected",
                           timeout=120)
            await conn.wait_connected(2, timeout=30)  # A's connection is the newest: the presses go to A

            refused = await press(allow, asked.message_id, operator_open_id="ou_mallory",
                                  operator_user_id="u_mallory", operator_union_id=None)
            assert refused["toast"]["content"] == NOT_YOURS
            assert card_buttons(fake.messages[asked.message_id].content) and not tool_ran(fake_openai, "call_W1")

            pressed = await press(allow, asked.message_id)
            assert pressed["toast"]["content"] == "Allowed"
            await answered_and_shown_once(fake, fake_openai, bridges, asked.message_id, "call_W1")
        finally:
            for bridge in bridges:
                await bridge.stop()
            await runner.cleanup()


async def test_the_buttons_of_a_process_that_died_are_closed_by_a_live_one(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_D1"]))
    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    async with FakeFeishu() as fake:
        fake.chat(FEISHU_CHAT)
        a, b, to_a, to_b = feishu_pair(tmp_path, fake_openai, fake, dsn, ports)
        bridges = [a, b]

        def request() -> Any:
            return approval_card(fake)

        try:
            await asyncio.gather(a.start(), b.start())
            for port in ports:
                await wait_for(lambda p=port: state_is(p, "feishu", "webhook"), bridges, what="serving",
                               timeout=120)
            msg = fake.user_message(FEISHU_CHAT, "what time is it?")
            sent = await to_b.send(to_b.message("@_user_1 what time is it?", chat_id=FEISHU_CHAT,
                                                message_id=msg.message_id,
                                                mentions=[Mention(fake.bot_name, fake.bot_open_id)]))
            assert sent.status == 200
            await wait_for(lambda: request() is not None, bridges, what="the approval card", timeout=60)
            asked = request()
            allow = card_buttons(asked.content)[0][1]

            async def recorded() -> bool:  # B has saved which message shows the request: then the kill
                rows = await fetch(dsn, "SELECT value FROM channel_state WHERE channel = 'feishu'"
                                        " AND name LIKE 'open\\_approvals:%'")
                return any(asked.message_id in str(r["value"]) for r in rows)
            await wait_for(recorded, bridges, what="the request's card recorded", timeout=30)
            await b.kill()
            killed_at = time.monotonic()

            def closed() -> bool:
                card = fake.messages[asked.message_id]
                return not card_buttons(card.content) and "the bridge restarted" in fake.text_of(card)
            await wait_for(closed, a, what="B's card closed by A", timeout=60)
            print(f"\nthe dead process's card closed {time.monotonic() - killed_at:.2f}s after its SIGKILL"
                  " (lease_seconds = 3)")
            late = await to_a.send(to_a.card_action(allow, message_id=asked.message_id, chat_id=FEISHU_CHAT))
            assert late.status == 200 and "no longer pending" in late.text
            await asyncio.sleep(1.0)
            assert card_patches(fake, asked.message_id) == 1  # closed once
            assert not tool_ran(fake_openai, "call_D1")
            assert await a.stop() == 0
            assert "Traceback" not in a.log(), a.log()
        finally:
            for bridge in bridges:
                await bridge.stop()


def slack_config(directory: Path, fake_openai: FakeOpenAI, slack: FakeSlack, dsn: str, port: int) -> Path:
    return asking(postgresql_config(directory, dsn=dsn, llm=fake_openai.base_url, port=port, extra=f"""
[channels.slack]
enabled = true
mode = "http"
bot_token = "{slack.bot_token}"
signing_secret = "{slack.signing_secret}"
api_base = "{slack.base_url}"
update_interval_ms = 100
"""))


async def test_a_slack_press_taken_by_another_process_is_shown_once_by_the_process_running_the_turn(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_S1"]), Text("It is late."))
    dsn = postgres.fresh_dsn()
    ports = [free_port(), free_port()]
    async with FakeSlack() as slack:
        a = BridgeProcess(slack_config(tmp_path / "a", fake_openai, slack, dsn, ports[0]), tmp_path / "a.log")
        b = BridgeProcess(slack_config(tmp_path / "b", fake_openai, slack, dsn, ports[1]), tmp_path / "b.log")
        bridges = [a, b]
        to_a, to_b = (EventSender(f"http://127.0.0.1:{p}/slack/events", slack.signing_secret, timeout=15)
                      for p in ports)

        def request() -> Any:
            return next((m for m in slack.messages("D0ALICE") if any(x.get("type") == "actions" for x in m.blocks)),
                        None)

        try:
            await asyncio.gather(a.start(), b.start())
            for port in ports:
                await wait_for(lambda p=port: state_is(p, "slack", "serving"), bridges, what="serving", timeout=120)
            assert (await to_b.event(slack.user_message("what time is it?"))).status == 200
            await wait_for(lambda: request() is not None, bridges, what="the approval request", timeout=60)
            asked = request()
            assert (await to_a.interaction(slack.press(asked, "Allow"))).status == 200
            await wait_for(lambda: "It is late." in slack.visible("D0ALICE"), bridges, what="the answer", timeout=60)
            assert tool_ran(fake_openai, "call_S1")
            await asyncio.sleep(1.0)  # a second update would show by now
            updates = [c for c in slack.calls_to("chat.update") if c.params.get("ts") == asked.ts]
            assert len(updates) == 1  # the outcome is shown once, by the process that posted the buttons
            shown = slack.message("D0ALICE", asked.ts)
            assert request() is None and "Allowed by alice" in shown.shown  # who pressed
            for bridge in bridges:
                assert await bridge.stop() == 0
                assert "Traceback" not in bridge.log(), bridge.log()
        finally:
            for bridge in bridges:
                await bridge.stop()
