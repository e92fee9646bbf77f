"""Headless Chromium for the page tests: Debian's /usr/bin/chromium driven by Playwright (no browser download)."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
async def browser(tmp_path):
    from playwright.async_api import async_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=ARGS,
            viewport={"width": 1100, "height": 760})
        try:
            yield context
        finally:
            await context.close()

