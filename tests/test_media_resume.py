"""Attachments on the admission path: a message is stored with its envelope the moment it is accepted, and
its files are fetched only when its turn begins, so a message with a photo that waits behind a slow reply and
outlives the process (stopped, or crashed: ``tests/test_crash_recovery.py``) still shows the model its image
after the restart; a web upload waits stored for its message, even behind ``/new``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from core.envelope import MediaItem, TurnTarget
from core.router import SubmitResult
from core.sqlite_store import SqliteStore
from tests.fakes.openai_server import Function, Text, image_parts, last_user_text
from tests.support.channel import FakePlatform, TestChannel
from tests.support.harness import make_harness
from tests.support.media import jpeg


async def _chunks(data: bytes) -> AsyncGenerator[bytes, None]:
    for start in range(0, len(data), 1000):
        yield data[start:start + 1000]


class FilesChannel(TestChannel):
    """A channel whose files come from ``files`` by id (what Telegram, Slack or Feishu do with their APIs);
    ``fetched`` records every download asked of it."""

    def __init__(self, platform: FakePlatform | None = None) -> None:
        super().__init__("files", platform)
        self.files: dict[str, bytes] = {}
        self.fetched: list[str] = []

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        self.fetched.append(item.file_id)
        async for chunk in _chunks(self.files[item.file_id]):
            yield chunk


async def files_harness(tmp_path, fake_openai, platform: FakePlatform | None = None, **kw):
    h = await make_harness(tmp_path, fake_openai, start=False, **kw)
    channel = FilesChannel(platform)
    h.core.add_channel(channel)
    await h.core.start()
    return h, channel


def echo(body):
    return Text("echo: " + last_user_text(body).split("\n\n")[0])


async def test_a_photo_waiting_behind_a_slow_reply_reaches_the_model_after_a_restart(tmp_path, fake_openai):
    photo = jpeg(640, 480)
    fake_openai.script(Text("the first answer takes its time", hold=asyncio.Event()))
    fake_openai.default = Function(echo)
    h, channel = await files_harness(tmp_path, fake_openai)
    channel.files["p1"] = photo
    await h.core.submit(channel.envelope("first"))
    await h.wait_for(lambda: len(fake_openai.requests) == 1)  # the slow reply is being written
    queued = channel.envelope("what is in this photo?", event_id="e2",
                              media=(MediaItem(kind="photo", file_id="p1", mime_type="image/jpeg"),))
    assert await h.core.submit(queued) is SubmitResult.QUEUED
    await h.core.shutdown()  # the waiting message stays stored, its photo not yet downloaded
    assert channel.fetched == []

    h2, channel2 = await files_harness(tmp_path, fake_openai, platform=channel.platform)
    channel2.files["p1"] = photo  # the platform still has it
    await h2.settle()
    request = fake_openai.requests[-1]
    assert last_user_text(request).startswith("what is in this photo?")
    assert image_parts(request) == [("image/jpeg", photo)]
    assert channel2.fetched == ["p1"]
    assert "echo: what is in this photo?" in channel2.platform.visible("c1")
    [_, user] = [m for m in (await h2.core.history("files:c1"))[1] if m.role == "user"]
    [ref] = user.history_view()["attachments"]
    assert (ref["kind"], ref["content_type"], ref["size"]) == ("image", "image/jpeg", len(photo))
    await h2.core.shutdown()


async def test_a_file_the_platform_no_longer_has_after_a_restart_is_described_and_the_text_answered(
        tmp_path, fake_openai):
    fake_openai.script(Text("slow", hold=asyncio.Event()))
    fake_openai.default = Function(echo)
    h, channel = await files_harness(tmp_path, fake_openai)
    await h.core.submit(channel.envelope("first"))
    await h.wait_for(lambda: len(fake_openai.requests) == 1)
    await h.core.submit(channel.envelope("and this one?", media=(
        MediaItem(kind="document", file_id="gone", file_name="notes.md"),)))
    await h.core.shutdown()

    h2, channel2 = await files_harness(tmp_path, fake_openai, platform=channel.platform)
    await h2.settle()  # channel2 has no file "gone": its download fails
    text = last_user_text(fake_openai.requests[-1])
    assert text.startswith("and this one?")
    assert "notes.md" in text and "could not be downloaded" in text
    assert "⚠️ notes.md: it could not be downloaded." in channel2.platform.plain("c1")
    await h2.core.shutdown()


async def test_a_web_upload_waits_stored_for_its_message_across_a_restart(tmp_path, fake_openai):
    photo = jpeg(320, 240)
    fake_openai.script(Text("slow", hold=asyncio.Event()))
    fake_openai.default = Function(echo)
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first")
    await h.wait_for(lambda: len(fake_openai.requests) == 1)
    ref = await h.core.upload("test:c1", "cat.jpg", _chunks(photo))
    assert ref.id is not None
    await h.say("and this?", media=(MediaItem(kind="photo", file_id=ref.id, attachment_id=ref.id),))
    await h.core.shutdown()

    h2 = await make_harness(tmp_path, fake_openai, platform=h.platform)
    await h2.settle()
    request = fake_openai.requests[-1]
    assert last_user_text(request).startswith("and this?")
    assert image_parts(request) == [("image/jpeg", photo)]
    stored = await h2.store.get_attachment(ref.id)
    assert stored is not None and stored.claimed  # its message refers to it now
    await h2.core.shutdown()


class SlowNewStore(SqliteStore):
    """``new_context`` waits at a gate: ``/new`` is under way while the user goes on."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def new_context(self, key, **kw):  # type: ignore[override]
        self.entered.set()
        await self.gate.wait()
        return await super().new_context(key, **kw)


async def test_an_upload_made_after_new_belongs_to_the_new_conversation(tmp_path, fake_openai):
    photo = jpeg(320, 240)
    fake_openai.default = Function(echo)
    store = SlowNewStore(tmp_path / "chat.db")
    h = await make_harness(tmp_path, fake_openai, store=store)
    before = await h.core.upload("test:c1", "old.jpg", _chunks(jpeg(10, 10)))  # never sent: /new drops it
    await h.say("/new")
    await asyncio.wait_for(store.entered.wait(), 5)
    ref = await h.core.upload("test:c1", "cat.jpg", _chunks(photo))
    assert await h.say("what is this?", media=(
        MediaItem(kind="photo", file_id=str(ref.id), attachment_id=ref.id),)) is SubmitResult.QUEUED
    store.gate.set()
    await h.settle()
    request = fake_openai.requests[-1]
    assert last_user_text(request).startswith("what is this?")
    assert image_parts(request) == [("image/jpeg", photo)]
    assert await store.get_attachment(str(before.id)) is None
    assert not (tmp_path / "media" / str(before.id)).exists()
    await h.core.shutdown()
