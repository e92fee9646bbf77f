"""A slow store and a channel that stops waiting for it (Slack answers its platform within 3 s): a command whose
event was recorded is still carried out, and a redelivery that comes while the first delivery is being stored
waits for that one instead of being told busy."""

from __future__ import annotations

import asyncio

import pytest

from core.router import AdmissionError, SubmitResult
from tests.fakes.openai_server import Function, Text, last_user_text
from tests.fakes.slack.harness import slack_harness
from tests.support.harness import Harness, make_harness
from tests.support.store import FlakyStore, SlowMarkAnswers, given_up_while_held


def echo(body):
    return Text("echo: " + last_user_text(body).split("\n\n")[0])


async def counting(tmp_path, fake_openai, store) -> tuple[Harness, asyncio.Event]:
    """A chat whose first reply is being written, held until the event is set; later messages are echoed."""
    hold = asyncio.Event()
    fake_openai.script(Text("counting one two three", hold=hold, hold_after=9))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, store=store)
    await h.say("count to a thousand")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)
    return h, hold


async def test_a_stop_whose_sender_stopped_waiting_still_stops_the_reply(tmp_path, fake_openai):
    store = SlowMarkAnswers(tmp_path / "chat.db")
    h, hold = await counting(tmp_path, fake_openai, store)
    await given_up_while_held(h, store, "/stop", "e2")
    assert await h.say("/stop", event_id="e2") is SubmitResult.DUPLICATE  # the platform's redelivery
    await h.wait_for(lambda: any(s.endswith("⏹ Stopped.") for s in h.platform.visible("c1")))
    hold.set()
    await h.settle()
    [stopped] = h.platform.visible("c1")
    assert stopped.endswith("⏹ Stopped.")
    await h.core.shutdown()


async def test_a_new_whose_sender_stopped_waiting_still_starts_a_new_conversation(tmp_path, fake_openai):
    store = SlowMarkAnswers(tmp_path / "chat.db")
    h, _ = await counting(tmp_path, fake_openai, store)
    await h.say("waiting")
    await given_up_while_held(h, store, "/new", "e3")
    assert await h.say("/new", event_id="e3") is SubmitResult.DUPLICATE  # the platform's redelivery
    await h.wait_for(lambda: len(h.platform.visible("c1")) == 2)
    await h.say("after new")
    await h.settle()
    shown = h.platform.visible("c1")
    assert shown[0].endswith("⏹ Stopped.")
    assert shown[1:] == ["🆕 Started a new conversation. Earlier messages stay in the history but are no longer "
                         "sent to the model. The message you sent before /new was not answered.",
                         "echo: after new"]
    assert [m["content"].split("\n\n")[0] for m in fake_openai.requests[-1]["messages"] if m["role"] == "user"] \
        == ["after new"]
    await h.core.shutdown()


async def test_a_redelivery_while_the_first_is_stored_into_a_full_queue_is_not_told_busy(tmp_path, fake_openai):
    """queue_capacity=1: the first delivery's place, its write still under way, fills the queue."""
    store = FlakyStore(tmp_path / "chat.db")
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, store=store, queue_capacity=1)
    await h.say("first")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)  # its turn runs, the queue is empty
    store.admission_gate = asyncio.Event()
    first = asyncio.create_task(h.say("second", event_id="e2"))
    await h.wait_for(lambda: store.at_gate == 1)
    again = asyncio.create_task(h.say("second", event_id="e2"))  # the platform sends it again meanwhile
    await asyncio.wait([again], timeout=0.2)
    assert not again.done()  # it waits for the first delivery's outcome
    store.admission_gate.set()
    assert await first is SubmitResult.QUEUED
    assert await again is SubmitResult.DUPLICATE
    hold.set()
    await h.settle()
    assert h.platform.visible("c1") == ["slow", "echo: second"]  # no busy notice, one answer
    await h.core.shutdown()


async def test_a_redelivery_while_the_first_fails_to_be_stored_is_taken_as_new(tmp_path, fake_openai):
    store = FlakyStore(tmp_path / "chat.db")
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai, store=store)
    store.admission_gate = asyncio.Event()
    store.fail_admissions = 1
    first = asyncio.create_task(h.say("hello", event_id="e1"))
    await h.wait_for(lambda: store.at_gate == 1)
    again = asyncio.create_task(h.say("hello", event_id="e1"))
    await asyncio.wait([again], timeout=0.2)
    store.admission_gate.set()
    with pytest.raises(AdmissionError):
        await first
    assert await again is SubmitResult.QUEUED
    await h.settle()
    assert h.platform.visible("c1") == ["echo: hello"]
    await h.core.shutdown()


@pytest.mark.parametrize("mode", ["socket", "http"])
async def test_slack_stop_acknowledged_only_on_redelivery_is_carried_out(tmp_path, fake_openai, fake_slack, mode):
    hold = asyncio.Event()
    fake_openai.script(Text("Counting " + "one two three " * 50, hold=hold, hold_after=30))
    store = SlowMarkAnswers(tmp_path / "chat.db")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"store": store}, submit_timeout=0.2)
    try:
        await t.deliver(fake_slack.user_message("count to a thousand"))
        await t.wait_for(lambda: fake_slack.visible("D0ALICE"))
        body = fake_slack.user_message("stop")
        store.gate = asyncio.Event()
        first = await t.deliver(body, ack_timeout=1.0)
        assert store.held == 1
        assert not first.acked  # the handler stopped waiting: Slack will send the event again
        store.gate.set()
        store.gate = None
        again = await t.redeliver(first, body)
        assert again.acked  # a duplicate now
        await t.wait_for(lambda: any(s.endswith("⏹ Stopped.") for s in fake_slack.visible("D0ALICE")))
        hold.set()
        await t.settle()
        [reply] = fake_slack.visible("D0ALICE")
        assert reply.endswith("⏹ Stopped.")
    finally:
        hold.set()
        await t.close()
