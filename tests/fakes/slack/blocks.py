"""Block Kit as the Slack fake checks and shows it: Slack's limits on blocks, and the words a block shows."""

from __future__ import annotations

from typing import Any

MARKDOWN_LIMIT = 12000
"""markdown_text per call, and all markdown blocks of one payload together."""
SECTION_TEXT_LIMIT = 3000
MAX_BLOCKS = 50


class SlackError(Exception):
    """A Web API error answered as HTTP 200 ``{"ok": false, "error": error, **extra}``."""

    def __init__(self, error: str, **extra: Any) -> None:
        super().__init__(error)
        self.error = error
        self.extra = extra


def check_blocks(blocks: Any) -> list[dict[str, Any]]:
    if not isinstance(blocks, list) or len(blocks) > MAX_BLOCKS:
        raise SlackError("invalid_blocks")
    markdown_total = 0
    for block in blocks:
        if not isinstance(block, dict):
            raise SlackError("invalid_blocks")
        kind = block.get("type")
        if kind == "markdown":
            text = block.get("text")
            if not isinstance(text, str) or not text:
                raise SlackError("invalid_blocks")
            markdown_total += len(text)
        elif kind == "section":
            text = block.get("text") or {}
            if not block.get("fields") and not str(text.get("text") or "").strip():
                raise SlackError("invalid_blocks")
            if len(str(text.get("text") or "")) > SECTION_TEXT_LIMIT:
                raise SlackError("invalid_blocks")
        elif kind == "header":
            if len(str((block.get("text") or {}).get("text") or "")) > 150:
                raise SlackError("invalid_blocks")
        elif kind == "actions":
            elements = block.get("elements") or []
            if not elements or len(elements) > 25:
                raise SlackError("invalid_blocks")
            ids = [e.get("action_id") for e in elements]
            if len(set(ids)) != len(ids):
                raise SlackError("invalid_blocks")
            for e in elements:
                if e.get("type") == "button" and (
                        len(str((e.get("text") or {}).get("text") or "")) > 75
                        or len(str(e.get("value") or "")) > 2000
                        or len(str(e.get("action_id") or "")) > 255):
                    raise SlackError("invalid_blocks")
        elif kind not in ("context", "divider", "rich_text", "image"):
            raise SlackError("invalid_blocks")
    if markdown_total > MARKDOWN_LIMIT:
        raise SlackError("msg_blocks_too_long")
    return [dict(b) for b in blocks]


def block_text(block: dict[str, Any]) -> str:
    """The visible words of one Block Kit block (buttons as ``[label]``)."""
    kind = block.get("type")
    if kind == "markdown":
        return str(block.get("text") or "")
    if kind in ("section", "header"):
        parts = [str((block.get("text") or {}).get("text") or "")]
        parts += [str(f.get("text") or "") for f in block.get("fields") or []]
        return "\n".join(p for p in parts if p)
    if kind == "context":
        return " ".join(str(e.get("text") or "") for e in block.get("elements") or [])
    if kind == "actions":
        return " ".join(f"[{(e.get('text') or {}).get('text', '')}]" for e in block.get("elements") or [])
    if kind == "rich_text":
        return "".join(_rich_text(e) for e in block.get("elements") or [])
    return ""


def _rich_text(element: dict[str, Any]) -> str:
    if "elements" in element:
        return "".join(_rich_text(e) for e in element["elements"])
    return str(element.get("text") or element.get("url") or "")
