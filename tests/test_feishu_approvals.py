"""Approval cards on Feishu: the request's buttons carry typed values, the card is one CardKit accepts,
the decided replacement removes the buttons, and a press parses back into who decided what."""

from __future__ import annotations

import json

import lark_oapi as lark
import pytest
from lark_oapi.api.cardkit.v1 import (
    BatchUpdateCardRequest,
    BatchUpdateCardRequestBody,
    CreateCardRequest,
    CreateCardRequestBody,
)

from channels.feishu.approvals import (
    GONE,
    ApprovalValue,
    approval_card,
    approval_elements,
    decided_card,
    decided_elements,
    element_ids,
    outcome_line,
    parse_card_action,
    toast,
    toast_with_card,
)
from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.events import card_action_event
from tests.fakes.feishu.openapi import card_buttons, card_text


def sdk(fake: FakeFeishu) -> lark.Client:
    return (lark.Client.builder().app_id(fake.app_id).app_secret(fake.app_secret).domain(fake.base_url)
            .timeout(5).log_level(lark.LogLevel.ERROR).build())


def test_the_buttons_carry_typed_values_and_show_what_will_run():
    card = approval_card("r1x", "fetch_url", '{"url": "https://example.com"}', "Alice")
    assert card_buttons(card) == [("✅ Allow", ApprovalValue("r1x", "allow").to_value()),
                                  ("❌ Deny", ApprovalValue("r1x", "deny").to_value())]
    text = card_text(card)
    assert "`fetch_url`" in text and "```\n{\"url\": \"https://example.com\"}\n```" in text and "Alice" in text


def test_model_written_names_and_arguments_cannot_break_out_of_code():
    elements = approval_elements("r2", "evil`tool", "```\n<at id=all></at>\n```", "Mallory")
    content = elements[0]["content"]
    assert "``evil`tool``" in content
    assert "````\n```\n<at id=all></at>\n```\n````" in content  # a longer fence around the arguments
    decided = decided_elements("r2", "t", "", None, outcome_line("deny", "**Bob** <at id=all>"))
    assert decided[0]["content"].endswith("❌ Denied by \\*\\*Bob\\*\\* &#60;at id=all\\>")


def test_values_and_refs_are_checked():
    assert ApprovalValue.parse(ApprovalValue("abc", "deny").to_value()) == ApprovalValue("abc", "deny")
    for tampered in ({"kind": "chatbridge.approval", "ref": "abc", "decision": "maybe"},
                     {"kind": "other", "ref": "abc", "decision": "allow"},
                     {"kind": "chatbridge.approval", "ref": "a b", "decision": "allow"}, "abc:allow", None):
        assert ApprovalValue.parse(tampered) is None
    with pytest.raises(ValueError):
        element_ids("way_too_long_ref_1")


async def test_cardkit_accepts_the_request_and_the_decided_update_removes_the_buttons(fake_feishu):
    client = sdk(fake_feishu)
    card = approval_card("r3", "current_time", "{}", "Alice")
    body = CreateCardRequestBody.builder().type("card_json").data(json.dumps(card)).build()
    created = await client.cardkit.v1.card.acreate(CreateCardRequest.builder().request_body(body).build())
    assert created.code == 0, created.msg
    card_id = created.data.card_id
    ids = element_ids("r3")
    [text] = decided_elements("r3", "current_time", "{}", "Alice", outcome_line("allow", "Alice"))
    actions = [{"action": "delete_elements", "params": {"element_ids": [ids["buttons"]]}},
               {"action": "update_element", "params": {"element_id": ids["text"], "element": text}}]
    update = BatchUpdateCardRequestBody.builder().sequence(1).actions(json.dumps(actions)).build()
    resp = await client.cardkit.v1.card.abatch_update(
        BatchUpdateCardRequest.builder().card_id(card_id).request_body(update).build())
    assert resp.code == 0, resp.msg
    assert fake_feishu.cards[card_id].buttons == []
    assert fake_feishu.cards[card_id].text.endswith("✅ Allowed by Alice")


def test_a_press_parses_into_operator_message_and_decision():
    value = ApprovalValue("r4", "allow").to_value()
    payload = card_action_event(value, token="vt", app_id="cli", message_id="om_card", chat_id="oc_g",
                                event_id="ev_9", operator_open_id="ou_bob", operator_user_id=None)
    action = parse_card_action(payload)
    assert action is not None
    assert (action.event_id, action.message_id, action.chat_id) == ("ev_9", "om_card", "oc_g")
    assert action.operator.open_id == "ou_bob" and action.operator.user_id is None
    assert action.approval == ApprovalValue("r4", "allow")
    other = parse_card_action(card_action_event({"vote": 1}, token="vt", app_id="cli", message_id="m",
                                                chat_id="c"))
    assert other is not None and other.approval is None and other.value == {"vote": 1}
    assert parse_card_action({"header": {"event_type": "im.message.receive_v1"}, "event": {}}) is None
    assert parse_card_action({"schema": "2.0", "event": {"action": {"value": value}}}) is None


def test_callback_answers():
    assert toast("warning", GONE) == {"toast": {"type": "warning", "content": GONE}}
    card = decided_card("r5", "t", "", None, "done")
    assert toast_with_card("success", "Allowed", card) == {
        "toast": {"type": "success", "content": "Allowed"}, "card": {"type": "raw", "data": card}}
