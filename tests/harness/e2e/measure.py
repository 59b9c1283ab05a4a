"""Measure, from vLLM's own ``/metrics``, how fast generation stops after a client disconnects.

Two tools, shared by ``tests/e2e/test_vllm_e2e.py`` and ``demo``:

- :class:`MetricsSampler`: a thread that polls ``GET /metrics`` every ``interval`` seconds
  (10 ms by default, on one keep-alive connection, re-opened after an error) and keeps
  ``(t, running, waiting,
  generation_tokens)`` samples, ``t`` in ``time.monotonic()`` seconds.
  :meth:`MetricsSampler.stop_report` turns the samples after a disconnect into a
  :class:`StopReport`.
- :class:`RawClient`: one HTTP/1.1 request on a raw asyncio connection, so the test decides the
  exact moment the client leaves (``transport.abort()`` sends a RST; ``close()`` a FIN).

Resolution: a sample is taken every ``interval`` plus one /metrics round trip (~5 ms), so the
times below are accurate to ~15 ms. vLLM updates ``vllm:generation_tokens_total`` in its API
process once per engine step output batch, and ``vllm:num_requests_running`` from the engine core's
scheduler stats of the last step (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.harness.e2e.vllm_server import parse_metrics


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() when the answer arrived, seconds
    running: float
    waiting: float
    generation_tokens: float


@dataclass(frozen=True)
class StopReport:
    """What happened after a disconnect at ``t0`` (monotonic seconds).

    ``ms_to_idle``: from ``t0`` to the first sample with running == waiting == 0 (None: never).
    ``ms_to_last_token``: from ``t0`` to the first sample that shows the final token count
    (0 if no token was counted after ``t0``). ``tokens_after``: tokens counted after ``t0``
    (final count minus the last sample before ``t0``). ``window_s``: how long was observed.
    """

    ms_to_idle: float | None
    ms_to_last_token: float
    tokens_after: int
    window_s: float
    running_at_end: int
    stale_ms: float
    max_gap_ms: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsSampler:
    """Poll ``{base_url}/metrics`` in a background thread until :meth:`close`.

    Use as a context manager. Sampling errors (e.g. a refused connection) are counted in
    ``errors`` and retried at the next tick; the thread never dies silently mid-test.
    """

    def __init__(self, base_url: str, interval: float = 0.01, timeout: float = 10.0) -> None:
        parts = urlsplit(base_url)
        assert parts.hostname is not None and parts.port is not None, base_url
        self._host, self._port = parts.hostname, parts.port
        self.interval = interval
        self.timeout = timeout
        self.samples: list[Sample] = []
        self.errors = 0
        self.max_gap = 0.0  # longest time between two samples: how stale the view could get
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)

    def read_once(self) -> Sample:
        """One fresh-connection read (for callers outside the sampling thread)."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            return self._read(conn)
        finally:
            conn.close()

    def _read(self, conn: http.client.HTTPConnection) -> Sample:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        m = parse_metrics(resp.read().decode())
        return Sample(time.monotonic(), m["running"], m["waiting"], m["generation_tokens"])

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port,
                                                        timeout=self.timeout)
            try:
                sample = self._read(self._conn)
            except (OSError, http.client.HTTPException, ValueError):  # ValueError: unparsed
                self.errors += 1
                self._conn.close()
                self._conn = None
            else:
                with self._lock:
                    self.samples.append(sample)
                self.max_gap = max(self.max_gap, sample.t - last)
                last = sample.t
            self._stop.wait(self.interval)
        if self._conn is not None:
            self._conn.close()

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def latest(self) -> Sample | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    async def wait_for(self, predicate: Any, guard_s: float, what: str) -> Sample:
        """Await a sample (taken from now on) for which ``predicate(sample)`` is true; every
        sample taken since the call counts, not only the latest one.

        Raises ``AssertionError`` naming ``what`` and what the sampler saw after ``guard_s``
        (the samples taken, their longest gap, the highest values, whether the thread lives)."""
        start = time.monotonic()
        seen = 0  # samples already checked
        while True:
            samples = self.snapshot()
            for s in samples[seen:]:
                if s.t >= start and predicate(s):
                    return s
            seen = len(samples)
            if time.monotonic() - start >= guard_s:
                break
            await asyncio.sleep(self.interval)
        since = [s for s in self.snapshot() if s.t >= start]
        gaps = [b.t - a.t for a, b in itertools.pairwise(since)]
        rose = next((s.t - start for s in since[1:]
                     if s.generation_tokens != since[0].generation_tokens), None)
        raise AssertionError(
            f"expected {what} within {guard_s}s; {len(since)} /metrics samples since, longest "
            f"gap {max(gaps, default=0.0):.2f}s, highest running "
            f"{max((s.running for s in since), default=None)}, generation_tokens "
            f"{since[0].generation_tokens if since else None} -> "
            f"{since[-1].generation_tokens if since else None} in "
            f"{len({s.generation_tokens for s in since})} distinct values (first rise at "
            f"+{rose}s), highest waiting "
            f"{max((s.waiting for s in since), default=None)}, sampler errors {self.errors}, "
            f"sampler thread alive {self._thread.is_alive()}; last sample: {self.latest()}")

    def stop_report(self, t0: float, until: float | None = None) -> StopReport:
        """Summarise the samples around a disconnect at ``t0`` (see :class:`StopReport`)."""
        samples = [s for s in self.snapshot() if until is None or s.t <= until]
        before = [s for s in samples if s.t <= t0]
        after = [s for s in samples if s.t > t0]
        assert before and after, f"need samples before and after the disconnect: {samples[-3:]}"
        base = before[-1].generation_tokens
        final = after[-1].generation_tokens
        first_final = next(s for s in after if s.generation_tokens == final)
        idle = next((s for s in after if s.running == 0 and s.waiting == 0), None)
        times = [before[-1].t] + [s.t for s in after]
        max_gap = max(b - a for a, b in itertools.pairwise(times))
        return StopReport(
            ms_to_idle=None if idle is None else round((idle.t - t0) * 1000, 1),
            ms_to_last_token=0.0 if final == base else round((first_final.t - t0) * 1000, 1),
            tokens_after=int(final - base),
            window_s=round(after[-1].t - t0, 3),
            running_at_end=int(after[-1].running),
            stale_ms=round((t0 - before[-1].t) * 1000, 1),
            max_gap_ms=round(max_gap * 1000, 1),
        )


