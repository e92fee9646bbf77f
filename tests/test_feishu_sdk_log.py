"""What lark-oapi's own log lines become once the bridge made its Feishu channel: lines of the bridge's log (its
format, secrets masked), never printed raw to stdout by the handler lark-oapi brings along."""

from __future__ import annotations

import io
import logging
import re

from aiohttp import web
from lark_oapi.core.log import logger as lark_logger

from bridge.logs import configure_logging
from channels.feishu.factory import create
from channels.feishu.settings import FeishuConfig
from tests.support.harness import make_harness

SECRET = "feishu-app-secret-0123456789abcdef"


async def test_a_lark_oapi_line_with_a_secret_in_it_is_logged_masked_and_not_printed_raw(tmp_path, fake_openai):
    # lark-oapi's own handler prints to stdout: pointed at `raw` here, to read what it would have printed
    raw = io.StringIO()
    theirs = [h for h in logging.getLogger("Lark").handlers if isinstance(h, logging.StreamHandler)]
    streams = [h.setStream(raw) for h in theirs]
    out = io.StringIO()
    configure_logging("info", [SECRET], stream=out)  # what `chatbridge run` does
    h = await make_harness(tmp_path, fake_openai)
    try:
        create(FeishuConfig(app_id="cli_test", app_secret=SECRET), h.core.host_for("feishu"), web.Application())
        lark_logger.error(f"connect failed, err: the app secret {SECRET} was refused")
    finally:
        for handler, stream in zip(theirs, streams, strict=True):
            handler.setStream(stream)
        await h.core.shutdown()
    assert raw.getvalue() == ""
    assert SECRET not in out.getvalue()
    assert re.search(r"^\S+ \S+ ERROR Lark: connect failed, err: the app secret \*\*\* was refused$",
                     out.getvalue(), re.MULTILINE)
