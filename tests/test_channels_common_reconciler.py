from __future__ import annotations

from collections.abc import Callable

import pytest

from channels.common.errors import PlatformError
from channels.common.ledger import Ledger, Part
from channels.common.reconciler import Reconciler


class Ops:
    """A platform double that records calls and can fail the next ones."""

    def __init__(self) -> None:
        self.shown: dict[str, Part] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: list[PlatformError] = []
        self.keys: list[str] = []
        self._ids = 0

    def _maybe_fail(self) -> None:
        if self.fail:
            raise self.fail.pop(0)

    async def send(self, content: Callable[[], Part], key: str) -> str:
        part = content()
        self.keys.append(key)
        self._maybe_fail()
        self._ids += 1
        mid = str(self._ids)
        self.shown[mid] = part
        self.calls.append(("send", part.text))
        return mid

    async def edit(self, message_id: str, part: Part) -> None:
        self._maybe_fail()
        self.shown[message_id] = part
        self.calls.append(("edit", part.text))

    async def delete(self, message_id: str) -> None:
        self._maybe_fail()
        del self.shown[message_id]
        self.calls.append(("delete", message_id))


def parts(*texts: str) -> list[Part]:
    return [Part.plain(t) for t in texts]


async def test_fewest_calls_edit_changed_send_missing_skip_equal():
    ops = Ops()
    r = Reconciler(ops)
    await r.apply(parts("a"), final=False)
    await r.apply(parts("a"), final=False)
    await r.apply(parts("ab"), final=False)
    await r.apply(parts("abc", "d"), final=False)
    assert ops.calls == [("send", "a"), ("edit", "ab"), ("edit", "abc"), ("send", "d")]


async def test_frozen_parts_are_untouched_while_streaming_but_final_reconciles_all():
    ops = Ops()
    r = Reconciler(ops)
    await r.apply(parts("one", "tw"), final=False)
    assert r.ledger.entries[0].frozen
    await r.apply(parts("ONE", "two"), final=False)
    assert ops.calls[-1] == ("edit", "two") and ops.shown["1"].text == "one"
    await r.apply([Part("ONE", "one", (("bold",),)), Part.plain("two")], final=True)
    assert ops.shown["1"].text == "ONE"


async def test_surplus_parts_are_deleted():
    ops = Ops()
    r = Reconciler(ops)
    await r.apply(parts("a", "b", "c"), final=True)
    await r.apply(parts("a"), final=True)
    assert list(ops.shown) == ["1"] and len(r.ledger) == 1


async def test_ledger_changes_only_on_success_and_a_retry_repeats_the_target_state():
    ops = Ops()
    r = Reconciler(ops)
    await r.apply(parts("a"), final=False)
    ops.fail = [PlatformError("503", kind="transient")]
    with pytest.raises(PlatformError):
        await r.apply(parts("a", "b"), final=True)
    assert len(r.ledger) == 1
    await r.apply(parts("a", "b"), final=True)
    assert [p.text for p in ops.shown.values()] == ["a", "b"]  # no duplicate "b"


async def test_not_found_marks_the_entry_gone_and_missing_reports_it():
    ops = Ops()
    r = Reconciler(ops)
    await r.apply(parts("first", "sec"), final=False)
    ops.fail = [PlatformError("gone", kind="not_found")]
    final = [Part("FIRST", "first", ("b",)), Part.plain("second")]
    with pytest.raises(PlatformError):
        await r.apply(final, final=True)
    assert r.ledger.entries[0].gone
    assert [p.source for p in r.ledger.missing(final)] == ["first", "second"]


async def test_a_retried_send_carries_the_same_idempotency_key_until_it_is_accepted():
    ops = Ops()
    r = Reconciler(ops)
    ops.fail = [PlatformError("timed out", kind="transient", outcome_unknown=True)]
    with pytest.raises(PlatformError):
        await r.apply(parts("a"), final=True)
    await r.apply(parts("a"), final=True)
    await r.apply(parts("a", "b"), final=True)
    assert ops.keys[0] == ops.keys[1] != ops.keys[2]


