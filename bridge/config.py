"""The operator config: one TOML file, validated by pydantic, `${NAME}` references read from the environment.

``load_config(path)`` returns an :class:`AppConfig` or raises :class:`ConfigError`, whose ``problems`` are
lines of the form ``dotted.key.path: what was wrong (what was expected)``. ``load_config(None)`` is the
embedded default: no file, every key at its default (web chat on 127.0.0.1:8765, the local model).

Secret fields are plain ``str`` values marked with ``json_schema_extra={"secret": True}``; they are masked in
``repr()``, in :meth:`AppConfig.masked_dump` and in every error message, and listed by
:meth:`AppConfig.secret_values` for the log redaction filter. Error messages and the dump also mask any
string that looks like a credential (``bridge.masking``): a secret pasted into the wrong key is not echoed.

A ``${NAME}`` that is unset or empty is an error where the value is required, and otherwise a warning
(collected by ``load_config(..., warnings=[])``; ``check`` and ``run`` print them). The model's ``api_key``
is required when the provider needs one: ``openai`` and ``anthropic`` need a key for every ``base_url`` that
is not on this machine (their official endpoints included); a server on this machine (Ollama, vLLM,
llama.cpp, a local proxy) is the operator's own and commonly takes requests without one, so there an empty
key is allowed (with a warning when it came from an unset variable). ``local`` uses no key.

A key left out of a channel table falls back to the environment variable named in DESIGN.md §6 (for example
``channels.telegram.token`` → ``TELEGRAM_BOT_TOKEN``); ``llm.api_key`` falls back to ``OPENAI_API_KEY`` or
``ANTHROPIC_API_KEY`` for those providers.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from bridge.masking import looks_secret, mask
from core.settings import CoreSettings

Loc = tuple[str | int, ...]
MissingEnv = dict[Loc, list[tuple[str, str]]]
"""Per config path: the environment variables it referenced that were unset or empty, with that state."""

DEFAULT_RETRY_DELAYS: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 30.0)
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


# ---- field types ---------------------------------------------------------------------------------------


def _no_bool_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _no_bool_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


def _empty_to_none(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


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


def _is_secret(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        fields = type(self).model_fields
        for name, value in super().__repr_args__():
            if name in fields and _is_secret(fields[name]) and isinstance(value, dict):
                yield name, {key: "***" if item else "" for key, item in value.items()}
            elif name in fields and _is_secret(fields[name]) and value:
                yield name, "***"
            else:
                yield name, value


# ---- sections ------------------------------------------------------------------------------------------


class BridgeConfig(_Section):
    data_dir: str = "data"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    shutdown_timeout: PositiveFloat = 10.0
    dedupe_ttl_hours: Annotated[Float, Field(ge=24)] = 48.0


LLM_DEFAULT_BASE_URLS: dict[str, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
LLM_KEY_ENV: dict[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


class LLMConfig(_Section):
    provider: Literal["openai", "anthropic", "local"] = "local"
    model: str = ""
    """Required for openai/anthropic; for local, "" means the bundled model."""
    base_url: str = ""
    """"" = the provider's official endpoint (see ``effective_base_url``)."""
    api_key: Secret = ""
    request_timeout: PositiveFloat = 60.0
    retry_delays: list[Annotated[Float, Field(ge=0)]] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_DELAYS)
    )
    context_window: Annotated[Int, Field(ge=1)] = 32_768
    max_output_tokens: Annotated[Annotated[Int, Field(ge=1)] | None, BeforeValidator(_empty_to_none)] = None
    model_path: Annotated[str | None, BeforeValidator(_empty_to_none)] = None
    temperature: Annotated[Annotated[Float, Field(ge=0, le=2)] | None, BeforeValidator(_empty_to_none)] = None

    @property
    def effective_base_url(self) -> str:
        return self.base_url or LLM_DEFAULT_BASE_URLS.get(self.provider, "")


MCP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def _mcp_name(value: Any) -> Any:
    if isinstance(value, str) and not MCP_NAME.match(value):
        raise PydanticCustomError("mcp_name", "expected letters, digits, '_' or '-' (it prefixes the tool names)")
    return value


