"""Photos and files shared on Slack reach the model: the real SlackChannel (slack_sdk, slack-bolt) against the
fake Slack (``files.info`` and private file URLs that want the bot token), the real core with its media store,
the real OpenAI SDK against the fake model server, which records the image parts it receives."""

from __future__ import annotations

import pytest
from aiohttp import web

from core.media import intake
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.fakes.slack.harness import slack_harness
from tests.fakes.slack.server import FakeSlack
from tests.support.media import jpeg

MB = 1_000_000
MODES = pytest.mark.parametrize("mode", ["socket", "http"])
DM = "D0ALICE"


def stored_files(tmp_path) -> list[str]:
    root = tmp_path / "media"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@MODES
async def test_a_photo_with_its_message_reaches_the_model_as_an_image_part(tmp_path, fake_openai, fake_slack, mode):
    photo = jpeg(1024, 768)
    fake_openai.script(Text("a red square"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode)
    try:
        shared = fake_slack.add_file("F0PHOTO", "IMG_0001.jpg", "image/jpeg", photo)
        await t.deliver(fake_slack.user_message("what is this?", files=[shared], subtype="file_share"))
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", photo)]
        assert last_user_text(request).startswith("what is this?")
        assert fake_slack.downloads == [("F0PHOTO", f"Bearer {fake_slack.bot_token}")]
        assert fake_slack.visible(DM) == ["a red square"]
    finally:
        await t.close()


async def test_with_vision_off_a_slack_photo_is_described(tmp_path, fake_openai, fake_slack):
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core={"vision": False})
    try:
        shared = fake_slack.add_file("F0PHOTO", "IMG_0001.jpg", "image/jpeg", jpeg(800, 600))
        await t.deliver(fake_slack.user_message("what is this?", files=[shared], subtype="file_share"))
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == []
        text = last_user_text(request)
        assert text.startswith("what is this?")
        assert "[The user attached an image: IMG_0001.jpg (image/jpeg, 800×600" in text and "not shown" in text
    finally:
        await t.close()


async def test_a_20_mb_file_over_a_10_mb_cap_is_not_downloaded_and_the_message_answered(
        tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text("I read your message"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core={"media_max_bytes": 10 * MB})
    try:
        shared = fake_slack.add_file("F0BIG", "dump.bin", "application/octet-stream", bytes(20 * MB))
        await t.deliver(fake_slack.user_message("please look at this", files=[shared], subtype="file_share"))
        await t.settle()
        note, answer = fake_slack.visible(DM)
        assert note == "⚠️ dump.bin: it is larger than the 10 MB limit for attachments."
        assert answer == "I read your message"
        sent = last_user_text(fake_openai.requests[0])
        assert sent.startswith("please look at this") and "It could not be read: it is larger than" in sent
        assert fake_slack.downloads == []  # Slack declares the size: nothing is fetched
        assert stored_files(tmp_path) == []
    finally:
        await t.close()


async def test_a_file_url_on_another_host_is_refused_and_never_gets_the_token(tmp_path, fake_openai, fake_slack):
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        shared = fake_slack.add_file("F0ELSE", "IMG_0002.jpg", "image/jpeg", jpeg())
        info, _ = fake_slack.files["F0ELSE"]
        # the same server under another name: a download there would show below, with the token it was sent
        url = str(info["url_private_download"])
        assert "//127.0.0.1:" in url
        info["url_private"] = info["url_private_download"] = url.replace("//127.0.0.1:", "//localhost:")
        await t.deliver(fake_slack.user_message("and this?", files=[shared], subtype="file_share"))
        await t.settle()
        note, answer = fake_slack.visible(DM)
        assert note == "⚠️ IMG_0002.jpg: it could not be downloaded."
        assert answer == "ok" and image_parts(fake_openai.requests[0]) == []
        assert fake_slack.downloads == [] and stored_files(tmp_path) == []
    finally:
        await t.close()


class BusyFileHost(FakeSlack):
    """Slack's file host answering 503 (under load) ``failures`` times before it serves the file."""

    failures = 1

    async def _file_download(self, request: web.Request) -> web.Response:
        if self.failures > 0:
            self.failures -= 1
            self.downloads.append((request.match_info["file_id"], request.headers.get("Authorization")))
            return web.Response(status=503, text="Service Unavailable")
        return await super()._file_download(request)


async def test_a_file_download_answered_503_once_is_made_again(tmp_path, fake_openai, monkeypatch):
    monkeypatch.setattr(intake, "FETCH_RETRY_DELAYS", (0.05, 0.05, 0.05))
    async with BusyFileHost() as busy:
        photo = jpeg(800, 600)
        t = await slack_harness(tmp_path, fake_openai, busy, "socket")
        try:
            shared = busy.add_file("F0PHOTO", "IMG_0001.jpg", "image/jpeg", photo)
            await t.deliver(busy.user_message("what is this?", files=[shared], subtype="file_share"))
            await t.settle()
            assert image_parts(fake_openai.requests[0]) == [("image/jpeg", photo)]
            assert busy.visible(DM) == ["ok"]
            assert [file_id for file_id, _ in busy.downloads] == ["F0PHOTO", "F0PHOTO"]
            assert len(stored_files(tmp_path)) == 1
        finally:
            await t.close()
