"""TurnRunner: runs the model for one prepared turn, racing it against the turn's cancel signal.

It feeds the TurnController (the only source of snapshots) and returns a typed TurnRunOutcome; it never
talks to a channel and never persists the answer (that is the committer's job).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from core.controller import TurnController
from core.failures import TurnFailure, TurnFailureKind
from core.input_builder import PreparedTurnInput, TurnInputBuilder
from core.llm.provider import (
    LLMProvider,
    LLMRequest,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    TextDelta,
)
from core.llm.retry import retry_policy
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import TaskSupervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Completed:
    text: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    partial: str


@dataclass(frozen=True, slots=True)
class Failed:
    failure: TurnFailure
    partial: str


@dataclass(frozen=True, slots=True)
class Stale:
    pass


TurnRunOutcome = Completed | Cancelled | Failed | Stale


class TurnRunner:
    def __init__(self, provider: LLMProvider, builder: TurnInputBuilder, store: Store,
                 supervisor: TaskSupervisor, settings: CoreSettings) -> None:
        self._provider = provider
        self._builder = builder
        self._store = store
        self._supervisor = supervisor
        self._settings = settings

    async def run(self, prepared: PreparedTurnInput, controller: TurnController,
                  cancel: asyncio.Event) -> TurnRunOutcome:
        turn_id = controller.snapshot.turn_id
        work = self._supervisor.spawn(f"turn:{turn_id}:model", self._run_model(prepared, controller))
        stop = self._supervisor.spawn(f"turn:{turn_id}:cancel-watch", cancel.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
        if work.cancelled() or cancel.is_set():
            return Cancelled(controller.text)
        return work.result()

    async def _run_model(self, prepared: PreparedTurnInput, controller: TurnController) -> TurnRunOutcome:
        recovered = False
        while True:
            try:
                text = await self._request(prepared, controller)
                return Completed(text)
            except ProviderError as exc:
                if exc.kind is ProviderErrorKind.CONTEXT_OVERFLOW and not recovered:
                    recovered = True
                    controller.reset_text("")
                    log.info("context overflow in %s; rebuilding the input once", prepared.session_key)
                    try:
                        prepared = await self._builder.recover_after_overflow(prepared)
                    except Exception as build_exc:
                        return Failed(TurnFailure(TurnFailureKind.CONTEXT_PREPARATION, repr(build_exc)),
                                      controller.text)
                    continue
                log.warning("model request failed for %s: %s", prepared.session_key, exc)
                return Failed(TurnFailure(TurnFailureKind.PROVIDER, str(exc), exc.kind), controller.text)

    async def _request(self, prepared: PreparedTurnInput, controller: TurnController) -> str:
        """One model request through the retry ladder. A retried attempt starts its text over."""
        start_text = controller.text
        attempt_no = 0

        async def on_retry(err: ProviderError, attempt: int, sleep: float) -> None:
            controller.reset_text(start_text)
            await self._trace(controller, "request_end",
                              {"status": err.kind.value, "attempt": attempt, "retry_in": sleep})

        request = LLMRequest(messages=prepared.messages, max_tokens=self._settings.max_output_tokens,
                             temperature=self._settings.temperature)
        text = ""
        async for attempt in retry_policy(self._settings.retry_delays, on_retry=on_retry):
            with attempt:
                attempt_no += 1
                parts: list[str] = []
                async for event in _bounded(self._provider.stream(request), self._settings.request_timeout):
                    if isinstance(event, TextDelta) and event.text:
                        parts.append(event.text)
                        controller.append_text(event.text)
                text = "".join(parts)
        if attempt_no > 1:  # a clean first attempt needs no trace; retries are worth keeping
            await self._trace(controller, "request_end", {"status": "completed", "attempt": attempt_no})
        return text

    async def _trace(self, controller: TurnController, kind: str, payload: dict[str, object]) -> None:
        snap = controller.snapshot
        try:
            await self._store.append_trace(snap.session_key, snap.turn_id, kind, dict(payload))
        except Exception as exc:  # tracing never breaks a turn
            log.warning("trace write failed: %s", exc)


async def _bounded(stream: AsyncIterator[ProviderEvent], timeout: float) -> AsyncIterator[ProviderEvent]:
    """Every provider gets the same bound: no event within ``timeout`` is a TIMEOUT (then the ladder)."""
    try:
        while True:
            try:
                async with asyncio.timeout(timeout):
                    event = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ProviderError(ProviderErrorKind.TIMEOUT, f"no model output within {timeout:g}s") from None
            yield event
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