class McpServerEntry(_Section):
    """One ``[[agent.mcp_servers]]`` entry: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    name: Annotated[str, BeforeValidator(_mcp_name)]
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra={"secret": True})
    """Every value is treated as a secret (masked, redacted from logs)."""
    url: str | None = None
    approval: Literal["ask", "auto", "deny"] = "ask"
    startup_timeout_seconds: PositiveFloat = 20.0
    call_timeout_seconds: PositiveFloat = 60.0


class FetchUrlConfig(_Section):
    enabled: bool = False
    max_bytes: Annotated[Int, Field(ge=1)] = 200_000
    timeout_seconds: PositiveFloat = 15.0


class AgentConfig(_Section):
    system_prompt: str = "You are a helpful assistant."
    max_turns: Annotated[Int, Field(ge=1)] = 20
    approval: Literal["ask", "auto", "deny"] = "ask"
    queue_capacity: Annotated[Int, Field(ge=1)] = 32
    session_idle_seconds: PositiveFloat = 300.0
    titles: bool = True
    approval_timeout_seconds: PositiveFloat = 600.0
    tool_approval: dict[str, Literal["ask", "auto", "deny"]] = Field(default_factory=dict)
    fetch_url: FetchUrlConfig = Field(default_factory=lambda: FetchUrlConfig())
    mcp_servers: list[McpServerEntry] = Field(default_factory=list)


class WebConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[Int, Field(ge=1, le=65535)] = 8765
    auth_token: Secret = ""


class TelegramConfig(_Section):
    enabled: bool = False
    token: Secret = ""
    api_base: str = "https://api.telegram.org"
    mode: Literal["polling", "webhook"] = "polling"
    webhook_url: str = ""
    webhook_secret: Secret = ""
    allow_from: AllowFrom = Field(default_factory=lambda: ["*"])
    group_policy: GroupPolicy = "mention"
    edit_interval_ms: Annotated[Int, Field(ge=100)] = 1000
    stream_transport: Literal["auto", "edit", "draft"] = "auto"


class SlackConfig(_Section):
    enabled: bool = False
    bot_token: Secret = ""
    app_token: Secret = ""
    signing_secret: Secret = ""
    mode: Literal["socket", "http"] = "socket"
    api_base: str = "https://slack.com/api/"
    allow_from: AllowFrom = Field(default_factory=lambda: ["*"])
    group_policy: GroupPolicy = "mention"


class FeishuConfig(_Section):
    enabled: bool = False
    app_id: str = ""
    app_secret: Secret = ""
    domain: str = "https://open.feishu.cn"
    mode: Literal["websocket", "webhook"] = "websocket"
    verification_token: Secret = ""
    encrypt_key: Secret = ""
    allow_from: AllowFrom = Field(default_factory=lambda: ["*"])
    group_policy: GroupPolicy = "mention"


class ChannelsConfig(_Section):
    telegram: TelegramConfig = Field(default_factory=TelegramConfig)
    slack: SlackConfig = Field(default_factory=SlackConfig)
    feishu: FeishuConfig = Field(default_factory=FeishuConfig)


# Keys that, when left out of their table, are read from the environment (DESIGN.md §6 defaults).
CHANNEL_ENV_DEFAULTS: dict[str, dict[str, str]] = {
    "telegram": {"token": "TELEGRAM_BOT_TOKEN"},
    "slack": {"bot_token": "SLACK_BOT_TOKEN", "app_token": "SLACK_APP_TOKEN"},
    "feishu": {"app_id": "FEISHU_APP_ID", "app_secret": "FEISHU_APP_SECRET"},
}


class AppConfig(_Section):
    """The whole operator config. Constructing one that is inconsistent raises :class:`ConfigError`."""

    bridge: BridgeConfig = Field(default_factory=BridgeConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    web: WebConfig = Field(default_factory=WebConfig)
    channels: ChannelsConfig = Field(default_factory=ChannelsConfig)

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
        return [name for name in ChannelsConfig.model_fields if getattr(self.channels, name).enabled]

    def secret_values(self) -> list[str]:
        """Every non-empty secret (enabled or not), longest first, for redacting logs."""
        values = {value for _, _, value in _iter_secrets(self) if value}
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
            session_idle_seconds=float(self.agent.session_idle_seconds),
            context_window=self.llm.context_window,
            retry_delays=tuple(float(d) for d in self.llm.retry_delays),
            request_timeout=float(self.llm.request_timeout),
            max_output_tokens=self.llm.max_output_tokens,
            temperature=float(self.llm.temperature) if self.llm.temperature is not None else None,
            dedupe_ttl_seconds=float(self.bridge.dedupe_ttl_hours) * 3600.0,
            shutdown_timeout=float(self.bridge.shutdown_timeout),
            titles=self.agent.titles,
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
        elif _is_secret(info) and isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, str):
                    yield (*loc, name, key), key, item
        elif _is_secret(info) and isinstance(value, str):
            yield (*loc, name), name, value


def _masked(model: BaseModel, secrets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _masked(value, secrets)
        elif _is_secret(info) and isinstance(value, dict):
            out[name] = {key: "***" if item else "" for key, item in value.items()}
        elif _is_secret(info):
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


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _url_problem(value: str, env_names: list[str] | None = None) -> str | None:
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    return None if ok else f"expected an http:// or https:// URL ({_got(value, env_names)})"


def _got(value: Any, env_names: list[str] | None) -> str:
    if env_names:  # the value came from the environment: name the variables, never echo what they hold
        return "got the value of " + ", ".join(f"${{{n}}}" for n in env_names)
    return f"got {_show(value)}"


def _cross_check(cfg: AppConfig, missing: Mapping[Loc, list[tuple[str, str]]],
                 from_env: Mapping[Loc, list[str]] | None = None) -> list[str]:
    problems: list[str] = []
    secrets = cfg.secret_values()
    from_env = from_env or {}

    def add(loc: Loc, message: str) -> None:
        problems.append(mask(f"{dotted(loc)}: {message}", secrets))

    def require(loc: Loc, value: str, why: str) -> None:
        refs = missing.get(loc)
        if refs:
            add(loc, "; ".join(f"environment variable {name} is {state}" for name, state in refs))
        elif not value.strip():
            add(loc, f"required {why} (got empty)")

    def url(loc: Loc, value: str) -> None:
        problem = _url_problem(value, from_env.get(loc))
        if problem:
            add(loc, problem)

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

    web = cfg.web
    if web.enabled:
        if not web.host.strip():
            add(("web", "host"), "expected a host name or address (got empty)")
        elif not is_loopback_host(web.host):
            require(
                ("web", "auth_token"),
                web.auth_token,
                f"when web.host is not a loopback address (host is {web.host!r})",
            )

    def needs_web(channel: str, mode: str) -> None:
        if not web.enabled:
            add(
                ("channels", channel, "mode"),
                f"mode {mode!r} is served by the web server, but [web] enabled = false "
                f"(enable [web] or use the other mode)",
            )

    tg = cfg.channels.telegram
    if tg.enabled:
        require(("channels", "telegram", "token"), tg.token, "when channels.telegram.enabled = true")
        url(("channels", "telegram", "api_base"), tg.api_base)
        if tg.mode == "webhook":
            needs_web("telegram", tg.mode)
            if tg.webhook_url:
                url(("channels", "telegram", "webhook_url"), tg.webhook_url)

    slack = cfg.channels.slack
    if slack.enabled:
        require(("channels", "slack", "bot_token"), slack.bot_token, "when channels.slack.enabled = true")
        if slack.mode == "socket":
            require(("channels", "slack", "app_token"), slack.app_token, "in socket mode")
        else:
            require(("channels", "slack", "signing_secret"), slack.signing_secret, "in http mode")
            needs_web("slack", slack.mode)
        url(("channels", "slack", "api_base"), slack.api_base)

    fs = cfg.channels.feishu
    if fs.enabled:
        require(("channels", "feishu", "app_id"), fs.app_id, "when channels.feishu.enabled = true")
        require(("channels", "feishu", "app_secret"), fs.app_secret, "when channels.feishu.enabled = true")
        if fs.mode == "webhook":
            require(("channels", "feishu", "verification_token"), fs.verification_token, "in webhook mode")
            needs_web("feishu", fs.mode)
        url(("channels", "feishu", "domain"), fs.domain)

    _check_mcp_servers(cfg, missing, from_env, add)

    if not web.enabled and not cfg.enabled_channels():
        add(("web", "enabled"), "nothing would run: the web chat and every channel are disabled")
    return problems


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
                problem = _url_problem(server.url, from_env.get((*at, "url")))
                if problem:
                    add((*at, "url"), problem)
            for key in ("args", "env"):
                if getattr(server, key):
                    add((*at, key), "only used with command (a stdio server); this one has url")


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


def _fill_env_defaults(data: dict[str, Any], resolver: _Resolver) -> None:
    """Keys the operator left out fall back to their environment variable (DESIGN.md §6 defaults)."""
    channels = data.get("channels")
    if isinstance(channels, dict):
        for channel, keys in CHANNEL_ENV_DEFAULTS.items():
            table = channels.get(channel)
            if isinstance(table, dict):
                for key, env_name in keys.items():
                    if key not in table:
                        table[key] = resolver.resolve(f"${{{env_name}}}", ("channels", channel, key))
                        resolver.implicit.add(("channels", channel, key))
    llm = data.get("llm")
    if isinstance(llm, dict) and "api_key" not in llm and llm.get("provider") in LLM_KEY_ENV:
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


def dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(top level)"


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
    return info is not None and _is_secret(info)


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


def _show(value: Any) -> str:
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
        got = f" ({_got(err.get('input'), resolver.from_env.get(loc))})"
    return f"{path}: {expected}{got}"
