"""/stop and shutdown while the local model reads a long prompt (one llama.cpp call with no token in between).

The real bundled model where the model matters (skipped without the `local` extra); a model that never
finishes its step where only the thread's bookkeeping does.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import core.llm.local_provider as local_provider
from core.llm.local_provider import LocalProvider
from core.llm.provider import LLMMessage, LLMRequest, StreamEnd, TextDelta
from core.llm.silence import bounded
from tests.test_local_provider import MODEL, BusyModel, BusyProvider, ask, needs_model

ROOT = Path(__file__).resolve().parent.parent


class ReadCounter(LocalProvider):
    """Records how many tokens the model's cache held when each generation's thread ended."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.held: list[int] = []
        self.entered = threading.Event()

    def _generate(self, request: LLMRequest, stop: threading.Event, put: Any) -> None:
        if self.generations == 1:
            self.entered.set()  # the second generation: the long read
        try:
            super()._generate(request, stop, put)
        finally:
            self.held.append(int(self._load().n_tokens))


@needs_model
async def test_stop_during_a_long_prompt_read_abandons_the_read():
    provider = ReadCounter(MODEL, n_ctx=2048, seed=1)
    try:
        [e async for e in provider.stream(ask("Say yes.", 2))]  # loads the model
        long_text = "Summarise this. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 110
        request = LLMRequest(messages=(LLMMessage("user", long_text),), max_tokens=4, temperature=0.0)
        prompt_tokens = len(provider._load().tokenize(long_text.encode()))
        assert prompt_tokens > 1400

        async def consume() -> None:
            async for _ in provider.stream(request):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(provider.entered.wait, 30)  # the thread is on its way into the read
        task.cancel()  # /stop
        with pytest.raises(asyncio.CancelledError):
            await task
        after = [e async for e in provider.stream(ask("Say yes.", 2))]
        assert isinstance(after[-1], StreamEnd)  # the model is usable again after the abandoned read
        assert provider.stopped_early == 1
        # the next request waited only for part of the read: the cache never held the whole long prompt
        # (before: the read went to its end, then the thread stopped at the first token)
        assert provider.held[1] < prompt_tokens
    finally:
        await provider.aclose()


class EnteredModel(BusyModel):
    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def create_chat_completion(self, **kw: Any) -> Iterator[dict[str, Any]]:
        chunks = super().create_chat_completion(**kw)
        self.entered.set()
        return chunks


async def test_shutdown_does_not_wait_for_a_model_stuck_in_one_step(monkeypatch):
    monkeypatch.setattr(local_provider, "CLOSE_TIMEOUT", 0.2)
    model = EnteredModel()
    provider = BusyProvider(model)
    try:
        task = asyncio.create_task(anext(provider.stream(ask("hi", 4))))
        assert await asyncio.to_thread(model.entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(10):  # before: until the model's step ended (30 s here)
            await provider.aclose()
    finally:
        model.go.set()


def test_a_forced_exit_does_not_wait_for_the_model_thread(tmp_path):
    """The second SIGTERM ends the process at once: the interpreter does not join the model's thread."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import asyncio, threading
        from core.llm.local_provider import LocalProvider
        from core.llm.provider import LLMMessage, LLMRequest

        class Stuck:
            n_tokens = 0
            def __init__(self):
                self.entered = threading.Event()
            def create_chat_completion(self, **kw):
                self.entered.set()
                threading.Event().wait(120)  # a prompt read that outlives the process
                return iter(())

        class P(LocalProvider):
            def __init__(self):
                super().__init__("/no/model.gguf")
                self.model = Stuck()
            def _load(self):
                return self.model

        async def main():
            p = P()
            task = asyncio.create_task(anext(p.stream(LLMRequest(messages=(LLMMessage("user", "hi"),)))))
            await asyncio.to_thread(p.model.entered.wait, 30)
            task.cancel()
            print("leaving", flush=True)

        asyncio.run(main())
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "leaving" in done.stdout, done.stderr
    assert done.returncode == 0, done.stderr


async def test_a_request_waiting_for_the_model_is_not_timed_out_as_silence(monkeypatch):
    """The third of three chats at once: waiting for the others' answers is not the model being silent."""
    monkeypatch.setattr(local_provider, "WAIT_KEEPALIVE", 0.02)
    model = EnteredModel()
    provider = BusyProvider(model)
    try:
        async def first() -> list[Any]:
            return [e async for e in provider.stream(ask("one", 4))]

        async def queued() -> list[Any]:
            return [e async for e in bounded(provider.stream(ask("two", 4)), 0.5)]

        holder = asyncio.create_task(first())
        assert await asyncio.to_thread(model.entered.wait, 30)
        waiting = asyncio.create_task(queued())
        await asyncio.sleep(1.5)  # three times the silence bound, spent waiting for the first answer
        assert not waiting.done()  # before: ProviderError(TIMEOUT), without ever reaching the model
        model.go.set()
        async with asyncio.timeout(10):
            answered = await waiting
            await holder
        assert "".join(e.text for e in answered if isinstance(e, TextDelta)) == "late"
        assert isinstance(answered[-1], StreamEnd) and model.steps == 2
    finally:
        model.go.set()
        await provider.aclose()
