"""Tool approvals on Feishu: card elements with Allow / Deny buttons, the "decided" replacement, and the
``card.action.trigger`` callback parsed into a typed action, with the toast answer Feishu expects.

Pure: builds JSON 2.0 card structures and reads callback bodies; who may decide, and what happens then, is
the channel's business.

- A button's callback ``value`` is an object (``ApprovalValue.to_value``): ``{"kind": "chatbridge.approval",
  "ref": …, "decision": "allow" | "deny"}``. ``ref`` is a short random token the channel maps to (session,
  tool call id); call ids never travel to the client. ``ApprovalValue.parse`` accepts only that shape.
- Element ids are derived from ``ref`` (letters, digits and underscore, starting with a letter, at most 20
  characters: Feishu's rule), so the channel can later replace the text and remove the buttons of exactly
  this request (CardKit ``batch_update``) or send the decided card as the callback's answer.
- Tool name and arguments are shown inside code (the arguments in a fence longer than any backtick run in
  them), so nothing the model put in them is interpreted as card markdown or tags.
- A callback must be answered within 3 seconds (Feishu shows an error otherwise) with HTTP 200 and
  ``{}``, a toast, and/or a new card: ``toast`` and ``toast_with_card`` build those bodies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from channels.feishu.inbound import Sender

Decision = Literal["allow", "deny"]
ToastKind = Literal["info", "success", "warning", "error"]
VALUE_KIND = "chatbridge.approval"
_REF = re.compile(r"[A-Za-z0-9]{1,12}")

NOT_YOURS = "Only the person who asked, or a user allowed to use this bot, can decide this."
GONE = "This request is no longer pending."
RECEIVED = "Received: the card will update in a moment."
"""The answer to a press still being carried out when the answer is due (Feishu waits 3 s): it counts, and its
card is patched with the outcome once decided."""
ALLOWED = "Allowed"
DENIED = "Denied"
ENDED = "⌛ No longer pending"
"""A card's outcome line when a press finds its request over and nothing said how it ended."""


@dataclass(frozen=True, slots=True)
class ApprovalValue:
    ref: str
    decision: Decision

    def __post_init__(self) -> None:
        if not _REF.fullmatch(self.ref):
            raise ValueError("an approval ref is 1-12 letters or digits")

    def to_value(self) -> dict[str, str]:
        return {"kind": VALUE_KIND, "ref": self.ref, "decision": self.decision}

    @classmethod
    def parse(cls, value: Any) -> ApprovalValue | None:
        if not isinstance(value, Mapping) or value.get("kind") != VALUE_KIND:
            return None
        ref, decision = value.get("ref"), value.get("decision")
        if not isinstance(ref, str) or not _REF.fullmatch(ref) or decision not in ("allow", "deny"):
            return None
        return cls(ref, decision)


def element_ids(ref: str) -> dict[str, str]:
    """The ids of one request's elements: its text, its button row, and each button."""
    if not _REF.fullmatch(ref):
        raise ValueError("an approval ref is 1-12 letters or digits")
    return {"text": f"ap{ref}_t", "buttons": f"ap{ref}_b", "allow": f"ap{ref}_a", "deny": f"ap{ref}_d"}


def _inline_code(text: str) -> str:
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _code_block(text: str) -> str:
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}\n{text}\n{fence}"


def request_markdown(tool_name: str, arguments: str, requested_by: str | None) -> str:
    lines = [f"🔧 **Approval needed:** {_inline_code(tool_name)}"]
    if requested_by:
        lines.append(f"Asked by {_inline_code(requested_by)}")
    if arguments:
        lines.append(_code_block(arguments))
    return "\n\n".join(lines)


def _button(element_id: str, label: str, kind: str, value: ApprovalValue) -> dict[str, Any]:
    return {"tag": "button", "element_id": element_id, "type": kind, "size": "medium",
            "text": {"tag": "plain_text", "content": label},
            "behaviors": [{"type": "callback", "value": value.to_value()}]}


