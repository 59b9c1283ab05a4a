"""The benchmark's load client: many streaming clients on raw uvloop Protocols, one process.

``python -m bench.client`` reads one JSON command per line on stdin and answers one JSON line
on stdout (the driver, :mod:`bench.run`, keeps it running across phases). Times are
``time.monotonic_ns()``, the engine's clock too (see :mod:`bench.wire`). What it measures:

- time to first token (TTFT): request written -> first SSE event read, per request;
- inter-token latency (ITL): gap between consecutive SSE events of one stream at the client;
- delivery latency: client read time - the engine's send time stamped in the event; unlike
  ITL it is the path's own delay, so path minus direct is what a proxy adds per event.

Commands (``port`` is the path under test: the engine, the sidecar or nginx):

- ``streams``: ``n`` concurrent streams of ``tokens`` events every ``interval_us``, started
  over a ramp of ``max(interval, n * 0.2 ms)``; meanwhile a prober sends one-event requests one
  at a time (``probe_pause_ms`` apart) on a keep-alive connection, so TTFT is sampled hundreds
  of times at any ``n`` with ``n`` streams open. Answers percentiles and event counts.
- ``idle_open`` / ``idle_close``: open ``n`` idle streams (head + first event, then silence)
  in batches, keep them, later reset them all.
- ``storm``: open ``n`` streams, wait until each has events, then close ``close`` of them (every
  other one) in one tight loop, RST (``SO_LINGER`` 0) or FIN; each close time is taken in
  ``connection_lost``, which uvloop calls right before it closes the socket; answers ``{tag:
  close ns}``; the rest are closed ``settle_s`` later.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import struct
import sys
import time
from typing import Any, cast

import uvloop

from bench.engine import raise_fd_limit
from bench.wire import EVENT_PREFIX, HEAD_END, ChunkedDecoder

BODY = json.dumps({"model": "bench/fake-model-7b", "stream": True, "max_tokens": 256,
                   "messages": [{"role": "user", "content": "Write a short poem."}]}).encode()
LINGER_RST = struct.pack("ii", 1, 0)
PERCENTILES = (50, 90, 99, 100)

_tags = itertools.count()


def request(mode: str, tokens: int, interval_us: int, *, record: bool = False) -> tuple[str, bytes]:
    """A new stream tag and the request bytes that ask the engine for that stream."""
    tag = f"c{next(_tags)}"
    target = (f"/v1/chat/completions?mode={mode}&tokens={tokens}&interval_us={interval_us}"
              f"&s={tag}" + ("&rec=1" if record else ""))
    return tag, (f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
                 ).encode() + BODY


class Samples:
    """Latency samples in nanoseconds and event counts of one phase."""

    def __init__(self) -> None:
        self.ttft: list[int] = []
        self.itl: list[int] = []
        self.delivery: list[int] = []
        self.events = 0
        self.errors = 0
        self.first_event = 0
        self.last_event = 0

    def summary(self) -> dict[str, Any]:
        return {"ttft_ms": percentiles(self.ttft), "itl_ms": percentiles(self.itl),
                "delivery_ms": percentiles(self.delivery), "events": self.events,
                "errors": self.errors,
                "span_s": (self.last_event - self.first_event) / 1e9 if self.events else 0.0}


def percentiles(values: list[int]) -> dict[str, float]:
    """p50/p90/p99/p100 (max) of nanosecond samples, in milliseconds; ``n`` the sample count."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    last = len(ordered) - 1
    out: dict[str, float] = {"n": len(ordered)}
    for p in PERCENTILES:
        out[f"p{p}"] = ordered[min(last, round(p / 100 * last))] / 1e6
    return out


