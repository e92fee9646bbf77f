"""Kill a real ``chatbridge run`` at random points, again and again, on one data directory: every accepted
message ends with exactly one answer or one notice, none twice, none lost; the database stays sound.

One process serves Telegram, Slack, Feishu and the web chat at once, so every kill hits all four. The kill
points are the ones a crash can hit in a turn's life: while the reply streams (the model holds the head's
stream until the kill, so it is cut off for certain), while a tool call waits for approval, and with messages
queued behind the head. Every run hits each of the three in its first three rounds (in a seeded order), the
long variant's fourth round a seeded one again. How many messages wait behind the head on each platform, which
Slack and Feishu events are still unacknowledged when the kill comes and which ones the platform delivers
again after the restart comes from a seeded random generator (the seed is in the test id, so a failure can be
replayed). Each seed runs the other receiving mode of Slack (Socket Mode / HTTP events) and Feishu (long
connection / webhook); the default run has the first, three rounds (``pytest --long`` adds the second, four
rounds).

Telegram never delivers a confirmed update twice: a message the bridge accepted and then forgot would simply
be missing. Slack and Feishu deliver an unacknowledged event again (Slack's ``retry_attempt`` /
``X-Slack-Retry-Num``, Feishu's redelivered frame or request), and may deliver an acknowledged one again too: the test
does both after every restart, and the bridge must answer each message once. A web client whose post got no
answer (the kill came first) sends it again with the same ``client_id``, and now and then one that was
answered: a message stored before the kill is answered ``duplicate``, never twice. How each platform shows
which message a bot message answers is in ``tests.support.platforms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.fakes.openai_server import FakeOpenAI, Function, Text, ToolCalls, last_user_text
from tests.fakes.slack import FakeSlack
from tests.fakes.telegram import FakeTelegram
from tests.support.platforms import (
    Bridge,
    Delivery,
    FeishuPlatform,
    Platform,
    SlackPlatform,
    TelegramPlatform,
    WebPlatform,
    feishu_fakes,
)
from tests.support.ports import free_port
from tests.support.process import BridgeProcess, wait_for

GROUP = -100777
KILL_POINTS = ("stream", "approval", "queued")
STARTUP = 180.0
"""Seconds a (re)started process may take to receive on every platform: generous, as a loaded machine starts
slowly, not wrongly (importing lark-oapi alone takes seconds)."""



def write_config(tmp_path: Path, fake_openai: FakeOpenAI, channels: str, port: int) -> Path:
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
port = {port}
{channels}""")
    return config


