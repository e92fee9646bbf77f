"""A model's refusal of a request with images stays with that request: one user's unreadable image, or a
conversation whose images grew past a server's body limit (413), never turns images off for the other users.
Images stop for the whole process only when the model says it takes none, or refused them in several
conversations (``core.media.vision``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest

import core.input_builder as input_builder
from core.envelope import MediaItem, TurnTarget
from core.input_builder import RuntimeContext, TurnInputBuilder
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMImage, LLMMessage, LLMRequest, ProviderError, ProviderErrorKind
from core.media.vision import REFUSING_SESSIONS, VisionPolicy, says_no_vision
from core.messages import AttachmentRef, ChatMessage, MessageSource
from core.settings import CoreSettings
from tests.fakes.openai_server import FakeOpenAI, Function, HttpError, Text, _error_body, image_parts, last_user_text
from tests.support.channel import TestChannel
from tests.support.harness import API_KEY, make_harness
from tests.support.media import jpeg

UNSUPPORTED_IMAGE = "You uploaded an unsupported image. Please make sure your image is valid."


class Files(TestChannel):
    def __init__(self) -> None:
        super().__init__("files")
        self.files: dict[str, bytes] = {}

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        yield self.files[item.file_id]


def photo(file_id: str) -> tuple[MediaItem, ...]:
    return (MediaItem(kind="photo", file_id=file_id),)


async def files_harness(tmp_path, fake_openai, files: dict[str, bytes]):  # type: ignore[no-untyped-def]
    h = await make_harness(tmp_path, fake_openai, start=False)  # [llm] vision = "auto", model "fake-model"
    ch = Files()
    ch.files.update(files)
    h.core.add_channel(ch)
    await h.core.start()
    return h, ch


async def test_one_users_unreadable_image_is_described_for_that_request_only(tmp_path, fake_openai):
    # an image the intake takes (it reads as one) but the model API refuses: what OpenAI answers for an image
    # it cannot process (a truncated or oddly encoded file); here the fake refuses these bytes
    bad, good, later = jpeg(400, 300, (200, 0, 0)), jpeg(400, 300), jpeg(320, 240, (0, 90, 0))

    def model(body: dict[str, Any]) -> HttpError | Text:
        if any(data == bad for _, data in image_parts(body)):
            return HttpError.bad_request(UNSUPPORTED_IMAGE)
        return Text(f"saw {len(image_parts(body))} image(s)")

    fake_openai.default = Function(model)
    h, ch = await files_harness(tmp_path, fake_openai, {"bad": bad, "good": good, "later": later})
    try:
        await h.core.submit(ch.envelope("look", chat_id="alice", media=photo("bad")))
        await h.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests] == [1, 0]  # refused, then described
        assert "[The user attached an image:" in last_user_text(fake_openai.requests[1])
        assert ch.platform.visible("alice") == ["saw 0 image(s)"]

        n = len(fake_openai.requests)
        await h.core.submit(ch.envelope("what is this?", chat_id="bob", media=photo("good")))
        await h.settle()
        assert [image_parts(r) for r in fake_openai.requests[n:]] == [[("image/jpeg", good)]]  # bob's photo shown
        assert ch.platform.visible("bob") == ["saw 1 image(s)"]

        # alice's next photo is shown too: the refused request's older image is described, the new one kept
        n = len(fake_openai.requests)
        await h.core.submit(ch.envelope("and this?", chat_id="alice", media=photo("later")))
        await h.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests[n:]] == [2, 1]
        assert image_parts(fake_openai.requests[-1]) == [("image/jpeg", later)]
        assert ch.platform.visible("alice")[-1] == "saw 1 image(s)"
    finally:
        await h.core.shutdown()


async def test_a_model_that_says_it_takes_no_images_is_described_to_for_everyone(tmp_path, fake_openai):
    fake_openai.reject_images = True  # OpenAI's "image_url is only supported by certain models"
    fake_openai.default = Text("ok")
    h, ch = await files_harness(tmp_path, fake_openai, {"a": jpeg(400, 300), "b": jpeg(300, 200)})
    try:
        await h.core.submit(ch.envelope("look", chat_id="alice", media=photo("a")))
        await h.settle()
        await h.core.submit(ch.envelope("look", chat_id="bob", media=photo("b")))
        await h.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests] == [1, 0, 0]  # bob's: described at once
        assert ch.platform.visible("bob") == ["ok"]
    finally:
        await h.core.shutdown()


async def test_images_past_a_servers_body_limit_are_described_for_that_conversation_only(tmp_path, fake_openai):
    """A server with a request-size limit answers 413: the request is rebuilt (a context overflow) with only the
    newest photo shown; the conversation goes on and another user's photo is still shown."""
    photos = {f"p{i}": jpeg(300, 200, (i * 40, 0, 0)) for i in range(5)}
    limit = sum(len(p) for p in photos.values()) * 3 // 5  # about three photos' worth

    def model(body: dict[str, Any]) -> HttpError | Text:
        if sum(len(d) for _, d in image_parts(body)) > limit:
            return HttpError(413, _error_body("Request Entity Too Large", "invalid_request_error", None))
        return Text(f"saw {len(image_parts(body))} image(s)")

    fake_openai.default = Function(model)
    h, ch = await files_harness(tmp_path, fake_openai, {**photos, "bob": jpeg(400, 300)})
    try:
        for fid in photos:
            await h.core.submit(ch.envelope("and this one", chat_id="alice", media=photo(fid)))
            await h.settle()
        answers = ch.platform.visible("alice")
        assert len(answers) == len(photos) and all(a.startswith("saw ") for a in answers), answers
        assert answers[-1] == "saw 1 image(s)"  # rebuilt: the newest photo shown, the older ones described
        assert image_parts(fake_openai.requests[-1]) == [("image/jpeg", photos["p4"])]

        n = len(fake_openai.requests)
        await h.core.submit(ch.envelope("what is this?", chat_id="bob", media=photo("bob")))
        await h.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests[n:]] == [1]
        assert ch.platform.visible("bob") == ["saw 1 image(s)"]
    finally:
        await h.core.shutdown()


