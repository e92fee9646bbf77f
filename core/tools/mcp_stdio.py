"""A stdio transport for MCP servers that never holds more than a bound of one message.

Why not the SDK's (``mcp.client.stdio.stdio_client``): it reads each message as one line of any length,
joining the pipe's chunks by string concatenation (quadratic in the line's length) and then parsing the
whole line, so a 10 MB tool result cost about 100 MB and seconds of CPU, and a 50 MB one ran past the call
timeout; it has no setting that bounds a line. Everything else is kept as the SDK does it: the SDK's safe
default environment, the server in a process group of its own, and on exit stdin closed, a grace period,
then the SDK's own termination of the process group; a stop that is cancelled part way (a close cut short,
a forced exit) kills the process group at once instead, so that no server outlives the bridge.
``ClientSession`` takes these streams like any transport's. (On Windows the SDK's transport is used as it
is, without the bound.)

The server's stderr is read line by line (each line bounded to ``MAX_STDERR_LINE`` bytes) and handed to
the caller's ``stderr`` function, which logs it; the end of its stdout (the server exited, or is exiting)
is reported to ``on_exit`` with the exit status, so a server that dies while nobody calls it is noticed at
once rather than at the next call.

stdout is read as bytes, and at most ``max_message_bytes`` of a line are kept: the rest of a longer line is
read and dropped, and the message is rebuilt from its head by :func:`salvage`. A tool result keeps the text
it had so far, marked as cut (and flagged in ``_meta`` under ``CUT_META``, with ``isError`` set so that the
SDK does not hold the cut result against the tool's output schema; :mod:`core.tools.mcp` reads the flag
and treats the result as the tool's text). Any other oversized answer becomes a JSON-RPC error naming its
size, so the request it answers fails at once instead of waiting for its timeout. So does an answer that is
not valid JSON-RPC (its result not an object, no ``"jsonrpc"``, a line cut short) when its ``id`` can be
read: the SDK drops what it cannot parse, and the call would wait out its timeout. Other lines that are
not JSON-RPC (a server's debug output) are dropped: the first of a connection is logged, the rest counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import pydantic_core
from anyio.abc import Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The most of one message (one line) kept in memory; also the bound on one streamable-HTTP event."""
CUT_META = "chatbridge/cut_at_bytes"
"""``_meta`` key of a result rebuilt from the head of an oversized message: its full size in bytes."""
EXIT_POLL_SECONDS = 0.25
"""How often a running server is looked at for having exited (``_watch_exit``)."""
EXIT_GRACE_SECONDS = 2.0
"""How long the server gets to exit on its own once its stdin is closed (the SDK waits as long)."""
MAX_STDERR_LINE = 8192
"""The most of one line of the server's stderr that is kept (the rest of a longer line is counted, not kept)."""
TAIL_BYTES = 256
"""The last bytes of an oversized line that are kept, to find its ``id`` when it comes after the result."""
TAIL_ID = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)\s*(?:,[^{}]*)?}\s*$')
"""The top-level ``"id"`` at the end of a message (only other plain members may follow it)."""
CUT_WORD = re.compile(r"(?<=\s)\S{1,256}$")
"""The last word of a stderr line cut at ``MAX_STDERR_LINE``, when it is short enough to be a secret's head."""
STRAY_SUMMARY_SECONDS = 300.0
"""How often, at most, the lines a server wrote to its stdout that are not JSON-RPC are summed up in the log."""


