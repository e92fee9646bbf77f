"""Benchmark: live streaming on Telegram through the real chain, aiogram and the fake Bot API.

1. One reply streamed for 60 (scaled) seconds: how many edits it costs, and how long after the model's
   last token the final text is visible.
2. 100 chats streaming at once: the most edits any chat got, against its budget of one per
   ``edit_interval`` (plus the first message), and the smallest gap between two calls to one chat.

    python -m tests.bench.telegram_stream               # real time: about 75 s
    python -m tests.bench.telegram_stream --scale 10    # 10x faster clock: intervals and durations / 10

With ``--scale S`` every interval and duration is divided by S (edit_interval 1 s → 1/S s) and the
measured times are printed both as measured and multiplied back by S. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fakes.openai_server import FakeOpenAI, Text  # noqa: E402
from tests.fakes.telegram import FakeTelegram  # noqa: E402
from tests.fakes.telegram.harness import telegram_harness  # noqa: E402

CORE = {"sink_update_timeout": 15.0, "delivery_wait_timeout": 120.0, "request_timeout": 30.0,
        "shutdown_timeout": 10.0}


async def long_reply(scale: float, seconds: float) -> None:
    interval = 1.0 / scale
    duration = seconds / scale
    chunks = 600
    text = " ".join(f"word{i}" for i in range(chunks * 2))
    chunk = math.ceil(len(text) / chunks)
    hold = asyncio.Event()
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeOpenAI() as llm, FakeTelegram() as tg:
            llm.script(Text(text, chunk_size=chunk, delay=duration / chunks, hold=hold, hold_after=len(text) - 1))
            t = await telegram_harness(Path(tmp), llm, tg, core=CORE, edit_interval=interval,
                                       first_delay=interval, stream_transport="edit")
            try:
                started = time.monotonic()
                tg.user_message("stream for a minute")
                # the fake holds the model's last character; release it once everything before it streamed,
                # so "the model ended" is a known instant
                await t.wait_for(lambda: any(len(getattr(e, "controller", None).text) == len(text) - 1
                                             for e in t.h.events if hasattr(e, "controller")),
                                 timeout=duration * 3 + 30)
                hold.set()
                llm_end = time.monotonic()
                streamed = llm_end - started
                await t.wait_for(lambda: " ".join(tg.visible(555)) == text, timeout=30)
                visible = time.monotonic()
                await t.settle(30)
                edits = tg.count("editMessageText")
                sends = tg.count("sendMessage")
                print(f"scale {scale:g}: a {seconds:g} s reply ({len(text)} chars in {chunks} chunks; it streamed "
                      f"for {streamed * scale:.1f} s scaled), edit_interval {interval * 1000:.0f} ms")
                print(f"  edits: {edits} (target <= {int(seconds) + 1}), messages: {sends}, "
                      f"calls per scaled second: {(edits + sends) / (streamed * scale):.2f}")
                lag = visible - llm_end
                print(f"  final text visible {lag * 1000:.0f} ms after the model ended "
                      f"(x{scale:g} = {lag * scale:.2f} s at real-time scale; target <= 1.5 s)")
            finally:
                await t.close()


async def many_chats(scale: float, chats: int, seconds: float) -> None:
    interval = 1.0 / scale
    duration = seconds / scale
    chunks = 200
    text = " ".join(f"token{i}" for i in range(chunks * 2))
    chunk = math.ceil(len(text) / chunks)
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeOpenAI() as llm, FakeTelegram() as tg:
            llm.script(*[Text(text, chunk_size=chunk, delay=duration / chunks) for _ in range(chats)])
            t = await telegram_harness(Path(tmp), llm, tg, core=CORE, edit_interval=interval,
                                       first_delay=interval, stream_transport="edit")
            try:
                started = time.monotonic()
                for i in range(chats):
                    tg.user_message("go", chat_id=10_000 + i, user_id=20_000 + i)
                await t.wait_for(lambda: sum(len(tg.visible(10_000 + i)) for i in range(chats)) == chats
                                 and all(tg.visible(10_000 + i) == [text] for i in range(chats)), timeout=120)
                elapsed = time.monotonic() - started
                await t.settle(60)
                worst_edits, worst_budget, min_gap = 0, 0, math.inf
                over = 0
                for i in range(chats):
                    calls = tg.calls_to(10_000 + i, "sendMessage", "editMessageText")
                    edits = sum(1 for c in calls if c.method == "editMessageText")
                    span = calls[-1].at - calls[0].at
                    budget = math.floor(span / interval + 1e-6) + 1
                    over += edits + 1 > budget + 1
                    worst_edits = max(worst_edits, edits)
                    worst_budget = max(worst_budget, budget)
                    gaps = [b.at - a.at for a, b in itertools.pairwise(calls)]
                    min_gap = min([min_gap, *gaps])
                print(f"scale {scale:g}: {chats} chats streaming {seconds:g} s replies at once, "
                      f"edit_interval {interval * 1000:.0f} ms; all answers complete after {elapsed:.2f} s")
                print(f"  most edits in one chat: {worst_edits} (its budget: <= {worst_budget} over its span); "
                      f"chats over budget: {over}")
                print(f"  smallest gap between two calls to one chat: {min_gap * 1000:.0f} ms "
                      f"(interval {interval * 1000:.0f} ms); total calls: {len(tg.calls)}")
            finally:
                await t.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--chats", type=int, default=100)
    parser.add_argument("--chat-seconds", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(long_reply(args.scale, args.seconds))
    asyncio.run(many_chats(args.scale, args.chats, args.chat_seconds))


if __name__ == "__main__":
    main()
