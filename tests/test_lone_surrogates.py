"""Unpaired surrogates (a "\\ud800" escape in JSON decodes to one) cannot be encoded as UTF-8, so SQLite and
every platform refuse them. Where text enters — a model's stream (every provider), an inbound message, a
rename, a tool's output — each one becomes U+FFFD, and the answer, the message and the title all arrive."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from core.llm.anthropic_provider import AnthropicProvider
from core.llm.provider import LLMMessage, LLMRequest, TextDelta, ToolCallDelta
from core.sqlite_store import SqliteStore
from core.store import StoreError
from core.text import sound_text
from core.tools.base import ToolRegistry
from tests.browser.server import open_stream, start_web_chat
from tests.fakes.anthropic_server import Text as AnthropicText
from tests.fakes.anthropic_server import ToolUses
from tests.fakes.openai_server import Text, ToolCalls
from tests.support.harness import make_harness
from tests.test_agent_loop import KEY, ScriptTool

LONE = "\ud800"
REPLACED = "\ufffd"


def test_sound_text_replaces_only_unpaired_surrogates() -> None:
    assert sound_text("plain") == "plain"
    assert sound_text("中文 ✓ 😀") == "中文 ✓ 😀"
    assert sound_text(f"a{LONE}b\udfffc") == f"a{REPLACED}b{REPLACED}c"
    assert sound_text("\ud83d\ude00") == "😀"  # a pair that was never joined is one character after all
    sound_text(f"x{LONE}").encode("utf-8")  # encodable


async def test_a_model_chunk_with_a_lone_surrogate_loses_nothing(tmp_path, fake_openai) -> None:
    fake_openai.script(Text(f"Hello {LONE}world, the whole answer.", chunk_size=4))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    answer = f"Hello {REPLACED}world, the whole answer."
    assert h.platform.visible("c1")[-1] == answer
    _, history = await h.store.history(KEY)
    assert [(m.role, m.content) for m in history] == [("user", "hi"), ("assistant", answer)]
    await h.core.shutdown()


async def test_anthropic_text_and_tool_arguments_are_made_sound(fake_anthropic) -> None:
    provider = AnthropicProvider("claude-test", fake_anthropic.base_url, "sk-ant-test", request_timeout=2.0)
    try:
        fake_anthropic.script(AnthropicText(f"odd {LONE} text"))
        events = [e async for e in provider.stream(LLMRequest(messages=(LLMMessage("user", "hi"),)))]
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == f"odd {REPLACED} text"
        fake_anthropic.script(ToolUses([("lookup", '{"q": "x' + LONE + '"}')], fragment_size=3))
        events = [e async for e in provider.stream(LLMRequest(messages=(LLMMessage("user", "hi"),)))]
        arguments = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
        assert json.loads(arguments) == {"q": f"x{REPLACED}"}
    finally:
        await provider.aclose()


async def test_a_tool_output_with_a_lone_surrogate_is_kept(tmp_path, fake_openai) -> None:
    async def odd(_: dict[str, Any]) -> str:
        return f"result {LONE} here"

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("odd", odd))
    fake_openai.script(ToolCalls([("odd", "{}")], ids=["call_O"]), Text("Done."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    await h.say("go")
    await h.settle()
    assert h.platform.visible("c1")[-1] == "Done."
    tool_message = [m for m in fake_openai.requests[-1]["messages"] if m.get("role") == "tool"]
    assert tool_message[0]["content"] == f"result {REPLACED} here"
    _, history = await h.store.history(KEY)
    assert [m.content for m in history if m.role == "tool"] == [f"result {REPLACED} here"]
    await h.core.shutdown()


async def test_a_web_message_and_a_rename_with_a_lone_surrogate_are_kept(tmp_path, fake_openai) -> None:
    fake_openai.script(Text("Got it."))
    wc = await start_web_chat(tmp_path, fake_openai)
    try:
        async with aiohttp.ClientSession() as http:
            base = wc.base_url
            async with http.post(f"{base}/api/sessions") as resp:
                sid = (await resp.json())["id"]
            sse = await open_stream(http, base, sid)
            # json= escapes the surrogate as \ud800, as a browser's JSON.stringify does
            async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": f"hi {LONE}"}) as resp:
                assert resp.status == 202
            await sse.until(lambda e: e.name == "turn_committed")
            async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
                messages = (await resp.json())["messages"]
            assert [(m["role"], m["content"]) for m in messages] == [("user", f"hi {REPLACED}"),
                                                                     ("assistant", "Got it.")]
            assert fake_openai.requests[0]["messages"][-1]["content"].startswith(f"hi {REPLACED}")

            async with http.patch(f"{base}/api/sessions/{sid}", json={"title": f"odd {LONE} title"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["title"] == f"odd {REPLACED} title"  # what was stored, not what was sent
            async with http.get(f"{base}/api/sessions") as resp:
                titles = [s["title"] for s in (await resp.json())["sessions"]]
            assert f"odd {REPLACED} title" in titles
    finally:
        await wc.close()


async def test_the_store_reports_text_it_cannot_encode_as_such(tmp_path) -> None:
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    try:
        await store.get_or_create_session("k")
        with pytest.raises(StoreError) as info:
            await store.rename("k", f"bad {LONE}")
        assert "connection unavailable" not in str(info.value)
        assert "cannot be encoded" in str(info.value)
        assert LONE not in str(info.value)
    finally:
        await store.close()
