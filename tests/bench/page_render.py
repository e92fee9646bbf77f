"""Benchmark: what rendering a long streamed reply costs the chat page (headless Chromium).

A real web chat (ChatCore + web channel, the fake model in this process) streams one long reply made of
prose and many code blocks in small pieces; the page renders Markdown (markdown-it + DOMPurify) and
highlights code (highlight.js) as it grows. Printed per reply: the ``turn`` events the page received, how
often it re-rendered the live reply, the time those renders took (total, mean and the longest one), how
many times highlight.js ran, and the main thread's long tasks (over 50 ms, the browser's own measure):
what a user could feel as the page stalling.

    python -m tests.bench.page_render            # about a minute
    python -m tests.bench.page_render --quick    # a shorter reply

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.browser.conftest import ARGS, CHROMIUM  # noqa: E402
from tests.browser.server import start_web_chat  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI, Text  # noqa: E402


def reply(blocks: int) -> str:
    parts = []
    for b in range(blocks):
        parts.append(f"### Step {b}\n\nSome **prose** about step {b}, with `inline code` and a [link]"
                     f"(https://example.org/{b}).\n\n| a | b |\n|---|--:|\n| {b} | {b * 2} |\n")
        lang = ("python", "javascript", "bash", "json")[b % 4]
        body = "\n".join(f"    value_{b}_{i} = compute({i}, '{'x' * (i % 7)}')  # step {i}" for i in range(40))
        parts.append(f"```{lang}\n{body}\n```\n")
    return "\n".join(parts)


async def measure(page, fake: FakeOpenAI, text: str, label: str) -> None:  # type: ignore[no-untyped-def]
    await page.click("#new-chat")
    await page.wait_for_function("() => document.querySelectorAll('#messages .msg').length === 0")
    await page.evaluate("""() => {
        window.__turnEvents = 0;
        window.chatbridge.app.stream.addEventListener('turn', () => { window.__turnEvents++; });
        window.__longTasks = [];
        new PerformanceObserver((list) => { for (const e of list.getEntries()) window.__longTasks.push(e.duration); })
            .observe({type: 'longtask'});
        const s = window.chatbridge.app.stats;
        s.liveRenders = 0; s.liveRenderMs = 0; s.liveRenderMaxMs = 0; s.highlightCalls = 0;
    }""")
    fake.script(Text(text, chunk_size=12, delay=0.002))
    started = time.monotonic()
    await page.fill("#input", "a long reply please")
    await page.press("#input", "Enter")
    await page.wait_for_function("() => document.querySelectorAll('#messages .msg.assistant:not(.live)').length"
                                 " === 1", timeout=600_000)
    shown = time.monotonic() - started
    await asyncio.sleep(0.5)  # the observer reports tasks after they end
    f = await page.evaluate("() => ({events: window.__turnEvents, long: window.__longTasks,"
                            " ...window.chatbridge.app.stats})")
    long = sorted(f["long"])
    print(f"{label}: {len(text)} characters in {len(text) // 12} chunks, on the page in {shown:.1f} s")
    print(f"  turn events {f['events']}, live renders {f['liveRenders']}, render time total "
          f"{f['liveRenderMs']:.0f} ms (mean {f['liveRenderMs'] / max(f['liveRenders'], 1):.1f} ms, longest "
          f"{f['liveRenderMaxMs']:.1f} ms), highlight.js runs {f['highlightCalls']}")
    print(f"  main-thread tasks over 50 ms: {len(long)}, total {sum(long):.0f} ms, longest "
          f"{(long[-1] if long else 0):.0f} ms")


async def main(quick: bool) -> None:
    from playwright.async_api import async_playwright

    blocks = 10 if quick else 40
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeOpenAI() as fake:
            chat = await start_web_chat(Path(tmp), fake)
            try:
                async with async_playwright() as pw:
                    browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
                    page = await browser.new_page(viewport={"width": 1100, "height": 760})
                    await page.goto(chat.base_url + "/")
                    await page.wait_for_selector("body[data-ready='1']")
                    await measure(page, fake, reply(blocks), f"{blocks} code blocks")
                    prose = "\n\n".join(" ".join(f"word{i}" for i in range(j, j + 60))
                                          for j in range(0, len(reply(blocks)) // 7, 60))
                    await measure(page, fake, prose, "prose only (paragraphs)")
                    await browser.close()
            finally:
                await chat.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
