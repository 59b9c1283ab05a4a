"""No request, whatever way it ends, leaves an object of the sidecar's to the cyclic garbage
collector: each one is freed by reference counting once done (docs/semantics.md §2c, "No
request leaves a reference cycle").

The soak (``test_soak.py``) checks that for its clients' disconnects; this test runs the other
ways a request ends, each a few times, through a sidecar in its own process (production wiring,
:mod:`tests.harness.load.sidecar_process` with ``count_cycles``: the collector keeps what it
finds there, and the test reads it by type) in front of the fake engine of
:mod:`tests.fakes.engine`: a stream and a JSON answer read whole, a HEAD, the engine closing or
resetting the connection mid-stream, a first-byte timeout (504), the client's deadline ending a
stream, a body over ``max_body_bytes`` (413), an engine that refuses connections (502), and a
client reset mid-stream (aborted).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from sidecar.headers import DEADLINE_HEADER
from tests.fakes.engine import FakeEngine
from tests.harness.cli_process import config_tree
from tests.harness.load.common import CHAT, chat_request, reset
from tests.harness.load.sidecar_process import sidecar_process

pytestmark = [pytest.mark.load, pytest.mark.timeout(120)]

TIMES = 5  # each way a request ends
GUARD_S = 10.0


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_each_way(port: int, engine: FakeEngine) -> dict[str, list[int]]:
    """Every way, ``TIMES`` times; the statuses each got."""
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, list[int]] = {}
    stream = {"messages": [], "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=GUARD_S)) as session:
        ways = {
            "stream read whole": ("POST", f"{CHAT}?tokens=3&interval=0.001", stream, {}),
            "JSON read whole": ("POST", f"{CHAT}?tokens=3&interval=0.001",
                                {"messages": []}, {}),
            "HEAD": ("HEAD", "/echo/x", None, {}),
            "engine FIN mid-stream": ("POST", f"{CHAT}?tokens=5&interval=0.001&die_after=2"
                                      "&die=fin", stream, {}),
            "engine RST mid-stream": ("POST", f"{CHAT}?tokens=5&interval=0.001&die_after=2"
                                      "&die=rst", stream, {}),
            "first-byte timeout": ("POST", f"{CHAT}?first_byte_delay=2", stream, {}),
            "deadline mid-stream": ("POST", f"{CHAT}?tokens=200&interval=0.01", stream,
                                    {DEADLINE_HEADER: "0.1"}),
            "body over max_body_bytes": ("POST", f"{CHAT}?tokens=3", {"pad": "x" * 5000}, {}),
            "engine refusing connections": ("POST", f"/down{CHAT}", stream, {}),
        }
        for name, (method, path, body, headers) in ways.items():
            for _ in range(TIMES):
                async with session.request(method, base + path, json=body,
                                           headers=headers) as response:
                    try:
                        await response.read()
                    except aiohttp.ClientPayloadError:
                        pass  # cut short mid-stream: the way under test
                    seen.setdefault(name, []).append(response.status)
    for n in range(TIMES):  # a client reset mid-stream: aborted
        head, body = chat_request("tokens=200&interval=0.01", f"reset-{n}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        await asyncio.wait_for(reader.readuntil(b"data:"), GUARD_S)
        reset(writer)
        seen.setdefault("client RST mid-stream", []).append(200)
    return seen


async def test_no_way_a_request_ends_leaves_a_reference_cycle(tmp_path: Path) -> None:
    engine = FakeEngine()
    await engine.start()
    try:
        tree = config_tree(
            engine.url, upstream={"first_byte_timeout_s": 0.2},
            downstream={"max_body_bytes": 2000},
            engines={"local": {"kind": "vllm", "url": engine.url,
                               "abort": {"api_key": "cli-key", "timeout_s": 2.0}},
                     "down": {"kind": "openai", "url": f"http://127.0.0.1:{closed_port()}"}},
            routes=[{"prefix": "/down", "engine": "down"},
                    {"prefix": "/", "engine": "local"}])
        async with sidecar_process(tmp_path, tree, count_cycles=True) as sidecar:
            _, before = await sidecar.stats()
            seen = await run_each_way(sidecar.proxy_port, engine)
            # Until the engine has stopped every stream (aborts, deadlines) and the sidecar's
            # confirmations and teardowns are over: the engine's record says when.
            for _ in range(int(GUARD_S / 0.05)):
                if all(g.stopped_at is not None or g.finished for g in engine.record.generations):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the teardowns after the last stop
            _, after = await sidecar.stats()
    finally:
        await engine.stop()
    print(f"\n[cycles] statuses per way: {seen}\n[cycles] left to the collector: {after}")
    assert seen["stream read whole"] == [200] * TIMES
    assert seen["first-byte timeout"] == [504] * TIMES
    assert seen["body over max_body_bytes"] == [413] * TIMES
    assert seen["engine refusing connections"] == [502] * TIMES
    assert not before and not after, (
        f"expected every object of the sidecar's freed by reference counting; the cyclic "
        f"collector found {after}")
