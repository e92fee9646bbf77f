"""Telegram's final rendering: Markdown as text + entities, and the plain source whenever the rendering
would not show every word the reader should see."""

from __future__ import annotations

from channels.telegram.render import format_markdown, keeps_every_word


def entity_types(source: str) -> list[str]:
    return [dict(e)["type"] for e in format_markdown(source).formatting]


def test_an_html_block_in_a_list_item_is_not_lost():
    for source in ("- <summary>Details</summary>", "1. <div>first step</div>", "- item\n\n  <p>more text</p>",
                   "Steps:\n\n- **bold** one\n- <details>the rest</details>"):
        part = format_markdown(source)
        for word in ("Details", "first", "step", "more", "text", "rest"):
            if word in source:
                assert word in part.text, (source, part.text)


def test_ordinary_markdown_keeps_its_formatting():
    assert entity_types("# Title\n\n**bold**, _italic_, `code` and [a link](https://example.com/a?b=c)") == [
        "underline", "bold", "bold", "italic", "code", "text_link"]  # the heading is underlined and bold
    assert entity_types("```python\nprint(1)\n```") == ["pre"]  # the language is in the entity
    assert entity_types("| a | b |\n|---|---|\n| x<br>y | z |") == ["pre"]  # a tag in a cell shows nothing
    assert entity_types("[the docs][1]\n\n[1]: https://example.com") == ["text_link"]  # the definition's label
    assert entity_types("中文**粗体**和 snake_case") == ["bold"]


def test_a_closed_comment_is_hidden_and_tag_names_are_not_words_a_reader_sees():
    assert format_markdown("before\n\n<!-- a note to self -->\n\nafter").text == "before\n\nafter"
    assert keeps_every_word("press <kbd>Ctrl</kbd>", "press Ctrl")
    assert not keeps_every_word("- <div>alpha", "⦁ ")
