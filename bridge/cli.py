"""The `chatbridge` command: run, check, init.

Without ``-c FILE``, ``run`` and ``check`` use ``$CHATBRIDGE_CONFIG`` if set, else ``./chatbridge.toml`` if it
exists (what ``chatbridge init`` writes), else the embedded default (web chat on 127.0.0.1:8765, local model).
Exit codes: ``bridge.exit_codes.ExitCode`` (0 ok, 1 operational failure, 2 invalid config or usage, 3 ``run``
cannot start with this config here, 130 interrupted), listed in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from bridge import __version__
from bridge.config import EMBEDDED_DEFAULT, AppConfig, ConfigError, load_config
from bridge.exit_codes import ExitCode

DEFAULT_CONFIG_FILE = "chatbridge.toml"
CONFIG_ENV_VAR = "CHATBRIDGE_CONFIG"


def template_text() -> str:
    """The commented config template shipped with the package (``bridge/templates/chatbridge.toml``)."""
    return resources.files("bridge").joinpath("templates", "chatbridge.toml").read_text(encoding="utf-8")


def resolve_config_path(option: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """``-c FILE``, else ``$CHATBRIDGE_CONFIG``, else ``./chatbridge.toml`` if present, else None."""
    if option:
        return option
    environ = os.environ if env is None else env
    if environ.get(CONFIG_ENV_VAR):
        return environ[CONFIG_ENV_VAR]
    return DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).is_file() else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatbridge",
        description="Chat with an LLM agent from Telegram, Slack, Feishu/Lark and a built-in web chat.",
        epilog=f"Without -c: ${CONFIG_ENV_VAR}, else ./{DEFAULT_CONFIG_FILE} if it exists, else the embedded "
        "default (web chat on http://127.0.0.1:8765 with the local model).",
    )
    parser.add_argument("--version", action="version", version=f"chatbridge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="start the bridge")
    run.add_argument("-c", "--config", metavar="FILE", help="the TOML config file")

    check = commands.add_parser("check", help="validate the config and print it with secrets masked; "
                               "reach a PostgreSQL store and report its schema version; start each MCP server "
                               "and list its tools (exit 1 if the store or a server fails)")
    check.add_argument("-c", "--config", metavar="FILE", help="the TOML config file")

    init = commands.add_parser("init", help="write a commented config template")
    init.add_argument("file", nargs="?", default=DEFAULT_CONFIG_FILE, help=f"default: {DEFAULT_CONFIG_FILE}")
    init.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    return parser


def _load(path: str | None) -> AppConfig | None:
    warnings: list[str] = []
    try:
        config = load_config(path, warnings=warnings)
    except ConfigError as exc:
        where = exc.source or path or EMBEDDED_DEFAULT
        print(f"config error in {where}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None
    if warnings:
        print(f"config warning in {path or EMBEDDED_DEFAULT}:", file=sys.stderr)
        for warning in warnings:
            print(f"  {warning}", file=sys.stderr)
    return config


def _check(option: str | None) -> int:
    path = resolve_config_path(option)
    config = _load(path)
    if config is None:
        return ExitCode.CONFIG
    print(json.dumps(config.masked_dump(), indent=2, ensure_ascii=False))
    print(f"config OK: {path or EMBEDDED_DEFAULT}")
    if config.store.backend == "postgresql":
        from bridge.store_check import check_store

        lines, ok = asyncio.run(check_store(config))
        print("\n".join(lines), flush=True)
        if not ok:
            return ExitCode.FAILURE
    if config.agent.mcp_servers:
        from bridge.logs import configure_logging
        from bridge.mcp import check_mcp_servers

        configure_logging(config.bridge.log_level, config.secret_values())  # the servers' own output, masked
        lines, ok = asyncio.run(check_mcp_servers(config))
        print("\n".join(lines), flush=True)
        if not ok:
            return ExitCode.FAILURE
    return ExitCode.OK


def _init(file: str, force: bool) -> int:
    path = Path(file)
    if path.is_dir():
        print(f"chatbridge init: {path} is a directory", file=sys.stderr)
        return ExitCode.FAILURE
    if path.exists() and not force:
        print(f"chatbridge init: {path} already exists; not overwriting it (use --force)", file=sys.stderr)
        return ExitCode.FAILURE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600 on creation: operators often paste a token into the file despite the advice in it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(template_text())
    except OSError as exc:
        print(f"chatbridge init: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return ExitCode.FAILURE
    print(f"wrote {path}")
    print(f"next: edit it, then `chatbridge check -c {path}` and `chatbridge run -c {path}`")
    return ExitCode.OK


def _run(option: str | None) -> int:
    path = resolve_config_path(option)
    config = _load(path)
    if config is None:
        return ExitCode.CONFIG
    print(f"chatbridge {__version__}: using {path or EMBEDDED_DEFAULT}", file=sys.stderr)
    from bridge.app import run_app
    from bridge.channels import preload
    from bridge.gc_tuning import tune_gc

    try:
        preload(config.enabled_channels())
        return int(asyncio.run(run_app(config, config_path=path, on_started=tune_gc)))
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except Exception:
        logging.getLogger("chatbridge").exception("chatbridge stopped on an unexpected error")
        return ExitCode.FAILURE


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: return instead of exiting
        return exc.code if isinstance(exc.code, int) else (ExitCode.OK if exc.code is None else ExitCode.CONFIG)
    if args.command == "check":
        return _check(args.config)
    if args.command == "init":
        return _init(args.file, args.force)
    if args.command == "run":
        return _run(args.config)
    parser.print_help(sys.stderr)
    return ExitCode.CONFIG


if __name__ == "__main__":
    raise SystemExit(main())
