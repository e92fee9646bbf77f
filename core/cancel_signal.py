"""CancelSignal: ``/stop`` (or shutdown) for one running turn.

Set at most once. Whoever must react registers a callback and is called at once, so a turn needs no
task of its own just to wait for a /stop that usually never comes.

``shutdown`` sets it too, and says why: the bridge is shutting down (the turn's stopped notice says so, not
like a user's ``/stop``). ``abandon`` sets it too, and says more: this process lost the session (its lease,
``core.leases``) to another one, which owns the turn's outcome from now on. The turn stops like on ``/stop``
but commits nothing and delivers nothing more (``core.executor``).
"""

from __future__ import annotations

from collections.abc import Callable


class CancelSignal:
    def __init__(self) -> None:
        self._set = False
        self._abandoned = False
        self._by_shutdown = False
        self._listeners: list[Callable[[], object]] = []

    def is_set(self) -> bool:
        return self._set

    @property
    def abandoned(self) -> bool:
        """The turn was abandoned (``abandon``): its outcome is another process's to close."""
        return self._abandoned

    @property
    def by_shutdown(self) -> bool:
        """The turn was stopped because the bridge is shutting down (``shutdown``), not by a user."""
        return self._by_shutdown

    def shutdown(self) -> None:
        """Stop the turn because the bridge is shutting down (a signal set before keeps its reason)."""
        if not self._set:
            self._by_shutdown = True
        self.set()

    def abandon(self) -> None:
        """Stop the turn and leave its outcome to the process that took its session over."""
        self._abandoned = True
        self.set()

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def on_set(self, listener: Callable[[], object]) -> Callable[[], object]:
        """Call ``listener`` when the signal is set (at once if it already is); returns an unsubscribe."""
        if self._set:
            listener()
            return lambda: None
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove
