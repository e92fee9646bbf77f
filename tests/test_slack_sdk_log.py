"""What the Slack SDK's failures leave in the operator's log: slack_sdk's Socket Mode client logs a failed
listener with its traceback; an acknowledgement that met a closing connection (the socket dropped while it
was on its way: Slack delivers the envelope again) is one warning line instead."""

from __future__ import annotations

import io
import logging

import aiohttp
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest

from channels.slack.sdk_log import sdk_logger

ENVELOPE = {"type": "events_api", "envelope_id": "env-1", "accepts_response_payload": False,
            "payload": {"type": "event_callback", "event": {"type": "message", "text": "hi"}}}


async def logged_by_a_failing_listener(error: Exception) -> str:
    """Run the SDK's own listener loop with a listener raising ``error``; what the log shows."""
    logger = sdk_logger()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    client = SocketModeClient(app_token="xapp-test", logger=logger)

    async def listener(_client: SocketModeClient, _request: SocketModeRequest) -> None:
        raise error

    client.socket_mode_request_listeners.append(listener)  # type: ignore[arg-type]
    try:
        await client.run_message_listeners(ENVELOPE, "{}")
    finally:
        logger.removeHandler(handler)
        await client.close()
    return out.getvalue()


async def test_an_acknowledgement_on_a_closing_connection_is_a_warning_without_a_traceback():
    shown = await logged_by_a_failing_listener(aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    assert shown.startswith("WARNING Failed to run a request listener: Cannot write to closing transport")
    assert "Traceback" not in shown


async def test_any_other_failure_keeps_its_traceback():
    shown = await logged_by_a_failing_listener(ValueError("a bug"))
    assert shown.startswith("ERROR Failed to run a request listener: a bug")
    assert "Traceback" in shown and "ValueError: a bug" in shown
