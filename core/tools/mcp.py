"""Tools from Model Context Protocol servers, through the official ``mcp`` SDK.

Each configured server is kept by one supervised asyncio task (:class:`McpToolSource`). Each connection to
it runs in a task of its own: the SDK's transports and ``ClientSession`` are async context managers whose
enter and exit must happen in the same task, so that task enters them, initializes, lists the tools, and
then serves requests from a queue until the connection ends. Every tool the server offers becomes a
:class:`McpTool` named ``<server>__<tool>``.

A server that goes away after it started — a stdio server that exits or is killed, a streamable-HTTP server
that cannot be reached or no longer knows our session — is brought back for as long as the bridge runs,
with tenacity's capped exponential backoff (:class:`RestartPolicy`). Meanwhile its tools stay offered to the
model, unchanged, and a call fails at once with a tool error saying the server is restarting (and when the
next attempt is due), so the model can tell the user or try later instead of the tool vanishing mid
conversation. A streamable-HTTP call that the server refused because it no longer knew the session did not
run there: it is sent again, once, as soon as the session is re-established. A server that never started
is left out (its tools were never listed) and not retried. The tool list is read at start-up only: after a
restart a tool the server no longer offers fails with that reason, and a new one is not offered.

What a stdio server writes to its stderr is logged line by line under the logger
``core.tools.mcp.<server name>`` at INFO, its ``env`` values masked (and whatever else the ``redact``
function the bridge passes masks).

No message of a server is held beyond ``MAX_MESSAGE_BYTES`` (see ``_transport``): a tool result that is
longer keeps its head over stdio, and fails its call over streamable HTTP.

:class:`McpManager` starts several servers side by side: one that fails (no such command, no answer within
its start-up timeout, refused connection) is reported as a one-line reason and the others keep working.
Reasons never contain the values of the server's ``env`` table nor the query part of its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import tenacity

from core.llm.provider import LLMToolSpec
from core.supervisor import Spawn, TaskSupervisor
from core.tools.base import DEFAULT_APPROVAL, ApprovalPolicy, ToolContext
from core.tools.mcp_stdio import CUT_META, MAX_MESSAGE_BYTES

if TYPE_CHECKING:  # the SDK is imported when a server is started, not when core is
    from mcp import ClientSession
    from mcp.types import CallToolResult, Implementation

log = logging.getLogger(__name__)

TOOL_SEPARATOR = "__"
PING_SECONDS = 5.0
"""After a call timed out or its caller gave up on it, how long the server has to answer a ping before it
counts as stuck and is restarted."""
MAX_TOOL_NAME = 64
"""The longest tool name the model APIs take (OpenAI's and Anthropic's function names: ``^[a-zA-Z0-9_-]{1,64}$``);
a server's tool whose ``<server>__<tool>`` is longer is left out, as one offered would fail every request."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_REASON_CHARS = 300
CLOSE_GRACE_SECONDS = 8.0
"""How long a server's task gets to leave its session on shutdown before it is cancelled (the SDK's stdio
shutdown waits up to a few seconds for the process to exit, then terminates and kills it)."""


DEFAULT_STARTUP_TIMEOUT = 20.0
"""Seconds a server has to start, initialize and list its tools."""
DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds one tool call may take."""


@dataclass(frozen=True, slots=True)
class McpServerConfig:
    """One MCP server as the operator configured it: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    url: str | None = None
    approval: ApprovalPolicy = DEFAULT_APPROVAL
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    call_timeout: float = DEFAULT_CALL_TIMEOUT

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise ValueError(f"MCP server name {self.name!r}: expected letters, digits, '_' or '-'")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command and url")

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    def secrets(self) -> list[str]:
        """Values that must not appear in any report: the env values, and the URL's query and user info."""
        values = [v for v in self.env.values() if v]
        if self.url:
            with contextlib.suppress(ValueError):
                parts = urlsplit(self.url)
                values += [p for p in (parts.query, parts.password, parts.username) if p]
        return sorted(set(values), key=lambda v: (-len(v), v))

    def target(self) -> str:
        """Where this server is, for reports: the command, or the URL without user info and query."""
        if self.command is not None:
            return self.scrub(self.command)
        assert self.url is not None
        try:
            parts = urlsplit(self.url)
            host = parts.hostname or ""
            port = f":{parts.port}" if parts.port else ""
            return f"{parts.scheme}://{host}{port}{parts.path}"
        except ValueError:
            return "(unparsable url)"

    def scrub(self, text: str) -> str:
        for secret in self.secrets():
            text = text.replace(secret, "***")
        return text


