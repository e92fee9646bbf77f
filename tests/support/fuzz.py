"""Hypothesis strategies for hostile input, and a way to drive a property against a running async server.

The strategies produce what a platform, a client or an operator could send that a well-behaved one would
not: unicode edges (lone surrogates, NULs, bidirectional controls, zero-width joiners, combining marks,
astral characters), wrong types, huge numbers, NaN and infinities, deep nesting and long strings — all of
bounded size, so a property's run stays short.

``drive`` runs a synchronous hypothesis test from an async test: the property runs on a worker thread and
hands each example to the test's own event loop (where the fakes and the bridge live), with a bound on
each example so that a hung handler fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")

EDGE_CHARS = [
    "\x00", "\ud800", "\udfff", "\udc00", "\u202e", "\u202d", "\u200f", "\u200e", "\u2066", "\u2069",
    "\u200b", "\u200d", "\ufeff", "\u0301", "\U0001f600", "\U0001f469\u200d\U0001f4bb", "\r", "\n", "\t",
    "\x1b", "\x7f", "\u0085", "\u2028", "\u2029", "\uffff", "\U0010ffff", "ｆ", "𝐛𝐨𝐥𝐝", "ß", "İ",
]
"""Characters that have broken text handling somewhere: surrogates, controls, direction marks, joiners."""

any_char = st.characters(exclude_categories=())  # every code point, lone surrogates included
edge_text = st.lists(st.one_of(st.sampled_from(EDGE_CHARS), any_char,
                               st.text(alphabet="ab _*`[]()#<>&@!|~-=.:/\\\"'{}", max_size=4)),
                     max_size=40).map("".join)
"""Short strings mixing edge characters, any code point and Markdown/JSON/markup metacharacters."""

long_text = st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\U0001f600", "\x00", "*", "<"]),
                      st.integers(min_value=1_000, max_value=70_000))
"""A long run of one character: oversized fields (up to 70,000 characters, well past every platform limit)."""

text = st.one_of(edge_text, edge_text, st.text(max_size=20), long_text)

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)


def json_like(leaves: st.SearchStrategy[Any] = scalars, *, max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Nested lists and objects (keys fuzzed too) of ``leaves``."""
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(edge_text, st.text(max_size=8)), inner, max_size=4)), max_leaves=max_leaves)


def deep(value: Any, depth: int) -> Any:
    """``value`` wrapped in ``depth`` lists (far deeper than any handler should recurse)."""
    for _ in range(depth):
        value = [value]
    return value


def fuzz_fields(known: dict[str, st.SearchStrategy[Any]], *, extra: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """An object with any subset of ``known`` fields (each from its strategy or any JSON value) and some
    unknown ones: the shape a platform sends, with every field possibly missing or of the wrong type."""
    values = {k: st.one_of(s, json_like()) for k, s in known.items()}
    base = st.fixed_dictionaries({}, optional=values)
    if not extra:
        return base
    return st.builds(lambda b, x: {**x, **b}, base, st.dictionaries(st.text(max_size=6), scalars, max_size=2))


def json_body(value: Any) -> bytes:
    """``value`` as a JSON document, the way a hostile client may write it: lone surrogates as ``\\ud800``
    escapes (valid JSON, invalid as UTF-8 text once decoded), NaN and Infinity as the bare words some
    parsers accept."""
    return json.dumps(value, ensure_ascii=True, allow_nan=True).encode()


def finite(value: Any) -> bool:
    return not (isinstance(value, float) and (math.isnan(value) or math.isinf(value)))


def drive(loop: asyncio.AbstractEventLoop, check: Callable[..., Coroutine[Any, Any, None]],
          *, per_example: float = 20.0) -> Callable[..., None]:
    """A synchronous callable for ``@given`` (strategies by keyword) that runs ``check(**kwargs)`` on ``loop``
    and waits for it (bounded: a handler that hangs fails the example instead of the whole run)."""

    def run(**kwargs: Any) -> None:
        future = asyncio.run_coroutine_threadsafe(check(**kwargs), loop)
        try:
            future.result(per_example)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer within {per_example}s: a hung handler") from None

    return run


async def in_thread(test: Callable[[], None]) -> None:
    """Run a hypothesis test (built with :func:`drive`) while this loop keeps serving the examples."""
    await asyncio.to_thread(test)


async def bounded(step: Awaitable[T], seconds: float = 20.0) -> T:
    async with asyncio.timeout(seconds):
        return await step
