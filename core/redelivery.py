"""Redelivery: a turn counts as delivered only once its terminal content is visible in its chat.

The executor marks a turn delivered (``Store.mark_delivered``) when its sink showed the terminal snapshot or
its one plain fallback was accepted by the platform. When both failed — the platform answered 5xx or timed
out for longer than its channel's call policy tries — the turn stays undelivered, and the text the chat does
not show yet (the fallback's text: what the sink's ledger says is missing) is handed here. A supervised task
sends it again on a bounded backoff (``CoreSettings.redelivery_delays``, through tenacity) until the
platform accepts it; only then is the turn marked delivered. A turn still undelivered after the last try
stays so in the store, and the next start sends it (``ChatCore._redeliver``), as after a crash.

Never twice: every try is one ``send_plain`` of what the chat does not show yet, made only after the
previous one failed — when the platform took the first messages of a long text, only the rest is tried
again (``SinkError.unsent``); a try that succeeded ends the retries and marks the turn, so neither this
process nor the next start sends it again. A try that timed out may have been carried out all the same:
the channel's call policy repeats such a send at most once (or under the platform's idempotency key,
``channels.common.calls``), and that repeat is its only one — a try whose outcome is unknown
(``Unshown.maybe_shown``) is not followed by background tries, which on a platform without idempotency
keys could show the text once per try during a long outage. The turn stays undelivered; the next start
sends it once more (the one case where it may then show twice or, if it had landed, three times).

A terminal message sent here is a plain fallback in ``/metrics`` (``count_sent``), counted once the platform
took all of it — on the first try, a later one or after a restart — never for a try that failed or timed out.

A channel whose clients read the stored history (``shows_history``, the web chat) already shows the
committed answer: its turns are marked delivered without a send.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import tenacity

from core.channel import ChannelRegistry
from core.delivery import PlainSender, Unshown
from core.envelope import TurnTarget
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import ShuttingDownError, TaskSupervisor

log = logging.getLogger(__name__)


class Redelivery:
    def __init__(self, store: Store, channels: ChannelRegistry, plain: PlainSender, supervisor: TaskSupervisor,
                 settings: CoreSettings, *, count_sent: Callable[[str], None] | None = None) -> None:
        """``count_sent(channel)``: a terminal message landed whole (the metrics' fallbacks)."""
        self._store = store
        self._channels = channels
        self._plain = plain
        self._supervisor = supervisor
        self._delays = tuple(float(d) for d in settings.redelivery_delays)
        self._count_sent = count_sent

    async def deliver(self, turn_id: str, target: TurnTarget, text: str) -> Unshown:
        """Send ``text`` as the terminal message of turn ``turn_id`` once. Returns what the chat still does
        not show: "" when it shows all of it (and the turn is marked delivered), else the rest, to send
        again — never the messages the platform already took."""
        rest = await self._plain.send_rest(target, text) if text else Unshown("")
        if not rest.text:
            if text and self._count_sent is not None:  # sent, and the platform took all of it
                self._count_sent(target.channel)
            await self.mark_delivered(turn_id)
        return rest

    def schedule(self, turn_id: str, target: TurnTarget, rest: Unshown) -> None:
        """Try ``rest`` again later, in the background, until it is visible or the backoff is spent; not
        at all when its last send timed out (it may be shown: the next start sends it)."""
        if rest.maybe_shown:
            log.warning("the reply of turn %s timed out on its way and may be shown after all; it is not sent "
                        "again before the next start", turn_id)
            return
        if not self._delays:
            return
        try:
            self._supervisor.spawn(f"redeliver:{turn_id}", self._retry(turn_id, target, rest.text))
        except ShuttingDownError:
            log.warning("turn %s is still undelivered; the next start sends it", turn_id)

    async def mark_delivered(self, turn_id: str) -> None:
        try:
            await self._store.mark_delivered(turn_id)
        except Exception as exc:  # the worst case is the answer sent once more after a restart
            log.warning("could not record the delivery of turn %s: %s", turn_id, exc)

    async def _retry(self, turn_id: str, target: TurnTarget, text: str) -> None:
        delays = self._delays
        pending = Unshown(text)

        async def again() -> bool:
            """One try; True when no more are to be made (delivered, or its outcome unknown)."""
            nonlocal pending
            channel = self._channels.get(target.channel)
            if getattr(channel, "shows_history", False):  # its pages show the committed turn by now
                await self.mark_delivered(turn_id)
                pending = Unshown("")
                return True
            pending = await self.deliver(turn_id, target, pending.text)
            return not pending.text or pending.maybe_shown

        def wait(state: tenacity.RetryCallState) -> float:
            return delays[min(state.attempt_number, len(delays) - 1)]

        def failed(state: tenacity.RetryCallState) -> bool:
            log.warning("turn %s is still undelivered after %d more tries; the next start sends it",
                        turn_id, state.attempt_number)
            return False

        await asyncio.sleep(delays[0])
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(len(delays)), wait=wait,
            retry=tenacity.retry_if_result(lambda delivered: not delivered), retry_error_callback=failed)
        if not await retrying(again):
            return
        if pending.text:
            log.warning("a later try of turn %s timed out and may be shown after all; it is not sent again "
                        "before the next start", turn_id)
        else:
            log.info("turn %s delivered on a later try", turn_id)
