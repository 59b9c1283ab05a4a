"""Upstream faults: what a client, the engine and the sidecar's upstream pool see when the engine
side fails, for every fault kind (docs/semantics.md section 4).

Kinds: refused, connect timeout, first-byte timeout (silent), malformed head, closed before the
head, death mid-stream by FIN and by RST, read timeout (silent mid-body), a ``Content-Length``
response cut short; and stale keep-alive connections (an upstream that closes idle ones).

Per kind: the client's view (an OpenAI-style 502/504 when nothing was sent yet, an abnormal end
when something was), whether the engine is aborted (once, exactly the request's ids, when the
sidecar gives up on a connection the engine still holds; never when the engine never got the
request or closed the connection itself), that a concurrent stream on another engine completes
byte-identical, and that the upstream connection is closed at the server side (never pooled).

Everything runs through the production wiring (``start_sidecar``/``sidecar`` fixtures) against
real servers on 127.0.0.1: :class:`tests.fakes.engine.FakeEngine`, raw upstreams from
:mod:`tests.fakes.upstreams`, and a real uvicorn server. Waits for something that has no event (a
connection closing at the server side) poll with a guard bound and say what they expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web

from sidecar.pool import Deadlines
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import ABORT_PATH, FakeEngine
from tests.fakes.upstreams import RawRequest, RawUpstream, refused_port
from tests.harness import rawhttp
from tests.harness.support import metrics, samples
from tests.test_proxy import (
    GUARD_S,
    StartSidecar,
    assert_openai_error,
    post_json,
    proxy_url,
    raw_upstream,
    sse_events,
)

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
QUIET_S = 0.3  # how long to wait for an abort that must NOT come, before a settling request
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(n: int) -> bytes:
    return b'data: {"choices":[{"text":"t%d"}]}\n\n' % n


def engine_like(response: bytes | None) -> Callable[[RawRequest], bytes | None]:
    """A raw upstream's responder: abort calls get 200, ``GET /health`` gets 200 ``ok`` (for
    :func:`settle`); every other request gets ``response`` (``None``: never answered)."""

    def respond(request: RawRequest) -> bytes | None:
        if is_abort(request):
            return b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        if request.head.startswith(b"GET /health "):
            return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        return response

    return respond


def is_abort(request: RawRequest) -> bool:
    return request.head.startswith(f"POST {ABORT_PATH} ".encode())


def abort_ids(upstream: RawUpstream) -> list[list[str]]:
    """The id list of every abort call the raw upstream received, in order."""
    return [json.loads(r.body)["request_ids"] for r in upstream.requests if is_abort(r)]


def generating_connections_open(upstream: RawUpstream) -> set[int]:
    """Connections that carried a proxied (non-abort) request and are still open."""
    return {r.connection for r in upstream.requests if not is_abort(r)} & upstream.open


async def until(predicate: Callable[[], bool], what: str, within_s: float = GUARD_S) -> float:
    """Poll ``predicate`` (no event exists for it) until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"expected {what} within {within_s}s; it did not happen")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def settle(servers: Servers) -> None:
    """A complete request through the sidecar: an abort call started before it (in its own task)
    has had a full round trip's time to arrive."""
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy_url(servers, "/health")) as resp:
            assert resp.status == 200, f"settle: expected 200 from /health, got {resp.status}"


