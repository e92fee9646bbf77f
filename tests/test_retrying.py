"""run_with_retries: the first try runs bare; a failure hands over to the tenacity policy unchanged."""

from __future__ import annotations

import pytest
import tenacity

from core.retrying import run_with_retries


class Flaky:
    def __init__(self, *outcomes: Exception | str) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def policy(seen: list[tuple[int, str]], attempts: int = 3):  # type: ignore[no-untyped-def]
    def before_sleep(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        seen.append((state.attempt_number, str(state.outcome.exception())))

    def make() -> tenacity.AsyncRetrying:
        seen.append((0, "policy built"))
        return tenacity.AsyncRetrying(retry=tenacity.retry_if_exception_type(ConnectionError),
                                      stop=tenacity.stop_after_attempt(attempts), wait=tenacity.wait_none(),
                                      before_sleep=before_sleep, reraise=True)
    return make


async def test_a_first_success_never_builds_the_policy():
    seen: list[tuple[int, str]] = []
    body = Flaky("ok")
    assert await run_with_retries(policy(seen), body) == "ok"
    assert body.calls == 1 and seen == []


async def test_the_first_failure_is_the_policys_attempt_one():
    seen: list[tuple[int, str]] = []
    body = Flaky(ConnectionError("first"), ConnectionError("second"), "ok")
    assert await run_with_retries(policy(seen), body) == "ok"
    assert body.calls == 3
    assert seen == [(0, "policy built"), (1, "first"), (2, "second")]


async def test_a_failure_the_policy_does_not_retry_is_raised_as_is():
    seen: list[tuple[int, str]] = []
    body = Flaky(ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        await run_with_retries(policy(seen), body)
    assert body.calls == 1


async def test_the_stop_rule_counts_the_first_failure():
    seen: list[tuple[int, str]] = []
    body = Flaky(ConnectionError("1"), ConnectionError("2"), ConnectionError("3"), "never reached")
    with pytest.raises(ConnectionError, match="3"):
        await run_with_retries(policy(seen, attempts=3), body)
    assert body.calls == 3
