"""Memory per idle open stream: the sidecar's RSS with N streams open and silent, minus before.

``python -m tests.load.idle_memory [STREAMS]`` (default 1000): the fake engine
(:mod:`tests.harness.load.engine_process`) and the sidecar
(:mod:`tests.harness.load.sidecar_process`) each run in a process of their own. After a warm-up of
64 short streams (imports, first allocations), the sidecar's RSS is read; then STREAMS chat streams
are opened, each gets its response head and one event, and the engine stays silent (the next event
is an hour away). Printed: the RSS growth per open stream. Not a test (pytest does not collect it).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import psutil
import uvloop

from tests.harness import rawhttp
from tests.harness.cli_process import config_tree
from tests.harness.load.common import chat_request
from tests.harness.load.engine_process import engine_process
from tests.harness.load.sidecar_process import sidecar_process

CONNECT_AT_ONCE = 64
SETTLE_S = 1.0


async def _open(port: int, query: str, gate: asyncio.Semaphore, whole: bool
                ) -> asyncio.StreamWriter:
    async with gate:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head, body = chat_request(query, "idle")
        writer.write(head + body)
        response = await rawhttp.read_head(reader)
        assert response.status == 200, f"expected a 200 stream, got {response.status}"
        if whole:
            await rawhttp.read_body(reader, response, "POST")
        else:
            await reader.readuntil(b"\n\n")  # the first event
        return writer


async def main(streams: int) -> None:
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)
    with tempfile.TemporaryDirectory() as tmp:
        async with engine_process() as engine, \
                sidecar_process(Path(tmp), config_tree(engine.url)) as sidecar:
            proc = psutil.Process(sidecar.pid)
            warm = await asyncio.gather(*(_open(sidecar.proxy_port, "tokens=5&interval=0.001",
                                                gate, True) for _ in range(64)))
            for writer in warm:
                writer.close()
            await asyncio.sleep(SETTLE_S)
            before = proc.memory_info().rss
            writers = await asyncio.gather(*(_open(sidecar.proxy_port,
                                                   "tokens=2&interval=3600", gate, False)
                                             for _ in range(streams)))
            await asyncio.sleep(SETTLE_S)
            after = proc.memory_info().rss
            for writer in writers:
                writer.close()
    print(f"[idle] {streams} idle streams: sidecar RSS {before / 2**20:.1f} -> "
          f"{after / 2**20:.1f} MiB, {(after - before) / streams / 1024:.1f} KiB per stream")


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