class McpStartError(Exception):
    """A server could not be started; the message is one short line without secrets."""


class McpToolError(Exception):
    """A tool call failed: the server said so (``isError``), it timed out, or the server is gone."""


# ---- one tool ------------------------------------------------------------------------------------------


class McpTool:
    """One tool of one MCP server, as a core :class:`~core.tools.base.Tool`."""

    def __init__(self, source: McpToolSource, remote_name: str, description: str,
                 parameters: dict[str, Any]) -> None:
        self._source = source
        self.remote_name = remote_name
        self._spec = LLMToolSpec(name=f"{source.config.name}{TOOL_SEPARATOR}{remote_name}",
                                 description=description, parameters=parameters)

    @property
    def spec(self) -> LLMToolSpec:
        return self._spec

    @property
    def approval(self) -> ApprovalPolicy | None:
        return self._source.config.approval

    @property
    def server(self) -> str:
        return self._source.config.name

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return await self._source.call(self.remote_name, arguments)


# ---- one server ----------------------------------------------------------------------------------------


ServerState = Literal["starting", "connected", "restarting", "failed", "stopped"]
"""``starting``: the first connection is being made. ``connected``: calls are served. ``restarting``: the
server went away after it had started; it is being brought back and its calls fail with that reason.
``failed``: it never started (it is left out; its tools were never listed). ``stopped``: closed."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a server that went away is brought back: for as long as the bridge runs, with tenacity's capped
    exponential backoff between attempts (``first_delay``, doubling, at most ``max_delay``), never in a
    busy loop. A session that stayed up for ``stable_after`` seconds counts as healthy: when it ends, the
    next outage starts afresh with one attempt at once (a dropped HTTP session of a server that is still
    there comes back without a pause); one that ends sooner backs off further."""

    first_delay: float = 1.0
    max_delay: float = 60.0
    stable_after: float = 60.0
    sleep: Callable[[float], Awaitable[None]] | None = None
    """How a pause between attempts is waited (default: the event loop's clock, cut short by closing)."""


@dataclass(eq=False)
class _Call:
    name: str
    arguments: dict[str, Any]
    future: asyncio.Future[str]


@dataclass(eq=False)
class _Live:
    """One connection to the server: the calls queued for it, and why it ended."""

    queue: asyncio.Queue[_Call | None] = field(default_factory=asyncio.Queue)
    open: bool = True
    reason: str | None = None
    expired: bool = False
    """Ended because the server no longer knew the session (streamable HTTP), not because it is gone."""


@dataclass(frozen=True, slots=True)
class _Listed:
    name: str
    description: str
    parameters: dict[str, Any]