@contextlib.asynccontextmanager
async def bounded_stdio_client(command: str, args: Sequence[str], env: Mapping[str, str] | None,
                               stderr: Callable[[str], None], on_exit: Callable[[int | None], None] | None = None,
                               max_message_bytes: int = MAX_MESSAGE_BYTES,
                               name: str = "?") -> AsyncIterator[tuple[Any, Any]]:
    """Start the server and yield (read stream, write stream) for ``mcp.ClientSession``.

    ``stderr`` gets each line the server writes to its stderr; ``on_exit`` the server's exit status (None
    when it closed its stdout but had not exited a moment later) once its stdout ends. ``name`` (the
    server's name in the config) is in every warning about what the server wrote."""
    if sys.platform == "win32":  # pragma: no cover - the SDK spawns in a Job Object there
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        async with stdio_client(StdioServerParameters(command=command, args=list(args), env=dict(env or {})),
                                errlog=sys.stderr) as streams:
            yield streams
        return

    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process([command, *args], env=get_default_environment() | dict(env or {}),
                                       stderr=subprocess.PIPE, start_new_session=True)
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    stderr_done = anyio.Event()
    exit_reported = False

    def exited(status: int | None) -> None:  # from whichever notices first: stdout ending, or the exit itself
        nonlocal exit_reported
        if not exit_reported and on_exit is not None:
            exit_reported = True
            on_exit(status)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_read, process, read_writer, max_message_bytes, exited, name)
            group.start_soon(_watch_exit, process, read_writer, exited)
            group.start_soon(_write, process, write_reader, read_writer)
            group.start_soon(_read_stderr, process, stderr, stderr_done)
            try:
                yield read_stream, write_stream
            finally:
                try:
                    with anyio.CancelScope(shield=True):
                        read_stream.close()  # the reader now only drains the pipe
                        await write_stream.aclose()
                        await _stop(process, stderr_done)
                except BaseException:
                    # The shield holds off anyio's cancellation only: a plain asyncio cancel (a close cut short
                    # by its timeout, a forced exit, the event loop's final cancel of what is left) still cuts
                    # the stop at its first wait. The server is then killed at once, its helpers with it, so
                    # that none is left running after the bridge.
                    _end_group(process.pid)
                    raise
                finally:
                    group.cancel_scope.cancel()
    finally:
        for stream in (read_stream, read_writer, write_stream, write_reader):
            await stream.aclose()


class _StrayLines:
    """The lines of one connection's stdout that are not JSON-RPC messages (a server's debug output, where only
    the protocol belongs). The first is logged as a warning; the rest are counted and summed up in one line
    at most every ``STRAY_SUMMARY_SECONDS`` and at the end of the connection: a server that prints a line per
    step of its work would otherwise fill the log with a warning per line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.unreported = 0
        self.reported_at = 0.0

    def add(self, size: int) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("MCP server %r wrote a line to its stdout that is not a JSON-RPC message (%d bytes; a "
                        "server must log to stderr)", self.name, size)
            self.reported_at = anyio.current_time()
            return
        self.unreported += 1
        if anyio.current_time() - self.reported_at >= STRAY_SUMMARY_SECONDS:
            self.report()

    def report(self) -> None:
        if self.unreported:
            log.warning("MCP server %r wrote %d more lines to its stdout that are not JSON-RPC messages (%d in all "
                        "on this connection)", self.name, self.unreported, self.count)
            self.unreported = 0
            with contextlib.suppress(RuntimeError):  # at the end of the connection, from a finally
                self.reported_at = anyio.current_time()


async def _read(process: Process, out: MemoryObjectSendStream[Any], limit: int,
                on_exit: Callable[[int | None], None] | None, name: str) -> None:
    stray = _StrayLines(name)
    try:
        await _read_lines(process, out, limit, on_exit, name, stray)
    finally:
        stray.report()


async def _read_lines(process: Process, out: MemoryObjectSendStream[Any], limit: int,
                      on_exit: Callable[[int | None], None] | None, name: str, stray: _StrayLines) -> None:
    assert process.stdout is not None
    head = bytearray()
    tail = bytearray()
    """The last bytes of an oversized line (a server may write the id of its answer last)."""
    size = 0
    async with out:
        try:
            async for chunk in process.stdout:
                start = 0
                while True:
                    newline = chunk.find(b"\n", start)
                    end = len(chunk) if newline < 0 else newline
                    size += end - start
                    room = limit - len(head)
                    if room > 0:
                        head += chunk[start:min(end, start + room)]
                    if size > limit:
                        tail += chunk[max(start, end - TAIL_BYTES):end]
                        del tail[:-TAIL_BYTES]
                    if newline < 0:
                        break
                    message = _message(bytes(head), size, limit, bytes(tail), name, stray)
                    head.clear()
                    tail.clear()
                    size = 0
                    start = newline + 1
                    if message is not None:
                        await out.send(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # The session is gone: keep reading (and dropping) so a server flushing its output on the way
            # out does not block on a full pipe and miss its chance to exit.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for _ in process.stdout:
                    pass
        except OSError:
            pass  # the pipe broke: the session sees the read stream end
        if on_exit is not None:
            # stdout ended: the server exited, or is about to. Its exit status is reported before the session
            # sees the stream end, so a call cut short by the exit fails with that as its reason.
            await _exited(process, EXIT_GRACE_SECONDS)
            on_exit(process.returncode)


async def _read_stderr(process: Process, sink: Callable[[str], None], done: anyio.Event,
                       limit: int = MAX_STDERR_LINE) -> None:
    """Each line of the server's stderr to ``sink``, until the pipe ends (kept short: see ``MAX_STDERR_LINE``)."""
    assert process.stderr is not None
    line = bytearray()
    over = 0

    def emit() -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        if over:
            # A word the cut ran through may be the head of a secret, which only a whole value is masked as:
            # a short last word goes with the rest (a line that is one long token keeps its head).
            cut = CUT_WORD.search(text)
            kept = text[:cut.start()].rstrip() if cut is not None else text
            dropped = len(text.encode()) - len(kept.encode())
            text = kept + f"… ({over + dropped:,} more bytes of this line not shown)"
        if text.strip():
            sink(text)

    try:
        async for chunk in process.stderr:
            start = 0
            while True:
                newline = chunk.find(b"\n", start)
                end = len(chunk) if newline < 0 else newline
                room = max(limit - len(line), 0)
                line += chunk[start:start + min(end - start, room)]
                over += max(end - start - room, 0)
                if newline < 0:
                    break
                emit()
                line.clear()
                over = 0
                start = newline + 1
        emit()
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass
    finally:
        done.set()


