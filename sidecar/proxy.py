"""The hot path: one downstream request relayed to its engine, and cancelled if the client leaves.

Disconnects are noticed event-driven: the production runner enables aiohttp's handler
cancellation, so a lost downstream connection cancels this handler at whatever it awaits
(reading the body, waiting for the engine to queue and prefill, waiting for a non-streaming
response, writing a stream). :meth:`Exchange.cancel` then closes the upstream connection and
starts the engine abort in its own task, and the cancellation propagates.

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
asked too, as ``asyncio.timeout`` does) and :meth:`Exchange.end_cancelled` aborts the engine and
ends the client's response with an error it can parse (the :class:`~sidecar.replies.Ending`'s
status before the head, its SSE error event mid-stream; every reply the sidecar writes itself
is built in :mod:`sidecar.replies`). Of a cancel call, the deadline and a disconnect, the first
the sidecar notices wins and is the only one counted: :meth:`Exchange.request_cancel` refuses a
request already ending (another ending asked, or the client's connection is lost or closing).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

from aiohttp import HttpVersion11, web
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDictProxy

from engine import Kept, Unabortable
from sidecar.abort import Aborter
from sidecar.confirm import Confirmation
from sidecar.errors import (
    DownstreamError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReadTimeout,
    detail,
)
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
from sidecar.plan import (
    AbortStep,
    Phase,
    Withheld,
    abort_steps,
    prepared_steps,
    response_phase,
    stopped_phase,
)
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
    gone_client,
    upstream_error,
)
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
    engine's response relayed downstream, and its early end (a disconnect, the cancel API, the
    deadline, an upstream fault), which closes the upstream and queues the abort
    (:mod:`sidecar.plan` says what to abort). Its id, access line and counts: :class:`Ticket`."""

    __slots__ = ("_bytes_sent", "_plan", "_planned", "aborter", "aborting", "body",
                 "confirmation", "downstream", "ending", "noticed_at", "phase", "prepared",
                 "prepared_phase", "record", "record_seq", "response", "sending", "sent_at",
                 "status_sent", "stop_recorded", "task", "upstream", "upstream_finished")

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
        # After an early end at an engine that confirms: the upstream response, read for the
        # engine's word that it stopped (sidecar.confirm); it owns the connection from then.
        self.confirmation: Confirmation | None = None
        self.upstream_finished = False  # engine sent its whole response, or the hop failed
        # For the access line: what went downstream, and where the exchange was stopped.
        self.status_sent: int | None = None
        self._bytes_sent = 0  # of a response the sidecar wrote itself
        self.phase: Phase | None = None
        self.response: web.StreamResponse | None = None  # once the relayed head is built
        self.downstream: Downstream | None = None  # the relayed body's byte path
        self.task = asyncio.current_task()  # the handler's, cancelled by the cancel API
        self.ending: Ending | None = None  # set when the sidecar asks to end the request
        self.sent_at: float | None = None  # time.monotonic() when the upstream request started
        # Stopping: the abort queued and the upstream closed at noticed_at (time.monotonic()),
        # then recorded (metrics, log) by the handler; aborting: engine ids queued.
        self.noticed_at: float | None = None
        self.stop_recorded = False
        self.aborting = 0
        # The abort plan, derived once the response is relaying (:meth:`_prepare_abort`), so
        # that a disconnect only queues it; None: derived at the disconnect (abort_plan).
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
        """Body bytes sent to the client (for the access line)."""
        relayed = self.downstream.bytes_sent if self.downstream is not None else 0
        return self._bytes_sent + relayed

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self._bytes_sent = value

    async def run(self) -> web.StreamResponse:
        request, engine = self.request, self.target.engine
        settings = self.runtime.settings.upstream
        headers = upstream_request_headers(request.headers, request.remote, request.scheme)
        client_id = self.tag(headers)
        try:
            self.body = await read_body(request, self.target, self.id, headers,
                                        settings.replay_buffer_bytes,
                                        self.runtime.settings.downstream)
        except DownstreamError as exc:
            return await self._refuse_body(exc)
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
            return await self._refuse_body(exc)
        except UpstreamError as exc:
            if self.noticed_at is not None:
                raise _left_first(exc) from exc
            return self._fail(exc)
        self.upstream = upstream
        # Observed in the next loop turn: after the head's write (nothing below gives up the
        # loop before it), whichever way this ends; the histogram is off the first byte's path.
        asyncio.get_running_loop().call_soon(self._observe_ttfb, time.monotonic() - started)
        if not self.target.wants_body(request.method, request.path):
            self.body.drop_copy()

        if has_forbidden_characters(upstream.headers, upstream.reason):
            return self._fail(UpstreamProtocolError(
                f"{engine.base_url} sent a response head (a header or the reason phrase) with "
                f"a control character"))
        response = self.response = RelayedResponse(
            status=upstream.status, reason=upstream.reason,
            headers=downstream_response_headers(upstream.headers))
        response.headers[REQUEST_ID] = self.id
        if client_id is not None:
            response.headers[CLIENT_REQUEST_ID] = client_id
        if request.version < HttpVersion11 and "Content-Length" not in response.headers:
            # The body's end is the close (no chunked before HTTP/1.1). aiohttp 3.14 decides so
            # in prepare but keeps the connection for a client that asked for keep-alive: the
            # client would wait for an end that never comes.
            response.force_close()
        transport = request.transport
        if transport is None or transport.is_closing():
            # The client left while the engine answered the head (its handler's cancellation
            # waits its turn: sidecar.downstream.TeardownPacer); a closed transport refuses
            # even set_write_buffer_limits.
            raise ConnectionResetError("the client left before the response began")
        # Past this many unsent bytes, response.write waits (aiohttp drains every 64 KiB).
        transport.set_write_buffer_limits(high=self.runtime.settings.downstream.write_buffer_bytes)
        await response.prepare(request)
        self.status_sent = response.status
        # aiohttp writes the head with the body that came with it (one write: RelayedResponse;
        # with the end too if the whole response is here: a JSON answer, a short stream). From
        # there the body goes from the engine's socket to the client's transport in the relay's
        # protocol callbacks (sidecar.relay), framed as aiohttp chose (chunked, or as is), and
        # aiohttp writes the end.
        writer = cast(StreamWriter, request.writer)
        downstream = self.downstream = Downstream(transport, writer.chunked)
        first = upstream.take_pending()
        if first:
            downstream.account(first)
        if upstream.complete:
            self.upstream_finished = True
            self._recorded_over()
            await response.write_eof(first)
            return response
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
            return self._broken_mid_stream(response, exc)
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

    def cancel(self, reason: str, *, disconnect: bool = True) -> None:
        """The client is gone (``disconnect``) or the sidecar is stopping: close upstream, abort
        the engine. Only a disconnect counts in ``client_disconnects_total``."""
        if self.saw_done_event:
            self.close()  # the engine had finished: nothing to abort
        if not self.upstream_finished or (self.noticed_at is not None and not self.stop_recorded):
            self._stop(reason, disconnect=disconnect)

    def client_gone(self) -> bool:
        """The client's connection was lost: called from the downstream protocol's
        ``connection_lost`` (:class:`sidecar.downstream.DownstreamHandler`), before aiohttp
        cancels the handler. The abort is queued right here, so when many clients leave at once
        every abort is on the wire before any of their handlers' teardown (the upstream close,
        metrics, logs, access lines) runs; the cancelled handler records the rest
        (:meth:`cancel`). Nothing to do if the response was complete, the engine had finished
        (``data: [DONE]``) or the sidecar is ending the request itself.

        Returns True if an abort was queued: the upstream is then left to the handler's
        teardown, which the downstream protocol may defer a few loop turns
        (:class:`sidecar.downstream.TeardownPacer`); the engine is already being told to stop.
        Otherwise (nothing to abort: the upstream close is all the engine hears) the upstream is
        closed in the next loop turn and False returned."""
        downstream = self.downstream
        if (self.upstream_finished or self.ending is not None
                or (downstream is not None and downstream.saw_done_event)):
            return False
        self._abort_now(time.monotonic(), close_later=True)
        return self.aborting > 0

    def close(self) -> None:
        """Last step of every request: a response not read to its end is never pooled again
        (one still before its head too), unless a confirmation watches it."""
        upstream = self.upstream or self.sending
        if upstream is not None and not self.upstream_finished:
            upstream.close()
            self.upstream_finished = True
        if self.body is not None:  # a body never sent whole: no cycle left to the collector
            self.body.on_sent = None

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
        self.noticed_at = noticed_at
        plan, request_body = self.prepared, self.body
        if plan is None:  # derived now (no response relaying yet, or deriving counts or logs)
            body = request_body.copy() if request_body else None
            phase = self.phase = self._phase(body)
        else:
            body = None
            # "request_body": a response relaying while the client still sends the body
            phase = self.phase = (self.prepared_phase if request_body is not None
                                  and request_body.complete else Phase.REQUEST_BODY)
        if phase is not Phase.REQUEST_BODY:
            body_sent_at = (request_body.sent_at if request_body and request_body.sent_at
                            else self.sent_at)
            # A lone id whose engine sent response body bytes, on a route where it streams only
            # once registered (EngineAdapter.registered_once_streaming: vLLM's chat and
            # completions), is known to it: no re-sends. A request with several ids keeps them
            # (one may still be registering while another streams).
            streamed = self.downstream is not None and self.downstream.bytes_sent > 0
            # One call per abort engine, queued in this same loop turn: the engines' calls run
            # concurrently, each with the ids its own kind derives.
            # Ids an engine may register long after the body (vLLM's Responses turns after a
            # built-in tool: EngineAdapter.registers_later) are re-sent for the window from now.
            upstream = self.upstream or self.sending
            for engine, ids, once_streaming, later in (
                    self.abort_plan(body) if plan is None else plan):
                registered = streamed and once_streaming and len(ids) == 1
                confirmation = None
                # Not a JSON answer whose head came: the engine sends it once it generated it
                # whole, so nothing is left to stop (one call, as before, and the close).
                if (confirm and upstream is not None and engine.confirms
                        and self.confirmation is None and not upstream.complete
                        and engine.base_url == self.target.engine.base_url
                        and engine.settings.abort.confirm_timeout_s > 0
                        and (self.upstream is None or phase is Phase.STREAMING)):
                    confirmation = self.confirmation = Confirmation(upstream)
                self.aborter.abort(engine, ids, self.id, noticed_at, self.access,
                                   None if registered else noticed_at if later else body_sent_at,
                                   confirmation)
                self.aborting += len(ids)
            if self.confirmation is not None and upstream is not None:
                if self.downstream is not None:
                    self.downstream.gone = True
                # Parked (unread) if other clients left in the last moment (a storm:
                # ReadPacer.park); a lone disconnect's confirmation is read as it comes.
                upstream.watch(self.confirmation)
                self.upstream_finished = True  # the confirmation closes it
                if close_later:  # a client left: the engines' reads wait, the aborts go first
                    upstream.connection.pool.reads.hold()
                return
        if close_later and self.aborting:
            self._stop_reading_upstream()
            return
        upstream = self.upstream or self.sending
        if upstream is not None:
            if close_later:
                asyncio.get_running_loop().call_soon(upstream.close)
            else:
                upstream.close()
        self.upstream_finished = True

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
        The connection is never pooled again (the teardown closes it: :meth:`close`)."""
        if self.downstream is not None:
            self.downstream.gone = True
        if self.upstream is not None and (connection := self.upstream.connection).retire():
            # Only ever reached from client_gone, which the downstream protocol's hook calls.
            cast(LossHook, self.request.protocol).follow_up(connection.end)

    def _stop(self, reason: str, *, disconnect: bool, confirm: bool = True) -> None:
        if self.noticed_at is None:
            self._abort_now(time.monotonic(), confirm=confirm)
        self.stop_recorded = True
        if disconnect:
            self.metrics.disconnects.labels(self.target.prefix, str(self.phase)).inc()
        aborting = self.aborting
        log.info("request %s: %s during %s; %s, %s", self.id, reason, self.phase,
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
        request, request_body = self.request, self.body
        engines = self.target.abort_engines(request.headers, self.id, self.metrics)
        steps, withheld = abort_steps(
            engines, request.method, request.path, self.id, body,
            unrewritten=request_body is not None and request_body.unrewritten,
            over_limit=request_body is not None and request_body.copy_over_limit)
        if withheld:
            self._withhold(withheld)
        return steps

    def _withhold(self, withheld: tuple[Withheld, ...]) -> None:
        """Count and log each engine the abort plan withholds (:class:`sidecar.plan.Withheld`):
        kept after its client leaves (a background response: counted per engine, one INFO line,
        and the access line's ``kept_by_engine``), or unabortable (counted, one WARNING)."""
        for engine, reason, named in withheld:
            if isinstance(reason, Kept):
                self.metrics.kept.labels(engine.name, reason).inc()
                if self.access.kept_by_engine(reason):
                    log.info("request %s: not aborted: the engine keeps it after the client "
                             "leaves (%s: %s); counted in cancel_sidecar_kept_requests_total",
                             self.id, reason, reason.why)
                continue
            self.metrics.unabortable.labels(engine.name, reason).inc()
            if named:
                log.warning("request %s: engine %s may run some of it under ids the sidecar "
                            "cannot name: its body was over upstream.replay_buffer_bytes, and "
                            "the ids are counted from the body; aborting the %d it can name; "
                            "counted in cancel_sidecar_unabortable_requests_total"
                            "{reason=\"%s\"}", self.id, engine.name, named, reason)
            else:
                log.warning("request %s: engine %s cannot be told to stop it by id (%s); only "
                            "its upstream is closed; counted in "
                            "cancel_sidecar_unabortable_requests_total{reason=\"%s\"}",
                            self.id, engine.name, reason.why, reason)

    def _prepare_abort(self, headers: CIMultiDictProxy[str]) -> None:
        """Derive the abort plan now that the response relays (its head, ``headers``, is in; the
        body copy final), so that a disconnect only queues it: when hundreds of clients leave at
        once, each disconnect's cost delays noticing the next (~0.5 ms of p99 client close ->
        abort call per microsecond, ``python -m bench``'s storm). Only a plan whose derivation
        counts and logs nothing (no ``abort_from_header``, nothing kept or unabortable) is
        prepared; the others are derived at the disconnect, as :meth:`abort_plan` does."""
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

    def _phase(self, body: bytes | None) -> Phase:
        """Where the request was when it stopped (:func:`sidecar.plan.stopped_phase`);
        ``body``: the kept body copy."""
        request_body, upstream = self.body, self.upstream
        return stopped_phase(request_body is not None and request_body.complete,
                             None if upstream is None else upstream.headers, body)

    async def _refuse_body(self, exc: DownstreamError) -> web.StreamResponse:
        """The client's body broke a ``downstream`` limit before the engine had all of it: the
        upstream request, if one was sent, is already closed and nothing is aborted. The client
        gets the JSON error and its connection is closed: the rest of its body is never read."""
        self.upstream_finished = True
        self.phase = Phase.REQUEST_BODY
        kind = type(exc).__name__.removeprefix("Request")
        self.metrics.downstream_errors.labels(self.target.prefix, kind).inc()
        log.info("request %s: %s; upstream closed, nothing to abort", self.id, exc)
        response = body_error(exc, self.id, self.request.headers.get(REQUEST_ID))
        await response.prepare(self.request)
        await response.write_eof()
        self.status_sent, self.bytes_sent = response.status, response.body_length
        if self.request.transport is not None:
            # Else aiohttp reads (and drops) what is left of the body for up to 10 s first.
            self.request.transport.close()
        return response

    def _fail(self, exc: UpstreamError) -> web.Response:
        kind = type(exc).__name__.removeprefix("Upstream")
        self.metrics.upstream_errors.labels(self.target.engine.name, kind).inc()
        # The detail (which may quote upstream bytes) goes to the log, not to the client.
        log.warning("request %s: %s", self.id, detail(exc))
        if exc.engine_may_hold_request:
            # A timeout or a malformed head: the engine may still be queuing or generating for
            # nobody, so abort it. (Connect errors: it never got the request; a close before the
            # head: its side is gone.) Its response is given up: nothing to confirm on.
            self._stop(kind, disconnect=False, confirm=False)
        self.upstream_finished = True
        return upstream_error(exc, self.id, self.request.headers.get(REQUEST_ID))

    def _broken_mid_stream(self, response: web.StreamResponse,
                           exc: UpstreamError | DownstreamError) -> web.StreamResponse:
        """The engine broke or fell silent after the response began: end it so the client sees
        it incomplete, and close the upstream connection (never pooled again).

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
        timed_out = isinstance(exc, UpstreamReadTimeout)
        kind = "ReadTimeout" if timed_out else "MidStream"
        self.metrics.upstream_errors.labels(self.target.engine.name, kind).inc()
        log.warning("request %s: upstream %s mid-response: %s", self.id,
                    "fell silent" if timed_out else "broke", exc)
        if timed_out and not self.saw_done_event:
            self._stop("read timeout", disconnect=False, confirm=False)
        self.upstream_finished = True
        assert self.upstream is not None
        self.upstream.close()
        cut(self.request, response)
        return response

    def request_cancel(self, ending: Ending = CANCELLED) -> bool:
        """The cancel API (or the deadline timer, with :data:`DEADLINE`): cancel the handler;
        :func:`serve` then calls :meth:`end_cancelled`. ``False`` if the request is already
        ending: another ending was requested, the client is gone (its disconnect is being
        handled: the connection is lost or closing), the handler is done, or the stream has
        already relayed ``data: [DONE]`` (the client has its whole answer and the engine is
        finished: an error event after it would contradict it, and there is nothing to abort;
        the response ends with the engine's final chunk, or ``upstream.read_timeout_s``). The
        first to ask wins."""
        transport = self.request.transport
        if (self.ending is not None or self.task is None or self.task.done()
                or transport is None or transport.is_closing() or self.saw_done_event):
            return False
        self.ending = ending
        self.task.cancel(ending.reason)
        return True

    def stop_for_ending(self) -> Ending:
        """After :meth:`request_cancel`: close upstream and abort the engine (as after a
        disconnect, not counted as one) and count the request under its :class:`Ending`."""
        ending = self.ending or CANCELLED
        self.cancel(ending.reason, disconnect=False)
        self.close()
        if self.phase is None:  # the engine had already finished
            self.phase = self._phase(None)
        counter = self.metrics.deadline_exceeded if ending is DEADLINE else self.metrics.cancelled
        counter.labels(self.target.prefix, self.phase).inc()
        self.access.cancelled(ending.reason)
        return ending

    async def end_cancelled(self) -> web.StreamResponse:
        """:meth:`stop_for_ending`, then end the client's response as its :class:`Ending`
        says: a JSON error with its status before the head; its SSE error event and the end of
        the stream mid-SSE (at an event boundary); else (a JSON body begun, or mid-event) the
        response cut short."""
        ending = self.stop_for_ending()
        response = self.response
        if response is None or not response.prepared:
            return await self._cancelled_before_head(ending)
        self._bytes_sent += await end_begun(self.request, response, ending, self.tail)
        return response

    async def _cancelled_before_head(self, ending: Ending) -> web.StreamResponse:
        response = ending_response(ending, self.id, self.request.headers.get(REQUEST_ID))
        if self.phase is Phase.REQUEST_BODY:
            response.force_close()  # the rest of the body is never read
        try:
            async with asyncio.timeout(CANCEL_WRITE_S):
                await response.prepare(self.request)
                await response.write_eof()
        except (TimeoutError, ConnectionResetError):
            cut(self.request, response)
            return response
        self.status_sent, self.bytes_sent = response.status, response.body_length
        if self.phase is Phase.REQUEST_BODY and self.request.transport is not None:
            self.request.transport.close()  # else aiohttp reads what is left: see _refuse_body
        return response


# Requests in flight by sidecar request id (the X-Request-Id returned to the client), for the
# cancel API (sidecar.cancel): added when serve creates the Exchange, removed as it ends. On the
# proxy app; the admin listener of the same process (or a --workers worker's control listener)
# reads it through cancel.local_canceller.
EXCHANGES: web.AppKey[dict[str, Exchange]] = web.AppKey("exchanges")


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


class LossHook(Protocol):
    """A downstream protocol that calls ``on_lost`` (once, then forgets it) when its connection
    is lost, before aiohttp cancels the handler: :class:`sidecar.downstream.DownstreamHandler`.
    ``on_lost`` returns True if it queued an abort: the handler's cancellation may then wait
    its turn, and so may what ``follow_up`` is given
    (:class:`sidecar.downstream.TeardownPacer`)."""

    on_lost: Callable[[], bool] | None

    def follow_up(self, callback: Callable[[], None]) -> None: ...


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
            exchange.bytes_sent = response.content_length or 0
        return response
    except asyncio.CancelledError:
        if exchange.ending and exchange.task:
            # The sidecar's own ending asked first (request_cancel refuses once the client is
            # gone), so it wins even if a disconnect or the stop drain asked too before the
            # handler ran: counted once, as the ending.
            status_class = "cancelled"
            if exchange.task.uncancel() == 0:  # our own cancellation, consumed
                return await exchange.end_cancelled()
            exchange.stop_for_ending()  # and no response: the handler was cancelled again
            gone = request.transport is None or request.transport.is_closing()
            raise
        gone = request.transport is None or request.transport.is_closing()
        if not gone:
            status_class = "cancelled"
        exchange.cancel("client disconnected" if gone else "handler cancelled", disconnect=gone)
        raise
    except ConnectionResetError:
        # A write found the client gone before the cancellation arrived, or the engine ended
        # its side on the abort while the cancellation waited its turn (_left_first).
        gone = True
        exchange.cancel("client disconnected")
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
