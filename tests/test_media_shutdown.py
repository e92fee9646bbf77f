"""A shutdown while a message's attachments download: the message is not used up. Nothing of it is stored, the
chat is shown no stopped notice for it, and the next start answers it once, its photo downloaded then and shown
to the model (``core.executor``, step 1). A user's ``/stop`` during the download keeps stopping that reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from core.envelope import MediaItem, TurnTarget
from tests.fakes.openai_server import Function, Text, image_parts, last_user_text
from tests.support.channel import FakePlatform, TestChannel
from tests.support.harness import make_harness
from tests.support.media import jpeg


class SlowFiles(TestChannel):
    """Files by id; with ``stall`` the download sends its first kilobyte and then nothing (bounded)."""

    def __init__(self, platform: FakePlatform | None = None, stall: bool = True) -> None:
        super().__init__("files", platform)
        self.files: dict[str, bytes] = {}
        self.stall = stall
        self.fetching = asyncio.Event()
        self.fetched: list[str] = []

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        self.fetched.append(item.file_id)
        self.fetching.set()
        data = self.files[item.file_id]
        yield data[:1000]
        if self.stall:
            await asyncio.sleep(30)
        yield data[1000:]


async def slow_harness(tmp_path, fake_openai, platform: FakePlatform | None = None, stall: bool = True):
    h = await make_harness(tmp_path, fake_openai, start=False)
    channel = SlowFiles(platform, stall)
    h.core.add_channel(channel)
    await h.core.start()
    return h, channel


def media_files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "media").rglob("*") if p.is_file())


def echo(body):  # type: ignore[no-untyped-def]
    return Text(f"echo: {last_user_text(body).split(chr(10) * 2)[0]} ({len(image_parts(body))} image)")


async def test_a_shutdown_during_a_download_leaves_the_message_to_the_next_start(tmp_path, fake_openai):
    photo = jpeg(320, 240)
    fake_openai.default = Function(echo)
    h, channel = await slow_harness(tmp_path, fake_openai)
    channel.files["p1"] = photo
    await h.core.submit(channel.envelope("what is in this photo?", event_id="e1",
                                         media=(MediaItem(kind="photo", file_id="p1", mime_type="image/jpeg"),)))
    await asyncio.wait_for(channel.fetching.wait(), 5)
    await h.core.shutdown()  # a deploy while the photo downloads
    assert channel.platform.visible("c1") == []  # no "Stopped: the bridge is shutting down" for a reply never begun
    assert fake_openai.requests == []
    assert not any(name.endswith(".part") for name in media_files(tmp_path))  # no partial download kept

    h2, channel2 = await slow_harness(tmp_path, fake_openai, platform=channel.platform, stall=False)
    channel2.files["p1"] = photo
    try:
        await h2.settle()
        assert channel2.fetched == ["p1"]  # downloaded again, whole
        assert [image_parts(r) for r in fake_openai.requests] == [[("image/jpeg", photo)]]
        assert channel2.platform.visible("c1") == ["echo: what is in this photo? (1 image)"]
        history = (await h2.core.history("files:c1"))[1]  # stored once, when answered
        assert [(m.role, m.content) for m in history] == [("user", "what is in this photo?"),
                                                          ("assistant", "echo: what is in this photo? (1 image)")]
    finally:
        await h2.core.shutdown()


async def test_a_users_stop_during_a_download_still_stops_that_reply(tmp_path, fake_openai):
    fake_openai.default = Function(echo)
    h, channel = await slow_harness(tmp_path, fake_openai)
    channel.files["p1"] = jpeg(320, 240)
    await h.core.submit(channel.envelope("what is in this photo?", event_id="e1",
                                         media=(MediaItem(kind="photo", file_id="p1", mime_type="image/jpeg"),)))
    await asyncio.wait_for(channel.fetching.wait(), 5)
    assert await h.core.stop("files:c1")
    await h.settle()
    history = (await h.core.history("files:c1"))[1]
    assert [m.role for m in history][:1] == ["user"]  # stored, its photo unread: /stop answers it as stopped
    assert history[0].source.attachments[0].note == "the reply was stopped before it was downloaded"
    assert fake_openai.requests == []
    await h.core.shutdown()

    h2, channel2 = await slow_harness(tmp_path, fake_openai, platform=channel.platform, stall=False)
    try:
        await h2.settle()
        assert channel2.fetched == [] and fake_openai.requests == []  # not answered again after a restart
    finally:
        await h2.core.shutdown()
