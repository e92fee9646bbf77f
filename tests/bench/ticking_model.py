"""The streaming benchmarks' model: an OpenAI-compatible ``/chat/completions`` that streams one fixed reply, every
stream of a process fed by one clock.

The project's protocol fake (``tests.fakes.openai_server.FakeOpenAI``) gives every stream a task that sleeps
before each chunk and encodes each chunk anew: 30–50 µs of CPU a chunk (``tests.bench.model_fake``). At 1,000
streams of one chunk every 10 ms (100,000 chunks a second) that is more than the benchmark machine has, so the
model fell behind and the pipelines measured met a different model depending on when they asked: a pipeline
whose requests came in one burst got every stream at once, late and in lumps of many chunks a read; one whose
requests came over a second met a model already busy and got its chunks one at a time. The comparison was
then partly of the rig's timing, not of the pipelines alone.

Here a request only registers its stream; one task a process wakes every ``delay`` and writes each stream
the chunks that are due by then (chunk ``i`` at ``start + i * delay``, as the protocol fake's sleeps would
have it), through aiohttp's public ``StreamResponse.write``, each distinct chunk encoded once a request.
Chunks a late tick finds due go out together, so a stream keeps its schedule as long as the machine allows.
The wire format is the protocol fake's: a role chunk, the content chunks, a finish chunk, the usage chunk
when the request asks for it, ``[DONE]``. Written for the benchmarks alone (no fault injection, one reply):
no library serves thousands of SSE streams from one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiohttp import web


@dataclass(eq=False)
class _Stream:
    resp: web.StreamResponse
    start: float
    head: bytes
    """The role chunk, written at once."""
    frames: list[bytes]
    """One per content chunk; the last one carries the finish, usage and ``[DONE]`` after it."""
    sent: int = 0
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class TickingModel:
    def __init__(self, text: str, chunk_size: int, delay: float, times: TextIO | None = None) -> None:
        self.pieces = [text[i:i + chunk_size] for i in range(0, len(text), chunk_size)]
        self.delay = delay
        self.times = times
        """Each stream appends ``<received> <ended>`` (``time.monotonic()``) here when its last byte is written."""
        self._streams: list[_Stream] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self._ticker: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0, *, reuse_port: bool = False) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_port=reuse_port or None)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._ticker = asyncio.create_task(self._tick())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for stream in self._streams:
            if not stream.done.done():
                stream.done.set_result(None)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": {"message": "this model only streams"}}, status=400)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        stream = self._stream(resp, body)
        await resp.write(stream.head)
        self._streams.append(stream)
        self._wake.set()
        await stream.done
        if self.times is not None:
            self.times.write(f"{received:.6f} {time.monotonic():.6f}\n")  # one write: O_APPEND keeps it whole
        await resp.write_eof()
        return resp

    def _stream(self, resp: web.StreamResponse, body: dict[str, Any]) -> _Stream:
        base = {"id": f"chatcmpl-fake-{next(self._ids)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": str(body.get("model", "fake-model"))}

        def frame(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]
            return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

        encoded = {piece: frame({"content": piece}) for piece in set(self.pieces)}  # the pieces repeat
        frames = [encoded[piece] for piece in self.pieces]
        end = frame({}, "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt = sum(len(str(m.get("content") or "")) for m in body.get("messages") or []) // 4 + 1
            completion = sum(map(len, self.pieces)) // 4 + 1
            end += frame(None, usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                      "total_tokens": prompt + completion})
        frames[-1] = frames[-1] + end + b"data: [DONE]\n\n"
        return _Stream(resp, asyncio.get_running_loop().time(), frame({"role": "assistant", "content": ""}),
                       frames)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
            now = loop.time()
            still: list[_Stream] = []
            for stream in self._streams:  # the list as it grows: a stream that joins during a write is served too
                due = min(len(stream.frames), int((now - stream.start) / self.delay))
                if due > stream.sent:
                    try:
                        await stream.resp.write(b"".join(stream.frames[stream.sent:due]))
                    except (ConnectionError, RuntimeError):  # the client went away
                        due = len(stream.frames)
                    stream.sent = due
                if stream.sent < len(stream.frames):
                    still.append(stream)
                elif not stream.done.done():
                    stream.done.set_result(None)
            self._streams = still
            await asyncio.sleep(self.delay - (loop.time() - now) % self.delay if self._streams else 0)
