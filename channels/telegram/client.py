"""Telegram Bot API calls through aiogram, with Telegram's error semantics mapped to ``PlatformError``.

Every call that targets a chat honours that chat's 429 pause and records new ones; transient failures
(5xx, timeouts, network) are retried by the shared ``RetryPolicy``; the bot token, which is part of
every Bot API URL, is scrubbed from every error text before it can reach a log or an exception.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from aiogram import Bot
from aiogram.exceptions import (
    ClientDecodeError,
    TelegramAPIError,
    TelegramBadRequest,
    TelegramForbiddenError,
    TelegramNetworkError,
    TelegramNotFound,
    TelegramRetryAfter,
    TelegramServerError,
    TelegramUnauthorizedError,
)
from aiogram.methods import TelegramMethod

from channels.common.errors import PlatformError
from channels.common.retry import RetryPolicy
from channels.common.throttle import ChatThrottle

log = logging.getLogger(__name__)

T = TypeVar("T")

NOT_MODIFIED = "message is not modified"
_NOT_FOUND = ("message to edit not found", "message to delete not found", "message_id_invalid")
_FORMAT = ("can't parse entities", "entity", "entities")


class TelegramClient:
    def __init__(self, bot: Bot, throttle: ChatThrottle, retry: RetryPolicy | None = None) -> None:
        self.bot = bot
        self.throttle = throttle
        self.retry = retry or RetryPolicy()

    def scrub(self, text: str) -> str:
        token = self.bot.token
        return text.replace(token, "***") if token else text

    async def call(self, method: TelegramMethod[T], *, chat: str | None = None,
                   request_timeout: int | None = None) -> T | None:
        """Run one Bot API method (retrying transient failures). Returns None for "message is not
        modified", which is success: the message already shows the target state."""
        async def once() -> T | None:
            return await self._once(method, chat, request_timeout)
        return await self.retry.call(once)

    async def _once(self, method: TelegramMethod[T], chat: str | None, request_timeout: int | None) -> T | None:
        name = method.__api_method__
        try:
            return await self.bot(method, request_timeout=request_timeout)
        except TelegramRetryAfter as exc:
            if chat is not None:
                self.throttle.pause(chat, float(exc.retry_after))
            raise PlatformError(f"{name}: 429 retry after {exc.retry_after}s", kind="rate_limited",
                                retry_after=float(exc.retry_after)) from None
        except TelegramBadRequest as exc:
            desc = exc.message.lower()
            if NOT_MODIFIED in desc:
                return None
            kind: Any = "not_found" if any(s in desc for s in _NOT_FOUND) else \
                "format" if any(s in desc for s in _FORMAT) else "permanent"
            raise PlatformError(self._detail(name, exc), kind=kind) from None
        except (TelegramServerError, ClientDecodeError) as exc:
            raise PlatformError(self._detail(name, exc), kind="transient") from None
        except TelegramNetworkError as exc:
            # the request may have reached Telegram before the connection broke
            raise PlatformError(self._detail(name, exc), kind="transient", outcome_unknown=True) from None
        except (TelegramForbiddenError, TelegramUnauthorizedError, TelegramNotFound) as exc:
            raise PlatformError(self._detail(name, exc), kind="permanent") from None
        except TelegramAPIError as exc:
            raise PlatformError(self._detail(name, exc), kind="permanent") from None
        except TimeoutError:
            raise PlatformError(f"{name}: timed out", kind="transient", outcome_unknown=True) from None

    def _detail(self, name: str, exc: Exception) -> str:
        message = exc.message if isinstance(exc, TelegramAPIError) else str(exc)
        return self.scrub(f"{name}: {message}")
