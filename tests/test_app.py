"""The `run` wiring: health endpoint and clean shutdown, startup refusals, log redaction."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import aiohttp

from bridge.app import run_app
from bridge.config import load_config
from bridge.logs import SecretRedactor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path, body: str):
    path = tmp_path / "chatbridge.toml"
    path.write_text(body)
    return path


async def test_run_serves_health_and_shuts_down_cleanly(tmp_path, fake_openai):
    port = free_port()
    path = write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
api_key = "sk-abc"
[web]
port = {port}
""")
    config = load_config(path)
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(config, config_path=str(path), stop=stop))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        body = await resp.json()
                        assert resp.status == 200
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
            else:
                raise AssertionError("server did not come up")
        assert body == {"status": "ok", "channels": {"web": "serving"}}
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
    assert (tmp_path / "data" / "chatbridge.db").exists()


async def test_run_without_the_local_extra_explains_how_to_install_it_or_use_an_api(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # how Python marks a module as not importable
    config = load_config(write_config(tmp_path, f'[bridge]\ndata_dir = "{tmp_path}"\n[llm]\nprovider = "local"\n'))
    assert await run_app(config, config_path=None) == 3
    err = capsys.readouterr().err
    assert "provider = 'local'" in err and 'pip install -e ".[local]"' in err and "base_url" in err


async def test_run_refuses_enabled_channels_without_an_adapter(tmp_path, capsys, fake_openai):
    config = load_config(write_config(tmp_path, f"""
[llm]
provider = "openai"
model = "m"
base_url = "{fake_openai.base_url}"
[channels.slack]
enabled = true
bot_token = "xoxb-abc"
app_token = "xapp-abc"
"""))
    assert await run_app(config, config_path=None) == 3
    err = capsys.readouterr().err
    assert "slack" in err and "xoxb-abc" not in err


def test_redactor_removes_secrets_from_messages_and_tracebacks():
    redactor = SecretRedactor(["sk-live-123", "hunter2"])
    try:
        raise RuntimeError("auth failed for key sk-live-123")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "using %s and %s", ("sk-live-123", "hunter2"),
                                   exc_info=__import__("sys").exc_info())
    redactor.filter(record)
    text = record.getMessage()
    assert "sk-live-123" not in text and "hunter2" not in text
    assert "***" in text and "auth failed" in text
