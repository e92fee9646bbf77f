"""Images, files and voice from Feishu reach the model: the real FeishuChannel (lark-oapi) against the fake Open
API, which hands out message resources on the wire, receiving over the long connection and the webhook; the
real core with its media store; the real OpenAI SDK against the fake model server, which records the image
parts and transcription uploads it receives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from core.media.transcribe import Transcriber
from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.harness import P2P, FeishuHarness, every_mode, feishu_harness
from tests.fakes.feishu.openapi import Message
from tests.fakes.openai_server import Function, Text, image_parts, last_user_text
from tests.support.media import jpeg, pdf, voice_ogg

MB = 1_000_000


pytest_generate_tests = every_mode  # each test on `feishu_bridge` runs over the long connection and the webhook


def post(text: str, *nodes: dict[str, Any]) -> dict[str, Any]:
    """A received post: a line of text, then one paragraph per image or video node."""
    return {"title": "", "content": [[{"tag": "text", "text": text}], *[[n] for n in nodes]]}


def user_message(fake: FakeFeishu, msg_type: str, content: dict[str, Any]) -> Message:
    return fake.user_message(P2P, chat_type="p2p", msg_type=msg_type, content=content)


async def deliver(t: FeishuHarness, msg: Message) -> None:
    """Push the user's message (as the mode receives it) and wait until it is answered."""
    _, payload = t.event("", message=msg, chat=P2P, chat_type="p2p", mention=False, message_type=msg.msg_type,
                         content=json.dumps(msg.content, ensure_ascii=False))
    await t.deliver(payload)
    await t.settle()


def stored_files(tmp_path: Any) -> list[str]:
    """Every file in the media directory (temporary writes included)."""
    root = tmp_path / "media"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


async def test_a_post_with_an_image_and_text_reaches_the_model_as_an_image_part(tmp_path, feishu_bridge, fake_openai,
                                                                                fake_feishu):
    photo = jpeg(1280, 960)
    fake_openai.script(Text("a red square"))
    t = await feishu_bridge()
    msg = user_message(fake_feishu, "post", post("what is this?", {"tag": "img", "image_key": "img_v3_a"}))
    fake_feishu.add_resource(msg, "img_v3_a", photo, kind="image", content_type="image/jpeg")
    await deliver(t, msg)
    [request] = fake_openai.requests
    assert image_parts(request) == [("image/jpeg", photo)]  # byte for byte
    assert last_user_text(request).startswith("what is this?")
    assert fake_feishu.downloads == [(msg.message_id, "img_v3_a", "image")]
    assert t.texts(P2P) == ["a red square"]
    [user] = [m for m in (await t.core.history(f"feishu:{P2P}"))[1] if m.role == "user"]
    [ref] = user.history_view()["attachments"]
    assert (ref["kind"], ref["content_type"], ref["size"]) == ("image", "image/jpeg", len(photo))
    assert stored_files(tmp_path) == [ref["id"]]


