"""The hot path: one downstream request relayed to its engine, and cancelled if the client leaves.

:class:`Exchange` is a request's life, its :meth:`~Exchange.run` read top to bottom; what happens
when the request ends before its response is whole is its
:class:`~sidecar.cancellation.Cancellation`'s (:mod:`sidecar.cancellation`), made at the first
early end.

Disconnects are noticed event-driven: the production runner enables aiohttp's handler
cancellation, so a lost downstream connection cancels this handler at whatever it awaits
(reading the body, waiting for the engine to queue and prefill, waiting for a non-streaming
response, writing a stream). :meth:`Cancellation.cancel
<sidecar.cancellation.Cancellation.cancel>` then closes the upstream connection and starts the
engine abort in its own task, and the cancellation propagates.

A write that fails because the client is gone takes the same path. The engine is aborted only if
it has the whole request and has not finished its response, and does not keep it on purpose after
the client leaves (a background response: ``EngineAdapter.kept_after_disconnect``); a client that
leaves right after the last byte costs nothing.

A client that reads slowly is not gone: each write waits while more than
``downstream.write_buffer_bytes`` are unsent, and the relay reads the engine only after its write,
so the engine's own writes wait too. A request body that breaks a ``downstream`` limit (size,
silence) gets 413/408 and the connection closed; the engine never had all of it: no abort.

The cancel API (:mod:`sidecar.cancel`) finds an exchange by its sidecar id (:data:`EXCHANGES`)
and cancels its handler with :data:`~sidecar.replies.CANCELLED`; a request's deadline
(``routes[].max_duration_s``, lowered by the client's ``X-Sidecar-Deadline-S``:
:meth:`sidecar.route.RouteTarget.deadline_s`) is one ``loop.call_at`` timer, cancelled when the
request ends, that does the same with :data:`~sidecar.replies.DEADLINE`. :func:`serve`
consumes only that cancellation (``Task.uncancel() == 0``: nothing else, e.g. a disconnect,
asked too, as ``asyncio.timeout`` does) and :meth:`Cancellation.end_cancelled
<sidecar.cancellation.Cancellation.end_cancelled>` aborts the engine and ends the client's
response with an error it can parse (the :class:`~sidecar.replies.Ending`'s status before the
head, its SSE error event mid-stream; every reply the sidecar writes itself is built in
:mod:`sidecar.replies`). Of a cancel call, the deadline and a disconnect, the first the sidecar
notices wins and is the only one counted: :meth:`Exchange.request_cancel` refuses a request
already ending (another ending asked, or the client's connection is lost or closing).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Protocol, cast

from aiohttp import HttpVersion11, web
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDictProxy

from engine import Unabortable
from sidecar.abort import Aborter
from sidecar.cancellation import Cancellation, LossHook
from sidecar.errors import DownstreamError, UpstreamError, UpstreamProtocolError
from sidecar.headers import (
    CLIENT_REQUEST_ID,
    REQUEST_ID,
    downstream_response_headers,
    has_forbidden_characters,
    upstream_request_headers,
)
from sidecar.inflight import InflightRecord
from sidecar.keys import ABORTER, RECORD
from sidecar.metrics import Metrics
from sidecar.plan import AbortStep, Phase, prepared_steps, response_phase
from sidecar.relay import Downstream, UpstreamResponse
from sidecar.replies import CANCELLED, DEADLINE, Ending, gone_client
from sidecar.route import RouteTarget
from sidecar.runtime import Runtime
from sidecar.ticket import Ticket
from sidecar.upstream import RequestBody, open_upstream, read_body

log = logging.getLogger(__name__)


class RelayedResponse(web.StreamResponse):
    """The relayed response: aiohttp keeps its head until the first body bytes (or the end, or
    ``send_headers``) and writes both in one write, as its own ``web.Response`` does
    (``_send_headers_immediately``, aiohttp 3.14 ``web_response.py``). A plain
    ``StreamResponse`` writes the head alone at ``prepare``: one more syscall, and one more
    wake-up of the client, before the first byte."""

    _send_headers_immediately = False


class Exchange(Ticket):
    """One request's life across the downstream/upstream race: its body relayed upstream, the
    engine's response relayed downstream, and on the way its record of in-flight work and its
    abort plan (:mod:`sidecar.plan`). An early end (a disconnect, the cancel API, the deadline,
    an upstream fault, a refused body) is its :class:`~sidecar.cancellation.Cancellation`'s,
    made at the first (:meth:`cancelling`). Its id, access line and counts: :class:`Ticket`."""

    __slots__ = ("_plan", "_planned", "aborter", "body", "bytes_written", "cancellation",
                 "downstream", "noticed_at", "phase", "prepared", "prepared_phase", "record",
                 "record_seq", "response", "sending", "sent_at", "status_sent", "task",
                 "upstream", "upstream_finished")

    def __init__(self, request: web.Request, runtime: Runtime, target: RouteTarget,
                 aborter: Aborter, metrics: Metrics, target_path: str,
                 record: InflightRecord | None = None) -> None:
        super().__init__(request, runtime, target, target_path, metrics)
        self.aborter = aborter
        # The record of in-flight engine work (sidecar.inflight): this request's line number
        # in it once its body went whole upstream (0: none).
        self.record = record
        self.record_seq = 0
        self.body: RequestBody | None = None
        self.upstream: UpstreamResponse | None = None
        self.sending: UpstreamResponse | None = None  # the attempt in flight, head or not
        self.upstream_finished = False  # engine sent its whole response, or the hop failed
        # For the access line: what went downstream, and where the exchange was stopped (set by
        # its cancellation).
        self.status_sent: int | None = None
        self.bytes_written = 0  # body bytes of a response the sidecar wrote itself
        self.phase: Phase | None = None
        self.response: web.StreamResponse | None = None  # once the relayed head is built
        self.downstream: Downstream | None = None  # the relayed body's byte path
        self.task = asyncio.current_task()  # the handler's, cancelled by the cancel API
        self.sent_at: float | None = None  # time.monotonic() when the upstream request started
        # The early end, made at the first (cancelling): None while there is none, and always
        # for a request that completes. noticed_at (time.monotonic()): when it queued the abort
        # and closed the upstream, the one thing of it the forward path checks.
        self.cancellation: Cancellation | None = None
        self.noticed_at: float | None = None
        # The abort plan, derived once the response is relaying (:meth:`_prepare_abort`), so
        # that a disconnect only queues it; None: derived at the disconnect
        # (Cancellation.abort_plan).
        self.prepared: list[AbortStep] | None = None
        self.prepared_phase = Phase.STREAMING  # with prepared: the phase once the body went whole
        self._plan: list[AbortStep] | None = None  # _plan_ahead's, once derived
        self._planned = False

    @property
    def saw_done_event(self) -> bool:
        """The last chunk relayed ended with ``data: [DONE]``: the engine is done."""
        return self.downstream is not None and self.downstream.saw_done_event

    @property
    def tail(self) -> bytes:
        """The last chunk relayed: does the stream end between SSE events?"""
        return self.downstream.tail if self.downstream is not None else b""

    @property
    def bytes_sent(self) -> int:
        """Body bytes sent to the client (for the access line): relayed, or written by the
        sidecar itself (``bytes_written``)."""
        relayed = self.downstream.bytes_sent if self.downstream is not None else 0
        return self.bytes_written + relayed

    async def run(self) -> web.StreamResponse:
        """Relay the request and its response; returns the response for aiohttp to finish: the
        relayed one, or the sidecar's own reply (413/408, 502/504) after an early end. Raises
        ``asyncio.CancelledError`` (a disconnect, the cancel API, the deadline) and
        ``ConnectionResetError`` (a write found the client gone, or it left before the engine's
        side failed: :func:`_left_first`), which :func:`serve` ends."""
        request, engine = self.request, self.target.engine
        settings = self.runtime.settings.upstream
        headers = upstream_request_headers(request.headers, request.remote, request.scheme)
        client_id = self.tag(headers)
        try:
            self.body = await read_body(request, self.target, self.id, headers,
                                        settings.replay_buffer_bytes,
                                        self.runtime.settings.downstream)
        except DownstreamError as exc:
            return await self.cancelling().refuse_body(exc)
        if self.body.unrewritten:
            log.warning("request %s: body over %d bytes not rewritten; the engine picks its own "
                        "request id and cannot be aborted by id (if it ends early: counted in "
                        "cancel_sidecar_unabortable_requests_total{reason=\"%s\"})", self.id,
                        settings.replay_buffer_bytes, Unabortable.BODY_OVER_REPLAY_BUFFER)

        started = self.sent_at = time.monotonic()
        if self.record is not None:
            if self.body.complete:  # in memory already (no body, a rewritten one)
                self._write_record()
            else:  # written once its last byte goes upstream, just before that write
                self.body.on_sent = self._write_record
        try:
            upstream = await open_upstream(
                self.runtime.pool, settings, request.method, engine.base_url,
                self.target_path, headers, self.body, self.id,
                wanted=lambda: self.noticed_at is None, sent=self._sent)
        except DownstreamError as exc:
            return await self.cancelling().refuse_body(exc)
        except UpstreamError as exc:
            if self.noticed_at is not None:
                raise _left_first(exc) from exc
            return self.cancelling().fail(exc)
        self.upstream = upstream
        # Observed in the next loop turn: after the head's write (nothing below gives up the
        # loop before it), whichever way this ends; the histogram is off the first byte's path.
        asyncio.get_running_loop().call_soon(self._observe_ttfb, time.monotonic() - started)
        if not self.target.wants_body(request.method, request.path):
            self.body.drop_copy()

        if has_forbidden_characters(upstream.headers, upstream.reason):
            return self.cancelling().fail(UpstreamProtocolError(
                f"{engine.base_url} sent a response head (a header or the reason phrase) with "
                f"a control character"))
        response, downstream = await begin_response(
            request, upstream, self.id, client_id,
            self.runtime.settings.downstream.write_buffer_bytes)
        self.response, self.downstream, self.status_sent = response, downstream, response.status
        # aiohttp writes the head with the body that came with it (one write: RelayedResponse;
        # with the end too if the whole response is here: a JSON answer, a short stream). From
        # there the body goes from the engine's socket to the client's transport in the relay's
        # protocol callbacks (sidecar.relay), and aiohttp writes the end.
        first = upstream.take_pending()
        if first:
            downstream.account(first)
        if upstream.complete:
            self.upstream_finished = True
            self._recorded_over()
            await response.write_eof(first)
            return response
        writer = cast(StreamWriter, request.writer)
        if first:
            # No drain here: while the handler waited, the engine's bytes would pile up unread
            # by the relay; the relay pauses reading instead if the client is behind.
            await writer.write(first, drain=False)
        else:
            writer.send_headers()
        flow = cast(FlowHook, request.protocol)
        flow.flow = downstream
        # Still over the high-water mark from the previous response on this connection (a
        # length-delimited one ends without waiting for the client): no pause_writing will
        # come, so the relay starts paused.
        downstream.paused = flow.writing_paused
        self._prepare_abort(upstream.headers)
        try:
            await upstream.relay(downstream, settings.read_timeout_s)
        except (UpstreamError, DownstreamError) as exc:
            if self.noticed_at is not None:
                raise _left_first(exc) from exc
            return self.cancelling().broken_mid_stream(response, exc)
        finally:
            flow.flow = None
        self.upstream_finished = True
        self._recorded_over()
        await response.write_eof()
        return response

    def _recorded_over(self) -> None:
        """The engine sent its whole response: its end goes in the record now, before the
        response's last write (and the handler's teardown) give a dying process more time to
        leave a finished request behind (:attr:`RequestLog.over` writes it again: a no-op)."""
        if self.record_seq:
            assert self.record is not None
            self.record.done(self.record_seq)

    def _sent(self, response: UpstreamResponse) -> None:
        self.sending = response

    def _write_record(self) -> None:
        """Write this request's engine work in the record of in-flight work
        (:mod:`sidecar.inflight`) as its whole body goes to the engine (just before the write
        that completes it), and its end when the request is over (:attr:`RequestLog.over`).
        Only a plan :meth:`_prepare_abort` would prepare is written: nothing kept after a
        disconnect (a background response), nothing unabortable, and no ``abort_from_header``
        target."""
        assert self.record is not None
        plan = self._plan_ahead()
        if not plan or self.record_seq or self.noticed_at is not None:
            return
        body = self.body
        sent_at = body.sent_at if body is not None and body.sent_at else self.sent_at
        record = self.record
        seq = self.record_seq = record.add(
            self.id, sent_at or time.monotonic(),
            [(step.engine.name, step.engine.base_url, step.ids) for step in plan])
        self.access.over = functools.partial(record.done, seq)

    def _observe_ttfb(self, seconds: float) -> None:
        """``cancel_sidecar_upstream_time_to_first_byte_seconds``: the upstream request sent ->
        its response head parsed."""
        self.metrics.child(self.metrics.upstream_ttfb, self.target.engine.name).observe(seconds)

    def cancelling(self) -> Cancellation:
        """This request's early end (:class:`~sidecar.cancellation.Cancellation`), made at the
        first call; :func:`serve` lets it go when the handler ends."""
        cancellation = self.cancellation
        if cancellation is None:
            cancellation = self.cancellation = Cancellation(self)
        return cancellation

    def client_gone(self) -> bool:
        """The client's connection was lost: called from the downstream protocol's
        ``connection_lost`` (:class:`sidecar.downstream.DownstreamHandler`, the
        :class:`~sidecar.cancellation.LossHook`), before aiohttp cancels the handler. Nothing to
        do if the response was complete or the engine had finished (``data: [DONE]``); else
        :meth:`Cancellation.client_gone <sidecar.cancellation.Cancellation.client_gone>` queues
        the abort. Returns True if it did: the handler's teardown may then wait its turn
        (:class:`sidecar.downstream.TeardownPacer`)."""
        downstream = self.downstream
        if self.upstream_finished or (downstream is not None and downstream.saw_done_event):
            return False
        return self.cancelling().client_gone()

    def request_cancel(self, ending: Ending = CANCELLED) -> bool:
        """The cancel API (:mod:`sidecar.cancel`) or the deadline timer (``ending``
        :data:`~sidecar.replies.DEADLINE`) asks to end this request: True if its handler was
        cancelled for it, False if the request is already ending or over
        (:meth:`Cancellation.request_cancel <sidecar.cancellation.Cancellation.request_cancel>`
        says when)."""
        return self.cancelling().request_cancel(ending)

    def close(self) -> None:
        """Last step of every request: a response not read to its end is never pooled again
        (one still before its head too), unless a confirmation watches it; what it failed
        with keeps no traceback."""
        upstream = self.upstream or self.sending
        if upstream is not None:
            if not self.upstream_finished:
                upstream.close()
                self.upstream_finished = True
            upstream.forget_tracebacks()  # they hold this request's frames
        if self.body is not None:  # a body never sent whole: no cycle left to the collector
            self.body.on_sent = None

    def _prepare_abort(self, headers: CIMultiDictProxy[str]) -> None:
        """Derive the abort plan now that the response relays (its head, ``headers``, is in; the
        body copy final), so that a disconnect only queues it: when hundreds of clients leave at
        once, each disconnect's cost delays noticing the next (~0.5 ms of p99 client close ->
        abort call per microsecond, ``python -m bench``'s storm). Only a plan whose derivation
        counts and logs nothing (no ``abort_from_header``, nothing kept or unabortable) is
        prepared; the others are derived at the disconnect
        (:meth:`Cancellation.abort_plan <sidecar.cancellation.Cancellation.abort_plan>`)."""
        plan = self._plan_ahead()
        if plan is not None:
            self.prepared = plan
            self.prepared_phase = response_phase(headers)

    def _plan_ahead(self) -> list[AbortStep] | None:
        """:func:`sidecar.plan.prepared_steps`, derived once (the body copy is final once the
        body went whole upstream)."""
        if self._planned:
            return self._plan
        self._planned = True
        request, body = self.request, self.body
        plan = self._plan = prepared_steps(
            self.target, request.method, request.path, self.id,
            body.copy() if body else None,
            unrewritten=body is not None and body.unrewritten,
            over_limit=body is not None and body.copy_over_limit)
        return plan


# Requests in flight by sidecar request id (the X-Request-Id returned to the client), for the
# cancel API (sidecar.cancel): added when serve creates the Exchange, removed as it ends. On the
# proxy app; the admin listener of the same process (or a --workers worker's control listener)
# reads it through cancel.local_canceller.
EXCHANGES: web.AppKey[dict[str, Exchange]] = web.AppKey("exchanges")


async def begin_response(request: web.Request, upstream: UpstreamResponse, request_id: str,
                         client_id: str | None, write_buffer_bytes: int
                         ) -> tuple[RelayedResponse, Downstream]:
    """The client's response to the engine's head (``upstream``), prepared: the engine's
    status, reason and fields (less the hop-by-hop ones), ``X-Request-Id`` (``request_id``)
    and ``X-Client-Request-Id`` (``client_id``, if the client sent one); aiohttp writes it with
    the first body bytes (:class:`RelayedResponse`). Returns it and its byte path, framed as
    aiohttp chose (chunked, or as is), which waits once ``write_buffer_bytes`` are unsent.
    Raises ``ConnectionResetError`` if the client left while the engine answered the head (its
    handler's cancellation waits its turn: :class:`sidecar.downstream.TeardownPacer`)."""
    response = RelayedResponse(status=upstream.status, reason=upstream.reason,
                               headers=downstream_response_headers(upstream.headers))
    response.headers[REQUEST_ID] = request_id
    if client_id is not None:
        response.headers[CLIENT_REQUEST_ID] = client_id
    if request.version < HttpVersion11 and "Content-Length" not in response.headers:
        # The body's end is the close (no chunked before HTTP/1.1). aiohttp 3.14 decides so in
        # prepare but keeps the connection for a client that asked for keep-alive: the client
        # would wait for an end that never comes.
        response.force_close()
    transport = request.transport
    if transport is None or transport.is_closing():  # it refuses even the limits then
        raise ConnectionResetError("the client left before the response began")
    # Past this many unsent bytes, response.write waits (aiohttp drains every 64 KiB).
    transport.set_write_buffer_limits(high=write_buffer_bytes)
    await response.prepare(request)
    return response, Downstream(transport, cast(StreamWriter, request.writer).chunked)


def _left_first(exc: BaseException) -> ConnectionResetError:
    """The client left before the engine's side failed: the engine ended its side on the abort
    the disconnect queued, while this handler's teardown waited its turn
    (:class:`sidecar.downstream.TeardownPacer`). Raised as a write to the gone client would
    raise, so :func:`serve` ends it as the disconnect it is, not as an upstream error."""
    return ConnectionResetError(f"the client left first; then the engine's side ended: {exc}")


class FlowHook(Protocol):
    """A downstream protocol that hands ``pause_writing``/``resume_writing`` to the relay in
    progress (``flow``): :class:`sidecar.downstream.DownstreamHandler`. The proxy app is served
    only through it (:class:`sidecar.downstream.DownstreamRunner`)."""

    flow: Downstream | None

    @property
    def writing_paused(self) -> bool: ...  # aiohttp's BaseProtocol: over the high-water mark


async def serve(request: web.Request, runtime: Runtime, target: RouteTarget, target_path: str,
                received: float, deadline_s: float | None, metrics: Metrics,
                app: web.Application) -> web.StreamResponse:
    """Proxy ``request``, admitted by the front door (:func:`sidecar.door.handle`) for
    ``target`` (``target_path``: its origin-form target), on the config generation ``runtime``:
    one :class:`Exchange`, findable by the cancel API (:data:`EXCHANGES`) while it runs, ended by
    its deadline (``deadline_s`` seconds from the loop time ``received``; ``None``: none), and
    counted, whichever way it ends, in ``metrics`` and its access line; the aborter, the record
    of in-flight work and the requests in flight are ``app``'s."""
    exchange = Exchange(request, runtime, target, app[ABORTER], metrics, target_path,
                        app[RECORD])
    timer = (None if deadline_s is None else asyncio.get_running_loop().call_at(
        received + deadline_s, exchange.request_cancel, DEADLINE))
    exchanges = app[EXCHANGES]
    exchanges[exchange.id] = exchange
    protocol = request.protocol
    # Not isinstance(protocol, LossHook): a runtime-checkable Protocol costs ~7 us per request.
    hook = cast(LossHook, protocol) if hasattr(protocol, "on_lost") else None
    if hook is not None:
        hook.on_lost = exchange.client_gone
    status_class = "disconnected"  # or "cancelled": the sidecar ended it (shutdown, cancel API,
    # deadline)
    gone = False
    try:
        response = await exchange.run()
        status_class = f"{response.status // 100}xx"
        if exchange.status_sent is None:  # an error response, which aiohttp sends next
            exchange.status_sent = response.status
            exchange.bytes_written = response.content_length or 0
        return response
    except asyncio.CancelledError:
        cancellation = exchange.cancelling()
        if cancellation.ending and exchange.task:
            # The sidecar's own ending asked first (request_cancel refuses once the client is
            # gone), so it wins even if a disconnect or the stop drain asked too before the
            # handler ran: counted once, as the ending.
            status_class = "cancelled"
            if exchange.task.uncancel() == 0:  # our own cancellation, consumed
                return await cancellation.end_cancelled()
            cancellation.stop_for_ending()  # and no response: the handler was cancelled again
            gone = request.transport is None or request.transport.is_closing()
            raise
        gone = request.transport is None or request.transport.is_closing()
        if not gone:
            status_class = "cancelled"
        cancellation.cancel("client disconnected" if gone else "handler cancelled",
                            disconnect=gone)
        raise
    except ConnectionResetError:
        # A write found the client gone before the cancellation arrived, or the engine ended
        # its side on the abort while the cancellation waited its turn (_left_first).
        gone = True
        exchange.cancelling().cancel("client disconnected")
        return gone_client()
    finally:
        if timer is not None:
            timer.cancel()
        if hook is not None:
            hook.on_lost = None
        del exchanges[exchange.id]
        exchange.close()
        exchange.done(status_class, exchange.status_sent, exchange.bytes_sent, gone,
                      exchange.phase)
        # The cancellation refers back to the exchange: let go of it, so that the two are not
        # a cycle left to the collector.
        exchange.cancellation = None
