"""A message's attachments are downloaded a few at a time, under one deadline for the whole message: the
references keep the order of the message's items whatever finished first, the user's notes name every file
(unnamed ones numbered), and /stop abandons all the downloads at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from core.envelope import MediaItem, TurnTarget
from core.media import intake
from core.media.fetch import FetchError
from tests.fakes.openai_server import last_user_text
from tests.support.channel import TestChannel
from tests.support.harness import make_harness


class HeldChannel(TestChannel):
    """Every download waits for its file's event (``release``), then serves ``file <id>`` or fails (``fail``);
    an id in ``stall`` never gets its bytes."""

    def __init__(self) -> None:
        super().__init__("files")
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()
        self.stall: set[str] = set()
        self.started: list[str] = []
        self.finished: list[str] = []
        self.closed: list[str] = []
        self.running = 0
        self.most = 0

    def gate(self, file_id: str) -> asyncio.Event:
        return self.gates.setdefault(file_id, asyncio.Event())

    def release(self, file_id: str) -> None:
        self.gate(file_id).set()

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        self.started.append(item.file_id)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if item.file_id in self.stall:
                yield b"the first bytes, "
                await asyncio.sleep(3600)
            await self.gate(item.file_id).wait()
            self.finished.append(item.file_id)
            if item.file_id in self.fail:
                raise FetchError("no such file")
            yield f"file {item.file_id}".encode()
        finally:
            self.running -= 1
            self.closed.append(item.file_id)


async def held_harness(tmp_path, fake_openai, **settings):  # type: ignore[no-untyped-def]
    h = await make_harness(tmp_path, fake_openai, start=False, **settings)
    channel = HeldChannel()
    h.core.add_channel(channel)
    await h.core.start()
    return h, channel


def media_files(tmp_path) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(p.name for p in (tmp_path / "media").rglob("*") if p.is_file())


async def test_files_download_a_few_at_a_time_and_keep_the_messages_order(tmp_path, fake_openai):
    h, channel = await held_harness(tmp_path, fake_openai)
    names = "abcdef"
    await h.core.submit(channel.envelope("six files", media=tuple(
        MediaItem(kind="document", file_id=n, file_name=f"{n}.txt") for n in names)))
    await h.wait_for(lambda: len(channel.started) == intake.FETCH_CONCURRENCY)
    await asyncio.sleep(0.05)  # no more start while all the slots are taken
    assert channel.started == list("abcd") and channel.running == 4
    channel.release("d")  # the last one first
    await h.wait_for(lambda: channel.started == list("abcde"))  # "e" took the freed slot
    await asyncio.sleep(0.05)
    assert channel.started == list("abcde") and channel.running == 4
    channel.release("c")
    await h.wait_for(lambda: channel.started == list(names))
    for n in "bfea":
        channel.release(n)
        await h.wait_for(lambda n=n: n in channel.closed)
    await h.settle()
    assert channel.finished == list("dcbfea") and channel.most == intake.FETCH_CONCURRENCY
    text = last_user_text(fake_openai.requests[0])
    where = [text.index(f"[Attached file: {n}.txt (text/plain") for n in names]
    assert where == sorted(where), text  # the message's order, not the order the downloads finished in
    for n in names:
        assert f"\nfile {n}\n[End of {n}.txt]" in text
    [user] = [m for m in (await h.core.history("files:c1"))[1] if m.role == "user"]
    assert [ref.name for ref in user.source.attachments] == [f"{n}.txt" for n in names]
    assert all(ref.id is not None and ref.note is None for ref in user.source.attachments)
    assert channel.platform.plain("c1") == []
    await h.core.shutdown()


async def test_the_notes_name_each_file_in_the_messages_order_and_number_the_unnamed_ones(tmp_path, fake_openai):
    h, channel = await held_harness(tmp_path, fake_openai)
    media = (MediaItem(kind="photo", file_id="p1"), MediaItem(kind="document", file_id="d1", file_name="a.bin"),
             MediaItem(kind="photo", file_id="p2"), MediaItem(kind="voice", file_id="v1"),
             MediaItem(kind="photo", file_id="p3"), MediaItem(kind="document", file_id="d2", file_name="b.txt"))
    channel.fail = {"p2", "d1", "v1", "p3"}
    await h.core.submit(channel.envelope("look", media=media))
    await h.wait_for(lambda: channel.started == ["p1", "d1", "p2", "v1"])
    for fid in ("v1", "p2", "d1", "p1", "p3", "d2"):  # the failures from the last one started to the first
        await h.wait_for(lambda fid=fid: fid in channel.started)
        channel.release(fid)
        await h.wait_for(lambda fid=fid: fid in channel.closed)
    assert channel.finished == ["v1", "p2", "d1", "p1", "p3", "d2"]
    await h.settle()
    assert channel.platform.plain("c1") == ["\n".join((
        "⚠️ a.bin: it could not be downloaded.",
        "⚠️ photo 2 of 3: it could not be downloaded.",
        "⚠️ voice message: it could not be downloaded.",  # the only one of its kind: no number
        "⚠️ photo 3 of 3: it could not be downloaded."))]
    [user] = [m for m in (await h.core.history("files:c1"))[1] if m.role == "user"]
    refs = user.source.attachments
    assert [ref.name for ref in refs] == ["photo", "a.bin", "photo", "voice message", "photo", "b.txt"]
    assert [ref.note is None for ref in refs] == [True, False, False, False, False, True]
    await h.core.shutdown()


async def test_unnamed_files_of_a_kind_are_numbered_in_the_notes_named_ones_keep_their_name(tmp_path, fake_openai):
    h, channel = await held_harness(tmp_path, fake_openai)
    media = (MediaItem(kind="photo", file_id="p1"), MediaItem(kind="photo", file_id="p2"),
             MediaItem(kind="document", file_id="d1", file_name="report.pdf"),
             MediaItem(kind="document", file_id="d2", file_name="report.pdf"),
             MediaItem(kind="voice", file_id="v1"), MediaItem(kind="photo", file_id="p3"))
    channel.fail = {"p2", "d1", "d2", "v1", "p3"}
    for item in media:
        channel.release(item.file_id)
    await h.core.submit(channel.envelope("look", media=media))
    await h.settle()
    assert channel.platform.plain("c1") == ["\n".join((
        "⚠️ photo 2 of 3: it could not be downloaded.",
        "⚠️ report.pdf: it could not be downloaded.",
        "⚠️ report.pdf: it could not be downloaded.",
        "⚠️ voice message: it could not be downloaded.",
        "⚠️ photo 3 of 3: it could not be downloaded."))]
    await h.core.shutdown()


async def test_stalled_downloads_hold_the_reply_for_one_fetch_timeout_not_one_per_file(tmp_path, fake_openai):
    timeout = 0.5
    h, channel = await held_harness(tmp_path, fake_openai, media_fetch_timeout=timeout)
    channel.stall = {f"p{i}" for i in range(9)}
    channel.release("ok")
    media = (*(MediaItem(kind="photo", file_id=f"p{i}") for i in range(3)),
             MediaItem(kind="document", file_id="ok", file_name="ok.txt"),
             *(MediaItem(kind="photo", file_id=f"p{i}") for i in range(3, 9)))
    started = time.monotonic()
    await h.core.submit(channel.envelope("ten files", media=media))
    await h.wait_for(lambda: bool(fake_openai.requests), timeout=20)
    waited = time.monotonic() - started
    await h.settle()
    # one file after another, this was ten timeouts (5 s here, 20 minutes with the defaults)
    assert timeout * 0.9 <= waited < timeout * 5, waited
    assert "\nfile ok\n[End of ok.txt]" in last_user_text(fake_openai.requests[0])  # a finished one is kept
    [notes] = channel.platform.plain("c1")
    lines = notes.split("\n")
    assert len(lines) == 9
    assert lines[:3] == [f"⚠️ photo {i} of 9: it took too long to download." for i in (1, 2, 3)]
    for i, line in enumerate(lines[3:], start=4):  # still waiting for a slot, or cut at the deadline
        assert line in (f"⚠️ photo {i} of 9: it took too long to download.",
                        f"⚠️ photo {i} of 9: there was no time left to download it."), line
    assert lines[-1] == "⚠️ photo 9 of 9: there was no time left to download it."
    assert sorted(channel.closed) == sorted(channel.started) and channel.running == 0
    [kept] = media_files(tmp_path)  # ok.txt; nothing of the abandoned downloads
    assert (tmp_path / "media" / kept).read_bytes() == b"file ok"
    await h.core.shutdown()


async def test_stop_abandons_all_the_downloads_at_once(tmp_path, fake_openai):
    h, channel = await held_harness(tmp_path, fake_openai)
    channel.stall = {f"p{i}" for i in range(6)}
    await h.core.submit(channel.envelope("six photos", media=tuple(
        MediaItem(kind="photo", file_id=f"p{i}") for i in range(6))))
    await h.wait_for(lambda: channel.running == intake.FETCH_CONCURRENCY)
    assert await h.core.stop("files:c1")
    await h.settle()  # within its bound, far below the two minutes of the fetch timeout
    assert sorted(channel.closed) == ["p0", "p1", "p2", "p3"] and channel.running == 0
    assert media_files(tmp_path) == []  # nothing half-downloaded kept
    assert fake_openai.requests == []
    [user] = [m for m in (await h.core.history("files:c1"))[1] if m.role == "user"]
    assert [ref.note for ref in user.source.attachments] == ["the reply was stopped before it was downloaded"] * 6
    await h.core.shutdown()
