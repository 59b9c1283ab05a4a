"""The floor: the least a Python proxy on uvloop does per request and per disconnect.

Run beside the sidecar in the same phases, it splits a figure into what this machine, Python and
uvloop cost anyway and what the sidecar adds; and ``floor-aiohttp`` against ``floor-raw`` shows
what aiohttp's request handling costs by itself. Not a product and not a fallback: no limits,
timeouts, error answers, header rewriting or abort bookkeeping; it speaks only to
:mod:`bench.engine` (keep-alive, chunked SSE answers) and the bench's clients (bodies with
``Content-Length``, no pipelining).

``python -m bench.floor --engine-port P --downstream raw|aiohttp`` prints
``bench-floor: 127.0.0.1:PORT`` once it listens.

- Upstream (both): pooled keep-alive connections, one :class:`Upstream` Protocol each, the
  response parsed by httptools; every body piece goes to the client's transport in the same
  callback, framed as one chunk. The request carries ``X-Request-Id`` (a counter).
- Downstream ``raw``: one :class:`RawDownstream` Protocol per client connection, requests parsed
  by httptools; the response head is written by the floor.
- Downstream ``aiohttp``: aiohttp's low-level ``web.Server`` (no application, router or
  middleware) with handler cancellation on; the handler writes the head with
  ``StreamResponse.prepare`` and the body bytes go to the transport as in ``raw``.
- A client gone while its response runs: ``chatcmpl-{X-Request-Id}`` queued, one abort call per
  loop turn (``POST /inference/v1/abort_requests``) on a connection opened at start, then the
  upstream connection closed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json

import httptools
import uvloop
from aiohttp import web

ABORT_PATH = b"/inference/v1/abort_requests"
HEAD = (b"HTTP/1.1 %d OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n")
LAST_CHUNK = b"0\r\n\r\n"


class Aborter(asyncio.Protocol):
    """One warm connection to the engine; ids queued in a loop turn leave in one call."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.queued: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        pass  # the engine's 200 answers: read and dropped

    def abort(self, request_id: str) -> None:
        if not self.queued:
            asyncio.get_running_loop().call_soon(self.flush)
        self.queued.append(f"chatcmpl-{request_id}")

    def flush(self) -> None:
        body = json.dumps({"request_ids": self.queued}).encode()
        self.queued = []
        assert self.transport is not None
        self.transport.write(b"POST %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json"
                             b"\r\nContent-Length: %d\r\n\r\n%s" % (ABORT_PATH, len(body), body))


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the engine, relaying one response at a time to ``sink``."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: asyncio.Transport | None = None  # the client's, once it may be written
        self.held: list[bytes] = []  # what came before the sink (aiohttp: before prepare)
        self.head: asyncio.Future[int] | None = None  # status, for the aiohttp downstream
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, target: bytes, request_id: str, body: bytes,
             sink: asyncio.Transport | None) -> None:
        loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.sink, self.head, self.done = sink, loop.create_future(), loop.create_future()
        self.held = []
        assert self.transport is not None
        self.transport.write(b"POST %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/"
                             b"json\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (target, request_id.encode(), len(body), body))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.sink is not None:
            self.sink.write(HEAD % status)
        elif self.head is not None:
            self.head.set_result(status)

    def on_body(self, body: bytes) -> None:
        chunk = b"%x\r\n%s\r\n" % (len(body), body)
        if self.sink is not None:
            self.sink.write(chunk)
        else:
            self.held.append(chunk)

    def on_message_complete(self) -> None:
        assert self.done is not None
        self.done.set_result(None)
        if self.sink is not None:
            self.sink.write(LAST_CHUNK)
            self.sink = None
            self.floor.idle.append(self)
        else:
            self.held.append(LAST_CHUNK)  # back to the pool once attached

    def attach(self, sink: asyncio.Transport) -> None:
        """The aiohttp downstream's head went: what was held goes, the rest as it comes."""
        if self.held:
            sink.write(b"".join(self.held))
            self.held = []
        if self.done is not None and self.done.done():
            self.floor.idle.append(self)
        else:
            self.sink = sink

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self.floor.idle:
            self.floor.idle.remove(self)


class Floor:
    """The pool, the aborter and the request ids, shared by every client connection."""

    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        self.idle: list[Upstream] = []
        self.connecting: set[asyncio.Task[None]] = set()
        self.aborter = Aborter()
        self.ids = itertools.count()

    async def start(self) -> None:
        await asyncio.get_running_loop().create_connection(
            lambda: self.aborter, "127.0.0.1", self.engine_port)

    async def upstream(self) -> Upstream:
        if self.idle:
            return self.idle.pop()
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: Upstream(self), "127.0.0.1", self.engine_port)
        return connection

    def request_id(self) -> str:
        return f"{next(self.ids):032x}"


class RawDownstream(asyncio.Protocol):
    """One client connection: httptools parses, the floor answers."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.target = b""
        self.body: list[bytes] = []
        self.running: tuple[Upstream, str] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.target = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        if self.floor.idle:
            self.start(self.floor.idle.pop(), body)
        else:
            task = asyncio.get_running_loop().create_task(self.connect(body),
                                                          name="floor upstream connect")
            self.floor.connecting.add(task)  # held until done: the loop keeps only weak refs
            task.add_done_callback(self.floor.connecting.discard)

    async def connect(self, body: bytes) -> None:
        self.start(await self.floor.upstream(), body)

    def start(self, upstream: Upstream, body: bytes) -> None:
        request_id = self.floor.request_id()
        self.running = (upstream, request_id)
        upstream.send(self.target, request_id, body, self.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.running is not None:
            upstream, request_id = self.running
            if upstream.done is not None and not upstream.done.done():
                self.floor.aborter.abort(request_id)
                upstream.close()


def aiohttp_handler(floor: Floor) -> web.Server:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        upstream = await floor.upstream()
        request_id = floor.request_id()
        upstream.send(request.raw_path.encode(), request_id, body, None)
        assert upstream.head is not None and upstream.done is not None
        try:
            response = web.StreamResponse(status=await upstream.head,
                                          headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            writer = request.writer
            writer.send_headers()
            writer.chunked = False  # type: ignore[attr-defined]  # the relay frames the body
            assert request.transport is not None
            upstream.attach(request.transport)
            await upstream.done
        except asyncio.CancelledError:
            floor.aborter.abort(request_id)
            upstream.close()
            raise
        await response.write_eof()
        return response
    return web.Server(handle, handler_cancellation=True)


async def serve(engine_port: int, downstream: str) -> None:
    loop = asyncio.get_running_loop()
    floor = Floor(engine_port)
    await floor.start()
    if downstream == "raw":
        server = await loop.create_server(lambda: RawDownstream(floor), "127.0.0.1", 0,
                                          backlog=4096)
    else:
        server = await loop.create_server(aiohttp_handler(floor), "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(f"bench-floor: 127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-port", type=int, required=True)
    p.add_argument("--downstream", choices=["raw", "aiohttp"], default="raw")
    args = p.parse_args()
    uvloop.run(serve(args.engine_port, args.downstream))


if __name__ == "__main__":
    main()
