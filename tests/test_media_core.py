"""Attachments in core: what the model is sent (images within the budget, descriptions otherwise, expired
files, compaction), the fetch seam as any channel implements it (a test channel that downloads), caps, and the
pieces (sniffing, names, vision knowledge, provider wire formats)."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
import zlib
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from aiohttp import web

from core.envelope import MediaItem, TurnTarget
from core.input_builder import IMAGE_CHARS, RuntimeContext, Summary, TurnInputBuilder, assemble
from core.llm.anthropic_provider import AnthropicProvider
from core.llm.local_provider import _message as local_message
from core.llm.provider import LLMImage, LLMMessage, LLMRequest
from core.media import digest, intake
from core.media.fetch import FetchError
from core.media.files import STALE_PART_SECONDS, MediaFiles
from core.media.library import display_name
from core.media.sniff import sniff
from core.media.transcribe import Transcriber
from core.media.vision import VisionPolicy, known_vision
from core.messages import AttachmentRef, ChatMessage, MessageSource
from tests.fakes.anthropic_server import FakeAnthropic, image_blocks
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.support.channel import TestChannel
from tests.support.harness import make_harness
from tests.support.media import _document, jpeg, pdf, pdf_bomb, png, voice_ogg

RT = RuntimeContext(channel="test", now=0.0)


def user(seq: int, text: str, *refs: AttachmentRef) -> ChatMessage:
    return ChatMessage(id=f"m{seq}", session_key="s", seq=seq, role="user", content=text,
                       source=MessageSource(kind="user_input", attachments=refs), received_at=0.0, created_at=0.0)


def image(name: str) -> AttachmentRef:
    return AttachmentRef(id=name.ljust(32, "0")[:32], kind="image", name=name, size=1000, content_type="image/png",
                         width=10, height=10)


# ---- what the model is sent ------------------------------------------------------------------------------

def test_older_images_become_descriptions_once_they_no_longer_fit_the_budget():
    history = [user(1, "first", image("a.png")), user(2, "second", image("b.png")), user(3, "third", image("c.png"))]
    shown: dict[int, tuple[AttachmentRef, ...]] = {}
    out = assemble("S", history, RT, budget_chars=2 * IMAGE_CHARS + 500, shown=shown)
    assert {i: [r.name for r in refs] for i, refs in shown.items()} == {2: ["b.png"], 3: ["c.png"]}
    assert out[1].content == "first\n\n[The user attached an image: a.png (image/png, 10×10, 1 KB). It is not shown " \
                             "to you.]"
    assert out[2].content == "second"


def test_the_newest_images_are_shown_even_over_budget_and_none_without_vision():
    history = [user(1, "look", image("a.png"), image("b.png"))]
    shown: dict[int, tuple[AttachmentRef, ...]] = {}
    assemble("S", history, RT, budget_chars=100, shown=shown)
    assert [r.name for r in shown[1]] == ["a.png", "b.png"]
    out = assemble("S", history, RT, budget_chars=100)  # no vision: described
    assert out[1].content.count("[The user attached an image:") == 2


async def test_an_expired_image_is_described_as_no_longer_available():
    async def gone(ref: AttachmentRef) -> LLMImage | None:
        return None

    class Store:
        async def context_messages(self, key: str, *, limit: int):  # type: ignore[no-untyped-def]
            return 1, [user(1, "still there?", image("a.png"))]

    from core.settings import CoreSettings
    builder = TurnInputBuilder(Store(), CoreSettings(), images=gone, vision=lambda: True)  # type: ignore[arg-type]
    prepared = await builder.prepare("s", 1, RT)
    last = prepared.messages[-1]
    assert last.images == ()
    assert "[The user attached an image: a.png (image/png, 10×10, 1 KB). Its file is no longer available.]" \
        in last.content


def test_a_summary_keeps_the_attachments_it_stands_for():
    summary = Summary("They talked about fruit.", 5, (image("pear.png"),))
    assert summary.message().content.endswith(
        "[Attachments the user sent in that part of the conversation: an image: pear.png (image/png, 10×10, 1 KB)]")


# ---- the seam, as a channel implements it --------------------------------------------------------------

class DownloadingChannel(TestChannel):
    """A channel whose files come from ``files`` (what Slack or Feishu do with their APIs)."""

    def __init__(self) -> None:
        super().__init__("files")
        self.files: dict[str, bytes] = {}
        self.fail_after: int | None = None
        self.hang = False
        self.closed: list[str] = []
        self.fetching = asyncio.Event()

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        self.fetching.set()
        try:
            if item.file_id not in self.files:
                raise FetchError("no such file")
            data = self.files[item.file_id]
            for start in range(0, len(data), 1000):
                if self.fail_after is not None and start >= self.fail_after:
                    raise FetchError("connection reset")
                if self.hang:
                    await asyncio.sleep(3600)
                yield data[start:start + 1000]
        finally:
            self.closed.append(item.file_id)


async def downloading_harness(tmp_path, fake_openai, **settings):
    h = await make_harness(tmp_path, fake_openai, start=False, **settings)
    channel = DownloadingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    return h, channel


def media_files(tmp_path) -> list[str]:
    root = tmp_path / "media"
    return sorted(p.name for p in root.rglob("*") if p.is_file())


async def test_a_download_that_breaks_half_way_keeps_nothing_and_the_text_is_answered(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["f"] = bytes(5000)
    channel.fail_after = 3000
    await h.core.submit(channel.envelope("here", media=(MediaItem(kind="document", file_id="f", file_name="a.bin"),)))
    await h.settle()
    assert channel.platform.plain("c1") == ["⚠️ a.bin: it could not be downloaded."]
    assert last_user_text(fake_openai.requests[0]).startswith("here")
    assert media_files(tmp_path) == [] and channel.closed == ["f"]
    await h.core.shutdown()


async def test_a_download_that_takes_too_long_is_abandoned(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai, media_fetch_timeout=0.2)
    channel.files["f"] = bytes(5000)
    channel.hang = True
    await h.core.submit(channel.envelope("here", media=(MediaItem(kind="photo", file_id="f"),)))
    await h.settle()
    assert channel.platform.plain("c1") == ["⚠️ photo: it took too long to download."]
    assert media_files(tmp_path) == [] and channel.closed == ["f"]  # the channel's generator was closed
    await h.core.shutdown()


async def test_stop_abandons_a_download_at_once(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["f"] = bytes(5000)
    channel.hang = True
    await h.core.submit(channel.envelope("here", media=(MediaItem(kind="photo", file_id="f"),)))
    await asyncio.wait_for(channel.fetching.wait(), 5)
    assert await h.core.stop("files:c1")
    await h.settle()  # within its bound, far below the two minutes of the fetch timeout
    assert media_files(tmp_path) == [] and channel.closed == ["f"]
    assert fake_openai.requests == []
    await h.core.shutdown()


async def test_only_max_files_attachments_of_a_message_are_read(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai, media_max_files=2)
    for name in ("a", "b", "c"):
        channel.files[name] = f"file {name}".encode()
    await h.core.submit(channel.envelope("three files", media=tuple(
        MediaItem(kind="document", file_id=n, file_name=f"{n}.txt") for n in "abc")))
    await h.settle()
    text = last_user_text(fake_openai.requests[0])
    assert "file a" in text and "file b" in text and "file c" not in text
    assert "c.txt. It could not be read: only 2 attachments of a message are read" in text
    assert channel.platform.plain("c1") == ["⚠️ Only the first 2 attachments of a message are read; 1 was left out."]
    await h.core.shutdown()


async def test_expired_files_are_deleted_and_the_model_then_gets_a_description(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["p"] = jpeg(30, 20)
    fake_openai.script(Text("a photo"), Text("I remember a photo"))
    await h.core.submit(channel.envelope("look", media=(MediaItem(kind="photo", file_id="p"),)))
    await h.settle()
    assert len(image_parts(fake_openai.requests[0])) == 1 and len(media_files(tmp_path)) == 1
    assert h.core.media is not None
    old = time.time() - 200 * 3600  # older than keep_hours (168 h)
    for path in (tmp_path / "media").iterdir():
        if path.is_file():
            os.utime(path, (old, old))
    await h.core.store.drop_expired_attachments(time.time() + 1)  # the rows expire with the files
    assert await h.core.media.sweep() == 1
    assert media_files(tmp_path) == []
    await h.core.submit(channel.envelope("what was it?"))
    await h.settle()
    second = fake_openai.requests[1]
    assert image_parts(second) == []
    assert "[The user attached an image: photo (image/jpeg, 30×20" in str(second["messages"])
    assert "Its file is no longer available." in str(second["messages"])
    await h.core.shutdown()


async def test_compaction_keeps_the_fact_that_an_attachment_existed(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["d"] = pdf([["quarterly numbers"]])
    fake_openai.script(Text("read it"), Text("SUMMARY: they discussed numbers"), Text("ok"))
    await h.core.submit(channel.envelope("see the report",
                                         media=(MediaItem(kind="document", file_id="d", file_name="q3.pdf"),)))
    await h.settle()
    assert "Compacted" in await h.core.compact("files:c1")
    assert "(attached: a PDF: q3.pdf" in str(fake_openai.requests[1]["messages"])
    await h.core.submit(channel.envelope("and now?"))
    await h.settle()
    summary = fake_openai.requests[2]["messages"][1]["content"]
    assert summary.startswith("[Summary of the earlier conversation]\nSUMMARY: they discussed numbers")
    assert "[Attachments the user sent in that part of the conversation: a PDF: q3.pdf (application/pdf" in summary
    await h.core.shutdown()


async def test_a_channel_without_a_fetcher_has_its_attachments_described(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    await h.say("see", media=(MediaItem(kind="document", file_id="x", file_name="r.pdf", size=1200),))
    await h.settle()
    assert "r.pdf (1 KB). It could not be read: this chat's files cannot be downloaded" in \
        last_user_text(fake_openai.requests[0])
    assert h.platform.plain("c1") == []
    await h.core.shutdown()


async def test_a_pdf_bomb_is_refused_once_opened_and_not_kept(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["b"] = pdf_bomb()
    await h.core.submit(channel.envelope("read this", media=(MediaItem(kind="document", file_id="b",
                                                                       file_name="report.pdf"),)))
    await h.settle()
    assert channel.platform.plain("c1") == [
        "⚠️ report.pdf: it unpacks to more data than documents may have here."]
    assert "report.pdf (application/pdf, " in last_user_text(fake_openai.requests[0])
    assert media_files(tmp_path) == []
    await h.core.shutdown()


# ---- provider wire formats -----------------------------------------------------------------------------

async def test_anthropic_gets_image_blocks_before_the_text(fake_anthropic: FakeAnthropic):
    data = png(12, 12)
    provider = AnthropicProvider("claude-test", fake_anthropic.base_url, "sk-ant-test", request_timeout=2.0)
    try:
        request = LLMRequest(messages=(LLMMessage("user", "what is it?",
                                                  images=(LLMImage("image/png", data, "[an image]"),)),))
        [event async for event in provider.stream(request)]
    finally:
        await provider.aclose()
    [body] = fake_anthropic.requests
    assert image_blocks(body) == [("image/png", data)]
    assert [b["type"] for b in body["messages"][0]["content"]] == ["image", "text"]


def test_the_local_model_reads_images_as_their_descriptions():
    message = LLMMessage("user", "what is it?", images=(LLMImage("image/png", b"x", "[an image: a.png]"),))
    assert local_message(message) == {"role": "user", "content": "what is it?\n\n[an image: a.png]"}


# ---- the pieces ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("head", "expected"), [
    (png(), ("image/png", "image")), (jpeg(), ("image/jpeg", "image")), (pdf([["x"]]), ("application/pdf", "pdf")),
    (b"# Title\n\nsome *markdown*", ("text/plain", "text")), (b'{"a": 1}', ("application/json", "text")),
    (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"><script/></svg>', ("text/plain", "text")),
    (b"\x00\x01\x02binary", ("application/octet-stream", "file")), (b"", ("application/octet-stream", "file")),
])
def test_the_type_comes_from_the_bytes(head, expected):
    found = sniff(head)
    assert (found.content_type, found.kind) == expected


def test_display_names_never_carry_a_path_or_control_characters():
    assert display_name("../../etc/passwd", "file") == "passwd"
    assert display_name("C:\\\\Users\\\\x\\\\report.pdf", "file") == "report.pdf"
    assert display_name("a\x00b\u202ec.txt", "file") == "abc.txt"
    assert display_name("..", "file") == "file" and display_name(None, "photo") == "photo"


@pytest.mark.parametrize(("provider", "model", "known"), [
    ("openai", "gpt-4o-mini", True), ("openai", "gpt-4.1", True), ("openai", "gpt-3.5-turbo", False),
    ("openai", "gpt-4", False), ("anthropic", "claude-sonnet-4-5", True), ("anthropic", "claude-3-5-haiku", True),
    ("openai", "llava:13b", True), ("openai", "qwen2.5-vl-7b", True), ("openai", "deepseek-chat", False),
    ("openai", "llama3.2", None), ("openai", "fake-model", None), ("local", "", False),
])
def test_what_is_known_of_a_models_vision(provider, model, known):
    assert known_vision(provider, model) is known


def test_auto_vision_is_given_up_when_the_model_says_it_takes_no_images_but_true_and_false_are_the_operators_word():
    auto = VisionPolicy("auto", "openai", "llama3.2")
    assert auto.enabled()
    auto.rejected("s", unsupported=True)  # more in tests/test_vision_refusals.py
    assert not auto.enabled()
    forced = VisionPolicy(True, "local")
    forced.rejected("s", unsupported=True)
    assert forced.enabled() and not VisionPolicy(False, "openai", "gpt-4o").enabled()


# ---- transcripts: only a real one, and within the text budget ------------------------------------------

async def transcription_endpoint(answer):
    """An OpenAI-compatible ``/audio/transcriptions`` on 127.0.0.1 answering ``answer()`` (a response, or a
    coroutine of one: an answer that waits); (runner, base_url)."""
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        response = answer()
        return await response if inspect.isawaitable(response) else response

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


async def transcribing_harness(tmp_path, fake_openai, base_url, **settings):
    """The core with a transcriber for ``base_url`` and a downloading channel: (harness, channel)."""
    transcriber = Transcriber(base_url, "whisper-1", "", retry_delays=())
    h = await make_harness(tmp_path, fake_openai, start=False, transcriber=transcriber, **settings)
    channel = DownloadingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    return h, channel


GARBAGE = {
    "an HTML page": lambda: web.Response(text="<html><body>Please sign in to the proxy</body></html>",
                                         content_type="text/html"),
    "a JSON error": lambda: web.json_response({"error": {"message": "quota exceeded"}}),
    "a null text": lambda: web.json_response({"text": None}),
}


@pytest.mark.parametrize("answer", list(GARBAGE))
async def test_an_answer_that_is_not_a_transcript_never_reaches_the_model_as_the_users_words(
        tmp_path, fake_openai, answer):
    runner, base = await transcription_endpoint(GARBAGE[answer])
    h, channel = await transcribing_harness(tmp_path, fake_openai, base)
    try:
        channel.files["v"] = voice_ogg()
        await h.core.submit(channel.envelope("", media=(MediaItem(kind="voice", file_id="v"),)))
        await h.settle()
        text = last_user_text(fake_openai.requests[0])
        assert "It could not be read: it could not be transcribed" in text
        assert "Voice message, transcribed" not in text and "sign in" not in text and "None" not in text
    finally:
        await h.core.shutdown()
        await runner.cleanup()


async def test_a_transcript_is_cut_to_the_text_budget_it_shares_with_the_documents(tmp_path, fake_openai):
    fake_openai.transcript = "word " * 100_000  # an hour of speech: 500,000 characters
    transcriber = Transcriber(fake_openai.base_url, "whisper-1", "sk-test", retry_delays=())
    h = await make_harness(tmp_path, fake_openai, start=False, transcriber=transcriber, media_text_chars=20_000)
    channel = DownloadingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    try:
        channel.files.update(v=voice_ogg(), d=b"notes " * 3000)
        await h.core.submit(channel.envelope("summarise", media=(
            MediaItem(kind="voice", file_id="v"), MediaItem(kind="document", file_id="d", file_name="notes.txt"))))
        await h.settle()
        text = last_user_text(fake_openai.requests[0])
        transcript = text.split("[Voice message, transcribed]\n", 1)[1].split("\n\n[Attached file:", 1)[0]
        assert transcript == "word " * 2000 + "\n[… cut here: 489,999 more characters not shown]"  # stripped
        assert "[… cut here: 8,000 more characters not shown]" in text  # the document's half of the budget
        assert len(text) < 21_000
    finally:
        await h.core.shutdown()


async def test_a_messages_voice_notes_are_transcribed_at_the_same_time(tmp_path, fake_openai):
    """The service answers only once it holds all three requests: one transcription after another (each
    waiting for its own answer) would never get one."""
    arrived: list[None] = []
    all_there = asyncio.Event()

    async def answer() -> web.Response:
        arrived.append(None)
        if len(arrived) == 3:
            all_there.set()
        await all_there.wait()
        return web.json_response({"text": "spoken words"})

    runner, base = await transcription_endpoint(answer)
    h, channel = await transcribing_harness(tmp_path, fake_openai, base, media_fetch_timeout=5.0)
    try:
        channel.files.update(a=voice_ogg(), b=voice_ogg(), c=voice_ogg())
        await h.core.submit(channel.envelope("", media=tuple(MediaItem(kind="voice", file_id=f) for f in "abc")))
        await h.settle()
        text = last_user_text(fake_openai.requests[0])
        assert text.count("[Voice message, transcribed]") == 3 and "could not" not in text
    finally:
        await h.core.shutdown()
        await runner.cleanup()


async def test_voice_notes_on_a_stalled_transcription_service_share_one_deadline(tmp_path, fake_openai):
    """Five voice notes, four transcribed at a time, a service that never answers: the four wait out the one
    deadline together and the fifth, whose turn comes after it, is not sent at all (each with its own timeout,
    the fifth would wait one more)."""
    stalled = asyncio.Event()
    arrived: list[None] = []

    async def answer() -> web.Response:
        arrived.append(None)
        await stalled.wait()  # never set while the test runs: the client gives up
        return web.json_response({"text": "late"})

    runner, base = await transcription_endpoint(answer)
    h, channel = await transcribing_harness(tmp_path, fake_openai, base, media_fetch_timeout=1.0)
    try:
        channel.files.update({f: voice_ogg() for f in "abcde"})
        await h.core.submit(channel.envelope("", media=tuple(MediaItem(kind="voice", file_id=f) for f in "abcde")))
        await h.settle()
        text = last_user_text(fake_openai.requests[0])
        assert text.count("it took too long to transcribe") == len(arrived) == 4
        assert text.count("there was no time left to transcribe it") == 1
    finally:
        stalled.set()
        await h.core.shutdown()
        await runner.cleanup()


# ---- a data directory shared by several processes (PostgreSQL) -----------------------------------------

class GatedChannel(TestChannel):
    """A download that stops half way until the test lets it go on."""

    def __init__(self) -> None:
        super().__init__("files")
        self.data = jpeg(640, 480)
        self.halfway = asyncio.Event()
        self.go_on = asyncio.Event()

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        yield self.data[:2000]
        self.halfway.set()
        await asyncio.wait_for(self.go_on.wait(), 10)
        yield self.data[2000:]


async def test_a_process_starting_on_the_same_media_directory_leaves_downloads_in_progress_alone(
        tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai, start=False)
    channel = GatedChannel()
    h.core.add_channel(channel)
    await h.core.start()
    try:
        await h.core.submit(channel.envelope("what is in this photo?", media=(MediaItem(kind="photo", file_id="p"),)))
        await asyncio.wait_for(channel.halfway.wait(), 5)
        assert [p.suffix for p in (tmp_path / "media" / "tmp").iterdir()] == [".part"]
        await asyncio.to_thread(MediaFiles(tmp_path / "media").prepare)  # another process starts
        channel.go_on.set()
        await h.settle()
        assert image_parts(fake_openai.requests[0]) == [("image/jpeg", channel.data)]
        assert not [v for v in channel.platform.visible("c1") if "⚠️" in v]
    finally:
        await h.core.shutdown()


def test_only_writes_abandoned_for_an_hour_are_deleted_at_start(tmp_path):
    files = MediaFiles(tmp_path)
    files.prepare()
    fresh, stale = tmp_path / "tmp" / "a.part", tmp_path / "tmp" / "b.part"
    fresh.write_bytes(b"in progress")
    stale.write_bytes(b"left by a process that died")
    old = time.time() - STALE_PART_SECONDS - 60
    os.utime(stale, (old, old))
    files.prepare()
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == ["a.part"]
    assert files.remove_stale_parts(now=time.time() + STALE_PART_SECONDS + 1) == 1  # the sweep, an hour on
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_a_download_on_a_full_disk_tells_the_sender_why_and_keeps_nothing(tmp_path, fake_openai, monkeypatch):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    real_open = Path.open

    def open_(self, mode="r", *args, **kwargs):  # the temporary write goes to /dev/full: ENOSPC
        if self.suffix == ".part" and "w" in mode:
            return real_open(Path("/dev/full"), mode, *args, **kwargs)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    channel.files["f"] = b"hello " * 1000
    await h.core.submit(channel.envelope("here", media=(MediaItem(kind="document", file_id="f", file_name="a.txt"),)))
    await h.settle()
    assert channel.platform.plain("c1") == ["⚠️ a.txt: the bridge has no room to store it."]
    assert "It could not be read: the bridge has no room to store it." in last_user_text(fake_openai.requests[0])
    assert media_files(tmp_path) == []
    await h.core.shutdown()


def truncated_jpeg() -> bytes:
    """A JPEG whose header is whole and whose scan data is cut in half (Pillow reads its size all the same)."""
    import io
    import random

    from PIL import Image
    out = io.BytesIO()
    Image.frombytes("RGB", (400, 300), random.Random(1).randbytes(400 * 300 * 3)).save(out, "JPEG")
    data = out.getvalue()
    return data[: len(data) // 2]


async def test_a_truncated_image_is_never_sent_to_the_model_and_the_sender_is_told(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files.update(bad=truncated_jpeg())
    await h.core.submit(channel.envelope("look", media=(MediaItem(kind="photo", file_id="bad"),)))
    await h.settle()
    [request] = fake_openai.requests
    assert image_parts(request) == []
    assert "It could not be read: the image could not be read (it is broken or cut short)." in last_user_text(request)
    assert channel.platform.plain("c1") == ["⚠️ photo: the image could not be read (it is broken or cut short)."]
    await h.core.shutdown()


# ---- reading a PDF is bounded ----------------------------------------------------------------------------

def drawing_pdf(pages: int) -> bytes:
    """Pages of nothing but text-positioning operators: 40 KB that inflate into 7 MB of content a page, which
    pypdf would take seconds a page to interpret."""
    content = b"BT /F1 11 Tf 72 740 Td " + b"1 0 Td " * 1_000_000 + b"ET"
    return _document([zlib.compress(content, 9)] * pages, filters=[True] * pages)


async def test_a_pdf_too_complex_to_read_in_time_is_read_only_in_part_and_the_model_is_told(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["d"] = drawing_pdf(3)
    started = time.monotonic()
    await h.core.submit(channel.envelope("summarise", media=(
        MediaItem(kind="document", file_id="d", file_name="r.pdf"),)))
    await h.wait_for(lambda: fake_openai.requests, timeout=30)
    assert time.monotonic() - started < 3  # the unbounded read took about 2.5 s a page here
    text = last_user_text(fake_openai.requests[0])
    assert "[Attached PDF: r.pdf (application/pdf, 3 pages," in text
    assert "[… pages 1–3 not read: the PDF is too long or too complex to read whole]" in text
    await h.settle()
    await h.core.shutdown()


def test_a_pdf_starts_no_new_page_past_its_time(tmp_path, monkeypatch):
    path = tmp_path / "r.pdf"
    path.write_bytes(pdf([["first page"], ["second page"], ["third page"]]))
    assert digest.pdf_excerpt(path, 1000)[0].count("[Page") == 3
    monkeypatch.setattr(digest, "PDF_READ_SECONDS", 0.0)
    text, pages = digest.pdf_excerpt(path, 1000)
    assert pages == 3
    assert text == ("[Page 1]\nfirst page\n\n"
                    "[… pages 2–3 not read: the PDF is too long or too complex to read whole]")


# ---- text files that are not UTF-8 -----------------------------------------------------------------------

LEGACY_TEXTS = {
    "a Windows CSV (cp1252)": ("prices.csv", "name;city;amount\nJosé;Zürich;12,50 €\nRené;Genève;7,00 €\n",
                               "cp1252"),
    "a Chinese note (GBK)": ("notes.txt", "会议纪要：明天下午三点开会，请准备季度报告。\n", "gbk"),
    "a Russian note (cp1251)": ("notes.txt", "Привет! Встреча завтра в три часа, подготовьте отчёт за квартал.\n",
                                "cp1251"),
}


@pytest.mark.parametrize("case", list(LEGACY_TEXTS))
async def test_a_text_file_in_a_legacy_encoding_reaches_the_model_as_its_text(tmp_path, fake_openai, case):
    name, content, encoding = LEGACY_TEXTS[case]
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["f"] = content.encode(encoding)
    await h.core.submit(channel.envelope("what does it say?", media=(
        MediaItem(kind="document", file_id="f", file_name=name),)))
    await h.settle()
    text = last_user_text(fake_openai.requests[0])
    assert f"[Attached file: {name} (text/plain, " in text
    assert f"\n{content}\n[End of {name}]" in text
    await h.core.shutdown()


async def test_a_log_with_terminal_colours_reaches_the_model_without_them(tmp_path, fake_openai):
    h, channel = await downloading_harness(tmp_path, fake_openai)
    channel.files["f"] = (b"2024-01-01 \x1b[32mINFO\x1b[0m build started\n"
                          b"2024-01-01 \x1b[1;31mERROR\x1b[0m test failed\n")
    await h.core.submit(channel.envelope("why did it fail?", media=(
        MediaItem(kind="document", file_id="f", file_name="build.log"),)))
    await h.settle()
    text = last_user_text(fake_openai.requests[0])
    assert "\n2024-01-01 INFO build started\n2024-01-01 ERROR test failed\n\n[End of build.log]" in text
    await h.core.shutdown()


class RateLimitedChannel(TestChannel):
    """A platform whose file download answers 429 with a Retry-After, then serves the file."""

    def __init__(self, retry_after: float) -> None:
        super().__init__("files")
        self.retry_after = retry_after
        self.tries: list[float] = []

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        self.tries.append(time.monotonic())
        if len(self.tries) == 1:
            raise FetchError("HTTP 429", transient=True, retry_after=self.retry_after)
        yield b"the notes"


@pytest.mark.parametrize("retry_after", [0.3, 3600.0])
async def test_a_rate_limited_download_waits_its_retry_after_unless_that_is_past_the_fetch_timeout(
        tmp_path, fake_openai, monkeypatch, retry_after):
    monkeypatch.setattr(intake, "FETCH_RETRY_DELAYS", (0.01, 0.01, 0.01))
    h = await make_harness(tmp_path, fake_openai, start=False, media_fetch_timeout=5.0)
    channel = RateLimitedChannel(retry_after)
    h.core.add_channel(channel)
    await h.core.start()
    started = time.monotonic()
    await h.core.submit(channel.envelope("here", media=(MediaItem(kind="document", file_id="f", file_name="a.txt"),)))
    await h.settle()
    text = last_user_text(fake_openai.requests[0])
    if retry_after < 1:
        assert len(channel.tries) == 2 and channel.tries[1] - channel.tries[0] >= 0.3
        assert "\nthe notes\n[End of a.txt]" in text and channel.platform.plain("c1") == []
    else:  # an hour: not waited for, nor the five seconds of the fetch timeout
        assert len(channel.tries) == 1 and time.monotonic() - started < 3
        assert channel.platform.plain("c1") == ["⚠️ a.txt: it could not be downloaded."]
    await h.core.shutdown()