def approval_elements(ref: str, tool_name: str, arguments: str, requested_by: str | None) -> list[dict[str, Any]]:
    """The request's text and its Allow / Deny buttons, as JSON 2.0 card body elements."""
    ids = element_ids(ref)
    buttons = [_button(ids["allow"], "✅ Allow", "primary", ApprovalValue(ref, "allow")),
               _button(ids["deny"], "❌ Deny", "danger", ApprovalValue(ref, "deny"))]
    return [{"tag": "markdown", "element_id": ids["text"],
             "content": request_markdown(tool_name, arguments, requested_by)},
            {"tag": "column_set", "element_id": ids["buttons"], "flex_mode": "none",
             "columns": [{"tag": "column", "width": "auto", "elements": [b]} for b in buttons]}]


def decided_elements(ref: str, tool_name: str, arguments: str, requested_by: str | None,
                     outcome: str) -> list[dict[str, Any]]:
    """What replaces the request once it is decided or over: the same text and the outcome, no buttons."""
    text = f"{request_markdown(tool_name, arguments, requested_by)}\n\n{_escape_line(outcome)}"
    return [{"tag": "markdown", "element_id": element_ids(ref)["text"], "content": text}]


def _escape_line(text: str) -> str:
    # a decider's display name is user data: keep it from being read as markdown or tags
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~>])", r"\\\1", text).replace("<", "&#60;")


def _card(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": "2.0", "config": {"update_multi": True},
            "header": {"title": {"tag": "plain_text", "content": "Approval"}, "template": "orange"},
            "body": {"elements": elements}}


def approval_card(ref: str, tool_name: str, arguments: str, requested_by: str | None) -> dict[str, Any]:
    """A card of its own for one request (shared: ``update_multi``, so its update shows to everyone)."""
    return _card(approval_elements(ref, tool_name, arguments, requested_by))


def decided_card(ref: str, tool_name: str, arguments: str, requested_by: str | None, outcome: str) -> dict[str, Any]:
    return _card(decided_elements(ref, tool_name, arguments, requested_by, outcome))


def outcome_line(decision: Decision, who: str) -> str:
    return f"✅ Allowed by {who}" if decision == "allow" else f"❌ Denied by {who}"


@dataclass(frozen=True, slots=True)
class CardAction:
    """One press on a card's callback button."""

    event_id: str | None
    operator: Sender
    message_id: str | None
    chat_id: str | None
    value: Any
    approval: ApprovalValue | None
    """The approval decision, when the button was one of ours; None for anything else."""


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def parse_card_action(payload: Mapping[str, Any]) -> CardAction | None:
    """A ``card.action.trigger`` body (``{"schema": "2.0", "header", "event"}``, as JSON; an SDK
    ``P2CardActionTrigger`` becomes one through ``json.loads(lark.JSON.marshal(obj))``), or None when it is not
    one or names no operator."""
    header, event = _map(payload.get("header")), _map(payload.get("event"))
    if header.get("event_type") not in (None, "card.action.trigger"):
        return None
    operator = _map(event.get("operator"))
    open_id = operator.get("open_id")
    if not isinstance(open_id, str) or not open_id:
        return None
    action, context = _map(event.get("action")), _map(event.get("context"))
    value = action.get("value")

    def opt(source: Mapping[str, Any], key: str) -> str | None:
        item = source.get(key)
        return item if isinstance(item, str) and item else None

    return CardAction(event_id=opt(header, "event_id"),
                      operator=Sender(open_id, opt(operator, "user_id"), opt(operator, "union_id")),
                      message_id=opt(context, "open_message_id"), chat_id=opt(context, "open_chat_id"),
                      value=value, approval=ApprovalValue.parse(value))


def toast(kind: ToastKind, text: str) -> dict[str, Any]:
    """The callback answer that shows a toast to the user who pressed."""
    return {"toast": {"type": kind, "content": text}}


def toast_with_card(kind: ToastKind, text: str, card: dict[str, Any]) -> dict[str, Any]:
    """A toast, and the card replaced at once by ``card`` (a JSON 2.0 card for a JSON 2.0 message)."""
    return {**toast(kind, text), "card": {"type": "raw", "data": card}}
