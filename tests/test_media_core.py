"""Attachments in core: what the model is sent (images within the budget, descriptions otherwise, expired
files, compaction), the fetch seam as any channel implements it (a test channel that downloads), caps, and the
pieces (sniffing, names, vision knowledge, provider wire formats)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator

import pytest

from core.envelope import MediaItem, TurnTarget
from core.input_builder import IMAGE_CHARS, RuntimeContext, Summary, TurnInputBuilder, assemble
from core.llm.anthropic_provider import AnthropicProvider
from core.llm.local_provider import _message as local_message
from core.llm.provider import LLMImage, LLMMessage, LLMRequest
from core.media.fetch import FetchError
from core.media.library import display_name
from core.media.sniff import sniff
from core.media.vision import VisionPolicy, known_vision
from core.messages import AttachmentRef, ChatMessage, MessageSource
from tests.fakes.anthropic_server import FakeAnthropic, image_blocks
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.support.channel import TestChannel
from tests.support.harness import make_harness
from tests.support.media import jpeg, pdf, pdf_bomb, png

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


def test_auto_vision_is_given_up_after_a_rejection_but_true_and_false_are_the_operators_word():
    auto = VisionPolicy("auto", "openai", "llama3.2")
    assert auto.enabled()
    auto.rejected()
    assert not auto.enabled()
    forced = VisionPolicy(True, "local")
    forced.rejected()
    assert forced.enabled() and not VisionPolicy(False, "openai", "gpt-4o").enabled()