class StreamConnection(asyncio.Protocol):
    """One downstream connection sending ``count`` requests one after another (keep-alive)."""

    def __init__(self, samples: Samples, make_request: Any, count: int = 1,
                 pause_s: float = 0.0, min_events: int = 1) -> None:
        self.samples = samples
        self.make_request = make_request
        self.left = count
        self.pause_s = pause_s
        self.transport: asyncio.Transport | None = None
        self.tag = ""
        self.sent_at = 0
        self.last = 0
        self.events = 0
        self.head = b""
        self.decoder: ChunkedDecoder | None = None
        self.sse = b""
        self.loop = asyncio.get_running_loop()
        self.finished = self.loop.create_future()  # all requests answered, or the connection lost
        self.min_events = min_events
        self.ready = self.loop.create_future()  # min_events events of the current stream read
        self.closing = False  # close() was called: a lost response is not an error
        self.closed_at = 0  # monotonic ns at connection_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._send()

    def _send(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.tag, data = self.make_request()
        self.left -= 1
        self.last = 0
        self.events = 0
        self.head = b""
        self.decoder = None
        self.sse = b""
        self.sent_at = time.monotonic_ns()
        self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        # uvloop calls this just before it closes the socket (RST or FIN goes out then), one
        # loop turn after transport.abort()/close(): this is the client's close instant.
        self.closed_at = time.monotonic_ns()
        if not self.finished.done():
            if (self.decoder is not None or self.head) and not self.closing:
                self.samples.errors += 1  # lost mid-response
            self.finished.set_result(None)
        if not self.ready.done():
            self.ready.set_result(False)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        decoder = self.decoder
        if decoder is None:
            self.head += data
            end = self.head.find(HEAD_END)
            if end < 0:
                return
            if self.head[9:12] != b"200" or b"chunked" not in self.head[:end].lower():
                self.samples.errors += 1
                assert self.transport is not None
                self.transport.abort()
                return
            data = self.head[end + 4:]
            self.head = b""
            decoder = self.decoder = ChunkedDecoder()
        payload = decoder.feed(data)
        if payload:
            sse = self.sse + payload if self.sse else payload
            start = 0
            samples = self.samples
            while (end := sse.find(b"\n\n", start)) >= 0:
                if sse.startswith(EVENT_PREFIX, start):
                    sent = int(sse[start + 11:sse.find(b",", start + 11)])
                    samples.delivery.append(now - sent)
                    if self.last:
                        samples.itl.append(now - self.last)
                    else:
                        samples.ttft.append(now - self.sent_at)
                    self.last = now
                    self.events += 1
                    samples.events += 1
                    if not samples.first_event:
                        samples.first_event = now
                    samples.last_event = now
                start = end + 2
            self.sse = sse[start:]
            if self.events >= self.min_events and not self.ready.done():
                self.ready.set_result(True)
        if decoder.done:
            self.decoder = None
            if self.left > 0:
                if self.pause_s:
                    self.loop.call_later(self.pause_s, self._send)
                else:
                    self._send()
            else:
                if not self.finished.done():
                    self.finished.set_result(None)
                assert self.transport is not None
                self.transport.close()

    def close(self, rst: bool) -> None:
        """Close the connection (RST or FIN); the socket closes on the loop's next turn, and
        :attr:`closed_at` records when."""
        assert self.transport is not None
        self.closing = True
        if rst:
            sock = self.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
            self.transport.abort()
        else:
            self.transport.close()


async def connect(port: int, conn: StreamConnection) -> StreamConnection:
    loop = asyncio.get_running_loop()
    try:
        await loop.create_connection(lambda: conn, "127.0.0.1", port)
    except OSError:
        conn.samples.errors += 1
        if not conn.finished.done():
            conn.finished.set_result(None)
        if not conn.ready.done():
            conn.ready.set_result(False)
    return conn


async def streams(cmd: dict[str, Any]) -> dict[str, Any]:
    port, n, tokens, interval_us = cmd["port"], cmd["n"], cmd["tokens"], cmd["interval_us"]
    timeout_s = cmd.get("timeout_s", 60.0)
    main, probe = Samples(), Samples()
    ramp_s = max(interval_us / 1e6, n * 0.0002)
    started = time.monotonic()

    async def one(i: int) -> None:
        await asyncio.sleep(ramp_s * i / n)
        conn = StreamConnection(main, lambda: request("stream", tokens, interval_us))
        await connect(port, conn)
        await conn.finished

    async def prober() -> None:
        await asyncio.sleep(ramp_s + interval_us / 1e6)
        conn = StreamConnection(probe, lambda: request("stream", 1, interval_us),
                                count=10**9, pause_s=cmd.get("probe_pause_ms", 10) / 1e3)
        await connect(port, conn)
        try:
            await conn.finished
        finally:
            if conn.transport is not None:
                conn.transport.close()

    probe_task = asyncio.create_task(prober(), name="prober") if cmd.get("probe", True) else None
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout_s)
    except TimeoutError:
        timed_out = True
    if probe_task is not None:
        probe_task.cancel()
        await asyncio.wait({probe_task})  # its end, without swallowing a cancel of our own
    wall = time.monotonic() - started
    return {"main": main.summary(), "probe": probe.summary(), "wall_s": wall,
            "timed_out": timed_out,
            "events_per_s": main.events / main.summary()["span_s"] if main.events > 1 else 0.0}


