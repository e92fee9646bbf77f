"""Which channels this build has, and how the bridge builds one.

A channel package exposes a factory ``create(settings, host, app) -> Channel``: its settings model (its
config table), the host core gives it (``core.host``: a ``SessionHost`` for the web chat, a
``ChannelHost`` for a platform), and the aiohttp application, to which it adds its HTTP routes (webhooks,
the web chat) before the server starts. A factory may raise ``ChannelStartupError``. The bridge registers
the channel with core for delivery and drives its lifecycle (``core.channel.Channel``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from aiohttp import web

from core.channel import Channel
from core.host import CoreHost

ChannelFactory = Callable[[Any, CoreHost, web.Application], Channel]

# channel name → "module:function". A channel without an entry has no adapter in this build.
FACTORIES: dict[str, str] = {
    "web": "channels.web.factory:create",
    "telegram": "channels.telegram.factory:create",
    "slack": "channels.slack.factory:create",
    "feishu": "channels.feishu.factory:create",
}


def factory_for(name: str) -> ChannelFactory | None:
    target = FACTORIES.get(name)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    factory: ChannelFactory = getattr(importlib.import_module(module), attr)
    return factory


def preload(names: list[str]) -> None:
    """Import the factories of ``names`` now, before the event loop starts: lark-oapi binds its long
    connection to the event loop that exists when it is first imported, which must not be the bridge's."""
    for name in names:
        factory_for(name)
