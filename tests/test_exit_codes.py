"""The exit status of `chatbridge run`, `check` and `init`, as the README documents them, from real processes
where the status comes from the process itself."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
import types
from pathlib import Path

import aiohttp

from bridge.cli import main
from bridge.exit_codes import ExitCode
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_documents_every_exit_status():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("Exit status (`bridge/exit_codes.py`):", 1)[1].split("\n\n", 2)[1]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", section, flags=re.M)}
    assert documented == {int(code) for code in ExitCode}


def config_text(tmp_path: Path, base_url: str, port: int, extra: str = "") -> str:
    return f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{base_url}"
api_key = "sk-exit-codes"
[web]
port = {port}
{extra}"""


async def chatbridge(tmp_path: Path, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATBRIDGE_", "SLACK_", "TELEGRAM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bridge.cli", *args, cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def finished(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_run_exits_0_when_stopped_by_sigterm_after_a_clean_start(tmp_path, fake_openai):
    port = free_port()
    path = tmp_path / "c.toml"
    path.write_text(config_text(tmp_path, fake_openai.base_url, port))
    proc = await chatbridge(tmp_path, "run", "-c", str(path))
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 120  # a cold start on a busy machine takes a while
            while True:
                assert time.monotonic() < deadline and proc.returncode is None, "chatbridge did not come up"
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code, err = await finished(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == ExitCode.OK, err
    assert "shutting down" in err


async def test_run_exits_3_when_the_port_is_taken_or_a_channel_cannot_start(tmp_path, fake_openai):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "c.toml"
        path.write_text(config_text(tmp_path, fake_openai.base_url, port))
        code, err = await finished(await chatbridge(tmp_path, "run", "-c", str(path)))
    assert code == ExitCode.STARTUP and f"cannot listen on 127.0.0.1:{port}" in err
    path.write_text(config_text(tmp_path, fake_openai.base_url, free_port(),
                                '[channels.telegram]\nenabled = true\ntoken = "not-a-bot-token-tg-secret"\n'))
    code, err = await finished(await chatbridge(tmp_path, "run", "-c", str(path)))
    assert code == ExitCode.STARTUP and "telegram" in err and "tg-secret" not in err


async def test_run_exits_3_when_the_data_dir_cannot_hold_the_database(tmp_path, fake_openai):
    (tmp_path / "data").write_text("a file where the data directory should be")
    path = tmp_path / "c.toml"
    path.write_text(config_text(tmp_path, fake_openai.base_url, free_port()))
    code, err = await finished(await chatbridge(tmp_path, "run", "-c", str(path)))
    assert code == ExitCode.STARTUP and "data_dir" in err and "Traceback" not in err


async def test_run_and_check_exit_2_on_an_invalid_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[web]\nprot = 1\n')
    for command in ("run", "check"):
        code, err = await finished(await chatbridge(tmp_path, command, "-c", str(path)))
        assert code == ExitCode.CONFIG and "web.prot: unknown key (did you mean 'port'?)" in err


def test_init_and_check_exit_statuses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "c.toml"]) == ExitCode.OK
    assert main(["init", "c.toml"]) == ExitCode.FAILURE  # exists, not overwritten
    assert main(["check", "-c", "c.toml"]) == ExitCode.OK
    assert main(["frobnicate"]) == ExitCode.CONFIG


def test_run_exits_1_on_an_unexpected_error(tmp_path, monkeypatch, caplog):
    async def run_app(config, *, config_path, on_started):  # the bridge failing in a way nobody foresaw
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(sys.modules, "bridge.app", types.SimpleNamespace(run_app=run_app))
    monkeypatch.chdir(tmp_path)
    assert main(["run"]) == ExitCode.FAILURE
    assert "disk on fire" in caplog.text  # with its traceback, in the log
