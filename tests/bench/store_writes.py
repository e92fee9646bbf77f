"""Benchmark: what the SQLite store's writes of one turn cost, alone.

A turn writes three times: the inbound message at admission, the user message with the turn record when
the turn starts (serving the inbound message), and the commit (answer, revision, turn end, trace). This
runs those three writes for many turns, one conversation at a time and 100 at once, and prints the CPU time
per turn (event loop and database threads together), with the writer merging writes that queue behind a
running statement (group commit) and with every write sent on its own.

    python -m tests.bench.store_writes            # about half a minute
    python -m tests.bench.store_writes --quick

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.messages import MessageSource, NewMessage  # noqa: E402
from core.sqlite import writer  # noqa: E402
from core.sqlite_store import SqliteStore  # noqa: E402

ENVELOPE = ('{"channel":"bench","chat_id":"c1","sender_id":"u1","content":"a question of about one line",'
            '"received_at":1700000000.5}')
TRACE = [("request_begin", {"model": "bench", "messages": 12}), ("text", {"text": "A short answer."}),
         ("request_end", {"status": "completed", "usage": [120, 12]})]


async def turns(store: SqliteStore, conversations: int, per_conversation: int) -> None:
    async def conversation(key: str) -> None:
        for _ in range(per_conversation):
            turn_id = uuid.uuid4().hex
            inbound = await store.admit_inbound("bench", None, ENVELOPE, ttl_seconds=3600)
            _, session = await store.append_message(key, NewMessage(
                role="user", content="a question of about one line",
                source=MessageSource(kind="user_input", from_channel="bench", turn_id=turn_id)),
                begin_turn=(turn_id, '{"channel":"bench","chat_id":"c1"}'), serves=inbound)
            await store.commit_turn(key, [NewMessage(role="assistant", content="A short answer.",
                                                     source=MessageSource(kind="assistant", turn_id=turn_id))],
                                    expect_generation=session.generation,
                                    expect_state_version=session.state_version, end_turn=(turn_id, "completed"),
                                    trace=(turn_id, TRACE))

    await asyncio.gather(*(conversation(f"bench:{i}") for i in range(conversations)))


async def cpu_per_turn(conversations: int, total: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        store = SqliteStore(Path(d) / "bench.db")
        await store.open()
        try:
            await turns(store, conversations, 3)  # warm-up: statement cache, pages
            per = max(1, total // conversations)
            cpu = time.process_time()
            await turns(store, conversations, per)
            return (time.process_time() - cpu) * 1e6 / (per * conversations)
        finally:
            await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    total, runs = (1000, 1) if args.quick else (3000, 3)
    merged = writer.MAX_MERGED
    print("store writes of one turn (admission, turn start, commit), CPU per turn, median of "
          f"{runs} run(s), interleaved")
    for conversations in (1, 100):
        figures: dict[str, list[float]] = {"merged": [], "alone": []}
        for _ in range(runs):
            for mode in ("merged", "alone"):
                writer.MAX_MERGED = merged if mode == "merged" else 1
                figures[mode].append(asyncio.run(cpu_per_turn(conversations, total)))
        writer.MAX_MERGED = merged
        m, a = statistics.median(figures["merged"]), statistics.median(figures["alone"])
        print(f"  {conversations:>3} conversation(s) at once: {m:6.0f} µs with group commit, {a:6.0f} µs with "
              f"every write on its own ({a / m:.2f}x)")


if __name__ == "__main__":
    main()
