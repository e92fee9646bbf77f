"""The `chatbridge` command: check / init / run, exit codes, masked output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import bridge
from bridge.cli import main, template_text
from bridge.config import AppConfig, load_config
from bridge.gc_tuning import YOUNG_GENERATION_THRESHOLD, tune_gc

ROOT = Path(__file__).resolve().parents[1]

ENV_SECRET = "xoxb-env-secret-0001"
LITERAL_SECRET = "literal-web-token-0002"
SECRET_CONFIG = f"""
[web]
host = "0.0.0.0"
auth_token = "{LITERAL_SECRET}"

[channels.slack]
enabled = true
bot_token = "${{SLACK_BOT_TOKEN}}"
app_token = "xapp-literal-0003"
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No stray ./chatbridge.toml or operator environment leaks into these tests.
    monkeypatch.chdir(tmp_path)
    for name in ("CHATBRIDGE_CONFIG", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "TELEGRAM_BOT_TOKEN",
                 "SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "FEISHU_APP_ID", "FEISHU_APP_SECRET"):
        monkeypatch.delenv(name, raising=False)


def _json_part(stdout: str) -> dict[str, Any]:
    body, _, _ = stdout.rpartition("\nconfig OK")
    return json.loads(body)  # type: ignore[no-any-return]


# ---- check ---------------------------------------------------------------------------------------------


def test_check_ok_masks_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(SECRET_CONFIG)
    monkeypatch.setenv("SLACK_BOT_TOKEN", ENV_SECRET)
    assert main(["check", "-c", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith(f"config OK: {path}")
    dump = _json_part(out)
    assert dump["web"]["auth_token"] == "***"
    assert dump["channels"]["slack"]["bot_token"] == "***"
    assert dump["channels"]["slack"]["signing_secret"] == ""
    assert dump["web"]["host"] == "0.0.0.0"
    for secret in (ENV_SECRET, LITERAL_SECRET, "xapp-literal-0003"):
        assert secret not in out + err


def test_check_error_exit_2_lists_problems_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(SECRET_CONFIG + '\n[llm]\nmodle = "x"\n')  # SLACK_BOT_TOKEN is unset
    assert main(["check", "-c", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"config error in {path}:"
    assert "  llm.modle: unknown key (did you mean 'model'?)" in lines
    assert "  channels.slack.bot_token: environment variable SLACK_BOT_TOKEN is not set" in lines
    assert LITERAL_SECRET not in err and "xapp-literal-0003" not in err


def test_check_error_never_echoes_a_misplaced_env_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[channels.slack]\nmode = "${SLACK_BOT_TOKEN}"\n')  # a secret in the wrong key
    monkeypatch.setenv("SLACK_BOT_TOKEN", ENV_SECRET)
    assert main(["check", "-c", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "channels.slack.mode: expected one of socket, http (got the value of ${SLACK_BOT_TOKEN})" in err
    assert ENV_SECRET not in out + err


def test_check_error_never_echoes_a_secret_pasted_into_the_wrong_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pasted = "sk-proj-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1HgFeDcBa"
    path = tmp_path / "c.toml"
    path.write_text(f'[web]\nport = "{pasted}"\n')
    assert main(["check", "-c", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "  web.port: expected an integer (got a value that looks like a secret, not shown)" in err.splitlines()
    assert pasted[:12] not in out + err


def test_check_warns_about_an_unset_key_variable_it_can_do_without(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOT_SET_VAR", raising=False)
    path = tmp_path / "c.toml"
    path.write_text('[llm]\nprovider = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:11434/v1"\n'
                    'api_key = "${NOT_SET_VAR}"\n')
    assert main(["check", "-c", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith(f"config OK: {path}")
    assert err.splitlines() == [
        f"config warning in {path}:",
        "  llm.api_key: environment variable NOT_SET_VAR is not set; no key is sent to http://127.0.0.1:11434/v1 "
        "(fine only if that server takes requests without one)"]


def test_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "-c", str(tmp_path / "missing.toml")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_check_without_file_uses_local_file_then_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "config OK: the embedded default" in out
    assert _json_part(out)["llm"]["provider"] == "local"

    (tmp_path / "chatbridge.toml").write_text("[web]\nport = 9999\n")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert _json_part(out)["web"]["port"] == 9999

    other = tmp_path / "other.toml"
    other.write_text("[web]\nport = 7777\n")
    monkeypatch.setenv("CHATBRIDGE_CONFIG", str(other))
    assert main(["check"]) == 0
    assert _json_part(capsys.readouterr().out)["web"]["port"] == 7777


# ---- init ----------------------------------------------------------------------------------------------


def test_init_writes_template_that_passes_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "sub" / "bot.toml"
    assert main(["init", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == template_text()
    capsys.readouterr()
    assert main(["check", "-c", str(target)]) == 0  # no environment needed (fixture cleared it)
    assert "config OK" in capsys.readouterr().out


def test_init_default_file_name_and_refuses_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init"]) == 0
    target = tmp_path / "chatbridge.toml"
    assert target.is_file()
    target.write_text("# my edits\n")
    capsys.readouterr()
    assert main(["init"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert target.read_text() == "# my edits\n"
    assert main(["init", "--force"]) == 0
    assert target.read_text(encoding="utf-8") == template_text()


def test_template_equals_example_file() -> None:
    example = ROOT / "config" / "chatbridge.example.toml"
    assert example.read_text(encoding="utf-8") == template_text()
    assert (ROOT / "bridge" / "templates" / "chatbridge.toml").read_text(encoding="utf-8") == template_text()


def test_template_shows_every_key_with_a_comment() -> None:
    text = template_text()
    lines = text.splitlines()
    data = tomllib.loads(text)

    def keys(model: type[Any], table: dict[str, Any], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                keys(annotation, table.get(name, {}), f"{prefix}{name}.")
                continue
            active = name in table
            commented = any(line.startswith(f"# {name} = ") for line in lines)
            assert active or commented, f"{prefix}{name} missing from the template"
            index = next(i for i, line in enumerate(lines)
                         if line.startswith((f"{name} = ", f"# {name} = ")))
            assert lines[index - 1].startswith("#"), f"{prefix}{name} has no comment above it"

    keys(AppConfig, data, "")
    # the template holds the defaults for every key it sets: `init` then `run -c` answers as the embedded default
    template = load_config(ROOT / "config" / "chatbridge.example.toml", env={})
    assert template == load_config(None, env={})
    assert template.llm.provider == "local"


def test_template_mcp_example_documents_every_key_and_loads() -> None:
    from bridge.config import McpServerEntry

    lines = template_text().splitlines()
    start = lines.index("# [[agent.mcp_servers]]")
    block: list[str] = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line.removeprefix("#").removeprefix(" "))
    for name in McpServerEntry.model_fields:
        index = next((i for i, line in enumerate(block) if line.startswith(f"{name} = ")), None)
        assert index is not None, f"agent.mcp_servers.{name} missing from the template example"
        assert block[index - 1].startswith("#"), f"agent.mcp_servers.{name} has no comment above it"
    example = "\n".join(line for line in block if not line.startswith("#"))
    config = AppConfig.model_validate(tomllib.loads("[agent]\n" + example))
    assert [s.name for s in config.agent.mcp_servers] == ["files", "search"]


# ---- run / version -------------------------------------------------------------------------------------


def test_run_delegates_to_run_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[AppConfig, str | None]] = []

    async def run_app(config: AppConfig, *, config_path: str | None, on_started: Callable[[], None]) -> int:
        calls.append((config, config_path))
        assert on_started is tune_gc  # the long-running process tunes its collector once it is up
        return 3

    monkeypatch.setitem(sys.modules, "bridge.app", types.SimpleNamespace(run_app=run_app))
    path = tmp_path / "c.toml"
    path.write_text("[web]\nport = 9001\n")
    assert main(["run", "-c", str(path)]) == 3
    assert calls[0][0].web.port == 9001 and calls[0][1] == str(path)
    assert main(["run"]) == 3
    assert calls[1][1] is None


def test_run_with_bad_config_exits_2_without_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    async def run_app(config: AppConfig, *, config_path: str | None, on_started: Callable[[], None]) -> int:
        raise AssertionError("must not start")

    monkeypatch.setitem(sys.modules, "bridge.app", types.SimpleNamespace(run_app=run_app))
    path = tmp_path / "c.toml"
    path.write_text('[web]\nhost = "0.0.0.0"\n')
    assert main(["run", "-c", str(path)]) == 2
    assert "web.auth_token" in capsys.readouterr().err


def test_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"chatbridge {bridge.__version__}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert bridge.__version__ == pyproject["project"]["version"]
    assert main([]) == 2
    assert main(["frobnicate"]) == 2


def test_subprocess_check_masks_secrets(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(SECRET_CONFIG)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLACK_", "CHATBRIDGE_"))}
    env["SLACK_BOT_TOKEN"] = ENV_SECRET
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    ok = subprocess.run([sys.executable, "-m", "bridge.cli", "check", "-c", str(path)],
                        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "config OK" in ok.stdout
    assert ENV_SECRET not in ok.stdout + ok.stderr and LITERAL_SECRET not in ok.stdout + ok.stderr
    del env["SLACK_BOT_TOKEN"]
    bad = subprocess.run([sys.executable, "-m", "bridge.cli", "check", "-c", str(path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert bad.returncode == 2
    assert "channels.slack.bot_token: environment variable SLACK_BOT_TOKEN is not set" in bad.stderr


def test_tune_gc_freezes_start_up_objects_and_collects_young_objects_less_often() -> None:
    import gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