async def _watch_exit(process: Process, reads: MemoryObjectSendStream[Any],
                      exited: Callable[[int | None], None]) -> None:
    """A server that exited while a process it started still holds its stdout open (a helper that inherited
    the pipe) never ends the stream: its exit is noticed here, and the session is shown the end of it."""
    while process.returncode is None:  # noqa: ASYNC110 - nothing signals an exit without waiting on the pipes
        await anyio.sleep(EXIT_POLL_SECONDS)
    await anyio.sleep(EXIT_GRACE_SECONDS)  # stdout ends at the exit as a rule, and the reader reports it
    exited(process.returncode)
    reads.close()


async def _write(process: Process, messages: MemoryObjectReceiveStream[Any],
                 reads: MemoryObjectSendStream[Any]) -> None:
    assert process.stdin is not None
    try:
        async with messages:
            async for message in messages:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await process.stdin.send(data.encode("utf-8"))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await reads.aclose()  # the server stopped reading: let the session see the end


async def _stop(process: Process, stderr_done: anyio.Event) -> None:
    """stdin closed, a grace period, then the process group terminated (the SDK's own escalation); what the
    server wrote to stderr on its way out is read before the pipes are closed."""
    from mcp.os.posix.utilities import terminate_posix_process_tree

    for pipe in (process.stdin,):
        if pipe is not None:
            with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await pipe.aclose()
    if not await _exited(process, EXIT_GRACE_SECONDS):
        await terminate_posix_process_tree(process, EXIT_GRACE_SECONDS)
        await _exited(process, EXIT_GRACE_SECONDS)
    _end_group(process.pid)  # what the server started and left behind (its own session: a group of its own)
    with anyio.move_on_after(EXIT_GRACE_SECONDS):  # a child of the server may still hold the pipe open
        await stderr_done.wait()
    with anyio.move_on_after(EXIT_GRACE_SECONDS), \
            contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.aclose()


async def _exited(process: Process, timeout: float) -> bool:
    # not process.wait(): it also waits for the pipes, which a child of the server may still hold
    with anyio.move_on_after(timeout):
        while process.returncode is None:  # noqa: ASYNC110 - nothing signals an exit without waiting on the pipes
            await anyio.sleep(0.01)
        return True
    return False


def _message(line: bytes, size: int, limit: int, tail: bytes = b"", name: str = "?",
             stray: _StrayLines | None = None) -> Any:
    """One line as a SessionMessage, or None for a blank line or an oversized one that cannot be matched to
    a request. A line that is not a valid message but carries the id of a request of ours is an answer gone
    wrong, and becomes an error answering that request (:func:`invalid_answer`), so the call fails at once
    instead of waiting for its timeout; any other line that is not JSON-RPC is counted in ``stray`` and
    handed on as the parse error (as the SDK does, which drops it)."""
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    if size > limit:
        return salvage(line, size, tail, name)
    if not line.strip():
        return None
    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        answer = invalid_answer(line, name)
        if answer is not None:
            return answer
        (stray or _StrayLines(name)).add(size)
        return exc


