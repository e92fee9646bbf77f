"""Sound text: strings that can be encoded as UTF-8, so SQLite, JSON encoders and every platform accept them.

A Python ``str`` may hold surrogate code points (U+D800–U+DFFF): a JSON ``"\\ud800"`` escape decodes to one.
They cannot be encoded as UTF-8, so one such character in a model's chunk, a user's message or a title made
the whole answer, message or rename fail where it was stored or sent. Text is made sound once, where it
enters core — provider events (``core.llm.provider``), inbound envelopes (``core.envelope``), renames
(``ChatCore.rename``), tool outputs (``core.agent.loop``) — and is trusted from there on.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def sound_text(text: str) -> str:
    """``text`` with every unpaired surrogate replaced by U+FFFD (a high and low surrogate that stand side by
    side become the one character they encode). Text without surrogates is returned as it is."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    # UTF-16 is where surrogates mean something: pairs decode to their character, the rest to U+FFFD
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def sound_value(value: Any) -> Any:
    """``sound_text`` on every string inside a JSON-like value (dict keys included)."""
    if isinstance(value, str):
        return sound_text(value)
    if isinstance(value, dict):
        return {sound_value(k): sound_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(sound_value(v) for v in value)
    return value
