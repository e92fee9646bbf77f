"""Photos, files and voice from Telegram reach the model: the real TelegramChannel and aiogram against the fake
Bot API (getFile and file downloads), the real core with its media store, the real OpenAI SDK against the
fake model server, which records the image parts and transcription uploads it receives."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from aiohttp import web

from core.media import intake
from core.media.transcribe import Transcriber
from tests.fakes.openai_server import HttpError, Text, image_parts, last_user_text
from tests.fakes.telegram.harness import telegram_harness
from tests.fakes.telegram.server import FakeTelegram
from tests.support.media import jpeg, pdf, png_bomb, voice_ogg

CHAT = 555
MB = 1_000_000



def stored_files(tmp_path) -> list[str]:
    """Every file in the media directory (temporary writes included)."""
    root = tmp_path / "media"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def user_texts(body: dict) -> list[str]:
    return [last_user_text({"messages": [m]}) for m in body["messages"] if m["role"] == "user"]


async def test_a_photo_with_its_caption_reaches_the_model_as_an_image_part(tmp_path, fake_openai, tg):
    photo = jpeg(1280, 960)
    tg.add_file("big", photo, path="photos/file_7.jpg")
    fake_openai.script(Text("a red square"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", photo)]  # the largest size, byte for byte
        assert last_user_text(request).startswith("what is this?")
        assert tg.downloads == ["photos/file_7.jpg"]
        assert tg.visible(CHAT) == ["a red square"]
        [user] = [m for m in (await t.core.history("telegram:555"))[1] if m.role == "user"]
        [ref] = user.history_view()["attachments"]
        assert (ref["kind"], ref["content_type"], ref["size"]) == ("image", "image/jpeg", len(photo))
        assert stored_files(tmp_path) == [ref["id"]]
    finally:
        await t.close()


async def test_the_chat_shows_typing_while_a_photo_downloads_and_not_after(tmp_path, fake_openai, tg):
    """Files can take a while to download, and no reply exists yet: the chat shows "typing…" meanwhile,
    repeated while the download lasts, and the sign ends with it."""
    tg.add_file("big", jpeg(), path="photos/file_7.jpg")
    held = tg.hold("getFile")
    t = await telegram_harness(tmp_path, fake_openai, tg)
    t.channel.live = dataclasses.replace(t.channel.live, typing_every=0.1)
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.wait_for(lambda: tg.count("getFile") == 1 and tg.count("sendChatAction") >= 2)
        assert tg.visible(CHAT) == [] and fake_openai.requests == []  # still downloading
        assert {c.params["action"] for c in tg.calls_to(CHAT, "sendChatAction")} == {"typing"}
        held.set()
        await t.settle()
        assert tg.visible(CHAT) == ["ok"]
        shown = tg.count("sendChatAction")
        await asyncio.sleep(0.5)  # five repeats' time: a sign left running would show again
        assert tg.count("sendChatAction") == shown
    finally:
        await t.close()


async def test_a_photo_captioned_like_a_command_is_a_message_and_its_photo_reaches_the_model(
        tmp_path, fake_openai, tg):
    photo = jpeg(640, 480)
    tg.add_file("big", photo)
    fake_openai.script(Text("a photo"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="/new", photo=True)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", photo)]
        assert tg.visible(CHAT) == ["a photo"]  # no "new conversation" notice, no photo dropped
    finally:
        await t.close()


async def test_with_vision_off_the_model_gets_a_description_instead(tmp_path, fake_openai, tg):
    tg.add_file("big", jpeg(1280, 960))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"vision": False})
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == []
        text = last_user_text(request)
        assert text.startswith("what is this?")
        assert "[The user attached an image: photo (image/jpeg, 1280×960" in text and "not shown to you" in text
    finally:
        await t.close()


async def test_a_model_that_rejects_images_is_asked_again_with_a_description_and_then_remembered(
        tmp_path, fake_openai, tg):
    fake_openai.reject_images = True
    tg.add_file("big", jpeg(800, 600))
    fake_openai.script(Text("I cannot see it, but you sent a photo"), Text("still no images"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests] == [1, 0]  # one retry, described
        assert "[The user attached an image: photo (image/jpeg, 800×600" in last_user_text(fake_openai.requests[1])
        assert tg.visible(CHAT) == ["I cannot see it, but you sent a photo"]

        tg.user_message(caption="and this one?", photo=True)
        await t.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests] == [1, 0, 0]  # remembered: no second try
        assert tg.visible(CHAT)[-1] == "still no images"
    finally:
        await t.close()


async def test_a_request_refused_for_another_reason_is_not_blamed_on_the_images(tmp_path, fake_openai, tg):
    tg.add_file("big", jpeg())
    fake_openai.script(HttpError.bad_request("Invalid value for 'tools'."),
                       HttpError.bad_request("Invalid value for 'tools'."), Text("fine"))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.settle()
        assert [len(image_parts(r)) for r in fake_openai.requests] == [1, 0]
        tg.user_message(caption="again", photo=True)
        await t.settle()
        # images are still sent: this photo and the earlier one, which still fits the context
        assert len(image_parts(fake_openai.requests[2])) == 2
    finally:
        await t.close()


@pytest.mark.parametrize("declared", [True, False], ids=["size-declared", "size-unknown"])
async def test_a_file_over_the_cap_is_refused_with_a_note_nothing_kept_and_the_caption_answered(
        tmp_path, fake_openai, tg, declared):
    big = bytes(20 * MB)
    tg.add_file("doc20", big)
    fake_openai.script(Text("I read your caption"))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"media_max_bytes": 10 * MB})
    try:
        document = {"file_id": "doc20", "file_name": "dump.bin", "mime_type": "application/octet-stream"}
        if declared:
            document["file_size"] = len(big)
        tg.user_message(caption="please look at this", document=document)
        await t.settle()
        note, answer = tg.visible(CHAT)
        assert note == "⚠️ dump.bin: it is larger than the 10 MB limit for attachments."
        assert answer == "I read your caption"
        sent = last_user_text(fake_openai.requests[0])
        assert sent.startswith("please look at this")
        assert "dump.bin" in sent and "It could not be read: it is larger than the 10 MB limit" in sent
        assert stored_files(tmp_path) == []  # nothing kept, not even part of it
        assert tg.downloads == ([] if declared else ["documents/file_1"])
    finally:
        await t.close()


async def test_a_pdf_and_a_markdown_file_reach_the_model_within_the_budget_with_the_cut_marked(
        tmp_path, fake_openai, tg):
    page = [f"Line {i} of the quarterly report, page text." for i in range(12)]
    tg.add_file("pdf", pdf([page, page, page, page, page]))
    markdown = "# Notes\n\n" + "\n".join(f"- item {i}: keep this in mind" for i in range(400))
    tg.add_file("md", markdown.encode())
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"media_text_chars": 1500})
    try:
        tg.user_message(caption="summarise", document={"file_id": "pdf", "file_name": "report.pdf"})
        await t.settle()
        text = last_user_text(fake_openai.requests[0])
        assert "[Attached PDF: report.pdf (application/pdf, 5 pages" in text
        assert "[Page 1]\nLine 0 of the quarterly report" in text
        assert "[… 2 more pages not included]" in text and "more characters of this page not shown" in text
        assert len(text) < 1500 + 600

        tg.user_message(caption="and these notes", document={"file_id": "md", "file_name": "notes.md"})
        await t.settle()
        text = last_user_text(fake_openai.requests[1])
        assert "[Attached file: notes.md (text/plain" in text and "# Notes\n\n- item 0: keep this in mind" in text
        assert f"[… cut here: the rest of its {len(markdown.encode()):,} bytes not shown]" in text
        assert "item 399" not in text
    finally:
        await t.close()


async def test_a_voice_message_is_transcribed_when_transcription_is_configured(tmp_path, fake_openai, tg):
    voice = voice_ogg()
    tg.add_file("v1", voice)
    fake_openai.transcript = "remind me to call Bob at five"
    transcriber = Transcriber(fake_openai.base_url, "whisper-1", "sk-test-transcribe")
    t = await telegram_harness(tmp_path, fake_openai, tg, transcriber=transcriber)
    try:
        tg.user_message(voice={"file_id": "v1", "file_size": len(voice)})
        await t.settle()
        [upload] = fake_openai.transcriptions
        assert (upload.model, upload.filename, upload.content_type, upload.data) == (
            "whisper-1", "audio.ogg", "audio/ogg", voice)
        text = last_user_text(fake_openai.requests[0])
        assert text.startswith("[Voice message, transcribed]\nremind me to call Bob at five")
    finally:
        await t.close()


async def test_a_voice_message_without_transcription_is_described(tmp_path, fake_openai, tg):
    tg.add_file("v1", voice_ogg())
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(voice={"file_id": "v1"})
        await t.settle()
        text = last_user_text(fake_openai.requests[0])
        assert "[The user attached an audio message: voice message (audio/ogg" in text
        assert "It was not transcribed" in text and fake_openai.transcriptions == []
    finally:
        await t.close()


async def test_a_failed_transcription_is_described_and_the_message_still_answered(tmp_path, fake_openai, tg):
    tg.add_file("v1", voice_ogg())
    fake_openai.transcription_error = HttpError.bad_request("Audio file is too short.")
    transcriber = Transcriber(fake_openai.base_url, "whisper-1", "sk-test-transcribe", retry_delays=())
    t = await telegram_harness(tmp_path, fake_openai, tg, transcriber=transcriber)
    try:
        tg.user_message(voice={"file_id": "v1"})
        await t.settle()
        assert "It could not be read: it could not be transcribed" in last_user_text(fake_openai.requests[0])
        assert tg.visible(CHAT) == ["ok"]
    finally:
        await t.close()


async def test_a_decompression_bomb_image_is_refused_and_not_kept(tmp_path, fake_openai, tg):
    tg.add_file("bomb", png_bomb(8000))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="look", document={"file_id": "bomb", "file_name": "tiny.png"})
        await t.settle()
        note, _ = tg.visible(CHAT)
        assert note.startswith("⚠️ tiny.png: 8000×8000 pixels is more than the 50 megapixels")
        assert image_parts(fake_openai.requests[0]) == []
        assert stored_files(tmp_path) == []
    finally:
        await t.close()


async def test_a_download_is_never_redirected_off_the_bot_api_host(tmp_path, fake_openai, tg):
    tg.add_file("big", jpeg())
    tg.file_redirect = "http://127.0.0.2:9/steal"  # another host than the Bot API server's
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="what is this?", photo=True)
        await t.settle()
        note, answer = tg.visible(CHAT)
        assert note == "⚠️ photo: it could not be downloaded."
        assert image_parts(fake_openai.requests[0]) == [] and answer == "ok"
        assert stored_files(tmp_path) == []
    finally:
        await t.close()


async def test_a_file_the_bot_api_will_not_hand_out_is_described(tmp_path, fake_openai, tg):
    tg.download_limit = 1000
    tg.add_file("doc", bytes(5000))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message(caption="here", document={"file_id": "doc", "file_name": "big.bin"})
        await t.settle()
        note, _ = tg.visible(CHAT)
        assert note == "⚠️ big.bin: it is larger than telegram lets bots download."
    finally:
        await t.close()


# ---- a file download that fails transiently is made again ----------------------------------------------

class FlakyFileHost(FakeTelegram):
    """The Bot API's file URL failing ``failures`` times (``mode``: a 502 page, a 429 with Retry-After, a body
    cut off half way), then serving the file."""

    def __init__(self, mode: str, failures: int = 1) -> None:
        super().__init__()
        self.mode = mode
        self.failures = failures
        self.download_times: list[float] = []

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self.download_times.append(time.monotonic())
        if self.failures <= 0:
            return await super()._file(request)
        self.failures -= 1
        self.downloads.append(request.match_info["path"])
        if self.mode == "502":
            return web.Response(status=502, text="<html>Bad Gateway</html>", content_type="text/html")
        if self.mode == "429":
            return web.Response(status=429, headers={"Retry-After": "1"}, text="Too Many Requests")
        if self.mode == "404":
            return web.Response(status=404, text="Not Found")
        data = self.files["big"]  # "cut": the connection drops half way through the body
        response = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        assert request.transport is not None
        request.transport.close()
        return response


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(intake, "FETCH_RETRY_DELAYS", (0.05, 0.05, 0.05))


@pytest.mark.parametrize("mode", ["502", "429", "cut"])
async def test_a_file_download_that_fails_once_is_made_again_and_the_photo_reaches_the_model(
        tmp_path, fake_openai, quick_retries, mode):
    async with FlakyFileHost(mode) as flaky:
        photo = jpeg(1280, 960)
        flaky.add_file("big", photo, path="photos/file_7.jpg")
        t = await telegram_harness(tmp_path, fake_openai, flaky)
        try:
            flaky.user_message(caption="what is this?", photo=True)
            await t.settle()
            [request] = fake_openai.requests
            assert image_parts(request) == [("image/jpeg", photo)]
            assert flaky.visible(CHAT) == ["ok"]  # no "could not be downloaded" note
            assert flaky.downloads == ["photos/file_7.jpg"] * 2
            if mode == "429":  # its Retry-After was waited out, not the short backoff
                assert flaky.download_times[1] - flaky.download_times[0] >= 0.95
            [user] = [m for m in (await t.core.history("telegram:555"))[1] if m.role == "user"]
            [ref] = user.history_view()["attachments"]
            assert stored_files(tmp_path) == [ref["id"]]  # the cut try left no partial file behind
        finally:
            await t.close()


async def test_a_file_download_that_keeps_failing_is_given_up_after_a_bounded_number_of_tries(
        tmp_path, fake_openai, quick_retries):
    async with FlakyFileHost("502", failures=100) as flaky:
        flaky.add_file("big", jpeg(), path="photos/file_7.jpg")
        t = await telegram_harness(tmp_path, fake_openai, flaky)
        try:
            flaky.user_message(caption="what is this?", photo=True)
            await t.settle()
            note, answer = flaky.visible(CHAT)
            assert note == "⚠️ photo: it could not be downloaded." and answer == "ok"
            assert len(flaky.downloads) == len(intake.FETCH_RETRY_DELAYS) + 1
            assert stored_files(tmp_path) == []
        finally:
            await t.close()


async def test_a_file_the_host_does_not_have_is_not_asked_for_again(tmp_path, fake_openai, quick_retries):
    async with FlakyFileHost("404") as flaky:
        flaky.add_file("big", jpeg(), path="photos/file_7.jpg")
        t = await telegram_harness(tmp_path, fake_openai, flaky)
        try:
            flaky.user_message(caption="what is this?", photo=True)
            await t.settle()
            assert flaky.visible(CHAT)[0] == "⚠️ photo: it could not be downloaded."
            assert flaky.downloads == ["photos/file_7.jpg"]
        finally:
            await t.close()
