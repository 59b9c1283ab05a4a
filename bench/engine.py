"""The benchmark's fake engine: vLLM's HTTP surface at token speed, on raw uvloop Protocols.

``python -m bench.engine [--port 0]`` prints ``bench-engine: 127.0.0.1:PORT`` and serves until
SIGTERM. It is written on ``asyncio.Protocol`` with hand-made framing (no aiohttp) so it costs
a few microseconds per event and is never what limits a path. What it serves:

- ``POST /v1/chat/completions``: the body is read (``Content-Length`` or chunked) and ignored;
  the query string says what to answer (proxies forward it untouched):

  - ``mode=stream`` (default): ``200``, ``text/event-stream``, chunked; the first event at once
    (zero prefill), then one event every ``interval_us`` microseconds (default 20,000) until
    ``tokens`` events (default 256), then ``data: [DONE]`` and the last chunk. Each event is an
    OpenAI ``chat.completion.chunk`` of ~220 bytes starting ``data: {"t":NS,`` with ``NS`` the
    engine's ``time.monotonic_ns()`` at the write (see :mod:`bench.wire`);
  - ``mode=idle``: the head and the first event, then nothing until the client leaves;
  - ``mode=json``: one non-streaming ``chat.completion`` document with ``Content-Length``.

  ``s=TAG`` names the stream for the records below; ``rec=1`` records when its upstream
  connection closes before the stream ended.
- ``POST /inference/v1/abort_requests``: answers ``200 {}`` and records the monotonic time
  (ns) at which the call's head arrived and the ``request_ids`` of its body.
- ``GET /bench/records``: JSON ``{"now": NS, "aborts": [[NS, [ids]]], "closes": [[TAG, NS]],
  "request_ids": {TAG: X-Request-Id}, "events": total events sent}``;
  ``POST /bench/reset`` clears them. ``GET /health``: ``200``.

Uvloop's clock and timers have whole milliseconds, so an event goes out on the tick nearest its
due time (up to half a millisecond early); events are scheduled on absolute due times, so the
rate does not drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import time
from typing import cast
from urllib.parse import parse_qsl

import uvloop

from bench.wire import HEAD_END, ChunkedDecoder, parse_head

ABORT_PATH = "/inference/v1/abort_requests"
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
TIMER_SLACK_S = 0.0005
LAST_CHUNKS = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class Records:
    """What the engine saw, for the driver: abort calls, upstream closes, ids, event count."""

    def __init__(self) -> None:
        self.aborts: list[tuple[int, list[str]]] = []
        self.closes: list[tuple[str, int]] = []
        self.request_ids: dict[str, str] = {}
        self.events = 0

    def reset(self) -> None:
        self.aborts = []
        self.closes = []
        self.request_ids = {}
        self.events = 0

    def as_json(self) -> bytes:
        return json.dumps({"now": time.monotonic_ns(), "aborts": self.aborts,
                           "closes": self.closes, "request_ids": self.request_ids,
                           "events": self.events}).encode()


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), content_type, len(body), body))


class Stream:
    """One SSE response being generated on a connection."""

    __slots__ = ("conn", "event_tail", "handle", "interval_s", "left", "next_due", "record", "tag")

    def __init__(self, conn: EngineProtocol, tag: str, engine_id: str, tokens: int,
                 interval_s: float, record: bool) -> None:
        self.conn = conn
        self.tag = tag
        self.record = record
        self.left = tokens
        self.interval_s = interval_s
        self.handle: asyncio.TimerHandle | None = None
        self.next_due = 0.0
        created = int(time.time())
        # Everything after the timestamp: an OpenAI chat chunk of realistic size.
        self.event_tail = (
            f',"id":"{engine_id}","object":"chat.completion.chunk","created":{created},'
            '"model":"bench/fake-model-7b","choices":[{"index":0,"delta":{"content":" token"},'
            '"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def event(self) -> bytes:
        payload = b'data: {"t":%d%s' % (time.monotonic_ns(), self.event_tail)
        return b"%x\r\n%s\r\n" % (len(payload), payload)


class EngineProtocol(asyncio.Protocol):
    """One engine connection: keep-alive HTTP/1.1 requests, at most one at a time."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.head: tuple[str, str, dict[str, str]] | None = None
        self.body_left = 0
        self.chunked: ChunkedDecoder | None = None
        self.body = b""
        self.stream: Stream | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        stream = self.stream
        if stream is not None:
            if stream.handle is not None:
                stream.handle.cancel()
            if stream.record:
                self.records.closes.append((stream.tag, time.monotonic_ns()))
            self.stream = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.buf:
            if self.head is None:
                end = self.buf.find(HEAD_END)
                if end < 0:
                    return
                self.head = parse_head(self.buf[:end])
                self.buf = self.buf[end + 4:]
                fields = self.head[2]
                if "chunked" in fields.get("transfer-encoding", ""):
                    self.chunked = ChunkedDecoder()
                else:
                    self.body_left = int(fields.get("content-length", "0"))
                self.body = b""
            if self.chunked is not None:
                self.body += self.chunked.feed(self.buf)
                if not self.chunked.done:
                    self.buf = b""
                    return
                self.buf = self.chunked.rest
                self.chunked = None
            elif self.body_left:
                take = self.buf[:self.body_left]
                self.body += take
                self.body_left -= len(take)
                self.buf = self.buf[len(take):]
                if self.body_left:
                    return
            head, self.head = self.head, None
            self._handle(*head)

    def _handle(self, method: str, target: str, fields: dict[str, str]) -> None:
        assert self.transport is not None
        path, _, query = target.partition("?")
        if path == ABORT_PATH and method == "POST":
            arrived = time.monotonic_ns()
            ids = json.loads(self.body or b"{}").get("request_ids", [])
            self.records.aborts.append((arrived, ids))
            self.transport.write(_response("200 OK", b"{}"))
        elif path == "/v1/chat/completions" and method == "POST":
            self._chat(dict(parse_qsl(query)), fields)
        elif path == "/bench/records":
            self.transport.write(_response("200 OK", self.records.as_json()))
        elif path == "/bench/reset" and method == "POST":
            self.records.reset()
            self.transport.write(_response("200 OK", b"{}"))
        elif path == "/health":
            self.transport.write(_response("200 OK", b""))
        else:
            self.transport.write(_response("404 Not Found", b'{"error":"not found"}'))
        if self.stream is None and fields.get("connection", "").lower() == "close":
            self.transport.close()

    def _chat(self, query: dict[str, str], fields: dict[str, str]) -> None:
        assert self.transport is not None
        tag = query.get("s", "")
        request_id = fields.get("x-request-id")
        engine_id = f"chatcmpl-{request_id}" if request_id else f"chatcmpl-bench-{tag}"
        if request_id and tag:
            self.records.request_ids[tag] = request_id
        mode = query.get("mode", "stream")
        if mode == "json":
            body = json.dumps({
                "id": engine_id, "object": "chat.completion", "created": int(time.time()),
                "model": "bench/fake-model-7b", "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": "token " * 16},
                    "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
            }).encode()
            self.transport.write(_response("200 OK", body))
            return
        tokens = max(int(query.get("tokens", "256")), 1)
        interval_s = int(query.get("interval_us", "20000")) / 1e6
        stream = Stream(self, tag, engine_id, tokens, interval_s, query.get("rec") == "1")
        self.stream = stream
        first = STREAM_HEAD + stream.event()
        self.records.events += 1
        stream.left -= 1
        if mode == "idle":
            self.transport.write(first)
            return
        if stream.left == 0:
            self.transport.write(first + LAST_CHUNKS)
            self.stream = None
            return
        self.transport.write(first)
        stream.next_due = self.loop.time() + interval_s
        stream.handle = self.loop.call_at(stream.next_due, self._tick, stream)

    def _tick(self, stream: Stream) -> None:
        transport = self.transport
        if self.stream is not stream or transport is None or transport.is_closing():
            return
        now = self.loop.time()
        # Every event due by now, or within half a tick: uvloop's clock and timers have whole
        # milliseconds, and a timer set less than 1 ms ahead fires at once (a busy loop).
        while stream.left > 0 and stream.next_due <= now + TIMER_SLACK_S:
            transport.write(stream.event())
            self.records.events += 1
            stream.left -= 1
            stream.next_due += stream.interval_s
        if stream.left > 0:
            stream.handle = self.loop.call_at(max(stream.next_due, now + 0.001), self._tick,
                                              stream)
        else:
            transport.write(LAST_CHUNKS)
            self.stream = None


def raise_fd_limit(want: int = 65536) -> int:
    """Raise ``RLIMIT_NOFILE`` to ``want`` (root may raise the hard limit) or else to the hard
    limit; returns the soft limit now in force (inherited by child processes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    records = Records()
    server = await loop.create_server(lambda: EngineProtocol(records), "127.0.0.1", port,
                                      backlog=4096, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    print(f"bench-engine: 127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    raise_fd_limit()
    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()

