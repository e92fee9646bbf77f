"""What every channel's settings model is built from: the table base, shared field types, and checks.

A channel package owns its ``[channels.<name>]`` table (``channels/<name>/settings.py``): a pydantic model
derived from :class:`Section`, built from the field types here, with a ``check`` method for the rules only
that channel knows (a key required in one mode, a URL that must be a URL). The bridge composes these
models into the operator config; ``chatbridge check`` and ``chatbridge run`` run the same checks, so they
never disagree about a file.

- :data:`Secret` marks a value that is masked in ``repr()``, in ``chatbridge check`` and in every error text,
  and redacted from the logs.
- :func:`env_default` names the environment variable a key is read from when the operator leaves it out of
  the table (DESIGN.md §6: ``token`` → ``${TELEGRAM_BOT_TOKEN}``).
- :data:`AllowFrom` (user ids or usernames, ``"*"`` for everyone) and :data:`GroupPolicy` are the same on
  every platform.
- :class:`Checks` collects cross-field problems as ``dotted.key: message`` lines; a required key whose
  ``${NAME}`` was unset names the variable instead of saying "got empty".
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from channels.common.masking import looks_secret

Loc = tuple[str | int, ...]
MissingEnv = Mapping[Loc, list[tuple[str, str]]]
"""Per config path: the environment variables it referenced that were unset or empty, with that state."""


# ---- field types ---------------------------------------------------------------------------------------


def _no_bool_int(value: Any) -> Any:
    if isinstance(value, bool):  # TOML true is not 1
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _no_bool_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


def _allow_entry(value: Any) -> Any:
    # Telegram/Slack/Feishu user ids may be written as TOML integers; usernames as strings.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and not value.strip():
        raise PydanticCustomError("allow_entry", "expected a user id or username, or \"*\"")
    return value.strip() if isinstance(value, str) else value


Int = Annotated[int, BeforeValidator(_no_bool_int)]
Float = Annotated[float, BeforeValidator(_no_bool_float)]
PositiveFloat = Annotated[Float, Field(gt=0)]
Secret = Annotated[str, Field(json_schema_extra={"secret": True})]
AllowFrom = list[Annotated[str, BeforeValidator(_allow_entry)]]
GroupPolicy = Literal["mention", "all", "off"]

EVERYONE: tuple[str, ...] = ("*",)
"""The default ``allow_from``: everyone may use the bot."""


def allow_everyone() -> list[str]:
    return list(EVERYONE)


@dataclass(frozen=True, slots=True)
class EnvDefault:
    """Field metadata: when the operator leaves the key out, it reads ``${variable}``."""

    variable: str


def env_default(variable: str) -> EnvDefault:
    return EnvDefault(variable)


def is_secret(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True


def env_default_of(info: FieldInfo) -> str | None:
    """The environment variable a left-out key falls back to, if it has one."""
    for meta in info.metadata:
        if isinstance(meta, EnvDefault):
            return meta.variable
    return None


class Section(BaseModel):
    """One table of the operator config: unknown keys are errors, secrets are masked in ``repr()``."""

    model_config = ConfigDict(extra="forbid")

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        fields = type(self).model_fields
        for name, value in super().__repr_args__():
            if name in fields and is_secret(fields[name]) and isinstance(value, dict):
                yield name, {key: "***" if item else "" for key, item in value.items()}
            elif name in fields and is_secret(fields[name]) and value:
                yield name, "***"
            else:
                yield name, value


# ---- checks --------------------------------------------------------------------------------------------


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def dotted(loc: Loc) -> str:
    """A key's path as the config file would write it: ``agent.subagents.profiles[0].name``; a key that TOML
    must quote is quoted (``profiles[0].":"``), so the path never reads as something else."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        key = part if _BARE_KEY.match(part) else json.dumps(part, ensure_ascii=False)
        out += f".{key}" if out else key
    return out or "(top level)"


def show_value(value: Any) -> str:
    """A short rendering of an operator's value for an error line (never used for secret keys; a value that
    looks like a credential, pasted into the wrong key, is not shown either)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and looks_secret(value):
        return "a value that looks like a secret, not shown"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def got(value: Any, env_names: list[str] | None = None) -> str:
    """"got <value>" for an error line, or the variables it came from (never echo what they hold)."""
    if env_names:
        return "got the value of " + ", ".join(f"${{{n}}}" for n in env_names)
    return f"got {show_value(value)}"


def url_problem(value: str, env_names: list[str] | None = None) -> str | None:
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    return None if ok else f"expected an http:// or https:// URL ({got(value, env_names)})"


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Checks:
    """Cross-field problems of one table, as ``dotted.key: message`` lines.

    Keys are given relative to the table (``at``), e.g. ``checks.require("token", ...)`` inside
    ``[channels.telegram]`` reports ``channels.telegram.token: ...``.
    """

    def __init__(self, at: Loc, missing: MissingEnv | None = None,
                 from_env: Mapping[Loc, list[str]] | None = None) -> None:
        self.at = at
        self.missing: MissingEnv = missing or {}
        self.from_env: Mapping[Loc, list[str]] = from_env or {}
        """Per config path: the environment variables its value came from (named instead of echoed)."""
        self.problems: list[str] = []

    def loc(self, key: str | Loc) -> Loc:
        return (*self.at, *((key,) if isinstance(key, str) else key))

    def add(self, key: str | Loc, message: str) -> None:
        self.problems.append(f"{dotted(self.loc(key))}: {message}")

    def unset_variables(self, key: str | Loc) -> str | None:
        """"environment variable X is not set" when the key's ``${X}`` was unset or empty."""
        refs = self.missing.get(self.loc(key))
        return "; ".join(f"environment variable {name} is {state}" for name, state in refs) if refs else None

    def require(self, key: str | Loc, value: str, why: str) -> None:
        """A key that must not be empty; names the unset variable when it came from ``${NAME}``."""
        unset = self.unset_variables(key)
        if unset:
            self.add(key, unset)
        elif not value.strip():
            self.add(key, f"required {why} (got empty)")

    def url(self, key: str | Loc, value: str) -> None:
        problem = url_problem(value, self.from_env.get(self.loc(key)))
        if problem:
            self.add(key, problem)


CALL_TIMEOUT_SECONDS = 30.0
"""The default (and the most) ``call_timeout_seconds``: the platform SDKs' own request timeouts are 30 s."""


class ChannelSection(Section):
    """The base of every ``[channels.<name>]`` table."""

    enabled: bool = False
    call_timeout_seconds: Annotated[PositiveFloat, Field(le=CALL_TIMEOUT_SECONDS)] = CALL_TIMEOUT_SECONDS
    """Bound on one attempt of a platform API call; one that takes longer is abandoned and counts as a
    transient failure (tried again under the call policy)."""

    def check(self, checks: Checks) -> None:
        """Add the problems of an enabled channel's settings (the bridge calls it only when enabled)."""

    def served_by_web(self) -> bool:
        """Whether this configuration receives through the [web] server (a webhook or HTTP mode)."""
        return False
