"""Slack rendering: Markdown → mrkdwn and markdown blocks, and long replies split under Slack's limits."""

from __future__ import annotations

import re

import pytest
from slack_sdk.web.async_client import AsyncWebClient

from channels.common.splitter import open_fence, utf16_len
from channels.slack.render import (
    MARKDOWN_BLOCK_LIMIT,
    TEXT_LIMIT,
    defuse,
    render_parts,
    stream_delta,
    stream_pieces,
    tables_as_code,
    to_mrkdwn,
)
from tests.fakes.slack import FakeSlack

ZW = "\u200b"


@pytest.mark.parametrize(("markdown", "mrkdwn"), [
    ("**bold** and *italic* and ~~gone~~", "*bold* and _italic_ and ~gone~"),
    ("__bold__ _it_", "*bold* _it_"),
    ("use `x < y && z`", "use `x &lt; y &amp;&amp; z`"),
    ("[docs](https://e.x/a?b=1&c=2)", "<https://e.x/a?b=1&amp;c=2|docs>"),
    ("<https://e.x>", "<https://e.x>"),
    ("[a|b](https://e.x)", "a|b (<https://e.x>)"),
    ("![chart](https://e.x/c.png)", "<https://e.x/c.png|chart>"),
    ("# Heading with **bold**", "*Heading with bold*"),
    ("- one\n- two", "• one\n• two"),
    ("- one\n  - inner\n- two", "• one\n    ◦ inner\n• two"),
    ("3. three\n4. four", "3. three\n4. four"),
    ("> quoted\n> on", "> quoted\n> on"),
    ("```python\nif a < b:\n    pass\n```", "```\nif a &lt; b:\n    pass\n```"),
    ("a\n\n---\n\nb", "a\n\n———\n\nb"),
    ("<b>not html</b>", "&lt;b&gt;not html&lt;/b&gt;"),
    ("ping <!channel> and <@U123>", "ping &lt;!channel&gt; and &lt;@U123&gt;"),
    ("foo**bar**baz", f"foo{ZW}*bar*{ZW}baz"),
    ("line one\nline two", "line one\nline two"),
])
def test_markdown_becomes_mrkdwn(markdown: str, mrkdwn: str) -> None:
    assert to_mrkdwn(markdown) == mrkdwn


def test_tables_become_aligned_code_blocks() -> None:
    source = "Prices:\n\n| fruit | qty |\n|:--|--:|\n| apple | 3 |\n| 香蕉 | 12 |\n\nEnd."
    expected_table = "fruit | qty\n------+----\napple |   3\n香蕉  |  12"
    assert to_mrkdwn(source) == f"Prices:\n\n```\n{expected_table}\n```\n\nEnd."
    assert tables_as_code(source) == f"Prices:\n\n```\n{expected_table}\n```\n\nEnd."
    quoted = "> | a |\n> |---|\n> | 1 |"
    assert tables_as_code(quoted) == quoted  # only top-level tables are rewritten in the source


def test_defuse_breaks_mentions_outside_code_only() -> None:
    text = "hey <!here> <@U1>\n```\n<!here>\n```"
    assert defuse(text) == f"hey <{ZW}!here> <{ZW}@U1>\n```\n<!here>\n```"


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9]+", text)


def long_reply(paragraphs: int = 60) -> str:
    chunks = []
    for i in range(paragraphs):
        chunks.append(f"Paragraph {i} explains step {i} in some detail. " * 4)
        if i % 5 == 0:
            body = "\n".join(f"    value_{i}_{j} = compute({j}) < limit" for j in range(30))
            chunks.append(f"```python\ndef block_{i}():\n{body}\n```")
    return "\n\n".join(chunks)


def test_a_20000_character_reply_is_split_under_the_limits_with_nothing_lost() -> None:
    reply = long_reply()
    assert len(reply) > 20_000
    parts = render_parts(reply)
    assert len(parts) >= 6
    for part in parts:
        assert utf16_len(part.mrkdwn) <= TEXT_LIMIT
        assert utf16_len(part.markdown) <= MARKDOWN_BLOCK_LIMIT
        assert open_fence(part.source) is None  # every part's code blocks are closed
        assert part.mrkdwn.count("```") % 2 == 0
    joined = "\n".join(p.source for p in parts)
    assert [w for w in _words(joined) if w != "python"] == [w for w in _words(reply) if w != "python"]


def test_escaping_that_grows_the_text_still_fits() -> None:
    reply = "<&>" * 5000  # every character becomes an entity: 4-5 times longer in mrkdwn
    parts = render_parts(reply)
    assert all(utf16_len(p.mrkdwn) <= TEXT_LIMIT for p in parts)
    assert "".join(p.source for p in parts) == reply


def test_astral_characters_are_measured_in_utf16_units() -> None:
    reply = " ".join(["😀😀😀"] * 1500)  # 4,500 code points, 9,000 UTF-16 units
    parts = render_parts(reply)
    assert len(parts) >= 3
    assert all(utf16_len(p.mrkdwn) <= TEXT_LIMIT for p in parts)
    assert "".join(p.source for p in parts).replace(" ", "") == reply.replace(" ", "")


def test_blank_replies_have_no_parts() -> None:
    assert render_parts("  \n ") == []


async def test_every_part_is_accepted_by_slack_as_post_and_as_update(fake_slack: FakeSlack) -> None:
    client = AsyncWebClient(token=fake_slack.bot_token, base_url=fake_slack.base_url, retry_handlers=[])
    parts = render_parts(long_reply(30) + "\n\n| a | b |\n|---|---|\n| 1 | 2 |")
    for part in parts:
        posted = await client.chat_postMessage(channel="D0ALICE", **part.message(rich=False))
        await client.chat_update(channel="D0ALICE", ts=posted["ts"], **part.message(rich=True))
        await client.chat_update(channel="D0ALICE", ts=posted["ts"], **part.message(rich=False))
    shown = fake_slack.messages("D0ALICE")
    assert [m.text for m in shown] == [p.mrkdwn for p in parts]
    assert [m.edits[1][1] for m in shown] == [[{"type": "markdown", "text": p.markdown}] for p in parts]


def test_stream_pieces_concatenate_exactly() -> None:
    delta = ("ab😀" * 5000) + "tail"
    pieces = stream_pieces(delta, limit=1000)
    assert "".join(pieces) == delta
    assert all(utf16_len(p) <= 1000 for p in pieces)
    assert all(not ("\ud800" <= p[-1] <= "\udbff") for p in pieces)
    assert stream_pieces("") == []


def test_stream_delta_only_extends() -> None:
    assert stream_delta("Hello", "Hello world") == " world"
    assert stream_delta("Hello", "Hello") == ""
    assert stream_delta("Hello", "Help") is None
