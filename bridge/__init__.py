"""The chatbridge application: operator config, wiring, HTTP server, CLI and lifecycle."""

__version__ = "0.1.0"
