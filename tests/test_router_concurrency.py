"""Seed 001 §6.4: ingress concurrency, ordering, capacity and shutdown."""

from __future__ import annotations

import asyncio

import pytest

from core.messages import MessageSource, NewMessage
from core.router import RouterClosedError, SubmitResult
from core.sqlite_store import SqliteStore
from tests.fakes.openai_server import Function, Text
from tests.support.harness import make_harness


def echo_last_user(body):
    last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    return Text("echo: " + last.split("\n\n[Runtime context]")[0])


class SlowForA(SqliteStore):
    """A store whose new_context and history are slow for session A only."""

    def __init__(self, path, gate: asyncio.Event) -> None:
        super().__init__(path)
        self.gate = gate

    async def new_context(self, key, **kw):  # type: ignore[override]
        if key == "test:A":
            await self.gate.wait()
        return await super().new_context(key, **kw)

    async def history(self, key, *, limit=1000, before=None):  # type: ignore[override]
        if key == "test:A":
            await self.gate.wait()
        return await super().history(key, limit=limit, before=before)


async def test_slow_command_in_one_session_does_not_delay_input_in_another(tmp_path, fake_openai):
    gate = asyncio.Event()
    fake_openai.default = Function(echo_last_user)
    h = await make_harness(tmp_path, fake_openai, store=SlowForA(tmp_path / "db", gate))
    assert await h.say("/new", chat_id="A") is SubmitResult.COMMAND
    assert await h.say("hello from B", chat_id="B") is SubmitResult.QUEUED
    await h.wait_for(lambda: h.platform.visible("B") == ["echo: hello from B"])
    assert h.platform.visible("A") == []  # A's /new is still stuck
    gate.set()
    await h.settle()
    assert h.platform.plain("A") and "new conversation" in h.platform.plain("A")[0]
    await h.core.shutdown()


async def test_slow_history_query_does_not_delay_stop_in_another_session(tmp_path, fake_openai):
    gate, hold = asyncio.Event(), asyncio.Event()
    fake_openai.script(Text("B is answering slowly", hold=hold, hold_after=1))
    h = await make_harness(tmp_path, fake_openai, store=SlowForA(tmp_path / "db", gate))
    slow_query = asyncio.create_task(h.core.history("test:A"))
    await h.say("question", chat_id="B")
    await h.wait_for(lambda: h.platform.visible("B") == ["B"])
    await h.say("/stop", chat_id="B")
    await h.wait_for(lambda: h.platform.visible("B") == ["B\n\n⏹ Stopped."])
    assert not slow_query.done()
    gate.set()
    hold.set()
    await slow_query
    await h.core.shutdown()


async def test_after_shutdown_new_input_gets_a_clear_failure(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.core.shutdown()
    with pytest.raises(RouterClosedError, match="shutting down"):
        await h.say("anyone there?")


async def test_same_session_order_is_kept(tmp_path, fake_openai):
    fake_openai.default = Function(echo_last_user)
    h = await make_harness(tmp_path, fake_openai)
    for i in range(6):
        await h.say(f"message {i}")
    await h.settle()
    assert h.platform.visible("c1") == [f"echo: message {i}" for i in range(6)]
    _, history = await h.core.history("test:c1")
    assert [m.content for m in history] == [x for i in range(6) for x in (f"message {i}", f"echo: message {i}")]
    sent_users = [[m["content"] for m in body["messages"] if m["role"] == "user"][-1] for body in fake_openai.requests]
    assert [s.split("\n\n")[0] for s in sent_users] == [f"message {i}" for i in range(6)]
    await h.core.shutdown()


async def test_full_queue_answers_busy_and_drops_nothing_silently(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("first", hold=hold, hold_after=1))
    fake_openai.default = Text("later")
    h = await make_harness(tmp_path, fake_openai, queue_capacity=32)
    await h.say("m0")
    await h.wait_for(lambda: h.core.sessions.is_running("test:c1"))
    results = [await h.say(f"m{i}") for i in range(1, 34)]
    assert results[:32] == [SubmitResult.QUEUED] * 32
    assert results[32] is SubmitResult.BUSY
    await h.wait_for(lambda: len(h.platform.plain("c1")) == 1)
    assert "not queued" in h.platform.plain("c1")[0]
    hold.set()
    await h.settle(timeout=30)
    live = [m for m in h.platform.messages.values() if m.kind == "live"]
    assert len(live) == 33  # m0 plus the 32 queued ones, each answered once
    await h.core.shutdown()


async def test_duplicate_event_is_answered_once_even_after_restart(tmp_path, fake_openai):
    fake_openai.default = Text("answer")
    h = await make_harness(tmp_path, fake_openai)
    assert await h.say("hi", event_id="upd-1") is SubmitResult.QUEUED
    assert await h.say("hi", event_id="upd-1") is SubmitResult.DUPLICATE
    await h.settle()
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai)
    h2.channel.platform = h.platform
    assert await h2.say("hi", event_id="upd-1") is SubmitResult.DUPLICATE
    await h2.settle()
    assert h.platform.visible("c1") == ["answer"]
    assert len(fake_openai.requests) == 1
    await h2.core.shutdown()


