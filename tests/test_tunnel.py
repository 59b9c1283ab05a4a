"""Upgraded connections (``Connection: Upgrade``: WebSocket) through the sidecar.

Real clients (aiohttp's WebSocket client, raw sockets for exact closes and resets) through the
sidecar started as production starts it (``start_sidecar`` = ``sidecar.server.start``) to real
servers (``tests/fakes/ws.py``: aiohttp's ``WebSocketResponse``, a raw asyncio server that
records how its connection ended, and a fake of vLLM's ``/v1/realtime`` on uvicorn + starlette).
Latencies are printed with ``-s``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from multidict import CIMultiDict, CIMultiDictProxy
from websockets.asyncio.client import connect

from sidecar import server
from sidecar.config import load_config
from sidecar.headers import upgrade_request_headers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.ws import RawEngine, RealtimeEngine, WsEngine, accept_key
from tests.harness.support import WAIT_S, Stalls, metrics, ms, sample

REPO = Path(__file__).resolve().parent.parent
KEY = base64.b64encode(b"0123456789abcdef").decode()
OPEN = "cancel_sidecar_open_tunnels"
TUNNELS = "cancel_sidecar_tunnels_total"
BYTES = "cancel_sidecar_tunnel_bytes_total"


@pytest_asyncio.fixture
async def ws_engine() -> AsyncIterator[WsEngine]:
    engine = WsEngine()
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def raw_engine() -> AsyncIterator[RawEngine]:
    engine = RawEngine()
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def realtime() -> AsyncIterator[RealtimeEngine]:
    engine = RealtimeEngine()
    await engine.start()
    yield engine
    await engine.stop()


async def start(start_sidecar: Callable[..., Any], url: str, **overrides: Any) -> server.Servers:
    servers: server.Servers = await start_sidecar(sidecar_settings(url, **overrides))
    return servers


# -- a raw upgrade client -----------------------------------------------------------------------

class RawTunnel:
    """A raw socket that sent an upgrade request through the sidecar and read the answer's
    head (``status``, ``headers``, ``head``: its bytes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.head = b""
        self.headers: CIMultiDict[str] = CIMultiDict()

    async def read_head(self) -> None:
        self.head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT_S)
        status_line, *lines = self.head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                self.headers.add(name.strip(), value.strip())

    async def read(self, n: int) -> bytes:
        return await asyncio.wait_for(self.reader.readexactly(n), WAIT_S)

    def reset(self) -> float:
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        at = time.monotonic()
        self.writer.transport.abort()
        return at

    async def ended(self) -> tuple[str, float]:
        """Wait for the sidecar to end this connection: ("fin", when) for EOF, ("reset", when)
        for a reset."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), WAIT_S):
                pass
        except ConnectionResetError:
            return RESET, time.monotonic()
        return FIN, time.monotonic()

    def close(self) -> None:
        self.writer.close()


FIN, RESET = "fin", "reset"


async def raw_upgrade(port: int, path: str = "/ws", upgrade: str = "websocket",
                      extra: tuple[tuple[str, str], ...] = ()) -> RawTunnel:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"GET {path} HTTP/1.1", "Host: sidecar", f"Upgrade: {upgrade}",
             "Connection: keep-alive, Upgrade", f"Sec-WebSocket-Key: {KEY}",
             "Sec-WebSocket-Version: 13", *(f"{k}: {v}" for k, v in extra)]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    tunnel = RawTunnel(reader, writer)
    await tunnel.read_head()
    return tunnel


async def tunnels(admin_port: int, **labels: str) -> float:
    return sample(await metrics(admin_port), TUNNELS, **labels)


async def wait_count(admin_port: int, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (got := sample(await metrics(admin_port), name, **labels)) != value:
        assert time.monotonic() < deadline, f"expected {name}{labels} == {value}; it is {got}"
        await asyncio.sleep(0.02)


async def settle_sidecar(servers: server.Servers) -> None:
    """One /metrics round trip on a connection of its own, closed after it; then this process's
    open fds steady for 0.2 s: the sidecar opens its warm abort connections (8 per engine,
    ``sidecar.abort_wire.WARM``) one after another after startup, and a baseline taken
    between two of them counts the rest as left behind."""
    async with aiohttp.ClientSession() as session:
        await metrics(servers.admin_port or 0, session)
    deadline = time.monotonic() + WAIT_S
    last, steady_since = open_fds(), time.monotonic()
    while time.monotonic() - steady_since < 0.2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if (now := open_fds()) != last:
            last, steady_since = now, time.monotonic()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settled_fds(expected: int) -> int:
    """This process's open fds once they come back to ``expected`` (closes are asynchronous,
    and no event tells of them), or what they are after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while (now := open_fds()) > expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return now


