"""Seed 001 §11.2: the client side of history deltas."""

from tests.support.history_mirror import DeltaResult, HistoryMirror


def msg(i: int) -> dict:
    return {"id": f"m{i}", "role": "user", "content": f"text {i}", "created_at": float(i)}


def test_contiguous_revisions_are_applied():
    mirror = HistoryMirror()
    mirror.load_full("s1", 1, [msg(1), msg(2)])
    assert mirror.apply_delta("s1", 2, [msg(3), msg(4)]) is DeltaResult.APPLIED
    assert mirror.apply_delta("s1", 3, [msg(5)]) is DeltaResult.APPLIED
    assert [m["id"] for m in mirror.messages] == ["m1", "m2", "m3", "m4", "m5"]
    assert mirror.revision == 3


def test_duplicate_delta_is_idempotent():
    mirror = HistoryMirror()
    mirror.load_full("s1", 1, [msg(1)])
    mirror.apply_delta("s1", 2, [msg(2)])
    assert mirror.apply_delta("s1", 2, [msg(2)]) is DeltaResult.DUPLICATE
    assert [m["id"] for m in mirror.messages] == ["m1", "m2"]


def test_messages_already_present_are_not_added_twice():
    mirror = HistoryMirror()
    mirror.load_full("s1", 1, [msg(1), msg(2)])  # full fetch raced with the delta of revision 2
    assert mirror.apply_delta("s1", 2, [msg(2), msg(3)]) is DeltaResult.APPLIED
    assert [m["id"] for m in mirror.messages] == ["m1", "m2", "m3"]


def test_gap_asks_for_exactly_one_full_fetch():
    mirror = HistoryMirror()
    mirror.load_full("s1", 1, [msg(1)])
    assert mirror.apply_delta("s1", 3, [msg(3)]) is DeltaResult.NEEDS_FULL_FETCH
    assert mirror.apply_delta("s1", 4, [msg(4)]) is not DeltaResult.NEEDS_FULL_FETCH
    assert [m["id"] for m in mirror.messages] == ["m1"]
    mirror.load_full("s1", 4, [msg(1), msg(2), msg(3), msg(4)])
    assert mirror.apply_delta("s1", 5, [msg(5)]) is DeltaResult.APPLIED


def test_delta_of_another_session_only_marks_it_unread():
    mirror = HistoryMirror()
    mirror.load_full("s1", 1, [msg(1)])
    assert mirror.apply_delta("s2", 7, [msg(9)]) is DeltaResult.MARKED_UNREAD
    assert mirror.unread == {"s2"}
    assert [m["id"] for m in mirror.messages] == ["m1"] and mirror.revision == 1
    mirror.load_full("s2", 7, [msg(9)])
    assert mirror.unread == set()
