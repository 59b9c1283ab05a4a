"""Cancellation, end to end: a client that leaves gets its upstream connection closed and exactly
its own engine request ids aborted, in every phase of the exchange.

Everything runs through the production wiring: :func:`sidecar.server.start` (the ``sidecar`` and
``start_sidecar`` fixtures, ``AppRunner`` with handler cancellation, what the CLI runs) and, in
the ``test_cli_*`` tests, the real ``python -m sidecar`` subprocess. Clients are raw sockets
(exact disconnect timing: ``rst`` = SO_LINGER 0 + close, ``fin`` = close, ``half`` = shutdown of
the write side only) and aiohttp clients; the engine is :mod:`tests.fake_engine` on 127.0.0.1.

Timing: waits are event-driven with a generous limit (``WAIT_S``); latencies are then asserted
against ``GUARD_S`` and printed (run with ``-s``). Time during which this test process did not
run at all (measured by the ``stalls`` fixture: on a loaded 2-CPU machine a process was seen
descheduled for 8-10 s at a time) is excluded from every latency before it is compared with its
bound (and printed with it), and extends every wait's limit, since after such a stall the wait's
timer fires before the I/O it was waiting for is processed. "Nothing happened" is checked by an
event-or-timeout wait (``QUIET_S``) followed by a full request through the sidecar
(:func:`settle`), so an abort that was going to be sent has had every chance to arrive.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import yaml
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")

GUARD_S = 1.0  # upper bound for "promptly": disconnect -> upstream closed / abort arrived
WAIT_S = 10.0  # how long any wait for an expected event may take before the test fails
FOREVER = 3600.0  # for waits that Stalls.wait bounds
QUIET_S = 0.3  # how long to wait for something that must NOT happen, before settle()
API_KEY = "sekret-key"  # what tests/conftest.py configures as abort.api_key
REPO = Path(__file__).resolve().parent.parent

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"

# name -> (path, body, engine request ids for sidecar id <id>)
ROUTES: dict[str, tuple[str, dict[str, Any], Callable[[str], list[str]]]] = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": "hi"}]},
             lambda i: [f"chatcmpl-{i}"]),
    "completions-3-prompts": (COMPLETIONS, {"prompt": ["a", "b", "c"]},
                              lambda i: [f"cmpl-{i}-0", f"cmpl-{i}-1", f"cmpl-{i}-2"]),
    "completions-1-prompt": (COMPLETIONS, {"prompt": "a"}, lambda i: [f"cmpl-{i}-0"]),
    "generate": (GENERATE, {"token_ids": [1, 2, 3]}, lambda i: [f"generate-tokens-{i}"]),
}

# phase -> (query, stream?, the phase label the sidecar counts)
PHASES: dict[str, tuple[str, bool, str]] = {
    "queued": ("?first_byte_delay=5", True, "before_first_byte"),
    "non_streaming": ("?tokens=1000&interval=0.01", False, "awaiting_response"),
    "mid_stream": ("?tokens=1000&interval=0.01", True, "streaming"),
}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# -- time this process did not run -------------------------------------------------------------

class Stalls:
    """Records the intervals in which this process did not run (descheduled: on a loaded
    2-CPU machine that can last seconds). A thread expects to wake every ``TICK_S``; a gap
    longer than ``TICK_S + SLACK_S`` is a stall. A thread, not a task: an event loop blocked by
    the code under test must count against it, not be excused as a stall (the ticker releases
    and retakes the GIL, so a busy or blocked loop barely delays it)."""

    TICK_S = 0.002
    SLACK_S = 0.01

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.TICK_S):
            now = time.monotonic()
            if now - last > self.TICK_S + self.SLACK_S:
                self.intervals.append((last, now))
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def within(self, start: float, end: float) -> float:
        """Seconds of stall between ``start`` and ``end`` (``time.monotonic()`` values)."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in list(self.intervals))

    def check(self, what: str, since: float, at: float, bound_s: float = GUARD_S) -> float:
        """Assert ``what`` happened within ``bound_s`` of ``since`` (stalls excluded); returns
        the raw latency."""
        took, stalled = at - since, self.within(since, at)
        assert took - stalled < bound_s, (
            f"expected {what} within {bound_s}s; it took {ms(took)}"
            + (f" ({ms(stalled)} of it with this process stalled)" if stalled else ""))
        return took

    def note(self, since: float, until: float) -> str:
        stalled = self.within(since, until)
        return f" [process stalled {ms(stalled)} meanwhile]" if stalled else ""

    def _left(self, start: float, within_s: float) -> float:
        now = time.monotonic()
        return max(0.0, start + within_s + self.within(start, now) - now)

    async def wait(self, aw: Awaitable[T], what: str, within_s: float = WAIT_S) -> T:
        """Await ``aw`` for at most ``within_s`` seconds of time in which this process ran;
        fail saying ``what`` was expected."""
        task = asyncio.ensure_future(aw)
        start = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._left(start, within_s))
                if done:
                    return task.result()
                await asyncio.sleep(5 * self.TICK_S)  # let the ticker record a stall just ended
                if not task.done() and self._left(start, within_s) == 0:
                    raise AssertionError(f"expected {what} within {within_s}s; it did not happen")
        finally:
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task


