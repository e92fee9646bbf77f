"""Runs a real ``lark.ws.Client`` on a dedicated thread, and stops it again, for tests.

How the SDK runs (lark-oapi 1.7.5, ``lark_oapi/ws/client.py``): ``lark_oapi.ws.client`` captures ONE event
loop at import time (``asyncio.get_event_loop()``, or a new loop when that fails) in the module attribute
``loop``, and every ``Client`` uses it: ``start()`` blocks in ``loop.run_until_complete(...)`` forever and
there is no ``stop()``. So a client must run on a thread of its own, only one client can run per process at
a time, and the module must have been imported while no event loop was running (else ``loop`` is that
running loop and ``start()`` fails with "This event loop is already running").

Stopping: every task on that loop is cancelled from outside (``run_coroutine_threadsafe``); ``start()``
then returns with ``CancelledError`` and the thread ends. The cancelled tasks are drained on the same thread
so nothing of one client's life (its ping loop, a reconnect in progress) resumes under the next client.
"""

from __future__ import annotations

import asyncio
import threading

import lark_oapi as lark
from lark_oapi.ws import client as ws_client_module


class WsClientThread:
    def __init__(self, client: lark.ws.Client) -> None:
        self.client = client
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def sdk_loop() -> asyncio.AbstractEventLoop:
        # the SDK exposes no other handle on the loop its client runs on (see the module docstring)
        return ws_client_module.loop

    def start(self) -> WsClientThread:
        loop = self.sdk_loop()
        if loop.is_running():
            raise RuntimeError("another lark.ws.Client is running in this process")

        def run() -> None:
            try:
                self.client.start()
            except asyncio.CancelledError:
                pass  # stop() cancelled the client's tasks
            except BaseException as exc:
                self.error = exc
            finally:
                pending = asyncio.all_tasks(loop)
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

        self._thread = threading.Thread(target=run, name="lark-ws-client", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        loop = self.sdk_loop()
        thread, self._thread = self._thread, None
        if thread is None:
            return

        async def cancel_all() -> None:
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_all(), loop)
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError("lark.ws.Client did not stop")

    async def astop(self, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self.stop, timeout)
