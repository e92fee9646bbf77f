"""``[agent.subagents]``: defaults, the profiles example of the template, and errors named by key path."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bridge.cli import template_text
from bridge.config import AppConfig, ConfigError, SubagentProfileEntry, load_config
from core.settings import SubagentProfile, SubagentSettings


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    return info.value.problems


def test_off_by_default_with_depth_one() -> None:
    settings = load_config(None, env={}).core_settings().subagents
    assert settings == SubagentSettings(enabled=False, max_depth=1, max_concurrent=4, profiles=())


def test_profiles_reach_core(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[agent.subagents]\nenabled = true\nmax_depth = 2\nmax_concurrent = 3\n'
                    '[[agent.subagents.profiles]]\nname = "researcher"\nsystem_prompt = "Research."\n'
                    'tools = ["fetch_url", "files__read_file"]\nmax_turns = 5\nmodel = "gpt-4o"\n'
                    '[[agent.subagents.profiles]]\nname = "plain"\n', encoding="utf-8")
    settings = load_config(path, env={}).core_settings().subagents
    assert settings == SubagentSettings(True, 2, 3, (
        SubagentProfile("researcher", "Research.", ("fetch_url", "files__read_file"), 5, "gpt-4o"),
        SubagentProfile("plain")))


def test_errors_name_the_key(tmp_path: Path) -> None:
    found = problems(tmp_path, '[agent.subagents]\nenabled = true\nmax_depth = 0\nmax_concurrent = 0\n'
                               'colour = "red"\n'
                               '[[agent.subagents.profiles]]\nname = "a b"\ntools = ["ok", "not ok"]\nmax_turns = 0\n'
                               'prompt = "x"\n'
                               '[[agent.subagents.profiles]]\nname = "twin"\n'
                               '[[agent.subagents.profiles]]\nname = "twin"\ntools = ["run_subagent"]\n')
    text = "\n".join(found)
    for path in ("agent.subagents.max_depth", "agent.subagents.max_concurrent", "agent.subagents.colour",
                 "agent.subagents.profiles[0].name", "agent.subagents.profiles[0].tools[1]",
                 "agent.subagents.profiles[0].max_turns", "agent.subagents.profiles[0].prompt"):
        assert path in text, (path, found)


def test_duplicate_names_and_a_profile_that_cannot_nest(tmp_path: Path) -> None:
    found = problems(tmp_path, '[agent.subagents]\nenabled = true\n'
                               '[[agent.subagents.profiles]]\nname = "twin"\n'
                               '[[agent.subagents.profiles]]\nname = "twin"\ntools = ["run_subagent"]\n')
    assert any(p.startswith("agent.subagents.profiles[1].name: duplicate name 'twin'") for p in found), found
    assert any(p.startswith("agent.subagents.profiles[1].tools: lists run_subagent") for p in found), found


def test_template_profiles_example_documents_every_key_and_loads() -> None:
    lines = template_text().splitlines()
    start = lines.index("# [[agent.subagents.profiles]]")
    block: list[str] = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line.removeprefix("#").removeprefix(" "))
    for name in SubagentProfileEntry.model_fields:
        index = next((i for i, line in enumerate(block) if line.startswith(f"{name} = ")), None)
        assert index is not None, f"agent.subagents.profiles.{name} missing from the template example"
        assert block[index - 1].startswith("#"), f"agent.subagents.profiles.{name} has no comment above it"
    example = "\n".join(line for line in block if not line.startswith("#"))
    config = AppConfig.model_validate(tomllib.loads("[agent.subagents]\n" + example))
    assert [p.name for p in config.agent.subagents.profiles] == ["researcher"]
