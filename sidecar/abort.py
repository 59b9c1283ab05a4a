"""Abort: tell an engine to stop work for request ids whose client is gone.

:meth:`Aborter.abort` only queues a request's ids and returns. Per engine, a flush scheduled with
``loop.call_soon`` (the first step of a task) packs everything queued in that event-loop turn
into as few calls as the engine allows (:attr:`~engine.base.EngineAdapter.max_ids_per_call`;
vLLM takes a list) and writes them at once on warm connections, so a lone abort waits for
nothing and a burst of disconnects becomes a few large calls. A loop turn can be long (hundreds
of clients leaving in it): ids that waited ``FLUSH_AGE_S`` for the flush leave at once, written
in the step that queues the next id::

    abort(ids) ──► engine queue ──(call_soon flush)──► call task (TaskSet) ──► POST abort path
                    ▲                                      │ answer: outcome to each request
                    └─────── next batch, when a slot frees ┘

The engine queue and its records are :mod:`sidecar.abort_queue`'s; one call (its attempts,
retries, outcome and log lines, on the abort connections of :mod:`sidecar.abort_wire`) is
:mod:`sidecar.abort_call`'s. :class:`Aborter` ties them: it queues, flushes, re-sends, bounds the
confirmations and gives each request its outcome.

Bounds (module constants here and in :mod:`sidecar.abort_queue`):

- at most ``MAX_CALLS_PER_ENGINE`` calls in flight per engine and ``MAX_CONCURRENT_CALLS`` in
  all (the abort session's pool size, so a call never waits for a pooled connection). Ids that
  arrive while every slot is busy wait and join the next batch. A call keeps its slot through
  its retries and their backoff: while an engine fails, no more than that many calls press on
  it, and new ids wait in the bounded queue instead;
- at most ``MAX_QUEUED_IDS`` ids wait per engine. When a request's ids would exceed that, the
  waiting request with the most ids gives way if it has more than the newcomer, else the
  newcomer does (:meth:`~sidecar.abort_queue.Queue.make_room`): the one not sent ends
  ``dropped`` (counted and logged), never silently lost, and one huge request never crowds out
  many small ones;
- ``abort.timeout_s`` bounds each attempt from sending to the answer, not the wait for a slot
  nor the backoff. A call takes at most ``(1 + retries) * timeout_s`` plus the backoffs.

Re-sending an abort is safe (in vLLM an id that is unknown, already finished or already aborted
is a no-op, and every request gets a fresh sidecar id; the sources: :mod:`sidecar.abort_call`).
So a call that fails transiently is retried (:mod:`sidecar.abort_call`), and a request's ids are
re-sent while the engine may still be registering them or until it confirms (:meth:`Aborter.abort`).

Each call runs in its own named task, so it survives the cancelled handler that asked for it and
never delays the upstream close or other traffic. A call's outcomes (``accepted``,
``http_<status>``, ``timeout``, ``error``), counted per attempt, and its log lines are
:mod:`sidecar.abort_call`'s; for a request also ``dropped``, and ``cancelled`` if the sidecar
stopped first. Each request gets the final outcome of the call(s) that carried its ids, once, in
``cancel_sidecar_aborted_requests_total``, the latency histogram and its access line.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import math
import time

from engine import AbortCall, EngineAdapter
from sidecar.abort_call import ACCEPTED, LOGGED_IDS, Pools, make_call
from sidecar.abort_queue import MAX_CALLS_PER_ENGINE, RESEND_SLOTS, Bounds, Queue, Request, Resend
from sidecar.abort_wire import PendingCall
from sidecar.confirm import CONFIRMED, UNCONFIRMED, Confirmation
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

MAX_CONCURRENT_CALLS = 64  # over all engines; also the abort session's pool size (sidecar.app)
RESEND_FIRST_S = 0.005  # the first re-send, after the first call; then doubling
# With a confirmation: the first re-send this long after the first call's answer, unless the
# engine confirmed meanwhile (vLLM ends an aborted stream ~2 ms after the call that reached its
# owner: ../shared/notes/cancellation-facts.md); then doubling, as RESEND_FIRST_S.
CONFIRM_WAIT_S = 0.01
# How long an engine counts as having several API-server processes after a request it surely
# knew was confirmed only after MULTI_RESENDS re-sends or more that its response shows changed
# nothing (Resend.judge: after a storm an engine's end can wait unread in the socket across
# re-sends, Confirmation.unread): meanwhile its first calls go on abort.fanout
# connections at once and its re-sends widen inside the registration window too (else they
# widen only once the window closed: one process, many calls naming an id still registering
# would be for nothing). One such re-send is allowed for an end read late.
MULTI_MEMORY_S = 60.0
MULTI_RESENDS = 2
RESEND_COALESCE_S = 0.002  # re-sends due this close together leave in one call
# A due re-send waits this long again while its engine reads are held, or while the engine's
# close of its response is still to be handled (Resend.waits_for_close).
HELD_WAIT_S = 0.005
# A batch of first calls waits for the next loop turn's flush at most this long: when a loop
# turn is long (hundreds of clients leaving in it), the ids queued so far leave at once.
FLUSH_AGE_S = 0.002


class Aborter:
    """Batches abort ids per engine, sends them in background calls, records every outcome."""

    def __init__(self, tasks: TaskSet, metrics: Metrics) -> None:
        self._tasks = tasks
        self._metrics = metrics
        self._queues: dict[EngineAdapter, Queue] = {}  # adapters compare by identity
        self._pools = Pools(tasks)  # by engine origin: they survive config reloads
        self._in_flight = 0
        self._order = itertools.count()  # ties in the re-send heap
        self._closed = False
        # Requests whose first call was answered, waiting for their engine's verdict.
        self._confirming: dict[Request, EngineAdapter] = {}
        # By engine origin: when one was last seen to have several API-server processes.
        self._multi_at: dict[str, float] = {}
        self._bounds = Bounds()  # confirmations by bound, one timer at the earliest

    def warm(self, engines: list[EngineAdapter]) -> None:
        """Open warm abort connections to each engine that aborts (:meth:`Pools.warm`)."""
        self._pools.warm(engines)

    async def close(self) -> None:
        """Stop the re-sends still due, give up the confirmations still awaited (their upstream
        connections closed, their outcome ``cancelled``) and close the abort connections (after
        the drain)."""
        self._closed = True
        self._bounds.clear()
        for queue in self._queues.values():
            queue.resend_timer.cancel()
            queue.resends.clear()
        for request, engine in list(self._confirming.items()):
            assert request.confirmation is not None
            request.confirmation.close()
            self._report(engine, request, "cancelled")
        await self._pools.close()

    def abort(self, engine: EngineAdapter, ids: tuple[str, ...], sidecar_id: str,
              noticed_at: float, request_log: RequestLog | None = None,
              body_sent_at: float | None = None,
              confirmation: Confirmation | None = None, may_start_late: bool = False,
              may_register_late: bool = False) -> None:
        """Queue ``ids`` (non-empty) for an abort call at ``engine``; returns at once.

        ``noticed_at`` is the ``time.monotonic()`` at which the disconnect was noticed; the
        request's abort latency is measured from it to the answer of the (last) call that
        carried its ids. ``request_log`` is told the request's outcome once (``cancelled`` if
        the sidecar stopped first, ``dropped`` if the engine's queue was full), so the
        request's access line waits for it. ``body_sent_at``: the ``time.monotonic()`` from
        which the registration window (``engines.*.abort.resend_window_s``) counts: when the
        engine got the whole body, or, for ids the engine may register any time later
        (:meth:`~engine.base.EngineAdapter.registers_later`), the disconnect itself; if the
        window is still open, the ids are re-sent until it closes (:class:`Resend`); ``None``:
        no re-sends.

        ``confirmation``: the request's upstream response, watched for the engine's word that
        the work stopped (:mod:`sidecar.confirm`). Then the ids are re-sent until that verdict
        (whatever ``body_sent_at``), spread over the abort connections, for at most
        ``abort.confirm_timeout_s`` after ``noticed_at`` (or the registration window's end, if
        later), and the request's outcome is the verdict (``confirmed``, ``finished``,
        ``unconfirmed``), unless the first call was refused. ``may_start_late``: a stream whose
        engine sends its first byte only once it registered it, and had sent none: if it is
        still silent at that bound, it is watched on for its start until
        ``abort.late_start_s`` after ``noticed_at`` (:mod:`sidecar.confirm`; the ids go again
        when it starts: :meth:`_late_start`). ``may_register_late``: a JSON answer the engine
        had sent nothing of, on such a route: if it is still silent at the bound, it is watched
        on the same way while its ids are re-sent (:meth:`_late_wait`). Raises ``ValueError``
        on an empty ``ids``.
        """
        if not ids:
            raise ValueError("refusing an empty id list: an engine may read it as 'abort all'")
        queue = self._queue(engine)
        request = Request(ids, sidecar_id, noticed_at, request_log, len(ids))
        if request_log is not None:
            request_log.abort_started()
        window_s = engine.settings.abort.resend_window_s
        if confirmation is not None and not self._closed:
            until = noticed_at + engine.settings.abort.confirm_timeout_s
            if body_sent_at is not None and window_s > 0:
                until = max(until, body_sent_at + window_s)
            request.confirmation = confirmation
            # Known to the engine once the registration window closed (or at once: None):
            # from then a call that changes nothing reached another API-server process than
            # the owner's, so the re-sends widen; before, it may be registering, as with one.
            known = noticed_at if body_sent_at is None else body_sent_at + window_s
            request.resend = Resend(ids, sidecar_id, until, min(noticed_at + CONFIRM_WAIT_S,
                                                                until),
                                    CONFIRM_WAIT_S, confirming=True,
                                    confirmation=confirmation, widen_from=known)
            if self._several(engine, noticed_at):
                # Seen with several API-server processes: the first call goes at once on
                # abort.fanout connections, as wide as a re-send would go by its fourth.
                request.copies = request.resend.calls = request.resend.width = (
                    engine.settings.abort.fanout)
            late_s = engine.settings.abort.late_start_s
            late = (may_start_late or may_register_late) and late_s > 0
            confirmation.arm(lambda verdict: self._verdict(engine, request, verdict), until,
                             (lambda: self._late_start(engine, request)) if may_start_late
                             else None,
                             noticed_at + late_s if late else None,
                             (lambda: self._late_wait(engine, request)) if may_register_late
                             else None)
            self._bounds.add(confirmation)
        elif body_sent_at is not None and window_s > 0 and not self._closed:
            until = body_sent_at + window_s
            if until > noticed_at:
                # Scheduled once the first call is accepted (_finish): a refused one (403
                # without --enable-scale-out) gets no re-send at all.
                request.resend = Resend(ids, sidecar_id, until,
                                        min(noticed_at + RESEND_FIRST_S, until),
                                        RESEND_FIRST_S)
        self._enqueue(queue, request)

    def abort_orphan(self, engine: EngineAdapter, ids: tuple[str, ...], sidecar_id: str,
                     sent_at: float) -> None:
        """Queue the abort of ``ids`` (non-empty) that a dead sidecar process started at
        ``engine`` (:mod:`sidecar.inflight`); ``sent_at``: ``time.monotonic()`` when the engine
        got the whole body. Nothing can confirm it (the request's upstream connection died with
        that process): every call, the first and the re-sends until the registration window's
        end (at least ``abort.resend_window_s`` from now: the engine may be registering it
        still), goes at once on ``abort.fanout`` abort connections, so it reaches the owner
        behind several API-server processes, within ``abort.max_calls``. Its outcome is that
        of its first call (``accepted`` at best). Raises ``ValueError`` on an empty ``ids``."""
        if not ids:
            raise ValueError("refusing an empty id list: an engine may read it as 'abort all'")
        now = time.monotonic()
        settings = engine.settings.abort
        request = Request(ids, sidecar_id, now, None, len(ids))
        if settings.resend_window_s > 0 and not self._closed:
            until = max(now, sent_at) + settings.resend_window_s
            wide = settings.fanout if engine.confirms else 1
            request.resend = Resend(ids, sidecar_id, until, min(now + RESEND_FIRST_S, until),
                                    RESEND_FIRST_S, confirming=wide > 1, widen_from=now,
                                    width=wide, calls=wide)
            request.copies = wide
        self._enqueue(self._queue(engine), request)

    def _queue(self, engine: EngineAdapter) -> Queue:
        queue = self._queues.get(engine)
        if queue is None:
            queue = self._queues[engine] = Queue(engine)
        return queue

    def _enqueue(self, queue: Queue, request: Request) -> None:
        """Put ``request``'s ids in line (:meth:`~sidecar.abort_queue.Queue.put`) and make sure a
        flush runs in the next loop turn."""
        if not queue.put(request, self._drop):
            return
        if queue.flush_scheduled:
            now = time.monotonic()
            if now - queue.batch_since >= FLUSH_AGE_S and self._pools.get(queue.engine).idle():
                # A long loop turn (a storm's disconnects): what waits leaves now, written in
                # this step; the scheduled flush sends what is queued after it.
                queue.batch_since = now
                self._flush(queue)
        else:
            queue.flush_scheduled = True
            queue.batch_since = time.monotonic()
            # A task's first step is scheduled with call_soon: the flush runs in the next loop
            # turn and writes every call in that step (a call's own task starts a turn later
            # still, which under load is tens of milliseconds: it only waits for the answer).
            token = queue.flush_token = object()
            flush = self._tasks.spawn(self._scheduled_flush(queue),
                                      name=f"abort {queue.engine.name}: flush")
            flush.add_done_callback(
                lambda task: self._flush_never_ran(queue) if task.cancelled()
                and queue.flush_token is token else None)

    def _schedule_resend(self, queue: Queue, resend: Resend) -> None:
        self._push(queue, resend)
        self._arm(queue)

    def _push(self, queue: Queue, resend: Resend) -> None:
        """Put ``resend`` in ``queue``'s heap at its ``due``; an entry it had is stale from now
        (a late start rescheduled it: :meth:`_late_start`)."""
        resend.slot = next(self._order)
        heapq.heappush(queue.resends, (resend.due, resend.slot, resend))

    def _arm(self, queue: Queue) -> None:
        """One timer per engine, at its earliest re-send (moved only when that gets earlier:
        a storm of aborts pushes its re-sends without a timer each)."""
        if queue.resends:
            queue.resend_timer.at_most(queue.resends[0][0],
                                       functools.partial(self._resend_due, queue))

    def _resend_due(self, queue: Queue) -> None:
        """Queue every re-send due now (or within ``RESEND_COALESCE_S``) as one batch."""
        queue.resend_timer.fired()
        now = time.monotonic()
        engine = queue.engine
        settings = engine.settings.abort
        max_interval_s = settings.resend_max_interval_s
        count = 0
        if queue.resends and queue.resends[0][2].waits_for_pacer(now):
            # Clients are still leaving (sidecar.read_pacer.ReadPacer holds or parks the
            # engine's reads, its ends among them, so that aborts go first): every re-send
            # waits, untouched (hundreds of them, each looked at every HELD_WAIT_S, took ~0.5
            # ms of loop time per look in python -m bench's storm, between the resets).
            queue.resend_timer.at_most(now + HELD_WAIT_S, functools.partial(self._resend_due,
                                                                            queue))
            return
        while queue.resends and queue.resends[0][0] <= now + RESEND_COALESCE_S:
            _, slot, resend = heapq.heappop(queue.resends)
            if slot != resend.slot:
                continue
            if resend.confirmation is not None and not resend.stopped:
                # The engine's answer may be read and held (sidecar.read_pacer.ReadPacer: while
                # clients leave, engine reads wait so that aborts go first). While clients
                # still leave, the re-send waits for the pacer to relay it (reading hundreds
                # of ends here, in one step, would delay noticing the next clients' loss);
                # once they stopped, it is read now, before deciding. An engine's close read
                # but not yet handled is waited for too (Resend.waits_for_close), per re-send:
                # it is one connection's, not the pool's.
                if resend.waits_for_pacer(now) or resend.waits_for_close(now):
                    resend.due = min(now + HELD_WAIT_S, resend.until)
                    self._push(queue, resend)
                    continue
                resend.confirmation.read_held()
            if resend.stopped:
                continue
            if resend.blind and resend.calls >= settings.max_calls:
                # A JSON answer's wait spent its calls a gap ago (a wide fanout, a small
                # max_calls): nothing more stops it here, so unconfirmed now, and closed (an
                # engine whose own disconnect detection works stops on that).
                if resend.confirmation is not None:
                    resend.confirmation.give_up()
                continue
            if resend.pending is None or resend.pending.unsent == 0:  # the last one went out
                copies = 1
                if resend.confirming:  # wider each time: other abort connections, processes
                    copies = resend.widen(now, self._several(engine, now), settings.fanout,
                                          settings.max_calls)
                    # A miss only once nothing the engine sent waits unread: its end may.
                    confirmation = resend.confirmation
                    if (resend.misses < MULTI_RESENDS and confirmation is not None
                            and not confirmation.aborted):
                        resend.judge(confirmation.pieces, confirmation.unread)
                again = resend.pending = Request(resend.ids, resend.sidecar_id, now, None,
                                                 len(resend.ids), resend=resend, first=False,
                                                 copies=copies)
                self._enqueue(queue, again)
                count += len(resend.ids) * copies
            if resend.confirming and resend.calls >= settings.max_calls and not resend.blind:
                continue  # its bound: the verdict is awaited without more calls
            if resend.advance(math.inf if resend.blind else max_interval_s):
                self._push(queue, resend)
        if count:
            self._metrics.abort_resent_ids.labels(engine.name).inc(count)
        self._arm(queue)
        if queue.idle() and self._queues.get(engine) is queue:
            del self._queues[engine]

    def _several(self, engine: EngineAdapter, now: float) -> bool:
        """True if ``engine`` was seen with several API-server processes in the last
        ``MULTI_MEMORY_S`` (:meth:`_verdict`)."""
        seen = self._multi_at.get(engine.base_url)
        return seen is not None and now - seen < MULTI_MEMORY_S

    def _drop(self, queue: Queue, request: Request) -> None:
        engine = queue.engine
        log.warning("request %s: abort queue of engine %s is full (%d ids waiting for one of %d "
                    "calls in flight); %d id(s) not aborted, counted in "
                    "cancel_sidecar_aborted_requests_total{outcome=\"dropped\"}",
                    request.sidecar_id, engine.name, queue.waiting_ids, queue.in_flight,
                    request.unsent)
        request.unsent = 0
        if request.resend is not None:
            request.resend.stopped = True
        if request.settle("dropped"):
            self._finish(engine, request)

    async def _scheduled_flush(self, queue: Queue) -> None:
        queue.flush_scheduled = False
        self._flush(queue)

    def _flush_never_ran(self, queue: Queue) -> None:
        """The flush task was cancelled before its first step (the sidecar is stopping): what
        it would have sent ends as cancelled, unless calls in flight will take it."""
        if queue.flush_scheduled:
            queue.flush_scheduled = False
            if queue.in_flight == 0:
                self._cancel_waiting(queue)

    def _flush(self, queue: Queue) -> None:
        """Start calls for what ``queue`` has waiting, while slots are free: each is written
        now, in the caller's step, on an idle warm connection
        (:meth:`~sidecar.abort_wire.AbortPool.begin`); a task per call waits for its answer."""
        engine = queue.engine
        while queue.ready() and self._in_flight < MAX_CONCURRENT_CALLS:
            ids, requests = queue.take(engine.max_ids_per_call,
                                       resends=queue.in_flight < RESEND_SLOTS)
            if not ids:  # only re-sends that a confirmation made needless
                continue
            call = engine.abort_call(ids)
            # A re-send spread over several abort connections (each may reach another of the
            # engine's API-server processes): the same call, once on each.
            # As many as the widest re-send asks, within every re-send's abort.max_calls.
            confirming = [r for r in requests if r.resend is not None and r.resend.confirming]
            budget = min((engine.settings.abort.max_calls - r.resend.calls + r.copies
                          for r in confirming if r.resend is not None),
                         default=MAX_CALLS_PER_ENGINE)
            copies = max(1, min(max(r.copies for r in requests), budget,
                                MAX_CALLS_PER_ENGINE - queue.in_flight,
                                MAX_CONCURRENT_CALLS - self._in_flight))
            for request in confirming:
                if request.resend is not None:
                    request.resend.calls += copies - request.copies  # as made, not as planned
            # The connections the requests tried (none yet for a first call: the LRU then).
            spread = [r.resend.tried for r in confirming if r.resend is not None]
            choose = (functools.partial(_tried_by, spread) if any(spread) else None)
            for copy in range(copies):
                if copy:
                    for request in requests:
                        request.calls += 1
                queue.in_flight += 1
                self._in_flight += 1
                try:
                    pending: PendingCall | None = self._pools.get(engine).begin(
                        call.path, call.json, engine.abort_headers(),
                        choose)
                except Exception:  # noqa: BLE001 - make_call makes it again and reports the error
                    pending = None
                if pending is not None and pending.conn is not None:
                    for tried in spread:
                        tried.add(id(pending.conn))
                self._tasks.spawn(self._send(queue, call, len(ids), requests, pending),
                                  name=f"abort {engine.name}: {len(ids)} id(s)")
        if queue.idle() and self._queues.get(engine) is queue:
            del self._queues[engine]

    async def _send(self, queue: Queue, call: AbortCall, count: int,
                    requests: list[Request], pending: PendingCall | None = None) -> None:
        """One call carrying ``count`` ids of ``requests``, retried while it fails transiently
        (:func:`~sidecar.abort_call.make_call`); then the next batch, if any. The call keeps its
        slot until its last attempt."""
        engine = queue.engine
        try:
            answer = await make_call(self._pools, self._metrics, engine, call, count, requests,
                                     pending)
        except asyncio.CancelledError:
            # The sidecar is stopping (TaskSet.drain): these requests, and what waits behind
            # the last call in flight, end as cancelled.
            self._release(queue)
            self._settle(engine, requests, "cancelled")
            if queue.in_flight == 0:
                self._cancel_waiting(queue)
            raise
        self._release(queue)
        self._settle(engine, requests, answer.outcome)
        self._flush(queue)
        for other in list(self._queues.values()):  # a slot under MAX_CONCURRENT_CALLS is free
            if other.ready() and self._in_flight < MAX_CONCURRENT_CALLS:
                self._flush(other)

    def _release(self, queue: Queue) -> None:
        queue.in_flight -= 1
        self._in_flight -= 1

    def _settle(self, engine: EngineAdapter, requests: list[Request], outcome: str) -> None:
        for request in requests:
            request.calls -= 1
            if request.resend is not None and outcome.startswith("http_"):
                # Refused (403 without --enable-scale-out, 401, 404, ...): re-sending cannot
                # help. A timeout or a lost connection does not stop them: an overloaded engine
                # is when registrations come late.
                request.resend.stopped = True
            if request.settle(outcome):
                self._finish(engine, request)

    def _cancel_waiting(self, queue: Queue) -> None:
        queue.resending.clear()
        queue.resending_ids = 0
        while queue.waiting:
            request = queue.waiting.popleft()
            queue.waiting_ids -= request.unsent
            request.unsent = 0
            if request.settle("cancelled"):
                self._finish(queue.engine, request)
        if queue.idle() and self._queues.get(queue.engine) is queue:
            del self._queues[queue.engine]

    def _finish(self, engine: EngineAdapter, request: Request) -> None:
        """Every id of ``request`` was answered (or will never be sent): count and report it
        (a re-send is counted only in ``abort_calls_total`` and ``abort_resent_ids_total``),
        or, with a confirmation still open, re-send until the verdict (:meth:`_verdict`)."""
        if not request.first:
            if request.resend is not None:
                request.resend.left(request)
            return
        request.answered = True
        outcome = request.outcome or ACCEPTED
        resend = request.resend
        confirmation = request.confirmation
        if confirmation is not None:
            if confirmation.open:
                if outcome == ACCEPTED:
                    # The engine's verdict decides; re-sends meanwhile, the first once the
                    # engine had time to end the response (it aborts after it answers: vLLM's
                    # endpoint starts the abort in a task).
                    self._confirming[request] = engine
                    # Not while a late start is awaited (nothing to name before it; a JSON
                    # answer's wait schedules its own: _late_wait), nor once one came (it
                    # scheduled its own re-sends: _late_start).
                    if (resend is not None and not resend.stopped and not self._closed
                            and resend.slot < 0 and not confirmation.waiting_start):
                        # As long again as the answer took from the disconnect (a loaded loop,
                        # a storm: the end is read as late as the answer was), at least
                        # CONFIRM_WAIT_S.
                        now = time.monotonic()
                        wait = max(CONFIRM_WAIT_S, now - request.noticed_at)
                        resend.due = min(max(resend.due, now + wait), resend.until)
                        self._schedule_resend(self._queue(engine), resend)
                    return
                # Refused, failed, dropped or cancelled: the abort path is broken, so the
                # upstream close, the other way the work stops, comes now.
                confirmation.close()
            elif confirmation.verdict is not None:  # the engine ended it before the answer
                outcome = _verdict_outcome(outcome, confirmation.verdict)
        elif resend is not None and outcome == ACCEPTED and not resend.stopped and not self._closed:
            queue = self._queue(engine)
            resend.due = min(max(resend.due, time.monotonic()), resend.until)
            self._schedule_resend(queue, resend)
        self._report(engine, request, outcome)

    def _late_start(self, engine: EngineAdapter, request: Request) -> None:
        """``request``'s stream began after its bound (the engine registered it late:
        :mod:`sidecar.confirm`): its ids go again now, then as re-sends after a disconnect, for
        a new bound ``abort.confirm_timeout_s`` from now, within ``abort.max_calls`` calls of
        their own (every call before came before the registration: an engine marked as having
        several processes spends the first budget within its bound). If its re-sends were
        stopped (a call refused, or given way in a full queue) or the sidecar stops:
        ``unconfirmed`` now, and the upstream closed."""
        resend, confirmation = self._restartable(request), request.confirmation
        if resend is None or confirmation is None:
            return
        now = time.monotonic()
        settings = engine.settings.abort
        log.info("request %s: engine %s began its stream %.3f s after the disconnect, past the "
                 "confirmation's bound (it registered the request late): naming its ids again",
                 request.sidecar_id, engine.name, now - request.noticed_at)
        self._metrics.child(self._metrics.abort_late_starts, engine.name).inc()
        confirmation.bound = now + settings.confirm_timeout_s
        resend.restart(now, confirmation.bound, now, CONFIRM_WAIT_S, blind=False)
        self._schedule_resend(self._queue(engine), resend)
        self._bounds.add(confirmation)

    def _late_wait(self, engine: EngineAdapter, request: Request) -> None:
        """``request``, a JSON answer its engine had sent nothing of by the confirmation's bound,
        is now watched on until ``abort.late_start_s`` after the disconnect (its bound moved
        there: :meth:`Confirmation.expire`): nothing it sends before its end says when the
        engine registers it, so its ids are re-sent meanwhile: the gaps double from
        ``abort.resend_max_interval_s`` without a cap (one the engine registers ``t`` seconds
        into the wait stops within about ``t`` more; a 30 s wait makes 7 re-sends, an 8th would
        fall on its end) and the re-sends widen from one call to ``abort.fanout`` (its owner may
        be any of several API-server processes; at once at an engine seen with several), within
        ``abort.max_calls`` calls of their own (7 re-sends, ``fanout`` 8: 39 calls). A call that
        changes nothing is no miss: it may still be registering. Its calls spent (a wider
        ``fanout``, a smaller ``max_calls``), its re-sends stopped, or the sidecar stopping:
        ``unconfirmed`` then (calls spent: at the next re-send due, a gap after the last call),
        and the upstream closed. A stream whose body copy was not kept (so not known for one)
        may take both waits: its head then starts it over as a late start
        (:meth:`_late_start`)."""
        resend, confirmation = self._restartable(request), request.confirmation
        if resend is None or confirmation is None:
            return
        now = time.monotonic()
        gap = engine.settings.abort.resend_max_interval_s
        resend.restart(now, confirmation.bound, min(now + gap, confirmation.bound), gap,
                       blind=True)
        self._schedule_resend(self._queue(engine), resend)

    def _restartable(self, request: Request) -> Resend | None:
        """``request``'s re-sends, if a late registration may start them over
        (:meth:`_late_start`, :meth:`_late_wait`); else ``None``, and, if it is confirming,
        ``unconfirmed`` now (its re-sends were stopped, or the sidecar stops)."""
        resend, confirmation = request.resend, request.confirmation
        if confirmation is None:
            return None
        if resend is None or resend.stopped or self._closed:
            confirmation.give_up()
            return None
        return resend

    def _verdict(self, engine: EngineAdapter, request: Request, verdict: str) -> None:
        """The engine's verdict on ``request`` (:class:`~sidecar.confirm.Confirmation`): no more
        re-sends; reported now if its first call was answered, else by :meth:`_finish`."""
        resend = request.resend
        if resend is not None:
            resend.stopped = True
            if resend.blind and verdict == CONFIRMED:
                log.info("request %s: engine %s stopped it %.3f s after the disconnect, past the "
                         "confirmation's bound (it registered the request late, or the calls "
                         "before missed its API-server process)",
                         request.sidecar_id, engine.name, time.monotonic() - request.noticed_at)
            if (verdict == CONFIRMED and resend.widen_from <= request.noticed_at
                    and resend.misses >= MULTI_RESENDS):
                now = time.monotonic()
                if not self._several(engine, now):
                    log.info("engine %s: request %s was confirmed only after %d or more abort "
                             "re-sends that changed nothing: taken to have several API-server "
                             "processes for the next %.0f s, its first abort calls go on %d "
                             "connections at once", engine.name,
                             request.sidecar_id, MULTI_RESENDS, MULTI_MEMORY_S,
                             engine.settings.abort.fanout)
                self._multi_at[engine.base_url] = now
        if request.answered:
            self._report(engine, request, _verdict_outcome(request.outcome or ACCEPTED, verdict))

    def _report(self, engine: EngineAdapter, request: Request, outcome: str) -> None:
        """Count ``request``'s final ``outcome`` once, observe its latency, tell its access
        line."""
        self._confirming.pop(request, None)
        confirmation = request.confirmation
        decided = confirmation.decided_at if confirmation is not None else None
        latency = (decided or time.monotonic()) - request.noticed_at
        metrics = self._metrics
        metrics.child(metrics.aborted_requests, engine.name, outcome).inc()
        if outcome == ACCEPTED:
            metrics.child(metrics.abort_latency, engine.name).observe(latency)
        elif outcome == CONFIRMED:
            metrics.child(metrics.abort_confirm_latency, engine.name).observe(latency)
        resend = request.resend
        if confirmation is not None and resend is not None:
            metrics.child(metrics.abort_calls_per_request, engine.name).observe(resend.calls)
            if outcome == UNCONFIRMED:
                log.warning("request %s: engine %s did not confirm that it stopped (ids %s) "
                            "within %.1f s of the disconnect, after %d abort call(s); its "
                            "upstream connection is closed; counted in "
                            "cancel_sidecar_aborted_requests_total{outcome=\"unconfirmed\"}",
                            request.sidecar_id, engine.name, " ".join(request.ids[:LOGGED_IDS]),
                            latency, resend.calls)
        if request.request_log is not None:
            request.request_log.abort_done(outcome, latency)


def _verdict_outcome(answered: str, verdict: str) -> str:
    """A confirmable request's outcome: the engine's verdict, unless nothing was confirmed and
    its first call had failed (``timeout``, ``error``): then that failure."""
    return answered if verdict == UNCONFIRMED and answered != ACCEPTED else verdict


def _tried_by(tried: list[set[int]], conn: object) -> int:
    """How many of the requests whose abort connections ``tried`` holds went on ``conn``."""
    return sum(id(conn) in t for t in tried)
