"""The downstream (client-facing) HTTP server: aiohttp's own, answering what it refuses in JSON.

Why this module exists: aiohttp answers a request it cannot parse (malformed request line or
header, a line over ``max_line_size``/``max_field_size``, ``Content-Length`` with
``Transfer-Encoding``, a bad chunk size, TLS or HTTP/2 bytes on the plain port, ...) before any
handler or middleware runs, from ``RequestHandler.handle_error`` (``aiohttp/web_protocol.py``):
a ``text/plain`` body quoting the offending request bytes, and an ERROR record with a traceback
in the log for each. An exception escaping the proxy's handler takes the same path (500), and a
``TimeoutError`` escaping it gives 504. A proxy whose every other answer is an OpenAI-style JSON
error should not switch format for these, nor echo request bytes (which may hold a key), nor log
a client's malformed bytes as a sidecar bug.

How: :class:`DownstreamHandler` overrides the public ``RequestHandler.handle_error``;
:class:`DownstreamServer` is a ``web.Server`` whose ``__call__`` (the protocol factory asyncio
calls once per accepted connection, ``aiohttp/web_server.py``) builds one;
:class:`DownstreamRunner` is a ``web.AppRunner`` whose ``_make_server`` (the hook
``BaseRunner`` leaves to its subclasses, ``aiohttp/web_runner.py``) lets ``AppRunner`` start the
app as usual, then serves it through a :class:`DownstreamServer` built with the very same
arguments. Everything else (parsing, keep-alive, handler cancellation, shutdown) is aiohttp's.

Statuses. aiohttp's parser gives every parse error status 400 (``aiohttp/http_exceptions.py``;
the C parser maps llhttp's errors in ``_http_parser.pyx`` ``parser_error_from_errno``). Kept as
400, except where a more precise status exists and aiohttp's exception tells it apart:

- 431 for ``LineTooLong`` and "Too many headers received": a request line, header name or value
  over its limit, or more than ``max_headers`` (128) fields. aiohttp raises the same
  ``LineTooLong`` for a long request line and for a long header field, so a long target gets
  431 rather than 414 (as Go's net/http and Node.js answer an oversized head).
- 505 for a request line whose version is not HTTP/1.x (``HTTP/3.0``; the HTTP/2
  prior-knowledge preface ``PRI * HTTP/2.0``).
- 500 ``internal_error`` for an exception in the proxy's handler (logged at ERROR with its
  traceback: that is a sidecar bug), 504 for a ``TimeoutError`` escaping it.

Every such answer closes the connection (``Connection: close``): after a parse error the
framing of whatever follows is unknown. A parse error is logged as one WARNING line naming the
client address and aiohttp's reason, never the request bytes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from yarl import URL

from sidecar.read_pacer import HOLD_S
from sidecar.relay import Downstream
from sidecar.replies import closing_error

log = logging.getLogger(__name__)

# What aiohttp's parse errors say without the request bytes, for the subclasses whose message
# quotes them (the C parser's messages quote them after a ":\n"; see _reason).
_FIXED_REASONS: dict[type[HttpProcessingError], str] = {
    InvalidHeader: "Invalid header field",
    BadHttpMethod: "Invalid method",
    BadStatusLine: "Malformed request line",
    InvalidURLError: "Invalid request target",
}
_TLS_ON_PLAIN_PORT = "Received HTTPS traffic on an HTTP port"  # BadHttpMethod's own text
_VERSION_REASON = "Only HTTP/1.0 and HTTP/1.1 are served on this port"


def parse_error_status(exc: HttpProcessingError) -> int:
    """The status for one of aiohttp's request parse errors: 431, 505 or 400 (module docstring).

    Reads the exception class and llhttp's reason text as aiohttp 3.14 words them; anything not
    recognised keeps aiohttp's 400.
    """
    if isinstance(exc, LineTooLong) or exc.message == "Too many headers received":
        return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
    if "Invalid HTTP version" in exc.message or exc.message.startswith("Pause on PRI/Upgrade"):
        return HTTPStatus.HTTP_VERSION_NOT_SUPPORTED
    return HTTPStatus.BAD_REQUEST


def parse_error_reason(exc: HttpProcessingError) -> str:
    """aiohttp's reason for a parse error without any request bytes, e.g. ``Invalid character
    in Content-Length``: safe to log and to send back."""
    if isinstance(exc, LineTooLong):
        return f"A request line or header field is longer than {exc.args[1]} bytes"
    if parse_error_status(exc) == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:
        return _VERSION_REASON
    text = exc.message
    if ":\n" in text:
        # llhttp's shape: "reason:\n[  reason:\n]\n  b'<request bytes>'\n  ^"; the bytes are a
        # repr, so no ":\n" inside them: every part but the last is reason.
        return ": ".join(part.strip() for part in text.split(":\n")[:-1])
    if type(exc) is BadHttpMessage or text == _TLS_ON_PLAIN_PORT:
        return text  # fixed texts ("Too many headers received", "Duplicate 'Host' header ...")
    return next((reason for cls, reason in _FIXED_REASONS.items() if isinstance(exc, cls)),
                "Malformed request")


class TeardownPacer:
    """Runs what follows a lost connection whose abort is already queued: the engine-side end of
    its upstream connection (:meth:`follow_up`) and its handler's teardown (:meth:`defer`),
    oldest first, paced per event-loop turn so that the next disconnects' aborts come first.

    Why: a lost connection costs little to notice (uvloop reads the reset, the proxy queues the
    request's abort: ~10-20 us), but what follows does not. Ending the engine's side
    (``shutdown()``: ~9 us, most of it the kernel delivering the FIN on loopback) and the
    cancelled handler's teardown (the cancellation unwinding its coroutines, the upstream close,
    metrics, the access line, aiohttp's own cleanup: ~100 us of Python) run in the same loop
    turns as the disconnects that keep arriving. When hundreds of clients leave at once (a
    client fleet restarts, a load balancer drops its connections), tearing every handler of one
    turn down in the next held the disconnects that arrived meanwhile back: each later batch's
    abort waited behind the previous batch's teardown (measured in ``python -m bench``'s storm:
    the last abort of 500 left 150-200 ms after its client).

    So a turn is *busy* while clients are leaving: connections were lost in the turn before it,
    or within ``hold_s`` (:data:`sidecar.read_pacer.HOLD_S`, as the held engine reads) before it.
    It runs at most ``follow_ups_per_busy_turn`` follow-ups and ``per_busy_turn`` teardowns,
    enough to keep moving. A quiet turn runs every follow-up waiting and up to ``per_turn``
    teardowns. Busy for ``hold_s`` and not only in the turn after a loss: a storm's resets come
    in bursts, one per poll of the sockets, and a quiet turn between two bursts runs every
    shutdown waiting and 16 teardowns (one took 5.4 ms in a traced storm, within 40 ms of the
    first close) while the next burst's resets wait unread.
    Measured in the storm (500 of 1,000 streams reset at once, 100 ms/token, 18 storms each,
    one worker): client close -> abort call at the engine p99 13.4 ms (median over storms),
    19.0 ms when only the teardowns were paced (``per_turn`` each turn, the ends in the next
    turn); the hold, with the ids derived ahead and eight warm abort connections, took it from
    16.1 to 14.0 ms on another day (24 storms each, interleaved). Only requests whose abort
    is already queued are paced (their engine is being told to stop); a request with nothing
    to abort (kind ``openai``: the upstream close is the cancellation) is closed and torn down
    at once.
    """

    def __init__(self, per_turn: int = 16, per_busy_turn: int = 1,
                 follow_ups_per_busy_turn: int = 4, hold_s: float = HOLD_S) -> None:
        self.per_turn = per_turn
        self.per_busy_turn = per_busy_turn
        self.follow_ups_per_busy_turn = follow_ups_per_busy_turn
        self.hold_s = hold_s
        self._waiting: deque[tuple[DownstreamHandler, BaseException | None]] = deque()
        self._follow_ups: deque[Callable[[], None]] = deque()
        self._scheduled = False
        self._lost = 0  # connections deferred since the last turn: clients still leaving
        self._last_lost = -math.inf  # loop time of the last connection deferred

    def follow_up(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (cheap, no arguments) in the next quiet turn, or in a busy one as
        its place in line comes."""
        self._follow_ups.append(callback)
        self._schedule()

    def defer(self, handler: DownstreamHandler, exc: BaseException | None) -> None:
        """Tear ``handler`` down (aiohttp's handling of its lost connection) in a later turn."""
        self._waiting.append((handler, exc))
        self._lost += 1
        self._last_lost = asyncio.get_running_loop().time()
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        loop = asyncio.get_running_loop()
        busy = self._lost > 0 or loop.time() - self._last_lost < self.hold_s
        self._lost = 0
        follow_ups, waiting = self._follow_ups, self._waiting
        count = len(follow_ups)
        for _ in range(min(self.follow_ups_per_busy_turn, count) if busy else count):
            try:
                follow_ups.popleft()()
            except Exception:
                log.exception("a follow-up of a lost connection failed")
        for _ in range(min(self.per_busy_turn if busy else self.per_turn, len(waiting))):
            handler, exc = waiting.popleft()
            try:
                handler.torn_down(exc)
            except Exception:
                log.exception("aiohttp's handling of a lost connection failed")
        if waiting or follow_ups:
            loop.call_soon(self._turn)
        else:
            self._scheduled = False


