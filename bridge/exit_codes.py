"""The exit status of every ``chatbridge`` command, in one place (the README's table lists the same)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """run: stopped by SIGINT/SIGTERM after a clean start; check: valid; init: written."""
    FAILURE = 1
    """check: an MCP server failed to start; init: the file exists or cannot be written; run: stopped on an
    unexpected error (the log has the traceback)."""
    CONFIG = 2
    """Invalid config (every problem named by its dotted key) or bad usage."""
    STARTUP = 3
    """run: the config is valid but the bridge cannot start with it here (a provider or channel this build
    or installation lacks, a channel that refused to start, the port is taken)."""
    FORCED = 4
    """run: a second SIGINT/SIGTERM forced the exit before the orderly shutdown had finished."""
    INTERRUPTED = 130
    """run: Ctrl-C before the bridge had installed its own signal handling."""
