"""Benchmark: where the resident memory of ``chatbridge run`` goes before any chat, and what lark-oapi's HTTP
clients cost.

Three measurements, each in fresh processes, read from ``/proc/<pid>/status`` (``VmRSS``):

- **imports**: a Python process that imports only the named modules (what the product loads for each channel:
  ``bridge.app`` with core, the store and the ``openai`` SDK; each channel's module and its SDK);
- **idle product**: ``chatbridge run`` with the end-to-end benchmark's config for each platform, against that
  platform's fake (``tests.bench.e2e``), once its channel receives and 5 s have passed, before any message;
- **lark-oapi's per-request client**: lark-oapi builds a new ``httpx.AsyncClient()`` for every request
  (``lark_oapi.core.http.transport``), each with a TLS context of its own that loads the CA bundle again.
  This builds ``--clients`` (32: the Feishu channel's requests in flight) of them at once, as that many
  requests in flight hold them, and prints the RSS they add and the CPU one costs.

    python -m tests.bench.rss_shares [--platform web feishu ...] [--clients 32]

Prints figures; asserts nothing. (Peak RSS under load, 100 and 1,000 chats, is ``tests.bench.e2e``.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench.e2e import PLATFORMS, start_product  # noqa: E402
from tests.bench.streaming import start_child, stop_child  # noqa: E402

IMPORTS = {
    "nothing": [],
    "lark_oapi alone": ["lark_oapi"],
    "aiogram alone": ["aiogram"],
    "openai alone": ["openai"],
    "bridge.app": ["bridge.app"],
    "bridge.app + web channel": ["bridge.app", "channels.web.channel"],
    "bridge.app + Slack channel": ["bridge.app", "channels.slack.channel"],
    "bridge.app + Telegram channel": ["bridge.app", "channels.telegram.channel"],
    "bridge.app + Feishu channel": ["bridge.app", "channels.feishu.channel"],
}

RSS_SNIPPET = "import re; print(int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)))"

CLIENTS_SNIPPET = """
import asyncio, re, sys, time, httpx
def rss():
    return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))
async def main(n):
    async with httpx.AsyncClient():  # the first one: httpx's and ssl's own one-time set-up
        pass
    before, cpu = rss(), time.process_time()
    clients = [httpx.AsyncClient() for _ in range(n)]
    cpu = time.process_time() - cpu
    print(rss() - before, cpu / n)
    for client in clients:
        await client.aclose()
asyncio.run(main(int(sys.argv[1])))
"""


def kib(text: str) -> float:
    return int(text) / 1024


def imports() -> None:
    print("RSS of a process that imports only:")
    for name, modules in IMPORTS.items():
        code = "".join(f"import {m}; " for m in modules) + RSS_SNIPPET
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        print(f"  {name:32s} {kib(out.stdout):6.1f} MiB")


async def idle(platform: str) -> float:
    fake_proc, line = start_child("tests.bench.e2e", "--serve-platform", platform)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # no message is sent, so the model is never asked: an address nothing listens on will do
            bridge, _ = await start_product(platform, "http://127.0.0.1:9/v1", json.loads(line), Path(tmp))
            try:
                await asyncio.sleep(5)
                status = Path(f"/proc/{bridge.proc.pid}/status").read_text()
                return kib(status.split("VmRSS:")[1].split()[0])
            finally:
                await bridge.stop()
    finally:
        stop_child(fake_proc)


def clients(n: int) -> None:
    out = subprocess.run([sys.executable, "-c", CLIENTS_SNIPPET, str(n)], capture_output=True, text=True,
                         check=True)
    added, cpu = out.stdout.split()
    print(f"lark-oapi's per-request client (httpx.AsyncClient() and its TLS context), {n} at once: "
          f"+{kib(added):.1f} MiB RSS ({kib(added) * 1024 / n:.0f} KiB each), {1000 * float(cpu):.1f} ms CPU each")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--platform", nargs="+", choices=PLATFORMS, default=list(PLATFORMS))
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    imports()
    print("RSS of `chatbridge run`, idle (the benchmark's config, channel receiving, no message yet):")
    for platform in args.platform:
        print(f"  {platform:8s} {asyncio.run(idle(platform)):6.1f} MiB", flush=True)
    clients(args.clients)


if __name__ == "__main__":
    main()
