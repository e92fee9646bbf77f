"""No accepted message is lost in a crash: a real ``chatbridge run`` is SIGKILLed with messages queued
behind a slow reply, and started again on the same data directory; a queued photo still reaches the model.

Telegram is the platform that never delivers a message twice once its update was confirmed (the bridge
stores the polling offset), so this is where a message accepted but only held in memory would vanish."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.fakes.openai_server import FakeOpenAI, Function, Text, ToolCalls, image_parts, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.support.media import jpeg
from tests.support.process import BridgeProcess, fetched_past, open_approvals, telegram_config, wait_for

CHAT = 555
INTERRUPTED = "⚠️ The bridge restarted while answering your last message. Please send it again."



def write_config(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> Path:
    return telegram_config(tmp_path, fake_openai.base_url, tg, shutdown_timeout=5)


async def test_sigkill_with_five_messages_queued_loses_none_and_answers_none_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    slow = asyncio.Event()
    fake_openai.script(Text("The first answer takes its time", hold=slow, hold_after=9))
    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    config = write_config(tmp_path, fake_openai, tg)
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        tg.user_message("m0")
        await wait_for(lambda: len(fake_openai.requests) == 1, bridge)  # m0's turn is running, and slow
        updates = [tg.user_message(f"m{i}") for i in range(1, 6)]
        # every update was confirmed to Telegram: it will never deliver them again
        await wait_for(lambda: fetched_past(tg, updates[-1]["update_id"]), bridge)
        await bridge.kill()
    finally:
        await bridge.stop()
    slow.set()

    again = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        answers = [f"echo: m{i}" for i in range(1, 6)]
        await wait_for(lambda: all(a in tg.visible(CHAT) for a in answers), again)
        await asyncio.sleep(1.0)  # anything sent twice would show by now
    finally:
        assert await again.stop() == 0
    shown = [m.text for m in tg.messages(CHAT) if not m.deleted]
    # m0: its reply was cut by the crash; the chat is told once. m1..m5: one answer each, in order.
    assert shown.count(INTERRUPTED) == 1
    assert [t for t in shown if t.startswith("echo: ")] == answers
    assert len(fake_openai.requests) == 6  # m0 once, then each queued message once


async def test_sigkill_with_a_photo_queued_keeps_it_for_the_model_after_the_restart(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    photo = jpeg(640, 480)
    tg.add_file("big", photo, path="photos/file_1.jpg")
    slow = asyncio.Event()
    fake_openai.script(Text("The first answer takes its time", hold=slow, hold_after=9))
    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    config = write_config(tmp_path, fake_openai, tg)
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        tg.user_message("m0")
        await wait_for(lambda: len(fake_openai.requests) == 1, bridge)
        update = tg.user_message(caption="what is in this photo?", photo=True)
        await wait_for(lambda: fetched_past(tg, update["update_id"]), bridge)  # Telegram will not send it again
        await bridge.kill()
    finally:
        await bridge.stop()
    slow.set()
    assert tg.downloads == []  # it waited behind m0: its turn, and its download, had not begun

    again = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        await wait_for(lambda: "echo: what is in this photo?" in tg.visible(CHAT), again)
    finally:
        assert await again.stop() == 0
    request = fake_openai.requests[-1]
    assert last_user_text(request).startswith("what is in this photo?")
    assert image_parts(request) == [("image/jpeg", photo)]  # downloaded after the restart, byte for byte
    assert tg.downloads == ["photos/file_1.jpg"]


RESTARTED = "⛔ Denied: the bridge restarted."


async def test_an_approval_left_waiting_by_a_crash_shows_the_restart_and_its_buttons_are_gone(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    fake_openai.script(ToolCalls([("current_time", "{}")], ids=["call_A"]))
    config = write_config(tmp_path, fake_openai, tg)
    asking = 'titles = false\ntool_approval = { current_time = "ask" }'
    config.write_text(config.read_text().replace("titles = false", asking))
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        tg.user_message("what time is it?")

        def request() -> Any:
            return next((m for m in tg.messages(CHAT) if m.buttons), None)

        await wait_for(lambda: request() is not None, bridge)
        await wait_for(lambda: "message_id" in open_approvals(tmp_path / "data"), bridge)  # recorded: then the crash
        await bridge.kill()
    finally:
        await bridge.stop()
    asked = request()
    assert asked is not None and "current_time" in asked.text
    allow = asked.buttons[0][1]

    again = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        shown = tg.chats[CHAT][asked.message_id]
        await wait_for(lambda: not shown.buttons and RESTARTED in shown.text, again)
        late = tg.press(CHAT, asked.message_id, "", data=allow)  # from a client that had not refreshed yet
        await wait_for(lambda: bool(tg.answers(late)), again)
        assert "no longer pending" in (tg.answers(late)[0].get("text") or "")
    finally:
        assert await again.stop() == 0
    assert len(fake_openai.requests) == 1  # the tool never ran: nothing asked the model again
    assert [m.text for m in tg.messages(CHAT) if not m.deleted].count(INTERRUPTED) == 1


async def test_an_answer_committed_but_never_shown_in_full_is_sent_once_after_the_restart(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    answer = "The capital of France is **Paris**, a city on the Seine."
    shown = "The capital of France is Paris, a city on the Seine."
    hold = asyncio.Event()
    fake_openai.script(Text(answer, hold=hold, hold_after=20))
    config = write_config(tmp_path, fake_openai, tg)
    config.write_text(config.read_text() + 'stream_transport = "edit"\n')  # a preview message, then edits
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        tg.fail("editMessageText", hang=60, when=lambda p: bool(p.get("entities")))  # the final edit never lands
        tg.user_message("capital of France?")
        await wait_for(lambda: tg.messages(CHAT), bridge)  # a preview of the first words
        hold.set()
        # the final edit is under way: the answer was committed before it
        await wait_for(lambda: any(c.method == "editMessageText" and c.params.get("entities") for c in tg.calls),
                       bridge)
        await bridge.kill()
    finally:
        await bridge.stop()
    assert shown not in tg.visible(CHAT)  # the chat shows only the preview's first words

    again = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        await wait_for(lambda: shown in tg.visible(CHAT), again)
        await asyncio.sleep(1.0)  # anything sent twice would show by now
    finally:
        assert await again.stop() == 0
    assert tg.visible(CHAT).count(shown) == 1
    assert INTERRUPTED not in tg.visible(CHAT)  # it was answered, not interrupted
    assert len(fake_openai.requests) == 1


async def test_sigkill_while_a_subagent_runs_ends_parent_and_child_with_one_notice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    from tests.support.db import rows

    held = asyncio.Event()

    def route(body: dict[str, Any]) -> Any:
        if last_user_text(body).startswith("TASK"):
            return Text("The child works slowly", hold=held, hold_after=9)
        return ToolCalls([("run_subagent", '{"task": "TASK slow work"}')], ids=["call_S"])

    fake_openai.default = Function(route)
    config = write_config(tmp_path, fake_openai, tg)
    config.write_text(config.read_text() + "\n[agent.subagents]\nenabled = true\n")
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        tg.user_message("delegate it")
        await wait_for(lambda: len(fake_openai.requests) == 2, bridge)  # the child's request is streaming
        await bridge.kill()
    finally:
        await bridge.stop()
    held.set()

    again = await BridgeProcess(config, tmp_path / "bridge.log").start()
    try:
        await wait_for(lambda: INTERRUPTED in tg.visible(CHAT), again)
        await asyncio.sleep(1.0)  # a second notice would show by now
    finally:
        assert await again.stop() == 0
    shown = [m.text for m in tg.messages(CHAT) if not m.deleted]
    assert shown.count(INTERRUPTED) == 1
    db = tmp_path / "data" / "chatbridge.db"
    turns = rows(db, "SELECT session_key, state FROM turns ORDER BY started_at")
    assert [state for _, state in turns] == ["interrupted", "interrupted"]
    parent, child = (key for key, _ in turns)
    assert child.startswith(f"{parent}-sub-")
    for key in (parent, child):  # both conversations end with the notice, none is left running
        last = rows(db, "SELECT content FROM messages WHERE session_key = ? ORDER BY seq DESC LIMIT 1", (key,))
        assert last == [(INTERRUPTED,)]
    assert len(fake_openai.requests) == 2
