"""The hot path: one downstream request relayed to its engine, and cancelled if the client leaves.

Disconnects are noticed event-driven: the production runner enables aiohttp's handler
cancellation, so a lost downstream connection cancels this handler at whatever it awaits
(reading the body, waiting for the engine to queue and prefill, waiting for a non-streaming
response, writing a stream). :meth:`Exchange.cancel` then closes the upstream connection and
starts the engine abort in its own task, and the cancellation propagates.

A write that fails because the client is gone takes the same path. The engine is aborted only if
it has the whole request and has not finished its response; a client that leaves right after the
last byte costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
import uuid

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from sidecar.abort import Aborter
from sidecar.errors import UpstreamError, UpstreamFirstByteTimeout
from sidecar.headers import (
    downstream_response_headers,
    unsupported_transfer_coding,
    upstream_request_headers,
)
from sidecar.keys import ABORTER, METRICS
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.route import RouteTarget
from sidecar.runtime import Runtime
from sidecar.upstream import RequestBody, open_upstream, origin_form, upstream_url

log = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
CLIENT_REQUEST_ID = "X-Client-Request-Id"
SSE_DONE = b"data: [DONE]\n\n"
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


def error_response(status: int, message: str, error_type: str,
                   request_id: str | None = None) -> web.Response:
    """An OpenAI-style JSON error: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    response = web.json_response(body, status=status)
    if request_id is not None:
        response.headers[REQUEST_ID] = request_id
    return response


