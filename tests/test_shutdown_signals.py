"""SIGTERM / SIGINT against a real ``chatbridge run``: the shutdown starts no new turn (a queued message is
answered at the next start, never "stopped"), is bounded as a whole by ``shutdown_timeout`` (a platform that
does not answer while a channel stops cannot stretch it), a second signal forces the exit, and a signal
during start-up (MCP servers starting, ``core.start`` telling a chat through a platform that hangs) ends it.

Each waits on conditions; the only durations asserted are generous upper bounds, far above the expected
exit time and below what the bridge took before these fixes (10 s and more per hanging step)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from pathlib import Path

import aiohttp

from bridge.exit_codes import ExitCode
from tests.fakes.openai_server import FakeOpenAI, Function, Text, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.support.ports import free_port
from tests.support.process import BridgeProcess, telegram_config, wait_for

CHAT = 555
SECRET = "hookSECRET_0123456789abcdef"


def webhook_config(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, port: int,
                   shutdown_timeout: float) -> Path:
    return telegram_config(tmp_path, fake_openai.base_url, tg, shutdown_timeout=shutdown_timeout, port=port,
                           telegram=f"""mode = "webhook"
webhook_url = "https://bot.example.com/telegram/webhook"
webhook_secret = "{SECRET}"
""")


async def post_update(port: int, tg: FakeTelegram, text: str) -> int:
    update = tg.user_message(text, enqueue=False)
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/telegram/webhook", json=update,
                                                   headers={"X-Telegram-Bot-Api-Secret-Token": SECRET}) as r:
        return r.status


def webhook_up(port: int):
    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
                return r.status == 200 and (await r.json())["channels"]["telegram"] == "webhook"
        except aiohttp.ClientError:
            return False
    return up


def shown(tg: FakeTelegram) -> list[str]:
    return [m.text for m in tg.messages(CHAT) if not m.deleted]


async def test_messages_queued_at_sigterm_are_not_started_but_answered_at_the_next_start(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    """While the channels stop (here Telegram does not answer deleteWebhook), the running turn goes on, but
    the queued messages are not started (before, the worker started them and the shutdown then cut them
    with "Stopped": the user saw "Stopped" for a message he never stopped, and it was never answered)."""
    tg.drafts_supported = False
    holds = {"m0": asyncio.Event(), "m1": asyncio.Event()}

    def model(body):
        said = last_user_text(body).split("\n\n")[0]
        if said in holds:
            return Text(f"answer to {said} " + "word " * 20 + "END", chunk_size=6, delay=0.02,
                        hold=holds[said], hold_after=30)
        return Text(f"answer to {said}")

    fake_openai.default = Function(model)
    port = free_port()
    cfg = webhook_config(tmp_path, fake_openai, tg, port, shutdown_timeout=3)
    log = tmp_path / "bridge.log"
    b = await BridgeProcess(cfg, log).start()
    try:
        await wait_for(webhook_up(port), b)
        assert await post_update(port, tg, "m0") == 200
        await wait_for(lambda: any("answer to m0" in t for t in shown(tg)), b)
        assert await post_update(port, tg, "m1") == 200
        assert await post_update(port, tg, "m2") == 200
        tg.hold("deleteWebhook")  # the channel's stop hangs
        b.proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: "shutting down" in b.log(), b)
        holds["m0"].set()  # m0's answer ends while the channel is stopping: its worker must start nothing more
        await asyncio.wait_for(b.proc.wait(), 60)
    finally:
        await b.stop()
    asked = [last_user_text(r).split("\n\n")[0] for r in fake_openai.requests]
    assert "m1" not in asked and "m2" not in asked, f"a queued message was started at shutdown: {asked}"
    holds["m1"].set()
    tg.holds.clear()
    again = await BridgeProcess(cfg, log).start()
    try:
        await wait_for(lambda: sum("answer to m1" in t for t in shown(tg)) == 1
                       and sum("answer to m2" in t for t in shown(tg)) == 1, again, what="m1 and m2 answered")
    finally:
        await again.stop()
    texts = shown(tg)
    assert sum("answer to m1" in t for t in texts) == 1 and sum("answer to m2" in t for t in texts) == 1, texts
    assert not any("Stopped" in t and ("m1" in t or "m2" in t) for t in texts), texts


async def test_a_channel_that_hangs_while_stopping_cannot_stretch_the_shutdown(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    """One deadline for the whole shutdown: a channel stop that hangs is cut (and logged once) within
    shutdown_timeout; before, each channel stop had 10 s of its own, outside the budget."""
    port = free_port()
    cfg = webhook_config(tmp_path, fake_openai, tg, port, shutdown_timeout=1)
    b = await BridgeProcess(cfg, tmp_path / "bridge.log").start()
    try:
        await wait_for(webhook_up(port), b)
        release = tg.hold("deleteWebhook")
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(b.proc.wait(), 60)
        took = time.monotonic() - t0
    finally:
        tg.hold("deleteWebhook").set()
        await b.stop()
    del release
    assert code == 0
    # expected about 0.5 s (half of shutdown_timeout for the channels); before the fix 10 s and more
    assert took < 8, f"shutdown took {took:.1f}s with shutdown_timeout = 1"
    cut = [line for line in b.log().splitlines() if "cut short by the shutdown deadline" in line]
    assert len(cut) == 1 and "stopping channel telegram" in cut[0], cut


async def test_a_second_signal_forces_the_exit(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    """The orderly shutdown waits for a hanging channel stop (shutdown_timeout = 60 leaves it 30 s); a second
    SIGINT forces the exit at once, with its own exit status."""
    port = free_port()
    cfg = webhook_config(tmp_path, fake_openai, tg, port, shutdown_timeout=60)
    b = await BridgeProcess(cfg, tmp_path / "bridge.log").start()
    try:
        await wait_for(webhook_up(port), b)
        tg.hold("deleteWebhook")
        b.proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: tg.count("deleteWebhook") > 0, b, what="the channel stopping")
        b.proc.send_signal(signal.SIGINT)
        try:
            code = await asyncio.wait_for(b.proc.wait(), 8)  # before the fix: the full 10 s channel stop
        except TimeoutError:
            code = None
    finally:
        tg.hold("deleteWebhook").set()
        await b.stop()
    assert code == ExitCode.FORCED, f"exit status {code}; log:\n{b.log()[-2000:]}"
    assert "forced exit" in b.log()


MCP_MARK = "chatbridge_shutdown_test_mcp"
STUBBORN = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
"""An MCP server that ignores SIGTERM and the end of its input, and never answers."""


def marked_processes(mark: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if mark.encode() in cmd:
                found.append(int(d))
    return found


async def test_sigterm_while_mcp_servers_start_stops_cleanly_and_leaves_no_server(
        tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    """The signal handlers are in place before the MCP servers start: before, a SIGTERM then killed the
    bridge by the default action (status -15) and left a server that ignores SIGTERM running."""
    mark = f"{MCP_MARK}_{secrets.token_hex(4)}"
    cfg = tmp_path / "chatbridge.toml"
    cfg.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
shutdown_timeout = 1
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
api_key = "sk-test"
[web]
port = {free_port()}
[[agent.mcp_servers]]
name = "stubborn"
command = "/bin/sh"
args = ["-c", "trap '' TERM HUP INT; exec python3 -c '{STUBBORN}' {mark}"]
startup_timeout_seconds = 60
""")
    b = await BridgeProcess(cfg, tmp_path / "bridge.log").start()
    try:
        await wait_for(lambda: marked_processes(mark), b, what="the MCP server started")
        b.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(b.proc.wait(), 30)
        await wait_for(lambda: not marked_processes(mark), b, timeout=5, what="no MCP server left")
    finally:
        await b.stop()
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
    assert code == 0, f"exit status {code}"