class _Down(Exception):
    """A connection attempt failed, or the connection ended soon after it was made: back off, try again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Closed(Exception):
    """The source is closing: no further attempt."""


class _SessionExpired(Exception):
    """The server refused a call because it no longer knew the session: the call never ran there."""


class McpToolSource:
    """One MCP server, held open by its own supervised task, which brings it back whenever it goes away.

    Tool calls reach the current connection through its queue. While the server is away they fail at once
    with the reason and when the next attempt is due; the tools themselves stay listed.
    """

    def __init__(self, config: McpServerConfig, *, spawn: Spawn, restart: RestartPolicy | None = None,
                 redact: Callable[[str], str] | None = None) -> None:
        """``spawn`` starts the server's tasks (a supervisor's, so they have a bounded shutdown); ``redact``
        masks what the server writes to its stderr before it is logged (the ``env`` values always are)."""
        self.config = config
        self._spawn = spawn
        self._restart = restart or RestartPolicy()
        self._redact = redact
        self._stderr_log = logging.getLogger(f"{__name__}.{config.name}")
        self._ready: asyncio.Future[list[McpTool]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._tools: list[McpTool] = []
        self._offered: frozenset[str] = frozenset()
        self._live: _Live | None = None
        self._up = asyncio.Event()
        self._stopping: asyncio.Future[None] | None = None
        """Done once the source is being closed: ends a pause, an attempt to connect, and the restarts."""
        self._state: ServerState = "starting"
        self._reason: str | None = None
        self._next_attempt: float | None = None
        self._restarts = 0

    @property
    def tools(self) -> list[McpTool]:
        return list(self._tools)

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def reason(self) -> str | None:
        """Why the server is not connected (restarting, failed), for reports; None while connected."""
        return None if self._state == "connected" else self._reason

    @property
    def connected(self) -> bool:
        return self._state == "connected"

    async def start(self) -> list[McpTool]:
        """Connect, initialize and list the tools within the start-up timeout; raise McpStartError if not.
        From then on the server is kept: whenever it goes away it is brought back (``RestartPolicy``)."""
        if self._task is not None:
            raise RuntimeError("McpToolSource.start called twice")
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._stopping = loop.create_future()
        self._task = self._spawn(f"mcp:{self.config.name}", self._supervise(self._ready))
        try:
            # the attempt bounds itself by the start-up timeout; this only guards against a wedged one
            async with asyncio.timeout(self.config.startup_timeout + CLOSE_GRACE_SECONDS):
                tools = await asyncio.shield(self._ready)
        except TimeoutError:
            await self._abort()
            self._reason = f"no answer within {_seconds(self.config.startup_timeout)} (startup_timeout_seconds)"
            self._state = "failed"
            raise McpStartError(self._reason) from None
        except BaseException:
            await self._abort()
            raise
        return list(tools)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call one tool by its name on the server; the text of its result, or McpToolError."""
        try:
            return await self._call_once(name, arguments)
        except _SessionExpired:
            pass
        # The server answered that it no longer knows our session (it restarted, or expired it), so the call
        # did not run there: once the session is re-established it is sent again, once.
        if not await self._until_up(self.config.startup_timeout):
            raise McpToolError(self._unavailable_text(name)) from None
        try:
            return await self._call_once(name, arguments)
        except _SessionExpired:
            raise McpToolError(f"MCP tool {self._qualified(name)} failed: the server dropped its session "
                               "again right after it was re-established") from None

    async def aclose(self, timeout: float = CLOSE_GRACE_SECONDS) -> None:
        """Leave the session (the stdio server is stopped) and stop bringing it back, bounded by ``timeout``;
        then cancel what is left."""
        self._stop_restarts()
        task = self._task
        if task is None or task.done():
            self._state = "stopped"
            return
        if self._live is not None:
            self._live.queue.put_nowait(None)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            log.warning("MCP server %s did not close within %.0fs; cancelling it", self.config.name, timeout)
            await self._abort()

    def _stop_restarts(self) -> None:
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)

    @property
    def _closing(self) -> bool:
        return self._stopping is not None and self._stopping.done()

    async def _abort(self) -> None:
        self._stop_restarts()
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=CLOSE_GRACE_SECONDS)

    # -- calls --------------------------------------------------------------------------------------

    async def _call_once(self, name: str, arguments: dict[str, Any]) -> str:
        live = self._live
        if live is None or not live.open or self._state != "connected":
            raise McpToolError(self._unavailable_text(name))
        if name not in self._offered:
            raise McpToolError(f"MCP tool {self._qualified(name)} is unavailable: the server no longer offers "
                               "it (its tool list changed when it was restarted)")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        live.queue.put_nowait(_Call(name, dict(arguments), future))
        # The session enforces the call timeout; this outer bound only guards against a wedged transport.
        try:
            async with asyncio.timeout(self.config.call_timeout + 5.0):
                return await asyncio.shield(future)
        except TimeoutError:
            future.cancel()
            raise McpToolError(self._timeout_text(name)) from None
        except asyncio.CancelledError:
            future.cancel()  # the serving task cancels the request it started for us
            raise

    async def _until_up(self, timeout: float) -> bool:
        """Wait until the server is connected again (False: not within ``timeout``, or closing)."""
        if self._closing:
            return False
        try:
            async with asyncio.timeout(timeout):
                await self._up.wait()
        except TimeoutError:
            return False
        return self._state == "connected"

    def _unavailable_text(self, name: str) -> str:
        server = self.config.name
        if self._state == "restarting":
            due = ""
            if self._next_attempt is not None:
                wait = self._next_attempt - asyncio.get_running_loop().time()
                due = f"; next attempt in {math.ceil(wait)}s" if wait > 0 else "; reconnecting now"
            return (f"MCP tool {self._qualified(name)} is unavailable: its server {server!r} is restarting "
                    f"({self._reason or 'it went away'}{due}). Try again later.")
        if self._state == "stopped" or self._closing:
            return f"MCP server {server!r} is not connected (the bridge is stopping it)"
        return f"MCP server {server!r} is not connected" + (f" ({self._reason})" if self._reason else "")

    def _qualified(self, name: str) -> str:
        return f"{self.config.name}{TOOL_SEPARATOR}{name}"

    # -- the supervising task -----------------------------------------------------------------------

    async def _supervise(self, ready: asyncio.Future[list[McpTool]]) -> None:
        """The first connection is the start (its failure is reported, never retried: the tools were never
        listed); after that, every end of the connection is followed by attempts to make a new one."""
        try:
            first: _Down | None = None
            try:
                await self._connect_and_serve(ready)
            except _Down as down:
                if not ready.done():
                    self._reason = down.reason
                    self._state = "failed"
                    ready.set_exception(McpStartError(down.reason))
                    return
                first = down
            while True:
                async for attempt in self._restart_policy():
                    with attempt:
                        if first is not None:  # the end that just happened is this outage's first failure
                            failure, first = first, None
                            raise failure
                        await self._connect_and_serve(ready)
                # a healthy session ended: the next outage backs off afresh, its first attempt at once
        except _Closed:
            pass
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(McpStartError("cancelled"))
            raise
        finally:
            self._up.clear()
            if self._state != "failed":
                self._state = "stopped"
            if not ready.done():
                ready.set_exception(McpStartError(self._reason or "closed during start-up"))
            if not ready.cancelled():
                ready.exception()  # marks it retrieved: a start that timed out never awaits it

    def _restart_policy(self) -> tenacity.AsyncRetrying:
        policy = self._restart
        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_Down),
            wait=tenacity.wait_exponential(multiplier=policy.first_delay, min=policy.first_delay,
                                           max=policy.max_delay),
            stop=tenacity.stop_never,  # for as long as the bridge runs; closing ends it (_Closed)
            sleep=policy.sleep or self._pause,
            before_sleep=self._before_retry,
            reraise=True)

    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        self._next_attempt = asyncio.get_running_loop().time() + delay
        failure = state.outcome.exception() if state.outcome is not None else None
        if isinstance(failure, _Down):
            self._reason = failure.reason
        if state.attempt_number > 1:  # the first failure is the end of the session, logged by _lost
            log.warning("MCP server %s: restart attempt %d failed: %s; next attempt in %s", self.config.name,
                        state.attempt_number - 1, self._reason, _seconds(round(delay, 3)))

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before the next attempt, or less when the source is closed meanwhile."""
        assert self._stopping is not None
        await asyncio.wait({self._stopping}, timeout=seconds)

    async def _connect_and_serve(self, ready: asyncio.Future[list[McpTool]]) -> None:
        """One connection, in a task of its own: made within the start-up timeout, then served until it
        ends. Returns when a healthy session ended; raises _Down to back off, _Closed when closing."""
        if self._closing:
            raise _Closed
        loop = asyncio.get_running_loop()
        live = _Live()
        connected: asyncio.Future[list[_Listed]] = loop.create_future()
        task = self._spawn(f"mcp:{self.config.name}:session", self._session(live, connected))
        assert self._stopping is not None
        try:
            either: set[asyncio.Future[Any]] = {connected, self._stopping}
            await asyncio.wait(either, timeout=self.config.startup_timeout, return_when=asyncio.FIRST_COMPLETED)
            if self._closing:
                raise _Closed
            if not connected.done():
                raise _Down(f"no answer within {_seconds(self.config.startup_timeout)} (startup_timeout_seconds)")
            try:
                listed = connected.result()
            except Exception as exc:
                raise _Down(str(exc) if isinstance(exc, McpStartError) else self.describe_failure(exc)) from None
            since = loop.time()
            self._on_connected(live, listed, ready)
            await asyncio.wait({task})
            self._lost(live, live.reason or "the connection ended")
            if self._closing:
                raise _Closed
            if not live.expired and loop.time() - since < self._restart.stable_after:
                raise _Down(self._reason or "the connection ended")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CLOSE_GRACE_SECONDS)
            if not connected.done():
                connected.cancel()
            elif not connected.cancelled():
                connected.exception()

    def _on_connected(self, live: _Live, listed: list[_Listed], ready: asyncio.Future[list[McpTool]]) -> None:
        names = frozenset(t.name for t in listed)
        if not ready.done():
            self._tools = [McpTool(self, t.name, t.description, t.parameters) for t in listed]
            ready.set_result(list(self._tools))
        else:
            self._restarts += 1
            log.info("MCP server %s is back (restart %d): %d tools", self.config.name, self._restarts, len(names))
            known = {t.remote_name for t in self._tools}
            if names != known:
                gone, new = sorted(known - names), sorted(names - known)
                log.warning("MCP server %s offers other tools since its restart (tools are read at start-up "
                            "only): no longer offered: %s; new, not offered to the model: %s", self.config.name,
                            ", ".join(gone) or "none", ", ".join(new) or "none")
        self._offered = names
        self._live = live
        self._reason = None
        self._next_attempt = None
        self._state = "connected"
        self._up.set()

    def _lost(self, live: _Live, reason: str, *, expired: bool = False) -> None:
        """The connection ``live`` ended (or is ending): calls fail at once from now on, until it is back."""
        if live.open:
            live.open = False
            live.reason = reason
            live.expired = expired
            live.queue.put_nowait(None)
        if self._live is live:
            self._live = None
            self._up.clear()
            self._reason = live.reason or reason
            if not self._closing:
                self._next_attempt = None
                self._state = "restarting"
                log.warning("MCP server %s went away: %s; bringing it back", self.config.name, self._reason)

    # -- one connection -----------------------------------------------------------------------------

    async def _session(self, live: _Live, connected: asyncio.Future[list[_Listed]]) -> None:
        """Connect, initialize, list the tools, then serve the calls of ``live`` until it ends. Never raises
        for the server's sake: how it ended is in ``live.reason`` (or ``connected``'s error)."""
        import anyio
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(live))
                session = await stack.enter_async_context(
                    ClientSession(read, write, client_info=_client_info()))
                await session.initialize()
                listed = await self._list_tools(session)
                if connected.done():  # the attempt gave up waiting
                    return
                connected.set_result(listed)
                async with anyio.create_task_group() as group:
                    while True:
                        request = await live.queue.get()
                        if request is None:
                            group.cancel_scope.cancel()
                            break
                        group.start_soon(self._handle, session, live, request)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # every failure ends this connection only, with a reason
            # a stdio server's exit was reported (``live.reason``) before its stream ended: the clearer reason
            reason = live.reason if live.reason and _connection_closed(exc) else self.describe_failure(exc)
            if not connected.done():
                connected.set_exception(McpStartError(reason))
            elif live.open:
                live.reason = reason
            if not isinstance(exc, Exception):
                raise
        finally:
            if not connected.done():  # ended without an error before it was up (the server ended at once)
                connected.set_exception(McpStartError(
                    f"{live.reason or 'the server closed the connection'} during start-up"))
            live.open = False
            self._fail_pending(live)

    def _transport(self, live: _Live) -> contextlib.AbstractAsyncContextManager[Any]:
        """The server's streams, each message bounded to ``MAX_MESSAGE_BYTES``: over stdio by our own
        transport (``core.tools.mcp_stdio``, which keeps the head of a longer tool result, logs the server's
        stderr, and reports its exit at once); over streamable HTTP by the SDK's ``max_sse_event_size`` (a
        longer event fails the call, read no further). What remains out of our hands: a server answering a
        call with a plain JSON body (not an event stream), which the SDK reads whole before anything of ours
        sees it."""
        cfg = self.config
        if cfg.command is not None:
            from core.tools.mcp_stdio import bounded_stdio_client

            def exited(status: int | None) -> None:
                how = f"the server exited with status {status}" if status is not None else "the server exited"
                self._lost(live, how)

            return bounded_stdio_client(cfg.command, cfg.args, dict(cfg.env) or None, self._log_stderr,
                                        on_exit=exited, name=cfg.name)
        from mcp.client.streamable_http import streamable_http_client

        assert cfg.url is not None
        return streamable_http_client(cfg.url, max_sse_event_size=MAX_MESSAGE_BYTES)

    def _log_stderr(self, line: str) -> None:
        line = self.config.scrub(line)
        if self._redact is not None:
            line = self._redact(line)
        self._stderr_log.info("%s", line)

    async def _list_tools(self, session: ClientSession) -> list[_Listed]:
        from mcp.types import PaginatedRequestParams

        tools: list[_Listed] = []
        seen: set[str] = set()
        longest = MAX_TOOL_NAME - len(self.config.name) - len(TOOL_SEPARATOR)
        cursor: str | None = None
        for _ in range(100):  # a server that pages forever is cut off
            params = PaginatedRequestParams(cursor=cursor) if cursor else None
            result = await session.list_tools(params=params)
            for tool in result.tools:
                if not NAME_PATTERN.match(tool.name):
                    log.warning("MCP server %s: skipping tool %r (name is not [A-Za-z0-9_-]+)",
                                self.config.name, tool.name)
                    continue
                if len(tool.name) > longest:  # the model's API would refuse every request offering it
                    log.warning("MCP server %s: skipping tool %r (%s%s<tool> would be longer than the %d "
                                "characters a model's API takes for a tool name)", self.config.name, tool.name,
                                self.config.name, TOOL_SEPARATOR, MAX_TOOL_NAME)
                    continue
                if tool.name in seen:
                    log.warning("MCP server %s: skipping a second tool named %r", self.config.name, tool.name)
                    continue
                seen.add(tool.name)
                schema = dict(tool.input_schema or {}) or {"type": "object", "properties": {}}
                tools.append(_Listed(tool.name, tool.description or "", schema))
            cursor = result.next_cursor
            if not cursor:
                break
        return tools

    async def _handle(self, session: ClientSession, live: _Live, call: _Call) -> None:
        import anyio

        if call.future.done():
            return
        timed_out = False
        with anyio.CancelScope() as scope:
            # A caller that gave up (cancelled its wait) cancels the request it started.
            call.future.add_done_callback(lambda _: scope.cancel())
            try:
                result = await session.call_tool(call.name, call.arguments,
                                                 read_timeout_seconds=self.config.call_timeout)
                text = result_text(result)
                if result.is_error and not _was_cut(result):
                    _settle(call.future, exc=McpToolError(text or f"MCP tool {call.name!r} failed"))
                else:
                    _settle(call.future, text)
            except Exception as exc:
                if _session_expired(exc):
                    # The server (streamable HTTP) no longer knows this session: connect afresh at once.
                    self._lost(live, "the server no longer knew the session (did it restart?)", expired=True)
                    _settle(call.future, exc=_SessionExpired())
                    return
                if _connection_closed(exc):
                    # The server is gone (it exited, or the HTTP connection broke): it is brought back.
                    self._lost(live, live.reason or self.describe_failure(exc))
                    _settle(call.future, exc=McpToolError(self._interrupted_text(call.name, live)))
                _settle(call.future, exc=self._call_error(call.name, exc))
                timed_out = _timed_out(exc)
            finally:  # cancelled: the source is closing, or the connection ended under the call
                _settle(call.future, exc=McpToolError(self._interrupted_text(call.name, live)))
        # (outside the scope, which the settled call cancels) a slow tool leaves the server answering a ping;
        # a server that answers nothing at all is stuck, and is restarted. A call its caller gave up on (a
        # user's /stop of a call that hung) is as much a sign as a timeout, and the only one before it: without
        # the ping the next call waited out its whole timeout. The caller is gone, so this costs no one a wait.
        given_up = call.future.cancelled()
        if (timed_out or given_up) and live.open and not self._closing and not await self._answers_ping(session):
            what = "a call timed out" if timed_out else "a call was given up on"
            self._lost(live, f"the server stopped answering ({what}, then a ping within {_seconds(PING_SECONDS)})")

    def _fail_pending(self, live: _Live) -> None:
        while True:
            try:
                request = live.queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if request is not None:
                _settle(request.future, exc=McpToolError(self._unavailable_text(request.name)))

    async def _answers_ping(self, session: ClientSession) -> bool:
        """Whether the server answers a ping within ``PING_SECONDS`` (after one of its calls timed out, or was
        given up on)."""
        import anyio

        try:
            with anyio.fail_after(PING_SECONDS):
                await session.send_ping()
        except Exception:
            return False
        return True

    def _call_error(self, name: str, exc: BaseException) -> McpToolError:
        if _timed_out(exc):  # our own wait ran out, not a server's error that speaks of a timeout
            return McpToolError(self._timeout_text(name))
        text = self.describe_failure(exc)
        if "byte limit" in text and "exceeded" in text:  # the SDK's bound on one streamable-HTTP event
            return McpToolError(f"MCP tool {self._qualified(name)} failed: its result is larger "
                                f"than {MAX_MESSAGE_BYTES:,} bytes and was not read (exceeded the "
                                f"{MAX_MESSAGE_BYTES} byte limit)")
        return McpToolError(f"MCP tool {self._qualified(name)} failed: {text}")

    def _interrupted_text(self, name: str, live: _Live) -> str:
        """A call the connection ended under: it may or may not have run on the server."""
        if self._closing:
            return f"MCP server {self.config.name!r} is closing"
        if live.reason:
            return (f"MCP tool {self._qualified(name)} failed: {live.reason} during the call; the server is being "
                    "restarted")
        return (f"MCP tool {self._qualified(name)} failed: the connection to its server ended during the call; it "
                "is being re-established")

    def _timeout_text(self, name: str) -> str:
        return (f"MCP tool {self._qualified(name)} timed out after "
                f"{_seconds(self.config.call_timeout)} (call_timeout_seconds)")

    def describe_failure(self, exc: BaseException) -> str:
        """One short line for the operator: what went wrong, without secrets."""
        from mcp import MCPError

        leaf = _leaf(exc)
        cfg = self.config
        if isinstance(leaf, FileNotFoundError) and cfg.command is not None:
            text = f"command not found: {cfg.command}"
        elif isinstance(leaf, PermissionError) and cfg.command is not None:
            text = f"command not executable: {cfg.command}"
        elif isinstance(leaf, OSError) and cfg.command is not None:
            text = f"cannot start {cfg.command}: {leaf.strerror or leaf}"
        elif isinstance(leaf, MCPError):
            message = leaf.message or str(leaf)
            if _connection_closed(leaf):
                text = (f"the server closed the connection (did it exit? its error output is logged as "
                        f"{self._stderr_log.name})" if cfg.command is not None
                        else "the server closed the connection")
            else:
                text = f"MCP error: {message}"
        elif _is_connect_error(leaf):
            text = f"cannot connect to {cfg.target()}: {leaf}"
        elif type(leaf).__name__ == "HTTPStatusError":
            status = getattr(getattr(leaf, "response", None), "status_code", "?")
            text = f"HTTP {status} from {cfg.target()}"
        else:
            text = f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
        text = cfg.scrub(" ".join(text.split()))
        return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _settle(future: asyncio.Future[str], value: str | None = None, *, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value or "")


def _was_cut(result: CallToolResult) -> bool:
    """A result our transport rebuilt from the head of an oversized message (not an error of the tool)."""
    meta = getattr(result, "meta", None)
    return isinstance(meta, dict) and isinstance(meta.get(CUT_META), int)


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def _timed_out(exc: BaseException) -> bool:
    """Our wait for an answer ran out (the SDK's read timeout)."""
    from mcp import MCPError
    from mcp.types import REQUEST_TIMEOUT

    leaf = _leaf(exc)
    return isinstance(leaf, TimeoutError) or (isinstance(leaf, MCPError) and leaf.code == REQUEST_TIMEOUT)


def _connection_closed(exc: BaseException) -> bool:
    from mcp import MCPError

    leaf = _leaf(exc)
    return isinstance(leaf, MCPError) and leaf.message.lower() == "connection closed"


_SESSION_GONE = ("session terminated", "session not found")
"""How a streamable-HTTP server's 404 for an unknown session reaches us: the SDK's own wording when the answer
had no JSON-RPC body, and the body both official SDKs' servers send. The SDK keeps the HTTP status to itself
when there is a body, so the words are all there is to go by."""


def _session_expired(exc: BaseException) -> bool:
    """The streamable-HTTP server no longer knows our session id (it restarted, or expired the session), so
    it did not run the request."""
    from mcp import MCPError

    leaf = _leaf(exc)
    return isinstance(leaf, MCPError) and leaf.message.strip().lower() in _SESSION_GONE


def _is_connect_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "ConnectionError"})


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _client_info() -> Implementation:
    from mcp.types import Implementation

    return Implementation(name="chatbridge", version="0.1.0")


