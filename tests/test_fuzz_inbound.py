"""Fuzzing every channel's inbound normaliser with what a platform (or someone posing as one) could send:
missing fields, wrong types, unicode edges, oversized text, deep nesting.

The property: a normaliser never raises. It answers with a message for core, or with "ignore" — and what
it hands on is well-formed (strings where strings belong, ids that are not empty). Each normaliser is the
pure function a webhook route or a socket handler calls, so a crash here would be a 500 (Telegram, Slack
and Feishu then redeliver the same event forever) or a dead event loop task."""

from __future__ import annotations

import json
from typing import Any

from aiogram.types import Update
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from channels.feishu.inbound import normalize as feishu_normalize
from channels.slack.inbound import BotIdentity as SlackBot
from channels.slack.inbound import normalize as slack_normalize
from channels.telegram.adapter import AllowList, BotIdentity
from channels.telegram.adapter import normalize as telegram_normalize
from core.envelope import InboundEnvelope
from tests.support.fuzz import deep, edge_text, fuzz_fields, json_like, text

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- Slack ------------------------------------------------------------------------------------------------

SLACK_BOT = SlackBot(user_id="U0BOT", bot_id="B0BOT", team_id="T0TEAM")

slack_file = fuzz_fields({"id": text, "mimetype": st.sampled_from(["image/png", "text/plain", "", "/"]),
                          "name": text, "title": text, "size": st.integers()})
slack_event = fuzz_fields({
    "type": st.sampled_from(["message", "app_mention", "reaction_added", ""]),
    "channel": st.sampled_from(["D0ALICE", "C0GENERAL", "G0GROUP", ""]),
    "channel_type": st.sampled_from(["im", "mpim", "channel", "group"]),
    "user": st.sampled_from(["U0ALICE", "U0BOT", ""]),
    "text": st.one_of(text, st.sampled_from(["<@U0BOT> hi", "<!channel>", "<http://x|y>", "<@U0BOT", "&amp;"])),
    "subtype": st.sampled_from(["file_share", "message_changed", "bot_message", "thread_broadcast"]),
    "thread_ts": st.sampled_from(["1700000000.000100", ""]),
    "ts": st.sampled_from(["1700000000.000200", ""]),
    "bot_id": st.sampled_from(["B0BOT", "B0OTHER"]),
    "files": st.lists(slack_file, max_size=3),
    "hidden": st.booleans(),
    "parent_user_id": text,
})
slack_body = st.one_of(
    fuzz_fields({"type": st.just("event_callback"), "event_id": text, "team_id": text, "event": slack_event}),
    json_like(),
)


@FUZZ
@given(slack_body)
@example({"event": {"type": "message", "subtype": [None]}})  # a subtype that is not a string
def test_slack_normalize_never_raises_and_hands_on_only_well_formed_messages(body: Any) -> None:
    if not isinstance(body, dict):
        body = {"event": body}
    got = slack_normalize(body, SLACK_BOT)
    if got.kind is None:
        assert got.ignore
        return
    assert got.ignore is None
    assert isinstance(got.text, str) and got.user and got.channel and got.ts
    assert got.session_key.startswith("slack:") and all(isinstance(k, str) for k in got.dedupe_keys)


def test_slack_events_of_the_wrong_shape_are_ignored_not_crashed_on() -> None:
    for body in ({"event": "message"}, {"event": ["message"]}, {"event": 7}, {"event": {"type": "message",
                 "user": "U0ALICE", "channel": "D0ALICE", "ts": "1.2", "text": "hi", "files": 3}},
                 {"event": {"type": "message", "user": {"id": "U0ALICE"}, "channel": ["D0"], "ts": 1.5,
                            "text": {"t": 1}}}):
        got = slack_normalize(body, SLACK_BOT)
        assert got.kind is None or isinstance(got.text, str), body


# ---- Feishu -------------------------------------------------------------------------------------------------

FEISHU_BOT = "ou_bot"

post_node = fuzz_fields({"tag": st.sampled_from(["text", "md", "a", "at", "code_block", "emotion", "hr", "img",
                                                 "media"]),
                         "text": text, "href": text, "user_id": st.sampled_from(["@_user_1", "ou_x", ""]),
                         "user_name": text, "language": text, "emoji_type": text, "image_key": text,
                         "file_key": text, "file_name": text})
