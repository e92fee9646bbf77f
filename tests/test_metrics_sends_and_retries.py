"""``/metrics`` counts what happened, not what was tried: a transcription tried again is a retry like a model
request's (its own series), and a plain fallback counts once the platform took it — not when a send that the
platform refused was only started."""

from __future__ import annotations

from aiohttp import web

from core.channel import SinkError
from core.envelope import MediaItem, TurnTarget
from core.media.transcribe import Transcriber
from tests.fakes.openai_server import Text, last_user_text
from tests.support.harness import make_harness
from tests.support.media import voice_ogg
from tests.test_media_core import DownloadingChannel, transcription_endpoint
from tests.test_metrics import value

ANSWER = "The capital of France is Paris."


def metric(h, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return value(h.core.metrics.render().decode(), name, **labels)


async def test_a_transcription_tried_again_is_counted_as_a_retry(tmp_path, fake_openai):
    answers = [web.Response(status=503, text="busy"), web.json_response({"text": "spoken words"})]
    runner, base = await transcription_endpoint(lambda: answers.pop(0))
    transcriber = Transcriber(base, "whisper-1", "", retry_delays=(0.0,))
    h = await make_harness(tmp_path, fake_openai, start=False, transcriber=transcriber)
    channel = DownloadingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    try:
        channel.files["v"] = voice_ogg()
        await h.core.submit(channel.envelope("", media=(MediaItem(kind="voice", file_id="v"),)))
        await h.settle()
        assert "spoken words" in last_user_text(fake_openai.requests[0]) and answers == []
        assert metric(h, "chatbridge_transcription_retries_total") == 1
        assert metric(h, "chatbridge_model_retries_total") == 0  # the model was asked once
    finally:
        await h.core.shutdown()
        await runner.cleanup()


async def test_a_fallback_the_platform_refused_is_not_counted(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai, redelivery_delays=(3600.0,))  # no later try in this test
    try:
        h.channel.finish_fail = True  # the live delivery fails: a plain fallback follows
        h.channel.plain_fail = True  # and the platform refuses it
        await h.say("capital of France?")
        await h.settle()
        assert h.platform.plain("c1") == []
        assert metric(h, "chatbridge_fallbacks_total", channel="test") == 0
    finally:
        await h.core.shutdown()


async def test_a_fallback_is_counted_once_when_a_later_try_lands(tmp_path, fake_openai):
    fake_openai.script(Text(ANSWER))
    h = await make_harness(tmp_path, fake_openai, redelivery_delays=(0.0,))
    tries: list[str] = []
    send_plain = h.channel.send_plain

    async def refused_once(target: TurnTarget, text: str) -> None:
        tries.append(text)
        if len(tries) == 1:
            raise SinkError("Bad Gateway")
        await send_plain(target, text)

    h.channel.send_plain = refused_once  # type: ignore[method-assign]
    try:
        h.channel.finish_fail = True
        await h.say("capital of France?")
        await h.settle()
        await h.wait_for(lambda: metric(h, "chatbridge_fallbacks_total", channel="test") == 1)
        assert h.platform.plain("c1") == [ANSWER] and len(tries) == 2
    finally:
        await h.core.shutdown()
