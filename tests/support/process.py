"""A real ``chatbridge run`` in its own process, for tests that kill it and start it again."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from tests.fakes.telegram import FakeTelegram

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


class BridgeProcess:
    """``python -m bridge.cli run -c CONFIG``; its stderr (the log) goes to ``log_path``."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> BridgeProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATBRIDGE_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bridge.cli", "run", "-c", str(self.config), cwd=self.config.parent,
                env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def kill(self) -> None:
        """SIGKILL: no shutdown code runs, exactly like a crash or an OOM kill."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait for the orderly shutdown; returns the exit code (-1 for a process never started, so
        a test's clean-up can stop every process it made, whatever failed before it started them all)."""
        if self.proc is None:
            return -1
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode if self.proc.returncode is not None else -1


def telegram_config(tmp_path: Path, llm_url: str, tg: FakeTelegram, *, shutdown_timeout: float = 5,
                    port: int | None = None, telegram: str = "") -> Path:
    """``chatbridge.toml`` in ``tmp_path`` for a bridge answering the fake Telegram with the fake model at
    ``llm_url`` (titles off): the web server off unless ``port`` is given, ``telegram`` more keys of the
    channel (a webhook's, say)."""
    web = f"port = {port}" if port is not None else "enabled = false"
    config = tmp_path / "chatbridge.toml"
    config.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
shutdown_timeout = {shutdown_timeout}

[llm]
provider = "openai"
model = "fake-model"
base_url = "{llm_url}"
api_key = "sk-test"
request_timeout = 30

[agent]
titles = false

[web]
{web}

[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
edit_interval_ms = 100
{telegram}
""")
    return config


async def wait_for(cond: Callable[[], Any], bridges: BridgeProcess | Sequence[BridgeProcess],
                   timeout: float = 60.0, what: str = "") -> None:
    """Poll ``cond`` (a function, or a coroutine function) until true (a bound on a hang, never a measure of
    speed); on timeout fail with the tail of each bridge's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = cond()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    group = [bridges] if isinstance(bridges, BridgeProcess) else list(bridges)
    logs = "\n----\n".join(b.log()[-4000 // len(group):] for b in group if b.log_path.exists())
    raise AssertionError(f"{what or 'condition'} not reached in time; bridge log:\n{logs}")


async def get_json(url: str) -> Any:
    """The JSON a GET of ``url`` answers with 200; None for any other status, or when nothing answers."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            return await resp.json() if resp.status == 200 else None
    except aiohttp.ClientError:
        return None


def postgresql_config(directory: Path, *, dsn: str, llm: str, port: int, api_key: str = "sk-test",
                      model: str = "fake", pool_size: int = 3, titles: bool = False, store: str = "",
                      extra: str = "") -> Path:
    """The config of one of several ``chatbridge run`` processes sharing the PostgreSQL database at ``dsn``:
    its own data_dir under ``directory`` and web ``port``, the fake model at ``llm``; ``store`` adds lines
    to ``[store]``, ``extra`` more sections at the end."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "chatbridge.toml"
    path.write_text(f"""
[bridge]
data_dir = "{directory / 'data'}"
shutdown_timeout = 5
[store]
backend = "postgresql"
dsn = "{dsn}"
pool_size = {pool_size}
{store}
[llm]
provider = "openai"
model = "{model}"
base_url = "{llm}"
api_key = "{api_key}"
[agent]
titles = {'true' if titles else 'false'}
[web]
port = {port}
{extra}
""")
    return path


def fetched_past(tg: FakeTelegram, update_id: int) -> bool:
    """The bridge polled with an offset past ``update_id``: it confirmed every update up to it."""
    return any(c.method == "getUpdates" and int(c.params.get("offset") or 0) > update_id for c in tg.calls)


def open_approvals(data_dir: Path, channel: str = "telegram") -> str:
    """The approval requests the running bridge has recorded as open for ``channel`` (read as another process
    would)."""
    with contextlib.closing(sqlite3.connect(data_dir / "chatbridge.db")) as db:
        row = db.execute("SELECT value FROM channel_state WHERE channel = ? AND name = 'open_approvals'",
                         (channel,)).fetchone()
    return row[0] if row else ""
