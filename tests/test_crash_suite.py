"""Kill a real ``chatbridge run`` at random points, again and again, on one data directory: every accepted
message ends with exactly one answer or one notice, none twice, none lost; the database stays sound.

The kill points are the ones a crash can hit in a turn's life: while the reply streams, while a tool call
waits for approval, and with messages queued behind a slow reply. Which one each round hits, and how many
messages wait behind it, comes from a seeded random generator (the seed is in the test id, so a failure can
be replayed). Telegram is the platform here because it never delivers a confirmed update twice: a message
the bridge accepted and then forgot would simply be missing. A group chat is used so that every message of
the bot says which user message it answers (Telegram's reply), which is how the test accounts for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.openai_server import FakeOpenAI, Function, Text, ToolCalls, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.support.process import BridgeProcess, fetched_past, open_approvals, wait_for

GROUP = -100777
INTERRUPTED = "⚠️ The bridge restarted while answering your last message. Please send it again."
TOO_OLD = "too old to answer"
STOPPED = "⏹ Stopped."  # how a reply cut short by a shutdown ends, in its own message
ROUNDS = 4


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as fake:
        yield fake


def write_config(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> Path:
    config = tmp_path / "chatbridge.toml"
    config.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
shutdown_timeout = 5

[llm]
provider = "openai"
model = "fake-model"
base_url = "{fake_openai.base_url}"
api_key = "sk-test"
request_timeout = 30

[agent]
titles = false
tool_approval = {{ current_time = "ask" }}

[web]
enabled = false

[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
edit_interval_ms = 100
group_policy = "all"
""")
    return config


def model(body: dict[str, Any]) -> Any:
    """``slow <id>``: a reply streamed over about a second; ``ask <id>``: a tool call that needs approval,
    then an answer; anything else: a quick answer. Every answer ends with ``END <id>`` in bold, so a
    finished (formatted) answer is told apart from a preview a crash cut off."""
    said = last_user_text(body).split("\n\n")[0]
    kind, _, ident = said.partition(" ")
    if body["messages"][-1].get("role") == "tool":
        return Text(f"The time was told. **END** {ident}")
    if kind == "ask":
        return ToolCalls([("current_time", "{}")])
    if kind == "slow":
        return Text("A slow answer " + "word " * 40 + f"**END** {ident}", chunk_size=6, delay=0.03)
    return Text(f"Quick answer **END** {ident}")


class Ledger:
    """The user messages sent (user message id → our id) and what the chat shows in answer to each."""

    def __init__(self, tg: FakeTelegram) -> None:
        self.tg = tg
        self.sent: dict[int, str] = {}

    def say(self, text: str) -> dict[str, Any]:
        update = self.tg.user_message(text, chat_id=GROUP, chat_type="group")
        self.sent[update["message"]["message_id"]] = text.partition(" ")[2]
        return update

    def endings(self) -> dict[str, list[str]]:
        """Our id → the terminal things the chat shows in answer to it: "answer" or "notice"."""
        found: dict[str, list[str]] = {ident: [] for ident in self.sent.values()}
        for m in self.tg.messages(GROUP):
            if m.deleted or m.reply_to not in self.sent:
                continue
            ident = self.sent[m.reply_to]
            if re.search(rf"(?<!\*)END {re.escape(ident)}$", m.text) and "**" not in m.text:
                found[ident].append("answer")
            elif m.text == INTERRUPTED or TOO_OLD in m.text or m.text.endswith(STOPPED):
                found[ident].append("notice")
        return found

    def settled(self) -> bool:
        return all(len(v) >= 1 for v in self.endings().values())


