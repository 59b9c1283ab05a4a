"""The relay: connections to engines as asyncio protocols, each response body written from the
engine's socket straight to the client's transport.

Why not aiohttp's client here: it hands every body chunk to the handler through a
``StreamReader``, so each SSE event cost a task wake-up, aiohttp's chunk framing and two
``await``s (the profile of ``python -m bench``: about 55% of the proxy's CPU per event). Here
each socket read is one Python step::

    uvloop -> UpstreamConnection.data_received(data)      the engine's bytes
           -> httptools (llhttp) parses them: on_body(piece)
           -> Downstream.write(piece): chunk framing, transport.write to the client

    UpstreamConnection (asyncio.Protocol): one request at a time; a response read to its end
        with keep-alive goes back to the pool, any other is closed
    UpstreamResponse: one attempt's response: its head (a future), then its body relayed
    Downstream: the client's side: framing, counters, backpressure

The connections are opened and kept by :mod:`sidecar.pool` (``UpstreamPool``); while clients
leave, their reads are held by :mod:`sidecar.read_pacer` (``ReadPacer``).

Backpressure: when the client's transport holds more than its high-water mark
(``downstream.write_buffer_bytes``), the downstream protocol's ``pause_writing`` pauses reading
the engine's socket, and ``resume_writing`` resumes it; the engine's writes then wait in the
kernel's buffers. aiohttp still terminates client connections, parses requests and writes the
response head (:class:`sidecar.downstream.DownstreamHandler` carries the two hooks).

Errors are :mod:`sidecar.errors` (those of connecting: :mod:`sidecar.pool`):
:class:`UpstreamDisconnected` (the engine closed or reset the connection: before the head, or
mid-body), :class:`UpstreamProtocolError` (bytes that are not an HTTP/1.x response, a
header field over ``MAX_HEADER_BYTES``), :class:`UpstreamReadTimeout` (no body byte within
``read_timeout_s`` while the client was not the one slowing the relay).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from functools import lru_cache
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.errors import (
    UpstreamDisconnected,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamReadTimeout,
)
from sidecar.read_pacer import CLOCK_RESOLUTION_S, MAX_HELD_BYTES, ReadPacer

MAX_HEADER_BYTES = 65536  # one header field (request or response; aiohttp's default: 8190)
MAX_HEAD_BYTES = 4 * MAX_HEADER_BYTES
SSE_DONE = b"data: [DONE]\n\n"
# Interim statuses llhttp ends without a body (100 Continue, 102 Processing, 103 Early Hints)
_INTERIM = frozenset({100, 102, 103})


class Origin:
    """Where an engine listens: ``host``, ``port``, TLS or not, and the ``Host`` field to send."""

    __slots__ = ("host", "host_field", "port", "tls")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.host_field = parts.netloc

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host_field}"


@lru_cache(maxsize=1024)
def origin(base_url: str) -> Origin:
    """The :class:`Origin` of an engine's ``base_url`` (``scheme://host:port``), parsed once."""
    return Origin(base_url)


def chunk_frame(piece: bytes) -> bytes:
    """``piece`` as one HTTP/1.1 chunk (RFC 9112 section 7.1): size in hex, CRLF, data, CRLF."""
    return b"%x\r\n%b\r\n" % (len(piece), piece)


