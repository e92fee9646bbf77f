"""Titles with the local provider never hold its one model while a chat waits for an answer.

The local model serves one request at a time; a title asked of it after a chat's first answer (a prompt of
up to 4,000 characters) made the chat's next message, and every other chat's, wait behind it. The model
here is scripted under the real ``LocalProvider``: it answers turns at once and holds any title request
until the test ends, so a title that reaches the model shows as a chat left waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

import core.title
from core.llm.local_provider import LocalProvider
from core.runtime import ChatCore
from core.settings import CoreSettings
from core.sqlite_store import SqliteStore
from core.title import TITLE_PROMPT
from tests.browser.server import SSEClient, open_stream, serve_web_chat


class ScriptedModel:
    """Answers a turn with "Answer to: <first line of the last message>"; a title request waits for ``release``."""

    n_tokens = 10

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.release = threading.Event()
        self.title_asked = asyncio.Event()
        self.titles = 0

    def create_chat_completion(self, *, messages: list[dict[str, str]], **kw: Any) -> Iterator[dict[str, Any]]:
        title = messages[0]["content"] == TITLE_PROMPT
        if title:
            self.titles += 1
            self.loop.call_soon_threadsafe(self.title_asked.set)

        def chunks() -> Iterator[dict[str, Any]]:
            if title:
                self.release.wait(30)  # a long title prompt being read
                text = "Capital of France"
            else:
                text = f"Answer to: {messages[-1]['content'].splitlines()[0]}"
            yield {"choices": [{"delta": {"content": text}, "finish_reason": None}]}
            yield {"choices": [{"delta": {}, "finish_reason": "stop"}]}
        return chunks()


class ScriptedProvider(LocalProvider):
    def __init__(self, model: ScriptedModel) -> None:
        super().__init__("/no/model.gguf")
        self.model = model

    def _load(self) -> Any:
        return self.model


async def answered(sse: SSEClient) -> str:
    """The text of the chat's next committed answer (the user sees it)."""
    committed = await sse.until(lambda e: e.name == "turn_committed")
    return str(committed.data["messages"][-1]["content"])


async def test_a_title_does_not_make_the_next_message_wait_for_the_local_model(tmp_path: Path) -> None:
    model = ScriptedModel(asyncio.get_running_loop())
    core = ChatCore(store=SqliteStore(tmp_path / "db.sqlite"), provider=ScriptedProvider(model),
                    settings=CoreSettings(titles=True, context_window=1024))
    chat = await serve_web_chat(core)
    base = chat.base_url
    try:
        async with aiohttp.ClientSession() as http:
            a, b = await open_stream(http, base, "a"), await open_stream(http, base, "b")
            await a.next()
            await b.next()

            async def send(sid: str, text: str) -> None:
                async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": text}) as resp:
                    assert resp.status == 202

            await send("a", "What is the capital of France? I am planning a trip there")
            assert await answered(a) == "Answer to: What is the capital of France? I am planning a trip there"
            # the chat's title shows (before: the title request was now holding the model)
            seen = asyncio.ensure_future(a.until(lambda e: e.name == "session_title"))
            asked = asyncio.ensure_future(model.title_asked.wait())
            await asyncio.wait((seen, asked), timeout=30, return_when=asyncio.FIRST_COMPLETED)
            asked.cancel()
            seen.cancel()  # (done already, unless the title went to the model)
            # the chat's second message and another chat's first are answered at once, not after the title
            await send("a", "And of Italy?")
            await send("b", "Say yes.")
            async with asyncio.timeout(20):  # before: never, while the title held the model
                assert await answered(a) == "Answer to: And of Italy?"
                assert await answered(b) == "Answer to: Say yes."
            assert [e.data["title"] for e in a.events if e.name == "session_title"] == [
                "What is the capital of France?"]
            assert model.titles == 0  # the model spent nothing on titles
            async with http.get(f"{base}/api/sessions") as resp:
                titles = {s["id"]: s["title"] for s in (await resp.json())["sessions"]}
            assert titles["a"] == "What is the capital of France?"
            a.resp.close()
            b.resp.close()
    finally:
        model.release.set()
        await chat.close()


def test_a_title_from_the_first_words_of_the_first_line() -> None:
    assert core.title.first_words("What is the capital of France?") == "What is the capital of France?"
    assert core.title.first_words("\n  Plan a three day trip to Rome with kids\nmore") == "Plan a three day trip to…"
    assert core.title.first_words('"Hello."') == "Hello"
    assert core.title.first_words("Where is Rome? I am going there in May") == "Where is Rome? I am going…"
    assert core.title.first_words("What is the capital of France? I am going there") == "What is the capital of France?"
    assert core.title.first_words("") == ""  # a message that was only an attachment keeps the default title
    assert len(core.title.first_words("x" * 200)) <= 61
    first = core.title.first_words
    long_words = "Internationalization considerations regarding multilingual interfaces and translation workflows"
    assert first(long_words) == "Internationalization considerations regarding multilingual…"  # one "…", not two
    assert first("**Bold** question about `things` here and more") == "Bold question about things here and…"
    assert first("今天天气很好，我们去公园散步吧。明天也去吗？") == "今天天气很好，我们去公园散步吧。明天也去…"