@contextlib.contextmanager
def unconnectable_port() -> Iterator[int]:
    """A port whose listener has a full accept queue: further SYNs are dropped, so connecting
    hangs until the connect timeout."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield int(listener.getsockname()[1])


# --- Upstream connection pooling ---------------------------------------------------------------

async def get_peer(session: aiohttp.ClientSession, servers: Servers) -> int:
    async with session.get(proxy_url(servers, "/peer")) as resp:
        assert resp.status == 200, f"/peer: expected 200, got {resp.status}"
        return int((await resp.json())["peer"])


async def test_upstream_connection_reused_but_not_after_a_cut_short_response(
        engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
        before = [await get_peer(session, sidecar) for _ in range(5)]
        assert len(set(before)) == 1, f"sequential requests should share one upstream "\
            f"connection, engine saw client ports {before}"

        async with rawhttp.connect(sidecar.proxy_port) as (reader, writer):
            writer.write(rawhttp.request_bytes("GET", "/peer_stream?tokens=10000&interval=0.01"))
            head = await rawhttp.read_head(reader)
            await reader.readuntil(b"\n\n")
            cut = int(head.get("X-Upstream-Peer") or 0)
            writer.transport.abort()
        await engine.peer_stream_closed.wait()

        after = [await get_peer(session, sidecar) for _ in range(5)]
    assert cut not in after, (
        f"the connection (port {cut}) whose response was cut short was reused: {after}")
    assert len(set(after)) == 1, f"expected reuse after the cut, engine saw ports {after}"


def _echo_len_app() -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"body_len": len(body)})

    app = web.Application()
    app.router.add_post("/v1/echo_len", handler)
    return app


def _answer_body_len(request: RawRequest) -> bytes:
    body = json.dumps({"body_len": len(request.body),
                       "sha256": hashlib.sha256(request.body).hexdigest()}).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


@contextlib.asynccontextmanager
async def idle_closing_upstream(kind: str) -> AsyncIterator[tuple[str, Callable[[], int]]]:
    """An upstream that closes keep-alive connections idle for ~0.2 s: an aiohttp server (like
    uvicorn's idle timeout), or a raw one that drops a reused connection when a request arrives
    after that idle gap, the race a pooled client loses when the server's close crosses its
    request on the wire. Yields (url, number of connections it has accepted)."""
    if kind == "aiohttp":
        peers: set[int] = set()

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            assert request.transport is not None
            peers.add(request.transport.get_extra_info("peername")[1])
            return await handler(request)  # type: ignore[no-any-return]

        app = _echo_len_app()
        app.middlewares.append(count)
        runner = web.AppRunner(app, keepalive_timeout=0.2, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", lambda: len(peers)
        finally:
            await runner.cleanup()
        return

    async with raw_upstream(_answer_body_len, drop_idle_s=0.2) as upstream:
        yield upstream.url, lambda: upstream.connections


@pytest.mark.parametrize("kind", ["aiohttp", "raw"])
async def test_post_never_fails_on_a_stale_pooled_connection(
        kind: str, start_sidecar: StartSidecar) -> None:
    gaps = [0.0, 0.25, 0.05, 0.19, 0.21, 0.3, 0.02, 0.2, 0.22, 0.18, 0.25, 0.23]
    async with idle_closing_upstream(kind) as (url, connections):
        servers = await start_sidecar(sidecar_settings(url, upstream={"keepalive_timeout_s": 30}))
        results = []
        async with aiohttp.ClientSession() as session:
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)  # creates the idle gap; not synchronisation
                body = json.dumps({"i": i, "pad": "p" * 2000}).encode()
                async with asyncio.timeout(GUARD_S), session.post(
                        proxy_url(servers, "/v1/echo_len"), data=body,
                        headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.read()
                    ok = resp.status == 200 and json.loads(answer)["body_len"] == len(body)
                    results.append((i, gap, resp.status, answer, ok))
        failed = [r for r in results if not r[-1]]
        assert not failed, f"POSTs failed after an idle gap (i, gap, status, body): {failed}"
        assert connections() > 1, (
            f"the upstream never closed an idle connection ({connections()} connection): "
            "the test did not exercise staleness")


async def test_an_idle_pooled_connection_is_closed_after_keepalive_timeout_s(
        start_sidecar: StartSidecar) -> None:
    """``upstream.keepalive_timeout_s`` counts from each time a connection goes back idle (the
    pool's :class:`~sidecar.pool.Deadlines`): reused within it, then closed by the sidecar once
    it passed, and the next request opens a new one."""
    async with raw_upstream(_answer_body_len) as upstream:
        servers = await start_sidecar(sidecar_settings(
            upstream.url, upstream={"keepalive_timeout_s": 0.3}))
        async with aiohttp.ClientSession() as session:
            async def post() -> int:
                async with asyncio.timeout(GUARD_S), session.post(
                        proxy_url(servers, "/v1/echo_len"), data=b'{"a": 1}') as resp:
                    await resp.read()
                    return resp.status
            def used() -> list[int]:  # the connections the proxied requests came on
                return [r.connection for r in upstream.requests
                        if r.head.startswith(b"POST /v1/echo")]
            assert await post() == 200
            await asyncio.sleep(0.2)  # idle, under the keep-alive timeout
            assert await post() == 200
            first, second = used()
            assert first == second, "expected the idle connection reused"
            await asyncio.sleep(0.15)  # 0.35 s after the first request, 0.15 after the second
            assert first in upstream.open, "closed before keepalive_timeout_s from its last use"
            await asyncio.sleep(0.65)
            assert first not in upstream.open, "expected the idle connection closed by the sidecar"
            assert await post() == 200
            assert used()[2] != first, "expected a new connection"


def test_deadlines_do_not_spin_on_uvloop_s_millisecond_timers() -> None:
    """``sidecar.pool.Deadlines`` under uvloop, which rounds a timer's delay to whole
    milliseconds and may fire up to that early: a deadline due within the clock's resolution
    counts as due. Re-armed instead, it ran in every loop pass until the clock ticked: 300
    deadlines of 12.3 ms cost ~285 ms of CPU that way, ~27 ms now (measured)."""
    async def cpu_ms(after_s: float, count: int) -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        expired: list[int] = []
        deadlines = Deadlines(after_s, expired.append)
        started = time.process_time()
        for i in range(count):
            deadlines.set(i, loop)
            await asyncio.sleep(0.003)
        await asyncio.sleep(after_s + 0.05)
        return (time.process_time() - started) * 1000, len(expired)

    cpu, expired = uvloop.run(cpu_ms(0.0123, 300))
    assert expired == 300, expired
    assert cpu < 100, f"{cpu:.0f} ms of CPU for 300 expiries: the timer spins"


async def test_post_still_streaming_its_body_survives_a_stale_pooled_connection(
        start_sidecar: StartSidecar) -> None:
    """The stale connection drops while the client is still sending: the sidecar re-sends what it
    already relayed on a fresh connection and keeps relaying the rest, no byte lost or doubled."""
    parts = [b'{"pad": "' + b"a" * 3000, b"b" * 50000, b'"}']
    whole = b"".join(parts)
    async with raw_upstream(_answer_body_len, drop_idle_s=0.2) as upstream:
        servers = await start_sidecar(sidecar_settings(
            upstream.url, upstream={"keepalive_timeout_s": 30}))
        async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
            async with session.post(proxy_url(servers, "/v1/echo_len"), data=b"{}") as warm:
                assert warm.status == 200, f"warm-up POST: expected 200, got {warm.status}"
        await asyncio.sleep(0.3)  # creates the idle gap; not synchronisation
        async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader,
                                                                                     writer):
            writer.write(rawhttp.request_bytes("POST", "/v1/echo_len", [
                ("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]))
            writer.write(b"%x\r\n%s\r\n" % (len(parts[0]), parts[0]))
            await writer.drain()
            await upstream.dropped_event.wait()  # the stale connection met the request head
            for part in parts[1:]:
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            writer.write(b"0\r\n\r\n")
            resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    assert resp.status == 200, f"expected 200 after the re-send, got {resp.status} {resp.body!r}"
    seen = json.loads(resp.body)
    assert (seen["body_len"], seen["sha256"]) == (len(whole), hashlib.sha256(whole).hexdigest()), (
        f"upstream got {seen['body_len']} bytes (sha {seen['sha256']}), client sent {len(whole)}")
    assert upstream.dropped == 1, f"expected exactly one stale drop, got {upstream.dropped}"


# --- Timeouts and upstream errors --------------------------------------------------------------

async def test_stream_longer_than_first_byte_timeout_completes(
        engine: FakeEngine, start_sidecar: StartSidecar) -> None:
    servers = await start_sidecar(sidecar_settings(
        engine.url, upstream={"first_byte_timeout_s": 0.3}))
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(servers.proxy_port, post_json(
            "/v1/chat/completions?tokens=8&interval=0.1", {"stream": True}))
    took = time.monotonic() - started
    events = sse_events(resp.body)
    assert resp.status == 200 and resp.ending == "complete" and events[-1:] == [
        b"data: [DONE]"], f"expected a complete stream, got {resp.status} {resp.ending} {events}"
    assert took > 0.6, f"the stream should have outlived first_byte_timeout_s, took {took:.2f}s"


async def test_refused_upstream_is_a_fast_502(start_sidecar: StartSidecar) -> None:
    engine = f"127.0.0.1:{refused_port()}"
    servers = await start_sidecar(sidecar_settings(f"http://{engine}"))
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(servers.proxy_port, post_json("/v1/chat/completions", {}))
    took = time.monotonic() - started
    assert_openai_error(resp.status, resp.body, 502, "upstream_unreachable")
    assert took < 1.0, f"a refused connection should fail at once, took {took:.2f}s"
    assert engine.encode() not in resp.body and b"Errno" not in resp.body, (
        f"the client's error should not name the engine's address nor the OS error: {resp.body!r}")


async def test_silent_upstream_is_a_504_after_first_byte_timeout(
        start_sidecar: StartSidecar) -> None:
    async with raw_upstream(lambda _: None) as upstream:
        servers = await start_sidecar(sidecar_settings(
            upstream.url, upstream={"first_byte_timeout_s": 0.4}))
        started = time.monotonic()
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, rawhttp.request_bytes("GET", "/x"))
        took = time.monotonic() - started
    assert_openai_error(resp.status, resp.body, 504, "upstream_timeout")
    assert 0.35 <= took < 3.0, f"expected the 504 after ~0.4s (first_byte_timeout_s), {took:.2f}s"
    assert len(upstream.requests) == 1, f"expected one request upstream, {upstream.requests}"


async def test_each_request_times_out_at_its_own_first_byte_deadline(
        engine: FakeEngine, start_sidecar: StartSidecar) -> None:
    """One loop timer serves every waiting head (sidecar.pool.FirstByteTimer): a request on a
    pooled connection and one 1 s later on a new connection each get their 504 about
    ``first_byte_timeout_s`` after their own start (the first one's, not at the second's deadline,
    1.4 s after it started), their engine requests are aborted, and the
    pool serves on."""
    servers = await start_sidecar(sidecar_settings(
        engine.url, upstream={"first_byte_timeout_s": 0.4}))
    chat = post_json(CHAT, {"stream": True})
    async with asyncio.timeout(GUARD_S):
        first = await rawhttp.exchange(servers.proxy_port, chat)  # pools its connection
        assert first.status == 200, first.status

        async def timed(delay_s: float) -> tuple[int, bytes, float]:
            await asyncio.sleep(delay_s)
            started = time.monotonic()
            resp = await rawhttp.exchange(servers.proxy_port, post_json(
                f"{CHAT}?first_byte_delay=5", {"stream": True}))
            return resp.status, resp.body, time.monotonic() - started

        answers = await asyncio.gather(timed(0), timed(1.0))
        for status, body, took in answers:
            assert_openai_error(status, body, 504, "upstream_timeout")
            assert 0.35 <= took < 0.9, f"expected each 504 ~0.4 s after its start: {answers}"
        after = await rawhttp.exchange(servers.proxy_port, chat)
        assert after.status == 200 and sse_events(after.body)[-1:] == [b"data: [DONE]"], after
        delayed = engine.record.generations[1:3]
        stopped = engine.record.stopped_event  # aborted after the 504s went out
        while True:
            stopped.clear()
            if all(g.stopped_at for g in delayed):
                break
            await stopped.wait()
    assert all(g.aborted_at for g in delayed), delayed
    assert len(set(engine.record.aborted_ids())) == 2, engine.record.aborted_ids()


async def test_connect_timeout_is_a_504(start_sidecar: StartSidecar) -> None:
    with unconnectable_port() as port:
        servers = await start_sidecar(sidecar_settings(
            f"http://127.0.0.1:{port}",
            upstream={"connect_timeout_s": 0.3, "first_byte_timeout_s": 10}))
        started = time.monotonic()
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, rawhttp.request_bytes("GET", "/x"))
        took = time.monotonic() - started
    assert_openai_error(resp.status, resp.body, 504, "upstream_timeout")
    assert 0.25 <= took < 3.0, f"expected the 504 after ~0.3s (connect_timeout_s), {took:.2f}s"


MALFORMED = {
    "garbage": b"this is not http\r\n\r\n",
    "bad-status": b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n",
    "bad-header": b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n",
    "truncated-head": b"HTTP/1.1 200 OK\r\nContent-Le",
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_upstream_response_is_a_502(name: str,
                                                    start_sidecar: StartSidecar) -> None:
    async with raw_upstream(lambda _: MALFORMED[name], close_after_response=True) as upstream:
        servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, rawhttp.request_bytes("GET", "/x"))
    assert_openai_error(resp.status, resp.body, 502, "upstream_protocol_error")


# --- An upstream that dies mid-stream ends the client's response abnormally --------------------

@pytest.mark.parametrize("die", ["fin", "rst"])
async def test_upstream_death_mid_stream_is_a_payload_error_for_aiohttp(
        die: str, engine: FakeEngine, sidecar: Servers) -> None:
    received = b""
    async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
        async with session.post(
                proxy_url(sidecar, f"/v1/chat/completions?tokens=10&die_after=3&die={die}"),
                json={"stream": True}) as resp:
            assert resp.status == 200, f"expected the stream to start with 200, got {resp.status}"
            with pytest.raises(aiohttp.ClientPayloadError):
                while chunk := await resp.content.readany():
                    received += chunk
    assert b"[DONE]" not in received, f"a [DONE] the engine never sent: {received!r}"
    assert received.count(b"data:") == 3, f"expected the 3 events sent, got {received!r}"


@pytest.mark.parametrize("die", ["fin", "rst"])
async def test_upstream_death_mid_stream_leaves_chunked_body_unterminated(
        die: str, engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, post_json(
            f"/v1/chat/completions?tokens=10&die_after=3&die={die}", {"stream": True}))
    assert resp.status == 200 and resp.chunked, f"expected a chunked 200, got {resp.headers}"
    assert resp.ending != "complete", (
        f"expected no terminating 0-chunk after the engine died, got a complete body {resp.body!r}")
    assert b"[DONE]" not in resp.body, f"a [DONE] the engine never sent: {resp.body!r}"


@pytest.mark.parametrize("die", ["fin", "rst"])
async def test_upstream_death_mid_stream_resets_an_http10_client(
        die: str, engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, post_json(
            f"/v1/chat/completions?tokens=10&die_after=3&die={die}", {"stream": True},
            "HTTP/1.0"))
    assert resp.status == 200 and not resp.chunked, f"expected close-delimited: {resp.headers}"
    assert resp.ending == "reset", (
        f"a close-delimited body cut short must end in a TCP reset (a FIN reads as a complete "
        f"response); got {resp.ending!r} after {resp.body!r}")
    assert b"[DONE]" not in resp.body, f"a [DONE] the engine never sent: {resp.body!r}"



# --- Read timeout: an engine silent mid-body -----------------------------------------------------

READ_TIMEOUT_S = 0.5
SILENT_STREAMS = {
    "head-then-silence": 0,  # headers sent, the first body byte never comes
    "events-then-silence": 3,  # some events, then nothing
}


@pytest.mark.parametrize("name", list(SILENT_STREAMS))
async def test_read_timeout_ends_a_silent_stream_abnormally_and_aborts_once(
        name: str, start_sidecar: StartSidecar) -> None:
    events = SILENT_STREAMS[name]
    sent = SSE_HEAD + b"".join(chunk(event(i)) for i in range(events))
    async with raw_upstream(engine_like(sent)) as upstream:
        servers = await start_sidecar(sidecar_settings(
            upstream.url, upstream={"read_timeout_s": READ_TIMEOUT_S}))
        started = time.monotonic()
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, post_json(
                CHAT, {"messages": [], "stream": True}))
        took = time.monotonic() - started
        closed = await until(lambda: not generating_connections_open(upstream),
                             "the silent upstream connection closed at the server side")
        await until(lambda: bool(abort_ids(upstream)), "an abort call at the engine")
        await asyncio.sleep(QUIET_S)  # room for a second abort call that must not come
        await settle(servers)
        aborts = abort_ids(upstream)
        values = await metrics(servers.admin_port or 0)
    print(f"[{name}] abnormal end after {took:.3f}s (read_timeout_s {READ_TIMEOUT_S}); "
          f"upstream connection closed {closed * 1000:.0f} ms after that")
    assert resp.status == 200 and resp.chunked, f"expected a chunked 200, got {resp.headers}"
    assert resp.ending != "complete", (
        f"a silent engine must not be turned into a clean end, got a complete body {resp.body!r}")
    assert resp.body == b"".join(event(i) for i in range(events)), (
        f"expected exactly the {events} events the engine sent, got {resp.body!r}")
    assert READ_TIMEOUT_S - 0.05 <= took < READ_TIMEOUT_S + 2.0, (
        f"expected the end ~{READ_TIMEOUT_S}s after the last byte, took {took:.2f}s")
    assert aborts == [[f"chatcmpl-{resp.get('X-Request-Id')}"]], (
        f"expected one abort call naming chatcmpl-{resp.get('X-Request-Id')}, got {aborts}")
    assert samples(values, "cancel_sidecar_upstream_errors_total") == {
        frozenset({("engine", "local"), ("kind", "ReadTimeout")}): 1.0}, (
        f"expected one ReadTimeout: {samples(values, 'cancel_sidecar_upstream_errors_total')}")
    assert not samples(values, "cancel_sidecar_client_disconnects_total"), (
        "a read timeout is not a client disconnect")


async def test_stream_with_gaps_shorter_than_read_timeout_is_never_cut(
        engine: FakeEngine, start_sidecar: StartSidecar) -> None:
    servers = await start_sidecar(sidecar_settings(
        engine.url, upstream={"read_timeout_s": READ_TIMEOUT_S}))
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S * 2):
        resp = await rawhttp.exchange(servers.proxy_port, post_json(
            f"{CHAT}?tokens=10&interval=0.3", {"messages": [], "stream": True}))
    took = time.monotonic() - started
    await settle(servers)
    values = await metrics(servers.admin_port or 0)
    events = sse_events(resp.body)
    assert resp.status == 200 and resp.ending == "complete" and len(events) == 11 and events[
        -1] == b"data: [DONE]", f"expected 10 events and [DONE]: {resp.ending} {events}"
    assert took >= 2.7, f"expected a ~3 s stream (an event every 0.3 s), it took {took:.2f}s"
    assert not samples(values, "cancel_sidecar_upstream_errors_total"), (
        f"no upstream error expected: {samples(values, 'cancel_sidecar_upstream_errors_total')}")
    assert engine.record.aborts == [], f"nothing to abort, got {engine.record.aborts}"


# --- A Content-Length response cut short ---------------------------------------------------------

CUT_SHORT = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
             + b'{"choices": "' + b"x" * 27)  # 40 of 100 bytes, then the engine closes


async def test_content_length_response_cut_short_is_a_payload_error_for_aiohttp(
        start_sidecar: StartSidecar) -> None:
    async with raw_upstream(engine_like(CUT_SHORT), close_after_response=True) as upstream:
        servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
            async with session.post(proxy_url(servers, CHAT), json={"messages": []}) as resp:
                assert resp.status == 200, f"expected the response to start, got {resp.status}"
                assert resp.content_length == 100, f"expected Content-Length 100: {resp.headers}"
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()


async def test_content_length_response_cut_short_gives_a_raw_client_fewer_bytes(
        start_sidecar: StartSidecar) -> None:
    async with raw_upstream(engine_like(CUT_SHORT), close_after_response=True) as upstream:
        servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, post_json(CHAT, {"messages": []}))
    assert resp.status == 200 and resp.get("Content-Length") == "100", (
        f"expected a 200 announcing 100 bytes, got {resp.status} {resp.headers}")
    assert resp.ending == "eof" and resp.body == CUT_SHORT.split(b"\r\n\r\n", 1)[1], (
        f"expected the 40 bytes the engine sent, then the close; got {resp.ending} {resp.body!r}")


# --- Every fault kind: abort or not, other streams unaffected, no connection leaked --------------

@dataclass
class Fault:
    """One fault on the ``faulty`` engine (route prefix ``/v1/chat/completions``).

    ``error``: the OpenAI error (status, type) the client gets, or ``None`` for an abnormal end
    after a 200. ``aborted``: whether the engine is aborted (once, the request's id).
    ``aborts``: the abort calls' id lists seen at the faulty engine (``None``: unreachable; the
    metrics are checked instead). ``open_connections``: the faulty engine's proxied connections
    still open at the server side (``None``: none was ever established).
    """

    url: str
    target: str
    body: dict[str, Any]
    error: tuple[int, str] | None
    aborted: bool
    kind: str
    aborts: Callable[[], list[list[str]]] | None = None
    open_connections: Callable[[], int] | None = None


STREAM = {"messages": [], "stream": True}


@contextlib.asynccontextmanager
async def raw_fault(response: bytes | None, error: tuple[int, str] | None, aborted: bool,
                    kind: str, body: dict[str, Any] | None = None,
                    **options: Any) -> AsyncIterator[Fault]:
    async with raw_upstream(engine_like(response), **options) as upstream:
        yield Fault(upstream.url, CHAT, body or STREAM, error, aborted, kind,
                    lambda: abort_ids(upstream), lambda: len(generating_connections_open(upstream)))


@contextlib.asynccontextmanager
async def fault(kind: str) -> AsyncIterator[Fault]:
    protocol = (502, "upstream_protocol_error")
    if kind == "refused":
        yield Fault(f"http://127.0.0.1:{refused_port()}", CHAT, STREAM,
                    (502, "upstream_unreachable"), False, "ConnectError")
    elif kind == "connect-timeout":
        with unconnectable_port() as port:
            yield Fault(f"http://127.0.0.1:{port}", CHAT, STREAM, (504, "upstream_timeout"),
                        False, "ConnectTimeout")
    elif kind == "first-byte-timeout":
        async with raw_fault(None, (504, "upstream_timeout"), True, "FirstByteTimeout") as f:
            yield f
    elif kind == "malformed-head":
        async with raw_fault(MALFORMED["bad-status"], protocol, True, "ProtocolError") as f:
            yield f
    elif kind == "control-character-header":  # aiohttp's client reads it; its server
        # cannot write it (a hostile tester's finding: the client got a mis-framed 500)
        async with raw_fault(SSE_HEAD.replace(b"\r\n\r\n", b"\r\nX-Odd: a\x01b\r\n\r\n")
                             + chunk(event(0)), protocol, True, "ProtocolError") as f:
            yield f
    elif kind == "closed-before-head":
        async with raw_fault(MALFORMED["truncated-head"], protocol, False, "Disconnected",
                             close_after_response=True) as f:
            yield f
    elif kind in ("death-fin", "death-rst"):
        dying = FakeEngine()
        await dying.start()
        try:
            server = dying.runner.server if dying.runner else None
            assert server is not None
            yield Fault(dying.url, f"{CHAT}?tokens=10&die_after=3&die={kind[6:]}", STREAM,
                        None, False, "MidStream", lambda: [a.ids for a in dying.record.aborts],
                        # Connections that carried a request: not the sidecar's warm abort one.
                        lambda: sum(c._request_count > 0 for c in server.connections))
        finally:
            await dying.stop()
    elif kind == "read-timeout":
        async with raw_fault(SSE_HEAD + chunk(event(0)), None, True, "ReadTimeout") as f:
            yield f
    elif kind == "content-length-cut-short":
        async with raw_fault(CUT_SHORT, None, False, "MidStream", {"messages": []},
                             close_after_response=True) as f:
            yield f
    else:
        raise ValueError(kind)


FAULT_KINDS = ["refused", "connect-timeout", "first-byte-timeout", "malformed-head",
               "control-character-header",
               "closed-before-head", "death-fin", "death-rst", "read-timeout",
               "content-length-cut-short"]
HEALTHY_TOKENS = 40  # at 0.05 s apart: a ~2 s stream, longer than any fault here takes


async def healthy_stream(servers: Servers) -> tuple[rawhttp.RawResponse, float]:
    """A stream through the healthy engine (route ``/``); returns it and when it ended."""
    resp = await rawhttp.exchange(servers.proxy_port, post_json(
        f"/v1/completions?tokens={HEALTHY_TOKENS}&interval=0.05", {"prompt": "a", "stream": True}))
    return resp, time.monotonic()


def fake_engine_stream(request_id: str, tokens: int) -> bytes:
    """The exact bytes :class:`FakeEngine` streams for ``tokens`` events and ``[DONE]``."""
    return b"".join(b"data: %s\n\n" % json.dumps(
        {"id": request_id, "choices": [{"text": f"t{i}"}]}, separators=(",", ":")).encode()
        for i in range(tokens)) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_upstream_fault_aborts_per_kind_spares_other_streams_and_leaks_no_connection(
        kind: str, engine: FakeEngine, start_sidecar: StartSidecar) -> None:
    async with fault(kind) as f:
        servers = await start_sidecar(sidecar_settings(
            engine.url,
            engines={"faulty": {"kind": "vllm", "url": f.url,
                                "abort": {"api_key": "sekret-key", "timeout_s": 2.0,
                                          "resend_window_s": 0}}},
            routes=[{"prefix": CHAT, "engine": "faulty"}, {"prefix": "/", "engine": "local"}],
            upstream={"connect_timeout_s": 0.3, "first_byte_timeout_s": 0.5,
                      "read_timeout_s": READ_TIMEOUT_S}))
        healthy = asyncio.create_task(healthy_stream(servers))
        await asyncio.wait_for(engine.record.started_event.wait(), GUARD_S)
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, post_json(f.target, f.body))
        fault_over = time.monotonic()
        closed_s = None
        if f.open_connections is not None:
            open_connections = f.open_connections
            closed_s = await until(lambda: open_connections() == 0,
                                   "the faulty engine's connections closed at the server side")
        if f.aborted and f.aborts is not None:
            aborts = f.aborts
            await until(lambda: bool(aborts()), "an abort call at the faulty engine")
        await asyncio.sleep(QUIET_S)  # room for an abort call that must not come (or a second)
        await settle(servers)
        values = await metrics(servers.admin_port or 0)
        async with asyncio.timeout(GUARD_S * 2):
            (stream, stream_ended) = await healthy
        seen_aborts = f.aborts() if f.aborts is not None else None
    rid = resp.get("X-Request-Id")
    if f.error is not None:
        assert_openai_error(resp.status, resp.body, *f.error)
    else:
        assert resp.status == 200 and resp.ending != "complete", (
            f"expected a 200 that ends abnormally, got {resp.status} {resp.ending} {resp.body!r}")
        assert b"[DONE]" not in resp.body, f"a [DONE] the engine never sent: {resp.body!r}"
    expected_aborts = [[f"chatcmpl-{rid}"]] if f.aborted else []
    if seen_aborts is not None:
        assert seen_aborts == expected_aborts, (
            f"{kind}: expected abort calls {expected_aborts}, the engine got {seen_aborts}")
    aborted = samples(values, "cancel_sidecar_aborted_requests_total")
    assert aborted == ({frozenset({("engine", "faulty"), ("outcome", "accepted")}): 1.0}
                       if f.aborted else {}), f"{kind}: aborted_requests_total is {aborted}"
    errors = samples(values, "cancel_sidecar_upstream_errors_total")
    assert errors == {frozenset({("engine", "faulty"), ("kind", f.kind)}): 1.0}, (
        f"{kind}: expected one {f.kind} in upstream_errors_total, got {errors}")
    healthy_id = stream.get("X-Request-Id") or ""
    assert stream.status == 200 and stream.ending == "complete" and stream.body == (
        fake_engine_stream(healthy_id, HEALTHY_TOKENS)), (
        f"{kind}: the concurrent healthy stream was disturbed: {stream.status} {stream.ending} "
        f"{stream.body[-200:]!r}")
    assert stream_ended > fault_over, (
        f"{kind}: the healthy stream ended before the fault did; it did not run concurrently")
    print(f"[{kind}] faulty connections closed "
          f"{'n/a' if closed_s is None else f'{closed_s * 1000:.0f} ms'} after the client's end")


# --- An upstream that closes idle keep-alive connections ------------------------------------------

async def test_posts_spaced_around_the_upstream_idle_close_all_succeed(
        start_sidecar: StartSidecar) -> None:
    """30 POSTs with bodies, each after a gap around the upstream's idle close (jitter
    0.22-0.38 s); the sidecar keeps idle connections 30 s. The upstream closes a connection idle
    0.34 s, and meets a request that arrives on one idle 0.3 s or more with a close (on loopback
    a plain idle close is seen by the pool before the next request, so the race a real network
    loses has to be played). Every POST must succeed with its body intact."""
    rng = random.Random(1234)
    gaps = [0.3 + rng.uniform(-0.08, 0.08) for _ in range(30)]
    async with raw_upstream(_answer_body_len, idle_close_s=0.34, drop_idle_s=0.3) as upstream:
        servers = await start_sidecar(sidecar_settings(
            upstream.url, upstream={"keepalive_timeout_s": 30}))
        failed = []
        async with aiohttp.ClientSession() as session:
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)  # creates the idle gap; not synchronisation
                body = json.dumps({"i": i, "pad": "p" * rng.randrange(10, 5000)}).encode()
                async with asyncio.timeout(GUARD_S), session.post(
                        proxy_url(servers, "/v1/echo_len"), data=body,
                        headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.read()
                seen = json.loads(answer) if resp.status == 200 else {}
                if (seen.get("body_len"), seen.get("sha256")) != (
                        len(body), hashlib.sha256(body).hexdigest()):
                    failed.append((i, round(gap, 3), resp.status, answer[:200]))
        connections, dropped = upstream.connections, upstream.dropped
        idle_closed = sum(gap > 0.34 for gap in gaps)
    print(f"30 POSTs around the idle close: {connections} upstream connections, {dropped} "
          f"requests met a closing connection, {idle_closed} gaps past the idle close")
    assert not failed, f"POSTs failed after an idle gap (i, gap, status, body): {failed}"
    assert dropped > 0 and idle_closed > 0, (
        f"expected both requests meeting a close ({dropped}) and idle-closed connections "
        f"({idle_closed} gaps > 0.34 s): staleness not exercised")


async def _asgi_echo_len(scope: dict[str, Any], receive: Callable[[], Any],
                         send: Callable[[dict[str, Any]], Any]) -> None:
    """A tiny ASGI app: answers a POST's body length and SHA-256 as JSON."""
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({"body_len": len(body),
                         "sha256": hashlib.sha256(body).hexdigest()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@contextlib.asynccontextmanager
async def uvicorn_server(timeout_keep_alive: int) -> AsyncIterator[str]:
    """A real uvicorn server on 127.0.0.1 in a thread (its own event loop); yields its URL."""
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_asgi_echo_len, timeout_keep_alive=timeout_keep_alive,
                            lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="uvicorn", daemon=True)
    thread.start()
    try:
        await until(lambda: bool(server.started), "uvicorn to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, GUARD_S)
        sock.close()


async def test_posts_spaced_around_uvicorns_keep_alive_timeout_all_succeed(
        start_sidecar: StartSidecar) -> None:
    """uvicorn with ``timeout_keep_alive=1`` and the sidecar's default 4 s pool keep-alive (the
    misconfiguration the stale-connection re-send exists for): 10 POSTs 0.9-1.1 s apart."""
    rng = random.Random(99)
    async with uvicorn_server(timeout_keep_alive=1) as url:
        servers = await start_sidecar(sidecar_settings(url))
        failed = []
        async with aiohttp.ClientSession() as session:
            for i in range(10):
                await asyncio.sleep(rng.uniform(0.9, 1.1))  # the idle gap; not synchronisation
                body = json.dumps({"i": i, "pad": "q" * rng.randrange(10, 5000)}).encode()
                async with asyncio.timeout(GUARD_S), session.post(
                        proxy_url(servers, "/v1/echo_len"), data=body,
                        headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.read()
                seen = json.loads(answer) if resp.status == 200 else {}
                if (seen.get("body_len"), seen.get("sha256")) != (
                        len(body), hashlib.sha256(body).hexdigest()):
                    failed.append((i, resp.status, answer[:200]))
    assert not failed, f"POSTs through the sidecar to uvicorn failed (i, status, body): {failed}"
