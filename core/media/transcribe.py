"""Voice and audio to text through an OpenAI-compatible ``/audio/transcriptions`` endpoint.

``[media.transcription]`` names the endpoint (``base_url``, ``model``, ``api_key``): OpenAI's Whisper or
gpt-4o-transcribe, or a local server that speaks the same API (faster-whisper-server, LocalAI, vLLM). The
official ``openai`` SDK makes the request; timeouts, 5xx, 429 and broken connections are retried on the
same ladder as model requests (tenacity), a rejected key or an account out of quota is not. An answer without
a string ``text`` (an HTML page or a JSON error answered 200) is malformed, retried the same way. Failures raise
:class:`TranscriptionError` with a detail for logs only (the key removed); the attachment is then described
instead. The transcript is cut to the message's text budget by the caller (``core.media.intake``). Each retry
is counted in ``/metrics`` (``chatbridge_transcription_retries_total``, apart from the model's: the endpoint is
often another server), through ``count_retry``, which the core using the transcriber sets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import openai

from core.llm.http_errors import Redactor, out_of_quota, refused, retry_after, sdk_error
from core.llm.provider import ProviderError, ProviderErrorKind
from core.llm.retry import counting, retry_policy
from core.retrying import run_with_retries

DEFAULT_TIMEOUT = 120.0
_EXTENSIONS = {"audio/ogg": "ogg", "audio/mpeg": "mp3", "audio/mp4": "m4a", "audio/wav": "wav",
               "audio/webm": "webm", "video/webm": "webm", "audio/flac": "flac", "video/mp4": "mp4"}


class TranscriptionError(Exception):
    """The endpoint did not transcribe the file (detail for logs, without secrets)."""


class Transcriber:
    def __init__(self, base_url: str, model: str, api_key: str = "", *, timeout: float = DEFAULT_TIMEOUT,
                 retry_delays: Sequence[float] = (2.0, 4.0)) -> None:
        self.model = model
        self.count_retry: Callable[[], None] | None = None
        """Called once per retry (set by the core: its metrics)."""
        self._delays = tuple(retry_delays)
        self._redactor = Redactor(api_key)
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "none", timeout=timeout, max_retries=0,
            http_client=openai.DefaultAioHttpClient(timeout=timeout))

    async def transcribe(self, path: Path, content_type: str) -> str:
        """The text spoken in the audio file at ``path``."""
        data = await asyncio.to_thread(path.read_bytes)
        # The endpoint tells formats apart by the file name's extension; the name is ours, never the sender's.
        name = f"audio.{_EXTENSIONS.get(content_type.split(';')[0], 'ogg')}"

        async def once() -> str:
            try:
                result = await self._client.audio.transcriptions.create(
                    model=self.model, file=(name, data, content_type), response_format="json")
            except openai.OpenAIError as exc:
                raise self._error(exc) from None
            # Only a JSON answer with a string ``text`` is a transcript: a proxy's HTML page answered 200, or a
            # JSON error object, would otherwise reach the model as the user's words.
            text = getattr(result, "text", None)
            if not isinstance(text, str):
                raise ProviderError(ProviderErrorKind.MALFORMED,
                                    f"the endpoint answered without a transcript ({type(result).__name__})")
            return text.strip()

        try:
            return await run_with_retries(
                lambda: retry_policy(self._delays, on_retry=counting(self.count_retry)), once)
        except ProviderError as exc:
            raise TranscriptionError(str(exc)) from None

    def _error(self, exc: openai.OpenAIError) -> ProviderError:
        K = ProviderErrorKind
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            if status in (401, 403):
                return sdk_error(K.AUTH, exc, self._redactor, status=status)
            if out_of_quota(status, exc.code, exc.type):  # not retried: no wait ends it
                return sdk_error(K.QUOTA, exc, self._redactor, status=status)
            if status == 429:
                return sdk_error(K.RATE_LIMIT, exc, self._redactor, status=status,
                                 retry_after=retry_after(exc.response.headers))
            kind = K.TRANSIENT if status >= 500 or status in (408, 409) else K.BAD_REQUEST
            return sdk_error(kind, exc, self._redactor, status=status)
        if isinstance(exc, openai.APITimeoutError):
            return sdk_error(K.TRANSIENT if refused(exc) else K.TIMEOUT, exc, self._redactor)
        if isinstance(exc, openai.APIConnectionError):
            return sdk_error(K.TRANSIENT, exc, self._redactor)
        return sdk_error(K.MALFORMED if isinstance(exc, openai.APIResponseValidationError) else K.BAD_REQUEST,
                         exc, self._redactor)

    async def aclose(self) -> None:
        await self._client.close()
