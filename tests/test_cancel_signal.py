"""CancelSignal: set once, listeners called at once, unsubscribing works."""

from __future__ import annotations

from core.cancel_signal import CancelSignal


def test_listeners_run_once_when_set_and_late_listeners_run_at_once():
    signal, calls = CancelSignal(), []
    signal.on_set(lambda: calls.append("a"))
    remove_b = signal.on_set(lambda: calls.append("b"))
    remove_b()
    assert not signal.is_set() and calls == []
    signal.set()
    signal.set()
    assert signal.is_set() and calls == ["a"]
    signal.on_set(lambda: calls.append("late"))
    assert calls == ["a", "late"]
