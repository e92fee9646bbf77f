"""Attaching files in the chat page (headless Chromium against a real web chat): by the button and by
drag-and-drop, the image previewed in the conversation and passed to the model, files offered as downloads."""

from __future__ import annotations

import base64
import os

import pytest

from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.server import start_web_chat
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.support.media import png

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")


@pytest.fixture
async def chat(tmp_path, fake_openai):
    wc = await start_web_chat(tmp_path, fake_openai, media_max_bytes=200_000)
    try:
        yield wc
    finally:
        await wc.close()


async def open_page(context, url):
    page = await context.new_page()
    await page.goto(url)
    await page.wait_for_selector("body[data-ready='1']")
    return page


async def test_an_attached_image_is_shown_in_the_page_and_passed_to_the_model(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text("A blue square."), Text("Noted."))
    image = png(120, 80)
    page = await open_page(browser, chat.base_url + "/")

    # by the button: the chip shows the upload, then the message carries it
    await page.set_input_files("#files", files=[{"name": "square.png", "mimeType": "image/png", "buffer": image}])
    await expect(page.locator("#outgoing .chip")).to_have_text("📎 square.png×")
    await page.fill("#input", "What is in this picture?")
    await page.press("#input", "Enter")
    await expect(page.locator(".msg.assistant").last).to_have_text("A blue square.")
    preview = page.locator(".msg.user:not(.pending) .attachments img.preview").first
    await expect(preview).to_be_visible()
    await page.wait_for_function("() => { const i = document.querySelector('.msg.user:not(.pending) img.preview');"
                                 " return i && i.complete && i.naturalWidth === 120; }")
    await expect(page.locator("#outgoing")).to_be_hidden()
    [request] = fake_openai.requests
    assert image_parts(request) == [("image/png", image)]
    assert last_user_text(request).startswith("What is in this picture?")

    # by drag and drop, a text file: offered as a download, its text given to the model
    notes = base64.b64encode(b"shopping: apples, pears").decode()
    transfer = await page.evaluate_handle(
        """(b64) => { const dt = new DataTransfer();
             const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
             dt.items.add(new File([bytes], 'notes.txt', { type: 'text/plain' })); return dt; }""", notes)
    await page.dispatch_event("#messages", "dragover", {"dataTransfer": transfer})
    await page.dispatch_event("#messages", "drop", {"dataTransfer": transfer})
    await expect(page.locator("#outgoing .chip")).to_have_text("📎 notes.txt×")
    await page.press("#input", "Enter")  # a message of attachments only
    await expect(page.locator(".msg.assistant").last).to_have_text("Noted.")
    link = page.locator(".msg.user:not(.pending) .attachments a.file").last
    await expect(link).to_have_text("📎 notes.txt (23 bytes)")
    assert "shopping: apples, pears" in last_user_text(fake_openai.requests[1])
    await page.screenshot(path=str(ARTIFACTS / "10-attachments.png"))


async def test_a_file_over_the_cap_is_refused_in_the_page(browser, chat, fake_openai):
    from playwright.async_api import expect

    page = await open_page(browser, chat.base_url + "/")
    await page.set_input_files("#files", files=[{"name": "big.bin", "mimeType": "application/octet-stream",
                                                 "buffer": bytes(300_000)}])
    await expect(page.locator(".notice").last).to_contain_text("Not attached: big.bin: it is larger than the 0.2 MB")
    await expect(page.locator("#outgoing")).to_be_hidden()
    assert fake_openai.requests == []
