"""Benchmark: what a very large MCP tool result costs the bridge (memory and time).

The test server (tests/mcp_servers/echo_server.py, its ``big`` tool) answers one call with a text of the
given size, over stdio and over streamable HTTP. Each call runs in a fresh process, so the resident size
before and after (and the peak) belong to that call alone.

    python -m tests.bench.mcp_large_result                 # 10 MB and 50 MB, stdio and HTTP
    python -m tests.bench.mcp_large_result --sizes 1000000

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ECHO = ROOT / "tests" / "mcp_servers" / "echo_server.py"


def rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 2**20


async def one_call(transport: str, size: int, port: int | None) -> None:
    from core.agent.loop import normalize_output
    from core.tools.base import ToolContext
    from core.tools.mcp import McpManager, McpServerConfig

    if port is not None:
        config = McpServerConfig(name="e", url=f"http://127.0.0.1:{port}/mcp", call_timeout=120)
    else:
        config = McpServerConfig(name="e", command=sys.executable, args=(str(ECHO),), call_timeout=120)
    manager = McpManager()
    try:
        failures = await manager.start([config])
        assert not failures, failures
        big = next(t for t in manager.tools() if t.spec.name == "e__big")
        before = rss_mb()
        started = time.monotonic()
        try:
            text = normalize_output(await big.run({"size": size}, ToolContext("bench", "bench", "bench")))
            outcome = f"{len(text):,} characters to the model"
        except Exception as exc:
            outcome = f"failed: {str(exc)[:90]}"
        took = time.monotonic() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"{transport:5} {size:>12,} chars  {took:6.2f} s  RSS {before} -> {rss_mb()} MB "
              f"(peak {peak} MB)  {outcome}", flush=True)
    finally:
        await manager.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 50_000_000])
    parser.add_argument("--one", nargs=2, metavar=("TRANSPORT", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        transport, size = args.one[0], int(args.one[1])
        server = None
        if transport == "http":
            server = subprocess.Popen([sys.executable, str(ECHO), "--http"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            assert server.stdout is not None
        try:
            port = int(server.stdout.readline().split()[1]) if server is not None and server.stdout else None
            asyncio.run(one_call(transport, size, port))
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)
        return
    for transport in ("stdio", "http"):
        for size in args.sizes:
            subprocess.run([sys.executable, "-m", "tests.bench.mcp_large_result", "--one", transport, str(size)],
                           cwd=ROOT, check=False, timeout=600)


if __name__ == "__main__":
    main()
