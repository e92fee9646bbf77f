"""The streaming benchmarks' model (``tests/bench/ticking_model.py``), read through the real ``openai`` SDK as the
product and the floor read it: the whole reply in order, on its schedule (a chunk never before its time), the
protocol's ending, and streams that do not disturb each other."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.bench.streaming import CHUNK, reply_text
from tests.bench.ticking_model import TickingModel

DELAY = 0.02
CHUNKS = 8


@pytest.fixture
async def model() -> AsyncIterator[TickingModel]:
    server = TickingModel(reply_text(CHUNKS), len(CHUNK), DELAY, io.StringIO())
    await server.start()
    yield server
    await server.stop()


async def stream(model: TickingModel, *, usage: bool = True) -> tuple[float, list[tuple[float, ChatCompletionChunk]]]:
    """The moment the request went out and every chunk with the moment it was read."""
    async with asyncio.timeout(10), openai.AsyncOpenAI(base_url=model.base_url, api_key="k", max_retries=0) as client:
        sent = time.monotonic()
        extra = {"stream_options": {"include_usage": True}} if usage else {}
        chunks = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                      stream=True, **extra)  # type: ignore[call-overload]
        return sent, [(time.monotonic(), chunk) async for chunk in chunks]


async def test_the_reply_comes_whole_in_order_and_never_before_its_time(model: TickingModel) -> None:
    sent, read = await stream(model)
    contents = [(at, c.choices[0].delta.content) for at, c in read if c.choices and c.choices[0].delta.content]
    assert "".join(text for _, text in contents) == reply_text(CHUNKS)
    assert len(contents) == CHUNKS
    for i, (at, _) in enumerate(contents, 1):  # chunk i is due i delays after the request arrived
        assert at - sent >= i * DELAY - 0.001
    assert read[0][1].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for _, c in read if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage = read[-1][1].usage
    assert usage is not None and usage.completion_tokens > 0
    assert isinstance(model.times, io.StringIO)
    received, ended = map(float, model.times.getvalue().split())
    assert ended - received >= CHUNKS * DELAY - 0.001


async def test_usage_only_when_the_request_asks_for_it(model: TickingModel) -> None:
    _, read = await stream(model, usage=False)
    assert all(c.usage is None for _, c in read)
    assert "".join(c.choices[0].delta.content or "" for _, c in read if c.choices) == reply_text(CHUNKS)


async def test_streams_at_once_and_a_client_that_leaves_do_not_disturb_the_others(model: TickingModel) -> None:
    async def leave_early() -> None:
        async with asyncio.timeout(10), openai.AsyncOpenAI(base_url=model.base_url, api_key="k",
                                                            max_retries=0) as client:
            chunks = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "go"}], stream=True)
            async for _ in chunks:
                break  # the response is closed with the client, mid-stream

    leaving = asyncio.create_task(leave_early())
    results = await asyncio.gather(*(stream(model) for _ in range(5)))
    await leaving
    for _, read in results:
        assert "".join(c.choices[0].delta.content or "" for _, c in read if c.choices) == reply_text(CHUNKS)
    _, after = await stream(model)  # the model still serves
    assert "".join(c.choices[0].delta.content or "" for _, c in after if c.choices) == reply_text(CHUNKS)
