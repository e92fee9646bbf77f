"""SQLite ``GLOB`` patterns (the ``Store.list_sessions`` filter) as anchored PostgreSQL regular expressions.

``*`` is any run of characters, ``?`` one character, ``[...]`` a set (``[^...]`` its complement); every
other character stands for itself, case-sensitively, as in SQLite.
"""

from __future__ import annotations

import re


def glob_to_regex(pattern: str) -> str:
    out: list[str] = ["^"]
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "*":
            out.append(".*")
        elif char == "?":
            out.append(".")
        elif char == "[":
            start = i + 1 + (pattern[i + 1:i + 2] == "^")
            end = pattern.find("]", start + (pattern[start:start + 1] == "]"))  # a leading ] is a member
            if end < 0:  # an unclosed set matches nothing in SQLite
                return "^(?!)"
            body = pattern[i + 1:end]
            negate = body.startswith("^")
            out.append("[" + ("^" if negate else "") + _set_body(body[1:] if negate else body) + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    out.append("$")
    return "".join(out)


def _set_body(body: str) -> str:
    """A set's members and ``a-z`` ranges, with the characters a regular expression set treats specially
    escaped."""
    return "".join(c if c == "-" else "\\" + c if c in "\\^[]" else c for c in body)
