"""Builds the Telegram channel from its ``[channels.telegram]`` settings, its host and the HTTP application.

Webhook mode adds ``POST /telegram/webhook`` to the application (served by the [web] server). A token that
cannot be a bot token raises ``ChannelStartupError``: ``chatbridge run`` reports it and exits.
"""

from __future__ import annotations

from aiogram import Bot
from aiogram.client.telegram import TelegramAPIServer
from aiogram.utils.token import TokenValidationError
from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import ChannelStartupError
from channels.common.throttle import Throttle
from channels.telegram.channel import TelegramChannel, TelegramSettings
from channels.telegram.client import Session
from channels.telegram.settings import TelegramConfig
from core.host import ChannelHost


def make_bot(token: str, api_base: str, *, connections: int = 100) -> Bot:
    """An aiogram Bot talking to ``api_base`` (api.telegram.org, a self-hosted Bot API server, a fake), over
    at most ``connections`` connections at once (new messages have a pool of their own, see ``client``)."""
    session = Session(api=TelegramAPIServer.from_base(api_base.rstrip("/")), limit=connections)
    return Bot(token=token, session=session)


def create(config: TelegramConfig, host: ChannelHost, app: web.Application) -> TelegramChannel:
    try:
        bot = make_bot(config.token, config.api_base)
    except TokenValidationError:
        raise ChannelStartupError("[channels.telegram] token is not a bot token (expected the form 123456:ABC-…, "
                                  "as @BotFather gives it)") from None
    channel = TelegramChannel(host, bot, TelegramSettings.of(config),
                              calls=Calls(Throttle(), CallPolicy(timeout=config.call_timeout_seconds)))
    if config.mode == "webhook":
        channel.routes(app)
    return channel
