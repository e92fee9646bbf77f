"""SIGTERM while a stopped turn's final edit is on its way: Telegram carries the edit out ("… ⏹ Stopped: the bridge is
shutting down. …") but
answers only after the shutdown's bound has cut the delivery. The chat shows that message once: the next
start does not send the turn's terminal text again as a new message (DESIGN §2 rule 6: shutdown never
produces two terminal messages), and the turn's log line says it was cancelled and what its cut delivery
left, not "abandoned".

Before the fix, the cut left the turn undelivered and the next start's redelivery sent that text again.

A real ``chatbridge run`` against the fake Bot API; the edit's answer is held until the test releases it (after
the process exited), so nothing depends on how long the shutdown takes."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from tests.fakes.openai_server import FakeOpenAI, Text
from tests.fakes.telegram import FakeTelegram
from tests.support.process import BridgeProcess, telegram_config, wait_for

CHAT = 555
STOPPED = "⏹ Stopped: the bridge is shutting down."


def write_config(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> Path:
    return telegram_config(tmp_path, fake_openai.base_url, tg, shutdown_timeout=4)


def shown(tg: FakeTelegram) -> list[str]:
    return [m.text for m in tg.messages(CHAT)]


async def test_a_final_edit_cut_by_the_shutdown_is_not_sent_again_at_the_next_start(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    tg.drafts_supported = False  # a live message edited in place
    hold = asyncio.Event()
    fake_openai.script(Text("A slow answer " + "word " * 30 + "END", chunk_size=6, delay=0.02,
                            hold=hold, hold_after=60),
                       Text("pong"))
    config = write_config(tmp_path, fake_openai, tg)
    log = tmp_path / "bridge.log"
    answer = asyncio.Event()
    bridge = await BridgeProcess(config, log).start()
    try:
        tg.user_message("hello")
        await wait_for(lambda: any("word" in t for t in shown(tg)), bridge)  # the live message streams
        # the stopped final edit lands at once, but its answer comes only when the test releases it
        tg.fail("editMessageText", apply_first=True, until=answer, times=100,
                when=lambda p: STOPPED in str(p.get("text")))
        assert await bridge.stop(timeout=60) == 0
    finally:
        await bridge.stop()
        answer.set()
        hold.set()
    [before] = shown(tg)
    assert STOPPED in before  # the edit was carried out
    ended = re.findall(r"turn \w+ in \S+: (.*) after [\d.]+s", log.read_text())

    tg.faults.clear()
    again = await BridgeProcess(config, log).start()
    try:  # the next start's redelivery comes before it receives: once "pong" shows, any second copy would too
        tg.user_message("ping")
        await wait_for(lambda: "pong" in shown(tg), again, what="the answer after the restart")
    finally:
        code = await again.stop()
    assert code == 0
    texts = shown(tg)
    assert sum(STOPPED in t for t in texts) == 1, f"the stopped turn shows twice: {texts}"
    assert texts == [before, "pong"], texts
    # the turn's log line: how it ended and what the cut left (before: "abandoned")
    assert ended and ended[0].startswith("cancelled (the shutdown cut its final edit"), ended
