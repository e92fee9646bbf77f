"""Builds the web chat from its ``[web]`` settings and its host, on the bridge's HTTP application."""

from __future__ import annotations

import logging

from aiohttp import web

from channels.web.channel import REAP_INTERVAL, UPDATE_INTERVAL, WebChannel
from channels.web.server import HEARTBEAT_SECONDS, WebAccess
from channels.web.settings import WebConfig
from channels.web.sse import StreamHub
from core.host import SessionHost

log = logging.getLogger(__name__)


def build(host: SessionHost, app: web.Application, *, access: WebAccess | None = None, hub: StreamHub | None = None,
          update_interval: float = UPDATE_INTERVAL, heartbeat: float = HEARTBEAT_SECONDS,
          reap_interval: float = REAP_INTERVAL) -> WebChannel:
    """The web channel with its routes on ``app`` (tests tune the intervals and the stream hub)."""
    channel = WebChannel(host, access=access, hub=hub, update_interval=update_interval, heartbeat=heartbeat,
                         reap_interval=reap_interval)
    channel.install(app)
    return channel


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


def create(config: WebConfig, host: SessionHost, app: web.Application) -> WebChannel:
    max_streams = stream_cap_for_open_files(config.max_streams)
    access = WebAccess(
        auth_token=config.auth_token, bind_host=config.host, allowed_hosts=tuple(config.allowed_hosts),
        trusted_proxies=tuple(config.trusted_proxies), max_streams=max_streams,
        max_streams_per_client=min(config.max_streams_per_client, max_streams))
    return build(host, app, access=access)
