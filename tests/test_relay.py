"""Relay messages between processes: split into notes that fit the bus, joined again in order, repeats
skipped, lost notes reported as a gap; over a real PostgreSQL bus between two "processes"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.bus import MAX_PAYLOAD_BYTES, LocalBus, check_note
from core.relay import NOTE_BYTES, Reassembler, Relay, join_items, split_items, split_message

BOUND = 10.0


def feed_all(joiner: Reassembler, notes: list[str]) -> list[tuple[str | None, str | None, bool]]:
    return [(r.sender, r.message, r.gap) for r in (joiner.feed(n) for n in notes)]


def messages(joiner: Reassembler, notes: list[str]) -> list[str]:
    return [r.message for r in (joiner.feed(n) for n in notes) if r.message is not None]


@pytest.mark.parametrize("text", ["", "short", "a" * (NOTE_BYTES * 3 + 17), "汉字é🙂" * 5000,
                                  "x" * (NOTE_BYTES - 1) + "🙂" + "y" * 10])
def test_a_message_of_any_size_is_split_into_notes_that_fit_and_joined_again(text: str) -> None:
    notes = split_message("nodea", 1, text)
    for note in notes:
        check_note("channel.web", note)  # each fits a bus note
        assert len(note.encode()) <= MAX_PAYLOAD_BYTES
    assert len(notes) >= max(1, -(-len(text.encode()) // NOTE_BYTES))
    assert messages(Reassembler("nodeb"), notes) == [text]


def test_bad_text_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="surrogate"):
        split_message("a", 1, "bad \ud800 text")
    with pytest.raises(ValueError, match="NUL"):
        split_message("a", 1, "a\x00b")


def test_messages_of_several_senders_are_joined_per_sender_in_order_and_own_notes_skipped() -> None:
    joiner = Reassembler("me")
    a1, a2 = split_message("a", 1, "A" * 20, 8), split_message("a", 2, "second of a", 8)
    b1 = split_message("b", 7, "B" * 9, 8)
    mine = split_message("me", 1, "my own", 8)
    got = feed_all(joiner, [a1[0], b1[0], *mine, a1[1], b1[1], a1[2], *a2])
    assert [(s, m) for s, m, _ in got if m is not None] == [("b", "B" * 9), ("a", "A" * 20), ("a", "second of a")]
    assert not any(gap for _, _, gap in got)


def test_a_repeated_note_is_skipped() -> None:
    joiner = Reassembler("me")
    one, two = split_message("a", 1, "one", 8), split_message("a", 2, "two and more", 8)
    got = feed_all(joiner, [*one, *one, two[0], two[0], two[1], *two])
    assert [m for _, m, _ in got if m is not None] == ["one", "two and more"]
    assert not any(gap for _, _, gap in got)


def test_a_lost_message_or_fragment_is_a_gap() -> None:
    joiner = Reassembler("me")
    notes = [*split_message("a", 1, "one", 8), *split_message("a", 3, "three", 8)]  # 2 never came
    assert feed_all(joiner, notes) == [("a", "one", False), ("a", "three", True)]
    joiner = Reassembler("me")
    four = split_message("a", 4, "four is long", 8)
    five = split_message("a", 5, "five", 8)
    assert feed_all(joiner, [four[0], *five]) == [(None, None, False), ("a", "five", True)]  # 4 cut short
    joiner = Reassembler("me")
    six = split_message("a", 6, "six is long too", 8)
    seven = split_message("a", 7, "seven", 8)
    assert feed_all(joiner, [six[0], six[0], six[1], *seven]) == [
        (None, None, False), (None, None, False), ("a", "six is long too", False), ("a", "seven", False)]
    assert feed_all(joiner, [*split_message("a", 9, "nine is long", 8)[1:]]) == [(None, None, True)]


def test_listening_midway_through_a_message_starts_with_the_next_one() -> None:
    joiner = Reassembler("me")
    first = split_message("a", 5, "started before", 8)
    assert feed_all(joiner, [first[1], *split_message("a", 6, "next", 8)]) == [
        (None, None, False), ("a", "next", False)]


def test_after_a_reset_any_next_note_starts_afresh() -> None:
    joiner = Reassembler("me")
    assert messages(joiner, split_message("a", 1, "one", 8)) == ["one"]
    joiner.reset()
    assert feed_all(joiner, split_message("a", 9, "nine", 8)) == [("a", "nine", False)]


def test_notes_without_a_relay_header_are_ignored() -> None:
    joiner = Reassembler("me")
    assert feed_all(joiner, ["no header", "x:1:0/1", "a:1:2/1\nbad index"]) == [(None, None, False)] * 3


@pytest.mark.parametrize("items", [[], [""], ["a"], ["12:34", "", "汉字🙂:9", "x" * 20000]])
def test_items_joined_into_one_message_come_apart_again(items: list[str]) -> None:
    assert split_items(join_items(items)) == items


@pytest.mark.parametrize("bad", ["5:abc", "x:abc", "3abc", "-1:a"])
def test_a_message_that_is_not_a_join_of_items_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        split_items(bad)


class Tasks:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, name: str, coro: Any) -> asyncio.Task[None]:
        self.tasks.append(asyncio.get_running_loop().create_task(coro, name=name))
        return self.tasks[-1]

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_messages_queued_together_travel_in_fewer_notes_and_arrive_one_by_one_in_order() -> None:
    bus, tasks = LocalBus(), Tasks()
    notes: list[str] = []
    bus.subscribe("channel.web", notes.append)
    a, b = Relay(bus, "channel.web", "aaaa", tasks.spawn), Relay(bus, "channel.web", "bbbb", tasks.spawn)
    got: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    gaps: list[str] = []
    b.listen(lambda s, m: got.put_nowait((s, m)), lambda: gaps.append("gap"))
    sent = [f"message {i}: " + "é" * (i % 7) for i in range(200)] + ["large: " + "汉" * 10_000]
    try:
        for text in sent:
            a.send(text)  # all queued before the first note is out
        assert [await asyncio.wait_for(got.get(), BOUND) for _ in sent] == [("aaaa", t) for t in sent]
        assert len(notes) <= 10 and gaps == []  # ~4 kB of small messages fit one note
        a.send("one more")
        assert await asyncio.wait_for(got.get(), BOUND) == ("aaaa", "one more")
        with pytest.raises(ValueError, match="surrogate"):
            a.send("bad \ud800")
    finally:
        await tasks.cancel()


async def test_a_message_dropped_from_a_full_outbox_is_a_gap_for_the_receivers() -> None:
    bus, tasks = LocalBus(), Tasks()
    a = Relay(bus, "channel.web", "aaaa", tasks.spawn, outbox_limit=2)
    b = Relay(bus, "channel.web", "bbbb", tasks.spawn)
    got: asyncio.Queue[str] = asyncio.Queue()
    b.listen(lambda s, m: got.put_nowait(m), lambda: got.put_nowait("<gap>"))
    try:
        a.send("first")
        assert await asyncio.wait_for(got.get(), BOUND) == "first"
        for text in ("1", "2", "3 is dropped"):
            a.send(text)
        assert [await asyncio.wait_for(got.get(), BOUND) for _ in range(3)] == ["<gap>", "1", "2"]
    finally:
        await tasks.cancel()


async def test_relays_of_two_processes_carry_large_messages_in_order_both_ways(postgres: Any) -> None:
    from core.postgresql.bus import PostgresqlBus

    dsn = postgres.fresh_dsn()
    buses = [PostgresqlBus(dsn), PostgresqlBus(dsn)]
    tasks: list[asyncio.Task[None]] = []

    def spawn(name: str, coro: Any) -> asyncio.Task[None]:
        tasks.append(asyncio.get_running_loop().create_task(coro, name=name))
        return tasks[-1]

    for bus in buses:
        await bus.open()
    try:
        a, b = Relay(buses[0], "channel.web", "aaaa", spawn), Relay(buses[1], "channel.web", "bbbb", spawn)
        at_a: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        at_b: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        gaps: list[str] = []
        a.listen(lambda s, m: at_a.put_nowait((s, m)), lambda: gaps.append("a"))
        b.listen(lambda s, m: at_b.put_nowait((s, m)), lambda: gaps.append("b"))
        sent = [f"{i}:" + "汉字" * (i * 1500) for i in range(8)]  # up to 63 kB, several notes each
        for text in sent:
            a.send(text)
        b.send("from b")
        got = [await asyncio.wait_for(at_b.get(), BOUND) for _ in sent]
        assert got == [("aaaa", t) for t in sent]
        assert await asyncio.wait_for(at_a.get(), BOUND) == ("bbbb", "from b")
        assert at_a.empty() and at_b.empty() and gaps == []  # nobody hears its own messages
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bus in buses:
            await bus.close()


async def test_a_process_alone_on_its_store_has_no_relay_and_decides_only_here(tmp_path: Any, fake_openai: Any) -> None:
    import aiohttp

    from tests.browser.server import start_web_chat

    chat = await start_web_chat(tmp_path, fake_openai)  # SQLite, LocalBus
    try:
        assert chat.core.relay("channel.web") is None and chat.core.relay("approvals") is None
        assert chat.channel.fanout is None and chat.hub.share is None
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{chat.base_url}/api/sessions") as resp:
                sid = (await resp.json())["id"]
            async with http.post(f"{chat.base_url}/api/sessions/{sid}/approvals/call_X",
                                 json={"decision": "allow"}) as resp:
                assert resp.status == 404  # nothing asked elsewhere, nothing waited for
    finally:
        await chat.close()
