"""No request, whatever way it ends, leaves an object of the sidecar's to the cyclic garbage
collector: each one is freed by reference counting once done (docs/semantics.md §2c, "No
request leaves a reference cycle").

The soak (``test_soak.py``) checks that for its clients' disconnects; this test runs the other
ways a request ends, each a few times, through a sidecar in its own process (production wiring,
:mod:`tests.harness.load.sidecar_process` with ``count_cycles``: the collector keeps what it
finds there, and the test reads it by type) in front of the fake engine of
:mod:`tests.fakes.engine`: a stream and a JSON answer read whole, a HEAD, the engine closing or
resetting the connection mid-stream, a first-byte timeout (504), the client's deadline ending a
stream, a body over ``max_body_bytes`` (413), an engine that refuses connections (502), a
request sent again after its pooled connection turned out stale, and a client reset mid-stream
(aborted).
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


class DroppingEngine:
    """A raw HTTP/1.1 engine that answers ``{}`` on a keep-alive connection, except that it
    closes the connection, unanswered, on every other request it reads: the sidecar's pooled
    connection is stale, and the request goes again on a fresh one (sidecar.upstream)."""

    OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self) -> None:
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                if self.requests % 2 == 0:
                    writer.close()
                    return
                writer.write(self.OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_each_way(port: int) -> dict[str, list[tuple[int, str]]]:
    """Every way, ``TIMES`` times; what each got: (status, how its body ended: ``[DONE]`` (the
    OpenAI end event last), ``whole`` (as framed, no end event) or ``cut`` (short of its
    framing))."""
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, list[tuple[int, str]]] = {}
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
            "first-byte timeout": ("POST", f"{CHAT}?first_byte_delay=3", stream, {}),
            "deadline mid-stream": ("POST", f"{CHAT}?tokens=200&interval=0.01", stream,
                                    {DEADLINE_HEADER: "0.1"}),
            "body over max_body_bytes": ("POST", f"{CHAT}?tokens=3", {"pad": "x" * 5000}, {}),
            "engine refusing connections": ("POST", f"/down{CHAT}", stream, {}),
            "sent again after a stale connection": ("POST", "/stale/x", {"messages": []}, {}),
        }
        for name, (method, path, body, headers) in ways.items():
            for _ in range(TIMES):
                async with session.request(method, base + path, json=body,
                                           headers=headers) as response:
                    try:
                        data = await response.read()
                        ending = "[DONE]" if data.endswith(b"data: [DONE]\n\n") else "whole"
                    except aiohttp.ClientPayloadError:
                        ending = "cut"  # the way under test: never a fabricated end
                    seen.setdefault(name, []).append((response.status, ending))
    for n in range(TIMES):  # a client reset mid-stream: aborted (checked at the engine)
        head, body = chat_request("tokens=200&interval=0.01", f"reset-{n}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        await asyncio.wait_for(reader.readuntil(b"data:"), GUARD_S)
        reset(writer)
        seen.setdefault("client RST mid-stream", []).append((200, "cut"))
    return seen


async def test_no_way_a_request_ends_leaves_a_reference_cycle(tmp_path: Path) -> None:
    engine, dropping = FakeEngine(), DroppingEngine()
    await engine.start()
    try:
        tree = config_tree(
            engine.url, upstream={"first_byte_timeout_s": 1.0},
            downstream={"max_body_bytes": 2000},
            engines={"local": {"kind": "vllm", "url": engine.url,
                               "abort": {"api_key": "cli-key", "timeout_s": 2.0}},
                     "down": {"kind": "openai", "url": f"http://127.0.0.1:{closed_port()}"},
                     "stale": {"kind": "openai", "url": await dropping.start()}},
            routes=[{"prefix": "/down", "engine": "down"}, {"prefix": "/stale", "engine": "stale"},
                    {"prefix": "/", "engine": "local"}])
        async with sidecar_process(tmp_path, tree, count_cycles=True) as sidecar:
            _, before = await sidecar.stats()
            seen = await run_each_way(sidecar.proxy_port)
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
        await dropping.stop()
    print(f"\n[cycles] per way: {seen}\n[cycles] left to the collector: {after}")
    # The deadline's stream ends as framed with an error event, never [DONE] (semantics §15).
    want = {"stream read whole": (200, "[DONE]"), "JSON read whole": (200, "whole"),
            "HEAD": (200, "whole"), "engine FIN mid-stream": (200, "cut"),
            "engine RST mid-stream": (200, "cut"), "first-byte timeout": (504, "whole"),
            "deadline mid-stream": (200, "whole"), "body over max_body_bytes": (413, "whole"),
            "engine refusing connections": (502, "whole"), "client RST mid-stream": (200, "cut"),
            "sent again after a stale connection": (200, "whole")}
    wrong = {way: got for way, got in seen.items() if got != [want[way]] * TIMES}
    assert not wrong, f"expected each way to end as {want}; these did not: {wrong}"
    assert dropping.requests >= 2 * TIMES - 1, (
        f"expected every other request to the dropping engine sent again; it read "
        f"{dropping.requests} for {TIMES}")
    # Stopped at the engine by an abort naming them: the client resets and the deadlines.
    aborted = [g for g in engine.record.generations if g.aborted_at is not None]
    assert len(aborted) >= 2 * TIMES, (
        f"expected the {TIMES} reset and {TIMES} deadline streams aborted at the engine; "
        f"{len(aborted)} were")
    assert not before and not after, (
        f"expected every object of the sidecar's freed by reference counting; the cyclic "
        f"collector found {after}")