class DownstreamHandler(RequestHandler):
    """aiohttp's per-connection protocol with JSON error answers (module docstring), a hook
    for the request in progress when the connection is lost (:attr:`on_lost`), and what it was
    lost with.

    ``lost_with`` is what the connection was lost with, once it is: ``None`` while open or
    after a clean close (the client's FIN), else the transport's error (a reset:
    ``ConnectionResetError``). aiohttp keeps it to itself (a request without a body gets no
    exception), and an upgraded connection's relay (:mod:`sidecar.tunnel`) turns a client's
    reset into a reset of the engine's side.
    """

    __slots__ = ("_pacer", "flow", "lost_with", "on_lost")

    def __init__(self, *args: Any, pacer: TeardownPacer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pacer = pacer
        self.lost_with: BaseException | None = None
        # Set by the proxy handler for the request it serves (sidecar.proxy.Exchange
        # .client_gone): the abort is queued before aiohttp cancels the handler. True: an
        # abort was queued, the handler's teardown may wait its turn.
        self.on_lost: Callable[[], bool] | None = None
        # Set by the proxy handler while it relays a response body (sidecar.relay.Downstream):
        # told when the transport's write buffer crosses its high and low marks, so that
        # reading the engine pauses and resumes with the client.
        self.flow: Downstream | None = None

    def connection_lost(self, exc: BaseException | None) -> None:
        """The client's connection is gone (reset, FIN or half-close: aiohttp's
        ``eof_received`` lets the transport close). :attr:`on_lost` runs first; then aiohttp's
        own handling, which cancels the handler (``handler_cancellation``): at once, or, if
        :attr:`on_lost` queued an abort (it returns True), paced by the :class:`TeardownPacer`
        so that the next disconnects' aborts are queued before this handler is torn down."""
        self.lost_with = exc
        on_lost, self.on_lost = self.on_lost, None
        paced = False
        if on_lost is not None:
            try:
                paced = on_lost()
            except Exception:
                # aiohttp's own cleanup below must still run; the fault is a sidecar bug.
                log.exception("the disconnect hook failed; the handler's cancellation will "
                              "still close the upstream and abort")
        if paced and self._pacer is not None:
            self._pacer.defer(self, exc)
        else:
            super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.flow is not None:
            self.flow.resume_writing()

    def follow_up(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the aborts of the disconnects arriving now
        (:meth:`TeardownPacer.follow_up`), or in the next loop turn without a pacer."""
        if self._pacer is not None:
            self._pacer.follow_up(callback)
        else:
            asyncio.get_running_loop().call_soon(callback)

    def torn_down(self, exc: BaseException | None) -> None:
        """aiohttp's own handling of the lost connection (the handler cancelled), deferred by
        :meth:`connection_lost`; run by the :class:`TeardownPacer`."""
        super().connection_lost(exc)

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The response for a request aiohttp could not parse (``exc`` is its
        ``HttpProcessingError``) or whose handler raised (``status`` 500, or 504 for a
        ``TimeoutError``): an OpenAI-style JSON error that closes the connection.

        Raises ``ConnectionError`` if part of a response was already sent, as aiohttp does:
        aiohttp then drops the connection.
        """
        if isinstance(exc, HttpProcessingError):
            status = parse_error_status(exc)
            reason = parse_error_reason(exc)
            log.warning("refused a malformed request from %s with %d: %s", request.remote,
                        status, reason)
            error_type = "invalid_request"
        elif status == HTTPStatus.GATEWAY_TIMEOUT:
            log.error("request %s %s: handler timed out", request.method, request.path)
            reason, error_type = "The request timed out in the sidecar", "timeout"
        else:
            log.error("request %s %s: unexpected error in the handler", request.method,
                      request.path, exc_info=exc)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            reason, error_type = "Internal error in the sidecar", "internal_error"
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already started; cannot send an error")
        return closing_error(status, reason, error_type)


class UnusableTarget(BaseRequest):
    """A request whose target aiohttp could not turn into a request: answered 400 by
    :func:`refusing_unusable_targets`, never routed."""


class UnsupportedVersion(BaseRequest):
    """A request line llhttp parsed with a version other than HTTP/1.0 and HTTP/1.1
    (``GET / HTTP/2.0``; a version-less HTTP/0.9 line reads as 0.9): answered 505 by
    :func:`refusing_unusable_targets`, in HTTP/1.1 (aiohttp writes the request's version in the
    status line: the proxy answered ``HTTP/2.0 200 OK`` in HTTP/1.1 framing), never routed.
    llhttp itself refuses the others (``HTTP/1.2``: :func:`parse_error_status`)."""


_SERVED_VERSIONS = frozenset({HttpVersion10, HttpVersion11})


def guarded_request_factory(factory: Callable[..., BaseRequest]) -> Callable[..., BaseRequest]:
    """Wrap aiohttp's request factory so a target it cannot represent becomes an
    :class:`UnusableTarget` instead of killing the connection.

    aiohttp's ``BaseRequest.__init__`` reads the host of an absolute-form target, which yarl
    refuses with ``UnicodeError`` for an invalid internationalised name (``GET http://xn--/``);
    ``RequestHandler.start`` builds the request outside any ``try``, so the connection's task
    died and the connection hung, unanswered and never closed (a hostile tester's finding).
    """
    def make(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> BaseRequest:
        if message.version not in _SERVED_VERSIONS:
            return UnsupportedVersion(message._replace(version=HttpVersion11), payload, protocol,
                                      writer, task, asyncio.get_running_loop())
        try:
            return factory(message, payload, protocol, writer, task)
        except ValueError:  # UnicodeError included
            safe = message._replace(url=URL.build(path="/", encoded=True))
            return UnusableTarget(safe, payload, protocol, writer, task,
                                  asyncio.get_running_loop())
    return make


def refusing_unusable_targets(
        handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]]
) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """Wrap the server's request handler: an :class:`UnusableTarget` gets a JSON 400 that
    closes the connection; every other request goes to ``handler``."""
    async def handle(request: BaseRequest) -> web.StreamResponse:
        if isinstance(request, UnsupportedVersion):
            log.warning("refused a request from %s with 505: not HTTP/1.0 or HTTP/1.1",
                        request.remote)
            return closing_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, _VERSION_REASON,
                                 "invalid_request")
        if not isinstance(request, UnusableTarget):
            return await handler(request)
        log.warning("refused a malformed request from %s with 400: unusable request target",
                    request.remote)
        return closing_error(HTTPStatus.BAD_REQUEST, "Invalid request target", "invalid_request")
    return handle


