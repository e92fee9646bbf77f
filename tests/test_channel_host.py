"""The host a channel is handed: durable dedupe and state on its own keys, and only its own sessions."""

from __future__ import annotations

import pytest

from core.router import SubmitResult
from tests.fakes.openai_server import Text
from tests.support.harness import make_harness


async def test_mark_seen_is_durable_and_apart_from_the_envelopes_event_ids(tmp_path, fake_openai):
    fake_openai.script(Text("answered"))
    h = await make_harness(tmp_path, fake_openai)
    host = h.core.host_for("test")
    assert await host.mark_seen("evt-1") is True
    assert await host.mark_seen("evt-1") is False
    # a channel key is not an envelope event id: the message with that id is still answered
    assert await h.say("hello", event_id="evt-1") is SubmitResult.QUEUED
    await h.settle()
    assert h.platform.visible("c1") == ["answered"]
    await host.set_state("cursor", "42")
    await h.core.shutdown()

    again = await make_harness(tmp_path, fake_openai)
    host = again.core.host_for("test")
    assert await host.mark_seen("evt-1") is False  # across a restart
    assert await host.mark_seen("evt-2") is True
    assert await host.get_state("cursor") == "42"
    assert await again.core.host_for("other").get_state("cursor") is None  # state is per channel
    await again.core.shutdown()


async def test_a_channel_acts_only_on_its_own_messages_and_sessions(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    host = h.core.host_for("web")
    with pytest.raises(ValueError):
        await host.submit(h.channel.envelope("hi"))  # an envelope of channel "test"
    with pytest.raises(ValueError):
        host.decide("test:c1", "call_1", "allow")
    with pytest.raises(ValueError):
        await host.history("test:c1")
    await host.create_session("web:abc")
    await h.core.host_for("test").submit(h.channel.envelope("hi"))
    await h.settle()
    assert [r.key for r in await host.list_sessions()] == ["web:abc"]
    await h.core.shutdown()
