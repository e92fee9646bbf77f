"""Tool-call arguments: checked against the tool's JSON schema, and shown as a person deciding should see them.

A call whose arguments are not a JSON object matching the tool's ``parameters`` schema never runs and is
never offered for approval: the model gets the reason as the call's output (``InvalidArguments``). The
check uses the ``jsonschema`` library (the dialect the schema names, Draft 2020-12 when it names none); a
tool whose schema is itself invalid is checked only for "a JSON object" and logged once. So is one whose
schema refers (``$ref``) to something it does not hold, such as a ``$defs`` entry an MCP server left out or
a remote document (never fetched): the reference is followed only when a call's arguments reach it, so that
shows at a call, not when the schema is compiled, and must not fail the turn.

What an approval shows (``shown_arguments``): every argument, its value as JSON text in full. The
schema's ``required`` arguments come first and are marked ``key`` — they say what the call does (for
``fetch_url``, the URL), so a channel with a length limit may shorten only the others. Characters that
could disguise a value on screen (control and format characters such as bidi overrides, line and paragraph
separators) are shown as ``\\u`` escapes of four hex digits (``\\u202e``).
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections.abc import Iterable
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing.exceptions import Unresolvable

from core.snapshot import ShownArgument

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 500
"""A rejection reason quotes the offending value; a huge one is cut (the model wrote it, it knows it)."""

_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})


class InvalidArguments(Exception):
    """The call's arguments do not fit the tool; the message is meant for the model."""


class ArgumentChecker:
    """One tool's schema, compiled once."""

    def __init__(self, tool_name: str, schema: dict[str, Any]) -> None:
        self.tool_name = tool_name
        self.schema = schema
        self._validator: Any = None
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls.check_schema(schema)
            self._validator = cls(schema)
        except SchemaError as exc:
            log.warning("tool %s has an invalid parameters schema (%s); its calls are checked only for a "
                        "JSON object", tool_name, exc.message)

    def parse(self, arguments: str) -> dict[str, Any]:
        """The arguments as a dict, or InvalidArguments saying what is wrong."""
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise InvalidArguments(f"the arguments are not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise InvalidArguments("the arguments must be a JSON object")
        if self._validator is not None:
            try:
                errors = list(self._validator.iter_errors(parsed))
            except Unresolvable as exc:
                log.warning("tool %s has a parameters schema whose reference %r cannot be resolved; its calls "
                            "are checked only for a JSON object", self.tool_name, exc.ref)
                self._validator = None
                return parsed
            if errors:
                raise InvalidArguments(_reason(errors))
        return parsed


def _reason(errors: list[ValidationError]) -> str:
    first = best_match(errors)
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in first.absolute_path)
    text = f"{where.lstrip('.')}: {first.message}" if where else first.message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def rejection(tool_name: str, reason: str) -> str:
    """The output a rejected call gets: what was wrong, and that nothing ran."""
    return (f"Tool call rejected: the arguments do not match the parameters of {tool_name} ({reason}). "
            "The tool did not run; call it again with valid arguments.")


def shown_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> tuple[ShownArgument, ...]:
    """Every argument for an approval request: the schema's required ones first (``key``), then the rest
    in the order the model wrote them. Values are JSON text, in full."""
    required = schema.get("required") if isinstance(schema, dict) else None
    key_names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict):  # the order the tool declares them in reads best
        key_names.sort(key=lambda n: list(props).index(n) if n in props else len(props))
    key = [n for n in key_names if n in arguments]
    others = [n for n in arguments if n not in key]
    return (*(_shown(n, arguments[n], True) for n in key), *(_shown(n, arguments[n], False) for n in others))


def arguments_text(shown: Iterable[ShownArgument]) -> str:
    """All arguments, one ``name=value`` line each (what a channel without a length limit shows)."""
    return "\n".join(f"{a.name}={a.value}" for a in shown)


def _shown(name: str, value: Any, key: bool) -> ShownArgument:
    return ShownArgument(visible(name), visible(json.dumps(value, ensure_ascii=False)), key)


def visible(text: str) -> str:
    """``text`` with every character that does not show as itself (controls, bidi and other format
    characters, separators, private use, unassigned) written as a ``\\u`` escape of four hex digits
    (``\\u202e``)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN_CATEGORIES else c for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
