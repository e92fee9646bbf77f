"""Builds the Telegram channel from the operator config (the bridge's plug-in point)."""

from __future__ import annotations

from aiogram import Bot
from aiogram.client.session.aiohttp import AiohttpSession
from aiogram.client.telegram import TelegramAPIServer
from aiogram.utils.token import TokenValidationError
from aiohttp import web

from bridge.app import StartupError
from bridge.config import AppConfig
from channels.telegram.channel import TelegramChannel, TelegramSettings
from core.runtime import ChatCore


def make_bot(token: str, api_base: str) -> Bot:
    """An aiogram Bot talking to ``api_base`` (api.telegram.org, a self-hosted Bot API server, a fake)."""
    session = AiohttpSession(api=TelegramAPIServer.from_base(api_base.rstrip("/")))
    return Bot(token=token, session=session)


def create(config: AppConfig, core: ChatCore, app: web.Application) -> TelegramChannel:
    tg = config.channels.telegram
    if tg.mode == "webhook":
        missing = [k for k in ("webhook_url", "webhook_secret") if not getattr(tg, k)]
        if missing:
            raise StartupError(
                f"[channels.telegram] mode = \"webhook\" needs {' and '.join(missing)}: webhook_url is the public "
                "HTTPS address that reaches /telegram/webhook on the [web] server, webhook_secret a random string "
                "Telegram sends back with every update.")
    try:
        bot = make_bot(tg.token, tg.api_base)
    except TokenValidationError:
        raise StartupError("[channels.telegram] token is not a bot token (expected the form 123456:ABC-…, "
                           "as @BotFather gives it)") from None
    channel = TelegramChannel(core, bot, TelegramSettings(
        mode=tg.mode, webhook_url=tg.webhook_url, webhook_secret=tg.webhook_secret,
        allow_from=tuple(tg.allow_from), group_policy=tg.group_policy, edit_interval=tg.edit_interval_ms / 1000,
        stream_transport=tg.stream_transport))
    core.add_channel(channel)
    if tg.mode == "webhook":
        channel.routes(app)
    return channel