@pytest.fixture(scope="session", name="stalls")
def stall_monitor() -> Iterator[Stalls]:
    monitor = Stalls()
    yield monitor
    monitor.stop()


# -- clients ------------------------------------------------------------------------------------

class RawClient:
    """One HTTP/1.1 connection on a raw socket, for exact control of when and how it ends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 stalls: Stalls) -> None:
        self.reader = reader
        self.writer = writer
        self.stalls = stalls

    def send_head(self, method: str, path: str, headers: list[tuple[str, str]],
                  content_length: int | None) -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: sidecar"]
        lines += [f"{k}: {v}" for k, v in headers]
        if content_length is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {content_length}"]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: list[tuple[str, str]] | None = None) -> None:
        self.send_head(method, path, headers or [], None if body is None else len(body))
        if body:
            self.writer.write(body)

    async def head(self) -> tuple[int, CIMultiDict[str]]:
        raw = await self.stalls.wait(self.reader.readuntil(b"\r\n\r\n"), "a response head")
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers.add(name.strip(), value.strip())
        return int(status_line.split()[1]), headers

    async def read_until(self, marker: bytes) -> bytes:
        return await self.stalls.wait(self.reader.readuntil(marker), f"to read {marker!r}")

    def disconnect(self, how: str) -> float:
        """End the connection (``rst``, ``fin`` or ``half``); returns ``time.monotonic()``."""
        if how == "rst":
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            at = time.monotonic()
            self.writer.transport.abort()
        elif how == "fin":
            at = time.monotonic()
            self.writer.close()
        elif how == "half":
            at = time.monotonic()
            self.writer.write_eof()  # shutdown(SHUT_WR): we still read
        else:
            raise ValueError(how)
        return at


@asynccontextmanager
async def raw_client(port: int, stalls: Stalls) -> AsyncIterator[RawClient]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield RawClient(reader, writer, stalls)
    finally:
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()


def request_body(body: dict[str, Any], stream: bool) -> bytes:
    return json.dumps({**body, "stream": stream}).encode()


# -- waiting and checking -----------------------------------------------------------------------

async def no_event(event: asyncio.Event, within_s: float = QUIET_S) -> bool:
    """True if ``event`` stays unset for ``within_s`` seconds."""
    try:
        await asyncio.wait_for(event.wait(), within_s)
    except TimeoutError:
        return True
    return False


async def settle(port: int) -> None:
    """A complete request through the sidecar: whatever the sidecar had started before it
    (an abort call in its own task) has had a full round trip's time to show up."""
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
        assert r.status == 200, f"settle request: expected 200 from /health, got {r.status}"
        await r.read()