async def test_a_413_is_a_request_too_large_not_a_bad_request(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(HttpError(413, _error_body("Request Entity Too Large", "invalid_request_error", None)))
    provider = OpenAIProvider(model="fake-model", base_url=fake_openai.base_url, api_key=API_KEY)
    try:
        with pytest.raises(ProviderError) as caught:
            async for _ in provider.stream(LLMRequest(messages=(LLMMessage("user", "hi"),))):
                pass
    finally:
        await provider.aclose()
    assert caught.value.kind is ProviderErrorKind.CONTEXT_OVERFLOW and caught.value.status == 413


# ---- the policy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "none"), [
    ("Invalid content type. image_url is only supported by certain models.", True),  # OpenAI, text model
    ("this model does not support image input", True),  # Ollama
    ("Model does not support images. Please use a model that does.", True),  # LM Studio
    ("image input is not supported - hint: you may need to provide the mmproj", True),  # llama.cpp
    ("At most 0 image(s) may be provided in one request.", True),  # vLLM, text only
    ("Failed to deserialize the JSON body: messages[1]: unknown variant `image_url`, expected `text`", True),
    (UNSUPPORTED_IMAGE, False),  # OpenAI: this one image
    ("Invalid image.", False),
    ("At most 1 image(s) may be provided in one request.", False),
    ("Request Entity Too Large", False),
])
def test_what_says_a_model_takes_no_images(text, none):
    assert says_no_vision(f"BadRequestError (HTTP 400): Error code: 400 - {{'error': {{'message': '{text}'}}}}") \
        is none


def test_images_stop_for_everyone_only_on_a_no_vision_answer_or_refusals_in_several_conversations():
    unknown = VisionPolicy("auto", "openai", "fake-model")
    for n in range(REFUSING_SESSIONS - 1):
        unknown.rejected(f"s{n}")
        unknown.rejected(f"s{n}")  # the same conversation again counts once
    assert unknown.enabled()
    unknown.rejected(f"s{REFUSING_SESSIONS - 1}")
    assert not unknown.enabled()

    said = VisionPolicy("auto", "openai", "fake-model")
    said.rejected("s0", unsupported=True)
    assert not said.enabled()

    known = VisionPolicy("auto", "openai", "gpt-4o")  # known to take images: a refusal is about the image
    for n in range(REFUSING_SESSIONS + 1):
        known.rejected(f"s{n}")
    assert known.enabled()
    known.rejected("s0", unsupported=True)
    assert not known.enabled()

    forced = VisionPolicy(True, "openai", "fake-model")
    forced.rejected("s0", unsupported=True)
    assert forced.enabled()


# ---- the image bytes of one request are capped -----------------------------------------------------------

def _image_ref(name: str) -> AttachmentRef:
    return AttachmentRef(id=name.ljust(32, "0")[:32], kind="image", name=name, size=1000, content_type="image/png",
                         width=10, height=10)


def _user(seq: int, text: str, *refs: AttachmentRef) -> ChatMessage:
    return ChatMessage(id=f"m{seq}", session_key="s", seq=seq, role="user", content=text,
                       source=MessageSource(kind="user_input", attachments=refs), received_at=0.0, created_at=0.0)


async def test_older_images_past_the_byte_cap_are_described_and_the_newest_kept(monkeypatch):
    monkeypatch.setattr(input_builder, "MAX_IMAGE_BYTES", 2500, raising=False)

    async def load(ref: AttachmentRef) -> LLMImage:
        return LLMImage("image/png", ref.name.encode() * (1000 // len(ref.name)), f"[described {ref.name}]")

    class Store:
        async def context_messages(self, key: str, *, limit: int):  # type: ignore[no-untyped-def]
            return 1, [_user(1, "one", _image_ref("a.png")), _user(2, "two", _image_ref("b.png")),
                       _user(3, "three", _image_ref("c.png"), _image_ref("d.png")),
                       _user(4, "four", _image_ref("e.png"), _image_ref("f.png"), _image_ref("g.png"))]

    builder = TurnInputBuilder(Store(), CoreSettings(), images=load, vision=lambda: True)  # type: ignore[arg-type]
    prepared = await builder.prepare("s", 1, RuntimeContext(channel="test", now=0.0))
    shown = [[i.description for i in m.images] for m in prepared.messages[1:]]
    # the newest message's three images (3,000 bytes, over the cap) are shown; older ones only while they fit
    assert shown == [[], [], [], ["[described e.png]", "[described f.png]", "[described g.png]"]]
    assert "[described c.png]" in prepared.messages[3].content and "[described a.png]" in prepared.messages[1].content

    monkeypatch.setattr(input_builder, "MAX_IMAGE_BYTES", 4500, raising=False)
    prepared = await builder.prepare("s", 1, RuntimeContext(channel="test", now=0.0))
    assert [len(m.images) for m in prepared.messages[1:]] == [0, 0, 1, 3]  # c.png fits; d.png, b.png would not
    assert "[described d.png]" in prepared.messages[3].content and "[described b.png]" in prepared.messages[2].content

    recovered = await builder.recover_after_overflow(prepared)  # a 413 / overflow: only the newest shown
    assert [len(m.images) for m in recovered.messages[1:]] == [0, 0, 0, 3]
