"""Benchmark: the web chat across two processes on one PostgreSQL database. Prints figures; asserts nothing.

Two web chats (ChatCore + web channel, each with its own PostgreSQL store and LISTEN/NOTIFY bus, as two
processes would have) in this process, on a throwaway cluster (``tests/support/postgres.py``). For each of
``--sessions`` conversations a browser-like SSE client follows it on both chats, and a message posted to
chat B streams a reply of ``--chars`` characters. For every event both clients got, the delay of the one
on chat A behind the one on chat B is the fan-out delay; also printed: the bus notes sent per turn.

Both chats, both sets of clients and the fake model share this one event loop, so the delays include
waiting for the loop; real processes would spread that over more cores.

    python -m tests.bench.web_fanout                 # 20 conversations at once, 2,000-character replies
    python -m tests.bench.web_fanout --sessions 50
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from channels.web.server import WebAccess  # noqa: E402
from tests.browser.server import SSEClient, WebChat, open_stream, start_web_chat  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI, Text  # noqa: E402
from tests.support.postgres import running_cluster  # noqa: E402


async def follow(client: SSEClient, until_committed: int, arrived: list[tuple[float, str]]) -> None:
    committed = 0
    while committed < until_committed:
        ev = await client.next(timeout=120)
        arrived.append((time.monotonic(), ev.name))
        committed += ev.name == "turn_committed"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(dsn: str, sessions: int, chars: int) -> None:
    from core.postgresql.bus import PostgresqlBus
    from core.postgresql.store import PostgresqlStore

    reply = Text(("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars], chunk_size=8,
                 delay=0.002)
    notes = 0

    def count(_: str) -> None:
        nonlocal notes
        notes += 1

    counter = PostgresqlBus(dsn)
    await counter.open()
    counter.subscribe("channel.web", count)
    async with FakeOpenAI(default=reply) as fake:
        with tempfile.TemporaryDirectory() as tmp:
            chats: list[WebChat] = []
            for name in ("a", "b"):
                (Path(tmp) / name).mkdir()
                chats.append(await start_web_chat(Path(tmp) / name, fake, store=PostgresqlStore(dsn, pool_size=5),
                                                  bus=PostgresqlBus(dsn), titles=False, access=WebAccess(
                                                      max_streams=10_000, max_streams_per_client=10_000)))
            a, b = chats
            try:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                    sids = []
                    for _ in range(sessions):
                        async with http.post(f"{b.base_url}/api/sessions") as resp:
                            sids.append((await resp.json())["id"])
                    clients = [(await open_stream(http, a.base_url, sid), await open_stream(http, b.base_url, sid))
                               for sid in sids]
                    for at_a, at_b in clients:
                        await at_a.next()
                        await at_b.next()
                    await asyncio.sleep(0.5)  # the opening sync requests are answered before the turns start
                    before = notes
                    arrivals = [([], []) for _ in sids]  # type: ignore[var-annotated]
                    started = time.monotonic()
                    readers = [asyncio.gather(follow(ca, 1, ra), follow(cb, 1, rb))
                               for (ca, cb), (ra, rb) in zip(clients, arrivals, strict=True)]
                    for sid in sids:
                        async with http.post(f"{b.base_url}/api/sessions/{sid}/messages",
                                             json={"text": "go"}) as resp:
                            assert resp.status == 202
                    await asyncio.gather(*readers)
                    elapsed = time.monotonic() - started
                    for ca, cb in clients:
                        ca.resp.close()
                        cb.resp.close()
            finally:
                for chat in chats:
                    await chat.close()
    await counter.close()
    delays, events, mismatched = [], 0, 0
    for ra, rb in arrivals:
        if [n for _, n in ra] != [n for _, n in rb]:
            mismatched += 1
        for (ta, _), (tb, _) in zip(ra, rb, strict=False):
            delays.append((ta - tb) * 1000)
        events += len(ra)
    print(f"{sessions} conversations at once, one turn each ({chars} characters, streamed on chat B), "
          f"{elapsed:.1f} s in all")
    print(f"  events seen by the browsers on chat A: {events} ({mismatched} conversations differed from chat B)")
    print(f"  fan-out delay behind chat B's browser: p50 {statistics.median(delays):.1f} ms, "
          f"p95 {pct(delays, 0.95):.1f} ms, max {max(delays):.1f} ms")
    print(f"  bus notes: {(notes - before) / sessions:.1f} per turn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--chars", type=int, default=2000)
    args = parser.parse_args()
    with running_cluster() as cluster:
        if isinstance(cluster, str):
            sys.exit(f"no PostgreSQL: {cluster}")
        asyncio.run(bench(cluster.fresh_dsn(), args.sessions, args.chars))


if __name__ == "__main__":
    main()