post_body = fuzz_fields({"title": text, "content": st.lists(st.lists(post_node, max_size=4), max_size=3)})
feishu_content = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), text),
    st.builds(json.dumps, post_body),
    st.builds(lambda b: json.dumps({"zh_cn": b}), post_body),
    st.builds(lambda v: json.dumps(v, allow_nan=True), fuzz_fields({
        "image_key": text, "file_key": text, "file_name": text,
        "duration": st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True))})),
    text,
)
mention = fuzz_fields({"key": st.sampled_from(["@_user_1", "@_user_2", "@_all"]), "name": text,
                       "id": fuzz_fields({"open_id": st.sampled_from(["ou_bot", "ou_bob", ""])})})
feishu_message = fuzz_fields({
    "message_id": st.sampled_from(["om_1", ""]), "chat_id": st.sampled_from(["oc_1", ""]),
    "chat_type": st.sampled_from(["p2p", "group", "topic"]),
    "message_type": st.sampled_from(["text", "post", "image", "file", "audio", "media", "sticker", "card"]),
    "content": feishu_content, "mentions": st.lists(mention, max_size=3),
    "root_id": text, "parent_id": text, "thread_id": text,
    "create_time": st.one_of(st.sampled_from(["1700000000000", "²", "١٢٣", "-1", ""]), text),
})
feishu_event = st.one_of(
    fuzz_fields({
        "schema": st.just("2.0"),
        "header": fuzz_fields({"event_type": st.sampled_from(["im.message.receive_v1", "other"]),
                               "event_id": text}),
        "event": fuzz_fields({
            "sender": fuzz_fields({"sender_type": st.sampled_from(["user", "app"]),
                                   "sender_id": fuzz_fields({"open_id": st.sampled_from(["ou_alice", "ou_bot"]),
                                                             "user_id": text, "union_id": text})}),
            "message": feishu_message}),
    }),
    json_like(),
)


@FUZZ
@given(feishu_event)
def test_feishu_normalize_never_raises_and_hands_on_only_well_formed_messages(event: Any) -> None:
    if not isinstance(event, dict):
        event = {"event": event}
    got = feishu_normalize(event, FEISHU_BOT)
    if got is None:
        return
    assert got.message_id and got.chat_id and got.sender.open_id and got.chat_type in ("p2p", "group")
    assert isinstance(got.text, str) and all(m.file_id for m in got.media)
    assert got.create_time_ms is None or isinstance(got.create_time_ms, int)
    assert got.session_key().startswith("feishu:") and got.dedupe_keys()


def _feishu(message: dict[str, Any]) -> dict[str, Any]:
    return {"schema": "2.0", "header": {"event_type": "im.message.receive_v1", "event_id": "ev"},
            "event": {"sender": {"sender_type": "user", "sender_id": {"open_id": "ou_alice"}},
                      "message": {"message_id": "om_1", "chat_id": "oc_1", "chat_type": "p2p", **message}}}


def test_feishu_numbers_a_parser_accepts_but_int_refuses_are_ignored() -> None:
    """Feishu's JSON may carry a duration Python's json reads as NaN or Infinity, and a create_time of digits
    that are not ASCII ("²".isdigit() is True, int("²") raises): neither may cost the message."""
    for content in ('{"file_key": "k", "duration": Infinity}', '{"file_key": "k", "duration": NaN}',
                    '{"file_key": "k", "duration": 1e400}'):
        got = feishu_normalize(_feishu({"message_type": "audio", "content": content}), FEISHU_BOT)
        assert got is not None and got.attachments[0].key == "k" and got.attachments[0].duration_ms is None
    for stamp in ("²", "١٢٣", "٣"):
        got = feishu_normalize(_feishu({"message_type": "text", "content": '{"text": "hi"}',
                                        "create_time": stamp}), FEISHU_BOT)
        assert got is not None and got.text == "hi" and got.create_time_ms is None


def test_feishu_fields_of_the_wrong_type_are_ignored_not_crashed_on() -> None:
    for message in ({"message_type": "text", "content": '{"text": "hi"}', "mentions": 5},
                    {"message_type": "post", "content": '{"title": "t", "content": 5}'},
                    {"message_type": "post", "content": '{"zh_cn": {"content": [[{"tag": "text", "text": 1}]]}}'},
                    {"message_type": "text", "content": json.dumps({"text": deep("x", 50)})}):
        got = feishu_normalize(_feishu(message), FEISHU_BOT)
        assert got is None or isinstance(got.text, str), message


