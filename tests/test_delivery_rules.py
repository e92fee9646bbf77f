"""DESIGN.md §2 delivery rules and seed 001 §5.3/§15: what the chat ends up showing.

Each test drives the real chain (SQLite store, OpenAI SDK against the fake server, the test channel)
and asserts what a chat user would see on the fake platform.
"""

from __future__ import annotations

import asyncio

from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import Hang, HttpError, Malformed, Text
from tests.support import db
from tests.support.harness import API_KEY, make_harness

ANSWER = "The capital of France is Paris."
SHUT_DOWN = "⏹ Stopped: the bridge is shutting down. Send your message again once it is back."
"""How a reply the shutdown stopped ends: not like a user's /stop (the user stopped nothing)."""


async def test_success_shows_the_answer_once_and_sends_no_fallback(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("capital of France?")
    await h.settle()
    assert h.platform.visible("c1") == [ANSWER]
    assert h.platform.plain("c1") == []
    assert await h.core.shutdown() == []


async def test_open_failure_sends_exactly_one_plain_reply(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.fail_open = True
    await h.say("capital of France?")
    await h.settle()
    assert h.platform.visible("c1") == [ANSWER]
    assert h.platform.plain("c1") == [ANSWER]
    await h.core.shutdown()


async def test_a_failed_final_update_sends_exactly_one_fallback(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.finish_fail = True
    await h.say("capital of France?")
    await h.settle()
    plain = h.platform.plain("c1")
    assert plain == [ANSWER]
    assert h.channel.sinks[0].finish_calls == 1  # retrying platform calls is the channel's business, not core's
    await h.core.shutdown()


async def test_hanging_sink_is_bounded_and_falls_back_once(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.hang_finish = True
    await h.say("capital of France?")
    await h.settle()
    assert h.platform.plain("c1") == [ANSWER]
    await h.core.shutdown()


class FailingCommitStore(SqliteStore):
    async def commit_turn(self, key, messages, **kw):  # type: ignore[override]
        raise StoreError("disk I/O error")


async def test_persistence_failure_never_delivers_the_answer_as_completed(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai, store=FailingCommitStore(tmp_path / "db.sqlite"))
    h.channel.fail_open = True  # so the plain fallback path is exercised
    await h.say("capital of France?")
    await h.settle()
    plain = h.platform.plain("c1")
    assert len(plain) == 1
    assert ANSWER not in plain[0]
    assert "could not be saved" in plain[0]
    await h.core.shutdown()


async def test_persistence_failure_with_live_sink_ends_in_a_failure_state(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai, store=FailingCommitStore(tmp_path / "db.sqlite"))
    seen = []
    h.core.events.subscribe(lambda e: seen.append(e))
    await h.say("capital of France?")
    await h.settle()
    [shown] = h.platform.visible("c1")
    assert "could not be saved" in shown  # the live message is marked failed, not completed
    assert h.platform.plain("c1") == []
    assert not any(type(e).__name__ == "TurnCommitted" for e in seen)
    # the trace normally rides on the commit; without one it is still written on its own
    kinds = [t.kind for t in db.traces(tmp_path / "db.sqlite", "test:c1")]
    assert kinds[0] == "request_begin" and "request_end" in kinds
    await h.core.shutdown()


async def test_stop_produces_exactly_one_terminal_message(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("Partial answer that goes on and on", hold=hold, hold_after=14))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("tell me a story")
    await h.wait_for(lambda: any("Partial" in t for t in h.platform.visible("c1")))
    await h.say("/stop")
    await h.settle()
    hold.set()
    assert h.platform.visible("c1") == ["Partial answer\n\n⏹ Stopped."]
    assert h.platform.plain("c1") == []
    _, history = await h.core.history("test:c1")
    # the stop notice is kept in history (for a reload), not shown a second time
    assert [(m.role, m.source.kind, m.content) for m in history] == [
        ("user", "user_input", "tell me a story"), ("assistant", "partial", "Partial answer"),
        ("assistant", "notice", "⏹ Stopped.")]
    await h.core.shutdown()


async def test_stop_with_failing_sink_sends_one_plain_notice(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("Partial answer that goes on", hold=hold, hold_after=14))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.finish_fail = True
    await h.say("tell me a story")
    await h.wait_for(lambda: any("Partial" in t for t in h.platform.visible("c1")))
    await h.say("/stop")
    await h.settle()
    hold.set()
    assert h.platform.plain("c1") == ["Partial answer\n\n⏹ Stopped."]
    await h.core.shutdown()


async def test_stop_when_idle_says_nothing_is_running(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.say("/stop")
    await h.settle()
    assert h.platform.plain("c1") == ["Nothing is running."]
    await h.core.shutdown()


async def test_shutdown_mid_reply_produces_one_terminal_message_and_reclaims_every_task(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("Streaming along nicely", hold=hold, hold_after=9))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("go")
    await h.say("queued behind")
    await h.wait_for(lambda: any("Streaming" in t for t in h.platform.visible("c1")))
    stragglers = await h.core.shutdown()
    assert stragglers == []
    assert len(h.core.supervisor) == 0
    live = [m for m in h.platform.messages.values() if m.kind == "live"]
    assert [m.text for m in live] == [f"Streaming\n\n{SHUT_DOWN}"]
    # the queued message stays stored, unanswered: the next start answers it, once
    assert h.platform.plain("c1") == []
    fake_openai.script(Text("Answered after the restart"))
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    assert h.platform.visible("c1") == [f"Streaming\n\n{SHUT_DOWN}", "Answered after the restart"]
    _, history = await h2.core.history("test:c1")
    assert ("notice", SHUT_DOWN) in [(m.source.kind, m.content) for m in history]
    assert fake_openai.requests[-1]["messages"][-1]["content"].startswith("queued behind")
    await h2.core.shutdown()


async def test_auth_failure_is_one_presentable_reply_without_retries_or_secrets(tmp_path, fake_openai):
    fake_openai.script(HttpError.auth())
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 1
    [shown] = h.platform.visible("c1")
    assert "API key" in shown
    assert API_KEY not in shown and "401" not in shown
    await h.core.shutdown()


async def test_hanging_model_times_out_through_the_ladder_then_fails(tmp_path, fake_openai):
    fake_openai.script(Hang(30), Hang(30), Hang(30))
    h = await make_harness(tmp_path, fake_openai, request_timeout=0.3)
    await h.say("hi")
    await h.settle(timeout=15)
    assert len(fake_openai.requests) == 3  # first try + the two retries of the test ladder
    [shown] = h.platform.visible("c1")
    assert "did not answer in time" in shown
    await h.core.shutdown()


async def test_malformed_chunk_is_retried_and_the_answer_shown_once(tmp_path, fake_openai):
    fake_openai.script(Malformed(after_text="Garbled start "), Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 2
    assert h.platform.visible("c1") == [ANSWER]
    assert h.db_path is not None
    traces = db.traces(h.db_path, "test:c1")
    assert [t.payload["status"] for t in traces if t.kind == "request_end"] == ["malformed", "completed"]
    await h.core.shutdown()


async def test_server_error_then_success_shows_the_answer_once(tmp_path, fake_openai):
    fake_openai.script(HttpError.server(503), Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert h.platform.visible("c1") == [ANSWER]
    assert h.platform.plain("c1") == []
    await h.core.shutdown()


async def test_slow_sink_sees_the_latest_snapshot_not_a_backlog(tmp_path, fake_openai):
    text = "word " * 200
    fake_openai.script(Text(text, chunk_size=2, delay=0.001))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.update_delay = 0.05
    await h.say("long please")
    await h.settle()
    sink = h.channel.sinks[0]
    assert h.platform.visible("c1") == [text]
    assert len(sink.updates) < len(text) // 2 / 4  # far fewer than the snapshots produced
    assert sink.updates == sorted(sink.updates)
    await h.core.shutdown()


async def test_an_unexpected_provider_error_still_ends_the_turn_with_one_notice(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)

    async def broken_stream(request):
        raise RuntimeError("provider bug with sk-internal-detail")
        yield  # pragma: no cover

    h.core.provider.stream = broken_stream  # type: ignore[method-assign]
    await h.say("hi")
    await h.settle()
    [shown] = h.platform.visible("c1")
    assert "could not be started" in shown and "sk-internal" not in shown
    assert h.platform.plain("c1") == []
    await h.core.shutdown()


async def test_platform_pauses_on_the_final_update_are_waited_out_beyond_the_delivery_wait(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai, delivery_wait_timeout=0.2)
    h.channel.finish_pauses, h.channel.pause_seconds = 3, 0.15  # 0.45 s of pauses, more than the wait
    await h.say("hi")
    await h.settle()
    assert h.platform.visible("c1") == [ANSWER]
    assert h.platform.plain("c1") == []
    assert h.channel.sinks[0].finish_calls == 1
    await h.core.shutdown()


async def test_a_provider_that_stops_producing_events_times_out_through_the_ladder(tmp_path, fake_openai):
    import asyncio as _asyncio

    from core.llm.provider import TextDelta

    h = await make_harness(tmp_path, fake_openai, request_timeout=0.2)
    calls = []

    async def silent_stream(request):
        calls.append(request)
        yield TextDelta("thinking")
        await _asyncio.sleep(3600)  # a local model wedged mid-answer

    h.core.provider.stream = silent_stream  # type: ignore[method-assign]
    await h.say("hi")
    await h.settle(timeout=15)
    assert len(calls) == 3  # first try and the test ladder's two retries
    [shown] = h.platform.visible("c1")
    assert "did not answer in time" in shown
    await h.core.shutdown()
