"""Slack Web API calls through slack_sdk's ``AsyncWebClient``, with Slack's errors mapped to ``PlatformError``.

``once`` is one attempt of one Web API method; ``call`` runs it under the channel's one call policy
(``channels.common.calls``). The client is built with ``retry_handlers=[]``: slack_sdk's default handler
would resend a request once after a connection error (a ``chat.postMessage`` whose answer was lost would be
posted twice), and its 429 handler would sleep inside the call, hiding the pause from the throttle. So the
call policy is the only retry layer, and it repeats a send whose outcome is unknown at most once.

Throttle scopes (``channels.common.throttle``): every call of a turn counts against its Slack channel (about
one message or update per second each) and against the workspace (``chat.update`` is Tier 3, about 50 a
minute for the whole app, which binds as soon as several replies stream at once). A 429 on
``chat.postMessage`` (limited per channel) pauses the channel; on another message write (``MESSAGE_WRITES``)
it pauses the workspace, and so every channel of it. Every other method has a limit of its own (its tier,
per workspace): its 429 pauses that method only (``method_scope``), so a refused thinking reaction or status
never holds up the replies themselves. The thinking indicator has a budget of its own as well
(``thinking_scope``): it is shown only when that budget has room at once (see ``channels.slack.sink``).

The workspace's pace spaces updates by when they leave; Slack counts them when they arrive, and a busy bridge
or network can bunch them on the way, so a pace at the limit itself would draw a 429 (and a pause of every
conversation's replies) now and then. ``chat.update`` also passes an ``ArrivalBudget`` of the workspace's
limit (``updates``: ``workspace_updates_per_minute`` in any 60 s), which bounds every minute Slack counts.

A failure that leaves open whether Slack carried the call out (``maybe_carried_out``: a timeout or a broken
connection, ``internal_error`` / ``fatal_error``, a 500, 504 or other server error but 502 and 503, which a
gateway answers when Slack's servers did not take the request, an answer that cannot be read) is reported with
``outcome_unknown``; a post is then looked for before it is made again (``channels.slack.posting``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from channels.common.arrivals import ArrivalBudget
from channels.common.calls import Calls
from channels.common.errors import ErrorKind, PlatformError
from channels.common.throttle import Scope

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT = frozenset({"internal_error", "fatal_error", "service_unavailable", "request_timeout"})
RATE_LIMITED = frozenset({"ratelimited", "rate_limited"})
"""Slack's rate limit as an error code with HTTP 200 (``rate_limited`` is documented for chat.postMessage, for an
app posting too many messages to a channel): a pause like a 429's."""
MAYBE_DONE = frozenset({"internal_error", "fatal_error"})
"""Errors Slack documents as "some aspect of the operation may have succeeded"."""
NOT_TAKEN = frozenset({502, 503})
"""Server errors that mean Slack's servers never took the request (a gateway in front of them answers)."""
NOT_FOUND = frozenset({"message_not_found"})
FORMAT = frozenset({"invalid_blocks", "invalid_blocks_format", "msg_blocks_too_long", "markdown_text_conflict"})
STREAM_ENDED = frozenset({"message_not_in_streaming_state", "stopped_by_user", "streaming_state_conflict"})
"""A native stream that Slack closed (it expired, or the user stopped it): it can no longer be appended to."""
STREAM_REFUSED = frozenset({"unknown_method", "not_allowed", "missing_scope", "feature_not_enabled",
                            "not_supported", "method_deprecated", "invalid_arguments", "not_allowed_token_type",
                            "missing_recipient_user_id", "missing_recipient_team_id", "team_access_not_granted",
                            "restricted_action", "channel_type_not_supported"})
"""``chat.startStream`` errors that mean streaming does not work here (the sink streams by updates instead)."""


def answer_of(exc: SlackApiError) -> tuple[int, dict[str, Any] | None]:
    """The HTTP status of a failed call's answer and its body, None when the body could not be read as Slack's
    JSON (slack_sdk then hands over aiohttp's own response, or an empty dict for a page that is not JSON)."""
    response = exc.response
    status = getattr(response, "status_code", None)
    if status is None:
        status = getattr(response, "status", None)
    data = getattr(response, "data", None)
    return int(status or 200), data if isinstance(data, dict) and "ok" in data else None


def maybe_carried_out(exc: SlackApiError) -> bool:
    """Whether the call that failed with ``exc`` may have been carried out all the same."""
    status, data = answer_of(exc)
    if status == 429 or status in NOT_TAKEN:
        return False
    if data is None or status >= 500:
        return True
    return str(data.get("error") or "") in MAYBE_DONE


def error_code(exc: PlatformError) -> str:
    """Slack's error code of a mapped failure ("" for network errors and HTTP failures without one)."""
    return getattr(exc, "slack_error", "")


class SlackCallError(PlatformError):
    """A ``PlatformError`` that keeps Slack's error code (``slack_error``)."""

    def __init__(self, detail: str, *, kind: ErrorKind, slack_error: str = "", **kw: Any) -> None:
        super().__init__(detail, kind=kind, **kw)
        self.slack_error = slack_error


