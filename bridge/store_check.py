"""``chatbridge check`` on the configured store: a PostgreSQL database is reached and its schema version
reported, without changing anything (``chatbridge run`` migrates it). Nothing printed names the connection
string; every line is masked with the config's secrets besides."""

from __future__ import annotations

from bridge.app import ASYNCPG_MISSING
from bridge.config import AppConfig
from channels.common.masking import mask
from core.store import StoreError


async def check_store(config: AppConfig) -> tuple[list[str], bool]:
    """Lines for the operator and whether the store can be used; SQLite has nothing to reach."""
    if config.store.backend != "postgresql":
        return [], True
    try:
        from core.postgresql.schema import MIGRATIONS
        from core.postgresql.store import database_schema_version
    except ImportError:
        return [f"store: {ASYNCPG_MISSING}"], False
    latest = len(MIGRATIONS)
    try:
        version = await database_schema_version(config.store.dsn.strip())
    except StoreError as exc:
        return [mask(f"store: cannot reach the PostgreSQL database in [store] dsn: {exc}",
                     config.secret_values())], False
    if version > latest:
        return [f"store: PostgreSQL reachable; schema version {version} is newer than this chatbridge "
                f"({latest}): upgrade chatbridge"], False
    if version < latest:
        todo = "chatbridge run creates the tables" if version == 0 else f"chatbridge run migrates it to {latest}"
        return [f"store: PostgreSQL reachable; schema version {version} ({todo})"], True
    return [f"store: PostgreSQL reachable; schema version {version} (current)"], True
