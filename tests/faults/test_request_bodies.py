"""Request bodies under the ``downstream`` limits: too large (413), too slow (408), and what
passes (exactly the limit, no limit, a slow but steady uploader).

A refused body never reached the engine whole, so nothing is ever aborted: either nothing went
upstream at all (a Content-Length over the limit, a ``/v1/responses`` body read whole first) or
the upstream request is closed mid-body. The client gets an OpenAI-style JSON error and its
connection is closed (the rest of its body is not read). Every refusal is counted in
``cancel_sidecar_downstream_errors_total{route,kind}`` and gets one access line.

The sidecar runs through :func:`sidecar.server.start` (the production wiring); clients are raw
sockets, so the body's framing and timing are exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine, Seen
from tests.harness import rawhttp
from tests.harness.support import disconnect_counts, metrics, no_event, samples, settle
from tests.test_proxy import assert_openai_error

pytestmark = pytest.mark.timeout(60)

GUARD_S = 5.0  # bound on any wait that should take milliseconds (or one short timeout)
LIMIT = 100_000  # downstream.max_body_bytes in these tests
RESPONSES = "/v1/responses"  # the route whose body the sidecar reads whole and rewrites

StartSidecar = Callable[..., Any]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def json_body(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes (>= 12)."""
    return b'{"pad": "' + b"p" * (size - 11) + b'"}'


async def response_and_close(reader: asyncio.StreamReader) -> tuple[rawhttp.RawResponse, str]:
    """One whole response, then how the connection ended after it: ``eof`` or ``reset``
    (``open`` if the sidecar kept it open for another :data:`GUARD_S` seconds)."""
    resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    try:
        async with asyncio.timeout(GUARD_S):
            rest = await reader.read()
    except TimeoutError:
        return resp, "open"
    except ConnectionResetError:
        return resp, "reset"
    assert rest == b"", f"bytes after the error response: {rest[:200]!r}"
    return resp, "eof"


def engine_requests(engine: FakeEngine) -> list[Seen]:
    """What reached the engine, without :func:`settle`'s health checks."""
    return [s for s in engine.watch.seen if s.path != "/health"]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [r.__dict__["access"] for r in caplog.records if r.name == "sidecar.access"]
    return [line for line in lines if line["path"] != "/health"]


async def assert_refused_and_counted(servers: Servers, engine: FakeEngine,
                                     caplog: pytest.LogCaptureFixture, status: int,
                                     kind: str) -> None:
    """No abort, no disconnect, one ``downstream_errors`` count and one access line."""
    assert await no_event(engine.record.abort_event), (
        f"expected no abort for a refused body, got {engine.record.aborted_ids()}")
    await settle(servers.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    values = await metrics(servers.admin_port or 0)
    errors = {(dict(k)["route"], dict(k)["kind"]): v for k, v in
              samples(values, "cancel_sidecar_downstream_errors_total").items()}
    assert errors == {("/", kind): 1}, f"expected one {kind} counted, got {errors}"
    assert disconnect_counts(values) == {}, (
        f"a refused body is not a disconnect, got {disconnect_counts(values)}")
    lines = access_lines(caplog)
    assert len(lines) == 1, f"expected one access line, got {lines}"
    line = lines[0]
    assert (line["status"], line["phase"], line["client_disconnected"], line["abort"]) == (
        status, "request_body", False, None), f"access line: {line}"


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.access")


# --- Too large ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/sink", RESPONSES])
async def test_content_length_over_the_limit_is_a_413_and_nothing_goes_upstream(
        path: str, engine: FakeEngine, start_sidecar: StartSidecar,
        caplog: pytest.LogCaptureFixture) -> None:
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"max_body_bytes": LIMIT}))
    body = json_body(LIMIT + 1)
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", path, [
            ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]))
        writer.write(body[:1000])  # the client starts sending; the rest is never read
        await writer.drain()
        resp, ending = await response_and_close(reader)
    assert_openai_error(resp.status, resp.body, 413, "request_too_large")
    assert resp.get("X-Request-Id"), f"expected the sidecar's X-Request-Id: {resp.headers}"
    assert ending in ("eof", "reset"), f"expected the connection closed after a 413, {ending}"
    await assert_refused_and_counted(servers, engine, caplog, 413, "BodyTooLarge")
    assert engine_requests(engine) == [], f"the engine saw {engine_requests(engine)}"


