"""The early end of a proxied request: what the sidecar does when a request ends before its response
is whole. In the field's terms the client *disconnects* and the engine *aborts*; the sidecar
*cancels* in between: it closes the upstream, queues the abort, counts and logs the end once, and
tells a client that is still there how its request ended.

A :class:`sidecar.proxy.Exchange` makes its :class:`Cancellation` at its first early end
(:meth:`~sidecar.proxy.Exchange.cancelling`; a request that completes never has one)::

    the client's connection is lost    client_gone: the abort queued at once, before aiohttp
                                       cancels the handler (sidecar.downstream.TeardownPacer)
    the handler is cancelled, or a     cancel: the upstream closed, the abort queued (if not
    write finds the client gone        already), counted and logged once
    the cancel API, the deadline       request_cancel: the handler cancelled; then
                                       end_cancelled: stopped as above, and the client told
                                       (its Ending, built in sidecar.replies)
    the engine fails or falls silent   fail (before the head: 502/504), broken_mid_stream
                                       (after it: the response cut short)
    the body breaks a downstream limit refuse_body (413/408: the engine never had all of it,
                                       nothing is aborted)

What to abort comes from :mod:`sidecar.plan` (prepared by the exchange while its response relays,
else derived here by :meth:`Cancellation.abort_plan`); the abort itself runs at
:class:`sidecar.abort.Aborter`, and an engine that confirms is read by a
:class:`sidecar.confirm.Confirmation`. This module sits below :mod:`sidecar.proxy`: it knows the
exchange only as :class:`ExchangeState`. Its log lines keep the logger ``sidecar.proxy``, as they
were before they moved here (the JSON lines' ``logger`` field).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import web

from engine import Kept
from sidecar.abort import Aborter
from sidecar.confirm import Confirmation
from sidecar.errors import DownstreamError, UpstreamError, UpstreamReadTimeout, detail
from sidecar.headers import REQUEST_ID
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.plan import AbortStep, Phase, Withheld, abort_steps, stopped_phase
from sidecar.relay import Downstream, UpstreamResponse
from sidecar.replies import (
    CANCEL_WRITE_S,
    CANCELLED,
    DEADLINE,
    Ending,
    body_error,
    cut,
    end_begun,
    ending_response,
    upstream_error,
)
from sidecar.route import RouteTarget
from sidecar.upstream import RequestBody

log = logging.getLogger("sidecar.proxy")  # the request path's lines: one logger (docstring)


class LossHook(Protocol):
    """A downstream protocol that calls ``on_lost`` (once, then forgets it) when its connection
    is lost, before aiohttp cancels the handler: :class:`sidecar.downstream.DownstreamHandler`.
    ``on_lost`` returns True if it queued an abort: the handler's cancellation may then wait
    its turn, and so may what ``follow_up`` is given
    (:class:`sidecar.downstream.TeardownPacer`)."""

    on_lost: Callable[[], bool] | None

    def follow_up(self, callback: Callable[[], None]) -> None: ...


class ExchangeState(Protocol):
    """The request a :class:`Cancellation` ends, as it sees it: :class:`sidecar.proxy.Exchange`.
    It reads the request, its route and what is in flight; it writes only the fields under
    "written here" (and closes upstream responses)."""

    request: web.Request
    target: RouteTarget
    metrics: Metrics
    aborter: Aborter
    access: RequestLog
    id: str  # the sidecar request id
    task: asyncio.Task[Any] | None  # the handler's
    body: RequestBody | None
    sent_at: float | None  # time.monotonic() when the upstream request started
    sending: UpstreamResponse | None  # the attempt in flight, head or not
    upstream: UpstreamResponse | None  # once its head is in
    response: web.StreamResponse | None  # the relayed response, once built
    downstream: Downstream | None  # the relayed body's byte path
    prepared: list[AbortStep] | None  # the abort plan, if derived ahead of the end
    prepared_phase: Phase  # with prepared: the phase once the body went whole
    # Written here:
    noticed_at: float | None  # time.monotonic() when the abort was queued
    upstream_finished: bool  # nothing more to read from the engine (or not by the exchange)
    phase: Phase | None  # where the request was stopped
    status_sent: int | None  # the status that went downstream (None: none yet)
    bytes_written: int  # body bytes of a response the sidecar wrote itself

    @property
    def saw_done_event(self) -> bool: ...  # the last chunk relayed ended with data: [DONE]

    @property
    def tail(self) -> bytes: ...  # the last chunk relayed

    def close(self) -> None: ...  # a response not read to its end is never pooled again


class Cancellation:
    """One request's early end (module docstring): the abort queued once, the end counted and
    logged once, the client told as its end says. ``exchange``: the request, which
    holds this in ``exchange.cancellation`` until its handler ends.

    Of a cancel call, the deadline and a disconnect, the first the sidecar notices wins and is
    the only one counted: :meth:`request_cancel` refuses a request already ending, and
    :meth:`client_gone` leaves a request the sidecar ends itself to that ending."""

    __slots__ = ("aborting", "confirmation", "ending", "exchange", "stop_recorded")

    def __init__(self, exchange: ExchangeState) -> None:
        self.exchange = exchange
        self.ending: Ending | None = None  # set when the sidecar asks to end the request
        # Stopping: the abort queued and the upstream closed (at exchange.noticed_at), then
        # recorded (metrics, log) by the handler; aborting: engine ids queued.
        self.stop_recorded = False
        self.aborting = 0
        # After an early end at an engine that confirms: the upstream response, read for the
        # engine's word that it stopped (sidecar.confirm); it owns the connection from then.
        self.confirmation: Confirmation | None = None

    def request_cancel(self, ending: Ending) -> bool:
        """The cancel API (``ending``: :data:`~sidecar.replies.CANCELLED`) or the deadline timer
        (:data:`~sidecar.replies.DEADLINE`): cancel the handler; :func:`sidecar.proxy.serve`
        then calls :meth:`end_cancelled`. ``False`` if the request is already ending: another
        ending was requested, the client is gone (its disconnect is being handled: the
        connection is lost or closing), the handler is done, or the stream has already relayed
        ``data: [DONE]`` (the client has its whole answer and the engine is finished: an error
        event after it would contradict it, and there is nothing to abort; the response ends
        with the engine's final chunk, or ``upstream.read_timeout_s``). The first to ask wins."""
        exchange = self.exchange
        transport, task = exchange.request.transport, exchange.task
        if (self.ending is not None or task is None or task.done()
                or transport is None or transport.is_closing() or exchange.saw_done_event):
            return False
        self.ending = ending
        task.cancel(ending.reason)
        return True

    def client_gone(self) -> bool:
        """The client's connection was lost while the engine still had work
        (:meth:`sidecar.proxy.Exchange.client_gone`, which the downstream protocol calls before
        aiohttp cancels the handler): queue the abort right here, so when many clients leave at
        once every abort is on the wire before any of their handlers' teardown (the upstream
        close, metrics, logs, access lines) runs; the cancelled handler records the rest
        (:meth:`cancel`). Nothing to do if the sidecar is ending the request itself.

        Returns True if an abort was queued: the upstream is then left to the handler's
        teardown, which the downstream protocol may defer a few loop turns
        (:class:`sidecar.downstream.TeardownPacer`); the engine is already being told to stop.
        Otherwise (nothing to abort: the upstream close is all the engine hears) the upstream is
        closed in the next loop turn and False returned."""
        if self.ending is not None:
            return False
        self._abort_now(time.monotonic(), close_later=True)
        return self.aborting > 0

    def cancel(self, reason: str, *, disconnect: bool = True) -> None:
        """The client is gone (``disconnect``) or the sidecar is stopping: close upstream, abort
        the engine (``reason``: for the log). Only a disconnect counts in
        ``client_disconnects_total``."""
        exchange = self.exchange
        if exchange.saw_done_event:
            exchange.close()  # the engine had finished: nothing to abort
        if not exchange.upstream_finished or (exchange.noticed_at is not None
                                              and not self.stop_recorded):
            self._stop(reason, disconnect=disconnect)

    def stop_for_ending(self) -> Ending:
        """After :meth:`request_cancel`: close upstream and abort the engine (as after a
        disconnect, not counted as one) and count the request under its :class:`Ending`
        (``cancelled_total`` or ``deadline_exceeded_total``), which it returns."""
        exchange = self.exchange
        ending = self.ending or CANCELLED
        self.cancel(ending.reason, disconnect=False)
        exchange.close()
        if exchange.phase is None:  # the engine had already finished
            exchange.phase = self._phase(None)
        metrics = exchange.metrics
        counter = metrics.deadline_exceeded if ending is DEADLINE else metrics.cancelled
        counter.labels(exchange.target.prefix, exchange.phase).inc()
        exchange.access.cancelled(ending.reason)
        return ending

    async def end_cancelled(self) -> web.StreamResponse:
        """:meth:`stop_for_ending`, then end the client's response as its :class:`Ending`
        says: a JSON error with its status before the head; its SSE error event and the end of
        the stream mid-SSE (at an event boundary); else (a JSON body begun, or mid-event) the
        response cut short. Returns the response, for the handler to return."""
        ending = self.stop_for_ending()
        exchange = self.exchange
        response = exchange.response
        if response is None or not response.prepared:
            return await self._cancelled_before_head(ending)
        exchange.bytes_written += await end_begun(exchange.request, response, ending,
                                                  exchange.tail)
        return response

    async def _cancelled_before_head(self, ending: Ending) -> web.StreamResponse:
        exchange = self.exchange
        request = exchange.request
        response = ending_response(ending, exchange.id, request.headers.get(REQUEST_ID))
        if exchange.phase is Phase.REQUEST_BODY:
            response.force_close()  # the rest of the body is never read
        try:
            async with asyncio.timeout(CANCEL_WRITE_S):
                await response.prepare(request)
                await response.write_eof()
        except (TimeoutError, ConnectionResetError):
            cut(request, response)
            return response
        exchange.status_sent, exchange.bytes_written = response.status, response.body_length
        if exchange.phase is Phase.REQUEST_BODY and request.transport is not None:
            request.transport.close()  # else aiohttp reads what is left: see refuse_body
        return response

    async def refuse_body(self, exc: DownstreamError) -> web.StreamResponse:
        """The client's body broke a ``downstream`` limit (``exc``) before the engine had all of
        it: the upstream request, if one was sent, is already closed and nothing is aborted. The
        client gets the JSON error (413, 408) and its connection is closed: the rest of its body
        is never read. Returns that response; raises ``ConnectionResetError`` if the client is
        gone before it is written (:func:`sidecar.proxy.serve` ends that as a disconnect)."""
        exchange = self.exchange
        request = exchange.request
        exchange.upstream_finished = True
        exchange.phase = Phase.REQUEST_BODY
        kind = type(exc).__name__.removeprefix("Request")
        exchange.metrics.downstream_errors.labels(exchange.target.prefix, kind).inc()
        log.info("request %s: %s; upstream closed, nothing to abort", exchange.id, exc)
        response = body_error(exc, exchange.id, request.headers.get(REQUEST_ID))
        await response.prepare(request)
        await response.write_eof()
        exchange.status_sent, exchange.bytes_written = response.status, response.body_length
        if request.transport is not None:
            # Else aiohttp reads (and drops) what is left of the body for up to 10 s first.
            request.transport.close()
        return response

    def fail(self, exc: UpstreamError) -> web.Response:
        """The engine gave no usable response head (``exc``): counted in
        ``upstream_errors_total``, logged, and the engine aborted if it may still hold the
        request. Returns the 502/504 for the handler to send."""
        exchange = self.exchange
        kind = type(exc).__name__.removeprefix("Upstream")
        exchange.metrics.upstream_errors.labels(exchange.target.engine.name, kind).inc()
        # The detail (which may quote upstream bytes) goes to the log, not to the client.
        log.warning("request %s: %s", exchange.id, detail(exc))
        if exc.engine_may_hold_request:
            # A timeout or a malformed head: the engine may still be queuing or generating for
            # nobody, so abort it. (Connect errors: it never got the request; a close before the
            # head: its side is gone.) Its response is given up: nothing to confirm on.
            self._stop(kind, disconnect=False, confirm=False)
        exchange.upstream_finished = True
        return upstream_error(exc, exchange.id, exchange.request.headers.get(REQUEST_ID))

    def broken_mid_stream(self, response: web.StreamResponse,
                          exc: UpstreamError | DownstreamError) -> web.StreamResponse:
        """The engine broke or fell silent after the response began: end it so the client sees
        it incomplete, and close the upstream connection (never pooled again). Returns
        ``response``.

        :class:`~sidecar.errors.UpstreamDisconnected` (FIN, RST, fewer bytes than
        ``Content-Length``) or :class:`~sidecar.errors.UpstreamProtocolError` (a body whose
        framing does not parse): the engine's side is gone, nothing is aborted; counted as
        ``MidStream``. (A request body that broke a ``downstream`` limit while the response
        streamed ends the same way.) :class:`UpstreamReadTimeout` (no body
        byte within ``read_timeout_s``): the engine may be stuck or generating for nobody, so it
        is aborted like after a first-byte timeout, unless it already sent ``data: [DONE]``;
        counted as ``ReadTimeout``. A chunked or length-delimited body is cut short (no final
        chunk / too few bytes); a close-delimited one (HTTP/1.0) can only say so with a TCP reset.
        """
        exchange = self.exchange
        timed_out = isinstance(exc, UpstreamReadTimeout)
        kind = "ReadTimeout" if timed_out else "MidStream"
        exchange.metrics.upstream_errors.labels(exchange.target.engine.name, kind).inc()
        log.warning("request %s: upstream %s mid-response: %s", exchange.id,
                    "fell silent" if timed_out else "broke", exc)
        if timed_out and not exchange.saw_done_event:
            self._stop("read timeout", disconnect=False, confirm=False)
        exchange.upstream_finished = True
        assert exchange.upstream is not None
        exchange.upstream.close()
        cut(exchange.request, response)
        return response

    def _abort_now(self, noticed_at: float, *, close_later: bool = False,
                   confirm: bool = True) -> None:
        """Queue the abort at every abort engine (if the engine had the whole body) and close
        the upstream; the part of stopping that cannot wait. Once per request.
        ``close_later`` (a disconnect): the upstream stays open for the handler's teardown to
        close if an abort was queued, else it is closed in a callback of its own.

        If the upstream engine itself is aborted and its kind confirms
        (:attr:`~engine.base.EngineAdapter.confirms`, ``abort.confirm_timeout_s`` > 0), the
        upstream is not closed: its response goes to a :class:`~sidecar.confirm.Confirmation`
        (nothing more reaches the client), which closes it at the engine's verdict or its bound
        (``confirm``: False when the sidecar closes the upstream itself: a timeout)."""
        exchange = self.exchange
        exchange.noticed_at = noticed_at
        plan, request_body = exchange.prepared, exchange.body
        if plan is None:  # derived now (no response relaying yet, or deriving counts or logs)
            body = request_body.copy() if request_body else None
            phase = exchange.phase = self._phase(body)
        else:
            body = None
            # "request_body": a response relaying while the client still sends the body
            phase = exchange.phase = (exchange.prepared_phase if request_body is not None
                                      and request_body.complete else Phase.REQUEST_BODY)
        if phase is not Phase.REQUEST_BODY:
            body_sent_at = (request_body.sent_at if request_body and request_body.sent_at
                            else exchange.sent_at)
            # A lone id whose engine sent response body bytes, on a route where it streams only
            # once registered (EngineAdapter.registered_once_streaming: vLLM's chat and
            # completions), is known to it: no re-sends. A request with several ids keeps them
            # (one may still be registering while another streams).
            streamed = exchange.downstream is not None and exchange.downstream.bytes_sent > 0
            # One call per abort engine, queued in this same loop turn: the engines' calls run
            # concurrently, each with the ids its own kind derives.
            # Ids an engine may register long after the body (vLLM's Responses turns after a
            # built-in tool: EngineAdapter.registers_later) are re-sent for the window from now.
            upstream = exchange.upstream or exchange.sending
            # No body copy (over upstream.replay_buffer_bytes) and no head yet: a stream or a
            # JSON answer, _phase cannot tell; either late registration may be waited for.
            unknown = plan is None and body is None and exchange.upstream is None
            for engine, ids, once_streaming, later in (
                    self.abort_plan(body) if plan is None else plan):
                registered = streamed and once_streaming and len(ids) == 1
                confirmation = None
                # Not a JSON answer whose head came: the engine sends it once it generated it
                # whole, so nothing is left to stop (one call, as before, and the close).
                if (confirm and upstream is not None and engine.confirms
                        and self.confirmation is None and not upstream.complete
                        and engine.base_url == exchange.target.engine.base_url
                        and engine.settings.abort.confirm_timeout_s > 0
                        and (exchange.upstream is None or phase is Phase.STREAMING)):
                    confirmation = self.confirmation = Confirmation(upstream)
                exchange.aborter.abort(
                    engine, ids, exchange.id, noticed_at, exchange.access,
                    None if registered else noticed_at if later else body_sent_at, confirmation,
                    may_start_late=once_streaming and (phase is Phase.BEFORE_FIRST_BYTE
                                                       or unknown),
                    may_register_late=once_streaming and phase is Phase.AWAITING_RESPONSE)
                self.aborting += len(ids)
            if self.confirmation is not None and upstream is not None:
                if exchange.downstream is not None:
                    exchange.downstream.gone = True
                # Parked (unread) if other clients left in the last moment (a storm:
                # ReadPacer.park); a lone disconnect's confirmation is read as it comes.
                upstream.watch(self.confirmation)
                exchange.upstream_finished = True  # the confirmation closes it
                if close_later:  # a client left: the engines' reads wait, the aborts go first
                    upstream.connection.pool.reads.hold()
                return
        if close_later and self.aborting:
            self._stop_reading_upstream()
            return
        upstream = exchange.upstream or exchange.sending
        if upstream is not None:
            if close_later:
                asyncio.get_running_loop().call_soon(upstream.close)
            else:
                upstream.close()
        exchange.upstream_finished = True

    def _stop_reading_upstream(self) -> None:
        """Stop reading the engine's response and end the connection on the engine's side soon;
        the handler's teardown, paced (:class:`sidecar.downstream.TeardownPacer`), closes it.

        Reading is paused: a chunk the engine still sends would only wake the handler to find
        the client gone and tear it down out of its turn (a piece already read is dropped:
        :attr:`sidecar.relay.Downstream.gone`). The connection is shut down both ways (the
        engine reads EOF: :meth:`sidecar.relay.UpstreamConnection.end`) as a follow-up of the
        lost connection: after the abort flush, in the next loop turn, unless clients are still
        leaving (a storm): then a few per turn, so the aborts of the disconnects still arriving
        go first (:meth:`sidecar.downstream.TeardownPacer.follow_up`).
        The connection is never pooled again (the teardown closes it:
        :meth:`sidecar.proxy.Exchange.close`)."""
        exchange = self.exchange
        if exchange.downstream is not None:
            exchange.downstream.gone = True
        if exchange.upstream is not None and (connection := exchange.upstream.connection).retire():
            # Only ever reached from client_gone, which the downstream protocol's hook calls.
            cast(LossHook, exchange.request.protocol).follow_up(connection.end)

    def _stop(self, reason: str, *, disconnect: bool, confirm: bool = True) -> None:
        exchange = self.exchange
        if exchange.noticed_at is None:
            self._abort_now(time.monotonic(), confirm=confirm)
        self.stop_recorded = True
        if disconnect:
            exchange.metrics.disconnects.labels(exchange.target.prefix, str(exchange.phase)).inc()
        aborting = self.aborting
        log.info("request %s: %s during %s; %s, %s", exchange.id, reason, exchange.phase,
                 "upstream read for the engine's confirmation" if self.confirmation
                 else "upstream closed",
                 f"aborting {aborting} engine id(s)" if aborting else "nothing to abort")

    def abort_plan(self, body: bytes | None) -> list[AbortStep]:
        """Every :class:`AbortStep` of this request now that it ended early
        (:func:`sidecar.plan.abort_steps`): the route's abort engines (``routes[].abort``) and
        the one its ``abort_from_header`` header names, if allowed
        (:meth:`RouteTarget.abort_engines`, which counts and logs a refused one), with ids.
        ``body``: the kept copy. Counts and logs what is withheld (:meth:`_withhold`); calls
        nothing."""
        exchange = self.exchange
        request, request_body = exchange.request, exchange.body
        engines = exchange.target.abort_engines(request.headers, exchange.id, exchange.metrics)
        steps, withheld = abort_steps(
            engines, request.method, request.path, exchange.id, body,
            unrewritten=request_body is not None and request_body.unrewritten,
            over_limit=request_body is not None and request_body.copy_over_limit)
        if withheld:
            self._withhold(withheld)
        return steps

    def _withhold(self, withheld: tuple[Withheld, ...]) -> None:
        """Count and log each engine the abort plan withholds (:class:`sidecar.plan.Withheld`):
        kept after its client leaves (a background response: counted per engine, one INFO line,
        and the access line's ``kept_by_engine``), or unabortable (counted, one WARNING)."""
        exchange = self.exchange
        metrics, request_id = exchange.metrics, exchange.id
        for engine, reason, named in withheld:
            if isinstance(reason, Kept):
                metrics.kept.labels(engine.name, reason).inc()
                if exchange.access.kept_by_engine(reason):
                    log.info("request %s: not aborted: the engine keeps it after the client "
                             "leaves (%s: %s); counted in cancel_sidecar_kept_requests_total",
                             request_id, reason, reason.why)
                continue
            metrics.unabortable.labels(engine.name, reason).inc()
            if named:
                log.warning("request %s: engine %s may run some of it under ids the sidecar "
                            "cannot name: its body was over upstream.replay_buffer_bytes, and "
                            "the ids are counted from the body; aborting the %d it can name; "
                            "counted in cancel_sidecar_unabortable_requests_total"
                            "{reason=\"%s\"}", request_id, engine.name, named, reason)
            else:
                log.warning("request %s: engine %s cannot be told to stop it by id (%s); only "
                            "its upstream is closed; counted in "
                            "cancel_sidecar_unabortable_requests_total{reason=\"%s\"}",
                            request_id, engine.name, reason.why, reason)

    def _phase(self, body: bytes | None) -> Phase:
        """Where the request was when it stopped (:func:`sidecar.plan.stopped_phase`);
        ``body``: the kept body copy."""
        request_body, upstream = self.exchange.body, self.exchange.upstream
        return stopped_phase(request_body is not None and request_body.complete,
                             None if upstream is None else upstream.headers, body)
