"""Slack event normalisation: kinds, ignored events, sessions and dedupe keys, on payloads from the Slack fake."""

from __future__ import annotations

from typing import Any

import pytest

from channels.slack.inbound import BotIdentity, normalize, readable
from tests.fakes.slack import FakeSlack


@pytest.fixture
def slack() -> FakeSlack:
    return FakeSlack()  # only its payload builders: no server needed


@pytest.fixture
def bot(slack: FakeSlack) -> BotIdentity:
    return BotIdentity(user_id=slack.bot_user_id, bot_id=slack.bot_id, team_id=slack.team_id)


def test_a_dm_is_one_session_answered_at_the_top_level(slack: FakeSlack, bot: BotIdentity) -> None:
    first = normalize(slack.user_message("hello there"), bot)
    second = normalize(slack.user_message("and again"), bot)
    assert (first.kind, first.ignore, first.text, first.user) == ("dm", None, "hello there", "U0ALICE")
    assert first.reply_thread_ts is None
    assert first.session_key == second.session_key == "slack:D0ALICE"
    assert first.dedupe_keys != second.dedupe_keys


def test_a_thread_in_a_dm_is_its_own_session(slack: FakeSlack, bot: BotIdentity) -> None:
    root = slack.user_message("root")["event"]["ts"]
    reply = normalize(slack.user_message("in thread", thread_ts=root), bot)
    assert (reply.kind, reply.reply_thread_ts) == ("dm", root)
    assert reply.session_key == f"slack:D0ALICE:{root}"


def test_a_channel_mention_is_answered_in_its_thread_and_deduped_across_both_deliveries(
        slack: FakeSlack, bot: BotIdentity) -> None:
    as_mention, as_message = slack.mention("what is up?")
    a, m = normalize(as_mention, bot), normalize(as_message, bot)
    for n in (a, m):
        assert (n.kind, n.ignore, n.text, n.mentions_bot) == ("mention", None, "what is up?", True)
    assert a.reply_thread_ts == a.ts and a.session_key == f"slack:C0GENERAL:{a.ts}"
    assert a.session_key == m.session_key
    assert a.event_id != m.event_id
    shared = set(a.dedupe_keys) & set(m.dedupe_keys)
    assert shared == {f"slack:msg:C0GENERAL:{a.ts}"}  # the double delivery is caught by (channel, ts)


def test_a_retried_delivery_has_the_same_keys(slack: FakeSlack, bot: BotIdentity) -> None:
    payload = slack.user_message("once please")
    assert normalize(payload, bot).dedupe_keys == normalize(dict(payload), bot).dedupe_keys
    assert normalize(payload, bot).dedupe_keys[0] == f"slack:event:{payload['event_id']}"


def test_thread_follow_ups_and_plain_channel_messages(slack: FakeSlack, bot: BotIdentity) -> None:
    root = slack.mention("start")[1]["event"]["ts"]
    follow = normalize(slack.user_message("more detail", channel="C0GENERAL", thread_ts=root), bot)
    assert (follow.kind, follow.mentions_bot, follow.parent_user_id) == ("thread_reply", False, "U0ALICE")
    assert follow.session_key == f"slack:C0GENERAL:{root}"  # the same session as the mention that started it
    chatter = normalize(slack.user_message("lunch?", channel="C0GENERAL"), bot)
    assert chatter.kind == "channel_message" and not chatter.mentions_bot


@pytest.mark.parametrize("case", ["own", "other_bot", "bot_message", "edit", "delete", "join", "hidden",
                                  "reaction_event", "empty"])
def test_events_that_are_not_user_input_are_ignored(slack: FakeSlack, bot: BotIdentity, case: str) -> None:
    from tests.fakes.slack import Message

    payload: dict[str, Any]
    if case == "own":
        payload = slack.bot_echo(Message("D0ALICE", slack.next_ts(), "my answer", user=slack.bot_user_id,
                                         bot_id=slack.bot_id))
        expected = "own_message"
    elif case == "other_bot":
        payload = slack.event_callback({"type": "message", "channel": "C0GENERAL", "channel_type": "channel",
                                        "user": "U0OTHERBOT", "bot_id": "B0OTHER", "text": "beep", "ts": "1.1"})
        expected = "bot_message"
    elif case == "bot_message":
        payload = slack.event_callback({"type": "message", "subtype": "bot_message", "channel": "C0GENERAL",
                                        "bot_id": "B0HOOK", "text": "webhook says hi", "ts": "1.2"})
        expected = "bot_message"
    elif case == "edit":
        ts = slack.user_message("typo")["event"]["ts"]
        payload = slack.edit_event("D0ALICE", ts, "fixed")
        expected = "subtype:message_changed"
    elif case == "delete":
        payload = slack.event_callback({"type": "message", "subtype": "message_deleted", "channel": "D0ALICE",
                                        "channel_type": "im", "hidden": True, "deleted_ts": "1.3", "ts": "1.4"})
        expected = "subtype:message_deleted"
    elif case == "join":
        payload = slack.user_message("<@U0ALICE> has joined the channel", channel="C0GENERAL",
                                     subtype="channel_join")
        expected = "subtype:channel_join"
    elif case == "hidden":
        payload = slack.event_callback({"type": "message", "channel": "D0ALICE", "channel_type": "im",
                                        "user": "U0ALICE", "text": "x", "ts": "1.5", "hidden": True})
        expected = "hidden"
    elif case == "reaction_event":
        payload = slack.event_callback({"type": "reaction_added", "user": "U0ALICE", "reaction": "+1"})
        expected = "event:reaction_added"
    else:
        payload = slack.user_message(f"<@{slack.bot_user_id}>", channel="C0GENERAL")
        expected = "empty"
    n = normalize(payload, bot)
    assert (n.kind, n.ignore) == (None, expected)


def test_user_input_subtypes_are_kept_and_files_become_media(slack: FakeSlack, bot: BotIdentity) -> None:
    files = [{"id": "F1", "name": "chart.png", "mimetype": "image/png", "size": 2048},
             {"id": "F2", "name": "notes.pdf", "mimetype": "application/pdf", "size": 9000}]
    n = normalize(slack.user_message("see attached", subtype="file_share", files=files), bot)
    assert (n.kind, n.text) == ("dm", "see attached")
    assert [(f.kind, f.file_id, f.file_name, f.size) for f in n.files] == [
        ("photo", "F1", "chart.png", 2048), ("document", "F2", "notes.pdf", 9000)]
    only_file = normalize(slack.user_message("", subtype="file_share", files=files[:1]), bot)
    assert only_file.kind == "dm" and only_file.text == ""
    root = slack.mention("q")[1]["event"]["ts"]
    broadcast = normalize(slack.user_message("also to channel", channel="C0GENERAL", thread_ts=root,
                                             subtype="thread_broadcast"), bot)
    assert broadcast.kind == "thread_reply"


def test_slack_markup_is_made_readable() -> None:
    text = ("<@U0BOT> see <https://e.x/a?b=1&amp;c=2|the docs> and <https://e.x> from <@U0ALICE> in "
            "<#C0GENERAL|general> &lt;tag&gt; <!here> <mailto:a@b.c|a@b.c>")
    assert readable(text, "U0BOT") == ("see the docs (https://e.x/a?b=1&c=2) and https://e.x from @U0ALICE in "
                                       "#general <tag> @here a@b.c")
