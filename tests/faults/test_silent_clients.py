"""Silent clients: ``downstream.idle_timeout_s`` closes a connection with no request in progress.

aiohttp's ``keepalive_timeout`` (``sidecar/server.py``) is armed when a connection is accepted and
after each response; when it fires on a connection still waiting for a complete request head,
the connection is closed. Here with 0.5 s: a client that sends nothing, half a request line, a
request line and some headers, or a head trickling in byte by byte, is closed after ~0.5 s and
nothing reaches the engine; a keep-alive connection idle after a response is closed too; a
request being handled (queued for longer than that, then streaming for longer) is never cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.runtime import describe_changes
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness import rawhttp

IDLE_S = 0.5
GUARD_S = 10.0  # generous: the machine is shared
ENGINE_URL = "http://127.0.0.1:8000"  # the reload tests compare configs; nothing is called


@pytest.fixture
async def idle_sidecar(engine: FakeEngine, start_sidecar: Callable[..., Any]) -> Servers:
    servers: Servers = await start_sidecar(
        sidecar_settings(engine.url, downstream={"idle_timeout_s": IDLE_S}))
    return servers


async def _closed_after(reader: asyncio.StreamReader, since: float) -> tuple[float, bytes]:
    """Seconds from ``since`` until the peer closed, and any bytes it sent before closing."""
    data = b""
    try:
        async with asyncio.timeout(GUARD_S):
            while chunk := await reader.read(65536):
                data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"expected the sidecar to close the connection within {GUARD_S} s "
                             f"(idle timeout {IDLE_S} s); it stayed open") from None
    return time.monotonic() - since, data


@pytest.mark.parametrize("sent", [
    b"",
    b"POST /v1/chat/com",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
], ids=["nothing", "half_a_request_line", "request_line_and_some_headers"])
async def test_silent_client_is_closed_after_the_idle_timeout(
        sent: bytes, engine: FakeEngine, idle_sidecar: Servers) -> None:
    async with rawhttp.connect(idle_sidecar.proxy_port) as (reader, writer):
        connected = time.monotonic()
        writer.write(sent)
        await writer.drain()
        elapsed, data = await _closed_after(reader, connected)
    assert data == b"", f"expected a close without a response, got {data[:200]!r}"
    assert IDLE_S * 0.9 <= elapsed < GUARD_S, (
        f"expected the connection closed ~{IDLE_S} s after connecting, it took {elapsed:.2f} s")
    assert engine.watch.seen == [] and engine.record.aborts == [], (
        f"expected nothing at the engine, saw {engine.watch.seen} {engine.record.aborts}")


async def test_head_trickling_in_is_closed_after_the_idle_timeout(
        engine: FakeEngine, idle_sidecar: Servers) -> None:
    """Bytes arriving do not extend the timeout: only a complete head does."""
    head = rawhttp.request_bytes("GET", "/echo/slow", [("X-Pad", "p" * 200)])
    async with rawhttp.connect(idle_sidecar.proxy_port) as (reader, writer):
        connected = time.monotonic()

        async def trickle() -> None:
            for byte in head[:-1]:  # never the last byte: the head never completes
                writer.write(bytes([byte]))
                await asyncio.sleep(0.02)  # the pace of a slow client, not synchronisation

        sender = asyncio.get_running_loop().create_task(trickle(), name="trickle")
        try:
            elapsed, data = await _closed_after(reader, connected)
        finally:
            sender.cancel()
    assert data == b"" and IDLE_S * 0.9 <= elapsed < min(GUARD_S, len(head) * 0.02), (
        f"expected a close ~{IDLE_S} s after connecting while the head still trickled in, got "
        f"{elapsed:.2f} s and {data[:100]!r}")
    assert engine.watch.seen == [], f"expected nothing at the engine, saw {engine.watch.seen}"


async def test_idle_keep_alive_connection_is_closed_after_a_response(
        engine: FakeEngine, idle_sidecar: Servers) -> None:
    async with rawhttp.connect(idle_sidecar.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("GET", "/echo/keep"))
        async with asyncio.timeout(GUARD_S):
            response = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
        answered = time.monotonic()
        assert response.status == 200 and response.get("Connection") is None, response.headers
        elapsed, data = await _closed_after(reader, answered)
    assert data == b"" and IDLE_S * 0.9 <= elapsed < GUARD_S, (
        f"expected the idle connection closed ~{IDLE_S} s after the response, got "
        f"{elapsed:.2f} s and {data[:100]!r}")


async def test_admin_listener_closes_silent_clients_too(idle_sidecar: Servers) -> None:
    assert idle_sidecar.admin_port is not None
    async with rawhttp.connect(idle_sidecar.admin_port) as (reader, writer):
        connected = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        elapsed, data = await _closed_after(reader, connected)
    assert data == b"" and IDLE_S * 0.9 <= elapsed < GUARD_S, (
        f"expected the admin connection closed ~{IDLE_S} s after connecting, got {elapsed:.2f} s")


async def test_requests_longer_than_the_idle_timeout_are_never_cut(
        engine: FakeEngine, idle_sidecar: Servers) -> None:
    """Queued for 2x the idle timeout, then streaming for 4x: the whole stream arrives."""
    body = b'{"stream": true, "messages": []}'
    raw = rawhttp.request_bytes(
        "POST", f"/v1/chat/completions?first_byte_delay={2 * IDLE_S}&tokens=20&interval=0.1",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)
    started = time.monotonic()
    async with rawhttp.connect(idle_sidecar.proxy_port) as (reader, writer):
        writer.write(raw)
        async with asyncio.timeout(GUARD_S):
            response = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
        took = time.monotonic() - started
        # Still usable afterwards: a second request on the same connection.
        writer.write(rawhttp.request_bytes("GET", "/echo/again"))
        async with asyncio.timeout(GUARD_S):
            again = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    assert response.status == 200 and response.ending == "complete", (
        f"expected a complete stream, got {response.status} {response.ending}")
    assert response.body.count(b"data: ") == 21 and response.body.endswith(b"data: [DONE]\n\n"), (
        f"expected 20 events and [DONE], got {response.body[-200:]!r}")
    assert took >= 3 * IDLE_S, f"the stream was expected to last > {3 * IDLE_S} s, took {took:.2f}"
    assert again.status == 200, f"expected the connection reusable, got {again.status}"
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborts}"


def test_idle_timeout_change_needs_a_restart_other_downstream_keys_reload() -> None:
    """SIGHUP: ``downstream.idle_timeout_s`` is fixed per listener; the rest applies."""
    def config(**downstream: Any) -> Settings:
        return sidecar_settings(ENGINE_URL, downstream=downstream)

    applied, restart = describe_changes(config(), config(idle_timeout_s=10, body_timeout_s=5))
    assert restart == ["downstream.idle_timeout_s: 75.0 -> 10.0"], restart
    assert applied == ["downstream.body_timeout_s: 60.0 -> 5.0"], applied
    applied, restart = describe_changes(config(), config(idle_timeout_s=10))
    assert (applied, restart) == ([], ["downstream.idle_timeout_s: 75.0 -> 10.0"]), (
        f"an idle_timeout_s change alone applies nothing, got {applied}, {restart}")


def test_record_dir_change_needs_a_restart_grace_period_reloads(tmp_path: Path) -> None:
    """SIGHUP: the record of in-flight work stays where the process opened it at start (a
    reload logged it as applied and kept writing to the old directory); the grace applies."""
    def config(**lifecycle: Any) -> Settings:
        return sidecar_settings(ENGINE_URL,
                                lifecycle={"record_dir": str(tmp_path / "a"), **lifecycle})

    applied, restart = describe_changes(
        config(), config(record_dir=str(tmp_path / "b"), grace_period_s=3))
    assert restart == [f"lifecycle.record_dir: {tmp_path / 'a'} -> {tmp_path / 'b'}"], restart
    assert applied == ["lifecycle.grace_period_s: 30.0 -> 3.0"], applied
