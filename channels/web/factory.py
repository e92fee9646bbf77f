"""Builds the web chat from its ``[web]`` settings and its host, on the bridge's HTTP application."""

from __future__ import annotations

from aiohttp import web

from channels.web.channel import UPDATE_INTERVAL, WebChannel
from channels.web.server import HEARTBEAT_SECONDS
from channels.web.settings import WebConfig
from channels.web.sse import StreamHub
from core.host import SessionHost


def build(host: SessionHost, app: web.Application, *, auth_token: str = "", hub: StreamHub | None = None,
          update_interval: float = UPDATE_INTERVAL, heartbeat: float = HEARTBEAT_SECONDS) -> WebChannel:
    """The web channel with its routes on ``app`` (tests tune the intervals and the stream hub)."""
    channel = WebChannel(host, auth_token=auth_token, hub=hub, update_interval=update_interval,
                         heartbeat=heartbeat)
    channel.install(app)
    return channel


def create(config: WebConfig, host: SessionHost, app: web.Application) -> WebChannel:
    return build(host, app, auth_token=config.auth_token)
