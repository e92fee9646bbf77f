"""Benchmark: the web chat's event streams under abuse. Prints figures; asserts nothing.

1. Memory: the web chat's process RSS before and after many SSE connections were opened and closed again
   (half to one conversation, half to ids never seen before), by a client in another process.
2. Open files: the web chat in a process limited to 256 open files, while another process holds 300
   streams open: how many were refused (503), whether the chat still answers, and how many bytes of log
   that cost. Then the same with the caps lifted (max_streams 10,000), so the process does run out of
   file descriptors: what asyncio's accept loop logs then.

    python -m tests.bench.web_streams            # 50,000 connections and a 15 s flood: about two minutes
    python -m tests.bench.web_streams --quick    # 5,000 connections and a 5 s flood
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.browser.server import start_web_chat  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.bench.web_streams", *args], cwd=ROOT)


# ---- client processes ---------------------------------------------------------------------------------


async def open_and_close(base: str, count: int, concurrency: int = 50) -> None:
    connector = aiohttp.TCPConnector(force_close=True, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def one(i: int) -> None:
            sid = "shared" if i % 2 else f"never-seen-{i}"
            async with http.get(f"{base}/api/sessions/{sid}/stream") as resp:
                await resp.content.readany()

        for start in range(0, count, concurrency):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + concurrency))))


async def hold_open(base: str, count: int, seconds: float) -> None:
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        held = []
        for i in range(count):
            try:
                resp = await asyncio.wait_for(http.get(f"{base}/api/sessions/s{i}/stream", headers={
                    "X-Forwarded-For": f"10.0.{i // 250}.{i % 250}"}), 1)
            except (aiohttp.ClientError, TimeoutError):
                statuses[0] = statuses.get(0, 0) + 1
                continue
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status == 200:
                held.append(resp)
            else:
                resp.release()
        answered = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                async with http.get(f"{base}/api/sessions", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    answered += resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
        for resp in held:
            resp.close()
    print(f"    {count} streams asked for: " + ", ".join(f"{n} x {'no answer' if s == 0 else s}"
                                                      for s, n in sorted(statuses.items())))
    print(f"    the conversation list answered {answered} of {int(seconds / 0.5)} times while they were open")


# ---- the web chat ---------------------------------------------------------------------------------------


async def memory(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeOpenAI() as fake:
            chat = await start_web_chat(Path(tmp), fake)
            try:
                gc.collect()
                before = rss_mb()
                started = time.monotonic()
                proc = child("--open-and-close", chat.base_url, str(count))
                while proc.poll() is None:
                    await asyncio.sleep(0.2)
                took = time.monotonic() - started
                await asyncio.sleep(2)  # the reaper ends what it has not seen end yet
                gc.collect()
                after = rss_mb()
                server = chat.channel.server
                print(f"1. {count} SSE connections opened and closed in {took:.1f} s "
                      f"({count / took:.0f}/s, client in another process)")
                print(f"    RSS {before:.0f} MB before, {after:.0f} MB after")
                print(f"    left behind: {len(server.connections)} connections, {len(chat.hub)} session streams, "
                      f"{server.slots.open} stream slots, {len(server.slots.by_client)} clients")
            finally:
                await chat.close()


async def flood(seconds: float, capped: bool) -> None:
    import resource

    from bridge.logs import configure_logging
    from channels.web.factory import stream_cap_for_open_files
    from channels.web.server import WebAccess

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    configure_logging("info", [])
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeOpenAI() as fake:
            if capped:
                access = WebAccess(max_streams=stream_cap_for_open_files(200), trusted_proxies=("127.0.0.1",))
            else:
                access = WebAccess(max_streams=10_000, max_streams_per_client=10_000)
            chat = await start_web_chat(Path(tmp), fake, access=access)
            try:
                label = "2." if capped else "2b. without the caps:"
                print(f"{label} web chat limited to 256 open files (stream cap {access.max_streams}); "
                      f"300 streams held open for {seconds:.0f} s by another process", file=sys.stdout)
                sys.stdout.flush()
                proc = child("--hold-open", chat.base_url, "300", str(seconds))
                while proc.poll() is None:
                    await asyncio.sleep(0.2)
            finally:
                await chat.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--open-and-close", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--hold-open", nargs=3, metavar=("URL", "N", "SECONDS"), help=argparse.SUPPRESS)
    parser.add_argument("--flood", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--uncapped", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.open_and_close:
        asyncio.run(open_and_close(args.open_and_close[0], int(args.open_and_close[1])))
        return
    if args.hold_open:
        asyncio.run(hold_open(args.hold_open[0], int(args.hold_open[1]), float(args.hold_open[2])))
        return
    if args.flood is not None:
        with open(os.environ["BENCH_LOG"], "w") as log_file:  # the bridge logs to stderr
            os.dup2(log_file.fileno(), 2)
        asyncio.run(flood(args.flood, capped=not args.uncapped))
        return
    asyncio.run(memory(5_000 if args.quick else 50_000))
    seconds = 5.0 if args.quick else 15.0
    for extra in ([], ["--uncapped"]):
        with tempfile.TemporaryDirectory() as tmp:
            log_path = Path(tmp) / "bridge.log"
            subprocess.run([sys.executable, "-m", "tests.bench.web_streams", "--flood", str(seconds), *extra],
                           cwd=ROOT, env={**os.environ, "BENCH_LOG": str(log_path)}, check=False)
            text = log_path.read_text(errors="replace")
            accept_errors = text.count("socket.accept() out of system resource")
            print(f"    log: {len(text.encode())} bytes, {accept_errors} 'socket.accept() out of system resource' "
                  "entries")


if __name__ == "__main__":
    main()