class Client:
    """State kept between commands: the idle streams."""

    def __init__(self) -> None:
        self.idle: list[StreamConnection] = []

    async def idle_open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        samples = Samples()
        batch = cmd.get("batch", 200)
        for start in range(0, cmd["n"], batch):
            conns = [StreamConnection(samples, lambda: request("idle", 2, 20000))
                     for _ in range(min(batch, cmd["n"] - start))]
            await asyncio.gather(*(connect(cmd["port"], c) for c in conns))
            for c in conns:
                await asyncio.wait_for(asyncio.shield(c.ready), cmd.get("timeout_s", 30.0))
            self.idle.extend(c for c in conns if c.ready.result())
        return {"open": len(self.idle), "errors": samples.errors}

    async def idle_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for c in self.idle:
            c.close(rst=True)
        count, self.idle = len(self.idle), []
        await asyncio.sleep(0.2)
        return {"closed": count}

    async def storm(self, cmd: dict[str, Any]) -> dict[str, Any]:
        samples = Samples()
        port, n, interval_us = cmd["port"], cmd["n"], cmd["interval_us"]
        tags: list[str] = []

        def make() -> tuple[str, bytes]:
            tag, data = request("stream", 10**6, interval_us, record=True)
            tags.append(tag)
            return tag, data

        conns: list[StreamConnection] = []
        for start in range(0, n, 200):
            batch = [StreamConnection(samples, make, min_events=3)
                     for _ in range(min(200, n - start))]
            await asyncio.gather(*(connect(port, c) for c in batch))
            conns.extend(batch)
        await asyncio.wait_for(asyncio.gather(*(asyncio.shield(c.ready) for c in conns)),
                               cmd.get("timeout_s", 60.0))
        live = [c for c in conns if c.ready.result()]
        await asyncio.sleep(cmd.get("steady_s", 0.5))
        chosen = live[::2][:cmd["close"]]
        rst = cmd.get("how", "rst") == "rst"
        asked = time.monotonic_ns()
        for c in chosen:
            c.close(rst)
        await asyncio.sleep(cmd.get("settle_s", 1.0))
        closed = {c.tag: c.closed_at for c in chosen if c.closed_at}
        for c in live[1::2]:
            c.close(rst=True)
        await asyncio.sleep(0.2)
        return {"closed": closed, "open": len(live), "errors": samples.errors,
                "close_spread_ms": (max(closed.values()) - min(closed.values())) / 1e6
                if closed else 0.0,
                "close_lag_ms": (min(closed.values()) - asked) / 1e6 if closed else 0.0}


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    client = Client()
    commands = {"streams": streams, "idle_open": client.idle_open,
                "idle_close": client.idle_close, "storm": client.storm}
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "now":
            result: dict[str, Any] = {"now": time.monotonic_ns()}
        else:
            result = await commands[cmd["cmd"]](cmd)
        print(json.dumps(result), flush=True)


def main() -> None:
    raise_fd_limit()
    uvloop.run(serve())


if __name__ == "__main__":
    main()
