"""The session worker's context cache: what the model is sent is exactly what a fresh load would give."""

from __future__ import annotations

from typing import Any

from core.context_cache import ContextCache
from core.llm.provider import LLMMessage
from core.messages import ChatMessage, MessageSource, NewMessage
from core.store import CommitResult, SessionRecord
from core.tools.base import ToolRegistry
from tests.fakes.openai_server import Function, Text, ToolCalls
from tests.support.harness import make_harness
from tests.test_agent_loop import ScriptTool

KEY = "test:c1"


def msg(seq: int, text: str = "") -> ChatMessage:
    return ChatMessage(id=f"m{seq}", session_key=KEY, seq=seq, role="user", content=text or f"m{seq}",
                       source=MessageSource(kind="user_input"), received_at=0.0, created_at=0.0)


def record(state_version: int, context_start_seq: int = 0) -> SessionRecord:
    return SessionRecord(key=KEY, title="t", title_is_default=True, generation=0, state_version=state_version,
                         history_revision=0, revision_seq=0, context_start_seq=context_start_seq, created_at=0.0,
                         updated_at=0.0)


# ---- the cache on its own ------------------------------------------------------------------------


def test_holds_one_version_only():
    cache = ContextCache(10)
    assert cache.get(0) is None
    cache.put(3, [msg(1), msg(2)])
    assert [m.seq for m in cache.get(3) or []] == [1, 2]
    assert cache.get(2) is None and cache.get(4) is None


def test_an_append_it_saw_moves_it_forward_and_one_it_missed_drops_it():
    cache = ContextCache(10)
    cache.put(3, [msg(1)])
    cache.appended(msg(2), record(4))
    assert [m.seq for m in cache.get(4) or []] == [1, 2]
    # someone else wrote version 5; this append goes 5 -> 6, which the cache cannot continue
    cache.appended(msg(4), record(6))
    assert cache.version is None and cache.get(6) is None


def test_the_first_message_of_a_context_is_that_whole_context():
    cache = ContextCache(10)
    cache.appended(msg(1), record(1))  # a new conversation: nothing to load
    assert [m.seq for m in cache.get(1) or []] == [1]
    # /new made the context start after seq 4 (versions the cache did not see): the next message alone
    cache.put(3, [msg(3), msg(4)])
    cache.appended(msg(5), record(6, context_start_seq=4))
    assert [m.seq for m in cache.get(6) or []] == [5]
    # a message after others in its context is not a whole context: one the cache missed drops it
    cache.clear()
    cache.appended(msg(6), record(7, context_start_seq=4))
    assert cache.version is None


def test_a_commit_adds_only_what_it_inserted():
    cache = ContextCache(10)
    cache.put(1, [msg(1)])
    cache.appended(msg(2), record(2))
    cache.committed(CommitResult(session_key=KEY, history_revision=1, messages=(msg(2), msg(3), msg(4)),
                                 state_version=3, inserted=2))
    assert [m.seq for m in cache.get(3) or []] == [1, 2, 3, 4]
    # a commit that inserted nothing keeps the version
    cache.committed(CommitResult(session_key=KEY, history_revision=2, messages=(), state_version=3, inserted=0))
    assert cache.version == 3


def test_messages_that_do_not_continue_it_drop_it():
    cache = ContextCache(10)
    cache.put(1, [msg(1), msg(2)])
    cache.extend(1, 2, [msg(2)])
    assert cache.version is None


def test_keeps_the_newest_limit_messages():
    cache = ContextCache(3)
    cache.put(5, [msg(i) for i in range(1, 6)])
    assert [m.seq for m in cache.get(5) or []] == [3, 4, 5]
    cache.extend(5, 6, [msg(6), msg(7)])
    assert [m.seq for m in cache.get(6) or []] == [5, 6, 7]


# ---- through the whole chain ---------------------------------------------------------------------


def sent_context(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, content) of what the model was sent after the system prompt, runtime block removed."""
    return [(m["role"], (m.get("content") or "").split("\n\n[Runtime context]")[0]) for m in body["messages"][1:]]


def stored_context(messages: list[ChatMessage], limit: int) -> list[tuple[str, str]]:
    """The newest ``limit`` messages, from the first user message among them: a tool result whose call fell
    out of the window, and an answer whose question did, are not sent."""
    kept = [(m.role, m.content) for m in messages[-limit:]]
    while kept and kept[0][0] != "user":
        kept.pop(0)
    return kept


async def test_every_request_of_a_long_conversation_matches_a_fresh_load(tmp_path, fake_openai):
    async def lookup(args: dict[str, Any]) -> str:
        return "looked up"

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("lookup", lookup))
    limit = 5  # small, so the window slides and tool messages fall out of it
    h = await make_harness(tmp_path, fake_openai, tools=tools, history_limit=limit)
    for i in range(8):
        if i % 3 == 1:
            fake_openai.script(ToolCalls([("lookup", "{}")]), Text(f"answer {i} after a lookup"))
        else:
            fake_openai.script(Text(f"answer {i}"))
        before = len(fake_openai.requests)
        await h.say(f"question {i}")
        await h.settle()
        _, history = await h.store.history(KEY)
        # the store now also holds this turn's answer: the first request saw everything up to the question
        upto_question = [m for m in history if m.seq <= max(m.seq for m in history if m.role == "user")]
        assert sent_context(fake_openai.requests[before]) == stored_context(upto_question, limit), i
    assert h.core.sessions.active_count == 1  # one live worker the whole time: the cache was in use
    await h.core.shutdown()


async def test_a_write_the_worker_did_not_make_reaches_the_next_request(tmp_path, fake_openai):
    fake_openai.default = Function(lambda body: Text("ok"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first")
    await h.settle()
    # another writer (a second process on the same database, an admin tool) adds a message
    await h.store.append_message(KEY, NewMessage(role="user", content="written elsewhere",
                                                 source=MessageSource(kind="user_input")))
    await h.say("second")
    await h.settle()
    assert [c for _, c in sent_context(fake_openai.requests[-1])] == ["first", "ok", "written elsewhere", "second"]
    await h.core.shutdown()


def test_model_forms_are_converted_once_and_go_with_their_messages():
    cache, calls = ContextCache(2), []

    def convert(m: ChatMessage) -> LLMMessage:
        calls.append(m.seq)
        return LLMMessage("user", m.content)

    cache.put(1, [msg(1), msg(2)])
    first = cache.converted(msg(2), convert)
    assert cache.converted(msg(2), convert) is first and calls == [2]
    cache.extend(1, 2, [msg(3)])  # seq 1 leaves the window
    cache.converted(msg(3), convert)
    cache.converted(msg(2), convert)
    assert calls == [2, 3]
    cache.put(5, [msg(2)])  # a reload starts afresh
    cache.converted(msg(2), convert)
    assert calls == [2, 3, 2]