async def metrics(admin_port: int, session: aiohttp.ClientSession | None = None
                  ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on the admin listener's /metrics: (name, labels) -> value."""
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await metrics(admin_port, own)
    async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        assert r.status == 200, f"GET /metrics: expected 200, got {r.status}"
        text = await r.text()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample(values: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def samples(values: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str
            ) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in values.items() if n == name and v}


async def wait_metric(stalls: Stalls, admin_port: int, name: str, value: float,
                      within_s: float = WAIT_S, **labels: str) -> float:
    """Poll /metrics until the sample reaches ``value`` (no event exists for it); returns the
    seconds it took. Fails with what the metric said instead."""
    start = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while True:
            got = sample(await metrics(admin_port, s), name, **labels)
            now = time.monotonic()
            if got >= value:
                return now - start
            if now - start - stalls.within(start, now) > within_s:
                raise AssertionError(f"expected {name}{labels} >= {value} within {within_s}s; "
                                     f"it is {got}")
            await asyncio.sleep(0.02)


def disconnect_counts(values: dict[tuple[str, frozenset[tuple[str, str]]], float]
                      ) -> dict[tuple[str, str], float]:
    return {(dict(k)["route"], dict(k)["phase"]): v
            for k, v in samples(values, "cancel_sidecar_client_disconnects_total").items()}


async def upstream_closed(engine: FakeEngine, stalls: Stalls) -> float:
    """Wait for the engine to see its generating connection go away; returns when it did."""
    await stalls.wait(engine.record.closed_event.wait(),
                      "the upstream (engine) connection to close")
    gen = engine.record.generations[-1]
    assert gen.closed_at is not None and not gen.finished, (
        f"expected the generation cut short, got finished={gen.finished} "
        f"closed_at={gen.closed_at}")
    return gen.closed_at


async def one_abort(engine: FakeEngine, stalls: Stalls, port: int) -> tuple[list[str], float]:
    """Wait for the abort call; check it is the only one and carries the bearer key. Returns
    its ids and when it arrived."""
    await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
    await settle(port)
    aborts = engine.record.aborts
    assert len(aborts) == 1, f"expected exactly one abort call, got {[a.ids for a in aborts]}"
    assert aborts[0].authorization == f"Bearer {API_KEY}", (
        f"expected the configured bearer key on the abort call, got {aborts[0].authorization!r}")
    return aborts[0].ids, aborts[0].at


# -- sidecar request ids ------------------------------------------------------------------------

async def test_every_request_gets_a_unique_sidecar_id(engine: FakeEngine,
                                                      sidecar: Servers) -> None:
    seen: list[str] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(20):
            async with s.post(f"http://127.0.0.1:{sidecar.proxy_port}/echo", data=b"x") as r:
                echoed = await r.json()
                rid = r.headers.get("X-Request-Id", "")
            upstream = [v for k, v in echoed["headers"] if k.lower() == "x-request-id"]
            assert upstream == [rid], f"engine got X-Request-Id {upstream}, client got {rid!r}"
            assert "X-Client-Request-Id" not in r.headers, "no client id was sent"
            assert re.fullmatch(r"[0-9a-f]{32}", rid), f"expected a uuid4 hex id, got {rid!r}"
            seen.append(rid)
    assert len(set(seen)) == 20, f"expected 20 distinct ids, got {seen}"


CLIENT_IDS = {
    "same": [("X-Request-Id", "shared-id")],
    "comma": [("X-Request-Id", "x, y")],
    "long": [("X-Request-Id", "L" * 4000)],
    "two-headers": [("X-Request-Id", "a"), ("X-Request-Id", "b")],
    "body-field": [],  # the body's "request_id" field is set below
}


@pytest.mark.parametrize("kind", sorted(CLIENT_IDS))
async def test_client_chosen_ids_never_reach_an_abort(engine: FakeEngine, sidecar: Servers,
                                                      stalls: Stalls, kind: str) -> None:
    """Two clients send the same id; disconnecting A aborts A's request only, B completes."""
    headers = CLIENT_IDS[kind]
    body = request_body({"messages": [], "request_id": "victim"}, stream=True)
    port = sidecar.proxy_port
    async with raw_client(port, stalls) as b, raw_client(port, stalls) as a:
        b.send("POST", f"{CHAT}?tokens=40&interval=0.01", body, headers)
        status_b, head_b = await b.head()
        await b.read_until(b"data:")
        a.send("POST", f"{CHAT}?tokens=1000&interval=0.01", body, headers)
        status_a, head_a = await a.head()
        await a.read_until(b"data:")
        assert status_a == status_b == 200, f"expected 200 twice, got {status_a}, {status_b}"
        at = a.disconnect("rst")
        ids, aborted_at = await one_abort(engine, stalls, port)
        rest_b = await b.read_until(b"data: [DONE]\n\n")
    a_id, b_id = head_a["X-Request-Id"], head_b["X-Request-Id"]
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[{kind}] abort {ms(latency)} after A left{stalls.note(at, aborted_at)}")
    assert ids == [f"chatcmpl-{a_id}"], f"expected only A's id chatcmpl-{a_id}, got {ids}"
    assert a_id != b_id and re.fullmatch(r"[0-9a-f]{32}", a_id), (a_id, b_id)
    assert rest_b.count(b"data:") == 40, f"B expected its whole stream, got {rest_b[-200:]!r}"
    gens = {g.request_id: g for g in engine.record.generations}
    assert gens[b_id].finished and gens[b_id].closed_at is None, "B must complete, unaborted"
    assert gens[a_id].closed_at is not None, "A's upstream must be closed"
    client_value = headers[0][1] if headers else None
    for head in (head_a, head_b):
        assert head.get("X-Client-Request-Id") == client_value, (
            f"expected X-Client-Request-Id {client_value!r:.40} in the response, "
            f"got {head.get('X-Client-Request-Id')!r:.40}")
    for seen in engine.watch.on(CHAT):
        assert seen.headers.getall("X-Request-Id") in ([a_id], [b_id]), (
            f"engine must see only the sidecar id, got {seen.headers.getall('X-Request-Id')}")
        assert seen.headers.get("X-Client-Request-Id") == client_value, (
            f"engine expected X-Client-Request-Id {client_value!r:.40}, "
            f"got {seen.headers.get('X-Client-Request-Id')!r:.40}")


# -- disconnect in every phase ------------------------------------------------------------------

@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_disconnect_closes_upstream_and_aborts_exact_ids(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, route: str, phase: str,
        how: str) -> None:
    path, body, expected_ids = ROUTES[route]
    query, stream, phase_label = PHASES[phase]
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send("POST", path + query, request_body(body, stream), [("X-Request-Id", "client")])
        client_id = None
        if phase == "mid_stream":
            status, head = await c.head()
            assert status == 200, f"expected a 200 stream, got {status}"
            client_id = head["X-Request-Id"]
            await c.read_until(b"data:")
        else:
            await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
        at = c.disconnect(how)
        closed_at = await upstream_closed(engine, stalls)
        ids, aborted_at = await one_abort(engine, stalls, sidecar.proxy_port)
    engine_id = engine.record.generations[0].request_id
    assert engine_id is not None and engine_id != "client", f"engine saw id {engine_id!r}"
    if client_id is not None:
        assert client_id == engine_id, f"client got id {client_id}, engine got {engine_id}"
    assert ids == expected_ids(engine_id), f"expected {expected_ids(engine_id)}, got {ids}"
    closed = stalls.check("the upstream close", at, closed_at)
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[{route} {phase} {how}] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    counts = disconnect_counts(await metrics(sidecar.admin_port or 0))
    assert counts == {("/", phase_label): 1}, f"expected one {phase_label} disconnect: {counts}"


@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("route", ["chat", "completions-3-prompts"])
async def test_disconnect_while_sending_the_body_closes_upstream_without_abort(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, route: str, how: str) -> None:
    """The engine never got a whole request, so it has nothing to abort: none is sent."""
    path, body, _ = ROUTES[route]
    raw = json.dumps({**body, "stream": True, "pad": "p" * 20000}).encode()
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send_head("POST", path + "?tokens=1000", [], len(raw))
        c.writer.write(raw[: len(raw) // 2])
        await c.writer.drain()
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(path)), FOREVER),
                          "the engine to receive the request head and part of the body")
        at = c.disconnect(how)
        seen = engine.watch.on(path)[0]
        await stalls.wait(engine.watch.until(lambda: seen.failed_at is not None, FOREVER),
                          "the engine's body read to fail (upstream closed)")
        assert seen.failed_at is not None
    closed = stalls.check("the upstream close", at, seen.failed_at)
    print(f"[{route} {how}] upstream closed {ms(closed)} after the client left mid-body "
          f"({seen.body_bytes} of {seen.content_length} bytes arrived, {seen.error})"
          f"{stalls.note(at, seen.failed_at)}")
    assert seen.content_length == len(raw), f"engine saw Content-Length {seen.content_length}"
    assert seen.body_bytes < len(raw), f"engine got the whole body: {seen.body_bytes} bytes"
    assert engine.record.generations == [], "the engine must never have parsed the request"
    assert await no_event(engine.record.abort_event), (
        f"expected no abort for an incomplete request, got {engine.record.aborted_ids()}")
    await settle(sidecar.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    values = await metrics(sidecar.admin_port or 0)
    assert disconnect_counts(values) == {("/", "request_body"): 1}, disconnect_counts(values)
    assert samples(values, "cancel_sidecar_abort_calls_total") == {}, "no abort call expected"


async def test_aiohttp_client_closing_a_stream_aborts(engine: FakeEngine, sidecar: Servers,
                                                      stalls: Stalls) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{sidecar.proxy_port}{COMPLETIONS}?tokens=1000",
                          json={"prompt": ["a", "b", "c"], "stream": True}) as r:
            rid = r.headers["X-Request-Id"]
            first = await stalls.wait(r.content.readline(), "an SSE line")
            assert first.startswith(b"data:"), f"expected an SSE event, got {first!r}"
            at = time.monotonic()
            r.close()
        closed_at = await upstream_closed(engine, stalls)
        ids, aborted_at = await one_abort(engine, stalls, sidecar.proxy_port)
    closed = stalls.check("the upstream close", at, closed_at)
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[aiohttp close] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    assert ids == [f"cmpl-{rid}-{i}" for i in range(3)], f"expected 3 ids for {rid}, got {ids}"