class Exchange:
    """One request's state across the downstream/upstream race."""

    def __init__(self, request: web.Request, runtime: Runtime, target: RouteTarget,
                 aborter: Aborter, metrics: Metrics, target_path: str) -> None:
        self.target_path = target_path  # origin-form path and query for the upstream
        self.runtime = runtime
        self.request = request
        self.target = target
        self.aborter = aborter
        self.metrics = metrics
        self.id = uuid.uuid4().hex
        self.body: RequestBody | None = None
        self.upstream: aiohttp.ClientResponse | None = None
        self.upstream_finished = False  # engine sent its whole response, or the hop failed
        self.saw_done_event = False  # the last chunk relayed ended with ``data: [DONE]``
        # For the access line: what went downstream, and where the exchange was stopped.
        self.status_sent: int | None = None
        self.bytes_sent = 0
        self.phase: str | None = None
        self.access = RequestLog(self.id, request.method, request.path, target.prefix,
                                 target.engine.name, request.headers.get(REQUEST_ID))

    async def run(self) -> web.StreamResponse:
        request, engine = self.request, self.target.engine
        settings = self.runtime.settings.upstream
        headers = upstream_request_headers(request.headers, request.remote, request.scheme)
        client_id = headers.popall(REQUEST_ID, None)
        if client_id:
            headers[CLIENT_REQUEST_ID] = client_id[0]
        engine.tag(request.path, self.id, headers)
        keep = settings.replay_buffer_bytes
        if not request.body_exists:
            self.body = RequestBody(None, keep)
        elif engine.rewrites_body(request.method, request.path):
            self.body = await self._rewritten_body(headers, keep)
        else:
            self.body = RequestBody(request.content, keep)

        started = time.monotonic()
        try:
            upstream = await open_upstream(
                self.runtime.sessions, settings, request.method,
                upstream_url(engine.base_url, self.target_path), headers, self.body, self.id)
        except UpstreamError as exc:
            return self._fail(exc)
        self.upstream = upstream
        self.metrics.upstream_ttfb.labels(engine.name).observe(time.monotonic() - started)
        if not engine.wants_body(request.method, request.path):
            self.body.drop_copy()

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=downstream_response_headers(upstream.headers))
        response.headers[REQUEST_ID] = self.id
        if client_id:
            response.headers[CLIENT_REQUEST_ID] = client_id[0]
        await response.prepare(request)
        self.status_sent = response.status
        previous = b""
        while True:
            try:
                chunk = await upstream.content.readany()
            except aiohttp.ClientError as exc:
                return self._broken_mid_stream(response, exc)
            if not chunk:
                break
            # The OpenAI end-of-stream event means the engine is done: a client that closes on
            # reading it (before the upstream's final chunk) is not a disconnect.
            self.saw_done_event = (chunk if len(chunk) >= len(SSE_DONE)
                                   else previous + chunk).endswith(SSE_DONE)
            previous = chunk
            await response.write(chunk)
            self.bytes_sent += len(chunk)
        self.upstream_finished = True
        upstream.release()
        await response.write_eof()
        return response

    async def _rewritten_body(self, headers: CIMultiDict[str], limit: int) -> RequestBody:
        """Read the body whole (up to ``limit`` bytes) and let the engine adapter rewrite it.

        A larger body is relayed unchanged after what was read: the engine then picks its own
        request id, so this request cannot be aborted by id (logged).
        """
        request, engine = self.request, self.target.engine
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := await request.content.readany()):
            chunks.append(chunk)
            size += len(chunk)
        if not request.content.at_eof():
            log.warning("request %s: body over %d bytes not rewritten; the engine picks its own "
                        "request id and cannot be aborted", self.id, limit)
            return RequestBody(request.content, limit, chunks)
        body = b"".join(chunks)
        new = engine.rewrite_body(request.method, request.path, self.id, body)
        if new is not None:
            headers["Content-Length"] = str(len(new))
        return RequestBody.of(body if new is None else new)

    def cancel(self, reason: str, *, disconnect: bool = True) -> None:
        """The client is gone (``disconnect``) or the sidecar is stopping: close upstream, abort
        the engine. Only a disconnect counts in ``client_disconnects_total``."""
        if self.saw_done_event:
            self.close()  # the engine had finished: nothing to abort
        if not self.upstream_finished:
            self._stop(reason, disconnect=disconnect)

    def close(self) -> None:
        """Last step of every request: a response not read to its end is never pooled again."""
        if self.upstream is not None and not self.upstream_finished:
            self.upstream.close()
            self.upstream_finished = True

    def _stop(self, reason: str, *, disconnect: bool) -> None:
        noticed_at = time.monotonic()
        engine, request = self.target.engine, self.request
        body = self.body.copy() if self.body else None
        phase = self.phase = self._phase(body)
        if disconnect:
            self.metrics.disconnects.labels(self.target.prefix, phase).inc()
        ids: tuple[str, ...] = ()
        if phase != "request_body":
            ids = engine.engine_request_ids(request.method, request.path, self.id, body)
        if ids:
            self.aborter.abort(engine, ids, self.id, noticed_at, self.access)
        if self.upstream is not None:
            self.upstream.close()
        self.upstream_finished = True
        log.info("request %s: %s during %s; upstream closed, %s", self.id, reason, phase,
                 f"aborting {len(ids)} engine id(s)" if ids else "nothing to abort")

    def _phase(self, body: bytes | None) -> str:
        """Where the request was when it stopped: ``request_body`` (the engine never had all of
        it), ``before_first_byte`` (a stream was asked for; the engine queues or prefills),
        ``awaiting_response`` (a non-streaming response is being computed or sent) or
        ``streaming``. ``body`` is the kept body copy. Cold path: parsed only here."""
        if self.body is None or not self.body.complete:
            return "request_body"
        if self.upstream is not None:
            streamed = self.upstream.content_type == "text/event-stream"
            return "streaming" if streamed else "awaiting_response"
        copy = body or b""
        try:
            asked = b'"stream"' in copy and json.loads(copy).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            asked = False
        return "before_first_byte" if asked else "awaiting_response"

    def _fail(self, exc: UpstreamError) -> web.Response:
        kind = type(exc).__name__.removeprefix("Upstream")
        self.metrics.upstream_errors.labels(self.target.engine.name, kind).inc()
        # The detail (which may quote upstream bytes) goes to the log, not to the client.
        log.warning("request %s: %s (%s)", self.id, exc, exc.__cause__)
        if isinstance(exc, UpstreamFirstByteTimeout):
            # The engine may still be queuing or generating for nobody: abort it.
            self._stop("first-byte timeout", disconnect=False)
        self.upstream_finished = True
        return error_response(exc.status, str(exc), exc.error_type, self.id)

    def _broken_mid_stream(self, response: web.StreamResponse,
                           exc: aiohttp.ClientError) -> web.StreamResponse:
        """The engine died after the response began: end it so the client sees it incomplete.

        A chunked or length-delimited body is cut short (no final chunk / too few bytes); a
        close-delimited one (HTTP/1.0) can only say so with a TCP reset.
        """
        self.upstream_finished = True
        self.metrics.upstream_errors.labels(self.target.engine.name, "MidStream").inc()
        log.warning("request %s: upstream broke mid-response: %s", self.id, exc)
        assert self.upstream is not None
        self.upstream.close()
        transport = self.request.transport
        if transport is not None:
            delimited = (response.headers.get("Transfer-Encoding") == "chunked"
                         or response.content_length is not None)
            if delimited:
                transport.close()
            else:
                # abort() alone sends a FIN, which reads as a complete body: force a reset.
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                transport.abort()
        return response


