"""An aiohttp application served on 127.0.0.1 from its own thread and event loop.

The Feishu fakes run this way, never on the event loop under test: lark-oapi fetches its tenant token with
blocking ``requests`` even from its ``a``-methods, and ``lark.ws.Client`` asks for its WebSocket URL with
``requests`` too. A fake on the test's loop would never get to answer those calls (the loop is blocked in
``requests`` waiting for the fake), so every call would hang until its timeout.

State shared with the test thread is guarded by the owner's lock; the test thread never touches the server
loop directly, except through ``call`` (run a coroutine there and wait for its result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


class ServerThread:
    def __init__(self, make_app: Callable[[], web.Application], *, name: str) -> None:
        self._make_app = make_app
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""
        self.port = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "server not started"
        return self._loop

    def start(self, timeout: float = 10.0) -> str:
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(ready))
                loop.run_forever()
            except BaseException as exc:  # a start-up failure must reach start(), not vanish in the thread
                if not ready.done():
                    ready.set_exception(exc)
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        self.base_url = ready.result(timeout)
        return self.base_url

    async def _serve(self, ready: concurrent.futures.Future[str]) -> None:
        self._runner = web.AppRunner(self._make_app(), handler_cancellation=True, shutdown_timeout=1.0,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        ready.set_result(f"http://127.0.0.1:{self.port}")

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
        """Run a coroutine on the server's loop and wait for its result (from any other thread)."""
        async def wrapper() -> T:
            return await fn()
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def stop(self, before: Callable[[], Awaitable[Any]] | None = None, timeout: float = 10.0) -> None:
        if self._loop is None or self._thread is None:
            return
        loop, runner = self._loop, self._runner

        async def shutdown() -> None:
            if before is not None:
                await before()
            if runner is not None:
                await runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout)
            self._loop = None
            self._thread = None
