from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from sidecar.server import Servers
from tests.fakes.engine import FakeEngine


async def test_stream_passes_through(engine: FakeEngine, sidecar: Servers) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{sidecar.proxy_port}/v1/chat/completions?tokens=5",
                          json={"stream": True}) as r:
            body = await r.read()
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
    assert body.count(b"data:") == 6, body
    assert engine.record.generations[0].request_id == rid
    assert engine.record.aborts == []


async def test_disconnect_aborts(engine: FakeEngine, sidecar: Servers) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.proxy_port)
    body = json.dumps({"stream": True}).encode()
    writer.write(b"POST /v1/chat/completions?tokens=1000 HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()
    await reader.readuntil(b"data:")
    closed = time.monotonic()
    writer.transport.abort()
    rec = await engine.record.wait_abort(2.0)
    await asyncio.wait_for(engine.record.stopped_event.wait(), 2.0)
    gen = engine.record.generations[0]
    assert rec.ids == [f"chatcmpl-{gen.request_id}"]
    assert rec.authorization == "Bearer sekret-key"
    assert gen.stopped_at is not None and not gen.finished, gen
    print("abort after", (rec.at - closed) * 1000,
          "ms; engine stopped after", (gen.stopped_at - closed) * 1000)
