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


def test_older_pages_go_in_front_only_when_they_end_at_the_oldest_message_held():
    mirror = HistoryMirror()
    mirror.load_full("s1", 9, [msg(7), msg(8), msg(9)], has_more=True)
    assert mirror.load_older("s1", "m7", [msg(4), msg(5), msg(6)], has_more=True)
    assert not mirror.load_older("s1", "m7", [msg(1), msg(2), msg(3)], has_more=False)  # asked before m7: late
    assert not mirror.load_older("s2", "m4", [msg(1)], has_more=False)  # another session
    assert mirror.load_older("s1", "m4", [msg(2), msg(3), msg(4)], has_more=False)  # overlap: m4 once
    assert [m["id"] for m in mirror.messages] == [f"m{i}" for i in range(2, 10)]
    assert mirror.has_more is False


def test_a_full_fetch_keeps_older_pages_it_overlaps_and_drops_them_after_a_larger_gap():
    mirror = HistoryMirror()
    mirror.load_full("s1", 5, [msg(4), msg(5)], has_more=True)
    mirror.load_older("s1", "m4", [msg(2), msg(3)], has_more=True)
    mirror.load_full("s1", 6, [msg(5), msg(6)], has_more=True)  # gap recovery: the newest page
    assert [m["id"] for m in mirror.messages] == ["m2", "m3", "m4", "m5", "m6"] and mirror.has_more
    mirror.load_full("s1", 9, [msg(8), msg(9)], has_more=True)  # no overlap: start again from this page
    assert [m["id"] for m in mirror.messages] == ["m8", "m9"] and mirror.has_more
    mirror.load_full("s2", 1, [msg(8)], has_more=False)  # another session never keeps s1's messages
    assert [m["id"] for m in mirror.messages] == ["m8"] and not mirror.has_more
