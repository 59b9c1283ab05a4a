"""A stop serves the requests that had already arrived (``sidecar.server.take_in_arrivals``).

The sidecar runs in this test's event loop, so a request written without yielding to the loop
is in the kernel but not yet read when ``Servers.stop()`` begins: the state of every request
that arrives while a busy sidecar (a disconnect storm) is told to stop. Without the take-in,
closing the listeners reset a connection still in the accept queue, and aiohttp's
``pre_shutdown()`` closed a kept-alive connection whose next request was not yet read: both
clients got no response (checked: both tests fail with ``take_in_arrivals`` skipped).
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from sidecar.server import Servers
from tests.fakes.engine import FakeEngine
from tests.harness import rawhttp

pytestmark = pytest.mark.timeout(30)

REQUEST = b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _read_all(sock: socket.socket) -> bytes:
    """Everything ``sock`` holds until the peer closes; blocking, with a guard timeout."""
    sock.settimeout(10)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        chunks.append(b"<reset>")
    return b"".join(chunks)


async def test_a_request_in_the_accept_queue_when_the_stop_begins_is_served(
        engine: FakeEngine, sidecar: Servers) -> None:
    # The kernel completes the handshake; the sidecar's loop has not run since.
    sock = socket.create_connection(("127.0.0.1", sidecar.proxy_port))
    try:
        sock.sendall(REQUEST)
        await sidecar.stop(grace_s=5.0)
        answer = await asyncio.to_thread(_read_all, sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200 "), (
        f"expected the request sent before the stop answered 200, got {answer[:80]!r}")
    assert len(engine.record.requests) == 1, "expected the request at the engine"


async def test_a_kept_alive_connections_unread_request_when_the_stop_begins_is_served(
        engine: FakeEngine, sidecar: Servers) -> None:
    async with rawhttp.connect(sidecar.proxy_port) as (reader, writer):
        writer.write(REQUEST.replace(b"Connection: close", b"Connection: keep-alive"))
        first = await asyncio.wait_for(
            rawhttp.read_body(reader, await rawhttp.read_head(reader)), 10)
        assert (first.status, first.ending) == (200, "complete"), first
        # The connection is idle, kept alive; the next request is written and, without a
        # loop turn in between, the stop begins.
        writer.write(REQUEST)
        await sidecar.stop(grace_s=5.0)
        answer = await asyncio.wait_for(reader.read(-1), 10)
    assert answer.startswith(b"HTTP/1.1 200 "), (
        f"expected the second request, unread when the stop began, answered 200, got "
        f"{answer[:80]!r}")
    assert len(engine.record.requests) == 2, "expected both requests at the engine"
