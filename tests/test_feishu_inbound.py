"""Normalising Feishu's ``im.message.receive_v1`` into a typed message: chats, mentions, threads, post
content, attachments, our own messages, session and dedupe keys."""

from __future__ import annotations

import json

from channels.feishu.inbound import normalize, read_message
from core.envelope import MediaItem, ReplyTo, ThreadRef
from tests.fakes.feishu.events import Mention, message_event, post_content

BOT = "ou_bot0000000000000000000000000000"
APP = "cli_app"


def event(text: str | None = "hello", **kw):
    return message_event(text, token="vt", app_id=APP, **kw)


def test_a_p2p_text_message():
    m = normalize(event("hello there", chat_type="p2p", chat_id="oc_dm", message_id="om_1", event_id="ev_1"), BOT)
    assert m is not None
    assert (m.chat_type, m.chat_id, m.message_id, m.text) == ("p2p", "oc_dm", "om_1", "hello there")
    assert m.sender.ids() == ("ou_user0000000000000000000000000001", "u_alice", "on_alice")
    assert m.session_key() == "feishu:oc_dm"
    assert m.dedupe_keys() == ("feishu:event:ev_1", "feishu:msg:om_1")
    assert m.thread is None and m.reply_to is None and not m.mentioned_bot


def test_a_message_in_a_chat_of_another_kind_is_a_group_message():
    # "topic_group" (a group of topics), or a kind Feishu adds later: it was dropped, acknowledged and unanswered
    m = normalize(event("@_user_1 hi", chat_type="topic_group", mentions=[Mention("chatbridge", BOT)]), BOT)
    assert m is not None and m.chat_type == "group" and m.mentioned_bot and m.text == "hi"
    assert normalize(event("hi", chat_type=""), BOT) is None


def test_the_bots_mention_is_stripped_and_others_are_resolved():
    m = normalize(event("@_user_1 ask @_user_2 about it @_all", mentions=[Mention("chatbridge", BOT),
                                                                           Mention("Bob", "ou_bob")]), BOT)
    assert m is not None
    assert m.text == "ask @Bob about it @all"
    assert m.mentioned_bot and m.mentions_all


def test_a_group_message_without_the_bots_mention():
    m = normalize(event("@_user_1 what do you think", mentions=[Mention("Bob", "ou_bob")]), BOT)
    assert m is not None and not m.mentioned_bot and m.text == "@Bob what do you think"


def test_a_message_in_a_thread_has_the_threads_session_and_answers_its_parent():
    m = normalize(event("more", chat_id="oc_g", thread_id="omt_7", root_id="om_root", parent_id="om_prev"), BOT)
    assert m is not None
    assert m.session_key() == "feishu:oc_g:omt_7"
    assert m.thread == ThreadRef(thread_id="omt_7") and m.reply_to == ReplyTo(message_id="om_prev")
    first = normalize(event("topic start", chat_id="oc_g", thread_id="omt_7"), BOT)
    assert first is not None and first.session_key() == m.session_key() and first.reply_to is None


def test_a_quote_reply_outside_threads_stays_in_the_chats_session():
    m = normalize(event("and why?", chat_id="oc_g", root_id="om_a", parent_id="om_b"), BOT)
    assert m is not None
    assert m.session_key() == "feishu:oc_g" and m.reply_to == ReplyTo(message_id="om_b")


def test_post_content_is_flattened_with_links_mentions_code_and_images():
    paragraphs = [
        [{"tag": "at", "user_id": "@_user_1", "user_name": "chatbridge"},
         {"tag": "text", "text": " please review "}, {"tag": "a", "href": "https://x.org/pr/1", "text": "the PR"}],
        [{"tag": "code_block", "language": "PYTHON", "text": "print(1)"}],
        [{"tag": "img", "image_key": "img_v3_abc"}],
        [{"tag": "emotion", "emoji_type": "SMILE"}, {"tag": "text", "text": " thanks"}]]
    m = normalize(event(message_type="post", content=post_content("Review", paragraphs),
                        mentions=[Mention("chatbridge", BOT)]), BOT)
    assert m is not None and m.mentioned_bot
    assert m.text.startswith("Review\nplease review [the PR](https://x.org/pr/1)")
    assert "```python\nprint(1)\n```" in m.text and ":SMILE: thanks" in m.text
    [image] = m.attachments
    assert (image.kind, image.key) == ("image", "img_v3_abc")
    assert m.media == (MediaItem(kind="photo", file_id="img_v3_abc"),)  # downloaded with type=image


