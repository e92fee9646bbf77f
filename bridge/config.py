"""The operator config: one TOML file, validated by pydantic, `${NAME}` references read from the environment.

``load_config(path)`` returns an :class:`AppConfig` or raises :class:`ConfigError`, whose ``problems`` are
lines of the form ``dotted.key.path: what was wrong (what was expected)``. ``load_config(None)`` is the
embedded default: no file, every key at its default (web chat on 127.0.0.1:8765, the local model).

Each channel package owns its table: ``[web]`` is ``channels.web.settings.WebConfig`` and
``[channels.<name>]`` is ``channels.<name>.settings``'s model, each with the checks only that channel knows;
this module composes them with the bridge's own tables and runs every check, so ``check`` and ``run``
agree. The field types they share (secrets, allow lists, group policy, environment defaults) are in
``channels.common.settings``.

Secret fields are plain ``str`` values marked with ``json_schema_extra={"secret": True}``; they are masked in
``repr()``, in :meth:`AppConfig.masked_dump` and in every error message, and listed by
:meth:`AppConfig.secret_values` for the log redaction filter. Error messages and the dump also mask any
string that looks like a credential (``channels.common.masking``): a secret pasted into the wrong key is not echoed.

A ``${NAME}`` that is unset or empty is an error where the value is required, and otherwise a warning
(collected by ``load_config(..., warnings=[])``; ``check`` and ``run`` print them). The model's ``api_key``
is required when the provider needs one: ``openai`` and ``anthropic`` need a key for every ``base_url`` that
is not on this machine (their official endpoints included); a server on this machine (Ollama, vLLM,
llama.cpp, a local proxy) is the operator's own and commonly takes requests without one, so there an empty
key is allowed (with a warning when it came from an unset variable). ``local`` uses no key.

A key left out of a channel table falls back to the environment variable its model names with
``env_default`` (DESIGN.md §6: ``channels.telegram.token`` → ``TELEGRAM_BOT_TOKEN``); ``llm.api_key`` falls
back to ``OPENAI_API_KEY`` or ``ANTHROPIC_API_KEY`` for those providers.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import unquote, urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from channels.common.masking import mask
from channels.common.settings import (
    ChannelSection,
    Checks,
    Float,
    Int,
    Loc,
    PositiveFloat,
    Secret,
    Section,
    dotted,
    env_default_of,
    is_loopback_host,
    is_secret,
    url_problem,
)
from channels.common.settings import (
    got as got_from,
)
from channels.feishu.settings import FeishuConfig
from channels.slack.settings import SlackConfig
from channels.telegram.settings import TelegramConfig
from channels.web.settings import WebConfig
from core.settings import CoreSettings, SubagentProfile, SubagentSettings
from core.tools.base import DEFAULT_APPROVAL
from core.tools.builtin import FetchUrl
from core.tools.mcp import DEFAULT_CALL_TIMEOUT, DEFAULT_STARTUP_TIMEOUT, NAME_PATTERN

__all__ = ["AppConfig", "ConfigError", "dotted", "is_loopback_host", "load_config"]

MissingEnv = dict[Loc, list[tuple[str, str]]]
"""Per config path: the environment variables it referenced that were unset or empty, with that state."""

CORE = CoreSettings()
"""Core's defaults: the keys that configure core take theirs from here, so each is defined once."""
EMBEDDED_DEFAULT = "the embedded default"


class ConfigError(Exception):
    """The config cannot be used.

    ``problems``: one line each; ``source``: the file (None: the embedded default).
    """

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


# ---- field types (the shared ones are in channels.common.settings) ---------------------------------------


def _empty_to_none(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _vision(value: Any) -> Any:
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() == "auto"):
        return value if isinstance(value, bool) else "auto"
    raise PydanticCustomError("vision", 'expected "auto", true or false')


# ---- sections ------------------------------------------------------------------------------------------


