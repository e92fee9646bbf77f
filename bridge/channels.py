"""How the bridge plugs platform channels in: one factory per channel package.

A factory gets the config, the core and the aiohttp application (before it starts), registers its
``ChannelPort`` with the core, adds its HTTP routes (webhooks, the web chat) and returns a
``ChannelRuntime`` the bridge starts and stops.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from bridge.config import AppConfig
from core.runtime import ChatCore


class ChannelRuntime(Protocol):
    name: str

    async def start(self) -> None:
        """Begin receiving (long polling, socket connection, webhook registration)."""
        ...

    async def stop(self) -> None:
        """Stop receiving new input. Outbound calls must keep working until ``close``: the core still
        delivers the terminal state of running turns during its shutdown."""
        ...

    async def close(self) -> None:
        """Release transports; called after the core has shut down."""
        ...

    def state(self) -> str:
        """A short word for /healthz: "polling", "webhook", "connected", "serving", "error", ..."""
        ...


ChannelFactory = Callable[[AppConfig, ChatCore, web.Application], ChannelRuntime]

# channel name → "module:function". A channel without an entry has no adapter in this build.
FACTORIES: dict[str, str] = {
    "web": "channels.web.factory:create",
    "telegram": "channels.telegram.factory:create",
}


def factory_for(name: str) -> ChannelFactory | None:
    target = FACTORIES.get(name)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    factory: ChannelFactory = getattr(importlib.import_module(module), attr)
    return factory
