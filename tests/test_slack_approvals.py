"""Slack approval blocks: posted through slack_sdk to the Slack fake, pressed there, and read back."""

from __future__ import annotations

import pytest
from slack_sdk.web.async_client import AsyncWebClient

from channels.slack.approvals import (
    ACTION_ALLOW,
    ACTION_DENY,
    ApprovalAction,
    approval_blocks,
    approval_text,
    decided_blocks,
    parse_press,
)
from tests.fakes.slack import FakeSlack, block_text


def client_for(slack: FakeSlack) -> AsyncWebClient:
    return AsyncWebClient(token=slack.bot_token, base_url=slack.base_url, retry_handlers=[])


async def test_a_press_on_the_posted_request_says_what_it_decides(fake_slack: FakeSlack) -> None:
    root = fake_slack.mention("fetch it")[0]["event"]["ts"]
    action = ApprovalAction("slack:C0GENERAL:" + root, "call_7Hx", requested_by="U0ALICE")
    posted = await client_for(fake_slack).chat_postMessage(
        channel="C0GENERAL", thread_ts=root, text=approval_text("fetch_url"),
        blocks=approval_blocks(action, "fetch_url", 'url="https://e.x/<page>"'))
    message = fake_slack.message("C0GENERAL", posted["ts"])
    assert message.shown.splitlines() == [
        "🔧 *Approval needed:* `fetch_url`", '```url="https://e.x/&lt;page&gt;"```', "Asked by <@U0ALICE>",
        "[Allow] [Deny]"]

    allow = parse_press(fake_slack.press(message, "Allow", user="U0ALICE"))
    assert allow is not None
    assert (allow.decision, allow.action, allow.user_id, allow.channel_id, allow.message_ts, allow.thread_ts) == (
        "allow", action, "U0ALICE", "C0GENERAL", posted["ts"], root)
    assert allow.by_requester and allow.response_url and allow.response_url.startswith(fake_slack.base)
    deny = parse_press(fake_slack.press(message, "Deny", user="U0BOB"))
    assert deny is not None and deny.decision == "deny" and not deny.by_requester


async def test_the_decided_message_has_no_buttons(fake_slack: FakeSlack) -> None:
    client = client_for(fake_slack)
    action = ApprovalAction("slack:D0ALICE", "c1", "U0ALICE")
    ts = (await client.chat_postMessage(channel="D0ALICE", text=approval_text("t"),
                                        blocks=approval_blocks(action, "t", "")))["ts"]
    await client.chat_update(channel="D0ALICE", ts=ts, text="Allowed: t",
                             blocks=decided_blocks("t", "", "allowed", by="U0ALICE"))
    message = fake_slack.message("D0ALICE", ts)
    assert [block_text(b) for b in message.blocks] == ["🔧 *Approval needed:* `t`", "✅ Allowed by <@U0ALICE>"]
    with pytest.raises(KeyError):
        fake_slack.press(message, "Allow")
    assert block_text(decided_blocks("t", "", "ended", by="U0BOB")[-1]) == "⌛ No longer pending"


async def test_long_arguments_and_ids_stay_within_block_kit_limits(fake_slack: FakeSlack) -> None:
    action = ApprovalAction("slack:C0GENERAL:1700000000.000100", "call_" + "x" * 300, None)
    blocks = approval_blocks(action, "write_file", "content=" + "y" * 10_000)
    await client_for(fake_slack).chat_postMessage(channel="C0GENERAL", text="approval", blocks=blocks)
    assert len(blocks) == 2  # no "asked by" line without a requester
    with pytest.raises(ValueError):
        ApprovalAction("s", "c" * 3000).encode()


def test_foreign_or_garbled_presses_are_not_approvals() -> None:
    good = ApprovalAction("slack:D1", "c1", "U1").encode()
    base = {"type": "block_actions", "user": {"id": "U1"}, "container": {}, "actions": []}
    assert parse_press({**base, "actions": [{"action_id": "someone.else", "value": good}]}) is None
    assert parse_press({**base, "actions": [{"action_id": ACTION_ALLOW, "value": "not json"}]}) is None
    assert parse_press({**base, "actions": [{"action_id": ACTION_DENY, "value": '{"v": 2}'}]}) is None
    assert parse_press({**base, "type": "view_submission"}) is None
    press = parse_press({**base, "actions": [{"action_id": ACTION_DENY, "value": good}]})
    assert press is not None and press.decision == "deny" and press.by_requester
