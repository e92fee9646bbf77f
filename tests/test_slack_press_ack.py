"""Slack button presses are acknowledged at once: Slack waits 3 seconds for the answer (the HTTP 200, the Socket
Mode ack), and with ``process_before_response`` that answer leaves only when the listener returns. So the press's
dedupe mark and decision run after it, and a slow disk cannot make Slack show its error for a press that was
carried out (the user presses again and hears "no longer pending"). A press that could not be taken tells the
presser so; one that arrives as the bridge stops is not acknowledged. The real channel (slack-bolt, slack_sdk)
against the fake Slack."""

from __future__ import annotations

import asyncio
import logging

import pytest

from channels.slack.channel import PRESS_NOT_TAKEN
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.slack import FakeSlack
from tests.fakes.slack.harness import Delivery, SlackHarness, slack_harness

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_S1"])
MODES = pytest.mark.parametrize("mode", ["socket", "http"])


class MarkStore(SqliteStore):
    """The channel's own dedupe marks (a press's) are held at ``gate`` while it is set (a slow disk), or fail
    ``failures`` times."""

    gate: asyncio.Event | None = None
    held = 0
    failures = 0

    async def mark_event_processed(self, channel, event_id, *, ttl_seconds):  # type: ignore[override]
        if channel.endswith(":channel-keys"):
            if self.failures:
                self.failures -= 1
                raise StoreError("disk I/O error")
            if self.gate is not None:
                self.held += 1
                await self.gate.wait()
        return await super().mark_event_processed(channel, event_id, ttl_seconds=ttl_seconds)


def approval_messages(slack: FakeSlack, channel: str) -> list:
    return [m for m in slack.messages(channel) if any(b.get("type") == "actions" for b in m.blocks)]


async def asked(t: SlackHarness, slack: FakeSlack):  # type: ignore[no-untyped-def]
    await t.deliver(slack.user_message("how many apples do I have?"))
    await t.wait_for(lambda: approval_messages(slack, "D0ALICE"))
    [msg] = approval_messages(slack, "D0ALICE")
    return msg


async def press(t: SlackHarness, payload: dict, *, within: float = 3.0) -> Delivery:
    """Slack's wait for a press's answer: acknowledged within ``within`` seconds, or not."""
    try:
        async with asyncio.timeout(within):
            return await t.press(payload)
    except TimeoutError:
        return Delivery(False)


@MODES
async def test_a_press_is_acknowledged_while_the_store_is_slow_and_decided_once(tmp_path, fake_openai, fake_slack,
                                                                               mode):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    store = MarkStore(tmp_path / "chat.db")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"tools": registry(tool), "store": store})
    try:
        msg = await asked(t, fake_slack)
        store.gate = asyncio.Event()  # the disk is slow: the press's mark waits until the test lets it go
        allow = fake_slack.press(msg, "Allow")
        assert (await press(t, allow)).acked  # Slack heard back in time, though nothing is stored yet
        await t.wait_for(lambda: store.held == 1)
        assert tool.calls == [] and approval_messages(fake_slack, "D0ALICE") == [msg]
        store.gate.set()
        store.gate = None
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert "Allowed by <@U0ALICE>" in fake_slack.message("D0ALICE", msg.ts).shown
        assert fake_slack.visible("D0ALICE")[-1] == "You have 42 apples."
        assert (await press(t, allow)).acked  # the same press delivered again: ignored
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert fake_slack.ephemerals == []
    finally:
        if store.gate is not None:
            store.gate.set()
        await t.close()


async def test_a_press_the_store_refused_is_logged_and_the_presser_asked_to_press_again(tmp_path, fake_openai,
                                                                                      fake_slack, caplog):
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    store = MarkStore(tmp_path / "chat.db")
    t = await slack_harness(tmp_path, fake_openai, fake_slack, "socket",
                            core={"tools": registry(tool), "store": store})
    try:
        msg = await asked(t, fake_slack)
        store.failures = 1
        with caplog.at_level(logging.WARNING, logger="channels.slack.channel"):
            assert (await press(t, fake_slack.press(msg, "Allow"))).acked
            await t.wait_for(lambda: fake_slack.ephemerals)
        assert [(e.user, e.text) for e in fake_slack.ephemerals] == [("U0ALICE", PRESS_NOT_TAKEN)]
        assert any("could not be taken" in r.getMessage() and "disk I/O error" in r.getMessage()
                   for r in caplog.records)
        assert tool.calls == [] and approval_messages(fake_slack, "D0ALICE") == [msg]  # still pending
        assert (await press(t, fake_slack.press(msg, "Allow"))).acked  # pressed again: taken
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert "Allowed by <@U0ALICE>" in fake_slack.message("D0ALICE", msg.ts).shown
    finally:
        await t.close()


@MODES
async def test_a_press_as_the_bridge_stops_is_not_acknowledged(tmp_path, fake_openai, fake_slack, mode, caplog):
    # nothing can carry it out any more: Slack shows its error (HTTP) or sends it again (Socket Mode), rather than
    # hearing that it was taken
    tool = RecordingTool("lookup", result="42 apples")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode, core={"tools": registry(tool)})
    try:
        msg = await asked(t, fake_slack)
        await t.core.supervisor.shutdown(1.0)  # shutdown began: no new task starts
        with caplog.at_level(logging.WARNING, logger="channels.slack.channel"):
            d = await t.deliver(fake_slack.press(msg, "Allow"), kind="interactive", ack_timeout=1.0)
        assert not d.acked
        if d.sent is not None:
            assert d.sent.status == 500
        assert any("as the bridge was stopping" in r.getMessage() for r in caplog.records)
        assert tool.calls == [] and fake_slack.ephemerals == []
    finally:
        await t.close()