class BridgeConfig(Section):
    data_dir: str = "data"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    shutdown_timeout: PositiveFloat = CORE.shutdown_timeout
    dedupe_ttl_hours: Annotated[Float, Field(ge=24)] = CORE.dedupe_ttl_seconds / 3600


DSN_SCHEMES = ("postgresql", "postgres")


class StoreConfig(Section):
    """``[store]``: where the durable state lives. SQLite (a file in ``[bridge] data_dir``) is the default;
    ``postgresql`` keeps it on a PostgreSQL server reached through ``dsn``."""

    backend: Annotated[Literal["sqlite", "postgresql"], BeforeValidator(_lower)] = "sqlite"
    dsn: Secret = ""
    """``postgresql://USER:PASSWORD@HOST:PORT/DATABASE``; a secret (it may hold the password)."""
    pool_size: Annotated[Int, Field(ge=1, le=1000)] = 10
    lease_seconds: Annotated[Float, Field(ge=1, le=600)] = 10.0
    """With several processes on one PostgreSQL database: how long a process holds a session it stopped
    renewing (a process that died leaves its sessions to the others after at most this long)."""

    def dsn_password(self) -> str:
        """The password inside ``dsn`` (also redacted from logs on its own), or ""."""
        try:
            return unquote(urlsplit(self.dsn).password or "")
        except ValueError:
            return ""


