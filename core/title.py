"""TitleService: names a session after its first exchange, in the background, off the critical path.

The title is committed only while it is still the default and the session's generation has not moved;
a user rename always wins, however late the model answers.

With the ``local`` provider the title is the first words of the user's first message, not a model request:
that provider has one model in this process and serves one request at a time, so a title asked for after a
chat's first answer would hold the model (a prompt of up to 4,000 characters, seconds on a CPU) while the
chat's next message, or another chat's, waits behind it. A title is a nicety; an answer is what the user
is waiting for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from core.events import EventBus, SessionTitleChanged
from core.llm.provider import LLMMessage, LLMProvider, LLMRequest
from core.llm.retry import collect_text, counting
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import SupervisorClosedError, TaskSupervisor

log = logging.getLogger(__name__)

TITLE_PROMPT = ("Give this conversation a short title of at most six words, in the user's language. "
                "Answer with the title only: no quotes, no punctuation at the end.")
MAX_TITLE_CHARS = 60
MAX_TITLE_WORDS = 8
FIRST_WORDS = 6
"""How many of the first message's words make a title taken from it (what TITLE_PROMPT asks the model for)."""
FIRST_CHARS = 20
"""How many characters of a first line without spaces make such a title."""
TITLE_RETRY_DELAYS = (1.0, 3.0)


class TitleService:
    def __init__(self, store: Store, provider: LLMProvider, supervisor: TaskSupervisor, events: EventBus,
                 settings: CoreSettings, *, on_model_retry: Callable[[], None] | None = None) -> None:
        self._on_model_retry = on_model_retry
        """Told of each title request tried again (the metrics' model retries)."""
        self._store = store
        self._provider = provider
        self._supervisor = supervisor
        self._events = events
        self._settings = settings
        self._from_model = provider.name != "local"
        """False for the in-process local model: see the module docstring."""

    def schedule(self, key: str, generation: int, user_text: str, answer: str) -> None:
        if not self._settings.titles:
            return
        try:
            self._supervisor.spawn(f"title:{key}", self._run(key, generation, user_text, answer))
        except SupervisorClosedError:
            log.debug("not titling %s: shutting down", key)

    async def _run(self, key: str, generation: int, user_text: str, answer: str) -> None:
        if not self._from_model:
            await self._commit(key, generation, first_words(user_text))
            return
        request = LLMRequest(messages=(
            LLMMessage("system", TITLE_PROMPT),
            LLMMessage("user", f"User: {user_text[:2000]}\n\nAssistant: {answer[:2000]}"),
        ), max_tokens=32)
        try:
            async with asyncio.timeout(self._settings.title_timeout):
                raw = await collect_text(self._provider, request, TITLE_RETRY_DELAYS,
                                         timeout=self._settings.request_timeout,
                                         on_retry=counting(self._on_model_retry))
        except Exception as exc:  # a title is a nicety: log and move on
            log.warning("title generation for %s failed: %s", key, exc)
            return
        await self._commit(key, generation, clean_title(raw))

    async def _commit(self, key: str, generation: int, title: str) -> None:
        if not title:  # e.g. a first message that was only a photo: the default title stays
            return
        if await self._store.set_title_if_default(key, title, expect_generation=generation):
            self._events.publish(SessionTitleChanged(key, title))


def clean_title(raw: str) -> str:
    line = next((ln.strip() for ln in raw.strip().splitlines() if ln.strip()), "")
    line = line.strip("\"'“”‘’`*# ").rstrip(".。!！")
    if line.lower().startswith("title:"):
        line = line[6:].strip()
    words = line.split()
    if len(words) > MAX_TITLE_WORDS:  # small models ramble; a title is a handful of words
        line = " ".join(words[:MAX_TITLE_WORDS]) + "…"
    if len(line) > MAX_TITLE_CHARS:
        line = line[:MAX_TITLE_CHARS].rsplit(" ", 1)[0] + "…"
    return line


def first_words(text: str) -> str:
    """A title from the start of the user's message: its first line without Markdown's emphasis and code marks,
    cut to FIRST_WORDS words (marked, unless they end a sentence), or to FIRST_CHARS characters for a script
    written without spaces (Chinese, Japanese)."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    words = line.replace("*", "").replace("`", "").split()
    kept = words[:FIRST_WORDS]
    if len(kept) == 1 and len(kept[0]) > FIRST_CHARS:
        return clean_title(kept[0][:FIRST_CHARS]) + "…"
    title = clean_title(" ".join(kept))
    if (len(words) > FIRST_WORDS and title and not title.endswith("…")
            and not kept[-1].endswith((".", "?", "!", "。", "？", "！"))):
        title += "…"
    return title
