"""Wiring and lifecycle of one chatbridge process: store, provider, core, HTTP server, channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from bridge.config import AppConfig
from bridge.logs import configure_logging
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMProvider
from core.runtime import ChatCore
from core.sqlite_store import SqliteStore

log = logging.getLogger("chatbridge")

EXIT_OK = 0
EXIT_STARTUP = 3


class StartupError(Exception):
    """The process cannot start with this config; the message tells the operator what to do."""


def build_provider(config: AppConfig) -> LLMProvider:
    llm = config.llm
    if llm.provider == "openai":
        return OpenAIProvider(model=llm.model, base_url=llm.effective_base_url, api_key=llm.api_key or "none",
                              request_timeout=float(llm.request_timeout))
    raise StartupError(
        f"[llm] provider = {llm.provider!r} is not available in this build of chatbridge. Set [llm] provider = "
        '"openai" with the base_url and api_key of any OpenAI-compatible endpoint (OpenAI, or a local server '
        'such as Ollama at "http://127.0.0.1:11434/v1"), then run `chatbridge run -c FILE`.')


def check_channels(config: AppConfig) -> None:
    enabled = config.enabled_channels()
    if enabled:
        raise StartupError(
            f"channel(s) {', '.join(enabled)} are enabled, but this build of chatbridge has no adapter for them "
            "yet. Set enabled = false in their [channels.*] tables.")


def build_http_app(core: ChatCore, config: AppConfig) -> web.Application:
    app = web.Application()

    async def healthz(_: web.Request) -> web.Response:
        channels = {name: "registered" for name in core.channels.names()}
        return web.json_response({"status": "ok", "channels": channels})

    app.router.add_get("/healthz", healthz)
    return app


async def run_app(config: AppConfig, *, config_path: str | None, stop: asyncio.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM (or ``stop`` is set); returns the process exit code."""
    configure_logging(config.bridge.log_level, config.secret_values())
    try:
        check_channels(config)
        provider = build_provider(config)
    except StartupError as exc:
        print(f"chatbridge: {exc}", file=sys.stderr)
        return EXIT_STARTUP

    data_dir = Path(config.bridge.data_dir)
    core = ChatCore(store=SqliteStore(data_dir / "chatbridge.db"), provider=provider,
                    settings=config.core_settings())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    runner: web.AppRunner | None = None
    try:
        await core.start()
        if config.web.enabled:
            runner = web.AppRunner(build_http_app(core, config), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, config.web.host, config.web.port)
            try:
                await site.start()
            except OSError as exc:
                print(f"chatbridge: cannot listen on {config.web.host}:{config.web.port}: {exc.strerror or exc}",
                      file=sys.stderr)
                return EXIT_STARTUP
            log.info("listening on http://%s:%d", config.web.host, config.web.port)
        log.info("chatbridge started (config: %s, data: %s)", config_path or "embedded default", data_dir)
        await stop.wait()
        log.info("shutting down")
        return EXIT_OK
    finally:
        if runner is not None:
            await runner.cleanup()
        stragglers = await core.shutdown()
        if stragglers:
            log.warning("abandoned tasks at shutdown: %s", ", ".join(stragglers))
