"""``[store]``: the config keys (errors name the key path and never echo the connection string), and
``chatbridge check`` reaching a PostgreSQL store and reporting its schema version without printing a secret."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.config import ConfigError, load_config
from tests.support.ports import free_port
from tests.support.postgres import PostgresCluster

PASSWORD = "pw-Sekr3t-9731"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "chatbridge.toml"
    path.write_text(text, encoding="utf-8")
    return path


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=env or {})
    return info.value.problems


def test_the_default_store_is_sqlite_with_nothing_to_set() -> None:
    cfg = load_config(None, env={})
    assert (cfg.store.backend, cfg.store.dsn, cfg.store.pool_size) == ("sqlite", "", 10)
    assert cfg.masked_dump()["store"] == {"backend": "sqlite", "dsn": "", "pool_size": 10,
                                                 "lease_seconds": 10.0}


def test_a_postgresql_dsn_is_a_secret_with_its_password(tmp_path: Path) -> None:
    dsn = f"postgresql://chat:{PASSWORD}@db.internal:5432/chatbridge"
    cfg = load_config(write(tmp_path, '[store]\nbackend = "PostgreSQL"\ndsn = "${DB}"\npool_size = 4\n'),
                      env={"DB": dsn})
    assert (cfg.store.backend, cfg.store.dsn, cfg.store.pool_size) == ("postgresql", dsn, 4)
    assert cfg.masked_dump()["store"]["dsn"] == "***"
    assert PASSWORD not in str(cfg.masked_dump()) and PASSWORD not in repr(cfg)
    assert {dsn, PASSWORD} <= set(cfg.secret_values())  # the logs redact either


def test_store_errors_name_the_key_and_never_the_dsn(tmp_path: Path) -> None:
    assert problems(tmp_path, '[store]\nbackend = "postgresql"\n') == [
        "store.dsn: required for backend 'postgresql' (e.g. dsn = \"${CHATBRIDGE_DSN}\" holding "
        "postgresql://USER:PASSWORD@HOST:5432/DATABASE) (got empty)"]
    assert problems(tmp_path, '[store]\nbackend = "postgresql"\ndsn = "${DB}"\n') == [
        "store.dsn: environment variable DB is not set"]
    wrong = problems(tmp_path, f'[store]\nbackend = "postgresql"\ndsn = "mysql://u:{PASSWORD}@h/db"\n')
    assert wrong == ["store.dsn: expected a postgresql:// URI (e.g. dsn = \"${CHATBRIDGE_DSN}\" holding "
                     "postgresql://USER:PASSWORD@HOST:5432/DATABASE)"]
    port = problems(tmp_path, f'[store]\nbackend = "postgresql"\ndsn = "postgresql://u:{PASSWORD}@h:port/db"\n')
    assert port[0].startswith("store.dsn: not a usable connection URI")
    unused = problems(tmp_path, f'[store]\ndsn = "postgresql://u:{PASSWORD}@h/db"\n')
    assert unused[0].startswith("store.dsn: only used with backend 'postgresql'")
    assert problems(tmp_path, '[store]\nbackend = "mysql"\npool_size = 0\nurl = "x"\n') == [
        "store.backend: expected one of sqlite, postgresql (got 'mysql')",
        "store.pool_size: expected a value >= 1 (got 0)",
        "store.url: unknown key"]
    listed = problems(tmp_path, f'[store]\nbackend = "postgresql"\ndsn = ["{PASSWORD}"]\n')
    assert listed[0] == "store.dsn: expected a string"
    for found in (wrong, port, unused, listed):
        assert PASSWORD not in "\n".join(found)


def _check(tmp_path: Path, dsn: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = write(tmp_path, f'[store]\nbackend = "postgresql"\ndsn = "{dsn}"\n')
    code = main(["check", "-c", str(path)])
    out, err = capsys.readouterr()
    return code, out + err


def test_check_reaches_postgresql_and_reports_the_schema_version(
        tmp_path: Path, postgres: PostgresCluster, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from core.postgresql.schema import MIGRATIONS
    from core.postgresql.store import PostgresqlStore

    monkeypatch.chdir(tmp_path)
    dsn = postgres.fresh_dsn().replace("postgres@", f"postgres:{PASSWORD}@")  # trust auth ignores it
    code, out = _check(tmp_path, dsn, capsys)
    assert code == 0, out
    assert "store: PostgreSQL reachable; schema version 0 (chatbridge run creates the tables)" in out
    async def migrate() -> None:  # what `chatbridge run` does first
        store = PostgresqlStore(dsn)
        await store.open()
        await store.close()

    asyncio.run(migrate())
    code, out = _check(tmp_path, dsn, capsys)
    assert code == 0 and f"store: PostgreSQL reachable; schema version {len(MIGRATIONS)} (current)" in out
    assert PASSWORD not in out and dsn not in out


def test_check_fails_when_postgresql_cannot_be_reached(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("asyncpg", reason="the `postgresql` extra is not installed")
    monkeypatch.chdir(tmp_path)
    port = free_port()  # a port nothing listens on
    code, out = _check(tmp_path, f"postgresql://chat:{PASSWORD}@127.0.0.1:{port}/chatbridge", capsys)
    assert code == 1
    assert "store: cannot reach the PostgreSQL database in [store] dsn: postgresql store: check failed" in out
    assert PASSWORD not in out


def test_run_refuses_to_start_when_postgresql_cannot_be_reached(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("asyncpg", reason="the `postgresql` extra is not installed")
    monkeypatch.chdir(tmp_path)
    port = free_port()
    path = write(tmp_path, f'[store]\nbackend = "postgresql"\ndsn = "postgresql://chat:{PASSWORD}@127.0.0.1:{port}/db"\n'
                           '[llm]\nprovider = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n'
                           f'[web]\nport = {port}\n')
    assert main(["run", "-c", str(path)]) == 3
    out, err = capsys.readouterr()
    assert "chatbridge: cannot use the PostgreSQL database in [store] dsn: postgresql store: open failed" in err
    assert PASSWORD not in out + err
