"""Requests that try to steer the sidecar: absolute-form targets, odd request targets, and the
engine's abort endpoints called through the proxy. Production wiring, fake engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.upstreams import RawUpstream
from tests.harness.support import metrics


async def _head_and_body(port: int, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` on a new connection: the response's head and its Content-Length body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
    finally:
        writer.close()
        await writer.wait_closed()
    return head, body


async def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    head, body = await _head_and_body(port, request)
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("target", [
    "http://evil.example:1/echo/abs?x=1",   # absolute-form naming another host and port
    "host://ignored/echo/abs?x=1",          # an odd scheme whose "host" could be glued on
    "http://127.0.0.1:1/echo/abs?x=1",      # a loopback port of the attacker's choosing
])
async def test_absolute_form_target_never_changes_the_upstream(
        target: str, engine: FakeEngine, sidecar: Servers) -> None:
    status, body = await _raw(sidecar.proxy_port,
                              f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                              .encode())
    assert status == 200, f"expected the engine's 200 for {target}, got {status}: {body[:200]!r}"
    seen = json.loads(body)
    assert seen["path_qs"] == "/echo/abs?x=1", (
        f"expected only the path and query to reach the configured engine, got {seen['path_qs']}")


@pytest.mark.parametrize("prefix", ["/", "/v1"])
async def test_asterisk_form_gets_a_json_400(engine: FakeEngine,
                                             start_sidecar: Callable[..., Any],
                                             prefix: str) -> None:
    """With a catch-all route and without one ("*" would match only the catch-all)."""
    sidecar = await start_sidecar(sidecar_settings(
        engine.url, routes=[{"prefix": prefix, "engine": "local"}]))
    status, body = await _raw(sidecar.proxy_port,
                              b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    # aiohttp's router answered 404 before the proxy saw the request; the proxy has no router
    # now (sidecar.app.proxy_handler) and answers the documented 400 itself.
    assert status == 400, f"expected a 400 for OPTIONS *, got {status}"
    assert json.loads(body)["error"]["message"] == "the request target must be a path", body
    assert engine.record.requests == [], "expected nothing forwarded to the engine"


@pytest.mark.parametrize("path", [
    "/inference/v1/abort_requests",      # vLLM's abort endpoint (the configured abort path)
    "/inference/v1/abort_requests/",
    "/inference/v1/abort%5Frequests",    # percent-encoded: the engine would decode it
    "/abort_requests",                   # vLLM dev mode: an empty list there aborts everything
])
async def test_clients_cannot_call_the_engine_abort_endpoint(
        path: str, engine: FakeEngine, sidecar: Servers) -> None:
    payload = b'{"request_ids": []}'
    status, body = await _raw(
        sidecar.proxy_port,
        f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert status == 403, f"expected 403 for POST {path}, got {status}: {body!r}"
    assert json.loads(body)["error"]["type"] == "forbidden", body
    assert engine.record.aborts == [], (
        f"expected no abort call to reach the engine, got {engine.record.aborts}")


async def test_large_response_header_passes_through(start_sidecar: Any) -> None:
    """An engine header of 20 KB (e.g. a long trace header) passes like a large request header
    does; aiohttp's client default (8190 bytes) would have made it a 502."""
    big = "t" * 20000
    upstream = RawUpstream(lambda _request: (
        f"HTTP/1.1 200 OK\r\nX-Trace: {big}\r\nContent-Length: 2\r\n\r\nok").encode())
    await upstream.start()
    try:
        servers: Servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        status, body = await _raw(servers.proxy_port,
                                  b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    finally:
        await upstream.stop()
    assert (status, body) == (200, b"ok"), f"expected the engine's 200 'ok', got {status} {body!r}"


async def test_listeners_default_to_loopback_only(engine: FakeEngine,
                                                   start_sidecar: Any) -> None:
    """A config naming no hosts listens on 127.0.0.1 only, the admin listener included."""
    settings = Settings.model_validate({
        "listen": {"port": 0}, "admin": {"port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine.url}},
        "routes": [{"prefix": "/", "engine": "local"}]})
    assert Settings.model_fields["admin"].default.host == "127.0.0.1", "admin default host"
    assert Settings.model_fields["listen"].default.host == "127.0.0.1", "listen default host"
    servers: Servers = await start_sidecar(settings)
    assert servers.admin is not None
    for name, runner in (("admin", servers.admin), ("proxy", servers.proxy)):
        hosts = [address[0] for address in runner.addresses]
        assert hosts == ["127.0.0.1"], f"expected {name} on 127.0.0.1 only, got {hosts}"


async def _raw_whole(port: int, request: bytes) -> bytes:
    """Everything the listener sends back for ``request`` until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(-1)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_engine_api_key_never_reaches_a_client(engine: FakeEngine,
                                                     sidecar: Servers) -> None:
    """The abort key (``sekret-key`` in tests/conftest.py) in no header or body of any answer:
    proxied, refused by the proxy, refused by aiohttp's parser, or from the admin listener
    (``/readyz`` makes a real abort call with the key)."""
    close = "Host: x\r\nConnection: close\r\n\r\n"
    body = b'{"request_ids": ["x"]}'
    proxy_requests = [
        f"GET /echo/key HTTP/1.1\r\n{close}".encode(),                        # proxied
        f"POST /inference/v1/abort_requests HTTP/1.1\r\nContent-Length: {len(body)}\r\n"
        f"{close}".encode() + body,                                            # 403
        f"OPTIONS * HTTP/1.1\r\n{close}".encode(),                             # 400
        b"GET /echo HTTP/1.1\r\nBad Header\r\n\r\n",                           # 400 (parser)
        f"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n{close}0\r\n\r\n"
        .encode(),                                                             # 501
    ]
    answers = [await _raw_whole(sidecar.proxy_port, raw) for raw in proxy_requests]
    assert sidecar.admin_port is not None
    for path in ("/healthz", "/readyz", "/metrics"):
        answers.append(await _raw_whole(sidecar.admin_port,
                                        f"GET {path} HTTP/1.1\r\n{close}".encode()))
    statuses = [int(answer.split(b" ", 2)[1]) for answer in answers]
    assert statuses == [200, 403, 400, 400, 501, 200, 200, 200], statuses
    assert engine.record.probes and engine.record.probes[-1].authorization == "Bearer sekret-key", (
        "expected /readyz to have made an abort call carrying the key")
    for raw, answer in zip(proxy_requests + [b"admin"] * 3, answers, strict=True):
        assert b"sekret-key" not in answer, f"the key reached a client answering {raw[:40]!r}"


@pytest.mark.parametrize("request_line", [b"GET /echo HTTP/2.0", b"GET /echo"],
                         ids=["http-2.0", "http-0.9"])
async def test_other_http_versions_get_a_json_505_in_http_1_1(
        request_line: bytes, engine: FakeEngine, sidecar: Servers) -> None:
    """llhttp parses these two (it refuses HTTP/1.2 itself); before, the request was proxied and
    answered with an ``HTTP/2.0 200 OK`` (or ``HTTP/0.9``) status line in HTTP/1.1 framing."""
    head, body = await _head_and_body(sidecar.proxy_port,
                                      request_line + b"\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 505 "), f"expected an HTTP/1.1 505, got {head!r}"
    assert b"connection: close" in head.lower(), head
    assert "HTTP/1.0 and HTTP/1.1" in json.loads(body)["error"]["message"], body
    assert engine.record.requests == [], "expected nothing forwarded to the engine"


async def test_requests_refused_by_the_proxy_have_one_access_line_and_are_counted(
        engine: FakeEngine, sidecar: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """A routed refusal (the abort path, a bad deadline header) names its route and counts in
    cancel_sidecar_requests_total; an unsupported Expect gets its access line (before: none)."""
    caplog.set_level(logging.INFO, logger="sidecar.access")
    refusals = [
        (b"POST /inference/v1/abort_requests HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
         403),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Sidecar-Deadline-S: soon\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n", 417),
    ]
    for request, status in refusals:
        got, _ = await _raw(sidecar.proxy_port, request.replace(
            b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
        assert got == status, f"expected {status}, got {got}"
    lines = [r.__dict__["access"] for r in caplog.records if r.name == "sidecar.access"]
    assert [line["status"] for line in lines] == [403, 400, 417], lines
    assert [line["route"] for line in lines] == ["/", "/", None], lines
    samples = await metrics(sidecar.admin_port or 0)
    counted = {(dict(labels)["route"], dict(labels)["status_class"]): value
               for (name, labels), value in samples.items()
               if name == "cancel_sidecar_requests_total" and value}
    assert counted == {("/", "4xx"): 2.0}, counted