async def test_aiohttp_client_cancelled_while_waiting_aborts(engine: FakeEngine,
                                                             sidecar: Servers,
                                                             stalls: Stalls) -> None:
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(
            f"http://127.0.0.1:{sidecar.proxy_port}{CHAT}?tokens=1000&interval=0.01",
            json={"messages": [], "stream": False}))
        await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
        at = time.monotonic()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        closed_at = await upstream_closed(engine, stalls)
        ids, aborted_at = await one_abort(engine, stalls, sidecar.proxy_port)
    closed = stalls.check("the upstream close", at, closed_at)
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[aiohttp cancel] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    engine_id = engine.record.generations[0].request_id
    assert ids == [f"chatcmpl-{engine_id}"], f"expected chatcmpl-{engine_id}, got {ids}"


# -- half-closed clients ------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["queued", "mid_stream"])
async def test_half_closed_client_counts_as_disconnected(engine: FakeEngine, sidecar: Servers,
                                                         stalls: Stalls, phase: str) -> None:
    """Policy: a client that shuts down its write side (``shutdown(SHUT_WR)``, a TCP FIN while
    it still reads) is treated as disconnected: the upstream connection is closed, the engine
    aborted, and the sidecar closes the client connection.

    Why: aiohttp's server protocol returns ``None`` from ``eof_received``, so the transport
    closes on a half-close and the handler is cancelled like on any lost connection. HTTP/1.1
    allows a half-close after a complete request, but LLM clients do not use it, and serving
    it would mean a FIN could never be told from a departed client, i.e. no cancellation for
    the most common way clients leave.
    """
    query, stream, phase_label = PHASES[phase]
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send("POST", CHAT + query, request_body({"messages": []}, stream))
        if phase == "mid_stream":
            await c.head()
            await c.read_until(b"data:")
        else:
            await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
        at = c.disconnect("half")
        closed_at = await upstream_closed(engine, stalls)
        ids, aborted_at = await one_abort(engine, stalls, sidecar.proxy_port)
        rest = await stalls.wait(c.reader.read(), "EOF from the sidecar")
        eof_at = time.monotonic()
    closed = stalls.check("the upstream close", at, closed_at)
    latency = stalls.check("the abort", at, aborted_at)
    stalls.check("EOF from the sidecar", at, eof_at)
    print(f"[half-close {phase}] upstream closed {ms(closed)}, abort {ms(latency)}, "
          f"{len(rest)} more bytes then EOF{stalls.note(at, aborted_at)}")
    assert b"[DONE]" not in rest, "the stream must not have completed"
    engine_id = engine.record.generations[0].request_id
    assert ids == [f"chatcmpl-{engine_id}"], f"expected chatcmpl-{engine_id}, got {ids}"
    counts = disconnect_counts(await metrics(sidecar.admin_port or 0))
    assert counts == {("/", phase_label): 1}, f"expected one {phase_label} disconnect: {counts}"


