"""Admission: an accepted message is stored before ``submit`` returns, waits in arrival order, survives a
restart (resumed, or answered with a notice when too old), and only an accepted message counts as seen."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.router import AdmissionError, SubmitResult
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import Function, Text, last_user_text
from tests.support import db
from tests.support.channel import TestChannel
from tests.support.harness import Harness, make_harness
from tests.support.store import FlakyStore, SlowAnswerStore, given_up_while_held


def echo(body):
    return Text("echo: " + last_user_text(body).split("\n\n")[0])


async def test_a_queued_message_is_stored_before_submit_returns(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)  # its turn began: its message is served
    assert await h.say("second", event_id="e2") is SubmitResult.QUEUED
    [waiting] = await h.store.waiting_inbound()
    assert '"content":"second"' in waiting.payload
    hold.set()
    await h.settle()
    assert await h.store.waiting_inbound() == []  # the turn's first step served it
    await h.core.shutdown()


async def test_messages_stored_before_a_crash_are_answered_after_it_in_order(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    channel = TestChannel()
    for i, chat in enumerate(["a", "b", "a", "a"]):
        envelope = channel.envelope(f"m{i}", chat_id=chat, event_id=f"e{i}")
        await store.admit_inbound("test", f"e{i}", envelope.model_dump_json(), ttl_seconds=3600)
    await store.close()  # the process that admitted them is gone
    h = await make_harness(tmp_path, fake_openai)
    await h.settle()
    assert h.platform.visible("a") == ["echo: m0", "echo: m2", "echo: m3"]
    assert h.platform.visible("b") == ["echo: m1"]
    assert await h.say("m0", chat_id="a", event_id="e0") is SubmitResult.DUPLICATE  # redelivered: still seen
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)  # nothing is answered twice
    await h2.settle()
    assert len(fake_openai.requests) == 4
    await h2.core.shutdown()


async def test_a_message_too_old_after_a_restart_gets_a_notice_instead(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    channel = TestChannel()
    old = channel.envelope("stale question", received_at=time.time() - 3 * 3600)
    fresh = channel.envelope("fresh question")
    for envelope in (old, fresh):
        await store.admit_inbound("test", None, envelope.model_dump_json(), ttl_seconds=3600)
    await store.close()
    h = await make_harness(tmp_path, fake_openai, resume_max_age=600.0)
    await h.settle()
    [notice, answer] = h.platform.visible("c1")
    assert "3 hours old" in notice and "send it again" in notice
    assert answer == "echo: fresh question"
    assert len(fake_openai.requests) == 1
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    assert len(h.platform.visible("c1")) == 2  # neither is repeated
    await h2.core.shutdown()


async def test_a_too_old_message_two_processes_read_as_waiting_gets_one_notice(tmp_path, fake_openai):
    """Each holder that reads it as waiting (the first one's lease ran out meanwhile) decides it is too old;
    only the one that finishes it tells the chat."""
    h = await make_harness(tmp_path, fake_openai)
    old = h.channel.envelope("stale question", received_at=time.time() - 3 * 3600)
    seq = await h.store.admit_inbound("test", None, old.model_dump_json(), ttl_seconds=3600, key=old.key())
    assert seq is not None
    for _ in range(2):
        await h.core.too_old(old, seq, 3 * 3600)
    [notice] = h.platform.visible("c1")
    assert "3 hours old" in notice
    assert [m.content for m in (await h.store.history(old.key()))[1]] == [notice]


async def test_busy_marks_nothing_so_the_same_event_is_accepted_later(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, queue_capacity=1)
    await h.say("one", event_id="e1")
    await h.wait_for(lambda: h.core.sessions.is_running("test:c1"))
    assert await h.say("two", event_id="e2") is SubmitResult.QUEUED
    assert await h.say("three", event_id="e3") is SubmitResult.BUSY
    # a redelivery of the queued message while the queue is full is a duplicate, not a second busy notice
    assert await h.say("two", event_id="e2") is SubmitResult.DUPLICATE
    await h.wait_for(lambda: len(h.platform.plain("c1")) == 1)
    hold.set()
    await h.settle()
    assert await h.say("three", event_id="e3") is SubmitResult.QUEUED
    await h.settle()
    [busy] = h.platform.plain("c1")
    assert "not queued" in busy
    assert h.platform.visible("c1") == ["slow", busy, "echo: two", "echo: three"]
    await h.core.shutdown()


async def test_redeliveries_during_a_long_reply_take_no_place_in_its_queue(tmp_path, fake_openai):
    """A platform redelivering a message already queued (Slack retries, a webhook resent) while a long reply
    is written is told it is a duplicate, and the user's next message still finds room in the queue."""
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, queue_capacity=2)
    await h.say("one", event_id="e1")
    await h.wait_for(lambda: h.core.sessions.is_running("test:c1"))
    assert await h.say("two", event_id="e2") is SubmitResult.QUEUED
    for _ in range(3):
        assert await h.say("two", event_id="e2") is SubmitResult.DUPLICATE
    assert await h.say("three", event_id="e3") is SubmitResult.QUEUED
    hold.set()
    await h.settle()
    assert h.platform.visible("c1") == ["slow", "echo: two", "echo: three"]
    await h.core.shutdown()


