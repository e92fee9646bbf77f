"""Benchmark: streaming replies on Telegram, the product against a minimal pipeline on the same fakes.

The fake Bot API and the fake OpenAI-compatible server run in their own processes on 127.0.0.1; this
process runs, one after the other on the same fakes, each pipeline for ``--chats`` chats that each send
one message and get one streamed reply of ``--chunks`` chunks (one every ``--chunk-ms`` ms):

- product: ``chatbridge``'s chain (ChatCore with SQLite, the OpenAI provider, the Telegram channel polling
  through aiogram, the shared live sink editing once per ``edit_interval`` = 1 s per chat);
- minimal: receive (getUpdates) → stream (the same SDK call the provider makes) → edit the newest text at
  most once a second per chat (split at 4096 characters), and nothing else: no persistence, no snapshots.

For each it prints the process CPU per turn (from the messages being queued until the fake Bot API reports
every reply whole, which this process asks once, with a request the fake answers only then), the p50 and
p90 of a turn's latency (from the update being queued to the whole reply visible, measured by the fake Bot
API) and the product/minimal ratios; each runs with the garbage collector tuned as ``chatbridge run`` tunes
it once it is up (after its start-up).
``--runs`` repeats the pair (alternating which goes first) and prints the medians.

    python -m tests.bench.telegram_stream                       # 200 chats, 100 and 1000 chunks, 3 runs
    python -m tests.bench.telegram_stream --chats 50 --runs 1   # quicker

Prints figures; asserts nothing about speed. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench.streaming import reply_text, serve_llm, squash, start_child, until_stdin_closes  # noqa: E402

CHAT_BASE = 1_000_000  # 1000 chunks of seven characters are two Telegram messages


# ---- the fakes, each in its own process ----------------------------------------------------------------


def serve(kind: str, chunks: int, chunk_ms: float) -> None:
    if kind == "llm":
        serve_llm(chunks, chunk_ms)
        return
    from tests.fakes.telegram.server import FakeTelegram

    class BenchTelegram(FakeTelegram):
        """Records when each chat first shows the whole expected reply; driven through two extra methods."""

        expected = ""
        queued: ClassVar[dict[int, float]] = {}
        done: ClassVar[dict[int, float]] = {}

        def _check(self, chat_id: int) -> None:
            if chat_id in self.done:
                return
            shown = "".join(m.text for m in self.messages(chat_id))
            if squash(shown) == self.expected:
                self.done[chat_id] = time.monotonic()

        async def _m_sendMessage(self, p: dict[str, Any]) -> dict[str, Any]:
            result = await super()._m_sendMessage(p)
            self._check(int(p["chat_id"]))
            return result

        async def _m_editMessageText(self, p: dict[str, Any]) -> dict[str, Any]:
            result = await super()._m_editMessageText(p)
            self._check(int(p["chat_id"]))
            return result

        async def _m_benchQueue(self, p: dict[str, Any]) -> bool:
            self.expected = squash(str(p["expected"]))
            self.calls = []
            first, count = int(p["first_chat"]), int(p["chats"])
            for chat in range(first, first + count):
                self.user_message("go", chat_id=chat, user_id=chat)
                self.queued[chat] = time.monotonic()
            return True

        async def _m_benchReport(self, p: dict[str, Any]) -> dict[str, Any]:
            """Answers once every chat shows its whole reply (or after ``wait`` seconds): the pipeline measured
            makes one request for its figures, not one every fraction of a second while it works."""
            first, count = int(p["first_chat"]), int(p["chats"])
            chats = range(first, first + count)
            deadline = time.monotonic() + float(p.get("wait", 0))
            while sum(1 for c in chats if c in self.done) < count and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            latencies = [self.done[c] - self.queued[c] for c in chats if c in self.done]
            edits = [sum(1 for call in self.calls if call.chat_id == c and call.method == "editMessageText")
                     for c in chats]
            return {"done": len(latencies), "latencies": latencies, "calls": len(self.calls),
                    "max_edits": max(edits, default=0)}

    async def main() -> None:
        fake = BenchTelegram()
        await fake.start()
        print(fake.base_url, flush=True)
        await until_stdin_closes()

    asyncio.run(main())


def start_fake(kind: str, chunks: int, chunk_ms: float) -> tuple[subprocess.Popen[str], str]:
    proc, url = start_child("tests.bench.telegram_stream", "--serve", kind, "--chunks", str(chunks),
                            "--chunk-ms", str(chunk_ms))
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise SystemExit(f"fake {kind} server did not start")
    return proc, url


# ---- the two pipelines ---------------------------------------------------------------------------------


class Bench:
    def __init__(self, tg_url: str, llm_url: str, token: str) -> None:
        self.tg_url = tg_url
        self.llm_url = llm_url
        self.token = token
        self._http: Any = None

    async def control(self, method: str, **params: Any) -> Any:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        async with self._http.post(f"{self.tg_url}/bot{self.token}/{method}", json=params) as resp:
            return (await resp.json())["result"]

    async def measure(self, name: str, first_chat: int, chats: int, expected: str,
                      run: Any) -> dict[str, float]:
        """Run ``run(stop_event)`` while ``chats`` turns are answered; CPU and latency of those turns."""
        from bridge.gc_tuning import tune_gc

        stop = asyncio.Event()
        worker = await run(stop)  # started and ready to receive
        tune_gc()  # as ``chatbridge run`` tunes it once it is up: what start-up imported and made is frozen
        cpu0 = time.process_time()
        await self.control("benchQueue", first_chat=first_chat, chats=chats, expected=expected)
        report = await self.control("benchReport", first_chat=first_chat, chats=chats, wait=600)
        cpu = time.process_time() - cpu0
        stop.set()
        await worker()
        lat = sorted(report["latencies"])
        if len(lat) < chats:
            print(f"  warning: {name}: only {len(lat)} of {chats} replies completed")
        return {"cpu_ms": cpu * 1000 / chats, "p50": statistics.median(lat),
                "p90": lat[int(0.9 * (len(lat) - 1))], "max_edits": report["max_edits"]}

    async def product(self, stop: asyncio.Event) -> Any:
        from channels.telegram.channel import TelegramChannel, TelegramSettings
        from channels.telegram.factory import make_bot
        from core.llm.openai_provider import OpenAIProvider
        from core.runtime import ChatCore
        from core.settings import CoreSettings
        from core.sqlite_store import SqliteStore

        tmp = tempfile.TemporaryDirectory()
        provider = OpenAIProvider(model="bench", base_url=self.llm_url, api_key="bench", request_timeout=60)
        core = ChatCore(store=SqliteStore(Path(tmp.name) / "chat.db"), provider=provider,
                        settings=CoreSettings(titles=False))
        channel = TelegramChannel(core.host_for("telegram"), make_bot(self.token, self.tg_url),
                                  TelegramSettings(stream_transport="edit", poll_timeout=1))
        core.add_channel(channel)
        await core.start()
        await channel.start()
        await channel.ready.wait()

        async def close() -> None:
            await channel.stop()
            await core.shutdown()
            await channel.close()
            tmp.cleanup()

        return close

    async def minimal(self, stop: asyncio.Event) -> Any:
        import openai
        from aiogram.methods import EditMessageText, GetUpdates, SendMessage

        from channels.telegram.factory import make_bot

        bot = make_bot(self.token, self.tg_url)
        client = openai.AsyncOpenAI(base_url=self.llm_url, api_key="bench", max_retries=0,
                                    http_client=openai.DefaultAioHttpClient(timeout=60))
        tasks: set[asyncio.Task[None]] = set()

        async def answer(chat: int, text: str) -> None:
            chunks = await client.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": text}], stream=True)
            parts: list[str] = []
            shown: list[tuple[int, str]] = []
            last = 0.0

            async def show() -> None:
                whole = "".join(parts)
                pieces = [whole[i:i + 4096] for i in range(0, len(whole), 4096)]
                for i, piece in enumerate(pieces):
                    if i == len(shown):
                        msg = await bot(SendMessage(chat_id=chat, text=piece))
                        shown.append((msg.message_id, piece))
                    elif shown[i][1] != piece:
                        await bot(EditMessageText(chat_id=chat, message_id=shown[i][0], text=piece))
                        shown[i] = (shown[i][0], piece)

            async for chunk in chunks:
                for choice in chunk.choices:
                    content = choice.delta.content
                    if content:
                        parts.append(content)
                if parts and time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    await show()
            await asyncio.sleep(max(0.0, last + 1.0 - time.monotonic()))
            await show()

        async def poll() -> None:
            offset = None
            while not stop.is_set():
                updates = await bot(GetUpdates(offset=offset, timeout=1), request_timeout=11)
                for update in updates:
                    offset = update.update_id + 1
                    if update.message is not None and update.message.text:
                        task = asyncio.create_task(answer(update.message.chat.id, update.message.text))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)

        poller = asyncio.create_task(poll())

        async def close() -> None:
            await poller
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
            await bot.session.close()

        return close

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()


async def one_size(chunks: int, args: argparse.Namespace, run_no: int) -> dict[str, dict[str, float]]:
    from tests.fakes.telegram.server import FakeTelegram

    llm, llm_url = start_fake("llm", chunks, args.chunk_ms)
    tg, tg_url = start_fake("telegram", chunks, args.chunk_ms)
    bench = Bench(tg_url, llm_url, FakeTelegram.token)
    expected = squash(reply_text(chunks))
    results: dict[str, dict[str, float]] = {}
    try:
        order = ["product", "minimal"] if run_no % 2 == 0 else ["minimal", "product"]
        for i, name in enumerate(order):
            first = CHAT_BASE * (1 + run_no * 2 + i)
            run = bench.product if name == "product" else bench.minimal
            results[name] = await bench.measure(name, first, args.chats, expected, run)
    finally:
        await bench.aclose()
        for proc in (llm, tg):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", choices=["llm", "telegram"])
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--chunks", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--chunk-ms", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.chunks[0], args.chunk_ms)
        return
    print(f"{args.chats} Telegram chats at once, one reply each, a chunk every {args.chunk_ms:g} ms, "
          f"edit_interval 1 s; medians of {args.runs} run(s)")
    cpu_by_size: dict[int, float] = {}
    for chunks in args.chunks:
        runs = [asyncio.run(one_size(chunks, args, r)) for r in range(args.runs)]

        def med(name: str, key: str, runs: list[dict[str, dict[str, float]]] = runs) -> float:
            return statistics.median(r[name][key] for r in runs)

        cpu_ratio = statistics.median(r["product"]["cpu_ms"] / r["minimal"]["cpu_ms"] for r in runs)
        p50_ratio = statistics.median(r["product"]["p50"] / r["minimal"]["p50"] for r in runs)
        cpu_by_size[chunks] = med("product", "cpu_ms")
        print(f"{chunks} chunks per reply ({len(reply_text(chunks))} characters):")
        for name in ("product", "minimal"):
            print(f"  {name:8s} CPU {med(name, 'cpu_ms'):7.2f} ms/turn   p50 {med(name, 'p50'):6.2f} s   "
                  f"p90 {med(name, 'p90'):6.2f} s   most edits in one chat {med(name, 'max_edits'):.0f}")
        print(f"  product/minimal: CPU per turn {cpu_ratio:.2f}x (target <= 2.0x), p50 {p50_ratio:.2f}x")
        print("  runs: " + json.dumps([{k: round(v['cpu_ms'], 2) for k, v in r.items()} for r in runs]))
    sizes = sorted(cpu_by_size)
    if len(sizes) > 1:
        a, b = sizes[0], sizes[-1]
        print(f"product CPU per turn from {a} to {b} chunks: x{cpu_by_size[b] / cpu_by_size[a]:.2f} "
              f"for x{b / a:g} the reply (linear or better: <= x{b / a:g})")


if __name__ == "__main__":
    main()
