"""WorkingSigns: a channel's "working" signs while messages' files download, handed over to their turns' sinks.

``core.channel.ShowsWorking``: while a message's attachments download, before its turn's sink opens, the chat
shows the sign the turn itself would show (Slack's thinking reaction or thread status, Feishu's "Typing"
reaction), at once and without waiting for it. When the turn's sink opens it takes the sign over (``take``):
the turn shows one indicator, and its sink takes it down at the end. A sign no sink takes within ``handover``
seconds of the downloads' end — the turn ended before it had a sink: the session moved to another process, the
bridge is stopping — is taken down here, and so is one whose wait the shutdown cancels: nothing would take it
down later. The channels share this; what shows a sign and what takes it down is each one's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from channels.common.errors import PlatformError
from core.host import ShuttingDownError

log = logging.getLogger(__name__)

OpsT = TypeVar("OpsT")


class WorkingSign(Generic[OpsT]):
    """One message's sign, shown through ``ops`` (the platform's message operations for its destination)."""

    def __init__(self, ops: OpsT) -> None:
        self.ops = ops
        self.landed = asyncio.Event()
        """Its call was answered (or failed, or was never made): ``ops`` says what it shows."""
        self.over = asyncio.Event()
        """The downloads are over: a sink may take it over now."""
        self.taken = asyncio.Event()
        """A sink took it over: that sink takes it down."""


class WorkingSigns(Generic[OpsT]):
    """A channel's signs by message key, until a sink takes each or it is taken down."""

    def __init__(self, spawn: Callable[[str, Coroutine[Any, Any, None]], object],
                 handover: Callable[[], float]) -> None:
        self._spawn = spawn
        self._handover = handover
        self._signs: dict[str, WorkingSign[OpsT]] = {}

    def take(self, key: str) -> WorkingSign[OpsT] | None:
        """The sign shown for message ``key``, now the caller's (a turn's sink) to take down; None if none."""
        sign = self._signs.pop(key, None)
        if sign is not None:
            sign.taken.set()
        return sign

    @contextlib.asynccontextmanager
    async def showing(self, key: str, ops: OpsT, *, show: Callable[[], Awaitable[None]],
                      take_down: Callable[[], Awaitable[None]], name: str) -> AsyncIterator[None]:
        """Show a sign for message ``key`` while the block runs (``show``, in a task of its own: the block does
        not wait for it); after it, the sign waits for a sink to ``take`` it (see the module docstring). A message
        that already has one (the same message handed over again) shows no second."""
        if key in self._signs:
            yield
            return
        sign = self._signs[key] = WorkingSign(ops)
        try:
            self._spawn(name, self._keep(key, sign, show, take_down))
        except ShuttingDownError:  # no sign then; the downloads go on
            del self._signs[key]
        try:
            yield
        finally:
            sign.over.set()

    async def _keep(self, key: str, sign: WorkingSign[OpsT], show: Callable[[], Awaitable[None]],
                    take_down: Callable[[], Awaitable[None]]) -> None:
        handover = self._handover()
        try:
            try:
                await show()
            except PlatformError as exc:
                log.info("no working sign while a message's files download: %s", exc)
            finally:
                sign.landed.set()
            await sign.over.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(handover):
                    await sign.taken.wait()
        finally:
            if self._signs.get(key) is sign:
                del self._signs[key]
            if not sign.taken.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(handover):
                        await take_down()
