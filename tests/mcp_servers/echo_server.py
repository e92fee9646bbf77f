"""A small MCP server for the tests, written with the official SDK.

``python echo_server.py`` serves over stdio; ``python echo_server.py --http`` serves streamable HTTP on an
ephemeral port of 127.0.0.1 and prints ``PORT <n>`` on stdout once it is listening.
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


async def _serve_http() -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    app = server.streamable_http_app()
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn_server = uvicorn.Server(config)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await uvicorn_server.serve(sockets=[sock])


if __name__ == "__main__":
    if "--http" in sys.argv[1:]:
        asyncio.run(_serve_http())
    else:
        server.run()
