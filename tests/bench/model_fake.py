"""Benchmark: the end-to-end benchmark's model fake alone, so that its figures say whether the rig or the
pipeline measured is the limit.

The fake (``tests.bench.streaming.serve_llm``: ``tests.bench.ticking_model``, OpenAI-compatible, real HTTP and
SSE, one or several processes serving one port) streams ``--chunks`` chunks one every ``--chunk-ms`` ms to
``--streams`` clients at once; the clients (this process, plain aiohttp, no SDK) count the chunks. Printed for
each number of processes: the chunks a second delivered against the demand, a stream's duration (p50, p99)
against an unloaded one's, and the fake's own CPU per chunk (its processes' user + system time from
/proc), i.e. how many chunks a second each core can serve.

    python -m tests.bench.model_fake                                  # 100 and 1000 streams; 1, 2, 4 processes
    python -m tests.bench.model_fake --streams 100 --processes 1 2

Prints figures; asserts nothing. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench.streaming import cpu_seconds, start_child, stop_child  # noqa: E402


def process_tree(pid: int) -> list[int]:
    """``pid`` and its children (the model fake's other processes)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [pid, *(int(child) for child in f.read().split())]


async def streams_at_once(url: str, streams: int) -> tuple[float, list[float], int]:
    """``streams`` streaming requests at once; returns the wall time, each stream's duration and the chunks
    received."""
    import aiohttp

    body = {"model": "bench", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one() -> tuple[float, int]:
            began, chunks = time.monotonic(), 0
            async with http.post(f"{url}/chat/completions", json=body) as resp:
                async for line in resp.content:
                    chunks += line.startswith(b"data: {")
            return time.monotonic() - began, chunks

        started = time.monotonic()
        done = await asyncio.gather(*(one() for _ in range(streams)))
        return time.monotonic() - started, [d for d, _ in done], sum(c for _, c in done)


async def run(args: argparse.Namespace) -> None:
    ideal = args.chunks * args.chunk_ms / 1000
    print(f"model fake alone: {args.chunks} chunks a stream, one every {args.chunk_ms:g} ms "
          f"(a stream takes {ideal:.1f} s unloaded)", flush=True)
    for processes in args.processes:
        proc, url = start_child("tests.bench.streaming", "--serve-llm", "--chunks", str(args.chunks),
                                "--chunk-ms", str(args.chunk_ms), "--processes", str(processes))
        try:
            pids = process_tree(proc.pid)
            assert len(pids) == processes, pids
            await streams_at_once(url, 2)  # warm-up: every import and first connection done
            alone = (await streams_at_once(url, 1))[1][0]
            for streams in args.streams:
                cpu0, mine0 = sum(cpu_seconds(p) for p in pids), time.process_time()
                wall, durations, chunks = await streams_at_once(url, streams)
                cpu, mine = sum(cpu_seconds(p) for p in pids) - cpu0, time.process_time() - mine0
                durations.sort()
                demand = streams * args.chunks / ideal
                print(f"  {processes} process{'es' if processes > 1 else '  '}  {streams:5d} streams  "
                      f"{chunks / wall:8.0f} chunks/s (demand {demand:6.0f})  stream p50 "
                      f"{statistics.median(durations):6.2f} s  p99 {durations[int(0.99 * (len(durations) - 1))]:6.2f}"
                      f" s (alone {alone:.2f} s)  fake CPU {1e6 * cpu / chunks:5.0f} µs/chunk "
                      f"= {chunks / cpu if cpu else float('inf'):6.0f} chunks/s a core; clients' CPU "
                      f"{1e6 * mine / chunks:4.0f} µs/chunk", flush=True)
        finally:
            stop_child(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunks", type=int, default=300)
    parser.add_argument("--chunk-ms", type=float, default=10.0)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
