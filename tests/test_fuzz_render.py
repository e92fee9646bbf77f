"""Fuzzing each platform's Markdown rendering with adversarial model output: unbalanced and nested markers,
fences opened and never closed, tables, HTML, links, entities, unicode edges (lone surrogates, astral
characters, RTL marks, NULs) and replies far longer than one message.

Properties, per platform, over the parts a reply is cut into:
- rendering never raises;
- every part is within the platform's limit (Telegram: 4,096 UTF-16 units with every entity inside the
  text, checked by the fake Bot API's own rules; Slack: 4,000 UTF-16 units of mrkdwn and 12,000 of markdown
  block; Feishu: the card budget and the 30 KB post);
- no text is lost: every word of the reply is shown by some part (in its text, or as a link's address).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from channels.common.splitter import split_text, utf16_len
from channels.feishu.render import CARD_PART_BYTES, POST_BYTES, card_parts, json_bytes, post_parts
from channels.slack.render import MARKDOWN_BLOCK_LIMIT, TEXT_LIMIT, render_parts
from channels.telegram.render import MESSAGE_LIMIT, format_markdown
from core.text import sound_text
from tests.fakes.telegram import FakeTelegram
from tests.support.fuzz import EDGE_CHARS

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
SYNTAX = ["**", "*", "_", "__", "`", "``", "~~", "~", "[", "]", "(", ")", "](", "![", "#", "|", "\\", "&", "&amp;",
          "<", ">", "<b>", "</b>", "<at id=all></at>", "<!--", "-->", "<div>", "http://example.com/x_y*z",
          "<https://example.com/a>", "@channel", "<!here>", "<@U123>", "$x$", "{", "}", ":", "'", '"', "+", "="]
BLOCK = ["\n", "\n\n", "\n```\n", "\n```python\n", "\n~~~\n", "\n# ", "\n> ", "\n- ", "\n1. ", "\n    ",
         "\n| a | b |\n|---|---|\n| ", "\n---\n", "\n* * *\n", "\n- [ ] ", "\n\t", "\n   > > > "]

piece = st.one_of(
    st.sampled_from(WORDS).map(lambda w: f" {w} "),
    st.sampled_from(SYNTAX), st.sampled_from(BLOCK), st.sampled_from(EDGE_CHARS),
    st.builds(lambda w, n: f" {w * n} ", st.sampled_from(WORDS), st.integers(1, 900)),  # one very long word
)
markdown = st.lists(piece, min_size=1, max_size=60).map(lambda ps: sound_text("".join(ps)))
"""Model output built from words, Markdown syntax in any order and unicode edges (made sound as core makes
every model chunk and inbound text: a lone surrogate is replaced before any renderer sees it, see
tests/test_lone_surrogates.py); a word is always
whitespace-delimited, so it stays a word (not a link address or a fence's language) however the syntax
around it parses, unless the syntax makes it one on purpose (checked below)."""
long_markdown = st.builds(lambda parts, n: sound_text("".join(parts)) * n, st.lists(piece, min_size=5, max_size=30),
                          st.integers(20, 80))
"""The same, repeated to several messages' worth."""
replies = st.one_of(markdown, markdown, long_markdown)


def visible_words(source: str) -> set[str]:
    """The words a reader must find (the tests skip replies with a link reference definition, ``[x]: y``,
    which Markdown shows nothing of)."""
    return {w for w in re.findall(r"\b[a-z]+\b", source) if w in WORDS}


# ---- Telegram ----------------------------------------------------------------------------------------------

_FAKE = FakeTelegram()


def telegram_parts(source: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """What the channel sends for a reply: split under the limit, each chunk rendered to text + entities."""
    out = []
    for chunk in split_text(source, MESSAGE_LIMIT):
        part = format_markdown(chunk, MESSAGE_LIMIT)
        out.append((part.text, [dict(e) for e in part.formatting]))
    return out


@FUZZ
@given(replies)
@example("\n- <!-- alpha ")  # an HTML block in a list item, which telegramify-markdown drops
def test_telegram_parts_fit_have_valid_entities_and_lose_no_words(source: str) -> None:
    assume("]:" not in source)
    parts = telegram_parts(source)
    found = []
    for text, entities in parts:
        if not text.strip():
            continue
        _FAKE._check_text({"text": text, "entities": entities})  # the fake Bot API's own 400s, raised here
        assert utf16_len(text) <= MESSAGE_LIMIT
        found.append(text)
        found.extend(str(e.get("url", "")) for e in entities)
    joined = "\n".join(found)
    missing = [w for w in sorted(visible_words(source)) if w not in joined]
    assert not missing, f"lost {missing}"


async def test_adversarial_replies_are_accepted_by_the_bot_api(tmp_path) -> None:
    """The same parts through the real aiogram client to the fake Bot API, which refuses what Telegram
    refuses (length in UTF-16 units, entities outside the text, empty text)."""
    from aiogram.methods import SendMessage

    from channels.telegram.factory import make_bot
    from channels.telegram.sink import entities as to_entities

    samples = ["**bold *nested _deep `code** end", "```python\nx = '\ufffd'\n", "\u202e" * 5000,
               "[link](http://example.com/a_b*c) " * 300, "😀" * 4097, "| a |\n|---|\n| " + "é" * 5000 + " |",
               "> " * 500 + "quote", "\x00 nul \x00", "*" * 9000, "<b>" * 2000,
               "# " + "\U0001f469\u200d\U0001f4bb" * 3000]
    async with FakeTelegram() as tg:
        bot = make_bot(tg.token, tg.base_url)
        try:
            for source in samples:
                for chunk in split_text(source, MESSAGE_LIMIT):
                    part = format_markdown(chunk, MESSAGE_LIMIT)
                    if not part.text.strip():
                        continue
                    await bot(SendMessage(chat_id=555, text=part.text, entities=to_entities(part),
                                          parse_mode=None))  # a 400 from the fake raises
            assert all(c.status == 200 for c in tg.calls), [c.status for c in tg.calls]
            assert len(tg.visible(555)) >= len(samples)
        finally:
            await bot.session.close()


# ---- Slack -------------------------------------------------------------------------------------------------


@FUZZ
@given(replies)
def test_slack_parts_fit_and_lose_no_words(source: str) -> None:
    assume("]:" not in source)
    parts = render_parts(source)
    for part in parts:
        assert utf16_len(part.mrkdwn) <= TEXT_LIMIT
        assert utf16_len(part.markdown) <= MARKDOWN_BLOCK_LIMIT
        for rich in (True, False):
            json.dumps(part.message(rich=rich))  # what slack_sdk sends
    mrkdwn = "\n".join(p.mrkdwn for p in parts)
    markdown = "\n".join(p.markdown for p in parts)
    words = visible_words(source)
    assert not [w for w in words if w not in mrkdwn], "mrkdwn lost words"
    assert not [w for w in words if w not in markdown], "markdown block lost words"


# ---- Feishu ------------------------------------------------------------------------------------------------


@FUZZ
@given(replies)
def test_feishu_cards_and_posts_fit_and_lose_no_words(source: str) -> None:
    assume("]:" not in source)
    cards = card_parts(source)
    for card in cards:
        assert json_bytes(card) <= CARD_PART_BYTES
    posts = post_parts(source)
    for post in posts:
        assert len(post.encode("utf-8", "surrogatepass")) <= POST_BYTES
        json.loads(post)
    words = visible_words(source)
    card_text = "\n".join(cards)
    post_text = "\n".join(json.dumps(json.loads(p), ensure_ascii=False) for p in posts)
    assert not [w for w in words if w not in card_text], "cards lost words"
    assert not [w for w in words if w not in post_text], "posts lost words"


@pytest.mark.parametrize("source", ["", " ", "\n\n", "\ufffd", "\x00", "\u202e"])
def test_degenerate_replies_render_without_raising(source: str) -> None:
    assert all(utf16_len(text) <= MESSAGE_LIMIT for text, _ in telegram_parts(source))
    slack, cards, posts = render_parts(source), card_parts(source), post_parts(source)
    assert all(json_bytes(card) <= CARD_PART_BYTES for card in cards)
    assert all(json.loads(post) for post in posts)
    if source.strip():  # something to show: every platform shows it
        assert slack and cards and posts
    else:  # nothing to show: no empty Slack message or Feishu card
        assert not slack and not cards and not posts