def _refuse(request: web.Request, status: int, message: str, error_type: str) -> web.Response:
    """A request the proxy answers itself, with its own access line."""
    response = error_response(status, message, error_type)
    RequestLog(uuid.uuid4().hex, request.method, request.path, None, None,
               request.headers.get(REQUEST_ID)
               ).handler_done(status, response.content_length or 0, False, None)
    return response


async def handle(request: web.Request, runtime: Runtime) -> web.StreamResponse:
    """Proxy one request with the config generation ``runtime`` it started on."""
    target = runtime.router.match(request.path)
    target_path = origin_form(request.raw_path, request.rel_url.raw_path_qs)
    if target is None:
        return _refuse(request, 404, f"no route for path {json.dumps(request.path)}",
                       "route_not_found")
    if target_path is None:
        return _refuse(request, 400, "the request target must be a path", "invalid_request")
    if request.path.rstrip("/") in target.engine.forbidden_paths():
        # Only the sidecar aborts: a client must not abort other clients' requests.
        return _refuse(request, 403, "the engine's abort endpoint is not exposed to clients",
                       "forbidden")
    if unsupported_transfer_coding(request.headers):
        refusal = _refuse(request, 501, "only the chunked transfer coding is supported",
                          "not_implemented")
        refusal.force_close()  # the body is left unread
        return refusal
    metrics = request.app[METRICS]
    exchange = Exchange(request, runtime, target, request.app[ABORTER], metrics, target_path)
    in_flight = metrics.in_flight.labels(target.prefix)
    in_flight.inc()
    status_class = "disconnected"  # or "cancelled": the sidecar stopped it (shutdown)
    gone = False
    try:
        response = await exchange.run()
        status_class = f"{response.status // 100}xx"
        if exchange.status_sent is None:  # an error response, which aiohttp sends next
            exchange.status_sent = response.status
            exchange.bytes_sent = response.content_length or 0
        return response
    except asyncio.CancelledError:
        gone = request.transport is None or request.transport.is_closing()
        if not gone:
            status_class = "cancelled"
        exchange.cancel("client disconnected" if gone else "handler cancelled", disconnect=gone)
        raise
    except ConnectionResetError:
        # A write found the client gone before the cancellation arrived.
        gone = True
        exchange.cancel("client disconnected")
        return web.Response(status=499)
    finally:
        exchange.close()
        in_flight.dec()
        metrics.requests.labels(target.prefix, status_class).inc()
        exchange.access.handler_done(exchange.status_sent, exchange.bytes_sent, gone,
                                     exchange.phase)
