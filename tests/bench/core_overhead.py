"""Benchmark: what the reply chain itself costs, beyond the model.

The fake OpenAI-compatible server runs in a separate process on 127.0.0.1 and answers at once, so the
figures are the chain's own work: ingress, SQLite persistence, the OpenAI SDK request, snapshots, the sink
and the commit. The chain process is pinned to one core where the OS allows it, and its garbage collector
is tuned as ``chatbridge run`` tunes it (bridge/gc_tuning.py); one extra line shows CPython's defaults.

    python -m tests.bench.core_overhead            # full run (about five minutes)
    python -m tests.bench.core_overhead --quick    # smaller counts

Prints figures and ratios against the targets; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bridge.gc_tuning import tune_gc  # noqa: E402
from core.llm.openai_provider import OpenAIProvider  # noqa: E402
from core.llm.provider import LLMMessage, LLMRequest  # noqa: E402
from core.runtime import ChatCore  # noqa: E402
from core.settings import CoreSettings  # noqa: E402
from core.sqlite_store import SqliteStore  # noqa: E402
from tests.support.channel import TestChannel  # noqa: E402

REPLY = "A short answer from the model, about one sentence long."
SERVER = f"""
import asyncio, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.fakes.openai_server import FakeOpenAI, Text
async def main():
    fake = FakeOpenAI(default=Text({REPLY!r}, chunk_size=16))
    await fake.start()
    fake.requests = _Discard()
    print(fake.base_url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
class _Discard(list):
    def append(self, item): pass
asyncio.run(main())
"""


def start_fake_llm() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    base_url = proc.stdout.readline().strip()
    if not base_url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise SystemExit("fake LLM server did not start")
    return proc, base_url


def settings(**kw: float) -> CoreSettings:
    return CoreSettings(titles=False, retry_delays=(0.05,), **kw)  # type: ignore[arg-type]


async def make_core(db: Path, base_url: str, **kw: float) -> tuple[ChatCore, TestChannel]:
    provider = OpenAIProvider(model="bench", base_url=base_url, api_key="bench", request_timeout=30)
    core = ChatCore(store=SqliteStore(db), provider=provider, settings=settings(**kw))
    channel = TestChannel()
    core.add_channel(channel)
    await core.start()
    return core, channel


async def run_turns(core: ChatCore, channel: TestChannel, sessions: int, turns_per_session: int,
                    prefix: str = "s") -> float:
    """Each session sends its next message as soon as the previous turn committed; returns seconds."""
    waiters: dict[str, asyncio.Event] = {}

    def on_event(event: object) -> None:
        if type(event).__name__ == "TurnCommitted":
            key = event.session_key  # type: ignore[attr-defined]
            if key in waiters:
                waiters[key].set()

    async def converse(chat: str) -> None:
        key = f"{channel.name}:{chat}"
        for k in range(turns_per_session):
            waiters[key] = asyncio.Event()
            await core.submit(channel.envelope(f"question {k}", chat_id=chat))
            await waiters[key].wait()

    unsubscribe = core.events.subscribe(on_event)
    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(converse(f"{prefix}{i}") for i in range(sessions))), 600)
    while not core.sessions.idle():
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - start
    unsubscribe()
    return elapsed


async def throughput(base_url: str, tmp: Path, sessions: int, turns: int) -> dict[str, float]:
    core, channel = await make_core(tmp / f"tp{sessions}.db", base_url)
    try:
        await run_turns(core, channel, min(sessions, 10), 1)  # warm-up
        per_session = max(1, turns // sessions)
        cpu0 = time.process_time()
        elapsed = await run_turns(core, channel, sessions, per_session)
        cpu = time.process_time() - cpu0
        n = sessions * per_session
        return {"sessions": sessions, "turns": n, "turns_per_s": n / elapsed, "cpu_ms_per_turn": cpu * 1000 / n}
    finally:
        await core.shutdown()


async def sdk_alone(base_url: str, concurrency: int, requests: int) -> dict[str, float]:
    """The official OpenAI SDK on its own against the same fake: the floor under every turn."""
    provider = OpenAIProvider(model="bench", base_url=base_url, api_key="bench", request_timeout=30)
    request = LLMRequest(messages=(LLMMessage("system", "s"), LLMMessage("user", "question")))

    async def worker(n: int) -> None:
        for _ in range(n):
            async for _event in provider.stream(request):
                pass

    await asyncio.gather(*(worker(1) for _ in range(concurrency)))  # warm the connection pool
    per = max(1, requests // concurrency)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    n = per * concurrency
    cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - t0
    await provider.aclose()
    return {"requests_per_s": n / elapsed, "cpu_ms_per_request": cpu * 1000 / n}


async def added_latency(base_url: str, tmp: Path, samples: int) -> dict[str, float]:
    provider = OpenAIProvider(model="bench", base_url=base_url, api_key="bench", request_timeout=30)
    request = LLMRequest(messages=(LLMMessage("system", "s"), LLMMessage("user", "question")))
    direct: list[float] = []
    for _ in range(samples + 5):
        t0 = time.perf_counter()
        async for _event in provider.stream(request):
            pass
        direct.append(time.perf_counter() - t0)
    await provider.aclose()
    direct = direct[5:]

    core, channel = await make_core(tmp / "latency.db", base_url)
    e2e: list[float] = []
    try:
        for i in range(samples + 5):
            committed = asyncio.Event()
            unsub = core.events.subscribe(
                lambda e, ev=committed: ev.set() if type(e).__name__ == "TurnCommitted" else None)
            t0 = time.perf_counter()
            # a new conversation each time, so the model request matches the "model alone" one in size
            await core.submit(channel.envelope("question", chat_id=f"lat{i}"))
            await committed.wait()
            while not core.sessions.idle():  # the terminal snapshot is on the platform
                await asyncio.sleep(0)
            e2e.append(time.perf_counter() - t0)
            unsub()
    finally:
        await core.shutdown()
    e2e = e2e[5:]
    p50_direct, p50_e2e = statistics.median(direct), statistics.median(e2e)
    return {"model_p50_ms": p50_direct * 1000, "turn_p50_ms": p50_e2e * 1000,
            "added_p50_ms": (p50_e2e - p50_direct) * 1000}


async def idle_memory(base_url: str, tmp: Path, sessions: int) -> dict[str, float]:
    db = tmp / "idle.db"
    core, channel = await make_core(db, base_url, session_idle_seconds=0.2)
    try:
        # Warm-up at full size, with other sessions: imports, caches, connections, and the capacity the event
        # loop's task sets and the HTTP connection pool grow to at this concurrency, which are not per session.
        await run_turns(core, channel, sessions, 1, prefix="warm")
        deadline = time.monotonic() + 10
        while core.sessions.active_count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        channel.platform.messages.clear()
        channel.platform.log.clear()
        channel.sinks.clear()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        await run_turns(core, channel, sessions, 1)
        peak_active = core.sessions.active_count
        deadline = time.monotonic() + 10
        while core.sessions.active_count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        channel.platform.messages.clear()
        channel.platform.log.clear()
        channel.sinks.clear()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    finally:
        await core.shutdown()
    db_bytes = sum(p.stat().st_size for p in tmp.glob("idle.db*"))
    return {"sessions": sessions, "workers_alive_after_idle": core.sessions.active_count,
            "peak_workers": peak_active, "bytes_per_idle_session": max(0, after - before) / sessions,
            "db_bytes_per_session": db_bytes / (2 * sessions)}


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["turns_per_s"])[len(runs) // 2]


def default_gc() -> None:
    """CPython's own collector settings (undoing ``tune_gc``)."""
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    proc, base_url = start_fake_llm()  # started first, so it does not inherit the pinning below
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
        os.sched_setaffinity(proc.pid, set(cores[1:]))
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            turns = 600 if args.quick else 3000
            print("chain throughput (fake LLM answering at once, separate process; chain on one core;")
            print("  1 session = one long conversation, its context capped at history_limit messages)")
            # 100 sessions is the target case: three runs with the garbage collector tuned as `chatbridge run`
            # tunes it, interleaved with three on CPython's defaults; each figure is the median run.
            tuned_runs: list[dict[str, float]] = []
            default_runs: list[dict[str, float]] = []
            for i in range(3):
                default_gc()
                default_runs.append(asyncio.run(throughput(base_url, tmp / f"default{i}", 100, turns)))
                tune_gc()
                tuned_runs.append(asyncio.run(throughput(base_url, tmp / f"tuned{i}", 100, turns)))
            results = {100: median_run(tuned_runs)}
            for sessions in (1, 1000):
                results[sessions] = asyncio.run(throughput(base_url, tmp, sessions, max(turns, sessions)))
            for sessions in (1, 100, 1000):
                r = results[sessions]
                print(f"  {sessions:>5} sessions: {r['turns']:>5.0f} turns  {r['turns_per_s']:8.1f} turns/s  "
                      f"{r['cpu_ms_per_turn']:6.2f} CPU ms/turn" + ("  (median of 3 runs)" if sessions == 100 else ""))
            at100 = results[100]["turns_per_s"]
            untuned = median_run(default_runs)
            print(f"  100 sessions with CPython's default garbage-collector settings: {untuned['turns_per_s']:8.1f} "
                  f"turns/s  {untuned['cpu_ms_per_turn']:6.2f} CPU ms/turn  (median of 3 runs)")
            sdk = asyncio.run(sdk_alone(base_url, 100, turns))
            print(f"  for reference, the OpenAI SDK alone at 100 concurrent requests: {sdk['requests_per_s']:8.1f} "
                  f"requests/s  {sdk['cpu_ms_per_request']:6.2f} CPU ms/request")
            lat = asyncio.run(added_latency(base_url, tmp, 100 if args.quick else 400))
            print("latency, sequential turns, each the first of its conversation")
            print(f"  model alone p50 {lat['model_p50_ms']:.2f} ms, whole turn p50 {lat['turn_p50_ms']:.2f} ms, "
                  f"added by the chain p50 {lat['added_p50_ms']:.2f} ms")
            mem = asyncio.run(idle_memory(base_url, tmp, 300 if args.quick else 1000))
            print("idle sessions")
            print(f"  {mem['sessions']} sessions, peak workers {mem['peak_workers']}, workers left after idle "
                  f"{mem['workers_alive_after_idle']}, {mem['bytes_per_idle_session']:.0f} B memory per idle "
                  f"session, {mem['db_bytes_per_session']:.0f} B of SQLite per session")
            print("against the targets")
            print(f"  turns/s at 100 sessions: {at100:.0f} / 500 = {at100 / 500:.2f}x "
                  f"(the SDK alone: {sdk['requests_per_s']:.0f} / 500 = {sdk['requests_per_s'] / 500:.2f}x)")
            print(f"  added p50: {lat['added_p50_ms']:.2f} ms / 5 ms = {lat['added_p50_ms'] / 5:.2f} of budget")
            print(f"  idle session: {mem['bytes_per_idle_session']:.0f} B / 8192 B = "
                  f"{mem['bytes_per_idle_session'] / 8192:.3f} of budget")
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
