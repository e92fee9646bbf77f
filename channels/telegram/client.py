"""Telegram Bot API calls through aiogram, with Telegram's error semantics mapped to ``PlatformError``.

``once`` is one attempt of one Bot API method; ``call`` runs it under the channel's one call policy
(``channels.common.calls``): paced in the chat's scope (``edit_interval`` between two calls to a chat, a
429's retry_after pausing the chat) and, for a new message, in the bot's scope too (Telegram's Bots FAQ:
no more than about 30 messages a second over all chats; edits are not named there and do not count),
transient failures retried within the policy's bound, a send whose
outcome is unknown repeated at most once (the Bot API has no idempotency key).

New messages go out on a connection pool of their own (``sender``): the bot's budget counts them where
Telegram receives them, so a send must leave at the slot it booked. On the pool every other call uses, a
send whose slot has come would wait behind edits booked after it whenever that pool is full (a thousand
chats streaming at once), and sends held back that way arrive together, past the budget. Even on their own
pool, sends that left at the pace reached Telegram up to 1.2 s after they left while the
bridge's event loop was busy (measured from the call's start to the fake's arrival), bunched past 30 in a second:
a new message also passes an ``ArrivalBudget`` of 30 a second (``BOT_SEND_LIMIT``), which keeps every second
within it however they bunch (``channels.common.arrivals``; within 30 in every second is within the bucket of
30 refilled at 30 a second that a burst-tolerant count would be). The bot token, which is
part of every Bot API URL, is scrubbed from every error text before it can reach a log or an exception. An
answer aiogram cannot read is reported by what went wrong, never by its content (users' messages); a
``getUpdates`` answer aiogram refuses for one update is read update by update (``channels.telegram.updates``).

Which failures of a call may have been carried out (``PlatformError.outcome_unknown``: a new message is then
repeated at most once, and no fallback follows): a timeout or a broken connection, an answer of 500, 504 or
any other server error but the two a gateway gives when Telegram's servers did not take the request at all
(502 Bad Gateway, 503 Service Unavailable: Telegram being down answers those to every call, and a reply
refused that way is sent again later), and an answer that cannot be read. An unreadable answer with a 2xx
status was carried out: it is not repeated at all. For that the session (``Session``) keeps the HTTP status of
an answer it could not read or that reported a server error.

A group upgraded to a supergroup has a new chat id (Telegram answers the old one with ``migrate_to_chat_id``):
the call is made again in the new chat at once, and every later call to the old chat goes to the new one.
``on_move`` is told of the upgrade first (the channel keeps it durably: the new chat goes on in the old chat's
session, ``TelegramChannel.remember_move``), and ``moved`` is filled at start from what it kept.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from aiogram import Bot
from aiogram.client.session.aiohttp import AiohttpSession
from aiogram.exceptions import (
    ClientDecodeError,
    RestartingTelegram,
    TelegramAPIError,
    TelegramBadRequest,
    TelegramEntityTooLarge,
    TelegramForbiddenError,
    TelegramMigrateToChat,
    TelegramNetworkError,
    TelegramNotFound,
    TelegramRetryAfter,
    TelegramServerError,
    TelegramUnauthorizedError,
)
from aiogram.methods import GetUpdates, Response, SendMessage, TelegramMethod
from aiogram.methods.base import TelegramType

from channels.common.arrivals import ArrivalBudget
from channels.common.calls import Calls
from channels.common.errors import PlatformError
from channels.common.throttle import Scope
from channels.telegram.updates import read_updates

log = logging.getLogger(__name__)

T = TypeVar("T")

NOT_MODIFIED = "message is not modified"
_NOT_FOUND = ("message to edit not found", "message to delete not found", "message_id_invalid")
_FORMAT = ("can't parse entities", "entity", "entities")


NOT_TAKEN = frozenset({502, 503})
"""Server errors that mean Telegram's servers never took the request (a gateway in front of them answers)."""


class UnreadableAnswer(ClientDecodeError):
    """An answer aiogram could not read, with its HTTP status."""

    def __init__(self, exc: ClientDecodeError, status: int) -> None:
        super().__init__(exc.message, exc.original, exc.data)
        self.status = status