async def test_sigterm_while_start_up_waits_on_the_platform_ends_it(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    """core.start tells the chat of an interrupted turn through Telegram, which does not answer: a SIGTERM
    then ends start-up (before, the process ran on until the platform call gave up, 50 s later)."""
    tg.drafts_supported = False
    hold = asyncio.Event()
    fake_openai.script(Text("A slow answer " + "word " * 30, chunk_size=6, delay=0.02, hold=hold, hold_after=40))
    cfg = telegram_config(tmp_path, fake_openai.base_url, tg, shutdown_timeout=1)
    log = tmp_path / "bridge.log"
    b = await BridgeProcess(cfg, log).start()
    try:
        tg.user_message("hello")
        await wait_for(lambda: any("word" in t for t in shown(tg)), b)
        await b.kill()
    finally:
        await b.stop()
    hold.set()
    release = tg.hold("sendMessage")  # the interrupted notice at start-up hangs
    n = tg.count("sendMessage")
    again = await BridgeProcess(cfg, log).start()
    try:
        await wait_for(lambda: tg.count("sendMessage") > n, again, what="start-up telling the chat")
        again.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(again.proc.wait(), 10)  # expected about 1 s; before: 50 s
        except TimeoutError:
            code = None
    finally:
        release.set()
        await again.stop()
    assert code == 0, f"exit status {code} (None: still running 10 s after SIGTERM)"
    assert "start-up cut short" in again.log()
