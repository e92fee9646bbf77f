"""Benchmark: what core adds to each streamed token, with no I/O.

A turn's reply streams through the OpenAI provider (its chunk mapping), the silence bound, the agent loop's
assembler, the merge queue and the turn controller before any channel sees it. This runs that path as a
turn runs it — ``AgentLoop.run`` with the real ``OpenAIProvider``, whose HTTP client is replaced by a source
of the SDK's typed chunks (built once, before the clock starts: building them is the SDK's work, measured by
``tests.bench.core_overhead``) that suspends once a chunk, as a socket read does — against the same source read by
the e2e benchmark's floor (``tests/bench/e2e.py``: look up the content, keep it) and by a bare loop. Each
pipeline runs ``--turns`` turns of ``--chunks`` chunks, ``--at-once`` of them streaming at the same time (a
thousand, as the e2e benchmark at 1,000 chats), the three alternating; the best of ``--repeats`` rounds is
printed (the least disturbed by the rest of the machine), per chunk and per turn. The garbage collector runs
with the settings ``chatbridge run`` gives it once it is up (``bridge.gc_tuning``), as the path does there.

    .venv/bin/python -m tests.bench.token_path                                       # 1,000 turns at once
    .venv/bin/python -m tests.bench.token_path --at-once 1 --turns 100 --repeats 10  # one turn at a time

Prints figures; asserts nothing about speed. No network at all.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletionChunk

from bridge.gc_tuning import tune_gc
from core.agent.approvals import ApprovalBroker
from core.agent.loop import AgentLoop
from core.controller import TurnController
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMMessage
from core.settings import CoreSettings
from core.supervisor import TaskSupervisor
from core.tools.base import ToolRegistry


def wire_chunks(count: int) -> list[dict[str, Any]]:
    """A reply as the model fake streams it: ``count`` content chunks, then the finish and the usage."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "bench"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"content": f"word{i % 100:02d} "},
                                    "finish_reason": None}]} for i in range(count)]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({**head, "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": count}})
    return chunks


class Source:
    """The SDK's stream as the provider sees it: an async iterator of typed chunks with ``close``; each chunk
    waits for one turn of the event loop first, as a chunk read from a socket does."""

    def __init__(self, chunks: list[ChatCompletionChunk]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self._read()

    async def _read(self) -> AsyncIterator[ChatCompletionChunk]:
        loop = asyncio.get_running_loop()
        for chunk in self._chunks:
            arrived = loop.create_future()
            loop.call_soon(arrived.set_result, None)
            await arrived
            yield chunk

    async def close(self) -> None:
        return None


class Completions:
    """``chat.completions`` of the stand-in client: ``create`` returns a ``Source``."""

    def __init__(self, chunks: list[ChatCompletionChunk]) -> None:
        self._chunks = chunks

    async def create(self, **params: Any) -> Source:
        return Source(self._chunks)


class SourceClient:
    """Stands in for the provider's ``openai.AsyncOpenAI``: its one call, ``chat.completions.create``."""

    def __init__(self, chunks: list[ChatCompletionChunk]) -> None:
        self.chat = SimpleNamespace(completions=Completions(chunks))

    async def close(self) -> None:
        return None


async def bare(chunks: list[ChatCompletionChunk]) -> None:
    async for _ in Source(chunks):
        pass


async def floor(chunks: list[ChatCompletionChunk]) -> None:
    parts: list[str] = []
    async for chunk in Source(chunks):
        for choice in chunk.choices:
            content = choice.delta.content
            if content:
                parts.append(content)
    assert parts


def product_turn(provider: OpenAIProvider, supervisor: TaskSupervisor, expected: str
                 ) -> Callable[[list[ChatCompletionChunk]], Coroutine[Any, Any, None]]:
    settings = CoreSettings(titles=False)
    tools = ToolRegistry()
    broker = ApprovalBroker()
    base = (LLMMessage("system", settings.system_prompt), LLMMessage("user", "Hello"))

    async def turn(chunks: list[ChatCompletionChunk]) -> None:
        controller = TurnController("turn", "bench:1")
        loop = AgentLoop(provider=provider, tools=tools, broker=broker, settings=settings,
                         session_key="bench:1", turn_id="turn", requested_by="user", emit=controller.apply,
                         spawn=supervisor.spawn)
        await loop.run(base)
        if controller.text != expected:
            raise AssertionError(f"the turn shows {controller.text[:60]!r}..., not the whole reply")

    return turn


def reply_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def measure(args: argparse.Namespace) -> dict[str, float]:
    """Best CPU seconds a turn of each pipeline (printed too)."""
    wire = wire_chunks(args.chunks)
    chunks = [ChatCompletionChunk.construct(**c) for c in wire]  # as the SDK builds them from the stream
    at_once = min(args.at_once, args.turns)
    batches = args.turns // at_once
    provider = OpenAIProvider(model="bench", base_url="http://127.0.0.1:9/v1", api_key="bench")
    await provider.aclose()  # its real client is never used: the chunks come from ``SourceClient``
    provider._client = SourceClient(chunks)  # type: ignore[assignment]
    supervisor = TaskSupervisor("bench")
    pipelines = {"bare loop": bare, "floor": floor, "core": product_turn(provider, supervisor, reply_text(wire))}
    tune_gc()  # as chatbridge run does once it is up
    best = {name: float("inf") for name in pipelines}
    for _ in range(args.repeats):
        for name, run in pipelines.items():
            start = time.process_time()
            for _ in range(batches):
                await asyncio.gather(*(run(chunks) for _ in range(at_once)))
            best[name] = min(best[name], (time.process_time() - start) / (batches * at_once))
    await supervisor.shutdown(1)
    print(f"{args.chunks} chunks a turn, {at_once} turns at once, best of {args.repeats} rounds of "
          f"{batches * at_once} turns (process CPU time)")
    for name, seconds in best.items():
        print(f"  {name:10s} {seconds * 1e3:7.3f} ms a turn  {seconds / args.chunks * 1e6:6.2f} us a chunk")
    added = best["core"] - best["floor"]
    print(f"  core over the floor: {added * 1e3:.3f} ms a turn, {added / args.chunks * 1e6:.2f} us a chunk")
    return best


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=1000, help="turns a pipeline runs in one round")
    parser.add_argument("--at-once", type=int, default=1000, help="turns streaming at the same time")
    return asyncio.run(measure(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