class ServerFailure(TelegramServerError):
    """A server error (5xx) with its HTTP status."""

    def __init__(self, exc: TelegramServerError, status: int) -> None:
        super().__init__(exc.method, exc.message)
        self.status = status


class Session(AiohttpSession):
    """aiogram's aiohttp session, keeping the HTTP status of an answer that failed to read or reported a
    server error (aiogram's own exceptions do not carry it): it tells whether the call may have been
    carried out."""

    def check_response(self, bot: Bot, method: TelegramMethod[TelegramType], status_code: int,
                       content: str) -> Response[TelegramType]:
        try:
            return super().check_response(bot, method, status_code, content)
        except ClientDecodeError as exc:
            raise UnreadableAnswer(exc, status_code) from exc.original
        except TelegramServerError as exc:
            if type(exc) is not TelegramServerError:  # RestartingTelegram: not taken, and kept as it is
                raise
            raise ServerFailure(exc, status_code) from None


def _maybe_taken(exc: Exception) -> bool:
    """Whether a failed call may have been carried out all the same (see the module docstring)."""
    if isinstance(exc, UnreadableAnswer):
        return exc.status not in NOT_TAKEN
    if isinstance(exc, RestartingTelegram):
        return False
    if isinstance(exc, ServerFailure):
        return exc.status not in NOT_TAKEN
    return isinstance(exc, (ClientDecodeError, TelegramServerError))  # from a session of another kind


BOT_SEND_LIMIT = 30
"""New messages Telegram takes from a bot in a second over all chats (its Bots FAQ: "about 30")."""
CHAT_BURST = 2
"""Calls a chat takes at once: Telegram allows short bursts over its one message a second in a chat, and the end
of a turn uses one call of it (``throttle.ending``), so the whole reply shows without waiting for the next slot."""


