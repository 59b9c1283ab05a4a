"""Helpers shared by the cancellation tests: raw-socket clients with exact disconnect timing,
event-driven waits that exclude time this process did not run, and /metrics readers.

Timing: waits are event-driven with a generous limit (``WAIT_S``); latencies are then asserted
against ``GUARD_S`` and printed (run with ``-s``). Time during which this test process did not
run at all (measured by :class:`Stalls`, the session fixture ``stalls`` in ``tests/conftest.py``:
on a loaded 2-CPU machine a process was seen descheduled for 8-10 s at a time) is excluded from
every latency before it is compared with its bound (and printed with it), and extends every
wait's limit, since after such a stall the wait's timer fires before the I/O it was waiting for
is processed. "Nothing happened" is checked by an event-or-timeout wait (``QUIET_S``) followed by
a full request through the sidecar (:func:`settle`), so an abort that was going to be sent has
had every chance to arrive.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

import aiohttp
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.engine import FakeEngine

T = TypeVar("T")

GUARD_S = 1.0  # upper bound for "promptly": disconnect -> upstream closed / abort arrived
WAIT_S = 10.0  # how long any wait for an expected event may take before the test fails
FOREVER = 3600.0  # for waits that Stalls.wait bounds
QUIET_S = 0.3  # how long to wait for something that must NOT happen, before settle()
API_KEY = "sekret-key"  # what tests/conftest.py configures as abort.api_key
RESEND_FIRST_S = 0.005  # documented (engines.*.abort): the first re-send, after the first call

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"


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
            if not any(k.lower() == "content-type" for k, _ in headers):
                lines.append("Content-Type: application/json")
            lines.append(f"Content-Length: {content_length}")
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

def max_calls(first_at: float, window_end: float, max_interval_s: float) -> int:
    """The most calls that may name one engine id of a request whose first abort call was made
    at ``first_at`` (no earlier than its client left) and whose window closes at
    ``window_end`` (no later than the engine's arrival + ``resend_window_s``): the first call,
    re-sends ``RESEND_FIRST_S`` after it with intervals doubling up to ``max_interval_s`` while
    before ``window_end``, the one at ``window_end``, and one more since re-sends due within a
    couple of ms leave together (one may go a little early). Earlier ``first_at`` and later
    ``window_end`` only allow more, so the client-side and engine-side times bound it."""
    if window_end <= first_at:
        return 1
    calls, at, gap = 1, first_at, RESEND_FIRST_S
    while at + gap < window_end:
        at += gap
        calls += 1
        gap = min(2 * gap, max_interval_s)
    return calls + 2


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
    """Wait for the engine to stop its last generation before its end: aborted (ended at once,
    as vLLM ends an aborted request, which the sidecar reads as its confirmation) or its
    connection gone; returns when it did."""
    await stalls.wait(engine.record.stopped_event.wait(),
                      "the engine to stop the generation (aborted, or its connection closed)")
    gen = engine.record.generations[-1]
    assert gen.stopped_at is not None and not gen.finished, (
        f"expected the generation cut short, got finished={gen.finished} "
        f"closed_at={gen.closed_at} aborted_at={gen.aborted_at}")
    return gen.stopped_at


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