class Downstream:
    """The client's side of the byte path: frames each body piece as the client's response
    needs (chunked, or raw for a length- or close-delimited one), writes it to the client's
    transport and keeps what the proxy asks about afterwards: ``bytes_sent``, the last piece
    (``tail``; at least its last ``len(SSE_DONE)`` bytes) and whether the stream ended with the
    OpenAI end event (``saw_done_event``).

    ``paused``: the client's transport is over its high-water mark (``pause_writing``): the
    engine's socket is not read, and that time does not count toward ``read_timeout_s``.
    """

    __slots__ = ("bytes_sent", "chunked", "gone", "paused", "saw_done_event", "tail",
                 "transport", "upstream")

    def __init__(self, transport: asyncio.Transport, chunked: bool) -> None:
        self.transport = transport
        self.chunked = chunked
        self.bytes_sent = 0
        self.tail = b""
        self.saw_done_event = False
        self.paused = False
        self.gone = False  # the client left and its abort is queued: the handler is told later
        self.upstream: UpstreamResponse | None = None

    def write(self, piece: bytes) -> None:
        """Relay one body piece. If the client is gone: dropped if :attr:`gone` (the proxy knows
        and tears the handler down in its turn), else kept by the relaying response
        (:meth:`UpstreamResponse.client_lost`: its parser stays whole, for a watcher that may
        read on), or ``ConnectionResetError`` raised."""
        transport = self.transport
        if transport.is_closing():
            if self.gone:
                return
            if self.upstream is not None:
                self.upstream.client_lost(piece)
                return
            raise ConnectionResetError("the client's connection is closing")
        self.account(piece)
        transport.write(chunk_frame(piece) if self.chunked else piece)

    def account(self, piece: bytes) -> None:
        """Count ``piece`` as relayed (:meth:`write`, or aiohttp's write of the head with the
        body that came with it)."""
        # The OpenAI end-of-stream event means the engine is done: a client that closes on
        # reading it (before the upstream's final chunk) is not a disconnect.
        # ``tail``: the last piece, or, after a short one, the last len(SSE_DONE) bytes relayed
        # (the end event may come in any number of pieces: one per chunk of the engine's).
        tail = piece if len(piece) >= len(SSE_DONE) else (self.tail + piece)[-len(SSE_DONE):]
        self.saw_done_event = tail.endswith(SSE_DONE)
        self.tail = tail
        self.bytes_sent += len(piece)

    def pause_writing(self) -> None:
        """From the client's protocol: its transport is over the high-water mark. A response
        read to its end leaves its connection alone (pooled, or another request's by now)."""
        self.paused = True
        if self.upstream is not None and not self.upstream.complete:
            self.upstream.connection.pause_reading()

    def resume_writing(self) -> None:
        """From the client's protocol: its transport drained below the low-water mark."""
        self.paused = False
        if self.upstream is not None and not self.upstream.complete:
            self.upstream.resumed()


class Watcher(Protocol):
    """What reads a response after its client left and its engine was told to abort it
    (:class:`sidecar.confirm.Confirmation`): its head if it comes only then (:meth:`began`),
    every body piece, then its end or loss."""

    paused: bool  # never: nobody slow is behind it

    def began(self) -> None: ...

    def write(self, piece: bytes) -> None: ...

    def ended(self) -> None: ...


