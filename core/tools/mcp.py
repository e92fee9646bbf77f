"""Tools from Model Context Protocol servers, through the official ``mcp`` SDK.

Each configured server is held open by one supervised asyncio task (:class:`McpToolSource`): the SDK's
transports and ``ClientSession`` are async context managers whose enter and exit must happen in the same
task, so that task enters them, initializes, lists the tools, and then serves requests from a queue until
it is told to stop. Every tool the server offers becomes a :class:`McpTool` named ``<server>__<tool>``.

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
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TextIO
from urllib.parse import urlsplit

from core.llm.provider import LLMToolSpec
from core.supervisor import Spawn, TaskSupervisor
from core.tools.base import DEFAULT_APPROVAL, ApprovalPolicy, ToolContext
from core.tools.mcp_stdio import CUT_META, MAX_MESSAGE_BYTES

if TYPE_CHECKING:  # the SDK is imported when a server is started, not when core is
    from mcp import ClientSession
    from mcp.types import CallToolResult, Implementation

log = logging.getLogger(__name__)

TOOL_SEPARATOR = "__"
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


@dataclass(eq=False)
class _Call:
    name: str
    arguments: dict[str, Any]
    future: asyncio.Future[str]


class McpToolSource:
    """One MCP server held open by its own task; tool calls reach it through a queue."""

    def __init__(self, config: McpServerConfig, *, spawn: Spawn, errlog: TextIO | None = None) -> None:
        """``spawn`` starts the serving task (a supervisor's, so it has a bounded shutdown)."""
        self.config = config
        self._spawn = spawn
        self._errlog = errlog
        self._queue: asyncio.Queue[_Call | None] = asyncio.Queue()
        self._ready: asyncio.Future[list[McpTool]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._tools: list[McpTool] = []
        self._closed_reason: str | None = None

    @property
    def tools(self) -> list[McpTool]:
        return list(self._tools)

    @property
    def connected(self) -> bool:
        return self._task is not None and not self._task.done() and self._closed_reason is None

    async def start(self) -> list[McpTool]:
        """Connect, initialize and list the tools within the start-up timeout; raise McpStartError if not."""
        if self._task is not None:
            raise RuntimeError("McpToolSource.start called twice")
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._task = self._spawn(f"mcp:{self.config.name}", self._serve())
        try:
            tools = await asyncio.wait_for(asyncio.shield(self._ready), self.config.startup_timeout)
        except TimeoutError:
            await self._abort()
            raise McpStartError(f"no answer within {_seconds(self.config.startup_timeout)} "
                                f"(startup_timeout_seconds)") from None
        except McpStartError:
            await self._abort()
            raise
        except asyncio.CancelledError:
            await self._abort()
            raise
        self._tools = tools
        return list(tools)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call one tool by its name on the server; the text of its result, or McpToolError."""
        if not self.connected:
            raise McpToolError(f"MCP server {self.config.name!r} is not connected"
                               + (f" ({self._closed_reason})" if self._closed_reason else ""))
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Call(name, dict(arguments), future))
        # The session enforces the call timeout; this outer bound only guards against a wedged transport.
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.call_timeout + 5.0)
        except TimeoutError:
            future.cancel()
            raise McpToolError(self._timeout_text(name)) from None
        except asyncio.CancelledError:
            future.cancel()  # the serving task cancels the request it started for us
            raise

    async def aclose(self, timeout: float = CLOSE_GRACE_SECONDS) -> None:
        """Leave the session (the stdio server is stopped), bounded by ``timeout``; then cancel the task."""
        task = self._task
        if task is None or task.done():
            return
        self._queue.put_nowait(None)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            log.warning("MCP server %s did not close within %.0fs; cancelling it", self.config.name, timeout)
            await self._abort()

    async def _abort(self) -> None:
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=CLOSE_GRACE_SECONDS)

    # -- the serving task ---------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._ready is not None
        ready = self._ready
        reason = "closed"
        try:
            await self._session_loop(ready)
        except asyncio.CancelledError:
            reason = "cancelled"
            if not ready.done():
                ready.set_exception(McpStartError("cancelled"))
            raise
        except BaseException as exc:  # every failure ends this server only, with a reason
            reason = self.describe_failure(exc)
            if not ready.done():
                ready.set_exception(McpStartError(reason))
            else:
                log.warning("MCP server %s disconnected: %s", self.config.name, reason)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._closed_reason = self._closed_reason or reason
            self._fail_pending()
            if not ready.done():  # left without an error before being ready (e.g. the server ended at once)
                ready.set_exception(McpStartError("the server closed the connection during start-up"))
            if not ready.cancelled():
                ready.exception()  # marks it retrieved: a start that timed out never awaits it

    async def _session_loop(self, ready: asyncio.Future[list[McpTool]]) -> None:
        import anyio
        from mcp import ClientSession

        async with contextlib.AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(self._transport())
            session = await stack.enter_async_context(
                ClientSession(read, write, client_info=_client_info()))
            await session.initialize()
            tools = await self._list_tools(session)
            if not ready.done():
                ready.set_result(tools)
            async with anyio.create_task_group() as group:
                while True:
                    request = await self._queue.get()
                    if request is None:
                        group.cancel_scope.cancel()
                        break
                    group.start_soon(self._handle, session, request)

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """The server's streams, each message bounded to ``MAX_MESSAGE_BYTES``: over stdio by our own
        transport (``core.tools.mcp_stdio``, which keeps the head of a longer tool result); over streamable
        HTTP by the SDK's ``max_sse_event_size`` (a longer event fails the call, read no further). What
        remains out of our hands: a server answering a call with a plain JSON body (not an event stream),
        which the SDK reads whole before anything of ours sees it."""
        cfg = self.config
        if cfg.command is not None:
            from core.tools.mcp_stdio import bounded_stdio_client

            return bounded_stdio_client(cfg.command, cfg.args, dict(cfg.env) or None,
                                        self._errlog or _default_errlog())
        from mcp.client.streamable_http import streamable_http_client

        assert cfg.url is not None
        return streamable_http_client(cfg.url, max_sse_event_size=MAX_MESSAGE_BYTES)

    async def _list_tools(self, session: ClientSession) -> list[McpTool]:
        from mcp.types import PaginatedRequestParams

        tools: list[McpTool] = []
        cursor: str | None = None
        for _ in range(100):  # a server that pages forever is cut off
            params = PaginatedRequestParams(cursor=cursor) if cursor else None
            result = await session.list_tools(params=params)
            for tool in result.tools:
                if not NAME_PATTERN.match(tool.name):
                    log.warning("MCP server %s: skipping tool %r (name is not [A-Za-z0-9_-]+)",
                                self.config.name, tool.name)
                    continue
                schema = dict(tool.input_schema or {}) or {"type": "object", "properties": {}}
                tools.append(McpTool(self, tool.name, tool.description or "", schema))
            cursor = result.next_cursor
            if not cursor:
                break
        return tools

    async def _handle(self, session: ClientSession, call: _Call) -> None:
        import anyio

        if call.future.done():
            return
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
                if _connection_closed(exc) and self._closed_reason is None:
                    # The server is gone (it exited, or the HTTP session ended): later calls fail at once.
                    self._closed_reason = self.describe_failure(exc)
                    log.warning("MCP server %s disconnected: %s", self.config.name, self._closed_reason)
                    self._queue.put_nowait(None)
                _settle(call.future, exc=self._call_error(call.name, exc))
            finally:
                _settle(call.future, exc=McpToolError(f"MCP server {self.config.name!r} is closing"))

    def _fail_pending(self) -> None:
        while True:
            try:
                request = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if request is not None:
                _settle(request.future, exc=McpToolError(
                    f"MCP server {self.config.name!r} is not connected ({self._closed_reason or 'closed'})"))

    def _call_error(self, name: str, exc: BaseException) -> McpToolError:
        text = self.describe_failure(exc)
        if "timed out" in text.lower():
            return McpToolError(self._timeout_text(name))
        if "byte limit" in text and "exceeded" in text:  # the SDK's bound on one streamable-HTTP event
            return McpToolError(f"MCP tool {self.config.name}{TOOL_SEPARATOR}{name} failed: its result is larger "
                                f"than {MAX_MESSAGE_BYTES:,} bytes and was not read (exceeded the "
                                f"{MAX_MESSAGE_BYTES} byte limit)")
        return McpToolError(f"MCP tool {self.config.name}{TOOL_SEPARATOR}{name} failed: {text}")

    def _timeout_text(self, name: str) -> str:
        return (f"MCP tool {self.config.name}{TOOL_SEPARATOR}{name} timed out after "
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
                text = ("the server closed the connection (did it exit? its own error output goes to "
                        "chatbridge's stderr)" if cfg.command is not None else "the server closed the connection")
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


def _connection_closed(exc: BaseException) -> bool:
    from mcp import MCPError

    leaf = _leaf(exc)
    return isinstance(leaf, MCPError) and leaf.message.lower() == "connection closed"


def _is_connect_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "ConnectionError"})


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _default_errlog() -> TextIO:
    """The server's stderr goes to ours when ours is a real file (pytest may have replaced it)."""
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        return stream
    return open(os.devnull, "w")  # lives as long as the process


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
    """The configured MCP servers of one process: started together, each failing on its own."""

    def __init__(self, *, errlog: TextIO | None = None) -> None:
        self._errlog = errlog
        self._supervisor = TaskSupervisor("mcp")  # the servers outlive the core: they have their own
        self._sources: list[McpToolSource] = []
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
            sources.append(McpToolSource(cfg, spawn=self._supervisor.spawn, errlog=self._errlog))
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
                                                     tools=tuple(t.spec.name for t in result)))
        return failures

    def tools(self) -> list[McpTool]:
        return [tool for source in self._sources for tool in source.tools]

    async def aclose(self, timeout: float = CLOSE_GRACE_SECONDS) -> None:
        """Close every server concurrently, bounded by ``timeout`` each."""
        sources, self._sources = self._sources, []
        await asyncio.gather(*(s.aclose(timeout) for s in sources), return_exceptions=True)
        await self._supervisor.shutdown(timeout)


def _replace_timeout(cfg: McpServerConfig, timeout: float) -> McpServerConfig:
    import dataclasses

    return dataclasses.replace(cfg, startup_timeout=timeout)
