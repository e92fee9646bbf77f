"""The token-path benchmark (``tests/bench/token_path.py``) at a tiny size, so that it keeps working: every
core turn it runs must show the whole reply, or the run fails. Nothing here is timed."""

from __future__ import annotations

from tests.bench import token_path


def test_the_token_path_benchmark_runs_every_pipeline_and_core_shows_each_reply_whole() -> None:
    best = token_path.main(["--chunks", "12", "--turns", "6", "--at-once", "3", "--repeats", "1"])
    assert set(best) == {"bare loop", "floor", "core"}
    assert all(0 <= seconds < float("inf") for seconds in best.values())  # every pipeline measured
