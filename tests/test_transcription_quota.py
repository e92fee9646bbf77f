"""A transcription account out of quota is not retried: no wait ends it (each voice note used to wait through
the whole retry ladder, a minute by default, before it was described instead)."""

from __future__ import annotations

import pytest

from core.media.transcribe import Transcriber, TranscriptionError
from tests.fakes.openai_server import FakeOpenAI, HttpError
from tests.support.media import voice_ogg


async def test_a_transcription_account_out_of_quota_is_asked_once(tmp_path, fake_openai: FakeOpenAI) -> None:
    fake_openai.transcription_error = HttpError.quota()
    transcriber = Transcriber(fake_openai.base_url, "whisper-1", "sk-test", retry_delays=(0.01, 0.01, 0.01))
    retries: list[None] = []
    transcriber.count_retry = lambda: retries.append(None)
    audio = tmp_path / "voice.ogg"
    audio.write_bytes(voice_ogg())
    try:
        with pytest.raises(TranscriptionError) as info:
            await transcriber.transcribe(audio, "audio/ogg")
    finally:
        await transcriber.aclose()
    assert len(fake_openai.transcriptions) == 1 and retries == []
    assert str(info.value).startswith("quota: ")  # the operator's log says what it is
    assert "sk-test" not in str(info.value)
