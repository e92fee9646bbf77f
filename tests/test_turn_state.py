"""Seed 001 §15: stale work, overflow recovery, inbound fidelity, titles, history deltas."""

from __future__ import annotations

import asyncio

from core.envelope import ReplyTo
from core.events import SessionTitleChanged, TurnCommitted
from core.sqlite_store import SqliteStore
from tests.fakes.openai_server import HttpError, Text
from tests.support.harness import make_harness

SYSTEM = "You are a helpful assistant."


class BumpBeforeCommit(SqliteStore):
    """Moves the session's generation just before the first turn commits (a racing /stop or /new)."""

    bumped = False

    async def commit_turn(self, key, messages, **kw):  # type: ignore[override]
        if not self.bumped and messages:
            self.bumped = True
            await self.bump_generation(key)
        return await super().commit_turn(key, messages, **kw)


async def test_stale_generation_never_commits(tmp_path, fake_openai):
    fake_openai.script(Text("an answer that lost the race"))
    h = await make_harness(tmp_path, fake_openai, store=BumpBeforeCommit(tmp_path / "db"))
    await h.say("hi")
    await h.settle()
    _, history = await h.core.history("test:c1")
    # the answer is dropped; the stop notice the chat shows is kept for history clients
    assert [(m.source.kind, m.content) for m in history] == [("user_input", "hi"), ("notice", "⏹ Stopped.")]
    # the user's message still reaches history clients as a revision
    [commit] = h.commits("test:c1")
    assert [m.content for m in commit.messages] == ["hi", "⏹ Stopped."]
    [shown] = h.platform.visible("c1")
    assert "Stopped" in shown
    await h.core.shutdown()


async def test_overflow_recovery_attaches_prompt_and_runtime_context_once(tmp_path, fake_openai):
    fake_openai.script(Text("first answer"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first question")
    await h.settle()
    fake_openai.script(HttpError.context_overflow(), Text("second answer"))
    await h.say("second question")
    await h.settle()
    retried = fake_openai.requests[-1]["messages"]
    assert [m["role"] for m in retried].count("system") == 1
    assert retried[0] == {"role": "system", "content": SYSTEM}
    joined = "\n".join(m["content"] for m in retried)
    assert joined.count("[Runtime context]") == 1
    assert retried[-1]["content"].startswith("second question\n\n[Runtime context]\n")
    assert h.platform.visible("c1")[-1] == "second answer"
    await h.core.shutdown()


async def test_overflow_recovery_happens_at_most_once(tmp_path, fake_openai):
    fake_openai.script(HttpError.context_overflow(), HttpError.context_overflow(), Text("never"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 2
    assert "no longer fits" in h.platform.visible("c1")[0]
    await h.core.shutdown()


async def test_inbound_fidelity_sender_received_at_and_reply_to_are_persisted(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.say("quoting you", sender_id="alice-42", received_at=1_700_000_000.25,
                reply_to=ReplyTo(message_id="m-17", text="earlier"))
    await h.settle()
    _, history = await h.core.history("test:c1")
    user = history[0]
    assert user.source.kind == "user_input"
    assert user.source.from_channel == "test"
    assert user.source.from_user_id == "alice-42"
    assert user.source.reply_to == "m-17"
    assert user.received_at == 1_700_000_000.25
    assert "alice-42" not in str(user.history_view())  # internal ids stay out of the client view
    await h.core.shutdown()


async def test_runtime_context_is_a_separate_block_on_the_last_user_message(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hello", sender_name="Alice")
    await h.settle()
    msgs = fake_openai.requests[0]["messages"]
    assert msgs[0]["role"] == "system"
    text = msgs[-1]["content"]
    first, block = text.split("\n\n", 1)
    assert first == "hello"
    assert block.startswith("[Runtime context]\nCurrent time: ")
    assert "Channel: test" in block and "Sender: Alice" in block
    await h.core.shutdown()


async def test_first_exchange_gets_a_title_in_the_background(tmp_path, fake_openai):
    fake_openai.script(Text("Paris is the capital."), Text('"Capital of France."'))
    h = await make_harness(tmp_path, fake_openai, titles=True)
    await h.say("capital of France?")
    await h.settle()
    await h.wait_for(lambda: any(isinstance(e, SessionTitleChanged) for e in h.events))
    record = await h.store.get_session("test:c1")
    assert record.title == "Capital of France"
    await h.core.shutdown()


async def test_user_rename_beats_a_late_title(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("Paris."), Text("Generated title", hold=hold, hold_after=0))
    h = await make_harness(tmp_path, fake_openai, titles=True)
    await h.say("capital of France?")
    await h.settle()
    await h.wait_for(lambda: len(fake_openai.requests) == 2)  # the title request is in flight
    await h.core.rename("test:c1", "My trip")
    hold.set()
    await asyncio.sleep(0.2)
    record = await h.store.get_session("test:c1")
    assert record.title == "My trip"
    assert [e.title for e in h.events if isinstance(e, SessionTitleChanged)] == ["My trip"]
    await h.core.shutdown()


async def test_title_job_does_not_hold_up_the_next_message(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("one"), Text("Title", hold=hold, hold_after=0), Text("two"))
    h = await make_harness(tmp_path, fake_openai, titles=True)
    await h.say("first")
    await h.settle()
    await h.wait_for(lambda: len(fake_openai.requests) == 2)
    await h.say("second")
    await h.wait_for(lambda: h.platform.visible("c1") == ["one", "two"])
    hold.set()
    assert await h.core.shutdown() == []


async def test_history_deltas_are_contiguous_and_cover_every_message_once(tmp_path, fake_openai):
    fake_openai.default = Text("answer")
    h = await make_harness(tmp_path, fake_openai)
    for i in range(3):
        await h.say(f"q{i}")
        await h.settle()
    commits: list[TurnCommitted] = h.commits("test:c1")
    assert [c.history_revision for c in commits] == [1, 2, 3]
    delta_ids = [m.id for c in commits for m in c.messages]
    rev, history = await h.core.history("test:c1")
    assert rev == 3
    assert delta_ids == [m.id for m in history]  # every message exactly once, the user's included
    assert [m.role for m in commits[0].messages] == ["user", "assistant"]
    await h.core.shutdown()


async def test_every_supervised_task_ends_within_the_shutdown_bound(tmp_path, fake_openai):
    import time

    never = asyncio.Event()
    fake_openai.script(Text("answer"), Text("A title", hold=never, hold_after=0), Text("x", hold=never))
    h = await make_harness(tmp_path, fake_openai, titles=True, shutdown_timeout=2.0, delivery_wait_timeout=60)
    await h.say("first", chat_id="a")
    await h.settle()
    await h.wait_for(lambda: len(fake_openai.requests) == 2)  # the title job hangs on the model
    h.channel.hang_finish = True
    await h.say("second", chat_id="b")  # its model hangs, and its sink would hang too
    await h.wait_for(lambda: len(fake_openai.requests) == 3)
    assert len(h.core.supervisor) >= 4  # two session workers, the title job, a model call, sinks
    started = time.monotonic()
    stragglers = await h.core.shutdown()
    assert time.monotonic() - started < 2.0 + 1.5  # the shutdown_timeout once, not twice or the 60 s
    assert stragglers == []
    assert len(h.core.supervisor) == 0


async def test_output_limits_from_the_config_reach_the_model(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai, max_output_tokens=123, temperature=0.3)
    await h.say("hi")
    await h.settle()
    body = fake_openai.requests[0]
    assert body["max_tokens"] == 123 and body["temperature"] == 0.3
    assert body["stream"] is True
    await h.core.shutdown()