def test_a_post_in_its_sending_shape_with_a_language_key():
    content = json.dumps({"en_us": {"title": "", "content": [[{"tag": "text", "text": "hi"}]]}})
    m = normalize(event(message_type="post", content=content), BOT)
    assert m is not None and m.text == "hi"


def test_files_and_images_become_attachments():
    file = normalize(event(message_type="file", content=json.dumps({"file_key": "file_1", "file_name": "a.pdf"})),
                     BOT)
    assert file is not None and file.text == ""
    [att] = file.attachments
    assert (att.kind, att.key, att.name) == ("file", "file_1", "a.pdf")
    assert file.media == (MediaItem(kind="document", file_id="file_1", file_name="a.pdf"),)
    image = normalize(event(message_type="image", content=json.dumps({"image_key": "img_1"})), BOT)
    assert image is not None and image.media == (MediaItem(kind="photo", file_id="img_1"),)
    voice = normalize(event(message_type="audio", content=json.dumps({"file_key": "file_v", "duration": 2300})),
                      BOT)
    assert voice is not None and voice.media == (MediaItem(kind="voice", file_id="file_v"),)
    video = normalize(event(message_type="media", content=json.dumps(
        {"file_key": "file_m", "image_key": "img_cover", "file_name": "clip.mp4", "duration": 5000})), BOT)
    assert video is not None and video.media == (MediaItem(kind="video", file_id="file_m", file_name="clip.mp4"),)


def test_a_sticker_is_named_in_words_since_feishu_does_not_hand_stickers_out():
    sticker = normalize(event(message_type="sticker", content=json.dumps({"file_key": "v2_sticker"})), BOT)
    assert sticker is not None and sticker.text == "[sticker]" and sticker.media == ()


def test_our_own_and_unreadable_messages_are_dropped():
    assert normalize(event(sender_open_id=BOT), BOT) is None
    assert normalize(event(sender_type="app"), BOT) is None
    assert normalize(event(message_type="interactive", content="{}"), BOT) is None
    assert normalize({"schema": "2.0", "header": {"event_type": "im.message.read_v1"}, "event": {}}, BOT) is None
    assert normalize({"event": {"message": {"chat_type": "group"}}}, BOT) is None
    broken = event()
    broken["event"]["message"]["content"] = "not json"
    m = normalize(broken, BOT)
    assert m is not None and m.text == ""


def test_a_users_message_of_a_kind_it_cannot_read_is_read_as_unreadable_not_dropped():
    # so the channel can tell its sender (normalize still gives None: nothing for a model)
    m = read_message(event(message_type="merge_forward", chat_type="p2p",
                           content=json.dumps({"content": "Merged and Forwarded Message"})), BOT)
    assert m is not None and not m.readable and m.message_type == "merge_forward" and m.text == ""
    assert m.media == () and m.chat_type == "p2p"
    mentioned = read_message(event("@_user_1", message_type="share_chat", mentions=[Mention("chatbridge", BOT)],
                                   content=json.dumps({"chat_id": "oc_x"})), BOT)
    assert mentioned is not None and not mentioned.readable and mentioned.mentioned_bot
    assert read_message(event(message_type="system", content="{}"), BOT) is None  # nobody's words
    assert read_message(event(message_type="interactive", content="{}", sender_open_id=BOT), BOT) is None
    text = read_message(event(message_type="text"), BOT)
    assert text is not None and text.readable


def test_a_location_becomes_its_place_and_coordinates_in_words():
    def location(content: dict) -> str | None:
        m = normalize(event(message_type="location", content=json.dumps(content)), BOT)
        return None if m is None else m.text

    assert location({"name": "Office", "longitude": "116.397", "latitude": "39.908"}) == \
        "[location] Office (latitude 39.908, longitude 116.397)"
    assert location({"name": "Office", "address": "1 Main St"}) == "[location] Office, 1 Main St"
    assert location({"longitude": 2.5, "latitude": -1}) == "[location] latitude -1, longitude 2.5"
    assert location({"name": "Here", "longitude": "NaN", "latitude": "1"}) == "[location] Here"
    assert location({}) is None  # nothing to say: the sender is told it cannot be read
    empty = read_message(event(message_type="location", content="{}"), BOT)
    assert empty is not None and not empty.readable