def invalid_answer(line: bytes, name: str = "?") -> Any:
    """An error answer (a SessionMessage) for ``line``, which is not a valid JSON-RPC message but looks like an
    answer to a request of ours: it has an ``id`` and no ``method`` (a request of the server's own is not
    answered for it). The id is read leniently: from a line cut short (a JSON object that does not end),
    as far as it goes, or from the line's end, where some servers write it. None when no id is found."""
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    text = line.decode("utf-8", "replace")
    why = ""
    try:
        parsed = pydantic_core.from_json(text)
    except ValueError:
        why = "the line ends before its JSON does"
        try:
            parsed = pydantic_core.from_json(text, allow_partial="trailing-strings")
        except ValueError:
            parsed = None
    if parsed is None:  # not JSON at all, as far as it goes: only an id at its end marks it as an answer
        found = TAIL_ID.search(text.rstrip())
        if found is None or not text.lstrip().startswith("{"):
            return None
        why = "it is not valid JSON"
        parsed = {"id": pydantic_core.from_json(found.group(1))}
    if not isinstance(parsed, dict) or "method" in parsed or not _is_id(parsed.get("id")):
        return None
    if why:
        pass  # not JSON: said above
    elif parsed.get("jsonrpc") != "2.0":
        why = 'it lacks "jsonrpc": "2.0"'
    elif "result" in parsed and not isinstance(parsed["result"], dict):
        why = f'its "result" is a JSON {_json_kind(parsed["result"])}, not an object'
    elif "error" in parsed and "result" not in parsed:
        why = 'its "error" is not an object with a "code" and a "message"'
    else:
        why = 'it is neither a result nor an error answer'
    log.warning("MCP server %r answered request %s with a message that is not valid JSON-RPC (%s); the request "
                "fails with that", name, parsed["id"], why)
    error = {"jsonrpc": "2.0", "id": parsed["id"],
             "error": {"code": -32603, "message": f"the server's answer is not valid JSON-RPC: {why}"}}
    return SessionMessage(jsonrpc_message_adapter.validate_python(error, by_name=False))


def _json_kind(value: object) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "null" if value is None else "value"


def salvage(head: bytes, size: int, tail: bytes = b"", name: str = "?") -> Any:
    """A small, valid message standing for an oversized one of ``size`` bytes whose first bytes are
    ``head``: a tool result keeps its text so far, any other answer becomes an error. Which request it
    answers is read from the head, or from ``tail``, its last bytes, where a server writes the ``id`` after the
    result (the TypeScript SDK's order). None when neither shows it (the request then runs into its
    timeout)."""
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    try:
        # the head is cut anywhere: inside a string (kept as far as it goes), even inside a UTF-8 sequence
        partial = pydantic_core.from_json(head.decode("utf-8", "ignore"), allow_partial="trailing-strings")
    except ValueError:
        partial = None
    if isinstance(partial, dict) and not _is_id(partial.get("id")):
        found = TAIL_ID.search(tail.decode("utf-8", "ignore"))
        if found is not None:
            partial["id"] = pydantic_core.from_json(found.group(1))
    if not isinstance(partial, dict) or not _is_id(partial.get("id")):
        log.warning("dropped a message of %d bytes from MCP server %r that does not say which request it answers",
                    size, name)
        return None
    note = (f"[The tool's result was {size:,} bytes; only its first {len(head):,} bytes were read. "
            "It begins:]")
    result = partial.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        # a block cut short may not have reached its "type" yet (servers order the fields as they like)
        texts = [b["text"] for b in result["content"]
                 if isinstance(b, dict) and b.get("type", "text") == "text" and isinstance(b.get("text"), str)]
        rebuilt: dict[str, Any] = {"jsonrpc": "2.0", "id": partial["id"], "result": {
            "content": [{"type": "text", "text": note}, *({"type": "text", "text": t} for t in texts)],
            "isError": True, "_meta": {CUT_META: size}}}
    else:
        rebuilt = {"jsonrpc": "2.0", "id": partial["id"], "error": {
            "code": -32603, "message": f"the server's answer was {size:,} bytes, more than the "
                                       f"{len(head):,} this client reads"}}
    return SessionMessage(jsonrpc_message_adapter.validate_python(rebuilt, by_name=False))


def _is_id(value: object) -> bool:
    """A JSON-RPC request id (a string or an integer; ``true`` is no id, though Python calls it an int)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _end_group(pgid: int) -> None:
    """Kill what is left of the server's process group once the server itself has gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
