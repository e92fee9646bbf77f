"""A TCP port on 127.0.0.1 to give a server that a test or benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on at the moment of asking (the system's pick; it stays free unless another
    program binds it before the caller does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