async def test_an_image_message_with_vision_off_is_described_instead(feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge(core={"vision": False})
    msg = user_message(fake_feishu, "image", {"image_key": "img_v3_b"})
    fake_feishu.add_resource(msg, "img_v3_b", jpeg(640, 480), kind="image", content_type="image/jpeg")
    await deliver(t, msg)
    [request] = fake_openai.requests
    assert image_parts(request) == []
    text = last_user_text(request)
    assert "[The user attached an image: photo (image/jpeg, 640×480" in text and "not shown to you" in text
    assert t.texts(P2P) == ["ok"]


@pytest.mark.parametrize("shape", ["post-with-video", "file"])
async def test_a_20_mb_resource_over_a_10_mb_cap_is_refused_with_a_note_nothing_kept_and_the_text_answered(
        tmp_path, feishu_bridge, fake_openai, fake_feishu, shape):
    fake_openai.script(Text("I read your words"))
    t = await feishu_bridge(core={"media_max_bytes": 10 * MB})
    if shape == "file":
        msg = user_message(fake_feishu, "file", {"file_key": "file_v3_big", "file_name": "dump.bin"})
    else:
        msg = user_message(fake_feishu, "post", post("please look at this", {
            "tag": "media", "file_key": "file_v3_big", "image_key": "img_cover", "file_name": "dump.bin"}))
    fake_feishu.add_resource(msg, "file_v3_big", bytes(20 * MB), file_name="dump.bin")
    await deliver(t, msg)
    note, answer = t.texts(P2P)
    assert note == "⚠️ dump.bin: it is larger than the 10 MB limit for attachments."
    assert answer == "I read your words"
    sent = last_user_text(fake_openai.requests[0])
    assert "dump.bin" in sent and "It could not be read: it is larger than the 10 MB limit" in sent
    if shape == "post-with-video":
        assert sent.startswith("please look at this")
    assert stored_files(tmp_path) == []  # nothing kept, not even part of it
    assert fake_feishu.downloads == [(msg.message_id, "file_v3_big", "file")]


async def test_a_pdf_and_a_markdown_file_reach_the_model_within_the_budget_with_the_cut_marked(
        feishu_bridge, fake_openai, fake_feishu):
    page = [f"Line {i} of the quarterly report, page text." for i in range(12)]
    t = await feishu_bridge(core={"media_text_chars": 1500})
    report = user_message(fake_feishu, "file", {"file_key": "file_pdf", "file_name": "report.pdf"})
    # Feishu's Content-Type is not trusted: the bytes say PDF
    fake_feishu.add_resource(report, "file_pdf", pdf([page] * 5), content_type="application/octet-stream")
    await deliver(t, report)
    text = last_user_text(fake_openai.requests[0])
    assert "[Attached PDF: report.pdf (application/pdf, 5 pages" in text
    assert "[Page 1]\nLine 0 of the quarterly report" in text
    assert "[… 2 more pages not included]" in text and "more characters of this page not shown" in text
    assert len(text) < 1500 + 600

    markdown = "# Notes\n\n" + "\n".join(f"- item {i}: keep this in mind" for i in range(400))
    notes = user_message(fake_feishu, "file", {"file_key": "file_md", "file_name": "notes.md"})
    fake_feishu.add_resource(notes, "file_md", markdown.encode(), content_type="image/png")  # a wrong content type
    await deliver(t, notes)
    text = last_user_text(fake_openai.requests[1])
    assert "[Attached file: notes.md (text/plain" in text and "# Notes\n\n- item 0: keep this in mind" in text
    assert f"[… cut here: the rest of its {len(markdown.encode()):,} bytes not shown]" in text
    assert "item 399" not in text
    assert image_parts(fake_openai.requests[1]) == []


async def test_a_voice_message_is_transcribed_when_transcription_is_configured(feishu_bridge, fake_openai, fake_feishu):
    voice = voice_ogg()
    fake_openai.transcript = "remind me to call Bob at five"
    transcriber = Transcriber(fake_openai.base_url, "whisper-1", "sk-test-transcribe")
    t = await feishu_bridge(core={"transcriber": transcriber})
    msg = user_message(fake_feishu, "audio", {"file_key": "file_voice", "duration": 2300})
    fake_feishu.add_resource(msg, "file_voice", voice, content_type="audio/opus")
    await deliver(t, msg)
    [upload] = fake_openai.transcriptions
    assert (upload.model, upload.content_type, upload.data) == ("whisper-1", "audio/ogg", voice)
    text = last_user_text(fake_openai.requests[0])
    assert text.startswith("[Voice message, transcribed]\nremind me to call Bob at five")
    assert fake_feishu.downloads == [(msg.message_id, "file_voice", "file")]


async def test_a_voice_message_without_transcription_is_described(feishu_bridge, fake_openai, fake_feishu):
    t = await feishu_bridge()
    msg = user_message(fake_feishu, "audio", {"file_key": "file_voice", "duration": 2300})
    fake_feishu.add_resource(msg, "file_voice", voice_ogg())
    await deliver(t, msg)
    text = last_user_text(fake_openai.requests[0])
    assert "[The user attached an audio message: voice message (audio/ogg" in text
    assert "It was not transcribed" in text and fake_openai.transcriptions == []


@pytest.mark.parametrize("fault", ["http-404", "not-in-message"])
async def test_a_failed_download_is_noted_and_the_words_still_answered(feishu_bridge, fake_openai, fake_feishu, fault):
    fake_openai.script(Text("answered anyway"))
    t = await feishu_bridge()
    msg = user_message(fake_feishu, "post", post("what about this?", {"tag": "img", "image_key": "img_v3_gone"}))
    if fault == "http-404":
        fake_feishu.add_resource(msg, "img_v3_gone", jpeg(), kind="image")
        fake_feishu.fail("message_resource.get", status=404, code=404, msg="not found")
    await deliver(t, msg)
    note, answer = t.texts(P2P)
    assert note == "⚠️ photo: it could not be downloaded."
    assert answer == "answered anyway"
    sent = last_user_text(fake_openai.requests[0])
    assert sent.startswith("what about this?") and "It could not be read: it could not be downloaded" in sent
    assert image_parts(fake_openai.requests[0]) == []
    assert fake_feishu.count("message_resource.get") == 1  # a refusal is not asked again


async def test_a_rate_limited_download_waits_for_the_reset_and_a_refused_token_is_replaced(
        feishu_bridge, fake_openai, fake_feishu):
    photo = jpeg(320, 240)
    t = await feishu_bridge()
    msg = user_message(fake_feishu, "image", {"image_key": "img_v3_c"})
    fake_feishu.add_resource(msg, "img_v3_c", photo, kind="image", content_type="image/jpeg")
    fake_feishu.rate_limit("message_resource.get", reset=1)
    fake_feishu.fail("message_resource.get", status=400, code=99991663, msg="Invalid access token for authorization.")
    tokens = fake_feishu.count("token")
    await deliver(t, msg)
    assert image_parts(fake_openai.requests[0]) == [("image/jpeg", photo)]
    assert [(c.status, c.code) for c in fake_feishu.calls_to("message_resource.get")] == [(429, 99991400),
                                                                                   (400, 99991663), (200, 0)]
    assert fake_feishu.count("token") == tokens + 1  # the refused token was dropped and a fresh one asked for
    assert t.texts(P2P) == ["ok"]


async def test_a_photo_waiting_behind_a_slow_reply_reaches_the_model_after_a_restart(
        tmp_path, fake_openai, fake_feishu):
    photo = jpeg(640, 480)
    fake_openai.script(Text("the first answer takes its time", hold=asyncio.Event()))
    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    t = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook")
    try:
        first = user_message(fake_feishu, "text", {"text": "first"})
        _, payload = t.event("first", message=first, chat=P2P, chat_type="p2p", mention=False)
        await t.deliver(payload)
        await t.wait_for(lambda: len(fake_openai.requests) == 1)  # the slow reply is being written
        msg = user_message(fake_feishu, "post", post("what is in this photo?", {"tag": "img", "image_key": "img_v3_w"}))
        fake_feishu.add_resource(msg, "img_v3_w", photo, kind="image", content_type="image/jpeg")
        _, payload = t.event("", message=msg, chat=P2P, chat_type="p2p", mention=False, message_type="post",
                             content=json.dumps(msg.content))
        answer = await t.deliver(payload)
        assert answer.status == 200  # stored: Feishu will not push it again
    finally:
        await t.close()  # the waiting message stays stored, its image not yet downloaded
    assert fake_feishu.downloads == []

    t2 = await feishu_harness(tmp_path, fake_openai, fake_feishu, mode="webhook")
    try:
        await t2.wait_for(lambda: len(fake_openai.requests) >= 2, timeout=10)
        await t2.settle()
        request = fake_openai.requests[-1]
        assert last_user_text(request).startswith("what is in this photo?")
        assert image_parts(request) == [("image/jpeg", photo)]
        assert fake_feishu.downloads == [(msg.message_id, "img_v3_w", "image")]
        assert "echo: what is in this photo?" in t2.texts(P2P)
    finally:
        await t2.close()
