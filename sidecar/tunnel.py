"""Upgraded connections (``Connection: Upgrade``: a WebSocket such as vLLM's ``/v1/realtime``)
relayed as a byte tunnel.

Flow for one upgrade request (``GET``, HTTP/1.1, no body; :func:`wants_tunnel`)::

    client head ──► raw TCP connection to the engine (loop.create_connection, the
                    tunnel_wire.EngineSide protocol), the head re-written with Upgrade +
                    Connection: Upgrade kept (headers.upgrade_request_headers), X-Request-Id =
                    the sidecar id
    engine head ◄── parsed with httptools (llhttp): 101 -> its bytes go to the client verbatim,
                    then the two sockets are spliced: every byte either way, untouched (frames,
                    masks, subprotocols, permessage-deflate: nothing is re-framed)
                    non-101 -> relayed as any response (headers.downstream_response_headers)
    either side ends ──► the other is ended at once: FIN -> close (after flushing), reset -> reset

The two sides on the wire (the engine's connection and its head's parser, the parser aiohttp
hands the client's bytes to, the response that tells aiohttp the ``101`` is sent, a side's FIN
or reset) and where aiohttp hands the client's connection over: :mod:`sidecar.tunnel_wire`.

Backpressure, both ways, no copies queued: client -> engine bytes are written to the engine's
transport as they arrive; when its buffer passes ``downstream.write_buffer_bytes`` asyncio calls
``EngineSide.pause_writing`` and the client's transport stops being read until
``resume_writing``. Engine -> client: written to the client's transport (same high-water mark);
when aiohttp's protocol reports ``writing_paused`` the engine's transport stops being read and
the handler task awaits ``request.writer.drain()`` before reading it again.

Limits (``tunnel`` config section): ``idle_timeout_s`` (no byte either way: both closed), and
``max_bytes`` (per direction); the route's deadline (``routes[].max_duration_s``, the client's
``X-Sidecar-Deadline-S``) bounds the session, counted from the request head. Before the ``101``:
``upstream.connect_timeout_s`` (else 504), ``upstream.first_byte_timeout_s`` for the head (504),
64 KiB of head at most (502). The sidecar's own ends close both sides with a FIN (nothing is
re-framed, so no WebSocket close frame is invented).

Never an abort call: a session's engine ids are minted by the engine (vLLM:
``rt-{connection_id}-{uuid4()}``, ``entrypoints/speech_to_text/realtime/connection.py``) and
aborted by it when its socket closes (``RealtimeConnection.cleanup``): the sidecar's job is to
close the engine's socket the moment the client's goes. Counted in ``cancel_sidecar_tunnels_*``
(:mod:`sidecar.metrics`) and on the access line (:mod:`sidecar.logs`: ``closed_by``,
``close_reason``, bytes each way).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

from aiohttp import HttpVersion11, web
from multidict import CIMultiDictProxy

from sidecar.config import MAX_SECONDS
from sidecar.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamReadTimeout,
    detail,
)
from sidecar.headers import (
    REQUEST_ID,
    downstream_response_headers,
    has_forbidden_characters,
    is_upgrade,
    upgrade_request_headers,
)
from sidecar.metrics import Metrics
from sidecar.replies import gone_client, upstream_error
from sidecar.route import RouteTarget
from sidecar.runtime import Runtime
from sidecar.ticket import Ticket
from sidecar.tunnel_wire import (
    ClientSide,
    EngineSide,
    SwitchedResponse,
    close_transport,
    reset_transport,
)
from sidecar.upstream import READ_BUFFER_BYTES

log = logging.getLogger(__name__)

CLIENT, ENGINE, SIDECAR = "client", "engine", "sidecar"  # closed_by
FIN, RESET = "fin", "reset"  # how a side ended it; the sidecar's reasons: the metric's help


def wants_tunnel(request: web.BaseRequest) -> bool:
    """True if ``request`` is an upgrade the tunnel relays: HTTP/1.1, ``Connection: upgrade``
    with an ``Upgrade`` field, and no body (an upgrade with a body, which RFC 9110 allows and
    WebSocket never sends, goes through the plain proxy path with its upgrade headers dropped:
    the engine answers it as a plain request)."""
    return (request.version == HttpVersion11 and not request.body_exists
            and is_upgrade(request.headers))




class Tunnel(Ticket):
    """One upgrade request: the handshake, then the relay until either side ends it. Its id,
    access line and counts: :class:`Ticket`."""

    __slots__ = ("_deadline", "_down_bytes", "_idle", "_up_bytes", "client_blocked",
                 "close_reason", "closed_by", "early", "engine", "last_io", "loop", "switched",
                 "switched_at", "to_client", "to_engine", "upgrade", "wake")

    def __init__(self, request: web.Request, runtime: Runtime, target: RouteTarget,
                 target_path: str, metrics: Metrics) -> None:
        super().__init__(request, runtime, target, target_path, metrics)
        self.loop = asyncio.get_running_loop()
        self.upgrade = request.headers.get("Upgrade", "")[:40]
        self.engine: EngineSide | None = None
        self.switched = False
        self.switched_at = 0.0
        self.early = b""  # engine bytes that came with the 101's head
        self.closed_by: str | None = None
        self.close_reason = ""
        self.to_engine = 0
        self.to_client = 0
        self.last_io = 0.0
        self.client_blocked = False  # the client's buffer is full: the engine is not read
        self.wake = asyncio.Event()
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        # Bytes counted as they pass (a session may last hours).
        self._up_bytes = self.metrics.tunnel_bytes.labels(target.prefix, "client_to_engine")
        self._down_bytes = self.metrics.tunnel_bytes.labels(target.prefix, "engine_to_client")

    # -- the handshake -------------------------------------------------------------------------

    async def run(self, received: float, deadline_s: float | None) -> web.StreamResponse:
        """Relay the upgrade; returns the response aiohttp finishes (a :class:`SwitchedResponse`
        after a ``101``). Cancellation (a disconnect, the stop drain) propagates after both
        sides are closed."""
        status: int | None = None
        sent = 0
        status_class = "disconnected"
        try:
            try:
                head = await self._handshake()
            except UpstreamError as exc:
                error = self._fail(exc)
                status, sent = error.status, error.content_length or 0
                status_class = f"{status // 100}xx"
                return error
            if not head:  # the engine refused the upgrade
                response = await self._relay_refusal()
                status, sent = response.status, response.body_length
                status_class = f"{status // 100}xx"
                return response
            response = await self._splice(head, received, deadline_s)
            status, status_class = 101, "1xx"
            return response
        except ConnectionResetError:  # a write found the client gone before its cancellation
            self.end(CLIENT, self._client_reason())
            return gone_client()
        except asyncio.CancelledError:
            self.end(CLIENT if self._client_gone() else SIDECAR,
                     self._client_reason() if self._client_gone() else "shutdown")
            raise
        finally:
            for timer in (self._deadline, self._idle):
                if timer is not None:
                    timer.cancel()
            engine = self.engine
            if engine is not None and engine.transport is not None and not self.switched:
                # A refusal relayed whole: FIN; cut short, or a failed handshake: reset.
                (close_transport if engine.message_done else reset_transport)(engine.transport)
            gone = self.closed_by == CLIENT or status_class == "disconnected"
            if self.switched:
                self._count_session()
                sent = self.to_client
            self.done(status_class, status, sent, gone, "tunnel" if self.switched else None)

    async def _handshake(self) -> bytes:
        """Connect, send the head, wait for the engine's. Returns the ``101``'s head bytes, or
        ``b""`` for any other status (its headers and body are on ``self.engine``). Raises
        :class:`~sidecar.errors.UpstreamError` subclasses."""
        request, settings = self.request, self.runtime.settings.upstream
        url = self.target.engine.base_url
        scheme, _, authority = url.partition("://")
        host, _, port_text = authority.rpartition(":")
        if not port_text.isdigit():  # no explicit port
            host, port_text = authority, "443" if scheme == "https" else "80"
        host = host.strip("[]")
        headers = upgrade_request_headers(request.headers, request.remote, request.scheme)
        self.tag(headers)
        lines = [f"{request.method} {self.target_path} HTTP/1.1", f"Host: {authority}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: this gives them back.
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        started = time.monotonic()
        try:
            async with asyncio.timeout(settings.connect_timeout_s):
                _, self.engine = await self.loop.create_connection(
                    lambda: EngineSide(self, self.runtime.settings.downstream.write_buffer_bytes),
                    host, int(port_text),
                    ssl=ssl.create_default_context() if scheme == "https" else None)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"no connection to {url} within {settings.connect_timeout_s}s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {url}: {exc}") from exc
        engine = self.engine
        assert engine.transport is not None
        engine.transport.write(head)
        try:
            async with asyncio.timeout(settings.first_byte_timeout_s):
                answer = await engine.ready
        except TimeoutError as exc:
            raise UpstreamFirstByteTimeout(
                f"no response from {url} within {settings.first_byte_timeout_s}s") from exc
        self.metrics.upstream_ttfb.labels(self.target.engine.name).observe(
            time.monotonic() - started)
        if not answer and has_forbidden_characters(CIMultiDictProxy(engine.headers),
                                                   engine.reason):
            # A refusal aiohttp could not write downstream (a 500 from prepare otherwise).
            raise UpstreamProtocolError(f"{url} refused the upgrade with a head (a header or "
                                        f"the reason phrase) holding a control character")
        return answer

    def _fail(self, exc: UpstreamError) -> web.Response:
        kind = type(exc).__name__.removeprefix("Upstream")
        self.metrics.upstream_errors.labels(self.target.engine.name, kind).inc()
        log.warning("request %s: upgrade: %s", self.id, detail(exc))
        return upstream_error(exc, self.id)

    async def _relay_refusal(self) -> web.StreamResponse:
        """The engine answered the upgrade with a status other than 101: relay it as the plain
        proxy path would (hop-by-hop headers dropped, body streamed), then close its
        connection. A body cut short by the engine ends the client's response abnormally."""
        engine = self.engine
        assert engine is not None and engine.transport is not None
        request = self.request
        headers = downstream_response_headers(CIMultiDictProxy(engine.headers))
        response = web.StreamResponse(status=engine.status, reason=engine.reason or None,
                                      headers=headers)
        for value in engine.headers.getall("Upgrade", ()):
            # Hop-by-hop, but it says which protocols this hop does accept (426 must send it).
            response.headers.add("Upgrade", value)
        response.headers[REQUEST_ID] = self.id
        log.info("request %s: upgrade to %r refused by the engine with %d", self.id,
                 self.upgrade, engine.status)
        await response.prepare(request)
        delimited = "Content-Length" in engine.headers or "Transfer-Encoding" in engine.headers
        read_timeout = self.runtime.settings.upstream.read_timeout_s
        while True:
            while engine.body:
                chunk = engine.body.popleft()
                engine.body_bytes -= len(chunk)
                await response.write(chunk)
            if engine.body_bytes <= READ_BUFFER_BYTES // 2 and not engine.lost:
                engine.transport.resume_reading()
            if engine.message_done or (engine.lost and not delimited):
                break
            if engine.lost:
                self.metrics.upstream_errors.labels(self.target.engine.name, "MidStream").inc()
                assert request.transport is not None
                request.transport.close()  # cut short: the client sees it incomplete
                return response
            engine.body_event.clear()
            try:
                async with asyncio.timeout(read_timeout):
                    await engine.body_event.wait()
            except TimeoutError:
                exc = UpstreamReadTimeout(f"no response body byte within {read_timeout}s")
                log.warning("request %s: %s", self.id, exc)
                self.metrics.upstream_errors.labels(self.target.engine.name,
                                                    "ReadTimeout").inc()
                assert request.transport is not None
                request.transport.close()
                return response
        await response.write_eof()
        return response

    # -- the relay -----------------------------------------------------------------------------

    async def _splice(self, head: bytes, received: float, deadline_s: float | None
                      ) -> web.StreamResponse:
        request = self.request
        transport = request.transport
        engine = self.engine
        assert engine is not None and engine.transport is not None
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client left during the handshake")
        settings = self.runtime.settings
        transport.set_write_buffer_limits(high=settings.downstream.write_buffer_bytes)
        transport.write(head)  # the engine's 101, byte for byte
        self.switched, self.switched_at = True, time.monotonic()
        self.last_io = self.loop.time()
        self.metrics.open_tunnels.labels(self.target.prefix).inc()
        log.info("request %s: switched to %r", self.id, self.upgrade)
        protocol = request.protocol
        protocol.keep_alive(False)
        # Feeds what aiohttp already read past the head, then every byte (sidecar.tunnel_wire).
        protocol.set_parser(ClientSide(self))  # type: ignore[arg-type]
        if self.early:
            self.from_engine(self.early)
            self.early = b""
        if engine.lost:  # right after its 101
            self.engine_lost(engine.lost_with)
        idle = settings.tunnel.idle_timeout_s
        if idle is not None:
            self._idle = self.loop.call_later(idle, self._check_idle, idle)
        if deadline_s is not None:
            self._deadline = self.loop.call_at(
                min(received + deadline_s, self.loop.time() + MAX_SECONDS),
                self.end, SIDECAR, "deadline")
        writer = request.writer
        while self.closed_by is None:
            if self.client_blocked:
                try:
                    await writer.drain()
                except ConnectionError:
                    break  # the client is gone: client_lost() ends it
                self.client_blocked = False
                if self.closed_by is None:
                    engine.transport.resume_reading()
            else:
                self.wake.clear()
                await self.wake.wait()
        return SwitchedResponse()

    def from_client(self, data: bytes) -> None:
        engine = self.engine
        if self.closed_by is not None or engine is None or engine.transport is None:
            return
        limit = self.runtime.settings.tunnel.max_bytes
        if limit and self.to_engine + len(data) > limit:
            self.end(SIDECAR, "max_bytes")
            return
        self.to_engine += len(data)
        self._up_bytes.inc(len(data))
        self.last_io = self.loop.time()
        engine.transport.write(data)

    def from_engine(self, data: bytes) -> None:
        transport = self.request.transport
        if self.closed_by is not None or transport is None:
            return
        limit = self.runtime.settings.tunnel.max_bytes
        if limit and self.to_client + len(data) > limit:
            self.end(SIDECAR, "max_bytes")
            return
        self.to_client += len(data)
        self._down_bytes.inc(len(data))
        self.last_io = self.loop.time()
        transport.write(data)
        if self.request.protocol.writing_paused and not self.client_blocked:
            self.client_blocked = True
            engine = self.engine
            if engine is not None and engine.transport is not None:
                engine.transport.pause_reading()
            self.wake.set()

    def pause_client(self) -> None:
        """The engine's write buffer is full: stop reading the client."""
        transport = self.request.transport
        if transport is not None and self.switched and self.closed_by is None:
            transport.pause_reading()

    def resume_client(self) -> None:
        transport = self.request.transport
        if transport is not None and self.switched and self.closed_by is None:
            transport.resume_reading()

    def _check_idle(self, idle_s: float) -> None:
        left = self.last_io + idle_s - self.loop.time()
        if self.closed_by is not None:
            return
        if left > 0.001:  # uvloop's timers count milliseconds
            self._idle = self.loop.call_later(left, self._check_idle, idle_s)
        else:
            self.end(SIDECAR, "idle_timeout")

    def _client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def _client_reason(self) -> str:
        return FIN if getattr(self.request.protocol, "lost_with", None) is None else RESET

    def client_lost(self) -> None:
        """aiohttp lost the client's connection (``feed_eof``)."""
        self.end(CLIENT, self._client_reason())

    def engine_lost(self, exc: BaseException | None) -> None:
        if self.switched:
            self.end(ENGINE, FIN if exc is None else RESET)

    def end(self, by: str, reason: str) -> None:
        """End the tunnel once: ``by`` (client, engine, sidecar) ended it for ``reason``; the
        other side (the sidecar: both) is closed now, a reset passed on as a reset."""
        if self.closed_by is not None:
            return
        self.closed_by, self.close_reason = by, reason
        self.wake.set()
        engine = self.engine.transport if self.engine is not None else None
        client = self.request.transport
        if by != ENGINE and engine is not None and not engine.is_closing():
            (reset_transport if reason == RESET else close_transport)(engine)
        if by != CLIENT and client is not None and not client.is_closing():
            (reset_transport if reason == RESET else close_transport)(client)
        if self.switched:
            log.info("request %s: tunnel closed by %s (%s) after %.3f s; %d bytes to the "
                     "engine, %d to the client", self.id, by, reason,
                     time.monotonic() - self.switched_at, self.to_engine, self.to_client)

    def _count_session(self) -> None:
        prefix = self.target.prefix
        metrics = self.metrics
        metrics.open_tunnels.labels(prefix).dec()
        metrics.tunnels.labels(prefix, self.closed_by or SIDECAR,
                               self.close_reason or "shutdown").inc()
        metrics.tunnel_duration.labels(prefix).observe(time.monotonic() - self.switched_at)
        self.access.tunnel_done(self.upgrade, self.to_engine, self.closed_by or SIDECAR,
                                self.close_reason or "shutdown")


async def relay(request: web.Request, runtime: Runtime, target: RouteTarget, target_path: str,
                received: float, deadline_s: float | None,
                metrics: Metrics) -> web.StreamResponse:
    """Relay the upgrade ``request`` (:func:`wants_tunnel`) to ``target``'s engine:
    ``target_path`` is its origin-form target, ``received`` the loop time its head arrived and
    ``deadline_s`` its deadline in seconds (``None``: none); counted in ``metrics``. Returns
    the response for aiohttp; never raises :class:`~sidecar.errors.UpstreamError` (answered
    502/504)."""
    return await Tunnel(request, runtime, target, target_path, metrics).run(received, deadline_s)