class RawClient:
    """One HTTP/1.1 request on a raw connection; the caller decides when the client leaves."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def post(cls, base_url: str, path: str, body: dict[str, Any],
                   headers: dict[str, str] | None = None, guard_s: float = 30.0) -> RawClient:
        """Connect and send ``POST path`` with a JSON body; return before any response byte."""
        parts = urlsplit(base_url)
        assert parts.hostname is not None and parts.port is not None, base_url
        async with asyncio.timeout(guard_s):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        payload = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}",
                "Content-Type: application/json", f"Content-Length: {len(payload)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        return cls(reader, writer)

    async def read_head(self, guard_s: float = 30.0) -> None:
        """Read the status line and headers (header names lower-cased)."""
        async with asyncio.timeout(guard_s):
            raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()

    async def read_events(self, count: int, guard_s: float = 30.0) -> list[bytes]:
        """Read ``count`` SSE events (``data: ...`` lines) from a streaming body."""
        events: list[bytes] = []
        async with asyncio.timeout(guard_s):
            while len(events) < count:
                line = await self.reader.readline()
                if not line:
                    raise AssertionError(f"stream ended after {len(events)} of {count} events")
                if line.startswith(b"data: "):
                    events.append(line.rstrip(b"\r\n"))
        return events

    async def disconnect(self, how: str = "abort") -> float:
        """Leave now: ``abort`` (RST) or ``close`` (FIN). Return the monotonic time of leaving."""
        t0 = time.monotonic()
        if how == "abort":
            self.writer.transport.abort()
        else:
            self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 5)
        except (ConnectionError, TimeoutError):
            pass
        return t0