def test_a_preview_counts_as_shown_only_in_its_final_form_unless_it_could_not_be_removed():
    ledger = Ledger()
    ledger.accepted_send("1", Part.plain("**x** done"))
    ledger.accepted_send("2", Part.plain("partial"))
    final = [Part("x done", "**x** done", ("bold",)), Part("partial and rest", "partial and rest")]
    assert [p.text for p in ledger.missing(final)] == ["x done", "partial and rest"]
    ledger.keep(0)  # a stale preview the platform would not let us delete still shows those words
    assert [p.text for p in ledger.missing(final)] == ["partial and rest"]


def test_the_rest_after_a_kept_preview_that_stopped_inside_a_word_says_it_goes_on_from_it():
    ledger = Ledger()
    ledger.accepted_send("1", Part.plain("Hello wo"))
    ledger.accepted_send("2", Part.plain("Second part ends here."))
    ledger.keep(0)
    ledger.keep(1)
    final = [Part.plain("Hello world, and more"), Part.plain("Second part ends here. Then this.")]
    assert ledger.unshown(final) == ["…rld, and more", "Then this."]


async def test_a_send_carries_the_part_decided_when_its_slot_came_and_the_ledger_records_that_part():
    ops = Ops()
    r = Reconciler(ops)
    asked: list[tuple[int, str]] = []

    def at_slot(index: int, booked: Part) -> Part:
        asked.append((index, booked.text))
        return Part.plain("Hello, the newer text")

    await r.apply([Part.plain("Hello")], final=False, at_slot=at_slot)
    assert ops.calls == [("send", "Hello, the newer text")]
    assert asked == [(0, "Hello")]
    assert [e.part.text for e in r.ledger.entries] == ["Hello, the newer text"]
    await r.apply([Part.plain("Hello, the newer text")], final=False)
    assert len(ops.calls) == 1  # the ledger's record matches what the chat shows: nothing to do


async def test_every_try_of_one_send_carries_the_part_first_decided_under_its_key():
    class Retrying(Ops):
        """Each send is tried twice (the first try's outcome unknown), as the call policy may."""

        async def send(self, content: Callable[[], Part], key: str) -> str:
            self.calls.append(("try", content().text))
            return await super().send(content, key)

    ops = Retrying()
    r = Reconciler(ops)
    newer = iter(["newer 1", "newer 2", "newer 3"])
    await r.apply([Part.plain("booked")], final=True, at_slot=lambda i, booked: Part.plain(next(newer)))
    assert ops.calls == [("try", "newer 1"), ("send", "newer 1")]
    assert r.ledger.entries[0].part.text == "newer 1"


class Deduping(Ops):
    """A platform that honours a send's key: a repeated key gets the first message back, showing what its first
    try carried; here the first try is carried out and its answer lost."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[str, str] = {}
        self.lose_next_answer = False

    async def send(self, content: Callable[[], Part], key: str) -> str:
        if key in self.by_key:
            self.calls.append(("send (the first message again)", content().text))
            return self.by_key[key]
        mid = await super().send(content, key)
        self.by_key[key] = mid
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise PlatformError("502", kind="transient", outcome_unknown=True)
        return mid


async def test_a_repeated_send_on_a_platform_that_honours_keys_carries_its_first_part_then_edits():
    ops = Deduping()
    r = Reconciler(ops, honours_keys=True)
    ops.lose_next_answer = True
    with pytest.raises(PlatformError):
        await r.apply(parts("The first words"), final=False)
    await r.apply(parts("The first words and the whole answer."), final=True)  # the turn ended meanwhile
    assert ops.calls == [("send", "The first words"), ("send (the first message again)", "The first words"),
                         ("edit", "The first words and the whole answer.")]
    assert ops.shown == {"1": Part.plain("The first words and the whole answer.")}
    assert r.ledger.entries[0].part.text == "The first words and the whole answer."


async def test_a_send_the_platform_refused_is_not_repeated_as_it_was():
    # refused (its formatting here): nothing was posted under its key, so the next try carries the new part
    ops = Deduping()
    r = Reconciler(ops, honours_keys=True)
    ops.fail.append(PlatformError("can't parse", kind="format"))
    with pytest.raises(PlatformError):
        await r.apply([Part("bold", formatting=("bold",))], final=True)
    await r.apply(parts("bold"), final=True)  # the plain final
    assert ops.calls == [("send", "bold")] and ops.shown == {"1": Part.plain("bold")}
