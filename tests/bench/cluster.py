"""Benchmark: 1, 2 and 3 ``chatbridge run`` processes on one PostgreSQL database, and a takeover.

Real processes on a throwaway PostgreSQL cluster (``tests.support.postgres``) and the fake model (each answer
takes ``--model-ms``), fed over the web chat's HTTP API: ``--conversations`` conversations get
``--messages`` messages each, every message posted to a random process, all at once. Prints turns per second
(messages answered / wall time until the last answer is in the history) and the p50 and p95 of the time
from a message's post to the model request that answers it (its wait in the queue, the lease, the
context). Then SIGKILLs the process streaming a held answer and prints how long after the kill another
process sent the conversation's next model request (leases of 2 s).

    python -m tests.bench.cluster             # about two minutes
    python -m tests.bench.cluster --quick

Prints figures; asserts nothing about speed (the processes share this machine's cores with the database).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text  # noqa: E402
from tests.support.cluster import LEASE_SECONDS, Cluster, asked, new_session, post  # noqa: E402
from tests.support.postgres import running_cluster  # noqa: E402
from tests.support.process import wait_for  # noqa: E402


async def throughput(root: Path, dsn: str, processes: int, conversations: int, messages: int,
                     model_seconds: float) -> tuple[float, float, float]:
    asked_at: dict[str, float] = {}

    async def answer(body: dict[str, Any]) -> Reply:
        text = asked(body)
        asked_at.setdefault(text, time.monotonic())
        await asyncio.sleep(model_seconds)
        return Text(f"answer to {text}", chunk_size=64)

    async with FakeOpenAI(default=Function(answer)) as fake:
        cluster = Cluster(root, fake, dsn, processes)
        rng = random.Random(processes)
        try:
            await cluster.start()
            async with aiohttp.ClientSession() as http:
                sids = [await new_session(http, cluster.base(rng.randrange(processes))) for _ in range(conversations)]
                posted: dict[str, float] = {}

                async def send(sid: str, text: str) -> None:
                    posted[text] = time.monotonic()
                    await post(http, cluster.base(rng.randrange(processes)), sid, text)

                began = time.monotonic()
                await asyncio.gather(*(send(sid, f"c{n} m{m}") for m in range(messages)
                                       for n, sid in enumerate(sids)))
                await wait_for(lambda: len(asked_at) >= conversations * messages, cluster.bridges, timeout=600)
                for sid in sids:
                    await cluster.wait_answered(sid, messages, timeout=600)
                elapsed = time.monotonic() - began
        finally:
            await cluster.stop()
    waits = sorted(asked_at[t] - posted[t] for t in posted)
    return conversations * messages / elapsed, statistics.median(waits), waits[int(len(waits) * 0.95) - 1]


async def takeover(root: Path, dsn: str) -> float:
    never = asyncio.Event()

    async def answer(body: dict[str, Any]) -> Reply:
        if asked(body) == "c0 first":
            return Text("cut off in the middle", hold=never, hold_after=6)
        return Text(f"answer to {asked(body)}")

    async with FakeOpenAI(default=Function(answer)) as fake:
        cluster = Cluster(root, fake, dsn, 2)
        try:
            await cluster.start()
            async with aiohttp.ClientSession() as http:
                sid = await new_session(http, cluster.base(0))
                await post(http, cluster.base(0), sid, "c0 first")
                await wait_for(lambda: len(fake.requests) == 1, cluster.bridges)
                holder = cluster.sender(0)
                await post(http, cluster.base(1 - holder), sid, "c0 second")
            return await cluster.kill_until(holder, lambda: len(fake.requests) >= 2, timeout=120)
        finally:
            await cluster.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--messages", type=int, default=3)
    parser.add_argument("--model-ms", type=float, default=200.0)
    parser.add_argument("--quick", action="store_true", help="30 conversations of 2 messages")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.messages = 30, 2
    with running_cluster() as pg:
        if isinstance(pg, str):
            sys.exit(pg)
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{args.conversations} conversations x {args.messages} messages, model answer "
                  f"{args.model_ms:.0f} ms, lease {LEASE_SECONDS} s")
            for n in (1, 2, 3):
                rate, p50, p95 = await throughput(Path(tmp) / f"n{n}", pg.fresh_dsn(), n, args.conversations,
                                                  args.messages, args.model_ms / 1000)
                print(f"{n} process(es): {rate:6.1f} turns/s   post -> model request p50 {p50 * 1000:6.0f} ms"
                      f"   p95 {p95 * 1000:6.0f} ms")
            took = await takeover(Path(tmp) / "takeover", pg.fresh_dsn())
            print(f"SIGKILL of the holder: the next model request {took:.2f} s later (lease {LEASE_SECONDS} s)")


if __name__ == "__main__":
    asyncio.run(main())
