"""Benchmark: the memory one Feishu attachment download takes, streamed or through lark-oapi's ``aget``.

The fake Open API (tests/fakes/feishu) runs in a child process on 127.0.0.1 and serves one resource of
``--mb`` megabytes. It is read twice, measured with tracemalloc (peak Python allocations of this process
during the read):

- ``FeishuApi.open_resource``, the channel's path: streamed in 64 KiB chunks, each dropped once counted (as
  the media store writes it to disk);
- ``client.im.v1.message_resource.aget``, lark-oapi's typed call: the whole body in memory before it returns.

    python -m tests.bench.feishu_download_memory [--mb 30]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import lark_oapi as lark  # noqa: E402
from lark_oapi.api.im.v1 import GetMessageResourceRequest  # noqa: E402

from channels.feishu.api import FeishuApi  # noqa: E402
from tests.fakes.feishu import FakeFeishu  # noqa: E402

MB = 1_000_000


@dataclass(frozen=True)
class Served:
    app_id: str
    app_secret: str
    base_url: str


def serve(mb: int) -> None:
    """The child: the fake with one resource; prints where it is, then serves until stdin closes."""
    with FakeFeishu() as fake:
        msg = fake.user_message("oc_bench", msg_type="file", content={"file_key": "file_big"})
        fake.add_resource(msg, "file_big", bytes(mb * MB))
        print(json.dumps({"app_id": fake.app_id, "app_secret": fake.app_secret, "base_url": fake.base_url,
                          "message_id": msg.message_id}), flush=True)
        sys.stdin.read()


async def streamed(fake: Served, message_id: str) -> tuple[int, int]:
    api = FeishuApi(fake.app_id, fake.app_secret, fake.base_url)
    await api.token()
    async with aiohttp.ClientSession() as session:
        tracemalloc.start()
        chunks, first = await api.open_resource(session, message_id, "file_big", "file")
        total = len(first)
        async for chunk in chunks:
            total += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return total, peak


async def sdk(fake: Served, message_id: str) -> tuple[int, int]:
    client = (lark.Client.builder().app_id(fake.app_id).app_secret(fake.app_secret).domain(fake.base_url)
              .log_level(lark.LogLevel.ERROR).build())
    request = GetMessageResourceRequest.builder().message_id(message_id).file_key("file_big").type("file").build()
    await client.im.v1.message_resource.aget(request)  # the token fetch and imports, before measuring
    tracemalloc.start()
    response = await client.im.v1.message_resource.aget(request)
    total = len(response.file.read()) if response.file is not None else 0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return total, peak


async def measure(fake: Served, message_id: str) -> None:
    for name, run in (("streamed (FeishuApi.open_resource)", streamed), ("lark-oapi aget", sdk)):
        total, peak = await run(fake, message_id)
        print(f"{name:36} {total / MB:6.1f} MB read, peak {peak / MB:7.2f} MB allocated")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=30)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.mb)
        return
    child = subprocess.Popen([sys.executable, "-m", "tests.bench.feishu_download_memory", "--serve", "--mb",
                              str(args.mb)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        where = json.loads(child.stdout.readline())
        asyncio.run(measure(Served(where["app_id"], where["app_secret"], where["base_url"]), where["message_id"]))
    finally:
        child.communicate(timeout=30)  # closing its stdin ends it


if __name__ == "__main__":
    main()
