"""The one call policy of a channel: every try takes a pace slot, 429s pause the scope and do not use up
a try, a send with an unknown outcome is repeated at most once, a live update is tried once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from channels.common.calls import CallPolicy, Calls, outside_bound
from channels.common.errors import PlatformError
from channels.common.throttle import Scope, Throttle
from tests.support.clock import ManualClock

A = Scope("chat:a", 1.0)
POLICY = CallPolicy(initial_wait=0.0, max_wait=0.0, timeout=None)


def failing(*errors: PlatformError):
    """A platform call that fails with ``errors`` in turn, then succeeds; records when each try was made."""
    tries: list[float] = []
    pending = list(errors)

    def make(clock: ManualClock):
        async def call() -> str:
            tries.append(clock.t)
            if pending:
                raise pending.pop(0)
            return "ok"
        return call

    return tries, make


def transient(**kw: object) -> PlatformError:
    return PlatformError("502", kind="transient", **kw)  # type: ignore[arg-type]


async def test_transient_failures_are_tried_three_times_in_all_each_in_its_own_slot():
    clock = ManualClock()
    calls = Calls(Throttle(clock=clock), POLICY)
    tries, make = failing(transient(), transient())
    assert await calls.call(make(clock), scopes=[A]) == "ok"
    assert tries == [0.0, 1.0, 2.0]  # a retry waits for the chat's next slot like any call
    tries, make = failing(transient(), transient(), transient())
    with pytest.raises(PlatformError):
        await calls.call(make(clock), scopes=[A])
    assert len(tries) == 3


async def test_a_429_pauses_the_scope_and_is_waited_out_without_using_up_a_try():
    clock = ManualClock()
    throttle = Throttle(clock=clock)
    calls = Calls(throttle, POLICY)
    limited = [PlatformError("429", kind="rate_limited", retry_after=30.0) for _ in range(4)]
    tries, make = failing(*limited, transient())
    assert await calls.call(make(clock), scopes=[A]) == "ok"
    assert len(tries) == 6 and tries[-1] >= 120.0
    assert throttle.paused_total([A]) >= 120.0


async def test_a_send_whose_outcome_is_unknown_is_repeated_at_most_once():
    clock = ManualClock()
    calls = Calls(Throttle(clock=clock), POLICY)
    tries, make = failing(transient(outcome_unknown=True), transient(outcome_unknown=True))
    with pytest.raises(PlatformError):
        await calls.call(make(clock), scopes=[A], idempotent=False)
    assert len(tries) == 2
    tries, make = failing(transient(outcome_unknown=True), transient(outcome_unknown=True))
    assert await calls.call(make(clock), scopes=[A], idempotent=True) == "ok"  # an edit: same target state
    assert len(tries) == 3


async def test_a_call_that_fails_after_a_try_timed_out_says_its_outcome_is_unknown():
    # timed out, then refused twice: the first try may have been carried out, whatever the last one says
    clock = ManualClock()
    calls = Calls(Throttle(clock=clock), POLICY)
    tries, make = failing(transient(outcome_unknown=True), transient(), transient())
    with pytest.raises(PlatformError) as failed:
        await calls.call(make(clock), scopes=[A], idempotent=False)
    assert len(tries) == 3 and failed.value.outcome_unknown
    tries, make = failing(transient(), transient(), transient())
    with pytest.raises(PlatformError) as failed:
        await calls.call(make(clock), scopes=[A], idempotent=False)
    assert not failed.value.outcome_unknown


async def test_a_live_update_is_tried_once_but_its_429_still_pauses_the_chat():
    clock = ManualClock()
    throttle = Throttle(clock=clock)
    calls = Calls(throttle, POLICY)
    tries, make = failing(PlatformError("429", kind="rate_limited", retry_after=5.0))
    with pytest.raises(PlatformError):
        await calls.call(make(clock), scopes=[A], retry=False)
    assert len(tries) == 1 and throttle.paused_for([A]) == 5.0


async def test_permanent_errors_are_not_retried():
    clock = ManualClock()
    calls = Calls(Throttle(clock=clock), POLICY)
    tries, make = failing(PlatformError("forbidden", kind="permanent"))
    with pytest.raises(PlatformError):
        await calls.call(make(clock), scopes=[A])
    assert len(tries) == 1


async def test_a_slot_paced_inside_a_call_is_waited_for_outside_the_calls_bound():
    """A budget only part of a call counts against (Feishu's app-wide sends) is taken inside the attempt with
    ``pace``: a wait for it longer than the attempt's bound does not time the attempt out, and the bound
    still holds for the work after it."""
    throttle = Throttle()
    calls = Calls(throttle, CallPolicy(attempts=1, timeout=0.3))
    app = Scope("app:send", 0.0)
    throttle.pause(app.key, 0.6)

    async def send() -> str:
        await calls.pace([app])
        return "sent"

    assert await calls.call(send) == "sent"

    async def send_then_hang() -> str:
        await calls.pace([app])
        await asyncio.sleep(5)
        return "late"

    throttle.pause(app.key, 0.6)
    with pytest.raises(PlatformError, match=r"no answer within 0\.3s"):
        await calls.call(send_then_hang)


async def test_a_task_started_inside_a_call_waits_outside_a_bound_that_is_over():
    """A task started during an attempt inherits its bound; once the attempt is over, a wait of that task
    outside the bound has nothing to hold and goes on."""
    calls = Calls(Throttle(), CallPolicy(attempts=1, timeout=1.0))
    started: list[asyncio.Task[str]] = []

    async def later() -> str:
        await asyncio.sleep(0.01)
        async with outside_bound():
            await asyncio.sleep(0)
        return "done"

    async def call() -> str:
        started.append(asyncio.get_running_loop().create_task(later()))
        return "ok"

    assert await calls.call(call) == "ok"
    assert await started[0] == "done"


CHANNEL_TABLES = {
    "telegram": 'token = "123456:TEST-token"',
    "slack": 'bot_token = "xoxb-test"\napp_token = "xapp-test"',
    "feishu": 'app_id = "cli_test"\napp_secret = "secret"',
}


@pytest.mark.parametrize("name", sorted(CHANNEL_TABLES))
async def test_the_operators_call_timeout_is_the_bound_of_every_call_the_channel_makes(tmp_path, fake_openai, name):
    """``[channels.<name>] call_timeout_seconds`` reaches the call policy of the channel ``chatbridge run``
    builds (what the policy does with its bound is tested above); 30 s unless set, more than 30 refused."""
    from aiohttp import web

    from bridge.channels import factory_for
    from bridge.config import ConfigError, load_config
    from tests.support.harness import make_harness

    def config(extra: str) -> Path:
        path = tmp_path / "chatbridge.toml"
        path.write_text(f'[channels.{name}]\nenabled = true\n{CHANNEL_TABLES[name]}\n{extra}\n')
        return path

    h = await make_harness(tmp_path, fake_openai)
    factory = factory_for(name)
    assert factory is not None
    try:
        for extra, bound in (("call_timeout_seconds = 2.5", 2.5), ("", 30.0)):
            channel = factory(load_config(config(extra), env={}).channels.sections()[name], h.core.host_for(name),
                              web.Application())
            try:
                assert channel.calls.policy.timeout == bound
            finally:
                await channel.close()
    finally:
        await h.core.shutdown()
    for wrong in ("31", "0"):
        with pytest.raises(ConfigError, match=rf"channels\.{name}\.call_timeout_seconds"):
            load_config(config(f"call_timeout_seconds = {wrong}"), env={})


async def test_one_failure_several_calls_share_is_counted_once():
    """Calls waiting on one shared request (Feishu's tenant token, fetched once for all of them) fail with the
    one error it raised: /metrics counts that one 429 once, and each call's own later try as it ends."""
    counted: list[str] = []
    calls = Calls(Throttle(), CallPolicy(initial_wait=0.0, max_wait=0.0, timeout=None), observe=counted.append)
    shared: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    shared.set_exception(PlatformError("429", kind="rate_limited", retry_after=0.01))
    fresh: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    fresh.set_result("ok")
    tries = 0

    async def waiting() -> str:
        nonlocal tries
        tries += 1
        return await asyncio.shield(shared if tries <= 2 else fresh)

    assert await asyncio.gather(calls.call(waiting), calls.call(waiting)) == ["ok", "ok"]
    assert counted.count("rate_limited") == 1 and counted.count("ok") == 2