# -- no abort when there is nothing to abort ----------------------------------------------------

@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("end", ["json", "stream-terminator", "stream-done"])
async def test_client_leaving_right_after_the_end_costs_nothing(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, end: str, how: str) -> None:
    """``stream-done``: the client closes on ``data: [DONE]``, maybe before the sidecar has
    relayed the chunked terminator; the engine is finished, so that is no disconnect either."""
    stream = end != "json"
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send("POST", f"{CHAT}?tokens=5&interval=0.001", request_body({"messages": []}, stream))
        status, head = await c.head()
        assert status == 200, f"expected 200, got {status}"
        if stream:
            assert head.get("Transfer-Encoding") == "chunked", head
            await c.read_until(b"data: [DONE]\n\n")
            if end == "stream-terminator":
                await c.read_until(b"\r\n0\r\n\r\n")  # the chunked terminator: the end
        else:
            await stalls.wait(c.reader.readexactly(int(head["Content-Length"])), "the body")
        c.disconnect(how)
    assert await no_event(engine.record.abort_event), (
        f"expected no abort after a complete response, got {engine.record.aborted_ids()}")
    await settle(sidecar.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    gen = engine.record.generations[0]
    assert gen.finished and gen.closed_at is None, f"expected a finished generation: {gen}"
    values = await metrics(sidecar.admin_port or 0)
    assert disconnect_counts(values) == {}, f"no disconnect expected: {disconnect_counts(values)}"


@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/echo")])
async def test_non_generating_route_disconnect_closes_upstream_without_abort(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, method: str, path: str,
        how: str) -> None:
    body = b'{"prompt": "x"}' if method == "POST" else None
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send(method, f"{path}?hold=5", body)
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(path)), FOREVER),
                          f"{method} {path} to reach the engine")
        at = c.disconnect(how)
        seen = engine.watch.on(path)[0]
        await stalls.wait(engine.watch.until(lambda: seen.failed_at is not None, FOREVER),
                          "the upstream request to be closed")
        assert seen.failed_at is not None
    closed = stalls.check("the upstream close", at, seen.failed_at)
    print(f"[{method} {path} {how}] upstream closed {ms(closed)}{stalls.note(at, seen.failed_at)}")
    assert await no_event(engine.record.abort_event), (
        f"expected no abort for {path}, got {engine.record.aborted_ids()}")
    await settle(sidecar.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    counts = disconnect_counts(await metrics(sidecar.admin_port or 0))
    assert counts == {("/", "awaiting_response"): 1}, counts


# -- disconnect metrics -------------------------------------------------------------------------

async def test_disconnect_metric_counts_each_phase_per_route(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    routes = [{"prefix": "/v1", "engine": "local"}, {"prefix": "/", "engine": "local"}]
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=routes))
    port = servers.proxy_port
    # request_body on /v1
    raw = request_body({"messages": [], "pad": "p" * 20000}, True)
    async with raw_client(port, stalls) as c:
        c.send_head("POST", CHAT, [], len(raw))
        c.writer.write(raw[:100])
        await c.writer.drain()
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(CHAT)), FOREVER),
                          "the request to reach the engine")
        c.disconnect("rst")
        await stalls.wait(engine.watch.until(
            lambda: engine.watch.on(CHAT)[0].failed_at is not None, FOREVER),
            "the upstream connection to close")
    # before_first_byte on / (the generate route lies outside /v1)
    async with raw_client(port, stalls) as c:
        c.send("POST", f"{GENERATE}?first_byte_delay=5", request_body({}, True))
        await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
        c.disconnect("fin")
        await stalls.wait(engine.record.closed_event.wait(), "the upstream connection to close")
    # streaming on /v1
    async with raw_client(port, stalls) as c:
        c.send("POST", f"{COMPLETIONS}?tokens=1000", request_body({"prompt": "a"}, True))
        await c.read_until(b"data:")
        c.disconnect("rst")
        await stalls.wait(engine.watch.until(
            lambda: sum(s.failed_at is not None for s in engine.watch.on(COMPLETIONS)) == 1,
            FOREVER), "the upstream connection to close")
    await settle(port)
    values = await metrics(servers.admin_port or 0)
    counts = disconnect_counts(values)
    assert counts == {("/v1", "request_body"): 1, ("/", "before_first_byte"): 1,
                      ("/v1", "streaming"): 1}, f"unexpected disconnect counts {counts}"
    requests = {(dict(k)["route"], dict(k)["status_class"]): v
                for k, v in samples(values, "cancel_sidecar_requests_total").items()}
    assert requests.get(("/v1", "disconnected")) == 2, requests
    assert requests.get(("/", "disconnected")) == 1, requests


