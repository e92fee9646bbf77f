"""What the streaming benchmarks share: the reply the fake model streams, the fake model in a process of its
own, child processes that print their address and run until their stdin closes, and a process's own CPU
time and peak memory read from ``/proc``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNK = "word12 "  # seven characters a chunk
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def reply_text(chunks: int) -> str:
    return (CHUNK * chunks).strip()


def squash(text: str) -> str:
    """The words of a text without its spacing, which rendering and splitting may change."""
    return "".join(text.split())


def serve_llm(chunks: int, chunk_ms: float, processes: int = 1, port: int = 0, times: str | None = None) -> None:
    """The benchmarks' model (``tests.bench.ticking_model``: OpenAI-compatible, real HTTP and SSE) streaming
    ``reply_text(chunks)``, one chunk every ``chunk_ms``; prints its URL and serves until stdin closes.

    ``times``: a file to which each streamed request appends a line ``<received> <ended>``, the moments
    (``time.monotonic()``, the same clock in every process) its handler started and its stream's last byte
    was written.

    With ``processes`` > 1 that many processes serve the one port (SO_REUSEPORT: the kernel spreads the
    connections among them), so the model's side is not what limits a benchmark: one process streams about
    80,000 chunks a second on this machine (``tests.bench.model_fake``). ``port``: join the processes already
    serving it (how the others are started)."""
    from tests.bench.ticking_model import TickingModel

    log = open(times, "a", buffering=1) if times else None  # open while serving

    async def main() -> None:
        fake = TickingModel(reply_text(chunks), len(CHUNK), chunk_ms / 1000, log)
        await fake.start(port, reuse_port=processes > 1 or port != 0)
        timed = ("--times", times) if times else ()
        others = [start_child("tests.bench.streaming", "--serve-llm", "--chunks", str(chunks), "--chunk-ms",
                              str(chunk_ms), "--port", str(fake.port), *timed)[0] for _ in range(processes - 1)]
        print(fake.base_url, flush=True)
        try:
            await until_stdin_closes()
        finally:
            for proc in others:
                stop_child(proc)
            await fake.stop()
            if log is not None:
                log.close()

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


if __name__ == "__main__":  # the model fake on its own (see serve_llm)
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--serve-llm", action="store_true", required=True)
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--chunk-ms", type=float, required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--times")
    args = parser.parse_args()
    serve_llm(args.chunks, args.chunk_ms, args.processes, args.port, args.times)
