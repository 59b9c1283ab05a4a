"""The benchmark's fake engine: vLLM's HTTP surface at token speed, on raw uvloop Protocols.

``python -m bench.engine [--port 0] [--api-servers N] [--seed S]`` prints ``bench-engine:
127.0.0.1:PORT`` and serves until SIGTERM. It is written on ``asyncio.Protocol`` with hand-made
framing (no aiohttp) so it costs a few microseconds per event and is never what limits a path.
What it serves:

- ``POST /v1/chat/completions``: the body is read (``Content-Length`` or chunked) and ignored;
  the query string says what to answer (proxies forward it untouched):

  - ``mode=stream`` (default): ``200``, ``text/event-stream``, chunked; the first event at once
    (zero prefill), then one event every ``interval_us`` microseconds (default 20,000) until
    ``tokens`` events (default 256), then ``data: [DONE]`` and the last chunk. Each event is an
    OpenAI ``chat.completion.chunk`` of ~220 bytes starting ``data: {"t":NS,`` with ``NS`` the
    engine's ``time.monotonic_ns()`` at the write (see :mod:`bench.wire`);
  - ``mode=idle``: the head and the first event, then nothing until the client leaves (or an
    abort ends it);
  - ``mode=json``: one non-streaming ``chat.completion`` document with ``Content-Length``.

  The stream's engine id is ``chatcmpl-{X-Request-Id}`` (``chatcmpl-bench-{TAG}`` without the
  header), as vLLM derives it. ``s=TAG`` names the stream for the records below; ``rec=1``
  records when its upstream connection closes while the stream runs, or after an abort ended
  it and before the connection carries another request.
- ``POST /inference/v1/abort_requests``: answers ``200 {}`` and records the monotonic time (ns)
  at which the call's head arrived, the ``request_ids`` of its body and the API-server process
  of the call's connection. Then, as vLLM does, every running stream of that process that an id
  names ends at once: a last event of the same format whose choice has ``"delta":{}`` and
  ``"finish_reason":"abort"``, then ``data: [DONE]`` and the last chunk (the connection stays
  open for the next request). Ids that name a stream of another process are misses: nothing
  changes (vLLM answers 200 all the same).
- ``GET /bench/records``: JSON ``{"now": NS, "aborts": [[NS, [ids]]], "abort_processes":
  [process], "abort_connections": [number], "closes": [[TAG, NS]], "stopped": {TAG: [NS,
  call]}, "owners": {TAG: process}, "request_ids": {TAG: X-Request-Id}, "events": total events
  sent, "api_servers": N, "accepted": [connections per process], "abort_hits": N,
  "abort_misses": N}``. ``abort_processes[i]``: the process that took ``aborts[i]``, and
  ``abort_connections[i]`` the number of its connection (the engine numbers the connections it
  accepts from 0); ``closes``: a ``rec=1`` stream's connection lost (while it ran: the engine's
  disconnect detection; or after an abort ended it: the proxy closed the connection all the
  same); ``stopped``: a stream ended by an abort, when its last event was written and the index
  in ``aborts`` of the call; ``owners``: the process of each ``rec=1`` stream;
  ``abort_misses``: ids named on a process other than their stream's. ``POST /bench/reset``
  clears them. ``GET /health``: ``200``; ``GET /version``: ``200 {"version":"bench"}`` (what the
  sidecar sends to keep an idle abort connection open).

Several API-server processes (``--api-servers N``, vLLM's ``vllm serve --api-server-count N``;
``../shared/notes/cancellation-facts.md``) are simulated in the one process behind the one port:
each accepted connection belongs for its life to one simulated process, and so does every
stream started on it; an abort call reaches only the streams of its own connection's process.
Which process takes a new connection is what vLLM 0.32's launcher does: the one with the fewest
open connections (``entrypoints/launchers/launcher.py``, ``NoSignalServer``; measured on real
vLLM by ``tests/e2e/probe_api_servers.py``), ties drawn from ``random.Random(seed)``, so a
run's spread is repeatable for the same sequence of connections. A stream's own connection
makes its owner the busiest process, so fresh connections go to the others. With ``N = 1``
every connection is process 0.

Uvloop's clock and timers have whole milliseconds, so an event goes out on the tick nearest its
due time (up to half a millisecond early); events are scheduled on absolute due times, so the
rate does not drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import signal
import time
from typing import Any, cast
from urllib.parse import parse_qsl

import uvloop

from bench.wire import HEAD_END, ChunkedDecoder, parse_head

ABORT_PATH = "/inference/v1/abort_requests"
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
TIMER_SLACK_S = 0.0005
LAST_CHUNKS = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
MODEL = "bench/fake-model-7b"


class Records:
    """What the engine saw, for the driver: abort calls and what they ended, upstream closes,
    ids, the process of each connection and stream, event count (module docstring)."""

    def __init__(self, api_servers: int) -> None:
        self.api_servers = api_servers
        self.reset()

    def reset(self) -> None:
        self.aborts: list[tuple[int, list[str]]] = []
        self.abort_processes: list[int] = []
        self.abort_connections: list[int] = []
        self.closes: list[tuple[str, int]] = []
        self.stopped: dict[str, tuple[int, int]] = {}
        self.owners: dict[str, int] = {}
        self.request_ids: dict[str, str] = {}
        self.accepted = [0] * self.api_servers
        self.abort_hits = 0
        self.abort_misses = 0
        self.events = 0

    def as_json(self) -> bytes:
        return json.dumps({"now": time.monotonic_ns(), "aborts": self.aborts,
                           "abort_processes": self.abort_processes,
                           "abort_connections": self.abort_connections,
                           "closes": self.closes, "stopped": self.stopped,
                           "owners": self.owners, "request_ids": self.request_ids,
                           "events": self.events, "api_servers": self.api_servers,
                           "accepted": self.accepted, "abort_hits": self.abort_hits,
                           "abort_misses": self.abort_misses}).encode()


class ApiServer:
    """One simulated API-server process: its running streams by engine id."""

    __slots__ = ("connections", "index", "live")

    def __init__(self, index: int) -> None:
        self.index = index
        self.live: dict[str, Stream] = {}
        self.connections = 0  # open now


class Engine:
    """The state every connection shares: the records and the simulated API-server processes."""

    def __init__(self, api_servers: int, seed: int) -> None:
        self.records = Records(api_servers)
        self.servers = [ApiServer(k) for k in range(api_servers)]
        self._rng = random.Random(seed)
        self.accepts = 0  # connections accepted so far: the next one's number

    def accept(self) -> ApiServer:
        """The process that accepts a new connection: the one with the fewest open connections,
        ties at random (module docstring); :meth:`closed` when it goes."""
        servers = self.servers
        if len(servers) == 1:
            chosen = servers[0]
        else:
            fewest = min(s.connections for s in servers)
            chosen = self._rng.choice([s for s in servers if s.connections == fewest])
        chosen.connections += 1
        self.records.accepted[chosen.index] += 1
        return chosen

    @staticmethod
    def closed(server: ApiServer) -> None:
        server.connections -= 1

    def owner(self, engine_id: str) -> ApiServer | None:
        return next((s for s in self.servers if engine_id in s.live), None)


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), content_type, len(body), body))


class Stream:
    """One SSE response being generated on a connection."""

    __slots__ = ("conn", "created", "engine_id", "event_tail", "handle", "interval_s", "left",
                 "next_due", "record", "tag")

    def __init__(self, conn: EngineProtocol, tag: str, engine_id: str, tokens: int,
                 interval_s: float, record: bool) -> None:
        self.conn = conn
        self.tag = tag
        self.engine_id = engine_id
        self.record = record
        self.left = tokens
        self.interval_s = interval_s
        self.handle: asyncio.TimerHandle | None = None
        self.next_due = 0.0
        self.created = int(time.time())
        # Everything after the timestamp: an OpenAI chat chunk of realistic size.
        self.event_tail = (
            f',"id":"{engine_id}","object":"chat.completion.chunk","created":{self.created},'
            f'"model":"{MODEL}","choices":[{{"index":0,"delta":{{"content":" token"}},'
            '"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def event(self) -> bytes:
        payload = b'data: {"t":%d%s' % (time.monotonic_ns(), self.event_tail)
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    def abort_event(self, now_ns: int) -> bytes:
        """The last event of a stream an abort ended, as vLLM's: ``finish_reason`` ``"abort"``
        (``vllm/v1/engine/__init__.py``, ``FinishReason.ABORT``)."""
        payload = (b'data: {"t":%d,"id":"%s","object":"chat.completion.chunk","created":%d,'
                   b'"model":"%s","choices":[{"index":0,"delta":{},"logprobs":null,'
                   b'"finish_reason":"abort"}]}\n\n'
                   % (now_ns, self.engine_id.encode(), self.created, MODEL.encode()))
        return b"%x\r\n%s\r\n" % (len(payload), payload)


class EngineProtocol(asyncio.Protocol):
    """One engine connection: keep-alive HTTP/1.1 requests, at most one at a time, all of them
    owned by the API-server process that accepted it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.records = engine.records
        self.server = engine.servers[0]
        self.number = 0  # the engine's count of accepted connections when this one came
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.head: tuple[str, str, dict[str, str]] | None = None
        self.body_left = 0
        self.chunked: ChunkedDecoder | None = None
        self.body = b""
        self.stream: Stream | None = None
        self.aborted: Stream | None = None  # a rec=1 stream an abort ended, until the next request
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server = self.engine.accept()
        self.number = self.engine.accepts
        self.engine.accepts += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.closed(self.server)
        stream = self.stream
        if stream is not None:
            if stream.handle is not None:
                stream.handle.cancel()
            if stream.record:
                self.records.closes.append((stream.tag, time.monotonic_ns()))
            self._ended(stream)
        elif self.aborted is not None:
            self.records.closes.append((self.aborted.tag, time.monotonic_ns()))
            self.aborted = None

    def _ended(self, stream: Stream) -> None:
        """``stream`` runs no more: off the connection and off its process's running streams."""
        self.stream = None
        live = self.server.live
        if live.get(stream.engine_id) is stream:
            del live[stream.engine_id]

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
            self._abort()
        elif path == "/v1/chat/completions" and method == "POST":
            self._chat(dict(parse_qsl(query)), fields)
        elif path == "/bench/records":
            self.transport.write(_response("200 OK", self.records.as_json()))
        elif path == "/bench/reset" and method == "POST":
            self.records.reset()
            self.transport.write(_response("200 OK", b"{}"))
        elif path == "/health":
            self.transport.write(_response("200 OK", b""))
        elif path == "/version":  # the sidecar keeps idle abort connections open with it
            self.transport.write(_response("200 OK", b'{"version":"bench"}'))
        else:
            self.transport.write(_response("404 Not Found", b'{"error":"not found"}'))
        if self.stream is None and fields.get("connection", "").lower() == "close":
            self.transport.close()

    def _abort(self) -> None:
        """vLLM's abort endpoint: ``200 {}`` whatever the ids, then the streams of this
        connection's process that they name end at once (module docstring)."""
        assert self.transport is not None
        arrived = time.monotonic_ns()
        records = self.records
        ids: Any = json.loads(self.body or b"{}").get("request_ids", [])
        call = len(records.aborts)
        records.aborts.append((arrived, ids))
        records.abort_processes.append(self.server.index)
        records.abort_connections.append(self.number)
        self.transport.write(_response("200 OK", b"{}"))
        live = self.server.live
        for engine_id in ids if isinstance(ids, list) else ():
            if not isinstance(engine_id, str):
                continue
            stream = live.get(engine_id)
            if stream is not None:
                records.abort_hits += 1
                stream.conn.end_aborted(stream, call)
            elif self.engine.owner(engine_id) is not None:
                records.abort_misses += 1

    def end_aborted(self, stream: Stream, call: int) -> None:
        """An abort call (index ``call`` in the records) ended ``stream``: its abort event, then
        ``data: [DONE]`` and the last chunk; the connection stays for the next request."""
        if stream.handle is not None:
            stream.handle.cancel()
        self._ended(stream)
        now = time.monotonic_ns()
        if stream.tag:
            self.records.stopped[stream.tag] = (now, call)
        if stream.record:
            self.aborted = stream
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(stream.abort_event(now) + LAST_CHUNKS)

    def _chat(self, query: dict[str, str], fields: dict[str, str]) -> None:
        assert self.transport is not None
        self.aborted = None
        tag = query.get("s", "")
        request_id = fields.get("x-request-id")
        engine_id = f"chatcmpl-{request_id}" if request_id else f"chatcmpl-bench-{tag}"
        if request_id and tag:
            self.records.request_ids[tag] = request_id
        mode = query.get("mode", "stream")
        if mode == "json":
            body = json.dumps({
                "id": engine_id, "object": "chat.completion", "created": int(time.time()),
                "model": MODEL, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": "token " * 16},
                    "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
            }).encode()
            self.transport.write(_response("200 OK", body))
            return
        tokens = max(int(query.get("tokens", "256")), 1)
        interval_s = int(query.get("interval_us", "20000")) / 1e6
        record = query.get("rec") == "1"
        stream = Stream(self, tag, engine_id, tokens, interval_s, record)
        first = STREAM_HEAD + stream.event()
        self.records.events += 1
        stream.left -= 1
        if stream.left == 0 and mode != "idle":
            self.transport.write(first + LAST_CHUNKS)
            return
        self.stream = stream
        self.server.live[engine_id] = stream
        if record and tag:
            self.records.owners[tag] = self.server.index
        self.transport.write(first)
        if mode == "idle":
            return
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
            self._ended(stream)


def raise_fd_limit(want: int = 65536) -> int:
    """Raise ``RLIMIT_NOFILE`` to ``want`` (root may raise the hard limit) or else to the hard
    limit; returns the soft limit now in force (inherited by child processes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve(port: int, api_servers: int = 1, seed: int = 0) -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(api_servers, seed)
    server = await loop.create_server(lambda: EngineProtocol(engine), "127.0.0.1", port,
                                      backlog=4096, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    print(f"bench-engine: 127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api-servers", type=_positive, default=1,
                   help="simulated API-server processes behind the port (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the accept race between API-server processes (default 0)")
    args = p.parse_args(argv)
    raise_fd_limit()
    uvloop.run(serve(args.port, args.api_servers, args.seed))


if __name__ == "__main__":
    main()