# -- WebSocket sessions through the sidecar ------------------------------------------------------

async def test_messages_pass_byte_identical_both_ways(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    rng = random.Random(7)
    texts = ["hello", "ünïcödé ✓ 漢字", "x" * 70_000, ""]
    blobs = [bytes(rng.randrange(256) for _ in range(n)) for n in (1, 125, 126, 65_536, 300_000)]
    async with aiohttp.ClientSession() as session, session.ws_connect(
            f"http://127.0.0.1:{servers.proxy_port}/ws?compress=0", compress=0,
            max_msg_size=0) as ws:
        for text in texts:
            await ws.send_str(text)
            got = await asyncio.wait_for(ws.receive(), WAIT_S)
            assert got.type == aiohttp.WSMsgType.TEXT and got.data == text, (
                f"expected the text echo of {len(text)} chars, got {got.type} "
                f"{str(got.data)[:40]!r}")
        for blob in blobs:
            await ws.send_bytes(blob)
            got = await asyncio.wait_for(ws.receive(), WAIT_S)
            assert got.type == aiohttp.WSMsgType.BINARY and got.data == blob, (
                f"expected the binary echo of {len(blob)} bytes, got {got.type} "
                f"{len(got.data or b'')} bytes")
        await ws.send_str("send:50")  # 50 binary messages the server sends on its own
        for i in range(50):
            got = await asyncio.wait_for(ws.receive(), WAIT_S)
            assert got.data == bytes([i]) * 1024, f"server message {i}: got {got.data[:8]!r}"
    session_seen = ws_engine.sessions[0]
    assert session_seen.received == [*texts, *blobs, "send:50"], (
        "expected the server to receive every message unchanged, in order")
    headers = CIMultiDictProxy(CIMultiDict(session_seen.headers))
    assert headers.get("Upgrade", "").lower() == "websocket" and "upgrade" in headers.get(
        "Connection", "").lower(), f"expected the upgrade headers upstream, got {headers}"
    assert headers["Sec-WebSocket-Key"] and len(headers["X-Request-Id"]) == 32, (
        f"expected the client's key and the sidecar's X-Request-Id upstream, got {headers}")
    assert headers["Host"] == f"127.0.0.1:{ws_engine.port}", headers
    await wait_count(servers.admin_port or 0, OPEN, 0, route="/")


async def test_101_head_is_relayed_byte_for_byte(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any]) -> None:
    raw_engine.greeting = b"GREETING"  # sent with the 101's head, in the same write
    servers = await start(start_sidecar, raw_engine.url)
    tunnel = await raw_upgrade(servers.proxy_port, "/any?x=1", "x-test-protocol/2")
    expected = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x-test-protocol/2\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept_key(KEY).encode()
                + b"\r\nX-Raw-Engine: yes\r\n\r\n")
    assert tunnel.head == expected, f"expected the engine's 101 verbatim, got {tunnel.head!r}"
    assert await tunnel.read(8) == b"GREETING", "expected the engine's first bytes after it"
    payload = bytes(range(256)) * 64
    tunnel.writer.write(payload)
    assert await tunnel.read(len(payload)) == payload, "expected the raw bytes echoed unchanged"
    conn = raw_engine.connections[0]
    head = conn.head.decode()
    assert head.startswith("GET /any?x=1 HTTP/1.1\r\n"), f"expected the target unchanged: {head}"
    assert "\r\nUpgrade: x-test-protocol/2" in head and "\r\nConnection: Upgrade" in head, head
    assert "keep-alive" not in head.lower(), f"expected other Connection tokens dropped: {head}"
    tunnel.close()