async def test_expect_100_continue_over_the_limit_gets_the_413_instead_of_100(
        engine: FakeEngine, start_sidecar: StartSidecar,
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that asks before sending is told 413 at once, never invited to send the body;
    one under the limit is still invited (100) and relayed."""
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"max_body_bytes": LIMIT}))
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [
            ("Content-Length", str(LIMIT + 1)), ("Expect", "100-continue")]))
        await writer.drain()
        resp, ending = await response_and_close(reader)  # no body sent: the first answer
    assert_openai_error(resp.status, resp.body, 413, "request_too_large")
    assert ending in ("eof", "reset"), f"expected the connection closed after a 413, {ending}"
    await assert_refused_and_counted(servers, engine, caplog, 413, "BodyTooLarge")
    assert engine_requests(engine) == [], f"the engine saw {engine_requests(engine)}"

    body = b"y" * LIMIT
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [
            ("Content-Length", str(len(body))), ("Expect", "100-continue")]))
        await writer.drain()
        interim = await rawhttp.read_head(reader)
        assert interim.status == 100, f"expected '100 Continue' under the limit, got {interim!r}"
        writer.write(body)
        ok = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    assert ok.status == 200 and json.loads(ok.body)["body_len"] == len(body), ok


async def test_unknown_expectation_is_a_json_417(engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S), rawhttp.connect(sidecar.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [
            ("Content-Length", "10"), ("Expect", "teapot")]))
        await writer.drain()
        resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    assert_openai_error(resp.status, resp.body, 417, "expectation_failed")
    assert engine_requests(engine) == [], f"the engine saw {engine_requests(engine)}"


# (path, upstream.replay_buffer_bytes): /sink relays as it reads; /v1/responses reads the body
# whole before anything goes upstream, or (a body over replay_buffer_bytes) relays the rest.
CROSSING = {
    "relayed": ("/sink", 8 * 1024 * 1024),
    "responses-read-whole": (RESPONSES, 8 * 1024 * 1024),
    "responses-relayed": (RESPONSES, 1000),
}


@pytest.mark.parametrize("case", list(CROSSING))
async def test_chunked_body_crossing_the_limit_is_a_413_and_closes_upstream(
        case: str, engine: FakeEngine, start_sidecar: StartSidecar,
        caplog: pytest.LogCaptureFixture) -> None:
    path, replay = CROSSING[case]
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"max_body_bytes": LIMIT},
        upstream={"replay_buffer_bytes": replay}))
    first, second = b'{"pad": "' + b"a" * 60_000, b"b" * 60_000 + b'"}'
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", path, [
            ("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]))
        writer.write(chunk(first))
        await writer.drain()
        if case != "responses-read-whole":  # the engine is reading the body when it crosses
            assert await engine.watch.until(lambda: bool(engine_requests(engine)), GUARD_S)
        writer.write(chunk(second))
        await writer.drain()
        resp, ending = await response_and_close(reader)
    assert_openai_error(resp.status, resp.body, 413, "request_too_large")
    assert ending in ("eof", "reset"), f"expected the connection closed after a 413, {ending}"
    seen = engine_requests(engine)
    if case == "responses-read-whole":
        assert seen == [], f"nothing should have gone upstream, the engine saw {seen}"
    else:
        assert len(seen) == 1 and seen[0].failed_at is not None, (
            f"expected the engine's body read to fail (upstream closed mid-body), saw {seen}")
        assert seen[0].body_bytes <= LIMIT, (
            f"the engine got {seen[0].body_bytes} body bytes, over the {LIMIT} limit")
    assert engine.record.generations == [], "the engine must never have parsed the request"
    await assert_refused_and_counted(servers, engine, caplog, 413, "BodyTooLarge")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_of_exactly_the_limit_passes(framing: str, engine: FakeEngine,
                                                  start_sidecar: StartSidecar) -> None:
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"max_body_bytes": LIMIT}))
    body = json_body(LIMIT)
    if framing == "chunked":
        head = [("Transfer-Encoding", "chunked")]
        data = chunk(body[:40_000]) + chunk(body[40_000:]) + b"0\r\n\r\n"
    else:
        head, data = [("Content-Length", str(len(body)))], body
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(servers.proxy_port,
                                      rawhttp.request_bytes("POST", "/sink", head, data))
    assert resp.status == 200, f"{framing}: a body of exactly the limit got {resp.status}"
    seen = json.loads(resp.body)
    assert (seen["body_len"], seen["sha256"]) == (len(body), hashlib.sha256(body).hexdigest()), (
        f"engine got {seen['body_len']} bytes (sha {seen['sha256']}), client sent {len(body)}")


@pytest.mark.parametrize("max_body_bytes", [None, 0], ids=["default-limit", "zero-no-limit"])
async def test_max_body_bytes_zero_means_no_limit(max_body_bytes: int | None,
                                                  engine: FakeEngine,
                                                  start_sidecar: StartSidecar) -> None:
    """A body announced at 100 GiB: the default limit (64 MiB) refuses it at once; with 0 it
    streams to the engine (the client then leaves mid-body)."""
    overrides: dict[str, Any] = (
        {} if max_body_bytes is None else {"downstream": {"max_body_bytes": 0}})
    servers = await start_sidecar(sidecar_settings(engine.url, **overrides))
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink",
                                           [("Content-Length", str(100 * 1024 ** 3))]))
        writer.write(b"x" * 65536)
        await writer.drain()
        if max_body_bytes is None:
            resp, _ = await response_and_close(reader)
            assert_openai_error(resp.status, resp.body, 413, "request_too_large")
            return
        await engine.sink_first_chunk.wait()
    assert engine_requests(engine)[0].content_length == 100 * 1024 ** 3


# --- Too slow ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", RESPONSES])
async def test_silent_mid_body_client_gets_a_408_and_upstream_is_closed(
        path: str, engine: FakeEngine, start_sidecar: StartSidecar,
        caplog: pytest.LogCaptureFixture) -> None:
    timeout_s = 0.5
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"body_timeout_s": timeout_s}))
    body = json.dumps({"messages": [], "stream": True, "pad": "p" * 20_000}).encode()
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", path, [
            ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]))
        writer.write(body[: len(body) // 2])
        await writer.drain()
        silent_from = time.monotonic()
        resp, ending = await response_and_close(reader)
        answered_after = time.monotonic() - silent_from
    assert_openai_error(resp.status, resp.body, 408, "request_timeout")
    assert ending in ("eof", "reset"), f"expected the connection closed after a 408, {ending}"
    assert timeout_s * 0.8 <= answered_after < GUARD_S, (
        f"expected the 408 about {timeout_s}s after the client fell silent, "
        f"got it after {answered_after:.2f}s")
    seen = engine_requests(engine)
    if path == RESPONSES:  # read whole before anything goes upstream
        assert seen == [], f"nothing should have gone upstream, the engine saw {seen}"
    else:
        assert len(seen) == 1 and seen[0].failed_at is not None, (
            f"expected the engine's body read to fail (upstream closed mid-body), saw {seen}")
        assert seen[0].body_bytes < len(body), f"engine got the whole body: {seen[0]}"
    assert engine.record.generations == [], "the engine must never have parsed the request"
    await assert_refused_and_counted(servers, engine, caplog, 408, "BodyTimeout")


async def test_slow_but_steady_uploader_is_never_cut(engine: FakeEngine,
                                                     start_sidecar: StartSidecar) -> None:
    """A chunk every body_timeout_s / 3 for 2 s: the timeout is per chunk, not for the body."""
    timeout_s, parts = 0.5, [b"%03d-" % i + b"z" * 1000 for i in range(12)]
    servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"body_timeout_s": timeout_s}))
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S * 2), rawhttp.connect(servers.proxy_port) as (reader,
                                                                                     writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [("Transfer-Encoding", "chunked")]))
        for part in parts:
            writer.write(chunk(part))
            await writer.drain()
            await asyncio.sleep(timeout_s / 3)  # the pace under test, not synchronisation
        writer.write(b"0\r\n\r\n")
        resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    took = time.monotonic() - started
    whole = b"".join(parts)
    assert resp.status == 200, f"a steady uploader was cut: {resp.status} {resp.body[:300]!r}"
    seen = json.loads(resp.body)
    assert (seen["body_len"], seen["sha256"]) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert took > 3 * timeout_s, f"the upload should outlast body_timeout_s, took {took:.2f}s"
