"""Benchmark: how fast the lead of a receiving connection (Telegram long polling) moves to a standby process
when the process holding it is killed, on a throwaway PostgreSQL cluster on 127.0.0.1.

Each round starts a holder process that takes the lead (``core.postgresql.leader``, default settings),
lets a standby in this process wait for it, SIGKILLs the holder, and measures the time from the kill to the
standby holding the lead. Since the holder's session ends with its process and the standby waits inside
``pg_advisory_lock``, that is the server noticing the closed connection plus one round trip.

    python -m tests.bench.leader_takeover            # 20 rounds, about half a minute
    python -m tests.bench.leader_takeover --rounds 5

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.postgresql.leader import PostgresqlLeadership  # noqa: E402
from tests.support.postgres import running_cluster  # noqa: E402

NAME = "telegram:polling:123456"
HOLDER = """
import asyncio, sys
from core.postgresql.leader import PostgresqlLeadership

async def main():
    lead = await PostgresqlLeadership(sys.argv[1]).acquire(sys.argv[2])
    print("leading", flush=True)
    await asyncio.sleep(3600)
    await lead.release()

asyncio.run(main())
"""


async def one_round(dsn: str) -> float:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, dsn, NAME, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None
        if (await asyncio.wait_for(holder.stdout.readline(), 60)).strip() != b"leading":
            raise RuntimeError("the holder process did not take the lead")
        waiting = asyncio.ensure_future(PostgresqlLeadership(dsn).acquire(NAME))
        await asyncio.sleep(0.3)  # the standby is waiting inside pg_advisory_lock by now
        if waiting.done():
            raise RuntimeError("the standby took a lead that was held")
        holder.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        lead = await asyncio.wait_for(waiting, 60)
        took = time.perf_counter() - killed
        await lead.release()
        return took
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()


async def run_rounds(dsn: str, rounds: int) -> list[float]:
    return [await one_round(dsn) for _ in range(rounds)]


def main(rounds: int) -> None:
    with running_cluster() as cluster:
        if isinstance(cluster, str):
            print(f"skipped: {cluster}")
            return
        times = asyncio.run(run_rounds(cluster.fresh_dsn(), rounds))
    ms = sorted(t * 1000 for t in times)
    print(f"lead taken over after the holder's SIGKILL, {rounds} rounds: p50 {statistics.median(ms):.1f} ms, "
          f"max {ms[-1]:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    main(parser.parse_args().rounds)
