"""Shared pytest fixtures."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:  # make `core`, `channels`, `bridge`, `tests.fakes` importable under plain `pytest`
    sys.path.insert(0, _ROOT)

from hypothesis import settings  # noqa: E402

from bridge.logs import NOISY_LOGGERS  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI  # noqa: E402
from tests.support.harness import shutdown_leftovers  # noqa: E402

# The default run explores the same examples every time, so a red run is never luck; a wider, random search
# is one flag away: `pytest tests/test_fuzz_*.py --hypothesis-profile=explore` (then fix what it finds and
# keep the example with @example, so the default run covers it from then on).
settings.register_profile("default-run", derandomize=True, database=None)
settings.register_profile("explore", max_examples=2000)
settings.load_profile("default-run")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the long variants (marked `long`): more crash seeds and rounds, every platform's "
                          "benchmark smoke")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long variant: `pytest --long` runs it")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _logging_is_restored_after_each_test() -> Iterator[None]:
    """``chatbridge run`` (``configure_logging``) replaces the root handlers and levels for the whole
    process; a test that runs it must not change what later tests log, or where."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
    for name, saved in levels.items():
        logging.getLogger(name).setLevel(saved)


@pytest.fixture(autouse=True)
async def _no_chat_core_outlives_its_test() -> AsyncIterator[None]:
    yield
    await shutdown_leftovers()


@pytest.fixture
async def fake_openai() -> AsyncIterator[FakeOpenAI]:
    """A started fake OpenAI-compatible server on 127.0.0.1; ``base_url`` ends with ``/v1``."""
    async with FakeOpenAI() as fake:
        yield fake

@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for a test's requests to the web chat's API."""
    async with aiohttp.ClientSession() as session:
        yield session


from tests.fakes.anthropic_server import FakeAnthropic  # noqa: E402


@pytest.fixture
async def chat(tmp_path: Path, fake_openai: FakeOpenAI) -> AsyncIterator[Any]:
    """A web chat on the fake model, served on 127.0.0.1 (a test file with other needs defines its own)."""
    from tests.browser.server import start_web_chat

    wc = await start_web_chat(tmp_path, fake_openai)
    try:
        yield wc
    finally:
        await wc.close()


@pytest.fixture
async def fake_anthropic() -> AsyncIterator[FakeAnthropic]:
    """A started fake Anthropic Messages API on 127.0.0.1; ``base_url`` has no ``/v1`` (the SDK adds it)."""
    async with FakeAnthropic() as fake:
        yield fake

from tests.fakes.slack import FakeSlack  # noqa: E402
from tests.fakes.telegram import FakeTelegram  # noqa: E402


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    """A started fake Telegram Bot API on 127.0.0.1 (``base_url`` and ``token`` are what aiogram takes)."""
    async with FakeTelegram() as fake:
        yield fake


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    """A started fake Slack (Web API + Socket Mode) on 127.0.0.1; ``base_url`` is what AsyncWebClient takes."""
    async with FakeSlack() as fake:
        yield fake

from tests.fakes.feishu import FakeFeishu  # noqa: E402
from tests.fakes.feishu.harness import CHAT as FEISHU_CHAT  # noqa: E402
from tests.fakes.feishu.harness import harnesses as feishu_harnesses  # noqa: E402


@pytest.fixture
async def fake_feishu() -> AsyncIterator[FakeFeishu]:
    """A started fake Feishu Open Platform on 127.0.0.1 with the harness's group chat."""
    async with FakeFeishu() as fake:
        fake.chat(FEISHU_CHAT)
        yield fake


@pytest.fixture
async def feishu_bridge(request: pytest.FixtureRequest, tmp_path: Path, fake_openai: FakeOpenAI,
                        fake_feishu: FakeFeishu) -> AsyncIterator[Any]:
    """Makes a bridge serving ``fake_feishu`` over its long connection (``harnesses``' maker), or in the mode
    it is parametrised with (``every_mode``)."""
    async with feishu_harnesses(getattr(request, "param", "websocket"), tmp_path, fake_openai, fake_feishu) as make:
        yield make

from tests.support.postgres import PostgresCluster, running_cluster  # noqa: E402


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 for the whole run (skips when PostgreSQL is absent);
    ``fresh_dsn()`` makes an empty database for one test."""
    with running_cluster() as cluster:
        if isinstance(cluster, str):
            pytest.skip(cluster)
        try:
            import asyncpg  # noqa: F401
        except ImportError:
            pytest.skip("asyncpg is not installed (the `postgresql` extra: pip install -e \".[postgresql]\")")
        yield cluster