async def crash_round(r: int, rng: random.Random, ledger: Ledger, bridge: BridgeProcess,
                      tmp_path: Path) -> BridgeProcess:
    """Send a head message and some behind it, kill the bridge at this round's point, start it again."""
    tg = ledger.tg
    point = rng.choice(["stream", "approval", "queued"])
    head = ledger.say(f"{'ask' if point == 'approval' else 'slow'} r{r}-head")
    head_id = head["message"]["message_id"]
    behind = [ledger.say(f"quick r{r}-q{i}") for i in range(rng.randint(0 if point != "queued" else 1, 3))]
    last = (behind or [head])[-1]["update_id"]

    def asked() -> int | None:
        return next((m.message_id for m in tg.messages(GROUP) if m.buttons and m.reply_to == head_id), None)

    if point == "stream":  # the head's reply is being shown, unfinished
        await wait_for(lambda: any(m.reply_to == head_id and "word" in m.text and "END" not in m.text
                                   for m in tg.messages(GROUP)), bridge)
    elif point == "approval":  # the head's tool call waits for a press, its request recorded
        await wait_for(lambda: asked() is not None and f'"message_id": {asked()}' in open_approvals(tmp_path / "data"),
                       bridge)
    await wait_for(lambda: fetched_past(tg, last), bridge)  # every message confirmed to Telegram
    await bridge.kill()
    await bridge.stop()
    return await BridgeProcess(bridge.config, bridge.log_path).start()


@pytest.mark.parametrize("seed", [7, 2024])
async def test_repeated_sigkills_lose_nothing_and_answer_nothing_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, seed: int) -> None:
    rng = random.Random(seed)
    fake_openai.default = Function(model)
    config = write_config(tmp_path, fake_openai, tg)
    log = tmp_path / "bridge.log"
    ledger = Ledger(tg)
    bridge = await BridgeProcess(config, log).start()
    try:
        for r in range(ROUNDS):
            bridge = await crash_round(r, rng, ledger, bridge, tmp_path)
        try:
            await wait_for(ledger.settled, bridge, timeout=60)
        except AssertionError:
            raise AssertionError(f"unsettled: {ledger.endings()}\n" + "\n".join(
                f"{m.message_id} reply_to={m.reply_to} deleted={m.deleted}: {m.text[:70]!r}"
                for m in tg.messages(GROUP))) from None
        await asyncio.sleep(1.0)  # anything shown twice would show by now
    finally:
        code = await bridge.stop()
    assert code == 0
    endings = ledger.endings()
    assert {ident: kinds for ident, kinds in endings.items() if len(kinds) != 1} == {}
    # a message that waited behind the crash is answered, not given up: only the heads were cut off
    assert all(kinds == ["answer"] for ident, kinds in endings.items() if "-q" in ident)
    assert not any(m.buttons for m in tg.messages(GROUP))  # no approval button left looking live
    with contextlib.closing(sqlite3.connect(tmp_path / "data" / "chatbridge.db")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


async def test_sigterm_during_a_burst_ends_within_the_shutdown_timeout_and_loses_nothing(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    fake_openai.default = Function(model)
    config = write_config(tmp_path, fake_openai, tg)
    config.write_text(config.read_text().replace("shutdown_timeout = 5", "shutdown_timeout = 2"))
    log = tmp_path / "bridge.log"
    ledger = Ledger(tg)
    bridge = await BridgeProcess(config, log).start()
    try:
        for i in range(6):  # one conversation: a reply being written and five waiting behind it
            ledger.say(f"slow burst-{i}")
        await wait_for(lambda: any("word" in m.text for m in tg.messages(GROUP)), bridge)
        stopping = time.monotonic()
        code = await bridge.stop(timeout=30)
        took = time.monotonic() - stopping
    finally:
        await bridge.stop()
    assert code == 0
    # the shutdown is bounded by shutdown_timeout (2 s), plus the process's own start-up of its exit
    assert took < 2 + 5, f"shutdown took {took:.1f}s"
    again = await BridgeProcess(config, log).start()
    try:
        try:
            await wait_for(ledger.settled, again, timeout=60)
        except AssertionError:
            raise AssertionError(f"unsettled: {ledger.endings()}\n" + "\n".join(
                f"{m.message_id} reply_to={m.reply_to}: {m.text[:90]!r}" for m in tg.messages(GROUP))) from None
        await asyncio.sleep(1.0)
    finally:
        assert await again.stop() == 0
    endings = ledger.endings()
    assert {ident: kinds for ident, kinds in endings.items() if len(kinds) != 1} == {}
    # the messages that only waited are answered after the restart, not given up
    assert sum(kinds == ["answer"] for kinds in endings.values()) >= 5
