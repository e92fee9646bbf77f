"""Bridge factory for the web chat: registers the "web" ChannelPort and its routes, returns its runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from channels.web.channel import WebChannel
from channels.web.server import WebServer
from channels.web.sse import StreamHub
from core.runtime import ChatCore

if TYPE_CHECKING:  # channels do not import the bridge at run time (bridge → channels → core)
    from bridge.config import AppConfig

log = logging.getLogger(__name__)


class WebRuntime:
    name = "web"

    def __init__(self, core: ChatCore, channel: WebChannel, server: WebServer, *, sweep_interval: float = 60.0) -> None:
        self.core = core
        self.channel = channel
        self.server = server
        self._sweep_interval = sweep_interval
        self._sweeper: asyncio.Task[None] | None = None
        self._unsubscribe = core.events.subscribe(channel.on_core_event)
        self._state = "ready"

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="web:reclaim-idle-streams")
        self._state = "serving"

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            gone = self.channel.hub.reclaim_idle()
            if gone:
                log.debug("reclaimed %d idle web session streams", len(gone))

    async def stop(self) -> None:
        self.server.accepting = False
        self._state = "stopping"

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self._unsubscribe()
        await self.server.close()
        self._state = "closed"

    def state(self) -> str:
        return self._state


def build(core: ChatCore, app: web.Application, *, auth_token: str = "", hub: StreamHub | None = None,
          update_interval: float = 0.05, heartbeat: float = 15.0) -> WebRuntime:
    channel = WebChannel(hub, update_interval=update_interval)
    core.add_channel(channel)
    server = WebServer(core, channel, auth_token=auth_token, heartbeat=heartbeat)
    server.install(app)
    return WebRuntime(core, channel, server)


def create(config: AppConfig, core: ChatCore, app: web.Application) -> WebRuntime:
    return build(core, app, auth_token=config.web.auth_token)
