"""The app's budget of sends, as the fake Open API counts it, when the bridge's event loop is held up.

Feishu allows an app 50 sends (creates and replies) a second over all its chats; the fake counts them over any
second in which they arrive (a sliding window), with no burst to spare. A thousand chats starting at once on a
busy host hold the bridge's event loop up; the throttle then lets the sends whose slots passed meanwhile leave
together, up to a quarter of a second's worth (``catch_up``), and the rest at the pace again. The channel's
pace must leave room for that in every second. Time here is virtual (``HeldUpClock``).
"""

from __future__ import annotations

import pytest

from channels.common.throttle import Scope, Throttle
from channels.feishu.channel import APP_SENDS_PER_SECOND
from tests.fakes.feishu.openapi import SENDS, RateLimit, app_limited
from tests.support.clock import HeldUpClock


async def sends_refused(sends: int, per_second: float, *, held_from: float, held_for: float) -> int:
    """``sends`` chats each send one message at once, paced at ``per_second``; how many the fake would refuse."""
    clock = HeldUpClock(held_from=held_from, held_for=held_for)
    throttle = Throttle(clock=clock)
    app = (Scope("app:send", 1 / per_second),)
    left: list[float] = []

    async def send() -> None:
        await throttle.reserve(app)
        left.append(clock.now())

    await clock.run([send() for _ in range(sends)])
    assert len(left) == sends
    budget = RateLimit(SENDS, "app", 50, 1.0, app_limited)  # the fake's enforce_limits(app_sends=50)
    refused = 0
    for at in left:
        if budget.full("app", at):
            refused += 1
        else:
            budget.take("app", at)
    return refused


@pytest.mark.parametrize("held_for", [0.0, 0.2, 1.0, 3.0])
async def test_the_apps_sends_stay_within_feishus_limit_when_the_loop_is_held_up(held_for):
    assert await sends_refused(200, APP_SENDS_PER_SECOND, held_from=0.5, held_for=held_for) == 0


async def test_paced_at_feishus_limit_itself_the_sends_after_a_held_up_loop_are_refused():
    # why the channel paces under the limit: the sends held up leave together, then the next second's at the pace
    assert await sends_refused(200, 50.0, held_from=0.5, held_for=1.0) > 0
