"""Builds the Slack channel from its ``[channels.slack]`` settings, its host and the HTTP application.

HTTP mode adds ``POST /slack/events`` to the application (served by the [web] server). The Web API client
talks to ``api_base`` through one pooled aiohttp session, without slack_sdk's own retries (the channel's
call policy is the only retry layer).
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from slack_sdk.web.async_client import AsyncWebClient

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Throttle
from channels.slack.channel import SlackChannel, SlackSettings
from channels.slack.settings import SlackConfig
from core.host import ChannelHost

REQUEST_TIMEOUT = 30


def make_client(token: str, api_base: str) -> AsyncWebClient:
    base = api_base if api_base.endswith("/") else api_base + "/"
    return AsyncWebClient(token=token, base_url=base, session=aiohttp.ClientSession(), timeout=REQUEST_TIMEOUT,
                          retry_handlers=[])


def create(config: SlackConfig, host: ChannelHost, app: web.Application) -> SlackChannel:
    channel = SlackChannel(host, make_client(config.bot_token, config.api_base), SlackSettings.of(config),
                           app_token=config.app_token, signing_secret=config.signing_secret,
                           calls=Calls(Throttle(), CallPolicy(timeout=config.call_timeout_seconds)))
    if config.mode == "http":
        channel.routes(app)
    return channel