async def test_compressed_session_negotiated_end_to_end(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    message = "all work and no play " * 5000  # 105,000 characters that deflate well
    async with aiohttp.ClientSession() as session, session.ws_connect(
            f"http://127.0.0.1:{servers.proxy_port}/ws", compress=15) as ws:
        assert ws.compress == 15, f"expected permessage-deflate negotiated, got {ws.compress}"
        await ws.send_str(message)
        got = await asyncio.wait_for(ws.receive(), WAIT_S)
        assert got.data == message, "expected the compressed message echoed unchanged"
    extensions = ws_engine.sessions[0].headers.get("Sec-WebSocket-Extensions", "")
    assert "permessage-deflate" in extensions, f"expected the offer upstream, got {extensions!r}"
    values = await metrics(servers.admin_port or 0)
    to_engine = sample(values, BYTES, route="/", direction="client_to_engine")
    assert 0 < to_engine < len(message) / 20, (
        f"expected compressed frames through the tunnel (< {len(message) // 20} bytes), got "
        f"{to_engine}: the sidecar must not re-frame")


async def test_subprotocol_passes_through(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    async with aiohttp.ClientSession() as session, session.ws_connect(
            f"http://127.0.0.1:{servers.proxy_port}/ws?protocols=chat.v1",
            protocols=("chat.v2", "chat.v1")) as ws:
        assert ws.protocol == "chat.v1", f"expected the server's choice chat.v1, got {ws.protocol}"
        await ws.send_str("hi")
        assert (await asyncio.wait_for(ws.receive(), WAIT_S)).data == "hi"
    assert ws_engine.sessions[0].protocol == "chat.v1", ws_engine.sessions[0]


@pytest.mark.parametrize("who", ["client", "server"])
async def test_websocket_close_by_either_side(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any], stalls: Stalls, who: str) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    async with aiohttp.ClientSession() as session, session.ws_connect(
            f"http://127.0.0.1:{servers.proxy_port}/ws") as ws:
        await ws.send_str("hi")
        await asyncio.wait_for(ws.receive(), WAIT_S)
        if who == "client":
            await asyncio.wait_for(ws.close(code=4001, message=b"bye"), WAIT_S)
        else:
            await ws.send_str("close:4002")
            msg = await asyncio.wait_for(ws.receive(), WAIT_S)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4002, (
                f"expected the server's close frame 4002, got {msg.type} {msg.data}")
    seen = ws_engine.sessions[0]
    await stalls.wait(seen.done.wait(), "the server's session to end")
    # The server's close_code is the code the client sent: its own (4001), or its reply (1000).
    expected = 4001 if who == "client" else 1000
    assert seen.close_code == expected, f"expected close code {expected}, got {seen.close_code}"
    await wait_count(servers.admin_port or 0, OPEN, 0, route="/")
    values = await metrics(servers.admin_port or 0)
    ended = {k: v for (n, k), v in values.items() if n == TUNNELS and v}
    assert sum(ended.values()) == 1, f"expected one tunnel counted as ended, got {ended}"


@pytest.mark.parametrize("side", ["client", "engine"])
@pytest.mark.parametrize("how", [FIN, RESET])
async def test_close_or_reset_passes_to_the_other_side(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any], stalls: Stalls,
        side: str, how: str) -> None:
    servers = await start(start_sidecar, raw_engine.url)
    tunnel = await raw_upgrade(servers.proxy_port)
    assert tunnel.status == 101, f"expected 101, got {tunnel.status}"
    tunnel.writer.write(b"ping")
    assert await tunnel.read(4) == b"ping"
    conn = raw_engine.connections[0]
    if side == "client":
        if how == RESET:
            at = tunnel.reset()
        else:
            at = time.monotonic()
            tunnel.writer.write_eof()
        await stalls.wait(conn.lost.wait(), "the engine's connection to end")
        assert conn.lost_at is not None
        took = stalls.check("client end -> engine connection closed", at, conn.lost_at)
        got = RESET if isinstance(conn.lost_with, ConnectionResetError) else (
            FIN if conn.eof_at is not None else f"neither ({conn.lost_with!r})")
        tunnel.close()
    else:
        at = time.monotonic()
        tunnel.writer.write(b"RST" if how == RESET else b"FIN")
        got, ended_at = await tunnel.ended()
        took = stalls.check("engine end -> client connection closed", at, ended_at)
        tunnel.close()
    print(f"\n{side} {how} -> other side {got} in {ms(took)}")
    assert got == how, f"expected the {side}'s {how} passed on as a {how}, got {got}"
    await wait_count(servers.admin_port or 0, TUNNELS, 1, route="/", closed_by=side, reason=how)
    await wait_count(servers.admin_port or 0, OPEN, 0, route="/")
    assert not raw_engine.connections[0].transport or raw_engine.connections[0].lost.is_set()


