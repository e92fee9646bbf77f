"""llama.cpp's own log goes to the bridge's log at debug level, not to stderr.

llama-cpp-python prints llama.cpp's errors on stderr even with ``verbose=False``; one of them,
"decode: removing memory module entries …", came at every prompt read a /stop abandoned, a line the operator
could do nothing about. Needs the real bundled model (skipped without the `local` extra).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from core.llm.local_provider import LocalProvider
from core.llm.provider import LLMMessage, LLMRequest, StreamEnd
from tests.test_local_provider import MODEL, ask, needs_model


class StopAtRead(LocalProvider):
    """Its second generation is stopped as its prompt read begins (a /stop at that moment)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.abandoned = threading.Event()

    def _generate(self, request: LLMRequest, stop: threading.Event, put: Any) -> None:
        stopping = self.generations == 1
        if stopping:
            stop.set()
        super()._generate(request, stop, put)
        if stopping:  # (not ``stop.is_set()``: every stream sets it when it ends, maybe before this line)
            self.abandoned.set()


@needs_model
async def test_an_abandoned_prompt_read_leaves_nothing_on_stderr_and_a_debug_line_in_the_log(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="core.llm.local_provider")
    provider = StopAtRead(MODEL, n_ctx=1024, seed=1)
    try:
        assert isinstance([e async for e in provider.stream(ask("Say yes.", 2))][-1], StreamEnd)
        long_text = "Summarise this. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 40
        request = LLMRequest(messages=(LLMMessage("user", long_text),), max_tokens=4, temperature=0.0)

        async def consume() -> None:
            async for _ in provider.stream(request):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(provider.abandoned.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert provider.stopped_early == 1
        after = [e async for e in provider.stream(ask("Say yes.", 2))]
        assert isinstance(after[-1], StreamEnd)
    finally:
        await provider.aclose()
    assert "removing memory module entries" not in capfd.readouterr().err
    routed = [r for r in caplog.records if r.name == "core.llm.local_provider" and r.levelno == logging.DEBUG]
    assert any("removing memory module entries" in r.getMessage() for r in routed)
