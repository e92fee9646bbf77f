"""What the streaming benchmarks share: the reply the fake model streams, the fake model in a process of its
own, child processes that print their address and run until their stdin closes, and a process's own CPU
time and peak memory read from ``/proc``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHUNK = "word12 "  # seven characters a chunk
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def reply_text(chunks: int) -> str:
    return (CHUNK * chunks).strip()


def squash(text: str) -> str:
    """The words of a text without its spacing, which rendering and splitting may change."""
    return "".join(text.split())


def serve_llm(chunks: int, chunk_ms: float) -> None:
    """The fake OpenAI-compatible server streaming ``reply_text(chunks)``, one chunk every ``chunk_ms``; prints
    its URL and serves until stdin closes (keeping no record of the requests)."""
    from tests.fakes.openai_server import FakeOpenAI, Text

    class _Discard(list[Any]):
        def append(self, item: Any) -> None:
            pass

    async def main() -> None:
        fake = FakeOpenAI(default=Text(reply_text(chunks), chunk_size=len(CHUNK), delay=chunk_ms / 1000))
        await fake.start()
        fake.requests = _Discard()
        print(fake.base_url, flush=True)
        await until_stdin_closes()

    asyncio.run(main())


async def until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def start_child(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``python -m module args``; returns the process and the first line it prints (its address)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise SystemExit(f"{module} {' '.join(args)} did not start")
    return proc, line


def stop_child(proc: subprocess.Popen[str], timeout: float = 5.0) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.close()
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, BrokenPipeError):
        proc.kill()
        proc.wait(timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process ``pid`` (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM of /proc/<pid>/status), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0
