"""Fuzzing the config loader: random TOML documents built from the real keys (and unknown ones), with values
of every TOML type in the right or the wrong place, ``${VAR}`` references, unicode edges and garbage text.

The property: ``load_config`` gives a usable config (its ``check`` view and its core settings build), or a
``ConfigError`` whose every line names where the problem is — a dotted key path that exists in the document
(or the table it belongs to), or the file itself for text that is not TOML — and never any other exception,
which ``chatbridge check`` and ``run`` would show as a traceback."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from bridge.cli import main as cli_main
from bridge.config import AppConfig, ConfigError, load_config
from tests.support.fuzz import edge_text

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tables(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], list[str]]:
    """Every table of the config and its keys, read from the models themselves (so new keys are fuzzed too)."""
    out: dict[tuple[str, ...], list[str]] = {prefix: []}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_tables(annotation, (*prefix, name)))
        else:
            out[prefix].append(name)
    return out


TABLES = _tables(AppConfig)
SECTIONS = [t for t in TABLES if t]


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (a lone surrogate's escape is invalid TOML: an error)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


strings = st.one_of(
    st.sampled_from(["", " ", "openai", "anthropic", "local", "polling", "webhook", "http", "socket", "*",
                     "@alice", "ask", "auto", "deny", "mention", "all", "off", "debug", "127.0.0.1", "0.0.0.0",
                     "https://bot.example.com/telegram/webhook", "http://127.0.0.1:11434/v1", "sk-" + "a" * 40,
                     "123456:" + "A" * 35, "${TOKEN}", "${UNSET}", "${EMPTY}", "${TOKEN:-x}", "${", "$${X}",
                     "data", "/nonexistent/dir", "fetch_url", "current_time", "npx", "files"]),
    edge_text,
)
toml_scalars = st.one_of(strings, st.booleans(), st.integers(-(2**63), 2**63 - 1),
                         st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, -1, 65536, 10**9]))
values = st.recursive(toml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(["name", "command", "args", "env", "url", "approval", "TOKEN",
                                               "fetch_url"]), edge_text), inner, max_size=3)), max_leaves=6)


@st.composite
def documents(draw: st.DrawFn) -> str:
    lines: list[str] = []
    for table in draw(st.lists(st.sampled_from(SECTIONS), max_size=4, unique=True)):
        keys = TABLES[table] + ["unknown_key", "modle", "enabled"]
        entries = draw(st.dictionaries(st.sampled_from(keys), values, max_size=5))
        lines.append("[" + ".".join(table) + "]")
        lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in entries.items())
    if draw(st.booleans()):
        for _ in range(draw(st.integers(1, 2))):
            server = draw(st.dictionaries(st.sampled_from(["name", "command", "args", "env", "url", "approval",
                                                           "startup_timeout_seconds", "call_timeout_seconds",
                                                           "bogus"]), values, max_size=5))
            lines.append("[[agent.mcp_servers]]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in server.items())
    if draw(st.booleans()):  # a top-level key or table of the wrong kind
        lines.insert(0, f"{draw(st.sampled_from(['llm', 'web', 'channels', 'bogus']))} = "
                        f"{toml_value(draw(toml_scalars))}")
    return "\n".join(lines) + "\n"


ENV = {"TOKEN": "s3cret-from-env-0123456789", "EMPTY": ""}
_LINE = re.compile(r'^(?P<path>(?:[^:\s"]|"(?:[^"\\]|\\.)*")+): ')
"""A problem line: the key's path (a key TOML must quote is quoted, and may hold a colon), then the problem."""


def _roots(document: str) -> set[str]:
    """The names a problem line may start with: every table and key written in the document (and the
    sections a key may be filled into)."""
    roots = {".".join(t) for t in SECTIONS} | {"llm", "web", "agent", "bridge", "channels", "(top level)"}
    for line in document.splitlines():
        m = re.match(r"^\[+([^\]]+)\]+", line)
        if m:
            roots.add(m.group(1))
        m = re.match(r'^("?[^=]+?"?)\s*=', line)
        if m:
            roots.add(m.group(1).strip('"'))
    return roots


def assert_loads_or_names_the_key(document: str, path: Path) -> None:
    path.write_text(document, encoding="utf-8", errors="surrogatepass")
    try:
        config = load_config(path, env=ENV)
    except ConfigError as exc:
        assert exc.problems
        roots = _roots(document)
        for problem in exc.problems:
            assert problem.strip(), exc.problems
            if problem.startswith(str(path)):
                continue  # not TOML / not readable: the file is named
            m = _LINE.match(problem)
            assert m, f"no key path in {problem!r}"
            head = m.group("path")
            top = re.split(r"[.\[]", head, maxsplit=1)[0]
            assert head in roots or top in roots or any(head.startswith(r) for r in roots), (problem, roots)
            assert ENV["TOKEN"] not in problem
        return
    json.dumps(config.masked_dump(), ensure_ascii=False)
    config.core_settings()
    assert ENV["TOKEN"] not in json.dumps(config.masked_dump())


@FUZZ
@given(documents())
@example('[agent.subagents]\nprofiles = [{":" = "/nonexistent/dir"}]\n')  # a key that must be quoted
def test_any_document_of_real_keys_loads_or_names_the_bad_key(document: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        assert_loads_or_names_the_key(document, Path(tmp) / "c.toml")


@FUZZ
@given(st.one_of(edge_text, st.text(alphabet='[]=."\'#\n ab{},\\${}', max_size=80)))
def test_text_that_is_not_toml_is_named_as_such(document: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        assert_loads_or_names_the_key(document, Path(tmp) / "c.toml")


def test_bytes_that_are_not_utf8_and_deep_nesting_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[llm]\nmodel = \"\xff\xfe\"\n")
    try:
        load_config(bad, env={})
    except ConfigError as exc:
        assert exc.problems == [f"{bad}: not UTF-8 text (bad byte at offset 15)"]
    deep = tmp_path / "deep.toml"
    deep.write_text("[llm]\nmodel = " + "[" * 5000 + "]" * 5000 + "\n")
    try:
        load_config(deep, env={})
    except ConfigError as exc:
        assert all(p.startswith((str(deep), "llm.model")) for p in exc.problems), exc.problems
    else:
        raise AssertionError("a list is not a model name")


def test_check_prints_no_traceback_for_wrong_types_anywhere(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('llm = 5\nweb = "x"\n[channels]\ntelegram = []\n[agent]\nmcp_servers = {name = 1}\n'
                   'tool_approval = ["x"]\n')
    assert cli_main(["check", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "llm: expected a table" in err, err


WRONG = [["x"], {"a": 1}, True, 2**63 - 1, -1, float("nan"), float("inf"), "\u202e\x00", "${UNSET}", ""]


def test_every_key_with_a_value_of_every_wrong_kind_loads_or_names_the_key(tmp_path: Path) -> None:
    """The sweep the random documents may miss: each key of each table alone, with each kind of value."""
    path = tmp_path / "c.toml"
    for table, keys in TABLES.items():
        for key in keys:
            for value in WRONG:
                line = f"{toml_key(key)} = {toml_value(value)}"
                document = f"[{'.'.join(table)}]\n{line}\n" if table else f"{line}\n"
                try:
                    assert_loads_or_names_the_key(document, path)
                except AssertionError:
                    raise
                except Exception as exc:
                    raise AssertionError(f"{document!r} raised {exc!r}") from exc
