"""The web chat's static files: every one ships in the package, the vendored libraries are the recorded
files with their licences, and the page loads only its own files (no inline script or handler, so a strict
Content-Security-Policy can forbid them)."""

from __future__ import annotations

import hashlib
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "channels" / "web"
STATIC = WEB / "static"
VENDOR = STATIC / "vendor"


def test_every_static_file_is_package_data():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["channels.web"]
    shipped = {p for pattern in patterns for p in WEB.glob(pattern) if p.is_file()}
    present = {p for p in STATIC.rglob("*") if p.is_file()}
    assert present - shipped == set()
    for licence in ("markdown-it/LICENSE", "dompurify/LICENSE", "dompurify/LICENSE-MPL", "highlight.js/LICENSE",
                    "markdown-it/bundled-licences/linkify-it-LICENSE"):
        assert VENDOR / licence in shipped


def test_vendored_files_are_the_recorded_ones():
    readme = (VENDOR / "README.md").read_text()
    recorded = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    assert set(recorded) == {"markdown-it/markdown-it.umd.min.js", "dompurify/purify.min.js",
                             "highlight.js/highlight.min.js", "highlight.js/github.min.css"}
    for name, digest in recorded.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    # the versions in the table are the ones the files announce
    assert "| `dompurify` | 3.5.0 |" in readme
    assert "DOMPurify 3.5.0 " in (VENDOR / "dompurify/purify.min.js").read_text()
    assert "| `@highlightjs/cdn-assets` | 11.12.0 |" in readme
    assert "Highlight.js v11.12.0 " in (VENDOR / "highlight.js/highlight.min.js").read_text()


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.inline_scripts = 0
        self.handlers: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self.handlers += [name for name, _ in attrs if name.startswith("on") or name == "style"]
        if tag == "script":
            if values.get("src"):
                self.sources.append(str(values["src"]))
            else:
                self.inline_scripts += 1
        if tag == "link" and values.get("rel") == "stylesheet":
            self.sources.append(str(values["href"]))


def test_the_page_loads_only_its_own_files_and_has_no_inline_code():
    page = _Page()
    page.feed((STATIC / "index.html").read_text())
    assert page.inline_scripts == 0 and page.handlers == []
    assert page.sources and all(s.startswith("/static/") for s in page.sources)
    for source in page.sources:
        assert (STATIC / source.removeprefix("/static/")).is_file(), source
    app = (STATIC / "app.js").read_text()
    assert "eval(" not in app and "new Function" not in app and "setAttribute(\"on" not in app
