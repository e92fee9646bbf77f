"""Builds the Feishu / Lark channel from its ``[channels.feishu]`` settings, its host and the HTTP application.

Webhook mode adds ``POST /feishu/events`` to the application (served by the [web] server).
"""

from __future__ import annotations

from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Throttle
from channels.feishu.channel import FeishuChannel, FeishuSettings
from channels.feishu.sdk_log import route_sdk_logging
from channels.feishu.settings import FeishuConfig
from core.host import ChannelHost


def create(config: FeishuConfig, host: ChannelHost, app: web.Application) -> FeishuChannel:
    route_sdk_logging()  # lark-oapi's lines through the bridge's log (secrets masked), not raw to stdout
    channel = FeishuChannel(host, FeishuSettings.of(config),
                            calls=Calls(Throttle(), CallPolicy(timeout=config.call_timeout_seconds)))
    if config.mode == "webhook":
        channel.routes(app)
    return channel