# -- the real CLI -------------------------------------------------------------------------------

CLI_KEY = "cli-sekret-key-1234"
CLI_GUARD_S = 2 * GUARD_S  # a second process, descheduled on its own on a loaded machine


@asynccontextmanager
async def cli_sidecar(tmp_path: Path, engine: FakeEngine) -> AsyncIterator[tuple[int, int, Path]]:
    """``python -m sidecar --config FILE`` with free ports; yields (proxy port, admin port,
    stderr file). Stops it with SIGTERM and checks it exits 0."""
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine.url,
                              "abort": {"api_key": CLI_KEY, "timeout_s": 1.0}}},
        "routes": [{"prefix": "/", "engine": "local"}],
        "log_level": "DEBUG",
    }))
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--config", str(config), cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            match = re.match(r"cancel-sidecar: proxy on 127\.0\.0\.1:(\d+), "
                             r"admin on 127\.0\.0\.1:(\d+)", line)
            assert match, (f"expected the 'proxy on HOST:PORT' line, got {line!r}; "
                           f"stderr: {stderr_path.read_text()}")
            yield int(match[1]), int(match[2]), stderr_path
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.communicate(), 10)
            except TimeoutError:
                proc.kill()
                await proc.communicate()
                raise AssertionError("the CLI did not stop within 10 s of SIGTERM") from None
    assert proc.returncode == 0, (f"expected exit 0 after SIGTERM, got {proc.returncode}; "
                                  f"stderr: {stderr_path.read_text()}")


