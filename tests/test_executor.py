"""ConversationExecutor, where its flow branches on what the store says (the full flow of a turn is what every
channel test drives): a message another process served first gets no second answer."""

from __future__ import annotations

from core.cancel_signal import CancelSignal
from core.context_cache import ContextCache
from tests.fakes.openai_server import FakeOpenAI, Text
from tests.support.harness import make_harness
from tests.support.store import user


async def test_a_message_served_by_another_process_first_is_not_answered_again(tmp_path, fake_openai: FakeOpenAI):
    """Two processes read the message as waiting (the old holder's lease ran out as its first write was on
    its way); the other one's write landed first. This one shows nothing, asks the model nothing, and leaves
    the message's dedupe mark in place."""
    fake_openai.script(Text("a second answer"))
    h = await make_harness(tmp_path, fake_openai)
    envelope = h.channel.envelope("hello", event_id="e-1")
    seq = await h.store.admit_inbound(envelope.channel, envelope.event_id, envelope.model_dump_json(),
                                      ttl_seconds=100, key=envelope.key())
    assert seq is not None
    await h.store.append_message(envelope.key(), user("hello"), begin_turn=("elsewhere", "{}"), serves=seq)

    await h.core.executor.execute(envelope, CancelSignal(), ContextCache(50), inbound=seq)

    assert h.platform.visible("c1") == [] and h.platform.plain("c1") == []
    assert fake_openai.requests == []
    assert [m.content for m in (await h.store.history(envelope.key()))[1]] == ["hello"]
    assert await h.store.event_seen(envelope.channel, "e-1")