MESSAGE_WRITES = frozenset({"chat.postMessage", "chat.update", "chat.delete", "chat.startStream",
                            "chat.appendStream", "chat.stopStream"})
"""The methods that write a reply, counted against its channel's and the workspace's budgets."""

CHAT_BURST = 2
"""Calls a channel takes at once: its pace (``update_interval_ms``) is the bridge's own, Slack limits updates per
workspace and allows chat.postMessage short bursts over one a second; the end of a turn uses one call of it
(``throttle.ending``), so the whole reply shows without waiting for the next slot."""


class SlackApi:
    def __init__(self, client: AsyncWebClient, calls: Calls, *, chat_interval: float,
                 workspace_interval: float, thinking_interval: float = 0.0,
                 updates: tuple[int, float] | None = None) -> None:
        """``updates``: Slack's limit on ``chat.update`` for the workspace, (calls, in seconds); None: none kept."""
        self.client = client
        self.calls = calls
        self.chat_interval = chat_interval
        self.workspace_interval = workspace_interval
        self.thinking_interval = thinking_interval
        self.updates = ArrivalBudget(*updates) if updates is not None else None
        self.team_id = ""
        """Set once ``auth.test`` answered: names the workspace scope."""

    def chat_scope(self, channel: str) -> Scope:
        return Scope(f"chat:{channel}", self.chat_interval, CHAT_BURST)

    def workspace_scope(self) -> Scope:
        return Scope(f"workspace:{self.team_id or 'default'}", self.workspace_interval)

    def method_scope(self, method: str) -> Scope:
        """A method outside ``MESSAGE_WRITES``: only its own 429 pauses count (Slack's tier of that method)."""
        return Scope(f"{method}:{self.team_id or 'default'}")

    def thinking_scope(self) -> Scope:
        """The thinking indicators' budget for the whole workspace: one per ``thinking_interval``."""
        return Scope(f"thinking:{self.team_id or 'default'}", self.thinking_interval)

    def scopes(self, channel: str) -> tuple[Scope, ...]:
        """The channel first: a 429 without a scope of its own pauses it."""
        return self.chat_scope(channel), self.workspace_scope()

    async def call(self, method: str, fn: Callable[[], Awaitable[T]], *, channel: str | None = None,
                   paced: bool = True, retry: bool = True, idempotent: bool = True) -> T:
        """One Web API method under the call policy, paced in ``channel``'s scopes when given (and, for a
        method that is not a message write, under its own 429 pauses)."""
        scopes = self.scopes(channel) if channel is not None else ()
        if scopes and method not in MESSAGE_WRITES:
            scopes = (*scopes, self.method_scope(method))
        return await self.calls.call(lambda: self.once(method, fn), scopes=scopes, paced=paced, retry=retry,
                                     idempotent=idempotent)

    async def once(self, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One attempt of one Web API method (``fn`` makes the slack_sdk call); an update first takes room in
        the workspace's ``updates`` budget (a wait of the bridge's own, outside the attempt's bound)."""
        if method != "chat.update" or self.updates is None:
            return await self._attempt(method, fn)
        async with self.updates.slot():
            return await self._attempt(method, fn)

    async def _attempt(self, method: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except SlackApiError as exc:
            raise self._mapped(method, exc) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            # the request may have reached Slack before the connection broke
            raise SlackCallError(f"{method}: {type(exc).__name__}", kind="transient",
                                 outcome_unknown=True) from None
        except AttributeError:
            # slack_sdk reading an answer that is not JSON (a 200 ``text/plain`` body): what it said is unknown
            raise SlackCallError(f"{method}: an answer that could not be read", kind="transient",
                                 outcome_unknown=True) from None

    def _mapped(self, method: str, exc: SlackApiError) -> SlackCallError:
        status, data = answer_of(exc)
        code = str((data or {}).get("error") or "")
        if status == 429 or code in RATE_LIMITED:
            headers = {str(k).lower(): v for k, v in (getattr(exc.response, "headers", None) or {}).items()}
            try:
                retry_after = float(headers.get("retry-after") or 1)
            except (TypeError, ValueError):
                retry_after = 1.0
            # chat.postMessage is limited per channel (the call's first scope); the other message writes count
            # against the workspace's budget; every other method has a tier of its own
            scope = (None if method == "chat.postMessage" else self.workspace_scope().key
                     if method in MESSAGE_WRITES else self.method_scope(method).key)
            return SlackCallError(f"{method}: 429 retry after {retry_after:g}s", kind="rate_limited",
                                  retry_after=retry_after, scope=scope, slack_error=code or "ratelimited")
        kind: ErrorKind
        if data is None or status >= 500 or code in TRANSIENT:
            kind = "transient"
        elif code in NOT_FOUND:
            kind = "not_found"
        elif code in FORMAT:
            kind = "format"
        else:
            kind = "permanent"
        detail = code or (f"HTTP {status}" if data is not None else f"HTTP {status}, an answer that could not be read")
        return SlackCallError(f"{method}: {detail}", kind=kind, slack_error=code,
                              outcome_unknown=maybe_carried_out(exc))