def result_text(result: CallToolResult) -> str:
    """A tool result as text: text blocks joined; other blocks described in one line each."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(block.text))
        elif kind in ("image", "audio"):
            size = len(str(getattr(block, "data", ""))) * 3 // 4
            parts.append(f"[{kind} {getattr(block, 'mime_type', '?')}, about {size} bytes, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {getattr(block, 'uri', '?')}]")
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            if isinstance(text, str):
                parts.append(text)
            else:
                parts.append(f"[resource {getattr(resource, 'uri', '?')} "
                             f"({getattr(resource, 'mime_type', None) or 'binary'}), not shown]")
        else:
            parts.append(f"[{kind or 'unknown'} content, not shown]")
    if not parts:
        structured = getattr(result, "structured_content", None)
        if structured is not None:
            import json

            return json.dumps(structured, ensure_ascii=False)
    return "\n".join(parts)


# ---- several servers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class McpServerStatus:
    name: str
    target: str
    tools: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class McpManager:
    """The configured MCP servers of one process: started together, each failing on its own, each brought
    back by its own task whenever it goes away after it started (``RestartPolicy``)."""

    def __init__(self, *, restart: RestartPolicy | None = None, redact: Callable[[str], str] | None = None) -> None:
        """``redact`` masks each line a server writes to its stderr before it is logged (beyond its ``env``
        values, which are always masked)."""
        self._restart = restart
        self._redact = redact
        self._supervisor = TaskSupervisor("mcp")  # the servers outlive the core: they have their own
        self._sources: list[McpToolSource] = []
        self._all: list[McpToolSource] = []
        self._owners: dict[str, str] = {}
        """Each full tool name offered, and the server it is the tool of."""
        self._withheld: set[McpTool] = set()
        self.statuses: list[McpServerStatus] = []

    async def start(self, configs: Sequence[McpServerConfig], timeout: float | None = None) -> list[str]:
        """Start every server concurrently; returns one ``"<name>: <reason>"`` line per server that failed.

        ``timeout`` (if given) caps each server's own ``startup_timeout``.
        """
        names = [c.name for c in configs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"MCP server names must be unique: {', '.join(duplicates)}")
        sources = []
        for cfg in configs:
            if timeout is not None and timeout < cfg.startup_timeout:
                cfg = _replace_timeout(cfg, timeout)
            sources.append(McpToolSource(cfg, spawn=self._supervisor.spawn, restart=self._restart,
                                         redact=self._redact))
        self._all.extend(sources)
        results = await asyncio.gather(*(s.start() for s in sources), return_exceptions=True)
        failures: list[str] = []
        for source, result in zip(sources, results, strict=True):
            cfg = source.config
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                reason = str(result) if isinstance(result, McpStartError) else source.describe_failure(result)
                failures.append(f"{cfg.name}: {reason}")
                self.statuses.append(McpServerStatus(cfg.name, cfg.target(), error=reason))
            else:
                self._sources.append(source)
                self.statuses.append(McpServerStatus(cfg.name, cfg.target(),
                                                     tools=tuple(t.spec.name for t in self._claim(source))))
        return failures

    def _claim(self, source: McpToolSource) -> list[McpTool]:
        """The tools of ``source`` whose full names no earlier server's tool has (in configuration order).

        ``<server>__<tool>`` is not unique across servers: server ``a``'s tool ``b__c`` and server ``a__b``'s
        tool ``c`` are both ``a__b__c``. A second one is left out with a warning, as a second tool of the
        same name on one server is, rather than stopping the bridge (a registry takes each name once). The
        built-in tools' names have no ``__``, so no MCP tool takes one of theirs."""
        kept: list[McpTool] = []
        for tool in source.tools:
            owner = self._owners.setdefault(tool.spec.name, source.config.name)
            if owner == source.config.name:
                kept.append(tool)
                continue
            log.warning("MCP server %s: skipping tool %r (%s is already the name of a tool of server %s)",
                        source.config.name, tool.remote_name, tool.spec.name, owner)
            self._withheld.add(tool)
        return kept

    def tools(self) -> list[McpTool]:
        return [tool for source in self._sources for tool in source.tools if tool not in self._withheld]

    def sources(self) -> list[McpToolSource]:
        """Every configured server, in configuration order (those that failed to start included)."""
        return list(self._all)

    def states(self) -> dict[str, ServerState]:
        """Each configured server's state now, by name (for ``/healthz``)."""
        return {source.config.name: source.state for source in self._all}

    async def aclose(self, timeout: float = CLOSE_GRACE_SECONDS) -> None:
        """Close every server concurrently, bounded by ``timeout`` each."""
        sources, self._sources = self._sources, []
        await asyncio.gather(*(s.aclose(timeout) for s in sources), return_exceptions=True)
        await self._supervisor.shutdown(timeout)


def _replace_timeout(cfg: McpServerConfig, timeout: float) -> McpServerConfig:
    import dataclasses

    return dataclasses.replace(cfg, startup_timeout=timeout)