class Model:
    """``slow <id>``: a reply that streams a few words, then holds until ``hold`` is set (the test sets it
    after the kill, so the reply is cut off mid-stream for certain); ``ask <id>``: a tool call that needs
    approval, then an answer; ``quick <id>``: a quick answer. Every answer ends with ``END <id>`` in bold, so
    a finished (formatted) answer is told apart from a preview a crash cut off."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()

    def __call__(self, body: dict[str, Any]) -> Any:
        said = last_user_text(body).split("\n\n")[0]
        found = re.search(r"\b(ask|slow|quick) (\S+)", said)
        assert found is not None, said
        kind, ident = found.groups()
        if body["messages"][-1].get("role") == "tool":
            return Text(f"The time was told. **END** {ident}")
        if kind == "ask":
            return ToolCalls([("current_time", "{}")])
        if kind == "slow":
            return Text("A slow answer " + "word " * 40 + f"**END** {ident}", chunk_size=6, delay=0.02,
                        hold=self.hold, hold_after=60)
        return Text(f"Quick answer **END** {ident}")


async def crash_round(r: int, point: str, rng: random.Random, bridge: Bridge, model: Model,
                      process: BridgeProcess, data_dir: Path) -> tuple[BridgeProcess, list[tuple[Platform, str]]]:
    """On every platform a head message and some behind it; kill the bridge at ``point`` (with some Slack and
    Feishu events still unacknowledged), start it again, and let the platforms deliver again. Returns the new
    process and the approval requests the kill left open."""
    model.hold = asyncio.Event()
    heads: dict[Platform, str] = {}
    this_round: dict[Platform, list[Delivery]] = {}
    for p in bridge.platforms:
        head = f"{p.name[:2]}{r}-head"
        heads[p] = head
        first = len(p.deliveries)
        await p.say(head, f"{'ask' if point == 'approval' else 'slow'} {head}")
        for i in range(rng.randint(0 if point != "queued" else 1, 3)):
            await p.say(f"{p.name[:2]}{r}-q{i}", f"quick {p.name[:2]}{r}-q{i}", head=head)
        this_round[p] = p.deliveries[first:]

    asked: list[tuple[Platform, str]] = []
    for p, head in heads.items():
        if point == "approval":  # the head's tool call waits for a press, its request recorded
            async def waiting(p: Platform = p, head: str = head) -> bool:
                await p.refresh()
                request = p.approval(head)
                return request is not None and p.approval_recorded(data_dir, request)

            await wait_for(waiting, process, timeout=60)
            request = p.approval(head)
            assert request is not None
            asked.append((p, request))
        else:  # the head's reply is being shown, unfinished (and held: it stays so until the kill)
            async def previewing(p: Platform = p, head: str = head) -> bool:
                await p.refresh()
                return p.previewing(head)

            await wait_for(previewing, process, timeout=60)
    await wait_for(bridge.confirmed, process)  # every delivery so far acknowledged to its platform
    strays: list[tuple[Platform, Delivery]] = []
    for p, head in heads.items():  # sent as the kill comes: acknowledged or not, nobody knows
        if not isinstance(p, TelegramPlatform) and rng.random() < 0.5:
            ident = f"{p.name[:2]}{r}-stray"
            strays.append((p, await p.say(ident, f"quick {ident}", head=head, wait=False)))
    await process.kill()
    await process.stop()
    model.hold.set()
    bridge.restarted()
    process = await BridgeProcess(process.config, process.log_path).start()
    await wait_for(bridge.up, process, timeout=STARTUP)

    for p, d in strays:
        this_round[p].append(d)
        if d.task is not None:
            with contextlib.suppress(Exception):
                await d.task
    for p, deliveries in this_round.items():
        for d in deliveries:
            # unacknowledged: the platform delivers it again; acknowledged: now and then it does anyway
            if not p.acked(d) or rng.random() < 0.4:
                again = await p.redeliver(d)
                assert p.acked(again), f"{p.name}: a redelivered event of {d.ident} was not acknowledged"
    return process, asked


async def settled(bridge: Bridge) -> bool:
    await bridge.refresh()
    return bridge.settled()


async def wait_settled(bridge: Bridge, process: BridgeProcess, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not await settled(bridge):
        if time.monotonic() > deadline:
            raise AssertionError(f"unsettled: {bridge.endings()}\n{bridge.describe()}\n{process.log()[-4000:]}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(("seed", "slack_mode", "feishu_mode", "rounds"),
                         [(7, "socket", "websocket", 3),
                          pytest.param(2024, "http", "webhook", 4, marks=pytest.mark.long)])
async def test_repeated_sigkills_lose_nothing_and_answer_nothing_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, fake_slack: FakeSlack, seed: int,
        slack_mode: Literal["socket", "http"], feishu_mode: Literal["websocket", "webhook"], rounds: int) -> None:
    rng = random.Random(seed)
    # every kill point once, then seeded ones
    points = rng.sample(KILL_POINTS, len(KILL_POINTS)) + [rng.choice(KILL_POINTS) for _ in range(rounds - 3)]
    model = Model()
    fake_openai.default = Function(model)
    port = free_port()
    data_dir = tmp_path / "data"
    async with feishu_fakes(feishu_mode) as (feishu, conn, origin):
        bridge = Bridge([TelegramPlatform(tg, [GROUP]), SlackPlatform(fake_slack, slack_mode, port),
                         FeishuPlatform(feishu, feishu_mode, port, conn=conn, origin=origin), WebPlatform(port)],
                        port)
        config = write_config(tmp_path, fake_openai, bridge.config(), port)
        process = await BridgeProcess(config, tmp_path / "bridge.log").start()
        closed: list[tuple[Platform, str]] = []
        try:
            await wait_for(bridge.up, process, timeout=STARTUP)
            for r, point in enumerate(points):
                await wait_settled(bridge, process)  # so a kill cuts off only this round's head
                process, asked = await crash_round(r, point, rng, bridge, model, process, data_dir)
                closed += asked
                for p, request in asked:  # the approvals left waiting say the restart denied them
                    async def denied(p: Platform = p, request: str = request) -> bool:
                        await p.refresh()
                        return p.approval_closed_by_restart(request)

                    await wait_for(denied, process, what=f"{p.name}: approval closed\n{p.describe()}")
            await wait_settled(bridge, process)
            await bridge.refresh(now=True)  # what the web chat shows, read last while it can be
        finally:
            code = await process.stop()  # an orderly stop: after it, nothing more can be shown
        assert code == 0
        endings = bridge.endings()
        twice = {p: {i: k for i, k in e.items() if len(k) != 1} for p, e in endings.items()}
        assert twice == {p: {} for p in endings}, f"{twice}\n{bridge.describe()}"
        for p, e in endings.items():  # a message that waited behind the crash is answered, not given up
            assert {i: k for i, k in e.items() if "-head" not in i and k != ["answer"]} == {}, p
        assert [p.live_buttons() for p in bridge.platforms] == [0] * 4  # no approval button left looking live
        assert all(p.approval_closed_by_restart(request) for p, request in closed)
        assert sum(len(p.idents) for p in bridge.platforms) >= 3 * rounds
    with contextlib.closing(sqlite3.connect(data_dir / "chatbridge.db")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        # history intact: every message once, and nothing accepted is left waiting
        said = [row[0] for row in db.execute("SELECT content FROM messages WHERE role = 'user'")]
        assert db.execute("SELECT count(*) FROM inbound WHERE envelope IS NOT NULL").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM turns WHERE state = 'running'").fetchone() == (0,)
    for p in bridge.platforms:
        for ident in p.idents:
            assert sum(1 for text in said if re.search(rf"\b{re.escape(ident)}\b", text)) == 1, (p.name, ident)


async def test_sigterm_during_a_burst_ends_within_the_shutdown_timeout_and_loses_nothing(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    model = Model()
    model.hold.set()  # the slow replies stream to their end
    fake_openai.default = Function(model)
    telegram = TelegramPlatform(tg, [GROUP])
    config = write_config(tmp_path, fake_openai, telegram.config(), free_port())
    config.write_text(config.read_text().replace("shutdown_timeout = 5", "shutdown_timeout = 2"))
    log = tmp_path / "bridge.log"
    bridge = await BridgeProcess(config, log).start()
    try:
        for i in range(6):  # one conversation: a reply being written and five waiting behind it
            await telegram.say(f"burst-{i}", f"slow burst-{i}")
        await wait_for(lambda: any("word" in m.text for m in tg.messages(GROUP)), bridge, timeout=STARTUP)
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
            await wait_for(telegram.settled, again, timeout=60)
        except AssertionError:
            raise AssertionError(f"unsettled: {telegram.endings()}\n{telegram.describe()}") from None
    finally:
        assert await again.stop() == 0  # an orderly stop: after it, nothing more can be shown
    endings = telegram.endings()
    assert {ident: kinds for ident, kinds in endings.items() if len(kinds) != 1} == {}
    # the messages that only waited are answered after the restart, not given up
    assert sum(kinds == ["answer"] for kinds in endings.values()) >= 5
