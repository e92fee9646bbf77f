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


def test_quantiles_as_the_benchmark_prints_them() -> None:
    assert e2e.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert e2e.quantile([float(i) for i in range(100, 0, -1)], 0.99) == 99.0
    assert e2e.quantile([float(i) for i in range(1, 101)], 0.25) == 25.0


def test_the_added_latency_interval_brackets_the_difference_and_only_it() -> None:
    floor = [1.0 + 0.01 * (i % 7) for i in range(60)]
    assert e2e.paired_interval([f + 0.005 for f in floor], floor, 0.5) == pytest.approx((0.005, 0.005))
    noisy = [f + 0.002 * ((i * 37) % 11 - 5) for i, f in enumerate(floor)]  # paired noise of ±10 ms
    low, high = e2e.paired_interval(noisy, floor, 0.5)
    assert low < 0 < high
    assert high - low < 0.03
    with pytest.raises(ValueError, match="differ in length"):
        e2e.paired_interval(noisy, floor[1:], 0.5)


def test_the_latency_mode_times_every_part_of_a_turn() -> None:
    rows = e2e.main(["--latency", "2", "--warmup", "0", "--platform", "web", "--chunks", "5", "--timeout", "60",
                     "--llm-processes", "1"])
    samples = rows[0]["samples"]
    for pipeline in ("product", "minimal"):
        assert [sorted(s) for s in samples[pipeline]] == [["bridge", "first", "in", "out", "total"]] * 2
        # the model's stream lies between what comes before and after it
        assert all(abs(s["in"] + s["out"] - s["bridge"]) < 1e-6 for s in samples[pipeline])
        assert all(0 < s["first"] and s["bridge"] < s["total"] for s in samples[pipeline])


def test_rounds_print_each_ratio_and_the_median_against_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    def row(pipeline: str, round_: int, cpu_ms: float) -> dict[str, object]:
        return {"platform": "telegram", "pipeline": pipeline, "round": round_, "chats": 1000, "done": 1000,
                "cpu_ms": cpu_ms, "p50": 40.0, "p99": 60.0, "rss": 270.0, "calls": 2.1, "limited": 0}

    e2e.print_summary([row("product", 1, 15.0), row("minimal", 1, 10.0), row("minimal", 2, 10.0),
                       row("product", 2, 18.0), row("product", 3, 14.0), row("minimal", 3, 10.0)])
    out = capsys.readouterr().out
    assert "CPU/turn  1.50x" in out and "CPU/turn  1.80x" in out and "(round 3)" in out
    assert "over 3 rounds: median 1.50x, 1.40-1.80x, within 1.5x in 2 of 3" in out