class DownstreamServer(web.Server):
    """``web.Server`` whose connections are :class:`DownstreamHandler`, sharing one
    :class:`TeardownPacer`. ``accepted``: connections made so far (with aiohttp's
    ``requests_count``, what a stop watches: ``sidecar.server.take_in_arrivals``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pacer = TeardownPacer()
        self.accepted = 0

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.accepted += 1

    def __call__(self) -> RequestHandler:
        return DownstreamHandler(self, loop=self._loop, pacer=self.pacer, **self._kwargs)


class DownstreamRunner(web.AppRunner):
    """``web.AppRunner`` serving its app through a :class:`DownstreamServer`; takes the same
    arguments (``keepalive_timeout``, ``handler_cancellation``, ...), and ``handler``: what
    serves every request instead of the app's router (the proxy's,
    :func:`sidecar.app.proxy_handler`; requests are still made by the app's request factory)."""

    def __init__(self, app: web.Application, *,
                 handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._handler = handler

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app, merges the app's handler_args
        kwargs: dict[str, Any] = dict(plain._kwargs)
        handler = plain.request_handler if self._handler is None else self._handler
        return DownstreamServer(refusing_unusable_targets(handler),
                                request_factory=guarded_request_factory(plain.request_factory),
                                handler_cancellation=plain.handler_cancellation,
                                loop=asyncio.get_running_loop(), **kwargs)