async def test_a_message_that_could_not_be_stored_is_refused_and_may_be_sent_again(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = FlakyStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store)
    store.fail_admissions = 1
    with pytest.raises(AdmissionError):
        await h.say("hello", event_id="e1")
    assert await h.say("hello", event_id="e1") is SubmitResult.QUEUED
    await h.settle()
    assert h.platform.visible("c1") == ["echo: hello"]
    await h.core.shutdown()


async def test_a_message_its_turn_could_not_save_may_be_sent_again(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = FlakyStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store)
    store.fail_appends = 1
    assert await h.say("hello", event_id="e1") is SubmitResult.QUEUED
    await h.settle()
    [failed] = h.platform.visible("c1")
    assert "could not be saved" in failed
    assert await h.say("hello", event_id="e1") is SubmitResult.QUEUED  # the user does what they were told
    await h.settle()
    assert h.platform.visible("c1") == [failed, "echo: hello"]
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    assert len(fake_openai.requests) == 1  # and it is not resumed after a restart either
    await h2.core.shutdown()


async def test_messages_keep_their_arrival_order_when_storing_them_is_slow(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = FlakyStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store, queue_capacity=1)
    store.admission_gate = asyncio.Event()
    first = asyncio.create_task(h.say("first"))
    await asyncio.sleep(0.02)  # the worker waits for the first message to be stored
    second = asyncio.create_task(h.say("second"))
    await asyncio.sleep(0.02)
    # both places are taken before either message is stored: a third is busy at once
    assert await h.say("third") is SubmitResult.BUSY
    store.admission_gate.set()
    assert await first is SubmitResult.QUEUED and await second is SubmitResult.QUEUED
    await h.settle()
    assert [t for t in h.platform.visible("c1") if t.startswith("echo")] == ["echo: first", "echo: second"]
    await h.core.shutdown()


async def test_shutdown_while_a_message_is_being_stored_loses_nothing(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    store = FlakyStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store)
    store.admission_gate = asyncio.Event()
    submitting = asyncio.create_task(h.say("in flight"))
    await asyncio.sleep(0.05)
    shutting_down = asyncio.create_task(h.core.shutdown())
    await asyncio.sleep(0.05)
    store.admission_gate.set()
    assert await submitting is SubmitResult.QUEUED  # accepted: stored before the store closed
    await shutting_down
    assert h.platform.visible("c1") == []
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    assert h.platform.visible("c1") == ["echo: in flight"]
    await h2.core.shutdown()


async def test_a_message_stored_after_its_sender_stopped_waiting_is_answered_once(tmp_path, fake_openai):
    # A channel that must answer its platform in time (Slack: 3 s) stops waiting for a slow store; the message
    # is stored all the same, and the platform's redelivery is then a duplicate: unless the message is also
    # queued, nobody answers it until the next start.
    fake_openai.default = Function(echo)
    store = SlowAnswerStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store)
    await given_up_while_held(h, store, "are you there?", "e1")
    await h.wait_for(lambda: "echo: are you there?" in h.platform.visible("c1"))
    assert await h.say("are you there?", event_id="e1") is SubmitResult.DUPLICATE  # the redelivery
    await h.settle()
    assert h.platform.visible("c1") == ["echo: are you there?"]
    assert await store.waiting_inbound() == []
    await h.core.shutdown()


