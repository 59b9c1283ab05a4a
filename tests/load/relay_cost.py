"""Relay cost per SSE event: the sidecar's CPU time per event relayed, for profiling the hot path.

``python -m tests.load.relay_cost [STREAMS] [TOKENS] [INTERVAL_S]`` (defaults 256, 200, 0.02):
the fake engine (:mod:`tests.harness.load.engine_process`) and the sidecar
(:mod:`tests.harness.load.sidecar_process`) each run in a process of their own; this process opens
STREAMS chat streams of TOKENS events, one every INTERVAL_S seconds, through the sidecar and reads
them to their end, checking each body byte for byte. Printed: the sidecar's CPU seconds (user +
system, psutil) from the first request to the last stream's end, per event relayed, and its RSS.
Not a test (pytest does not collect it); run it under ``flock /tmp/bench.lock`` when quoting.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import psutil
import uvloop

from tests.harness import rawhttp
from tests.harness.cli_process import config_tree
from tests.harness.load.common import chat_request, expected_stream
from tests.harness.load.engine_process import engine_process
from tests.harness.load.sidecar_process import sidecar_process

CONNECT_AT_ONCE = 64


async def _one(port: int, tokens: int, interval: float, gate: asyncio.Semaphore) -> None:
    async with gate:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head, body = chat_request(f"tokens={tokens}&interval={interval}", "relay")
        writer.write(head + body)
        response = await rawhttp.read_head(reader)
    sidecar_id = response.get("X-Request-Id")
    assert response.status == 200 and sidecar_id, f"expected a 200 stream, got {response.status}"
    whole = await rawhttp.read_body(reader, response, "POST")
    assert whole.body == expected_stream(sidecar_id, tokens), "stream not byte-identical"
    writer.close()


async def main(streams: int, tokens: int, interval: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with engine_process() as engine, \
                sidecar_process(Path(tmp), config_tree(engine.url)) as sidecar:
            proc = psutil.Process(sidecar.pid)
            rss_before = proc.memory_info().rss
            cpu_before = sum(proc.cpu_times()[:2])
            started = time.monotonic()
            gate = asyncio.Semaphore(CONNECT_AT_ONCE)
            await asyncio.gather(*(_one(sidecar.proxy_port, tokens, interval, gate)
                                   for _ in range(streams)))
            took = time.monotonic() - started
            cpu = sum(proc.cpu_times()[:2]) - cpu_before
            rss = proc.memory_info().rss
    events = streams * (tokens + 1)
    print(f"[relay] {streams} streams x {tokens + 1} events every {interval * 1000:.0f} ms: "
          f"{events} events in {took:.1f} s ({events / took:.0f}/s); sidecar CPU {cpu:.2f} s "
          f"= {cpu / events * 1e6:.1f} us per event ({cpu / took:.0%} of a CPU); RSS "
          f"{rss_before / 2**20:.1f} -> {rss / 2**20:.1f} MiB")


if __name__ == "__main__":
    args = [*map(float, sys.argv[1:4])]
    defaults = [256, 200, 0.02]
    streams, tokens, interval = (args + defaults[len(args):])
    uvloop.run(main(int(streams), int(tokens), interval))
