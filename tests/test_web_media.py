"""Attachments in the web chat over real HTTP: upload (multipart, same origin rules, the size cap checked by the
server), the message that carries them, the model's request, and downloads served only within their session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.server import new_session, start_web_chat
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.support.media import png, png_bomb


@pytest.fixture
async def chat(tmp_path, fake_openai):
    wc = await start_web_chat(tmp_path, fake_openai, media_max_bytes=100_000)
    try:
        yield wc
    finally:
        await wc.close()


async def upload(http, base, sid, data: bytes, name: str, headers: dict[str, str] | None = None):
    """A browser's multipart upload (the file name sent as written, as browsers do)."""
    body = (b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="' + name.encode() + b'"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--BOUNDARY--\r\n")
    sent = {"Content-Type": "multipart/form-data; boundary=BOUNDARY", **(headers or {})}
    async with http.post(f"{base}/api/sessions/{sid}/attachments", data=body, headers=sent) as resp:
        return resp.status, await resp.json()


def media_files(tmp_path) -> list[str]:
    root = tmp_path / "media"
    return sorted(p.name for p in root.rglob("*") if p.is_file())


async def settle(chat, timeout: float = 10.0) -> None:
    import asyncio
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if chat.core.sessions.idle():
            return
    raise AssertionError("chat did not settle")


async def test_an_uploaded_image_reaches_the_model_and_only_its_session_can_download_it(chat, http, fake_openai,
                                                                                         tmp_path):
    fake_openai.script(Text("a blue square"))
    base = chat.base_url
    sid, other = await new_session(http, base), await new_session(http, base)
    image = png(40, 30)
    status, ref = await upload(http, base, sid, image, "../../etc/square.png")
    assert status == 201
    assert (ref["kind"], ref["content_type"], ref["size"], ref["name"]) == ("image", "image/png", len(image),
                                                                            "square.png")
    async with http.post(f"{base}/api/sessions/{sid}/messages",
                         json={"text": "what is this?", "attachments": [ref["id"]]}) as resp:
        assert resp.status == 202
    await settle(chat)
    [request] = fake_openai.requests
    assert image_parts(request) == [("image/png", image)]
    assert last_user_text(request).startswith("what is this?")

    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        user = next(m for m in (await resp.json())["messages"] if m["role"] == "user")
    assert [a["id"] for a in user["attachments"]] == [ref["id"]]

    async with http.get(f"{base}/api/sessions/{sid}/attachments/{ref['id']}") as resp:
        assert resp.status == 200 and await resp.read() == image
        assert resp.headers["Content-Type"] == "image/png"
        assert resp.headers["Content-Disposition"].startswith("inline;")
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
    async with http.get(f"{base}/api/sessions/{other}/attachments/{ref['id']}") as resp:
        assert resp.status == 404  # another session cannot download it
    async with http.post(f"{base}/api/sessions/{other}/messages",
                         json={"text": "mine now", "attachments": [ref["id"]]}) as resp:
        assert resp.status == 400  # nor send it as its own
    async with http.get(f"{base}/api/sessions/{sid}/attachments/{ref['id']}",
                        headers={"Sec-Fetch-Site": "cross-site"}) as resp:
        assert resp.status == 403  # nor can another site embed it


async def test_a_file_that_is_not_an_image_is_served_as_a_download(chat, http):
    base = chat.base_url
    sid = await new_session(http, base)
    page = b"<html><script>alert(document.cookie)</script></html>"
    status, ref = await upload(http, base, sid, page, "page.html")
    assert status == 201 and ref["kind"] == "text"
    async with http.get(f"{base}/api/sessions/{sid}/attachments/{ref['id']}") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "application/octet-stream"
        assert resp.headers["Content-Disposition"] == \
            "attachment; filename=\"page.html\"; filename*=UTF-8''page.html"


async def test_an_upload_over_the_cap_is_refused_and_nothing_is_kept(chat, http, tmp_path):
    base = chat.base_url
    sid = await new_session(http, base)
    status, body = await upload(http, base, sid, bytes(150_000), "big.bin")
    assert status == 413 and "larger than the 0.1 MB limit" in body["error"]
    status, body = await upload(http, base, sid, png_bomb(8000), "bomb.png")
    assert status == 413 and "pixels" in body["error"]
    assert media_files(tmp_path) == []


async def test_uploads_follow_the_origin_rules_and_take_multipart_only(chat, http, tmp_path):
    base = chat.base_url
    sid = await new_session(http, base)
    status, _ = await upload(http, base, sid, png(), "x.png", headers={"Origin": "http://evil.example"})
    assert status == 403
    async with http.post(f"{base}/api/sessions/{sid}/attachments", data=png(),
                         headers={"Content-Type": "image/png"}) as resp:
        assert resp.status == 415
    assert media_files(tmp_path) == []


async def test_new_drops_uploads_no_message_refers_to(chat, http, fake_openai, tmp_path):
    base = chat.base_url
    sid = await new_session(http, base)
    _, sent = await upload(http, base, sid, png(), "sent.png")
    _, unsent = await upload(http, base, sid, png(8, 8), "unsent.png")
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "", "attachments": [sent["id"]]}) as r:
        assert r.status == 202
    await settle(chat)
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "/new"}) as r:
        assert r.status == 202
    for _ in range(200):
        if unsent["id"] not in media_files(tmp_path):
            break
        await __import__("asyncio").sleep(0.02)
    assert media_files(tmp_path) == [sent["id"]]  # the message's attachment stays (until it expires)


@pytest.fixture
def full_disk(monkeypatch):
    """Every temporary write of the media directory goes to /dev/full: the kernel answers ENOSPC."""
    real_open = Path.open

    def open_(self, mode="r", *args, **kwargs):
        if self.suffix == ".part" and "w" in mode:
            return real_open(Path("/dev/full"), mode, *args, **kwargs)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)


async def test_an_upload_on_a_full_disk_is_refused_with_a_reason_the_page_can_show(chat, http, tmp_path, full_disk):
    sid = await new_session(http, chat.base_url)
    status, body = await upload(http, chat.base_url, sid, b"hello " * 1000, "notes.txt")
    assert (status, body) == (507, {"error": "the bridge has no room to store it"})
    assert media_files(tmp_path) == []


async def test_an_empty_file_is_described_to_the_model_as_empty(chat, http, fake_openai):
    base = chat.base_url
    sid = await new_session(http, base)
    status, ref = await upload(http, base, sid, b"", "notes.txt")
    assert status == 201 and ref["size"] == 0
    async with http.post(f"{base}/api/sessions/{sid}/messages",
                         json={"text": "what's in my notes?", "attachments": [ref["id"]]}) as resp:
        assert resp.status == 202
    await settle(chat)
    text = last_user_text(fake_openai.requests[0])
    assert "[The user attached a file: notes.txt. It is empty (0 bytes).]" in text
    assert "content is not shown" not in text