class TelegramClient:
    def __init__(self, bot: Bot, calls: Calls, *, chat_interval: float, bot_sends_per_second: float) -> None:
        self.bot = bot
        self.sender = Bot(token=bot.token, session=Session(api=bot.session.api), default=bot.default)
        """The same bot on its own connections, for new messages only."""
        self.calls = calls
        self.chat_interval = chat_interval
        self.sends = Scope("bot:sends", 1.0 / bot_sends_per_second)
        """The bot's budget of new messages, shared by every chat."""
        self.arrivals = ArrivalBudget(BOT_SEND_LIMIT)
        """The same budget where Telegram counts it: new messages in flight or answered within the last second."""
        self.moved: dict[int, int] = {}
        """Groups upgraded to supergroups: the old chat id, the new one."""
        self.on_move: Callable[[int, int], Awaitable[None]] | None = None
        """Told of a group found upgraded (the old chat id, the new one) before the call is made again there;
        it must not raise."""
        self.on_poll_failure: Callable[[], None] | None = None
        """Told of every failed attempt of ``getUpdates`` (one the call policy retries too): receiving is held
        up, so an album's rest may be waiting at Telegram (``Albums.pause``)."""
        self._answer_models: dict[type[TelegramMethod[Any]], object] = {}
        """aiogram reads every answer into ``Response[<the method's result type>]``, a pydantic generic model
        that pydantic caches only weakly: once the garbage collector had freed it, the next call built the
        model again (about 6 ms each; a fortieth of the bridge's CPU at 1,000 chats streaming). Holding the
        model of every method this client calls keeps it cached."""

    def scope(self, chat: str) -> Scope:
        """A chat's budget: one call per ``chat_interval``."""
        return Scope(f"chat:{chat}", self.chat_interval, CHAT_BURST)

    def scopes(self, chat: str, method: TelegramMethod[Any]) -> tuple[Scope, ...]:
        """What a call of ``method`` to ``chat`` counts against: the chat, and the bot's sends for a new
        message (the chat first: a 429, which names no scope, pauses it)."""
        return (self.scope(chat), self.sends) if isinstance(method, SendMessage) else (self.scope(chat),)

    async def close(self) -> None:
        await self.sender.session.close()

    def scrub(self, text: str) -> str:
        token = self.bot.token
        return text.replace(token, "***") if token else text

    async def call(self, method: TelegramMethod[T], *, chat: str | None = None, paced: bool = True,
                   retry: bool = True, request_timeout: int | None = None, once_if_unsure: bool = False) -> T | None:
        """Run one Bot API method under the call policy (paced in ``chat``'s scopes when given). Returns None
        for "message is not modified", which is success: the message already shows the target state.
        ``once_if_unsure``: a new message that must never show twice (an approval request's keyboard) is not
        repeated once a try's outcome is unknown; the call fails with ``outcome_unknown`` instead."""
        return await self.calls.call(
            lambda: self.once(method, request_timeout), scopes=self.scopes(chat, method) if chat is not None else (),
            paced=paced, retry=retry, idempotent=not isinstance(method, SendMessage),
            timeout=request_timeout + 10 if request_timeout is not None else None, repeat=once_if_unsure)

    async def once(self, method: TelegramMethod[T], request_timeout: int | None = None) -> T | None:
        """One attempt of one Bot API method (in a group's new chat when it was upgraded to a supergroup)."""
        chat_id = getattr(method, "chat_id", None)
        if isinstance(chat_id, int) and chat_id in self.moved:
            method = method.model_copy(update={"chat_id": self.moved[chat_id]})
        for _ in range(2):  # an upgrade is followed once, not a chat that moves again at once
            try:
                return await self._once(method, request_timeout)
            except PlatformError:
                if isinstance(method, GetUpdates) and self.on_poll_failure is not None:
                    self.on_poll_failure()
                raise
            except _Moved as moved:
                log.info("a group was upgraded to a supergroup; its replies go to the new chat from now on")
                if self.on_move is not None:
                    await self.on_move(moved.old, moved.new)
                self.moved[moved.old] = moved.new
                method = method.model_copy(update={"chat_id": moved.new})
        raise PlatformError(f"{method.__api_method__}: the chat moved again", kind="permanent")

    async def _once(self, method: TelegramMethod[T], request_timeout: int | None) -> T | None:
        name = method.__api_method__
        bot = self.sender if isinstance(method, SendMessage) else self.bot
        if type(method) not in self._answer_models:
            self._answer_models[type(method)] = Response[method.__returning__]  # type: ignore[name-defined]
        try:
            async with self.arrivals.slot() if bot is self.sender else contextlib.nullcontext():
                return await bot(method, request_timeout=request_timeout)
        except TelegramRetryAfter as exc:
            raise PlatformError(f"{name}: 429 retry after {exc.retry_after}s", kind="rate_limited",
                                retry_after=float(exc.retry_after)) from None
        except TelegramMigrateToChat as exc:
            chat_id = getattr(method, "chat_id", None)
            if isinstance(chat_id, int) and chat_id != exc.migrate_to_chat_id:
                raise _Moved(chat_id, exc.migrate_to_chat_id) from None
            raise PlatformError(self._detail(name, exc), kind="permanent") from None
        except TelegramBadRequest as exc:
            desc = exc.message.lower()
            if NOT_MODIFIED in desc:
                return None
            kind: Any = "not_found" if any(s in desc for s in _NOT_FOUND) else \
                "format" if any(s in desc for s in _FORMAT) else "permanent"
            raise PlatformError(self._detail(name, exc), kind=kind) from None
        except ClientDecodeError as exc:
            if isinstance(method, GetUpdates):  # one update aiogram refuses must not refuse the batch
                updates = read_updates(exc.data, self.bot)
                if updates is not None:
                    return cast(T, updates)
            # carried out when Telegram answered 2xx: never repeated then
            done = isinstance(exc, UnreadableAnswer) and 200 <= exc.status < 300
            # not str(exc): it quotes the whole answer, users' messages and all
            raise PlatformError(f"{name}: {exc.message} ({type(exc.original).__name__})",
                                kind="permanent" if done else "transient",
                                outcome_unknown=_maybe_taken(exc)) from None
        except TelegramServerError as exc:
            raise PlatformError(self._detail(name, exc), kind="transient", outcome_unknown=_maybe_taken(exc)) from None
        except TelegramEntityTooLarge as exc:  # a request Telegram refused by its size: nothing was carried out
            raise PlatformError(self._detail(name, exc), kind="permanent") from None
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


class _Moved(Exception):
    """The chat of a call is now a supergroup with another id (``TelegramClient.once`` calls again there)."""

    def __init__(self, old: int, new: int) -> None:
        super().__init__(f"chat {old} is now {new}")
        self.old = old
        self.new = new
