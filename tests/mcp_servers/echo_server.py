"""A small MCP server for the tests, written with the official SDK.

``python echo_server.py`` serves over stdio; ``python echo_server.py --http [--port N]`` serves streamable
HTTP on 127.0.0.1 (an ephemeral port unless ``--port`` names one) and prints ``PORT <n>`` on stdout once it
is listening.

It can be told to go away: the ``crash`` tool ends the process at once, the ``pid`` tool tells a test whom
to kill, and with ``ECHO_FAIL_STARTS=<file>`` in its environment a start while the file holds a number above
zero counts it down and exits at once with status 2 (a server that keeps failing to come back). ``stderr``
writes a line to its stderr, ``stderr_env`` the value of one of its environment variables.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("echo")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail() -> str:
    """Always fails."""
    raise ToolError("this tool always fails")


@server.tool()
def crash() -> str:
    """End the server process at once, without answering."""
    os._exit(1)


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def stderr(text: str) -> str:
    """Write ``text`` as a line to this server's stderr."""
    print(text, file=sys.stderr, flush=True)
    return "written"


@server.tool()
def stderr_env(name: str) -> str:
    """Write the value of one environment variable to this server's stderr."""
    print(f"{name} is {os.environ.get(name, '')}", file=sys.stderr, flush=True)
    return "written"


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def big(size: int) -> str:
    """A text of ``size`` characters: "0123456789" repeated, so a cut shows where it was made."""
    return ("0123456789" * (size // 10 + 1))[:size]


@server.tool()
def env(name: str) -> str:
    """The value of one environment variable of this server process ("" when unset)."""
    return os.environ.get(name, "")


def _fail_start_if_told() -> None:
    path = os.environ.get("ECHO_FAIL_STARTS")
    if not path:
        return
    try:
        left = int(open(path).read().strip() or 0)
    except FileNotFoundError:
        return
    if left > 0:
        with open(path, "w") as f:
            f.write(str(left - 1))
        print(f"failing this start on purpose ({left - 1} more to fail)", file=sys.stderr, flush=True)
        raise SystemExit(2)


async def _serve_http(port: int) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    app = server.streamable_http_app()
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn_server = uvicorn.Server(config)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await uvicorn_server.serve(sockets=[sock])


if __name__ == "__main__":
    _fail_start_if_told()
    argv = sys.argv[1:]
    if "--http" in argv:
        asyncio.run(_serve_http(int(argv[argv.index("--port") + 1]) if "--port" in argv else 0))
    else:
        server.run()
