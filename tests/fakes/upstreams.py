"""Misbehaving upstreams the fake engine cannot play, as raw asyncio servers on 127.0.0.1.

:class:`RawUpstream` reads each request (head plus a Content-Length or chunked body) and writes
whatever bytes its ``respond`` callable returns: a response with hand-written hop-by-hop headers,
a malformed status line, or nothing at all (a listener that accepts and never answers). With
``idle_close_s`` it closes a keep-alive connection that stays idle that long, like an engine's
HTTP server does; with ``drop_idle_s`` it plays the race an idle close can win: a request
that arrives on a used connection idle that long is met by a close, its body unread.

A response that does not close its connection and is not followed by another request leaves the
upstream silent on that connection: ``respond`` returning only a head, or a head and some events,
plays an engine that stalls mid-response. :attr:`RawUpstream.open` says which connections are
still open at the server side, for leak checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RawRequest:
    head: bytes
    body: bytes
    connection: int  # 0, 1, ...: which upstream connection carried it


Responder = Callable[[RawRequest], bytes | None]


class RawServer:
    """An asyncio server on 127.0.0.1, a free port: :meth:`_serve` runs per connection, and
    :meth:`stop` resets every connection whose writer is in ``_writers``. Subclasses that are
    dataclasses declare ``port``, ``_server`` and ``_writers`` as fields instead of calling
    ``__init__``."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class RawUpstream(RawServer):
    """A raw HTTP/1.1 server. ``respond(request)`` gives the response bytes, or ``None`` to
    never answer: the connection then stays open until :meth:`stop`, or is closed at once with
    ``drop_unanswered``. ``close_after_response`` closes every connection after one response."""

    def __init__(self, respond: Responder, *, idle_close_s: float | None = None,
                 close_after_response: bool = False, drop_unanswered: bool = False,
                 drop_idle_s: float | None = None) -> None:
        super().__init__()
        self.respond = respond
        self.drop_unanswered = drop_unanswered
        self.drop_idle_s = drop_idle_s
        self.dropped = 0  # requests met by a close (drop_idle_s)
        self.dropped_event = asyncio.Event()
        self.idle_close_s = idle_close_s
        self.close_after_response = close_after_response
        self.requests: list[RawRequest] = []
        self.connections = 0
        self.open: set[int] = set()  # numbers of the connections not yet closed
        self.received = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        self.open.add(conn)
        self._writers.add(writer)
        answered_at: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_close_s):
                        head = await reader.readuntil(b"\r\n\r\n")
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return  # idle too long, or the client went away
                if (self.drop_idle_s is not None and answered_at is not None
                        and loop.time() - answered_at >= self.drop_idle_s):
                    self.dropped += 1
                    self.dropped_event.set()
                    return
                request = RawRequest(head, await read_request_body(reader, head), conn)
                self.requests.append(request)
                self.received.set()
                response = self.respond(request)
                if response is None:
                    if not self.drop_unanswered:
                        await reader.read()  # hold the connection open, never answer
                    return
                writer.write(response)
                await writer.drain()
                answered_at = loop.time()
                if self.close_after_response:
                    return
        except ConnectionError:
            return
        finally:
            self.open.discard(conn)
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def read_request_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The body a request ``head`` announces (chunked or ``Content-Length``), read whole."""
    fields = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
        return body
    return await reader.readexactly(int(fields.get(b"content-length", b"0")))


def refused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
