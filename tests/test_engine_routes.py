"""vLLM routes whose ids need more than a header, and the end of a stream, against a small
engine app written for these cases (a real aiohttp server on 127.0.0.1), through the
production wiring.

- ``/v1/responses``: vLLM ignores ``X-Request-Id`` there and takes the body's ``request_id``, so
  the sidecar overwrites that field with ``resp_<sidecar id>``; an abort names
  ``resp_<sidecar id>_0``. A client's own ``request_id`` is never what the engine uses.
- ``data: [DONE]`` is the end of an OpenAI stream: a client that closes the moment it reads it,
  before the engine's final chunk arrived, is not a disconnect and costs no abort.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio
from aiohttp import web

from sidecar.server import Servers
from tests.conftest import sidecar_settings

ABORT_PATH = "/inference/v1/abort_requests"


class RouteEngine:
    """Records bodies and aborts; ``/v1/responses`` streams until told to stop; ``/done_hold``
    streams ``[DONE]`` and then holds back the end of the chunked body until released. An abort
    ends nothing here, so the sidecars in front run with ``confirm=False`` (closed at once)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.aborts: list[list[str]] = []
        self.aborted = asyncio.Event()
        self.received = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/chat/completions", self.done_hold)
        app.router.add_post(ABORT_PATH, self.abort)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def responses(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.received.set()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b'data: {"type":"response.output_text.delta"}\n\n')
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.closed.set()
            raise

    async def done_hold(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await self.release.wait()  # the final chunk comes later than the client's close
        await response.write_eof()
        return response

    async def abort(self, request: web.Request) -> web.Response:
        self.aborts.append((await request.json())["request_ids"])
        self.aborted.set()
        return web.Response()


@pytest_asyncio.fixture
async def route_engine() -> AsyncIterator[RouteEngine]:
    engine = RouteEngine()
    await engine.start()
    yield engine
    engine.release.set()
    await engine.runner.cleanup()


async def _post(port: int, path: str, body: bytes, extra: str = ""
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
    await writer.drain()
    return reader, writer


def _sidecar_id(head: bytes) -> str:
    for line in head.decode("latin-1").split("\r\n"):
        name, _, value = line.partition(":")
        if name.lower() == "x-request-id":
            return value.strip()
    raise AssertionError(f"no X-Request-Id in response head {head!r}")


async def test_responses_body_request_id_is_overwritten_and_aborted(
        route_engine: RouteEngine, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sidecar_settings(route_engine.url, confirm=False))
    body = json.dumps({"model": "m", "input": "héllo ☃", "stream": True,
                       "request_id": "resp_someone-elses-id"}).encode()
    reader, writer = await _post(sidecar.proxy_port, "/v1/responses", body,
                                 "X-Request-Id: chosen-by-client\r\n")
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readuntil(b"data:")
    sid = _sidecar_id(head)
    sent = route_engine.bodies[0]
    assert sent["request_id"] == f"resp_{sid}", (
        f"expected the body's request_id replaced by resp_{sid}, engine got {sent['request_id']!r}")
    assert sent["input"] == "héllo ☃" and sent["model"] == "m", f"other fields changed: {sent}"
    writer.transport.abort()
    async with asyncio.timeout(2):
        await route_engine.aborted.wait()
        await route_engine.closed.wait()
    assert route_engine.aborts == [[f"resp_{sid}_0"]], (
        f"expected one abort naming resp_{sid}_0, got {route_engine.aborts}")


async def test_responses_body_that_is_not_json_passes_unchanged(
        route_engine: RouteEngine, start_sidecar: Callable[..., Any]) -> None:
    """The engine rejects such a body itself; the sidecar must not fail or alter it."""
    sidecar: Servers = await start_sidecar(sidecar_settings(route_engine.url, confirm=False))
    reader, writer = await _post(sidecar.proxy_port, "/v1/responses", b"{not json")
    async with asyncio.timeout(5):
        status = (await reader.readuntil(b"\r\n")).split()[1]
    writer.close()
    await writer.wait_closed()
    # The route engine's json() fails on it: aiohttp answers 500; what matters is that the
    # body reached the engine unchanged and the sidecar relayed the engine's own status.
    assert status == b"500", f"expected the engine's own error status relayed, got {status!r}"


async def test_close_right_after_done_event_is_not_a_disconnect(
        route_engine: RouteEngine, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sidecar_settings(route_engine.url, confirm=False))
    body = json.dumps({"messages": [], "stream": True}).encode()
    for _ in range(3):
        reader, writer = await _post(sidecar.proxy_port, "/v1/chat/completions", body)
        async with asyncio.timeout(5):
            await reader.readuntil(b"data: [DONE]\n\n")
        writer.transport.abort()  # gone before the engine's final chunk
    # An abort would be sent within milliseconds of the close; allow far more than that.
    try:
        async with asyncio.timeout(1.0):
            await route_engine.aborted.wait()
    except TimeoutError:
        pass
    assert route_engine.aborts == [], (
        f"expected no abort for streams that reached [DONE], got {route_engine.aborts}")