LLM_DEFAULT_BASE_URLS: dict[str, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
LLM_KEY_ENV: dict[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


class LLMConfig(Section):
    provider: Literal["openai", "anthropic", "local"] = "local"
    model: str = ""
    """Required for openai/anthropic; for local, "" means the bundled model."""
    base_url: str = ""
    """"" = the provider's official endpoint (see ``effective_base_url``)."""
    api_key: Secret = ""
    request_timeout: PositiveFloat = CORE.request_timeout
    retry_delays: list[Annotated[Float, Field(ge=0)]] = Field(default_factory=lambda: list(CORE.retry_delays))
    context_window: Annotated[Int, Field(ge=1)] = CORE.context_window
    max_output_tokens: Annotated[Annotated[Int, Field(ge=1)] | None, BeforeValidator(_empty_to_none)] = None
    model_path: Annotated[str | None, BeforeValidator(_empty_to_none)] = None
    temperature: Annotated[Annotated[Float, Field(ge=0, le=2)] | None, BeforeValidator(_empty_to_none)] = None
    vision: Annotated[Literal["auto"] | bool, BeforeValidator(_vision)] = CORE.vision

    @property
    def effective_base_url(self) -> str:
        return self.base_url or LLM_DEFAULT_BASE_URLS.get(self.provider, "")


class TranscriptionConfig(Section):
    """``[media.transcription]``: an OpenAI-compatible ``/audio/transcriptions`` endpoint; off while ``model``
    is empty."""

    base_url: str = ""
    model: str = ""
    api_key: Secret = ""

    @property
    def enabled(self) -> bool:
        return bool(self.model.strip())


class MediaConfig(Section):
    max_bytes: Annotated[Int, Field(ge=1)] = CORE.media_max_bytes
    max_files: Annotated[Int, Field(ge=1)] = CORE.media_max_files
    keep_hours: PositiveFloat = CORE.media_keep_seconds / 3600
    transcription: TranscriptionConfig = Field(default_factory=TranscriptionConfig)


def _mcp_name(value: Any) -> Any:
    if isinstance(value, str) and not NAME_PATTERN.match(value):
        raise PydanticCustomError("mcp_name", "expected letters, digits, '_' or '-' (it prefixes the tool names)")
    return value


class McpServerEntry(Section):
    """One ``[[agent.mcp_servers]]`` entry: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    name: Annotated[str, BeforeValidator(_mcp_name)]
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra={"secret": True})
    """Every value is treated as a secret (masked, redacted from logs)."""
    url: str | None = None
    """Its user info and query are secrets (an HTTP server's only way to take credentials): see ``url_secrets``."""
    approval: Literal["ask", "auto", "deny"] = DEFAULT_APPROVAL
    startup_timeout_seconds: PositiveFloat = DEFAULT_STARTUP_TIMEOUT
    call_timeout_seconds: PositiveFloat = DEFAULT_CALL_TIMEOUT

    def url_secrets(self) -> set[str]:
        """The parts of ``url`` that carry credentials (user name, password, query), as written and decoded."""
        if not self.url:
            return set()
        try:
            parts = urlsplit(self.url)
            found = [p for p in (parts.username, parts.password, parts.query) if p]
        except ValueError:  # an unparsable URL is refused when the server starts; mask it whole meanwhile
            found = [self.url]
        return {*found, *(unquote(p) for p in found)}


class FetchUrlConfig(Section):
    enabled: bool = False
    max_bytes: Annotated[Int, Field(ge=1)] = FetchUrl.MAX_BYTES
    timeout_seconds: PositiveFloat = FetchUrl.TIMEOUT_SECONDS


def _tool_name(value: Any) -> Any:
    if isinstance(value, str) and not NAME_PATTERN.match(value):
        raise PydanticCustomError("tool_name", "expected a tool name: letters, digits, '_' or '-'")
    return value


class SubagentProfileEntry(Section):
    """One ``[[agent.subagents.profiles]]`` entry: how a child session with this profile runs."""

    name: Annotated[str, BeforeValidator(_tool_name)]
    system_prompt: Annotated[str | None, BeforeValidator(_empty_to_none)] = None
    tools: list[Annotated[str, BeforeValidator(_tool_name)]] | None = None
    max_turns: Annotated[Int, Field(ge=1)] | None = None
    model: Annotated[str | None, BeforeValidator(_empty_to_none)] = None


class SubagentsConfig(Section):
    enabled: bool = False
    max_depth: Annotated[Int, Field(ge=1, le=3)] = CORE.subagents.max_depth
    max_concurrent: Annotated[Int, Field(ge=1)] = CORE.subagents.max_concurrent
    profiles: list[SubagentProfileEntry] = Field(default_factory=list)

    def settings(self) -> SubagentSettings:
        return SubagentSettings(
            enabled=self.enabled, max_depth=self.max_depth, max_concurrent=self.max_concurrent,
            profiles=tuple(SubagentProfile(name=p.name, system_prompt=p.system_prompt,
                                           tools=tuple(p.tools) if p.tools is not None else None,
                                           max_turns=p.max_turns, model=p.model) for p in self.profiles))


class AgentConfig(Section):
    system_prompt: str = CORE.system_prompt
    max_turns: Annotated[Int, Field(ge=1)] = CORE.max_turns
    approval: Literal["ask", "auto", "deny"] = DEFAULT_APPROVAL
    queue_capacity: Annotated[Int, Field(ge=1)] = CORE.queue_capacity
    resume_max_age_seconds: Annotated[Float, Field(ge=0)] = CORE.resume_max_age
    session_idle_seconds: PositiveFloat = CORE.session_idle_seconds
    titles: bool = CORE.titles
    approval_timeout_seconds: PositiveFloat = CORE.approval_timeout
    tool_approval: dict[str, Literal["ask", "auto", "deny"]] = Field(default_factory=dict)
    fetch_url: FetchUrlConfig = Field(default_factory=lambda: FetchUrlConfig())
    mcp_servers: list[McpServerEntry] = Field(default_factory=list)
    subagents: SubagentsConfig = Field(default_factory=lambda: SubagentsConfig())


class ChannelsConfig(Section):
    """``[channels.*]``: one table per platform, each modelled in its channel package."""

    telegram: TelegramConfig = Field(default_factory=TelegramConfig)
    slack: SlackConfig = Field(default_factory=SlackConfig)
    feishu: FeishuConfig = Field(default_factory=FeishuConfig)

    def sections(self) -> dict[str, ChannelSection]:
        return {name: getattr(self, name) for name in type(self).model_fields}


class AppConfig(Section):
    """The whole operator config. Constructing one that is inconsistent raises :class:`ConfigError`."""

    bridge: BridgeConfig = Field(default_factory=BridgeConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    media: MediaConfig = Field(default_factory=MediaConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    web: WebConfig = Field(default_factory=WebConfig)
    channels: ChannelsConfig = Field(default_factory=ChannelsConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> AppConfig:
        context = info.context if isinstance(info.context, dict) else {}
        missing: Mapping[Loc, list[tuple[str, str]]] = context.get("missing_env") or {}
        problems = _cross_check(self, missing, context.get("from_env") or {})
        if problems:
            raise ConfigError(problems)  # not a ValueError: pydantic lets it through unchanged
        warnings = context.get("warnings")
        if isinstance(warnings, list):
            warnings.extend(_unset_warnings(self, missing, context.get("implicit_env") or set()))
        return self

    # ---- views ---------------------------------------------------------------------------------------

    def enabled_channels(self) -> list[str]:
        return [name for name, section in self.channels.sections().items() if section.enabled]

    def secret_values(self) -> list[str]:
        """Every non-empty secret (enabled or not), longest first, for redacting logs."""
        values = {value for _, _, value in _iter_secrets(self) if value}
        values.add(self.store.dsn_password())
        for server in self.agent.mcp_servers:
            values |= server.url_secrets()
        values.discard("")
        return sorted(values, key=lambda v: (-len(v), v))

    def masked_dump(self) -> dict[str, Any]:
        """The resolved config as plain data; secrets are "***" (empty ones stay "")."""
        secrets = self.secret_values()
        return _masked(self, secrets)

    def core_settings(self) -> CoreSettings:
        return CoreSettings(
            system_prompt=self.agent.system_prompt,
            max_turns=self.agent.max_turns,
            approval_timeout=float(self.agent.approval_timeout_seconds),
            queue_capacity=self.agent.queue_capacity,
            resume_max_age=float(self.agent.resume_max_age_seconds),
            session_idle_seconds=float(self.agent.session_idle_seconds),
            context_window=self.llm.context_window,
            retry_delays=tuple(float(d) for d in self.llm.retry_delays),
            request_timeout=float(self.llm.request_timeout),
            max_output_tokens=self.llm.max_output_tokens,
            temperature=float(self.llm.temperature) if self.llm.temperature is not None else None,
            dedupe_ttl_seconds=float(self.bridge.dedupe_ttl_hours) * 3600.0,
            shutdown_timeout=float(self.bridge.shutdown_timeout),
            titles=self.agent.titles,
            vision=self.llm.vision,
            media_max_bytes=self.media.max_bytes,
            media_max_files=self.media.max_files,
            media_keep_seconds=float(self.media.keep_hours) * 3600.0,
            subagents=self.agent.subagents.settings(),
        )


def _iter_secrets(model: BaseModel, loc: Loc = ()) -> Iterator[tuple[Loc, str, str]]:
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _iter_secrets(value, (*loc, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _iter_secrets(item, (*loc, name, i))
        elif is_secret(info) and isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, str):
                    yield (*loc, name, key), key, item
        elif is_secret(info) and isinstance(value, str):
            yield (*loc, name), name, value


def _masked(model: BaseModel, secrets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _masked(value, secrets)
        elif is_secret(info) and isinstance(value, dict):
            out[name] = {key: "***" if item else "" for key, item in value.items()}
        elif is_secret(info):
            out[name] = "***" if value else ""
        elif isinstance(value, str):
            out[name] = _scrub(value, secrets)
        elif isinstance(value, list):
            out[name] = [_masked(v, secrets) if isinstance(v, BaseModel) else _scrub(v, secrets)
                         if isinstance(v, str) else v for v in value]
        else:
            out[name] = value
    return out


def _scrub(text: str, secrets: list[str]) -> str:
    # A secret pasted into a non-secret key (a URL, the system prompt) must not leak either.
    return mask(text, secrets)


# ---- cross-field checks ----------------------------------------------------------------------------------


def _cross_check(cfg: AppConfig, missing: Mapping[Loc, list[tuple[str, str]]],
                 from_env: Mapping[Loc, list[str]] | None = None) -> list[str]:
    """Every cross-field problem, with secret values and credential-shaped strings masked."""
    from_env = from_env or {}
    checks = Checks((), missing, from_env)
    add, require, url = checks.add, checks.require, checks.url

    if not cfg.bridge.data_dir.strip():
        add(("bridge", "data_dir"), "expected a directory path (got empty)")

    llm = cfg.llm
    if llm.base_url:
        url(("llm", "base_url"), llm.base_url)
    if llm.provider in ("openai", "anthropic"):
        if not llm.model.strip():
            example = "gpt-4o-mini" if llm.provider == "openai" else "claude-sonnet-4-5"
            add(("llm", "model"), f"required for provider {llm.provider!r} (e.g. {example!r})")
        host = _url_host(llm.base_url) if llm.base_url else None
        if not (host and is_loopback_host(host)):
            env_name = LLM_KEY_ENV[llm.provider]
            require(
                ("llm", "api_key"),
                llm.api_key,
                f"for provider {llm.provider!r} unless base_url points at this machine "
                f"(set api_key = \"${{{env_name}}}\")",
            )
    if llm.model_path is not None and llm.provider != "local":
        add(("llm", "model_path"), f"only used with provider 'local' (provider is {llm.provider!r})")

    transcription = cfg.media.transcription
    if transcription.enabled:
        at = ("media", "transcription")
        if not transcription.base_url.strip():
            add((*at, "base_url"), "required when model is set (e.g. \"https://api.openai.com/v1\")")
        else:
            url((*at, "base_url"), transcription.base_url)
            host = _url_host(transcription.base_url)
            if not (host and is_loopback_host(host)):
                require((*at, "api_key"), transcription.api_key,
                        "unless base_url points at this machine (e.g. api_key = \"${OPENAI_API_KEY}\")")
    elif transcription.base_url.strip() or transcription.api_key:
        add(("media", "transcription", "model"),
            "required to transcribe (e.g. \"whisper-1\"); without it base_url and api_key are not used")

    _check_store(cfg, checks)

    web = Checks(("web",), missing, from_env)
    cfg.web.check(web)
    problems = [*checks.problems, *web.problems]

    # Each enabled channel checks its own table; whether the web server is there to serve it is ours.
    for name, section in cfg.channels.sections().items():
        if not section.enabled:
            continue
        channel = Checks(("channels", name), missing, from_env)
        section.check(channel)
        if section.served_by_web() and not cfg.web.enabled:
            mode = getattr(section, "mode", "")
            channel.add("mode", f"mode {mode!r} is served by the web server, but [web] enabled = false "
                                "(enable [web] or use the other mode)")
        problems.extend(channel.problems)

    rest = Checks((), missing, from_env)
    _check_mcp_servers(cfg, missing, from_env, rest.add)
    _check_subagents(cfg, rest.add)
    if not cfg.web.enabled and not cfg.enabled_channels():
        rest.add(("web", "enabled"), "nothing would run: the web chat and every channel are disabled")
    secrets = cfg.secret_values()
    return [mask(p, secrets) for p in [*problems, *rest.problems]]


def _check_store(cfg: AppConfig, checks: Checks) -> None:
    store = cfg.store
    at = ("store", "dsn")
    if store.backend == "sqlite":
        if store.dsn.strip():
            checks.add(at, "only used with backend 'postgresql' (backend is 'sqlite': the database is a file "
                           "in [bridge] data_dir)")
        return
    example = 'e.g. dsn = "${CHATBRIDGE_DSN}" holding postgresql://USER:PASSWORD@HOST:5432/DATABASE'
    checks.require(at, store.dsn, f"for backend 'postgresql' ({example})")
    if not store.dsn.strip() or checks.unset_variables(at):
        return
    try:
        parts = urlsplit(store.dsn.strip())
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        checks.add(at, f"not a usable connection URI ({example})")
        return
    if parts.scheme not in DSN_SCHEMES:
        checks.add(at, f"expected a postgresql:// URI ({example})")


def _check_mcp_servers(cfg: AppConfig, missing: Mapping[Loc, list[tuple[str, str]]],
                       from_env: Mapping[Loc, list[str]], add: Callable[[Loc, str], None]) -> None:
    seen: dict[str, int] = {}
    for i, server in enumerate(cfg.agent.mcp_servers):
        at: Loc = ("agent", "mcp_servers", i)
        for loc, refs in missing.items():
            if loc[: len(at)] == at:
                add(loc, "; ".join(f"environment variable {name} is {state}" for name, state in refs))
        if server.name in seen:
            add((*at, "name"), f"duplicate name {server.name!r} (also agent.mcp_servers[{seen[server.name]}])")
        seen.setdefault(server.name, i)
        if (server.command is None) == (server.url is None):
            add(at, "give exactly one of command (a stdio server) and url (a streamable-HTTP server)")
        elif server.command is not None:
            if not server.command.strip() and (*at, "command") not in missing:
                add((*at, "command"), "expected the server's executable (got empty)")
        else:
            assert server.url is not None
            if (*at, "url") not in missing:
                problem = url_problem(server.url, from_env.get((*at, "url")))
                if problem:
                    add((*at, "url"), problem)
            for key in ("args", "env"):
                if getattr(server, key):
                    add((*at, key), "only used with command (a stdio server); this one has url")


def _check_subagents(cfg: AppConfig, add: Callable[[Loc, str], None]) -> None:
    sub = cfg.agent.subagents
    seen: dict[str, int] = {}
    for i, profile in enumerate(sub.profiles):
        at: Loc = ("agent", "subagents", "profiles", i)
        if profile.name in seen:
            add((*at, "name"), f"duplicate name {profile.name!r} (also agent.subagents.profiles[{seen[profile.name]}])")
        seen.setdefault(profile.name, i)
        if profile.tools is not None and "run_subagent" in profile.tools and sub.max_depth < 2:
            add((*at, "tools"), "lists run_subagent, but max_depth = 1 lets no subagent start another "
                                "(raise agent.subagents.max_depth or remove it)")


def _url_host(value: str) -> str | None:
    try:
        return urlsplit(value).hostname
    except ValueError:
        return None


def _unset_warnings(cfg: AppConfig, missing: Mapping[Loc, list[tuple[str, str]]],
                    implicit: set[Loc]) -> list[str]:
    """One line per ``${NAME}`` the operator wrote that is unset or empty where that is allowed (where it
    is not, :func:`_cross_check` already made it an error). Fallbacks the operator did not write (a channel
    token read from its conventional variable) are not mentioned."""
    lines: list[str] = []
    for loc, refs in missing.items():
        if loc in implicit:
            continue
        unset = "; ".join(f"environment variable {name} is {state}" for name, state in refs)
        if loc == ("llm", "api_key"):
            if cfg.llm.provider == "local":
                consequence = "the local provider uses no key"
            else:
                consequence = (f"no key is sent to {cfg.llm.effective_base_url} (fine only if that server "
                               "takes requests without one)")
        else:
            consequence = "the value is empty"
        lines.append(f"{dotted(loc)}: {unset}; {consequence}")
    return lines


# ---- loading -------------------------------------------------------------------------------------------

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_TOML_POS = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$", re.S)


class _Resolver:
    """Replaces ``${NAME}`` / ``${NAME:-default}`` in every string, remembering unset and empty variables."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.missing: MissingEnv = {}
        self.from_env: dict[Loc, list[str]] = {}
        self.implicit: set[Loc] = set()
        """Keys filled from their conventional variable because the operator left them out."""

    def resolve(self, value: Any, loc: Loc = ()) -> Any:
        if isinstance(value, str):
            return self._string(value, loc)
        if isinstance(value, dict):
            return {key: self.resolve(item, (*loc, key)) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item, (*loc, i)) for i, item in enumerate(value)]
        return value

    def _string(self, text: str, loc: Loc) -> str:
        names: list[str] = []
        missing: list[tuple[str, str]] = []

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            names.append(name)
            got = self.env.get(name)
            if default is not None:  # ${NAME:-default}: the default when NAME is unset or empty
                return got if got else default
            if got is None:
                missing.append((name, "not set"))
                return ""
            if got == "":
                missing.append((name, "empty"))
            return got

        out = _ENV_REF.sub(substitute, text)
        if names:
            self.from_env[loc] = names
        if missing:
            self.missing[loc] = missing
        return out


def _read_toml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{source}: file not found (create one with `chatbridge init {source}`)", source=source
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file", source=source) from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the file ({exc.strerror or exc})", source=source) from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        problem = f"{source}: not UTF-8 text (bad byte at offset {exc.start})"
        raise ConfigError(problem, source=source) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_POS.match(str(exc))
        if match:
            where = f"line {match['line']}, column {match['col']}"
            message = match["msg"]
        else:
            where, message = "", str(exc)
        prefix = f"{source}, {where}" if where else source
        raise ConfigError(f"{prefix}: invalid TOML: {message}", source=source) from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"{source}: invalid TOML: arrays or inline tables nested too deeply",
                          source=source) from None


def _fill_env_defaults(data: dict[str, Any], resolver: _Resolver) -> None:
    """Keys the operator left out fall back to their environment variable (DESIGN.md §6 defaults)."""
    channels = data.get("channels")
    if isinstance(channels, dict):
        for channel, info in ChannelsConfig.model_fields.items():
            table = channels.get(channel)
            model = info.annotation
            if not isinstance(table, dict) or not (isinstance(model, type) and issubclass(model, BaseModel)):
                continue
            for key, field in model.model_fields.items():
                env_name = env_default_of(field)
                if env_name is not None and key not in table:
                    table[key] = resolver.resolve(f"${{{env_name}}}", ("channels", channel, key))
                    resolver.implicit.add(("channels", channel, key))
    llm = data.get("llm")
    provider = llm.get("provider") if isinstance(llm, dict) else None
    # a provider of the wrong type (a list, a table) is reported by validation, not looked up here
    if isinstance(llm, dict) and "api_key" not in llm and isinstance(provider, str) and provider in LLM_KEY_ENV:
        llm["api_key"] = resolver.resolve(f"${{{LLM_KEY_ENV[llm['provider']]}}}", ("llm", "api_key"))
        resolver.implicit.add(("llm", "api_key"))


def load_config(path: str | Path | None, *, env: Mapping[str, str] | None = None,
                warnings: list[str] | None = None) -> AppConfig:
    """Load, resolve and validate the config at ``path`` (None: the embedded default). ``warnings``, if
    given, receives one line per thing that may be wrong but does not stop the config from being used."""
    environ: Mapping[str, str] = os.environ if env is None else env
    source = None if path is None else str(path)
    raw: dict[str, Any] = {} if path is None else _read_toml(Path(path))
    resolver = _Resolver(environ)
    data = resolver.resolve(raw)
    _fill_env_defaults(data, resolver)
    context = {"missing_env": resolver.missing, "from_env": resolver.from_env, "implicit_env": resolver.implicit}
    secrets = [value for loc, value in _leaves(data) if _secret_loc(loc)]
    try:
        found: list[str] = []
        config = AppConfig.model_validate(data, context={**context, "warnings": found})
        if warnings is not None:
            warnings.extend(mask(w, secrets) for w in found)
        return config
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems = [mask(_describe(err, resolver), secrets) for err in errors]
    except ConfigError as exc:
        raise ConfigError([mask(p, secrets) for p in exc.problems], source=source) from None
    # Report the cross-field problems too, so one `check` lists everything: validate again with the
    # offending keys removed (they take their defaults) and keep what that second pass finds.
    for err in errors:
        _prune(data, tuple(err["loc"]))
    try:
        AppConfig.model_validate(data, context=context)
    except ConfigError as exc:
        problems.extend(mask(p, secrets) for p in exc.problems)
    except ValidationError:
        pass
    raise ConfigError(list(dict.fromkeys(problems)), source=source)


def _leaves(value: Any, loc: Loc = ()) -> Iterator[tuple[Loc, str]]:
    """Every string in the raw config data with its path (to find the secret ones before validation)."""
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*loc, i))


def _prune(data: dict[str, Any], loc: Loc) -> None:
    table: Any = data
    for i, part in enumerate(loc):
        if not isinstance(table, dict) or not isinstance(part, str) or part not in table:
            return
        last = i == len(loc) - 1 or not isinstance(loc[i + 1], str)
        if last:
            del table[part]
            return
        table = table[part]


# ---- describing validation errors ------------------------------------------------------------------------


def _model_at(loc: Loc) -> type[BaseModel] | None:
    model: type[BaseModel] = AppConfig
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        info = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = info.annotation if info else None
        if get_origin(annotation) is list and parts and isinstance(parts[0], int):
            parts.pop(0)  # an entry of a list of tables, e.g. agent.mcp_servers[0]
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _secret_loc(loc: Loc) -> bool:
    if len(loc) >= 2 and isinstance(loc[-1], str) and _secret_loc(loc[:-1]):
        return True  # a value inside a secret table (agent.mcp_servers[0].env.TOKEN)
    model = _model_at(loc[:-1])
    info = model.model_fields.get(loc[-1]) if model and loc and isinstance(loc[-1], str) else None
    return info is not None and is_secret(info)


def _unknown_key(loc: Loc) -> str:
    key = loc[-1]
    parent = _model_at(loc[:-1])
    if not isinstance(key, str) or parent is None:
        return "unknown key"
    if not loc[:-1] and key in ChannelsConfig.model_fields:
        return f"unknown key (did you mean [channels.{key}]?)"
    close = difflib.get_close_matches(key, list(parent.model_fields), n=1, cutoff=0.6)
    return f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _expected(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "literal_error":
        choices = re.findall(r"'((?:[^'\\]|\\.)*)'", str(ctx.get("expected", "")))
        return "expected one of " + ", ".join(choices)
    simple = {
        "string_type": "expected a string",
        "int_type": "expected an integer",
        "int_parsing": "expected an integer",
        "int_from_float": "expected an integer",
        "float_type": "expected a number",
        "float_parsing": "expected a number",
        "bool_type": "expected true or false",
        "bool_parsing": "expected true or false",
        "list_type": "expected a list",
        "model_type": "expected a table",
        "model_attributes_type": "expected a table",
        "dict_type": "expected a table",
    }
    if kind in simple:
        return simple[kind]
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        bound = next(iter(ctx.values()), "?")
        return f"expected a value {bounds[kind]} {_number(bound)}"
    message = str(err.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def _describe(err: Mapping[str, Any], resolver: _Resolver) -> str:
    loc: Loc = tuple(err["loc"])
    path = dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{path}: {_unknown_key(loc)}"
    if kind == "missing":
        return f"{path}: required key is missing"
    expected = _expected(err)
    refs = resolver.missing.get(loc)
    if refs:
        unset = "; ".join(f"environment variable {name} is {state}" for name, state in refs)
        return f"{path}: {unset} ({expected})"
    if _secret_loc(loc):
        got = ""  # never echo what might be a secret
    else:
        got = f" ({got_from(err.get('input'), resolver.from_env.get(loc))})"
    return f"{path}: {expected}{got}"
