"""The wire of an upgraded connection (:mod:`sidecar.tunnel`): its two sides, and how a side is
ended::

    EngineSide        the raw TCP connection to the engine (an asyncio.Protocol opened with
                      loop.create_connection): the engine's head parsed with httptools (llhttp):
                      101 -> its head's bytes, and any bytes after them, for the tunnel;
                      non-101 -> its status, headers and body for the refusal relay; then every
                      byte handed to the tunnel (:meth:`Splice.from_engine`)
    ClientSide        the parser aiohttp hands every client byte after the request head to
                      (:meth:`Splice.from_client`), and the client connection lost
    SwitchedResponse  what the handler returns for a relayed 101: aiohttp writes nothing more
    reset_transport   end a side with a TCP reset; close_transport: with a FIN after flushing
    Splice            what the two sides call on the tunnel they feed (sidecar.tunnel.Tunnel)

Where aiohttp hands over (aiohttp 3.14, ``web_protocol.RequestHandler``). The tunnel keeps the
handler task running for the session's life and uses the takeover ``web_ws.WebSocketResponse``
uses (``_post_start``): ``request.protocol.set_parser(parser)`` then
``request.protocol.keep_alive(False)``. ``set_parser`` is the public hook for "the rest of this
connection is another protocol": from then on ``data_received`` feeds every byte to the parser's
``feed_data`` (and it first feeds the bytes aiohttp buffered past the request head,
``_message_tail``), and ``connection_lost`` calls its ``feed_eof``. aiohttp keeps owning the
transport and the connection's bookkeeping (the server's connection list, handler cancellation,
graceful shutdown), so nothing else has to be re-implemented or patched. Rejected: replacing the
protocol with ``transport.set_protocol`` (aiohttp then never hears ``connection_lost``: its
server leaks the connection, its handler is never cancelled), and writing the ``101`` through
``StreamResponse.prepare`` (it adds ``Date``/``Server`` when absent: the engine's head is relayed
as its bytes instead, and :class:`SwitchedResponse` tells aiohttp it is already sent).
``set_parser`` alone cannot tell a client's FIN from its reset (``connection_lost``'s exception
is not passed on for a bodiless request): :class:`sidecar.downstream.DownstreamHandler` records
it as ``lost_with``. aiohttp's parser switches to "upgraded" (bytes after the head are not HTTP)
only for ``Upgrade: websocket`` or ``tcp``; for another token, bytes a client sends before the
``101`` arrives are parsed as HTTP (clients wait for the ``101``, as RFC 9110 section 7.8 asks).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from typing import Protocol, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict

from sidecar.errors import UpstreamDisconnected, UpstreamError, UpstreamProtocolError
from sidecar.upstream import MAX_HEADER_BYTES, READ_BUFFER_BYTES

FLUSH_S = 5.0  # after a FIN-close, how long unsent bytes may wait for a reader, then a reset
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


class Splice(Protocol):
    """What :class:`EngineSide` and :class:`ClientSide` call on the tunnel they feed: bytes and
    ends from each side, the engine's write buffer full or drained. ``switched``: the engine's
    ``101`` was relayed and the sockets are spliced; ``early``: engine bytes that came with the
    ``101``'s head, kept until then."""

    switched: bool
    early: bytes

    def from_client(self, data: bytes) -> None: ...

    def from_engine(self, data: bytes) -> None: ...

    def client_lost(self) -> None: ...

    def engine_lost(self, exc: BaseException | None) -> None: ...

    def pause_client(self) -> None: ...

    def resume_client(self) -> None: ...


def reset_transport(transport: asyncio.Transport) -> None:
    """Close ``transport`` with a TCP reset (unsent bytes dropped); nothing if it is already
    closing (its socket may be gone)."""
    if transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass  # already closed underneath: abort() below is all there is to do
    transport.abort()


def close_transport(transport: asyncio.Transport) -> None:
    """Close ``transport`` with a FIN once its unsent bytes are written; a reader that takes
    more than ``FLUSH_S`` seconds for them gets a reset instead (no fd waits on it forever)."""
    if transport.is_closing():
        return
    transport.close()
    if transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(FLUSH_S, transport.abort)


class SwitchedResponse(web.StreamResponse):
    """What the handler returns for a relayed ``101``: its head was written verbatim by the
    tunnel and the connection is no longer HTTP, so aiohttp's ``prepare``/``write_eof`` (which
    ``RequestHandler.finish_response`` calls after the handler) write nothing."""

    def __init__(self) -> None:
        super().__init__(status=101)
        self.force_close()

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