class UpstreamResponse:
    """One attempt's response on an :class:`UpstreamConnection`: the httptools callbacks.

    ``head`` resolves once the status line and headers are parsed (``status``, ``reason``,
    ``headers``), or raises the attempt's :class:`~sidecar.errors.UpstreamError`. Body pieces
    that arrive before :meth:`relay` are kept in order. Once :meth:`watch` hands it to a
    :class:`Watcher`, the pieces, the end and a loss go there, whatever the handler does.
    """

    def __init__(self, connection: UpstreamConnection, head_only: bool) -> None:
        loop = connection.loop
        self.connection = connection
        # The parser calls this response's bound methods: a reference cycle, broken once no
        # byte can reach it (:meth:`_release`).
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        # What aiohttp's client allowed engines (aiohttp/_http_parser.pyx, HttpResponseParser):
        # header bytes llhttp calls invalid (control characters are refused by the proxy:
        # has_forbidden_characters), a bare LF ending a line, whitespace after a chunk size.
        self.parser.set_dangerous_leniencies(lenient_headers=True,
                                             lenient_optional_cr_before_lf=True,
                                             lenient_spaces_after_chunk_size=True)
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] | None = None  # while relaying
        self.head_only = head_only
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self._fields: list[tuple[str, str]] = []
        self.uploading: asyncio.Task[None] | None = None  # the rest of the request body
        self.head_bytes = 0
        self.complete = False  # the whole response was read
        self.interim = False  # parsing a 1xx (skipped)
        self.failure: BaseException | None = None
        self.pending: list[bytes] = []  # body pieces before relay()
        self.downstream: Downstream | Watcher | None = None
        self.watcher: Watcher | None = None  # after the client left (watch)
        self.reading_since: float | None = None  # loop time the relay began waiting for bytes
        self._timer: asyncio.TimerHandle | None = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the whole response: the engine's framing is off
            raise UpstreamProtocolError("bytes after the end of the response")

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("utf-8", "surrogateescape")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_HEADER_BYTES:
            raise UpstreamProtocolError(f"a response header field over {MAX_HEADER_BYTES} bytes")
        self._fields.append((name.decode("utf-8", "surrogateescape"),
                             value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        assert self.parser is not None  # called by it
        self.status = self.parser.get_status_code()
        if self.status in _INTERIM:
            # RFC 9110 section 15.2: a client must parse 1xx answers it did not expect (as
            # aiohttp's client did: skipped). llhttp ends them with no body; the final
            # response follows.
            self.interim = True
            self._fields.clear()
            self.reason = ""
            return
        if self.status < 200:  # 101 or an unknown 1xx: its framing is not HTTP/1.1's
            raise UpstreamProtocolError(f"an unexpected interim response {self.status}")
        self.headers = CIMultiDictProxy(CIMultiDict(self._fields))
        if not self.head.done():  # cancelled with a handler whose client left: watched now
            self.head.set_result(None)
        if self.watcher is not None:  # the engine began it after its client left
            self.watcher.began()
        if self.head_only:  # a response to HEAD: no body, whatever its framing says
            raise _HeadOnly

    def on_body(self, piece: bytes) -> None:
        if self.downstream is None:
            self.pending.append(piece)
        else:
            self.downstream.write(piece)

    def on_message_complete(self) -> None:
        if self.interim:  # the end of a 1xx: the final response is still to come
            self.interim = False
            return
        self.complete = True
        assert self.parser is not None  # called by it, or at its end (_HeadOnly, a close)
        self.connection.finished(self, self.parser.should_keep_alive())
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
        if self.watcher is not None:
            self.watcher.ended()
        self._release()

    # the handler's side
    def take_pending(self) -> bytes:
        """The body bytes that arrived with or after the head, before :meth:`relay`."""
        pending, self.pending = self.pending, []
        return b"".join(pending)

    async def relay(self, downstream: Downstream, read_timeout_s: float | None) -> None:
        """Relay the body to ``downstream`` and return once it is whole. Raises
        :class:`UpstreamDisconnected` (the engine's side cut it short),
        :class:`UpstreamProtocolError`, :class:`UpstreamReadTimeout`, or
        ``ConnectionResetError`` if the client is gone. Cancellation leaves the connection to
        :meth:`close`."""
        if self.watcher is not None:  # the client left before the relay began: watched now
            raise ConnectionResetError("the client left before its response was relayed")
        self.downstream = downstream
        downstream.upstream = self
        if pending := self.take_pending():
            downstream.write(pending)
        if self.complete:  # its connection is pooled or closed already: not to be paused
            return
        if downstream.paused:  # the client's transport is over its high-water mark already
            self.connection.pause_reading()
        if self.failure is not None:
            raise self.failure
        loop = self.connection.loop
        self.done = loop.create_future()
        self.reading_since = loop.time()
        if read_timeout_s is not None:
            self._timer = loop.call_later(read_timeout_s, self._check, read_timeout_s)
        try:
            await self.done
        finally:
            # What it raised holds this frame, which holds this response: no cycle through it.
            self.done = None
            if self._timer is not None:
                self._timer.cancel()
            downstream.upstream = None
            if self.downstream is downstream:  # not handed to a watcher meanwhile
                self.downstream = None

    def watch(self, watcher: Watcher) -> None:
        """The client left (or the sidecar ends the request) and the engine is being told to
        abort it: from now on every body piece goes to ``watcher`` instead of the client, and
        the response's end or loss is reported to it (``ended``), whether or not the handler
        still runs. The engine's socket is read again if a slow client had paused it; closing
        the response is then the watcher's to do (:meth:`close`)."""
        if isinstance(self.failure, ConnectionResetError):
            # A write found the client gone before the proxy knew (data_received): the
            # client's loss, not the engine's; the response goes on for the watcher.
            self.failure = None
        if pending := self.take_pending():
            watcher.write(pending)
        if self.complete or self.failure is not None:
            watcher.ended()  # not kept: released already (_release), nothing more comes
            return
        self.watcher = watcher
        self.downstream = watcher
        # Unread while clients leave (ReadPacer.park: the aborts go first), else read now (a
        # slow client may have paused it).
        if not self.connection.pool.reads.park(self.connection):
            self.connection.resume_reading()

    def client_lost(self, piece: bytes) -> None:
        """A write found the client gone before the proxy knew: ``piece`` is kept (a watcher
        may read on: :meth:`watch`), reading stops, and the relay fails with
        ``ConnectionResetError``. Nothing is raised through the parser: llhttp accepts no more
        bytes after a callback raised."""
        self.pending.append(piece)
        self.connection.pause_reading()
        self.fail(ConnectionResetError("the client's connection is closing"))

    def resumed(self) -> None:
        self.reading_since = self.connection.loop.time()
        self.connection.resume_reading()

    def fail(self, exc: BaseException) -> None:
        """The attempt failed: its head or its body relay raises ``exc``; a watcher hears
        that the response ended."""
        if self.failure is None:
            self.failure = exc
            if self.watcher is not None and not isinstance(exc, ConnectionResetError):
                self.watcher.ended()  # the engine's side ended (not a write to a gone client)
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: a re-sent attempt may never await it
        elif self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    def expire(self, timeout_s: float) -> None:
        """No head within ``timeout_s`` (``upstream.first_byte_timeout_s``:
        :class:`sidecar.pool.Deadlines`): the wait for it raises
        :class:`UpstreamFirstByteTimeout`. Not a failure of the response: whoever was told of it
        closes it, or reads the engine's answer to the abort on it (:meth:`watch`)."""
        if not self.head.done():
            self.head.set_exception(UpstreamFirstByteTimeout(
                f"no response from {self.connection.origin} within {timeout_s}s"))

    def close(self) -> None:
        """A response not read to its end: its connection is never used again."""
        if not self.complete:
            self.connection.close()
        if self.uploading is not None:
            self.uploading.cancel()

    def forget_tracebacks(self) -> None:
        """The request is over: what this response failed with (:attr:`failure`, the exception
        of :attr:`head`) keeps no traceback. Raised through the handler, it holds the
        handler's frames, which hold this response: a cycle otherwise. (A watcher that reads on
        only asks whether it failed.)"""
        if self.failure is not None:
            self.failure.__traceback__ = None
        head = self.head
        if head.done() and not head.cancelled() and (exc := head.exception()) is not None:
            exc.__traceback__ = None

    def _release(self) -> None:
        """No byte reaches this response again (read to its end, or its connection lost): drop
        the references that point back at it (its parser's callbacks, its watcher's, its read
        deadline's, its upload's), so that reference counting frees it and all it holds at once.

        Left to the cyclic collector, every response outlived young collections under load, and
        pymalloc keeps an arena while one object lives in it: after 6,000 requests of
        tests/load/test_soak.py ~60,000 objects waited for a middle-generation collection, and
        the process kept 36 arenas for 21 MB of live objects (24 before the run)."""
        self.parser = None
        self.watcher = self.downstream = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.uploading is not None:  # its frame holds this response
            self.uploading.cancel()  # nowhere to write to any more
            self.uploading = None

    def _check(self, timeout_s: float) -> None:
        """The read deadline: one timer re-armed at most once per ``timeout_s``; a piece read
        moves ``reading_since`` (:meth:`UpstreamConnection.data_received`)."""
        loop = self.connection.loop
        since = self.reading_since
        downstream = self.downstream
        if downstream is not None and downstream.paused:  # the client is slow, not the engine
            self._timer = loop.call_later(timeout_s, self._check, timeout_s)
        elif since is not None and loop.time() - since < timeout_s - CLOCK_RESOLUTION_S:
            self._timer = loop.call_at(since + timeout_s, self._check, timeout_s)
        else:
            self._timer = None
            self.fail(UpstreamReadTimeout(
                f"no response body byte from {self.connection.origin} within {timeout_s}s"))
            self.connection.close()


class _HeadOnly(Exception):
    """Raised from ``on_headers_complete`` to stop httptools at the end of a head with no body
    (llhttp's "skip the body" answer is not reachable through httptools)."""


class Pool(Protocol):
    """What a connection asks of its pool (:class:`sidecar.pool.UpstreamPool`)."""

    reads: ReadPacer  # holds the engines' reads while clients leave

    def idle(self, connection: UpstreamConnection) -> None: ...

    def lost(self, connection: UpstreamConnection) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an engine, carrying one request at a time."""

    def __init__(self, pool: Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None  # the attempt in flight
        self.in_use = False  # counted against max_connections (UpstreamPool)
        self.idle = False  # in the pool's idle list
        self.reused = False  # taken from the idle list: it carried a request before
        self._drained: asyncio.Future[None] | None = None  # while writing waits (pause_writing)
        self._reading = True
        self._ended = False  # retire() or end() was called: nothing more is written or pooled
        self._held: list[bytes] | None = None  # reads kept while clients leave (ReadPacer)
        self.held_bytes = 0  # their size: at most MAX_HELD_BYTES plus one read
        self.queued = False  # in the ReadPacer's line
        self.parked = False  # reading paused by the ReadPacer until clients stop leaving
        self.unparked_at = -1.0  # loop time at which the ReadPacer last resumed its reading

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def _hold(self, data: bytes) -> None:
        response = self.response
        if response is not None:
            response.reading_since = self.loop.time()
        reads = self.pool.reads
        reads.held_reads += 1
        held = self._held
        if held is None:
            held = self._held = []
            reads.wait(self)  # once in line, also after a relay beyond MAX_HELD_BYTES
        held.append(data)
        self.held_bytes += len(data)
        if self.held_bytes > MAX_HELD_BYTES:
            self.relay_held()

    @property
    def watched(self) -> bool:
        """True if the response in flight is read for a watcher (its client left:
        :meth:`UpstreamResponse.watch`), not relayed to a client."""
        response = self.response
        return response is not None and response.watcher is not None

    @property
    def reads_held(self) -> bool:
        """True while engine reads of this connection wait in :class:`ReadPacer` because
        clients are still leaving: held, parked (unread), or resumed in this loop tick (what
        the engine sent is read in the coming poll)."""
        return (self.parked or self.unparked_at == self.loop.time()
                or (self._held is not None and self.pool.reads.holding))

    def relay_held(self) -> bool:
        """Relay the reads :class:`ReadPacer` held, as one piece; False if none were held (or
        they were dropped)."""
        held, self._held = self._held, None
        self.held_bytes = 0
        if not held:
            return False
        self.data_received(b"".join(held), held_back=True)
        return True

    def data_received(self, data: bytes, held_back: bool = False) -> None:
        """An engine read: relayed now, or held while clients leave (:class:`ReadPacer`);
        ``held_back``: reads that were held, relayed now (:meth:`relay_held`)."""
        # Bytes on an idle connection are never held: it is closed at once, before the pool can
        # hand it to the next request (which would get them as its response).
        if not held_back and (self._held is not None or (
                self.pool.reads.holding and self.response is not None)):
            self._hold(data)
            return
        response = self.response
        if response is None:  # bytes nobody asked for: the framing is lost
            self.close()
            return
        response.reading_since = self.loop.time()
        head_pending = not response.head.done()
        if head_pending:
            response.head_bytes += len(data)
        parser = response.parser
        assert parser is not None  # released only once it is no connection's response
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # Not a local here: this frame is in the traceback of what a callback raised.
            self._raised_in_callback(response, exc.__context__)
        except httptools.HttpParserError as exc:
            self._failed(response, UpstreamProtocolError(
                f"{self.origin} sent bytes that are not an HTTP/1.x response: "
                f"{type(exc).__name__}"))
        else:
            # Checked once the read is parsed: body bytes read with the end of the head are no
            # part of it (one read holds up to 256000 bytes).
            if head_pending and not response.head.done() and response.head_bytes > MAX_HEAD_BYTES:
                self._failed(response, UpstreamProtocolError(
                    f"{self.origin} sent a response head over {MAX_HEAD_BYTES} bytes"))

    def _raised_in_callback(self, response: UpstreamResponse, cause: BaseException | None
                            ) -> None:
        """A parser callback of ``response`` raised ``cause``; the parser takes no more bytes."""
        if isinstance(cause, _HeadOnly):
            response.on_message_complete()
        elif isinstance(cause, ConnectionResetError):  # the client is gone mid-write
            self.pause_reading()
            response.fail(cause)
        else:
            self._failed(response, cause if isinstance(cause, UpstreamError) else
                         UpstreamProtocolError(f"{self.origin} sent a malformed response"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay_held()  # what the engine sent before it closed comes first
        self.transport = None
        self.resume_writing()  # an upload waiting to write finds the connection closed
        self.pool.lost(self)
        response = self.response
        if response is None or response.complete:
            return
        if response.head.done() and exc is None and _close_delimited(response):
            response.on_message_complete()  # its end is the close (HTTP/1.0 style): a FIN;
            return  # a reset (exc) cuts it short
        where = ("mid-response" if response.head.done()
                 else "mid-head" if response.head_bytes else "before responding")
        error = UpstreamDisconnected(
            f"{self.origin} closed the connection {where}" + (f": {exc}" if exc else ""))
        error.answered = response.head_bytes > 0
        response.fail(error)
        self.response = None
        response._release()

    def pause_writing(self) -> None:
        self._drained = self.loop.create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # the pool's and the handler's side
    def send(self, head: bytes, body: Iterable[bytes], head_only: bool) -> UpstreamResponse:
        """Write a request (``head`` and the ``body`` framed as its head says) and return its
        :class:`UpstreamResponse`; more of the body may follow through :meth:`write_body`."""
        assert self.transport is not None and self.response is None
        response = self.response = UpstreamResponse(self, head_only)
        self.transport.write(b"".join((head, *body)))
        return response

    async def write_body(self, data: bytes) -> None:
        """Write more of the request body, waiting while the engine reads slowly. Raises
        ``ConnectionResetError`` if the connection is closed."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._ended:
            raise ConnectionResetError("the upstream connection is closed")
        transport.write(data)
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def pause_reading(self) -> None:
        transport = self.transport
        if self._reading and transport is not None and not transport.is_closing():
            self._reading = False
            transport.pause_reading()

    def resume_reading(self) -> None:
        transport = self.transport
        if not self._reading and transport is not None and not transport.is_closing():
            self._reading = True
            transport.resume_reading()

    def finished(self, response: UpstreamResponse, keep_alive: bool) -> None:
        """``response`` was read to its end: back to the pool if the engine keeps the
        connection open, else closed."""
        if self.response is response:
            self.response = None
            uploading = response.uploading
            if uploading is not None and not uploading.done():
                # The engine answered before the whole request body went out: the rest would
                # share the connection with the next request. Never pooled; the upload ends.
                uploading.cancel()
                self.close()
            elif keep_alive and self.reusable:
                # Reading may be paused for this response's slow client (its last write
                # crossed the high-water mark): the connection is done with that client, and
                # an idle one is read, to notice the engine closing it.
                self.resume_reading()
                self.pool.idle(self)
            else:
                self.close()

    def close(self) -> None:
        self._held, self.held_bytes = None, 0  # the response is given up: never relayed
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    def retire(self) -> bool:
        """The client left and its abort is queued: stop reading the engine's response, and
        never write to nor pool this connection again (:attr:`reusable` is False from now on);
        :meth:`end` follows. The pool's reads are held meanwhile (:class:`ReadPacer`). False
        (nothing done) if the engine's side is closed already (its ``connection_lost`` is
        queued)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        self.pause_reading()
        self._ended = True
        self._held, self.held_bytes = None, 0  # for a client that is gone
        self.pool.reads.hold()
        return True

    def end(self) -> None:
        """End the connection on the engine's side now: ``shutdown(SHUT_RDWR)`` (the engine
        reads EOF at once; what it still sends is dropped); the transport stays for the
        handler's teardown to close, and the connection is never used again.

        On the transport's own descriptor, wrapped without a duplicate and detached again
        (uvloop's transport sockets refuse ``shutdown()``; ``transport.write_eof()`` would wait
        for a loop iteration of libuv's). The descriptor is the connection's as long as the
        transport is not closing: uvloop closes it only after that."""
        transport = self.transport
        self._ended = True
        if transport is None or transport.is_closing():
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0,
                             transport.get_extra_info("socket").fileno())
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # reset by the engine meanwhile: nothing left to end
        finally:
            sock.detach()

    @property
    def reusable(self) -> bool:
        """True if a finished response leaves the connection fit for the next request:
        connected, not closing, and never ended (:meth:`end`: the client left)."""
        transport = self.transport
        return transport is not None and not transport.is_closing() and not self._ended

    @property
    def open(self) -> bool:
        """True while the connection can carry a request (connected, reading, not closing)."""
        transport = self.transport
        return transport is not None and not transport.is_closing() and self._reading

    def _failed(self, response: UpstreamResponse, exc: BaseException) -> None:
        response.fail(exc)
        self.close()


def _close_delimited(response: UpstreamResponse) -> bool:
    """True if the response's body ends with the connection (RFC 9112 section 6.3: neither
    chunked nor a ``Content-Length``)."""
    headers = response.headers
    return ("Content-Length" not in headers
            and not headers.get("Transfer-Encoding", "").lower().rstrip().endswith("chunked"))
