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


def test_a_shutdown_says_why_unless_a_user_stopped_the_turn_first():
    by_shutdown = CancelSignal()
    by_shutdown.shutdown()
    assert by_shutdown.is_set() and by_shutdown.by_shutdown
    by_user = CancelSignal()
    by_user.set()  # /stop, then the bridge shuts down before the turn ended: the user's stop is what he sees
    by_user.shutdown()
    assert by_user.is_set() and not by_user.by_shutdown
