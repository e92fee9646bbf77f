"""Tool approvals on Slack: Block Kit Allow / Deny buttons, the "decided" replacement, and reading a press.

A pending tool call is shown as a section (tool name and a one-line argument summary), a context line (who
asked) and two buttons. Both buttons carry the same typed value, ``ApprovalAction`` — session key, tool call
id and requester — as compact JSON: Slack allows 2,000 characters per button value and a ``block_actions``
payload can only come from Slack (signed over HTTP, or over the app's own socket), so the press itself says
what it decides, and a press that arrives after a restart is still understood (core then answers whether the
call is still pending). The action ids (``ACTION_ALLOW`` / ``ACTION_DENY``) say which way.

When the approval ends (a press, a timeout, /stop) the message is updated with ``decided_blocks``: the same
description without buttons, plus how it ended. The blocks are built with slack_sdk's typed Block Kit models,
which enforce Slack's per-element limits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from slack_sdk.models.blocks import ActionsBlock, ButtonElement, ContextBlock, MarkdownTextObject, SectionBlock

from channels.slack.render import escape

ACTION_ALLOW = "chatbridge.approval.allow"
ACTION_DENY = "chatbridge.approval.deny"
BLOCK_ID = "chatbridge.approval"
Decision = Literal["allow", "deny"]
Outcome = Literal["allowed", "denied", "ended"]

_DECISIONS: dict[str, Decision] = {ACTION_ALLOW: "allow", ACTION_DENY: "deny"}
_SECTION_LIMIT = 3000
_VALUE_LIMIT = 2000
_OUTCOME_LINES = {"allowed": "✅ Allowed", "denied": "❌ Denied", "ended": "⌛ No longer pending"}


@dataclass(frozen=True, slots=True)
class ApprovalAction:
    """What a button decides: the pending tool call ``call_id`` of session ``session_key``."""

    session_key: str
    call_id: str
    requested_by: str | None = None
    origin: tuple[str, ...] = ()
    """A subagent's call (``run_subagent``): the child sessions it came through."""

    def encode(self) -> str:
        data: dict[str, Any] = {"v": 1, "s": self.session_key, "c": self.call_id, "r": self.requested_by}
        if self.origin:
            data["o"] = list(self.origin)
        value = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        if len(value) > _VALUE_LIMIT:
            raise ValueError("approval reference longer than Slack's 2,000-character button value")
        return value

    @classmethod
    def decode(cls, value: str | None) -> ApprovalAction | None:
        try:
            data = json.loads(value or "")
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("v") != 1:
            return None
        session, call, asker, origin = data.get("s"), data.get("c"), data.get("r"), data.get("o") or []
        if not isinstance(session, str) or not isinstance(call, str) or not (asker is None or isinstance(asker, str)):
            return None
        if not isinstance(origin, list) or not all(isinstance(o, str) for o in origin):
            return None
        return cls(session, call, asker, tuple(origin))


def _describe(tool_name: str, arguments: str, label: str | None = None) -> str:
    head = f"🔧 *Approval needed:* `{escape(tool_name)}`"
    if label:  # a subagent asks: say which one (its profile and task), so the chat knows whose call it is
        head += f"\n🤖 asked by subagent {escape(label)}"
    if not arguments.strip():
        return head
    room = _SECTION_LIMIT - len(head) - 8
    summary = escape(arguments)
    if len(summary) > room:  # a summary of the call, not the reply: shortening it loses no answer text
        summary = summary[:room - 1] + "…"
    return f"{head}\n```{summary}```"


def approval_text(tool_name: str) -> str:
    """The message's ``text``: the notification and screen-reader fallback for the blocks."""
    return f"Approval needed: {tool_name}"


def approval_blocks(action: ApprovalAction, tool_name: str, arguments: str,
                    label: str | None = None) -> list[dict[str, Any]]:
    """The pending request: description, who asked, Allow / Deny."""
    value = action.encode()
    blocks: list[Any] = [SectionBlock(text=MarkdownTextObject(text=_describe(tool_name, arguments, label)))]
    if action.requested_by:
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=f"Asked by <@{action.requested_by}>")]))
    blocks.append(ActionsBlock(block_id=BLOCK_ID, elements=[
        ButtonElement(text="Allow", action_id=ACTION_ALLOW, value=value, style="primary"),
        ButtonElement(text="Deny", action_id=ACTION_DENY, value=value, style="danger"),
    ]))
    return [b.to_dict() for b in blocks]


def decided_blocks(tool_name: str, arguments: str, outcome: Outcome, by: str | None = None, *,
                   line: str | None = None, label: str | None = None) -> list[dict[str, Any]]:
    """The request as it ended: no buttons, and a line saying how (and by whom, for a press); ``line``, when
    given, says how it ended instead (a timeout, a stopped reply)."""
    if line is None:
        line = _OUTCOME_LINES[outcome] + (f" by <@{by}>" if by and outcome != "ended" else "")
    else:
        line = escape(line)
    return [b.to_dict() for b in (SectionBlock(text=MarkdownTextObject(text=_describe(tool_name, arguments, label))),
                                  ContextBlock(elements=[MarkdownTextObject(text=line)]))]


@dataclass(frozen=True, slots=True)
class ApprovalPress:
    """One press on an approval button, from a ``block_actions`` payload."""

    decision: Decision
    action: ApprovalAction
    user_id: str
    user_name: str | None
    channel_id: str | None
    message_ts: str | None
    thread_ts: str | None
    response_url: str | None

    @property
    def by_requester(self) -> bool:
        return self.action.requested_by is not None and self.user_id == self.action.requested_by


def parse_press(payload: Mapping[str, Any]) -> ApprovalPress | None:
    """The approval press in a ``block_actions`` payload, or None when it is not one of ours (or garbled)."""
    if payload.get("type") != "block_actions":
        return None
    user = payload.get("user") or {}
    container = payload.get("container") or {}
    channel = payload.get("channel") or {}
    for act in payload.get("actions") or []:
        decision = _DECISIONS.get(str(act.get("action_id") or ""))
        if decision is None:
            continue
        action = ApprovalAction.decode(act.get("value"))
        if action is None or not user.get("id"):
            return None
        return ApprovalPress(
            decision=decision, action=action, user_id=str(user["id"]),
            user_name=user.get("username") or user.get("name"),
            channel_id=container.get("channel_id") or channel.get("id"),
            message_ts=container.get("message_ts") or (payload.get("message") or {}).get("ts"),
            thread_ts=container.get("thread_ts") or (payload.get("message") or {}).get("thread_ts"),
            response_url=payload.get("response_url"))
    return None