async def remembering_banana(tmp_path, fake_openai) -> tuple[Harness, asyncio.Event]:
    """A chat whose first reply is being written, held until the event is set; later messages are echoed."""
    hold = asyncio.Event()
    fake_openai.script(Text("remembering banana slowly", hold=hold, hold_after=11))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai)
    await h.say("remember banana")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)
    return h, hold


async def test_new_ends_the_conversation_for_the_messages_waiting_before_it(tmp_path, fake_openai):
    h, hold = await remembering_banana(tmp_path, fake_openai)
    await h.say("waiting 1")
    await h.say("waiting 2")
    assert await h.say("/new") is SubmitResult.COMMAND
    await h.say("after new")
    hold.set()
    await h.settle()
    shown = h.platform.visible("c1")
    assert shown[0].endswith("⏹ Stopped.")
    assert "new conversation" in shown[1] and "2 messages you sent before /new were not answered" in shown[1]
    assert shown[2:] == ["echo: after new"]
    # the fresh context holds only the message sent after /new
    assert [m["content"].split("\n\n")[0] for m in fake_openai.requests[-1]["messages"] if m["role"] == "user"] \
        == ["after new"]
    await h.core.shutdown()
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    assert len(fake_openai.requests) == 2  # the dropped messages are not resumed after a restart
    await h2.core.shutdown()


async def test_a_new_waiting_for_its_stopped_turn_at_a_shutdown_is_still_carried_out(tmp_path, fake_openai):
    """/new stops the running reply and waits for it to end; a shutdown that begins meanwhile let the worker
    end after that reply, so the /new was never carried out: no answer to it, the old context kept, the
    messages it ended answered after the restart."""
    h, _ = await remembering_banana(tmp_path, fake_openai)
    await h.say("waiting")
    assert await h.say("/new") is SubmitResult.COMMAND  # the reply is stopping, not stopped yet
    assert await h.core.shutdown() == []
    shown = h.platform.visible("c1")
    assert shown[0].endswith("⏹ Stopped.")  # stopped by /new, not by the shutdown
    assert shown[1:] == ["🆕 Started a new conversation. Earlier messages stay in the history but are no longer "
                         "sent to the model. The message you sent before /new was not answered."]
    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.say("after new")
    await h2.settle()
    assert h2.platform.visible("c1")[2:] == ["echo: after new"]  # "waiting" is not answered after the restart
    assert [m["content"].split("\n\n")[0] for m in fake_openai.requests[-1]["messages"] if m["role"] == "user"] \
        == ["after new"]
    await h2.core.shutdown()


async def test_a_failed_new_leaves_the_waiting_messages_to_be_answered(tmp_path, fake_openai):
    class NoNewContext(SqliteStore):
        async def new_context(self, key, **kw):  # type: ignore[override]
            raise StoreError("sqlite store: new_context failed (OperationalError: disk I/O error)")

    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, store=NoNewContext(tmp_path / "chat.db"))
    await h.say("first")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)  # the first turn's reply is being written
    await h.say("waiting")
    await h.say("/new")
    hold.set()
    await h.settle()
    assert h.platform.visible("c1")[-1] == "echo: waiting"
    assert h.db_path is None
    await h.core.shutdown()


async def test_every_message_is_in_the_database_with_its_mark_until_served(tmp_path, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("a", event_id="e1")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)  # its turn began
    await h.say("b", event_id="e2")
    assert h.db_path is not None
    rows = db.rows(h.db_path, "SELECT event_id, envelope IS NOT NULL FROM inbound ORDER BY seq")
    assert rows == [("e1", 0), ("e2", 1)]  # e1 was served by its turn's first step, e2 waits
    hold.set()
    await h.settle()
    await h.core.shutdown()
