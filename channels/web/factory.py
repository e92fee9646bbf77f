"""Bridge factory for the web chat: registers the "web" ChannelPort and its routes, returns its runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from channels.web.auth import load_cookie_key
from channels.web.channel import WebChannel
from channels.web.server import WebAccess, WebServer
from channels.web.sse import StreamHub
from core.runtime import ChatCore

if TYPE_CHECKING:  # channels do not import the bridge at run time (bridge → channels → core)
    from bridge.config import AppConfig

log = logging.getLogger(__name__)


class WebRuntime:
    name = "web"

    def __init__(self, core: ChatCore, channel: WebChannel, server: WebServer, *, sweep_interval: float = 60.0,
                 reap_interval: float = 1.0) -> None:
        self.core = core
        self.channel = channel
        self.server = server
        self._sweep_interval = sweep_interval
        self._reap_interval = reap_interval
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe = core.events.subscribe(channel.on_core_event)
        self._state = "ready"

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._sweep(), name="web:reclaim-idle-streams"),
                       asyncio.create_task(self._reap(), name="web:end-abandoned-streams")]
        self._state = "serving"

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            gone = self.channel.hub.reclaim_idle()
            if gone:
                log.debug("reclaimed %d idle web session streams", len(gone))

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval)
            self.server.reap_closed()

    async def stop(self) -> None:
        self.server.accepting = False
        self._state = "stopping"

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._unsubscribe()
        await self.server.close()
        self._state = "closed"

    def state(self) -> str:
        return self._state


def build(core: ChatCore, app: web.Application, *, access: WebAccess | None = None, hub: StreamHub | None = None,
          update_interval: float = 0.05, heartbeat: float = 15.0, reap_interval: float = 1.0) -> WebRuntime:
    channel = WebChannel(hub, update_interval=update_interval)
    core.add_channel(channel)
    server = WebServer(core, channel, access=access, heartbeat=heartbeat)
    server.install(app)
    return WebRuntime(core, channel, server, reap_interval=reap_interval)


def stream_cap_for_open_files(requested: int) -> int:
    """``requested``, lowered to half the process's open-file limit: streams past what the process can
    hold would starve every other connection (the listening socket's accept() fails with EMFILE)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return requested
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or requested <= soft // 2:
        return requested
    bound = max(1, soft // 2)
    log.warning("[web] max_streams = %d is more than this process can keep open (open-file limit %d); "
                "using %d (raise the limit with `ulimit -n` to allow more)", requested, soft, bound)
    return bound


def create(config: AppConfig, core: ChatCore, app: web.Application) -> WebRuntime:
    web_cfg = config.web
    max_streams = stream_cap_for_open_files(web_cfg.max_streams)
    access = WebAccess(
        auth_token=web_cfg.auth_token, bind_host=web_cfg.host, allowed_hosts=tuple(web_cfg.allowed_hosts),
        trusted_proxies=tuple(web_cfg.trusted_proxies), max_streams=max_streams,
        max_streams_per_client=min(web_cfg.max_streams_per_client, max_streams),
        cookie_key=load_cookie_key(Path(config.bridge.data_dir)) if web_cfg.auth_token else None)
    return build(core, app, access=access)
