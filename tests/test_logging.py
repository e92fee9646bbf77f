"""The log a chatbridge process writes: one line per turn, the turn id on every record logged inside it
(also from the tasks the turn spawns), and logging set up by `run` never outliving a test."""

from __future__ import annotations

import io
import logging
import re

from bridge.logs import configure_logging
from core.turn_log import TurnIdFilter
from tests.fakes.openai_server import Text
from tests.support.harness import API_KEY, make_harness


async def test_each_turn_logs_one_line_and_its_id_is_on_every_record_logged_for_it(tmp_path, fake_openai):
    out = io.StringIO()
    configure_logging("info", [API_KEY], stream=out)
    fake_openai.script(Text("first answer"), Text("second answer"))
    h = await make_harness(tmp_path, fake_openai)
    h.channel.finish_fail = True  # turn 1: the sink's final update fails, one plain fallback
    logging.getLogger("tests").warning("before any turn")
    await h.say("hi")
    await h.settle()
    h.channel.finish_fail = False
    await h.say("again")
    await h.settle()
    await h.core.shutdown()

    lines = out.getvalue().splitlines()
    turns = [m for line in lines if (m := re.search(r"core\.turn turn=(\w+): turn (\w+) in test:c1: (.+) after "
                                                     r"\d+\.\d\ds$", line))]
    assert [(m[1] == m[2], m[3]) for m in turns] == [(True, "completed"), (True, "completed")]
    first, second = turns[0][1], turns[1][2]
    assert first != second
    # logged by the sink's own task (spawned inside the turn) and by the executor: both carry the turn id
    sink_line = next(line for line in lines if "final delivery failed" in line)
    fallback_line = next(line for line in lines if "sending one plain fallback" in line)
    assert f"core.delivery turn={first}:" in sink_line and f"core.executor turn={first}:" in fallback_line
    assert not any(second in line for line in lines if "fallback" in line or "delivery failed" in line)
    assert re.search(r"tests: before any turn$", next(line for line in lines if "before any turn" in line))


def test_run_replaces_the_root_handlers_for_the_process():
    configure_logging("debug", ["s3cret"])  # what `chatbridge run` does; the next test must not see it
    assert any(isinstance(f, TurnIdFilter) for handler in logging.getLogger().handlers for f in handler.filters)


def test_logging_set_up_by_an_earlier_test_is_gone():
    root = logging.getLogger()
    assert not any(isinstance(f, TurnIdFilter) for handler in root.handlers for f in handler.filters)
    assert root.level != logging.DEBUG and logging.getLogger("httpx").level == logging.NOTSET
