"""Feishu rendering: what a card's markdown element and a post show for the model's Markdown, and how a long
reply is split into cards and posts within Feishu's limits."""

from __future__ import annotations

import json
import re

from channels.common.splitter import open_fence
from channels.feishu.render import (
    CARD_PART_BYTES,
    POST_BYTES,
    card_markdown,
    card_parts,
    json_bytes,
    plain_post_content,
    post_content,
    post_paragraphs,
    post_parts,
)


def test_raw_html_cannot_mention_everyone_but_code_keeps_its_text():
    src = "Hi <at id=all></at> and <font color=red>x</font>\n\n`<at id=all>`\n\n```\n<at id=all></at>\n```\n"
    out = card_markdown(src)
    assert "<at" not in out.split("`")[0] and "<font" not in out
    assert "&#60;at id=all>&#60;/at>" in out
    assert "`<at id=all>`" in out and "```\n<at id=all></at>\n```" in out


def test_an_html_block_is_shown_as_text():
    assert card_markdown("<div>\n<person id='ou_x'></person>\n</div>\n") == \
        "&#60;div>\n&#60;person id='ou_x'>&#60;/person>\n&#60;/div>\n"


def test_images_become_links_because_cards_only_show_uploaded_images():
    assert card_markdown("see ![chart](https://example.com/c.png) here") == \
        "see [chart](https://example.com/c.png) here"


def test_plain_markdown_passes_through_unchanged():
    src = "# Title\n\n**bold** *it* ~~gone~~ [link](https://x.org)\n\n- a\n- b\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert card_markdown(src) == src


def test_a_fifth_table_in_one_element_is_shown_as_a_code_block():
    table = "| h{n} | v |\n|---|---|\n| r{n} | 1 |\n"
    src = "\n".join(table.format(n=n) for n in range(6))
    out = card_markdown(src)
    assert out.count("```") == 4  # tables 5 and 6 fenced
    assert all(f"| r{n} | 1 |" in out for n in range(6))
    assert out.index("```") > out.index("| r3 | 1 |")


def long_reply() -> str:
    blocks = []
    for i in range(60):
        blocks.append(f"## Section {i}\n\nParagraph {i} explains things. " + "More words here. " * 12)
        if i % 5 == 0:
            blocks.append("```python\n" + "\n".join(f"x{i}_{j} = {j}  # <tag>" for j in range(30)) + "\n```")
        if i % 7 == 0:
            blocks.append("| col | val |\n|---|---|\n" + "".join(f"| c{i}{j} | {j} |\n" for j in range(8)))
    return "\n\n".join(blocks)


def words(text: str) -> list[str]:
    """The words of ``text`` without fence lines (a split closes and reopens a code block)."""
    kept = [line for line in text.replace("&#60;", "<").split("\n") if not line.lstrip().startswith("```")]
    return re.findall(r"[A-Za-z0-9_<>]+", "\n".join(kept))


def test_a_20000_character_reply_splits_into_cards_within_budget_with_code_fences_intact():
    src = long_reply()
    assert len(src) > 20_000
    parts = card_parts(src)
    assert len(parts) >= 2
    for part in parts:
        assert json_bytes(part) <= CARD_PART_BYTES
        assert open_fence(part) is None  # every part renders on its own
    # nothing is lost or repeated: the parts hold the source's words in order
    assert [w for p in parts for w in words(p)] == words(src)


def test_split_budget_counts_utf8_bytes_of_json():
    src = "好" * 30_000  # 90 KB of UTF-8
    parts = card_parts(src)
    assert all(json_bytes(p) <= CARD_PART_BYTES for p in parts)
    assert "".join(parts) == src


def test_post_nodes_are_literal_and_links_only_http():
    paragraphs = post_paragraphs("Ping <at user_id=\"all\"></at> [docs](https://d.org) [local](file:///etc) "
                                 "**b**")
    [line] = paragraphs
    assert {"tag": "text", "text": "<at user_id=\"all\">"} in line
    assert {"tag": "a", "href": "https://d.org", "text": "docs"} in line
    assert {"tag": "text", "text": "local (file:///etc)"} in line
    assert {"tag": "text", "text": "b", "style": ["bold"]} in line
    assert not any(node["tag"] == "at" for node in line)


def test_post_code_blocks_tables_lists_and_quotes():
    src = "Intro\n\n```py\nprint(1)\n```\n\n```weird\nx\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n" \
          "1. one\n2. two\n   - inner\n\n> quoted\n\n---\n\nend"
    paragraphs = post_paragraphs(src)
    flat = [node for p in paragraphs for node in p]
    assert {"tag": "code_block", "text": "print(1)", "language": "PYTHON"} in flat
    assert {"tag": "code_block", "text": "x"} in flat  # unknown language left out
    assert {"tag": "code_block", "text": "| a | b |\n|---|---|\n| 1 | 2 |"} in flat
    lines = ["".join(n.get("text", "") for n in p) for p in paragraphs]
    assert "1. one" in lines and "2. two" in lines and "    • inner" in lines and "> quoted" in lines
    assert [{"tag": "hr"}] in paragraphs and lines[-1] == "end"


def test_post_content_shape_and_plain_post():
    content = json.loads(post_content("hello", title="T"))
    assert content == {"zh_cn": {"title": "T", "content": [[{"tag": "text", "text": "hello"}]]}}
    plain = json.loads(plain_post_content("a **b**\n<at user_id=all>"))
    assert plain["zh_cn"]["content"] == [[{"tag": "text", "text": "a **b**"}],
                                         [{"tag": "text", "text": "<at user_id=all>"}]]


def test_post_parts_each_fit_feishus_30_kb():
    parts = post_parts(long_reply() * 3)
    assert len(parts) >= 2
    assert all(len(p.encode()) <= POST_BYTES for p in parts)