async def test_cli_notices_mid_stream_disconnect(engine: FakeEngine, tmp_path: Path,
                                                 stalls: Stalls) -> None:
    async with cli_sidecar(tmp_path, engine) as (port, admin, stderr):
        async with raw_client(port, stalls) as c:
            c.send("POST", f"{COMPLETIONS}?tokens=1000",
                   request_body({"prompt": ["a", "b", "c"]}, True), [("X-Request-Id", "mine")])
            _, head = await c.head()
            await c.read_until(b"data:")
            at = c.disconnect("rst")
            closed_at = await upstream_closed(engine, stalls)
            await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
        rid = head["X-Request-Id"]
        await settle(port)
        await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1, WAIT_S,
                          engine="local", outcome="ok")
        counts = disconnect_counts(await metrics(admin))
    abort = engine.record.aborts
    closed = stalls.check("the upstream close", at, closed_at, CLI_GUARD_S)
    latency = stalls.check("the abort", at, abort[0].at, CLI_GUARD_S)
    print(f"[cli mid-stream] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, abort[0].at)}")
    assert [a.ids for a in abort] == [[f"cmpl-{rid}-{i}" for i in range(3)]], abort
    assert abort[0].authorization == f"Bearer {CLI_KEY}", abort[0].authorization
    assert engine.record.generations[0].request_id == rid
    assert counts == {("/", "streaming"): 1}, counts
    log = stderr.read_text()
    assert rid in log and "aborted" in log, f"expected the abort logged with {rid}: {log}"
    assert CLI_KEY not in log, "the api key appeared in the CLI's log"


async def test_cli_notices_half_close_while_queued_and_logs_abort_failure(
        engine: FakeEngine, tmp_path: Path, stalls: Stalls) -> None:
    engine.record.abort_status = 500
    async with cli_sidecar(tmp_path, engine) as (port, admin, stderr):
        async with raw_client(port, stalls) as c:
            c.send("POST", f"{CHAT}?first_byte_delay=5", request_body({"messages": []}, True))
            await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
            at = c.disconnect("half")
            closed_at = await upstream_closed(engine, stalls)
            await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
        await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1, WAIT_S,
                          engine="local", outcome="http_500")
        counts = disconnect_counts(await metrics(admin))
        # Other traffic is unaffected.
        await settle(port)
    rid = engine.record.generations[0].request_id
    aborted_at = engine.record.aborts[0].at
    closed = stalls.check("the upstream close", at, closed_at, CLI_GUARD_S)
    latency = stalls.check("the abort", at, aborted_at, CLI_GUARD_S)
    print(f"[cli half-close queued] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    assert engine.record.aborted_ids() == [f"chatcmpl-{rid}"], engine.record.aborted_ids()
    assert counts == {("/", "before_first_byte"): 1}, counts
    log = stderr.read_text()
    failure = [line for line in log.splitlines() if "WARNING" in line and "abort" in line]
    assert any(str(rid) in line and "HTTP 500" in line for line in failure), (
        f"expected a WARNING naming {rid} and HTTP 500, got: {log}")
    assert CLI_KEY not in log, "the api key appeared in the CLI's log"
