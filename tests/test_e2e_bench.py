"""The end-to-end benchmark (``tests/bench/e2e.py``) at a tiny size, so that it keeps working: the product
(``chatbridge run``) and the minimal pipeline each answer two chats, and each reply shows whole on the
platform's fake. The default run does this on the web chat and Slack, with two model processes (the benchmark's
rig in full); ``pytest --long`` on every platform (each channel's own tests cover its delivery either way).
Nothing here is timed."""

from __future__ import annotations

import pytest

from tests.bench import e2e

DEFAULT_RUN = ("web", "slack")


@pytest.mark.parametrize("platform", [p if p in DEFAULT_RUN else pytest.param(p, marks=pytest.mark.long)
                                      for p in e2e.PLATFORMS])
def test_both_pipelines_answer_every_chat_whole(platform: str) -> None:
    rows = e2e.main(["--platform", platform, "--chats", "2", "--chunks", "5", "--timeout", "60",
                     "--llm-processes", "2"])
    assert [(r["pipeline"], r["done"], r["limited"]) for r in rows] == [("product", 2, 0), ("minimal", 2, 0)]
    assert all(r["calls"] >= 1 for r in rows)  # the platform fake saw the replies being shown
