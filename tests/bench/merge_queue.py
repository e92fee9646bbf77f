"""Merge-queue overhead: µs per event through one MergeQueue, and per tool call through the approval gate
and a tool producer (no model, no I/O). Prints figures; asserts nothing about speed.

    .venv/bin/python -m tests.bench.merge_queue
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from core.agent.approvals import ApprovalBroker, ApprovalGate
from core.agent.events import CompleteToolCall, PartialText, ToolOutput, TurnEvent
from core.agent.merge_queue import MergeQueue
from core.llm.provider import LLMToolSpec
from core.supervisor import TaskSupervisor
from core.tools.base import ToolContext, ToolRegistry

EVENTS = 200_000
CALLS = 20_000


class Echo:
    spec = LLMToolSpec("echo", "echo", {"type": "object"})
    approval = "auto"

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return "ok"


async def per_event() -> float:
    count = 0

    def consume(event: TurnEvent) -> None:
        nonlocal count
        count += 1

    queue: MergeQueue[TurnEvent] = MergeQueue(consume, TaskSupervisor("bench").spawn)
    delta = PartialText("delta", "x")

    async def produce(n: int) -> None:
        for i in range(n):
            queue.push(delta)
            if i % 64 == 0:
                await asyncio.sleep(0)

    start = time.perf_counter()
    for _ in range(4):
        queue.add_producer("p", produce(EVENTS // 4))
    await queue.join()
    assert count == EVENTS
    return (time.perf_counter() - start) / EVENTS * 1e6


async def per_tool_call() -> float:
    outputs = 0

    def consume(event: TurnEvent) -> None:
        nonlocal outputs
        outputs += isinstance(event, ToolOutput)

    queue: MergeQueue[TurnEvent] = MergeQueue(consume, TaskSupervisor("bench").spawn)
    tools = ToolRegistry()
    tools.add(Echo())  # type: ignore[arg-type]

    async def run(call: CompleteToolCall) -> None:
        text = await Echo().run({}, ToolContext("k", "t", call.call_id))
        queue.push(ToolOutput(call.call_id, call.name, text, "done"))

    gate = ApprovalGate(queue=queue, tools=tools, broker=ApprovalBroker(), session_key="k", requested_by=None,
                        timeout=60, start_tool=lambda c: queue.add_producer(c.call_id, run(c)))

    async def driver() -> None:
        for i in range(CALLS):
            call = CompleteToolCall(f"c{i}", "echo", "{}")
            queue.push(call)
            gate.submit(call)
            if i % 64 == 0:
                await asyncio.sleep(0)

    start = time.perf_counter()
    queue.add_producer("driver", driver())
    await queue.join()
    assert outputs == CALLS
    return (time.perf_counter() - start) / CALLS * 1e6


async def main() -> None:
    ev = await per_event()
    tc = await per_tool_call()
    print(f"merge queue: {ev:.2f} µs per event ({EVENTS} events, 4 producers)")
    print(f"tool call through approval gate + tool producer + queue: {tc:.1f} µs per call ({CALLS} calls)")


if __name__ == "__main__":
    asyncio.run(main())
