from __future__ import annotations

import random
import re

import pytest

from channels.common.splitter import open_fence, split, split_text, utf8_len, utf16_len


def _words(text: str) -> str:
    """The text without fence lines and whitespace: what must survive a split unchanged."""
    return re.sub(r"\s+", "", re.sub(r"(?m)^ {0,3}(```|~~~).*$", "", text))


def test_short_text_is_one_part():
    assert split_text("hello", 100) == ["hello"]


def test_prefers_paragraph_then_line_then_sentence():
    para = "a" * 30 + "\n\n" + "b" * 30
    assert split_text(para, 40) == ["a" * 30, "b" * 30]
    lines = "a" * 30 + "\n" + "b" * 30
    assert split_text(lines, 40) == ["a" * 30, "b" * 30]
    sentences = "First sentence here. Second one is here."
    assert split_text(sentences, 30) == ["First sentence here.", "Second one is here."]


def test_hard_cut_when_no_boundary():
    parts = split_text("x" * 100, 30)
    assert all(len(p) <= 30 for p in parts) and "".join(parts) == "x" * 100


def test_counts_utf16_units_not_characters():
    text = "😀" * 20  # 40 UTF-16 units
    parts = split_text(text, 16)
    assert all(utf16_len(p) <= 16 for p in parts)
    assert "".join(parts) == text
    assert utf16_len("😀a") == 3 and utf8_len("é") == 2


def test_code_fence_cut_by_a_split_is_closed_and_reopened():
    code = "\n".join(f"print({i})  # line {i}" for i in range(40))
    text = f"Intro paragraph.\n\n```python\n{code}\n```\n\nOutro."
    parts = split_text(text, 200)
    assert len(parts) > 2
    for part in parts:
        assert utf16_len(part) <= 200
        assert open_fence(part) is None, part  # balanced in every part
    assert parts[1].startswith("```python\n")
    assert _words("\n".join(parts)) == _words(text)


@pytest.mark.parametrize("limit", [64, 257, 1000, 4096])
def test_long_mixed_reply_is_complete_and_within_limit(limit):
    blocks = []
    for i in range(30):
        blocks.append(f"Paragraph {i}: " + "lorem ipsum dolor sit amet. " * (i % 7 + 1))
        if i % 4 == 0:
            blocks.append("```js\n" + "\n".join(f"const v{j} = {j} * 😀;" for j in range(i + 3)) + "\n```")
    text = "\n\n".join(blocks)
    parts = split_text(text, limit)
    assert all(utf16_len(p) <= limit for p in parts)
    assert all(open_fence(p) is None for p in parts)
    assert _words("\n".join(parts)) == _words(text)


def test_open_fence_tracks_nested_markers():
    assert open_fence("```py\nx\n```") is None
    assert open_fence("text\n```py\nx") == "```py"
    assert open_fence("````\n```\nstill open") == "````"


def test_a_code_line_longer_than_the_limit_is_cut_inside_its_block_without_empty_parts():
    # this used to loop forever: the only line break in reach was right after the fence line
    text = "Intro\n\n```py\n" + "x" * 200 + "\n```"
    parts = split_text(text, 64)
    assert all(utf16_len(p) <= 64 and open_fence(p) is None for p in parts)
    assert all(p.strip("`py\n") for p in parts)  # no part is an empty code block
    assert "".join(p.replace("```py", "").replace("```", "").replace("\n", "") for p in parts) == "Intro" + "x" * 200


def test_split_can_continue_from_any_part_it_made():
    blocks = [f"Paragraph {i}: " + "words and more words. " * (i % 5 + 1) for i in range(40)]
    blocks[7] = "```sh\n" + "\n".join(f"echo {j} 😀" for j in range(60)) + "\n```"
    text = "\n\n".join(blocks)
    chunks = split(text, 300)
    for k, chunk in enumerate(chunks):
        assert split(text, 300, start=chunk.start, reopen=chunk.reopen) == chunks[k:]


def test_random_replies_split_completely_and_within_the_limit():
    rng = random.Random(7)
    pieces = ["alpha", "beta.", "gamma!", "😀", "é", "\n", "\n\n", "\n```py\n", "\n```\n", "  ", "x" * 50, "\t"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) + rng.choice([" ", "", "\n"]) for _ in range(rng.randint(1, 200)))
        limit = rng.choice([37, 64, 100])  # (at 16 a fence line itself must be cut)
        for measure in (utf16_len, utf8_len, len):
            parts = split_text(text, limit, measure=measure)
            assert all(measure(p) <= limit for p in parts)
            assert _words("\n".join(parts)) == _words(text)