class ClientSide:
    """The parser handed to aiohttp's ``RequestHandler.set_parser``: every client byte after
    the request head goes to the tunnel; ``feed_eof`` is the client connection lost."""

    def __init__(self, tunnel: Splice) -> None:
        self._tunnel = tunnel

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self._tunnel.from_client(data)
        return False, b""  # never "end of message": aiohttp would close the connection

    def feed_eof(self) -> None:
        self._tunnel.client_lost()


class EngineSide(asyncio.Protocol):
    """The raw connection to the engine: the response head parsed with httptools, then (after
    a ``101``) every byte handed to the tunnel. ``write_buffer_bytes``: the high-water mark of
    its write buffer (``downstream.write_buffer_bytes``)."""

    def __init__(self, tunnel: Splice, write_buffer_bytes: int) -> None:
        self.tunnel = tunnel
        self.write_buffer_bytes = write_buffer_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head = bytearray()  # the response head's bytes so far (and what followed them)
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.headers_done = False
        self.message_done = False
        self.status = 0
        self.reason = ""
        self.ready: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.body: deque[bytes] = deque()  # a refused upgrade's body, not yet relayed
        self.body_bytes = 0
        self.body_event = asyncio.Event()
        self.upgraded = False  # a 101's head was read: what follows is the new protocol
        self.lost = False
        self.lost_with: BaseException | None = None

    # -- httptools callbacks (the head and a refused upgrade's body) -----------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_bytes += len(body)
        self.body_event.set()
        if self.body_bytes > READ_BUFFER_BYTES and self.transport is not None:
            self.transport.pause_reading()  # resumed as the handler relays it

    def on_message_complete(self) -> None:
        self.message_done = True
        self.body_event.set()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=self.write_buffer_bytes)

    def data_received(self, data: bytes) -> None:
        if self.tunnel.switched:
            self.tunnel.from_engine(data)
        elif self.upgraded:  # after the 101's head, before the relay starts: keep it
            self.tunnel.early += data
        elif not self.message_done:
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        """Feed the response head (and a refused upgrade's body) to llhttp, which refuses
        control characters and bare LFs in a head. Refused (-> 502): a malformed head, one
        over ``MAX_HEADER_BYTES``, an interim 1xx other than 101."""
        if not self.headers_done:
            self.head += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # llhttp stops at the end of a 101's head: the rest of ``data`` is the new protocol.
            end = len(self.head) - len(data) + int(exc.args[0])
            self._switch(end)
            return
        except httptools.HttpParserError as exc:
            if self.headers_done and self.status == 101:
                # A 101 without "Connection: upgrade": llhttp refuses to go on, but the engine
                # switched all the same; its head ends at the first empty line.
                end = self.head.find(b"\r\n\r\n")
                if end >= 0:
                    self._switch(end + 4)
                    return
            self._fail(UpstreamProtocolError(f"malformed response head: {exc}"))
            return
        if not self.headers_done:
            if len(self.head) > MAX_HEADER_BYTES:
                self._fail(UpstreamProtocolError(
                    f"response head over {MAX_HEADER_BYTES} bytes"))
        elif self.head and self.head.find(b"\r\n\r\n") + 4 > MAX_HEADER_BYTES:
            self._fail(UpstreamProtocolError(f"response head over {MAX_HEADER_BYTES} bytes"))
        elif self.status == 101:  # the upgrade exception comes with the head's last byte
            self._fail(UpstreamProtocolError("101 response head did not end as one"))
        elif self.status < 200:
            self._fail(UpstreamProtocolError(f"interim response {self.status} to an upgrade"))
        elif not self.ready.done():
            self.head.clear()
            self.ready.set_result(b"")  # a refused upgrade: the caller reads headers and body

    def _switch(self, end: int) -> None:
        if self.ready.done():
            return
        if end > MAX_HEADER_BYTES:
            self._fail(UpstreamProtocolError(f"response head over {MAX_HEADER_BYTES} bytes"))
            return
        head, tail = bytes(self.head[:end]), bytes(self.head[end:])
        self.head.clear()
        self.upgraded = True
        self.tunnel.early = tail
        self.ready.set_result(head)

    def _fail(self, exc: UpstreamError) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.tunnel.pause_client()

    def resume_writing(self) -> None:
        self.tunnel.resume_client()

    def eof_received(self) -> bool:
        self.tunnel.engine_lost(None)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost, self.lost_with = True, exc
        self.body_event.set()
        if not self.ready.done():
            self.ready.set_exception(UpstreamDisconnected(
                f"closed the connection before a complete response head ({exc})"))
        self.tunnel.engine_lost(exc)