async def test_turn_interrupted_by_a_crash_is_reported_once_on_restart(tmp_path, fake_openai):
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    target = '{"channel":"test","chat_id":"c9","session_key":"test:c9"}'
    message = NewMessage(role="user", content="hi", source=MessageSource(kind="user_input"))
    await store.append_message("test:c9", message, begin_turn=("t-crashed", target))
    await store.close()
    h = await make_harness(tmp_path, fake_openai)
    assert len(h.platform.plain("c9")) == 1 and "restarted" in h.platform.plain("c9")[0]
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai)
    assert h2.platform.plain("c9") == []
    await h2.core.shutdown()


async def test_help_lists_the_commands(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.say("/help")
    await h.settle()
    [text] = h.platform.plain("c1")
    assert "/stop" in text and "/new" in text
    assert fake_openai.requests == []
    await h.core.shutdown()


async def test_new_starts_a_fresh_context_but_keeps_history(tmp_path, fake_openai):
    fake_openai.default = Function(echo_last_user)
    h = await make_harness(tmp_path, fake_openai)
    await h.say("remember the word banana")
    await h.settle()
    await h.say("/new")
    await h.settle()
    await h.say("what was the word?")
    await h.settle()
    last_request = fake_openai.requests[-1]["messages"]
    assert not any("banana" in m["content"] for m in last_request)
    _, history = await h.core.history("test:c1")
    assert any("banana" in m.content for m in history)
    await h.core.shutdown()


async def test_idle_session_workers_are_reaped(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai, session_idle_seconds=0.1)
    for chat in ("a", "b", "c"):
        await h.say("hi", chat_id=chat)
    await h.settle()
    await h.wait_for(lambda: h.core.sessions.active_count == 0, timeout=3)
    await h.say("again", chat_id="a")  # a reaped session comes back on demand
    await h.settle()
    assert h.platform.visible("a") == ["ok", "ok"]
    await h.core.shutdown()


async def test_a_stored_new_that_two_processes_read_as_waiting_is_announced_once(tmp_path, fake_openai):
    """A ``/new`` another process stored for this session (``SessionFailover.forward_new``), carried out by two
    holders that both read it as waiting (the first one's lease ran out meanwhile): the second finds it
    carried out and tells the chat nothing."""
    h = await make_harness(tmp_path, fake_openai)
    envelope = h.channel.envelope("/new")
    seq = await h.store.admit_inbound(envelope.channel, None, '{"command": "new"}', ttl_seconds=100,
                                      key=envelope.key())
    assert seq is not None
    for _ in range(2):  # each process's job for the same stored record
        job = h.core.stored_job("new", envelope, seq)
        assert job is not None
        await job([])
    assert h.platform.plain("c1") == [h.core.presenter.new_context()]
    assert (await h.store.get_or_create_session(envelope.key())).generation == 1