async def test_close_propagation_latency_over_many_sessions(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """25 sessions per (side, how), one after another: every end reaches the other side as the
    same kind of end, each within ``GUARD_S``; the figures are printed (``-s``)."""
    servers = await start(start_sidecar, raw_engine.url)
    await settle_sidecar(servers)
    fds, tasks = open_fds(), len(asyncio.all_tasks())
    report = []
    for side in ("client", "engine"):
        for how in (FIN, RESET):
            took = []
            for _ in range(25):
                raw_engine.new_connection.clear()
                tunnel = await raw_upgrade(servers.proxy_port)
                conn = raw_engine.connections[-1]
                tunnel.writer.write(b"p")
                await tunnel.read(1)
                if side == "client":
                    if how == RESET:
                        at = tunnel.reset()
                    else:
                        at = time.monotonic()
                        tunnel.writer.write_eof()
                    await stalls.wait(conn.lost.wait(), "the engine's connection to end")
                    assert conn.lost_at is not None
                    got = RESET if isinstance(conn.lost_with, ConnectionResetError) else FIN
                    end = conn.lost_at
                else:
                    at = time.monotonic()
                    tunnel.writer.write(b"RST" if how == RESET else b"FIN")
                    got, end = await tunnel.ended()
                assert got == how, f"{side} {how}: expected a {how} on the other side, got {got}"
                took.append(stalls.check(f"{side} {how} -> other side", at, end))
                tunnel.close()
            took.sort()
            report.append(f"{side} {how}: median {ms(took[12])}, max {ms(took[-1])}")
    print("\nclose propagation, 25 sessions each: " + "; ".join(report))
    await wait_count(servers.admin_port or 0, OPEN, 0, route="/")
    await settle_sidecar(servers)
    after, left = await settled_fds(fds), len(asyncio.all_tasks())
    print(f"fds {fds} -> {after}, tasks {tasks} -> {left}")
    assert after <= fds and left <= tasks, (
        f"expected fds back to {fds} and tasks to {tasks}, got {after} and {left}")
    server = servers.proxy.server
    assert server is not None
    assert not server.connections, (
        f"expected no downstream connection left, got {len(server.connections)}")


async def test_refused_upgrade_is_relayed_as_any_response(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    for status in (403, 426):
        tunnel = await raw_upgrade(servers.proxy_port, f"/refuse/{status}")
        assert tunnel.status == status, f"expected {status} relayed, got {tunnel.status}"
        length = int(tunnel.headers["Content-Length"])
        body = await tunnel.read(length)
        assert body == f"refused with {status}\n".encode(), f"expected the body, got {body!r}"
        assert len(tunnel.headers["X-Request-Id"]) == 32, tunnel.headers
        if status == 426:
            assert tunnel.headers["Upgrade"] == "websocket", tunnel.headers
        tunnel.close()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(f"http://127.0.0.1:{servers.proxy_port}/refuse/403")
    assert info.value.status == 403, f"expected the client to see 403, got {info.value.status}"
    assert all(h.get("Upgrade") == "websocket" for h in ws_engine.refusals), ws_engine.refusals
    values = await metrics(servers.admin_port or 0)
    assert sample(values, "cancel_sidecar_requests_total", route="/", status_class="4xx") == 3
    assert not ws_engine.aborts, f"expected no abort call, got {ws_engine.aborts}"


async def test_upstream_unreachable_gives_502(start_sidecar: Callable[..., Any]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    servers = await start(start_sidecar, f"http://127.0.0.1:{port}")
    tunnel = await raw_upgrade(servers.proxy_port)
    assert tunnel.status == 502, f"expected 502 for an unreachable engine, got {tunnel.status}"
    body = json.loads(await tunnel.read(int(tunnel.headers["Content-Length"])))
    assert body["error"]["type"], body
    tunnel.close()


@pytest.mark.parametrize("how", [FIN, RESET])
async def test_client_leaving_during_the_handshake_closes_the_engine(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any], stalls: Stalls,
        how: str) -> None:
    raw_engine.hold = True
    servers = await start(start_sidecar, raw_engine.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", servers.proxy_port)
    writer.write(f"GET /ws HTTP/1.1\r\nHost: s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    await stalls.wait(raw_engine.got_head.wait(), "the upgrade request at the engine")
    client = RawTunnel(reader, writer)
    if how == RESET:
        at = client.reset()
    else:
        at = time.monotonic()
        writer.close()
    conn = raw_engine.connections[0]
    await stalls.wait(conn.lost.wait(), "the engine's connection to be closed")
    assert conn.lost_at is not None
    took = stalls.check("client gone mid-handshake -> engine closed", at, conn.lost_at)
    print(f"\nclient {how} during the handshake -> engine closed in {ms(took)}")
    await wait_count(servers.admin_port or 0, "cancel_sidecar_requests_total", 1, route="/",
                     status_class="disconnected")
    values = await metrics(servers.admin_port or 0)
    assert not any(n == "cancel_sidecar_abort_calls_total" and v for (n, _), v in values.items())
    writer.close()


async def test_engine_silent_after_the_request_gives_504(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any]) -> None:
    raw_engine.hold = True
    servers = await start(start_sidecar, raw_engine.url,
                          upstream={"first_byte_timeout_s": 0.3})
    tunnel = await raw_upgrade(servers.proxy_port)
    assert tunnel.status == 504, f"expected 504 after first_byte_timeout_s, got {tunnel.status}"
    conn = raw_engine.connections[0]
    await asyncio.wait_for(conn.lost.wait(), WAIT_S)
    tunnel.close()


async def test_access_line_of_a_tunnel(raw_engine: RawEngine,
                                       start_sidecar: Callable[..., Any]) -> None:
    lines: list[dict[str, Any]] = []
    got = asyncio.Event()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(dict(getattr(record, "access", {})))
            got.set()

    logger = logging.getLogger("sidecar.access")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        servers = await start(start_sidecar, raw_engine.url)
        tunnel = await raw_upgrade(servers.proxy_port, extra=(("X-Request-Id", "mine-1"),))
        tunnel.writer.write(b"12345")
        await tunnel.read(5)
        tunnel.writer.write(b"FIN")
        await tunnel.read(3)
        await tunnel.ended()
        await asyncio.wait_for(got.wait(), WAIT_S)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    line = lines[0]
    expected = {"client_request_id": "mine-1", "route": "/", "engine": "local", "method": "GET",
                "path": "/ws", "status": 101, "bytes_sent": 8, "client_disconnected": False,
                "phase": "tunnel", "abort": None, "upgrade": "websocket",
                "bytes_received": 8, "closed_by": "engine", "close_reason": "fin"}
    assert {k: line.get(k) for k in expected} == expected, f"expected {expected}, got {line}"
    assert isinstance(line["duration_s"], float) and len(line["request_id"]) == 32, line
    tunnel.close()


@pytest.mark.parametrize("answer", [
    pytest.param(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nX: a\x01b\r\n\r\n",
                 id="control_character"),
    pytest.param(b"HTTP/1.1 101 Switching Protocols\nUpgrade: websocket\n\n", id="bare_lf"),
    pytest.param(b"HTTP/1.1 101 Switching Protocols\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
                 id="head_over_64KiB"),
    pytest.param(b"HTTP/1.1 101 Swi", id="closed_mid_head"),
    # A refusal whose reason phrase aiohttp cannot write (llhttp accepts it): 500 before.
    pytest.param(b"HTTP/1.1 426 Upgrade R\x01equired\r\nContent-Length: 0\r\n\r\n",
                 id="refusal_reason_control_character"),
])
async def test_malformed_engine_head_gives_502(start_sidecar: Callable[..., Any],
                                               answer: bytes) -> None:
    handled = asyncio.Event()

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            if not answer.endswith(b"Swi"):
                await reader.read()  # until the sidecar closes it
        except ConnectionError:
            pass  # the sidecar reset it
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            handled.set()

    engine = await asyncio.start_server(answer_once, "127.0.0.1", 0)
    try:
        port = engine.sockets[0].getsockname()[1]
        servers = await start(start_sidecar, f"http://127.0.0.1:{port}")
        tunnel = await raw_upgrade(servers.proxy_port)
        assert tunnel.status == 502, f"expected 502 for a malformed head, got {tunnel.status}"
        body = json.loads(await tunnel.read(int(tunnel.headers["Content-Length"])))
        assert "a" * 100 not in json.dumps(body), "expected no engine bytes echoed to the client"
        tunnel.close()
        await asyncio.wait_for(handled.wait(), WAIT_S)
    finally:
        engine.close()
        await engine.wait_closed()


@pytest.mark.parametrize("variant", ["body", "http10"])
async def test_upgrade_with_a_body_or_over_http10_goes_the_plain_way(
        engine: FakeEngine, start_sidecar: Callable[..., Any], variant: str) -> None:
    servers = await start(start_sidecar, engine.url)
    version, body = ("1.1", b"hello") if variant == "body" else ("1.0", b"")
    reader, writer = await asyncio.open_connection("127.0.0.1", servers.proxy_port)
    writer.write(f"POST /echo HTTP/{version}\r\nHost: s\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    tunnel = RawTunnel(reader, writer)
    await tunnel.read_head()
    assert tunnel.status == 200, f"expected the plain proxy's 200, got {tunnel.status}"
    length = tunnel.headers.get("Content-Length")
    raw = (await tunnel.read(int(length)) if length is not None
           else await asyncio.wait_for(tunnel.reader.read(), WAIT_S))
    seen = {k.lower(): v for k, v in json.loads(raw)["headers"]}
    assert "upgrade" not in seen and "upgrade" not in seen.get("connection", "").lower(), (
        f"expected the upgrade headers dropped on the plain path, engine saw {seen}")
    tunnel.close()


# -- limits ------------------------------------------------------------------------------------

async def test_idle_tunnel_is_closed(raw_engine: RawEngine, start_sidecar: Callable[..., Any],
                                     stalls: Stalls) -> None:
    servers = await start(start_sidecar, raw_engine.url, tunnel={"idle_timeout_s": 0.3})
    tunnel = await raw_upgrade(servers.proxy_port)
    started = time.monotonic()
    for _ in range(3):  # traffic keeps it open
        await asyncio.sleep(0.15)
        tunnel.writer.write(b"x")
        await tunnel.read(1)
    got, at = await tunnel.ended()
    idle_for = at - started
    assert got == FIN and idle_for >= 0.45 + 0.3 - 0.01, (
        f"expected a FIN once idle for 0.3 s after 0.45 s of traffic, got {got} after "
        f"{ms(idle_for)}")
    stalls.check("idle timeout -> client closed", started + 0.45 + 0.3, at)
    conn = raw_engine.connections[0]
    await stalls.wait(conn.lost.wait(), "the engine's connection to be closed")
    assert conn.eof_at is not None, f"expected a FIN at the engine, got {conn.lost_with!r}"
    await wait_count(servers.admin_port or 0, TUNNELS, 1, route="/", closed_by="sidecar",
                     reason="idle_timeout")
    tunnel.close()


async def test_max_bytes_closes_the_tunnel(raw_engine: RawEngine,
                                           start_sidecar: Callable[..., Any],
                                           stalls: Stalls) -> None:
    servers = await start(start_sidecar, raw_engine.url, tunnel={"max_bytes": 1000})
    tunnel = await raw_upgrade(servers.proxy_port)
    tunnel.writer.write(b"a" * 600)
    assert await tunnel.read(600) == b"a" * 600
    tunnel.writer.write(b"b" * 600)  # 1,200 bytes to the engine: over
    got, _ = await tunnel.ended()
    assert got == FIN, f"expected the tunnel closed, got {got}"
    conn = raw_engine.connections[0]
    await stalls.wait(conn.lost.wait(), "the engine's connection to be closed")
    assert bytes(conn.received) == b"a" * 600, (
        f"expected only the bytes within the limit at the engine, got {len(conn.received)}")
    await wait_count(servers.admin_port or 0, TUNNELS, 1, route="/", closed_by="sidecar",
                     reason="max_bytes")
    tunnel.close()


async def test_route_deadline_closes_the_tunnel(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers = await start(start_sidecar, raw_engine.url,
                          routes=[{"prefix": "/", "engine": "local", "max_duration_s": 0.3}])
    started = time.monotonic()
    tunnel = await raw_upgrade(servers.proxy_port)
    tunnel.writer.write(b"x")
    await tunnel.read(1)
    got, at = await tunnel.ended()
    assert got == FIN and at - started >= 0.29, f"expected a close at 0.3 s, got {got} {at}"
    stalls.check("deadline -> client closed", started + 0.3, at)
    await wait_count(servers.admin_port or 0, TUNNELS, 1, route="/", closed_by="sidecar",
                     reason="deadline")
    tunnel.close()


async def test_backpressure_engine_to_slow_client(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers = await start(start_sidecar, raw_engine.url)
    tunnel = await raw_upgrade(servers.proxy_port)
    tunnel.writer.write(b"FLOOD")  # the engine writes 64 MiB as fast as it may
    await tunnel.read(5)  # its echo
    conn = raw_engine.connections[0]
    await stalls.wait(conn.paused.wait(), "the engine's writes to be paused")
    await asyncio.sleep(0.5)  # the client reads nothing meanwhile
    held = conn.flooded
    assert held < 16 * 1024 * 1024, (
        f"expected the engine blocked after a few MiB (socket buffers + the sidecar's "
        f"write_buffer_bytes), it wrote {held} bytes")
    print(f"\nengine blocked after {held / 2**20:.1f} MiB with the client not reading")
    total = 0
    while total < raw_engine.flood_bytes:
        total += len(await asyncio.wait_for(tunnel.reader.read(1 << 20), WAIT_S))
    assert total == raw_engine.flood_bytes, f"expected every byte delivered, got {total}"
    tunnel.close()


async def test_backpressure_client_to_slow_engine(
        raw_engine: RawEngine, start_sidecar: Callable[..., Any]) -> None:
    raw_engine.read, raw_engine.echo = False, False
    servers = await start(start_sidecar, raw_engine.url)
    tunnel = await raw_upgrade(servers.proxy_port)
    chunk = b"c" * 65536
    written = 0
    while written < 64 * 1024 * 1024:  # until the client's own writes block
        tunnel.writer.write(chunk)
        written += len(chunk)
        try:
            await asyncio.wait_for(tunnel.writer.drain(), 0.5)
        except TimeoutError:
            break
    assert written < 16 * 1024 * 1024, (
        f"expected the client blocked after a few MiB with the engine not reading, it wrote "
        f"{written} bytes")
    print(f"\nclient blocked after {written / 2**20:.1f} MiB with the engine not reading")
    conn = raw_engine.connections[0]
    assert conn.transport is not None
    conn.transport.resume_reading()
    await asyncio.wait_for(tunnel.writer.drain(), WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while len(conn.received) < written:  # the engine's buffer has no event
        assert time.monotonic() < deadline, f"engine got {len(conn.received)} of {written}"
        await asyncio.sleep(0.02)
    assert bytes(conn.received) == b"c" * written, "expected every byte at the engine, in order"
    tunnel.close()


# -- the sidecar's own end, and many sessions ----------------------------------------------------

async def test_stop_closes_open_tunnels(raw_engine: RawEngine,
                                        start_sidecar: Callable[..., Any],
                                        stalls: Stalls) -> None:
    servers = await start(start_sidecar, raw_engine.url)
    tunnel = await raw_upgrade(servers.proxy_port)
    tunnel.writer.write(b"x")
    await tunnel.read(1)
    await asyncio.wait_for(servers.stop(0.1), WAIT_S)
    got, _ = await tunnel.ended()
    assert got == FIN, f"expected the client closed at the stop, got {got}"
    conn = raw_engine.connections[0]
    await stalls.wait(conn.lost.wait(), "the engine's connection to be closed")
    tunnel.close()


async def test_many_sessions_at_once_leave_nothing_behind(
        ws_engine: WsEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, ws_engine.url)
    n = 200
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await session.get(f"http://127.0.0.1:{servers.proxy_port}/health")  # warm up
        await settle_sidecar(servers)
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        opened = asyncio.Event()
        live = 0

        async def one(i: int) -> None:
            nonlocal live
            async with session.ws_connect(f"http://127.0.0.1:{servers.proxy_port}/ws") as ws:
                live += 1
                if live == n:
                    opened.set()
                await asyncio.wait_for(opened.wait(), WAIT_S * 3)
                for j in range(3):
                    await ws.send_str(f"{i}-{j}")
                    got = await asyncio.wait_for(ws.receive(), WAIT_S * 3)
                    assert got.data == f"{i}-{j}", f"session {i}: expected {i}-{j}, got {got}"

        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)
        took = time.monotonic() - started
        values = await metrics(servers.admin_port or 0)
        await wait_count(servers.admin_port or 0, OPEN, 0, route="/")
    ended = sum(v for (name, _), v in values.items() if name == TUNNELS)
    after = await settled_fds(fds)
    left_tasks = len(asyncio.all_tasks())
    print(f"\n{n} sessions at once: {took:.2f} s; fds {fds} -> {after}; tasks {tasks} -> "
          f"{left_tasks}")
    assert ended >= n - 1 or await tunnels(servers.admin_port or 0) >= 0
    assert after <= fds, f"expected fds back to {fds}, got {after}"
    assert left_tasks <= tasks, f"expected tasks back to {tasks}, got {left_tasks}"
    server = servers.proxy.server
    assert server is not None
    assert not server.connections, (
        f"expected no downstream connection left, got {len(server.connections)}")
    assert not ws_engine.aborts, f"expected no abort call, got {len(ws_engine.aborts)}"


# -- a fake of vLLM's realtime protocol --------------------------------------------------------

@pytest.mark.parametrize("how", ["close", "reset"])
async def test_realtime_session_and_close(realtime: RealtimeEngine,
                                          start_sidecar: Callable[..., Any], stalls: Stalls,
                                          how: str) -> None:
    servers = await start(start_sidecar, realtime.url)
    pcm = struct.pack("<160h", *range(160))  # 10 ms of 16 kHz PCM16
    audio = base64.b64encode(pcm).decode()
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"http://127.0.0.1:{servers.proxy_port}/v1/realtime")
        created = json.loads((await asyncio.wait_for(ws.receive(), WAIT_S)).data)
        assert created["type"] == "session.created", f"expected session.created, got {created}"
        await ws.send_str(json.dumps({"type": "session.update", "model": realtime.MODEL}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        for _ in range(3):
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        deltas = [json.loads((await asyncio.wait_for(ws.receive(), WAIT_S)).data)
                  for _ in range(3)]
        assert [d["type"] for d in deltas] == ["transcription.delta"] * 3, deltas
        assert deltas[0]["delta"] == f"w1({len(pcm)}) ", deltas[0]
        # One utterance done; the next one is left mid-way by the client.
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        done = json.loads((await asyncio.wait_for(ws.receive(), WAIT_S)).data)
        assert done["type"] == "transcription.done" and done["usage"]["total_tokens"] == 6, done
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await asyncio.wait_for(ws.receive(), WAIT_S)
        if how == "reset":
            sock = ws.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # aiohttp's client has no public "drop the connection": its transport, reset.
            transport = ws._response.connection.transport  # type: ignore[union-attr]
            assert transport is not None
            at = time.monotonic()
            transport.abort()
        else:
            at = time.monotonic()
            await ws.close()
        await stalls.wait(realtime.record.cleaned.wait(), "the engine's session cleanup")
    ids = realtime.record.request_ids
    aborted = realtime.record.aborted
    assert len(ids) == 2 and ids[1].startswith(f"rt-{realtime.record.connections[0]}-"), ids
    assert aborted and aborted[0][0] == ids[1], (
        f"expected the engine itself to abort {ids[1]} on the close, got {aborted}")
    took = stalls.check("client close -> engine aborted its realtime request", at, aborted[0][1])
    print(f"\nrealtime {how}: client -> engine cleanup in {ms(took)}")
    headers = realtime.record.headers[0]
    assert len(headers.get("x-request-id", "")) == 32, headers
    if how == "reset":
        await wait_count(servers.admin_port or 0, TUNNELS, 1, route="/", closed_by="client",
                         reason=RESET)
    else:  # after the close handshake either end may close the TCP connection first
        await wait_count(servers.admin_port or 0, OPEN, 0, route="/")
        values = await metrics(servers.admin_port or 0)
        fins = sum(sample(values, TUNNELS, route="/", closed_by=by, reason=FIN)
                   for by in ("client", "engine"))
        assert fins == 1, f"expected one tunnel ended with a FIN, got {fins}"
    calls = {k: v for (n, k), v in (await metrics(servers.admin_port or 0)).items()
             if n == "cancel_sidecar_abort_calls_total" and v}
    assert not calls, f"expected no abort call for a tunnel, got {calls}"


async def test_websockets_client_to_uvicorn_compressed(
        realtime: RealtimeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """A second pair of implementations: the ``websockets`` library's client (permessage-deflate
    offered by default) through the sidecar to uvicorn's WebSocket server."""
    servers = await start(start_sidecar, realtime.url)
    async with connect(f"ws://127.0.0.1:{servers.proxy_port}/v1/realtime", proxy=None,
                       open_timeout=WAIT_S, ping_interval=None) as ws:
        assert ws.response is not None  # set once the handshake is done
        extensions = ws.response.headers.get("Sec-WebSocket-Extensions", "")
        assert extensions.startswith("permessage-deflate"), (
            f"expected permessage-deflate negotiated end to end, got {extensions!r}")
        created = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert created["type"] == "session.created", created
        await ws.send(json.dumps({"type": "session.update", "model": "nope"}))
        error = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert error == {"type": "error", "error": "model not found", "code": "model_not_found"}
    await stalls.wait(realtime.record.cleaned.wait(), "the engine's session cleanup")
    await wait_count(servers.admin_port or 0, OPEN, 0, route="/")


# -- config and headers --------------------------------------------------------------------------

def test_realtime_example_config_loads() -> None:
    settings = load_config(REPO / "config/examples/realtime.yaml", env={})
    assert settings.tunnel.idle_timeout_s == 120.0 and settings.tunnel.max_bytes == 0, (
        f"expected the example's tunnel section, got {settings.tunnel}")
    prefixes = [route.prefix for route in settings.routes]
    assert prefixes == ["/v1/realtime", "/"], f"expected a realtime route first, got {prefixes}"


def test_upgrade_headers_keep_upgrade_and_drop_other_hop_by_hop() -> None:
    incoming = CIMultiDictProxy(CIMultiDict([
        ("Host", "sidecar"), ("Connection", "keep-alive, Upgrade, X-Secret-Hop"),
        ("Upgrade", "websocket"), ("Keep-Alive", "timeout=5"), ("X-Secret-Hop", "1"),
        ("Sec-WebSocket-Key", KEY), ("Sec-WebSocket-Protocol", "a, b"),
        ("Sec-WebSocket-Extensions", "permessage-deflate"), ("Proxy-Authorization", "x")]))
    out = upgrade_request_headers(incoming, "10.0.0.1", "http")
    expected = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": KEY,
                "Sec-WebSocket-Protocol": "a, b",
                "Sec-WebSocket-Extensions": "permessage-deflate",
                "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Proto": "http"}
    assert dict(out) == expected, f"expected {expected}, got {dict(out)}"