# ---- Telegram -----------------------------------------------------------------------------------------------

TG_BOT = BotIdentity(123456, "chatbridge_test_bot")

tg_user = fuzz_fields({"id": st.one_of(st.sampled_from([777, 888, 123456]), st.integers()),
                       "is_bot": st.booleans(), "first_name": text, "last_name": text,
                       "username": st.one_of(st.sampled_from(["alice", "chatbridge_test_bot", "ALICE"]), text)},
                      extra=False)
tg_entity = fuzz_fields({"type": st.sampled_from(["mention", "text_mention", "bold", "bot_command", "url"]),
                         "offset": st.integers(min_value=-5, max_value=5000),
                         "length": st.integers(min_value=-5, max_value=5000), "user": tg_user}, extra=False)
tg_file = fuzz_fields({"file_id": text, "file_unique_id": text, "file_size": st.integers(),
                       "mime_type": text, "file_name": text, "width": st.integers(), "height": st.integers()},
                      extra=False)
tg_message = st.recursive(
    fuzz_fields({
        "message_id": st.integers(min_value=-(2**63), max_value=2**63),
        "date": st.integers(min_value=0, max_value=2**40),
        "chat": fuzz_fields({"id": st.sampled_from([555, -100123, 0]), "type": st.sampled_from(
            ["private", "group", "supergroup", "channel", "secret"]), "is_forum": st.booleans()}, extra=False),
        "from": tg_user,
        "text": st.one_of(text, st.sampled_from(["/stop", "/stop@chatbridge_test_bot", "@chatbridge_test_bot hi",
                                                 "/new@other_bot"])),
        "caption": text,
        "entities": st.lists(tg_entity, max_size=3),
        "caption_entities": st.lists(tg_entity, max_size=3),
        "message_thread_id": st.integers(min_value=-5, max_value=2**40),
        "is_topic_message": st.booleans(),
        "photo": st.lists(tg_file, max_size=2),
        "document": tg_file, "voice": tg_file,
    }, extra=False),
    lambda inner: st.builds(lambda m, r: {**m, "reply_to_message": r}, inner, inner), max_leaves=3)
tg_update = st.one_of(
    st.builds(lambda uid, m, kind: {"update_id": uid, kind: m}, st.integers(min_value=0, max_value=2**40),
              tg_message, st.sampled_from(["message", "edited_message"])),
    json_like(),
)


@FUZZ
@given(tg_update, st.sampled_from([("*",), ("alice",), ("777",), ()]), st.sampled_from(["mention", "all", "off"]))
def test_telegram_normalize_never_raises_and_refuses_the_unauthorised(data: Any, allow: tuple[str, ...],
                                                                     policy: str) -> None:
    try:
        update = Update.model_validate(data)
    except ValidationError:
        return  # the webhook answers 400 (and polling never sees what Telegram would not send)
    if update.message is None:
        return
    got = telegram_normalize(update.message, TG_BOT, allow=AllowList(allow), group_policy=policy)
    if got is None:
        return
    assert isinstance(got, InboundEnvelope) and got.content.strip()
    user = update.message.from_user
    assert user is not None and not user.is_bot
    assert "*" in allow or str(user.id) in allow or (user.username or "").lower() in allow


@FUZZ
@given(edge_text, st.lists(st.tuples(st.integers(-3, 60), st.integers(-3, 60)), max_size=4))
def test_telegram_mentions_with_entities_outside_the_text_are_not_a_crash(body: str,
                                                                          spans: list[tuple[int, int]]) -> None:
    message = {"message_id": 1, "date": 0, "chat": {"id": -100123, "type": "supergroup"},
               "from": {"id": 777, "is_bot": False, "first_name": "A", "username": "alice"},
               "text": body or "x",
               "entities": [{"type": "mention", "offset": o, "length": n} for o, n in spans]}
    update = Update.model_validate({"update_id": 1, "message": message})
    assert update.message is not None
    telegram_normalize(update.message, TG_BOT, allow=AllowList(("*",)), group_policy="mention")


def test_the_strategies_reach_the_edges() -> None:
    """The properties above are only as good as their input: it does carry lone surrogates and RTL marks."""
    from hypothesis import find

    assert "\ud800" in find(edge_text, lambda s: "\ud800" in s)
    assert "\u202e" in find(edge_text, lambda s: "\u202e" in s)
