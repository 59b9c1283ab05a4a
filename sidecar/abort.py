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

Bounds (module constants):

- at most ``MAX_CALLS_PER_ENGINE`` calls in flight per engine and ``MAX_CONCURRENT_CALLS`` in
  all (the abort session's pool size, so a call never waits for a pooled connection). Ids that
  arrive while every slot is busy wait and join the next batch. A call keeps its slot through
  its retries and their backoff: while an engine fails, no more than that many calls press on
  it, and new ids wait in the bounded queue instead;
- at most ``MAX_QUEUED_IDS`` ids wait per engine. When a request's ids would exceed that, the
  waiting request with the most ids gives way if it has more than the newcomer, else the
  newcomer does (:meth:`Aborter._make_room`): the one not sent ends ``dropped`` (counted and
  logged), never silently lost, and one huge request never crowds out many small ones;
- ``abort.timeout_s`` bounds each attempt from sending to the answer, not the wait for a slot
  nor the backoff. A call takes at most ``(1 + retries) * timeout_s`` plus the backoffs.

Retries. Re-sending an abort is safe: in vLLM an id that is unknown, already finished or
already aborted is a no-op. ``POST /inference/v1/abort_requests``
(``vllm/entrypoints/scale_out/token_in_token_out/api_router.py``, ``abort_requests``) only reads
``request_ids``, starts ``engine_client.abort(ids)`` in a background task and answers 200;
``AsyncLLM.abort`` (``vllm/v1/engine/async_llm.py``) maps the ids in
``OutputProcessor.abort_requests`` (``vllm/v1/engine/output_processor.py``:
``external_req_ids.pop(id, [])``, so an id no live request has maps to nothing) and sends the
engine core only that list (``vllm/v1/engine/core_client.py``, ``abort_requests_async``: nothing
for an empty list), whose ``Scheduler.finish_requests`` (``vllm/v1/core/sched/scheduler.py``)
skips ids that are unknown or finished. A re-send can never hit a later request either: every
request gets a fresh sidecar id. An attempt is retried, up to ``abort.retries`` more times after
a backoff of ``RETRY_BACKOFF_S`` doubling per retry (at most ``RETRY_BACKOFF_MAX_S``), only
when the failure is transient (:func:`transient`):

- no connection, or the connection lost before an answer (refused, reset, closed; not TLS
  errors, which repeat; :class:`~sidecar.abort_wire.AbortWireError`);
- ``RETRY_STATUSES`` (502, 503, 504): a proxy in front of the engine, or an engine that is
  overloaded or starting (uvicorn answers 503 beyond ``--limit-concurrency``).

Never retried: any other status. 401/403/404 do not change (:data:`ABORT_STATUS_HINTS`); 500
neither, since vLLM's handler does nothing that can fail transiently before it answers; 429
asks the caller to slow down, which a retry within ~100 ms defeats. Never after a timeout:
the engine hangs, the call may have landed, and the attempt's budget is spent.

Each call runs in its own named task, so it survives the cancelled handler that asked for it and
never delays the upstream close or other traffic. Outcomes: ``ok``, ``http_<status>``,
``timeout``, ``error``; for a request also ``dropped``, and ``cancelled`` if the sidecar stopped
first. ``cancel_sidecar_abort_calls_total`` counts every attempt by its outcome; each request
gets the final outcome of the call(s) that carried its ids, once, in
``cancel_sidecar_aborted_requests_total``, the latency histogram and its access line. One log
line per attempt that failed (ids, requests, outcome, hint, whether it is retried) and one per
call that succeeded; the bearer key is never logged.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import AbortCall, EngineAdapter
from sidecar.abort_wire import WARM, AbortPool, AbortWireError, PendingCall
from sidecar.confirm import CONFIRMED, UNCONFIRMED, Confirmation
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

MAX_CALLS_PER_ENGINE = 8
MAX_CONCURRENT_CALLS = 64  # over all engines; also the abort session's pool size (sidecar.app)
MAX_QUEUED_IDS = 16384  # per engine, waiting for a slot: at most ~8 MB held while an engine hangs
RESEND_SLOTS = 2  # re-sends start only while fewer calls are in flight: first calls go first
_LOGGED_IDS = 8  # sidecar request ids named in a call's log line; the access lines have the rest
RETRY_BACKOFF_S = 0.05  # before the first retry, seconds; doubles for each further one
RETRY_BACKOFF_MAX_S = 1.0
RETRY_STATUSES = frozenset({502, 503, 504})
MAX_COLD_POOLS = 256  # abort connection pools of engines not in the config (per-request targets)
RESEND_FIRST_S = 0.005  # the first re-send, after the first call; then doubling
# With a confirmation: the first re-send this long after the first call's answer, unless the
# engine confirmed meanwhile (vLLM ends an aborted stream ~2 ms after the call that reached its
# owner: ../shared/notes/cancellation-facts.md); then doubling, as RESEND_FIRST_S.
CONFIRM_WAIT_S = 0.01
# How long an engine counts as having several API-server processes after a request it surely
# knew was confirmed only after MULTI_RESENDS re-sends or more: meanwhile its first calls go on
# abort.fanout connections at once and its re-sends widen inside the registration window too
# (else they widen only once the window closed: one process, many calls naming an id still
# registering would be for nothing). One re-send is allowed for an end read late.
MULTI_MEMORY_S = 60.0
MULTI_RESENDS = 2
RESEND_COALESCE_S = 0.002  # re-sends due this close together leave in one call
HELD_WAIT_S = 0.005  # a due re-send waits this long again while its engine reads are held
BOUND_EARLY_S = 0.002  # a confirmation's bound this close is reached (the loop's timers: 1 ms)
# A batch of first calls waits for the next loop turn's flush at most this long: when a loop
# turn is long (hundreds of clients leaving in it), the ids queued so far leave at once.
FLUSH_AGE_S = 0.002
_OK = "accepted"

# What an abort endpoint's refusal usually means; for the logs and /readyz.
ABORT_STATUS_HINTS = {
    401: "the engine rejected abort.api_key",
    403: "the abort endpoint is disabled: start vLLM with --enable-scale-out",
    404: "no abort endpoint at abort.path",
    500: "the abort endpoint failed; see the engine's log",
    502: "a proxy in front of the engine could not reach it",
    503: "the engine, or a proxy in front of it, is overloaded or not ready",
    504: "a proxy in front of the engine got no answer from it",
    **dict.fromkeys((301, 302, 303, 307, 308), "a redirect, not followed: point engines.*.url "
                    "and abort.path at the engine itself"),
}
_TIMEOUT_HINT = "the engine accepted the call but did not answer within abort.timeout_s"
_UNEXPECTED_HINT = ("the abort call could not be made; check engines.*.abort (e.g. a key aiohttp "
                    "refuses in a header) and report it if the config is fine")


_ERROR_HINTS = {
    "connect": "nothing accepts connections at the engine's url",
    "lost": "the connection was lost before an answer",
    "protocol": "the engine's answer was not HTTP/1.x",
}


def transient(exc_or_status: BaseException | int) -> bool:
    """True if an abort attempt that failed this way is worth repeating (see the module
    docstring): a lost or refused connection (not TLS), or status 502/503/504. Timeouts are
    not transient here: the engine hangs and the call may have landed."""
    if isinstance(exc_or_status, int):
        return exc_or_status in RETRY_STATUSES
    return isinstance(exc_or_status, AbortWireError) and exc_or_status.transient


def backoff(retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (1, 2, ...): ``RETRY_BACKOFF_S`` doubling,
    at most ``RETRY_BACKOFF_MAX_S``."""
    return float(min(RETRY_BACKOFF_S * 2 ** (retry - 1), RETRY_BACKOFF_MAX_S))


@dataclass(frozen=True, slots=True)
class _Answer:
    """How one attempt of an abort call ended."""

    outcome: str  # ok, http_<status>, timeout, error
    detail: str  # for the log: "HTTP 503", "ClientConnectorError: ...", "no answer within ..."
    hint: str  # what it usually means, or ""
    took: float  # seconds from sending to the answer
    transient: bool  # worth another attempt


@dataclass(slots=True, eq=False)
class _Request:
    """One request's abort, from :meth:`Aborter.abort` to its outcome."""

    ids: tuple[str, ...]
    sidecar_id: str
    noticed_at: float  # time.monotonic() when the disconnect was noticed
    request_log: RequestLog | None
    unsent: int  # ids (the last ones) not yet taken into a call
    calls: int = 0  # calls carrying some of its ids, not yet answered
    outcome: str | None = None  # the first outcome that was not accepted, else accepted
    resend: _Resend | None = None  # its re-sends, if it ended inside the registration window
    first: bool = True  # False for a re-send: counted in no request-level metric
    copies: int = 1  # calls it makes at once, each on another abort connection (confirming)
    confirmation: Confirmation | None = None  # the engine's word that the work stopped
    answered: bool = False  # its first call(s) ended; with a confirmation: awaiting the verdict

    def settle(self, outcome: str) -> bool:
        """Record a call's ``outcome``; True once every id was sent and answered."""
        if self.outcome is None or self.outcome == _OK:
            self.outcome = outcome
        return self.unsent == 0 and self.calls == 0


@dataclass(slots=True, eq=False)
class _Resend:
    """One request's re-sends at one engine: its ids again, at ``due`` (``time.monotonic()``),
    then after ``gap`` seconds doubling up to the engine's ``resend_max_interval_s``, the last
    one at ``until`` (the registration window's end)."""

    ids: tuple[str, ...]
    sidecar_id: str
    until: float
    due: float
    gap: float
    stopped: bool = False  # refused (re-sending cannot help), or the engine confirmed
    pending: _Request | None = None  # the last re-send queued (one at a time per request)
    # With a confirmation: each re-send makes ``width`` calls at once on as many abort
    # connections, ``width`` doubling up to ``abort.fanout`` from ``widen_from`` (the ids are
    # surely registered then); ``calls`` counts every call naming the ids (the first too), at
    # most ``abort.max_calls``.
    confirming: bool = False
    confirmation: Confirmation | None = None
    tried: set[int] = field(default_factory=set)  # id()s of the abort connections it went on
    widen_from: float = 0.0
    width: int = 1
    calls: int = 1
    resends: int = 0  # re-sends made (each of ``width`` calls)

    def advance(self, max_interval_s: float) -> bool:
        """Move to the next re-send; False once the one at ``until`` was made."""
        if self.due >= self.until:
            return False
        self.gap = min(self.gap * 2, max_interval_s)
        self.due = min(self.due + self.gap, self.until)
        return True


class _EarliestTimer:
    """One event-loop timer for many due times (``time.monotonic()``): set at the earliest and
    moved only when that gets earlier, so a storm of aborts pushes its due times (re-sends,
    confirmation bounds) without a timer each. The callback calls :meth:`fired` first."""

    __slots__ = ("_at", "_handle")

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def at_most(self, due: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``due``, or earlier if the timer is already set earlier."""
        if self._handle is not None:
            if self._at <= due:
                return
            self._handle.cancel()
        self._at = due
        self._handle = asyncio.get_running_loop().call_later(
            max(0.0, due - time.monotonic()), callback)

    def fired(self) -> None:
        self._handle = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@dataclass(slots=True, eq=False)
class _Queue:
    """One engine adapter's waiting requests and calls in flight."""

    engine: EngineAdapter
    waiting: deque[_Request] = field(default_factory=deque)  # first calls: always ahead
    waiting_ids: int = 0
    resending: deque[_Request] = field(default_factory=deque)  # re-sends, one per request
    resending_ids: int = 0
    in_flight: int = 0
    flush_scheduled: bool = False
    batch_since: float = 0.0  # time.monotonic() the first id waiting for the flush was queued
    flush_token: object = None  # the scheduled flush task's, so a stale done-callback is known
    resends: list[tuple[float, int, _Resend]] = field(default_factory=list)  # heap by due
    resend_timer: _EarliestTimer = field(default_factory=_EarliestTimer)

    def take(self, limit: int, *, resends: bool) -> tuple[tuple[str, ...], list[_Request]]:
        """Up to ``limit`` waiting ids, oldest first, first calls before re-sends (those only if
        ``resends``), and the requests they belong to. A request with more ids than fit is
        split; its remaining ids stay first in line."""
        ids: list[str] = []
        requests: list[_Request] = []
        for line in (self.waiting, self.resending) if resends else (self.waiting,):
            taken = len(ids)
            while line and len(ids) < limit:
                request = line[0]
                if request.resend is not None and request.resend.stopped and not request.first:
                    line.popleft()  # confirmed (or refused) while it waited: not sent
                    self.resending_ids -= request.unsent
                    request.unsent = 0
                    continue
                start = len(request.ids) - request.unsent
                count = min(request.unsent, limit - len(ids))
                ids.extend(request.ids[start:start + count])
                request.unsent -= count
                request.calls += 1
                requests.append(request)
                if request.unsent == 0:
                    line.popleft()
            if line is self.waiting:
                self.waiting_ids -= len(ids) - taken
            else:
                self.resending_ids -= len(ids) - taken
        return tuple(ids), requests

    def ready(self) -> bool:
        """Something to send now: a first call while a slot is free, a re-send while one of
        the ``RESEND_SLOTS`` is."""
        return bool((self.waiting and self.in_flight < MAX_CALLS_PER_ENGINE)
                    or (self.resending and self.in_flight < RESEND_SLOTS))

    def idle(self) -> bool:
        return (not self.waiting and not self.resending and self.in_flight == 0
                and not self.flush_scheduled and not self.resends)


class Aborter:
    """Batches abort ids per engine, sends them in background calls, records every outcome."""

    def __init__(self, tasks: TaskSet, metrics: Metrics) -> None:
        self._tasks = tasks
        self._metrics = metrics
        self._queues: dict[EngineAdapter, _Queue] = {}  # adapters compare by identity
        # By engine origin: survives config reloads. Configured engines' pools are kept warm;
        # others (per-request targets) are not, and at most MAX_COLD_POOLS are kept.
        self._pools: dict[str, AbortPool] = {}
        self._warm: set[str] = set()
        self._in_flight = 0
        self._order = itertools.count()  # ties in the re-send heap
        self._closed = False
        # Requests whose first call was answered, waiting for their engine's verdict.
        self._confirming: dict[_Request, EngineAdapter] = {}
        # By engine origin: when one was last seen to have several API-server processes.
        self._multi_at: dict[str, float] = {}
        # Confirmations by bound (time.monotonic()), and the one timer at the earliest.
        self._bounds: list[tuple[float, int, Confirmation]] = []
        self._bound_timer = _EarliestTimer()

    def warm(self, engines: list[EngineAdapter]) -> None:
        """Open warm abort connections to each engine that aborts (at startup and after a
        reload), so the first abort after it waits for no handshake."""
        for engine in engines:
            if engine.aborts:
                self._warm.add(engine.base_url)
                pool = self._pool(engine)
                pool.size, pool.spread = _spread(engine)
                pool.keep_alive(engine.keepalive_path, engine.abort_headers())
                if not pool.warm:
                    pool.warm = True
                    pool.start()

    def _pool(self, engine: EngineAdapter) -> AbortPool:
        url = engine.base_url
        pool = self._pools.pop(url, None)
        if pool is None:
            size, spread = _spread(engine)
            pool = AbortPool(url, warm=url in self._warm, size=size, spread=spread)
            pool.keep_alive(engine.keepalive_path, engine.abort_headers())
            pool.start()
            cold = [u for u in self._pools if u not in self._warm]
            if len(cold) >= MAX_COLD_POOLS:  # the least recently used
                self._tasks.spawn(self._pools.pop(cold[0]).close(),
                                  name=f"abort connections of {cold[0]}: close")
        self._pools[url] = pool  # most recently used last
        return pool

    async def close(self) -> None:
        """Stop the re-sends still due, give up the confirmations still awaited (their upstream
        connections closed, their outcome ``cancelled``) and close the abort connections (after
        the drain)."""
        self._closed = True
        self._bound_timer.cancel()
        self._bounds.clear()
        for queue in self._queues.values():
            queue.resend_timer.cancel()
            queue.resends.clear()
        for request, engine in list(self._confirming.items()):
            assert request.confirmation is not None
            request.confirmation.close()
            self._report(engine, request, "cancelled")
        await asyncio.gather(*(pool.close() for pool in self._pools.values()))

    def abort(self, engine: EngineAdapter, ids: tuple[str, ...], sidecar_id: str,
              noticed_at: float, request_log: RequestLog | None = None,
              body_sent_at: float | None = None,
              confirmation: Confirmation | None = None) -> None:
        """Queue ``ids`` (non-empty) for an abort call at ``engine``; returns at once.

        ``noticed_at`` is the ``time.monotonic()`` at which the disconnect was noticed; the
        request's abort latency is measured from it to the answer of the (last) call that
        carried its ids. ``request_log`` is told the request's outcome once (``cancelled`` if
        the sidecar stopped first, ``dropped`` if the engine's queue was full), so the
        request's access line waits for it. ``body_sent_at``: the ``time.monotonic()`` from
        which the registration window (``engines.*.abort.resend_window_s``) counts: when the
        engine got the whole body, or, for ids the engine may register any time later
        (:meth:`~engine.base.EngineAdapter.registers_later`), the disconnect itself; if the
        window is still open, the ids are re-sent until it closes (:class:`_Resend`); ``None``:
        no re-sends.

        ``confirmation``: the request's upstream response, watched for the engine's word that
        the work stopped (:mod:`sidecar.confirm`). Then the ids are re-sent until that verdict
        (whatever ``body_sent_at``), spread over the abort connections, for at most
        ``abort.confirm_timeout_s`` after ``noticed_at`` (or the registration window's end, if
        later), and the request's outcome is the verdict (``confirmed``, ``finished``,
        ``unconfirmed``), unless the first call was refused. Raises ``ValueError`` on an empty
        ``ids``.
        """
        if not ids:
            raise ValueError("refusing an empty id list: an engine may read it as 'abort all'")
        queue = self._queue(engine)
        request = _Request(ids, sidecar_id, noticed_at, request_log, len(ids))
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
            request.resend = _Resend(ids, sidecar_id, until, min(noticed_at + CONFIRM_WAIT_S,
                                                                 until),
                                     CONFIRM_WAIT_S, confirming=True,
                                     confirmation=confirmation, widen_from=known)
            if self._several(engine, noticed_at):
                # Seen with several API-server processes: the first call goes at once on
                # abort.fanout connections, as wide as a re-send would go by its fourth.
                request.copies = request.resend.calls = request.resend.width = (
                    engine.settings.abort.fanout)
            confirmation.arm(lambda verdict: self._verdict(engine, request, verdict))
            self._bound(until, confirmation)
        elif body_sent_at is not None and window_s > 0 and not self._closed:
            until = body_sent_at + window_s
            if until > noticed_at:
                # Scheduled once the first call is accepted (_finish): a refused one (403
                # without --enable-scale-out) gets no re-send at all.
                request.resend = _Resend(ids, sidecar_id, until,
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
        request = _Request(ids, sidecar_id, now, None, len(ids))
        if settings.resend_window_s > 0 and not self._closed:
            until = max(now, sent_at) + settings.resend_window_s
            wide = settings.fanout if engine.confirms else 1
            request.resend = _Resend(ids, sidecar_id, until, min(now + RESEND_FIRST_S, until),
                                     RESEND_FIRST_S, confirming=wide > 1, widen_from=now,
                                     width=wide, calls=wide)
            request.copies = wide
        self._enqueue(self._queue(engine), request)

    def _queue(self, engine: EngineAdapter) -> _Queue:
        queue = self._queues.get(engine)
        if queue is None:
            queue = self._queues[engine] = _Queue(engine)
        return queue

    def _enqueue(self, queue: _Queue, request: _Request) -> None:
        """Put ``request``'s ids in line (a re-send behind every first call) and make sure a
        flush runs in the next loop turn. A re-send that does not fit the bound is skipped: it
        never pushes out a first call."""
        ids = request.ids
        if not request.first:
            if queue.resending_ids + len(ids) > MAX_QUEUED_IDS:
                return
            queue.resending.append(request)
            queue.resending_ids += len(ids)
        else:
            while (queue.resending and queue.waiting_ids + queue.resending_ids + len(ids)
                   > MAX_QUEUED_IDS):  # re-sends give way first
                queue.resending_ids -= queue.resending.pop().unsent
            if (queue.waiting_ids + len(ids) > MAX_QUEUED_IDS
                    and not self._make_room(queue, request)):
                return
            queue.waiting.append(request)
            queue.waiting_ids += len(ids)
        if queue.flush_scheduled:
            now = time.monotonic()
            if now - queue.batch_since >= FLUSH_AGE_S and self._pool(queue.engine).idle():
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

    def _schedule_resend(self, queue: _Queue, resend: _Resend) -> None:
        heapq.heappush(queue.resends, (resend.due, next(self._order), resend))
        self._arm(queue)

    def _arm(self, queue: _Queue) -> None:
        """One timer per engine, at its earliest re-send (moved only when that gets earlier:
        a storm of aborts pushes its re-sends without a timer each)."""
        if queue.resends:
            queue.resend_timer.at_most(queue.resends[0][0],
                                       functools.partial(self._resend_due, queue))

    def _resend_due(self, queue: _Queue) -> None:
        """Queue every re-send due now (or within ``RESEND_COALESCE_S``) as one batch."""
        queue.resend_timer.fired()
        now = time.monotonic()
        engine = queue.engine
        settings = engine.settings.abort
        max_interval_s = settings.resend_max_interval_s
        count = 0
        if queue.resends and _waits_for_pacer(queue.resends[0][2], now):
            # Clients are still leaving (sidecar.read_pacer.ReadPacer holds or parks the
            # engine's reads, its ends among them, so that aborts go first): every re-send
            # waits, untouched (hundreds of them, each looked at every HELD_WAIT_S, took ~0.5
            # ms of loop time per look in python -m bench's storm, between the resets).
            queue.resend_timer.at_most(now + HELD_WAIT_S, functools.partial(self._resend_due,
                                                                            queue))
            return
        while queue.resends and queue.resends[0][0] <= now + RESEND_COALESCE_S:
            _, _, resend = heapq.heappop(queue.resends)
            if resend.confirmation is not None and not resend.stopped:
                # The engine's answer may be read and held (sidecar.read_pacer.ReadPacer: while
                # clients leave, engine reads wait so that aborts go first). While clients
                # still leave, the re-send waits for the pacer to relay it (reading hundreds
                # of ends here, in one step, would delay noticing the next clients' loss);
                # once they stopped, it is read now, before deciding.
                if _waits_for_pacer(resend, now):
                    resend.due = min(now + HELD_WAIT_S, resend.until)
                    heapq.heappush(queue.resends, (resend.due, next(self._order), resend))
                    continue
                resend.confirmation.read_held()
            if resend.stopped:
                continue
            if resend.pending is None or resend.pending.unsent == 0:  # the last one went out
                copies = 1
                if resend.confirming:  # wider each time: other abort connections, processes
                    several = self._several(engine, now)
                    if several:
                        resend.width = settings.fanout
                    copies = min(resend.width, settings.max_calls - resend.calls)
                    if now >= resend.widen_from or several:
                        resend.width = min(resend.width * 2, settings.fanout)
                    resend.calls += copies
                    resend.resends += 1
                again = resend.pending = _Request(resend.ids, resend.sidecar_id, now, None,
                                                  len(resend.ids), resend=resend, first=False,
                                                  copies=copies)
                self._enqueue(queue, again)
                count += len(resend.ids) * copies
            if resend.confirming and resend.calls >= settings.max_calls:
                continue  # its bound: the verdict is awaited without more calls
            if resend.advance(max_interval_s):
                heapq.heappush(queue.resends, (resend.due, next(self._order), resend))
        if count:
            self._metrics.abort_resent_ids.labels(engine.name).inc(count)
        self._arm(queue)
        if queue.idle() and self._queues.get(engine) is queue:
            del self._queues[engine]

    def _bound(self, until: float, confirmation: Confirmation) -> None:
        """Expire ``confirmation`` at ``until`` (``time.monotonic()``): one timer for all of them
        (a heap), set at the earliest and moved only when that gets earlier."""
        heapq.heappush(self._bounds, (until, next(self._order), confirmation))
        self._bound_timer.at_most(until, self._bounds_due)

    def _bounds_due(self) -> None:
        self._bound_timer.fired()
        now = time.monotonic()
        bounds = self._bounds
        # Within a clock tick counts as due: a re-arm rounded to 0 ms would turn the loop
        # without sleeping until the tick.
        while bounds and bounds[0][0] <= now + BOUND_EARLY_S:
            heapq.heappop(bounds)[2].expire()  # a no-op for one decided or closed already
        if bounds:
            self._bound_timer.at_most(bounds[0][0], self._bounds_due)

    def _several(self, engine: EngineAdapter, now: float) -> bool:
        """True if ``engine`` was seen with several API-server processes in the last
        ``MULTI_MEMORY_S`` (:meth:`_verdict`)."""
        seen = self._multi_at.get(engine.base_url)
        return seen is not None and now - seen < MULTI_MEMORY_S

    def _make_room(self, queue: _Queue, request: _Request) -> bool:
        """Fit ``request`` into its engine's full queue; True if it now fits.

        The waiting request with the most unsent ids gives way while it has more than
        ``request``; otherwise ``request`` itself is dropped. So one client's request with
        thousands of ids (a completion with a long prompt list) can never crowd out the aborts
        of many small ones. A dropped request ends ``dropped``: counted, logged, access line.
        """
        need = len(request.ids)
        while queue.waiting_ids + need > MAX_QUEUED_IDS:
            biggest = max(queue.waiting, key=lambda r: r.unsent, default=None)
            if biggest is None or biggest.unsent <= need:
                self._drop(queue, request)
                return False
            queue.waiting.remove(biggest)
            queue.waiting_ids -= biggest.unsent
            self._drop(queue, biggest)
        return True

    def _drop(self, queue: _Queue, request: _Request) -> None:
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

    async def _scheduled_flush(self, queue: _Queue) -> None:
        queue.flush_scheduled = False
        self._flush(queue)

    def _flush_never_ran(self, queue: _Queue) -> None:
        """The flush task was cancelled before its first step (the sidecar is stopping): what
        it would have sent ends as cancelled, unless calls in flight will take it."""
        if queue.flush_scheduled:
            queue.flush_scheduled = False
            if queue.in_flight == 0:
                self._cancel_waiting(queue)

    def _flush(self, queue: _Queue) -> None:
        """Start calls for what ``queue`` has waiting, while slots are free: each is written
        now, in the caller's step, on an idle warm connection (:meth:`AbortPool.begin`); a task
        per call waits for its answer."""
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
                    pending: PendingCall | None = self._pool(engine).begin(
                        call.path, call.json, engine.abort_headers(),
                        choose)
                except Exception:  # noqa: BLE001 - _post makes it again and reports the error
                    pending = None
                if pending is not None and pending.conn is not None:
                    for tried in spread:
                        tried.add(id(pending.conn))
                self._tasks.spawn(self._send(queue, call, len(ids), requests, pending),
                                  name=f"abort {engine.name}: {len(ids)} id(s)")
        if queue.idle() and self._queues.get(engine) is queue:
            del self._queues[engine]

    async def _send(self, queue: _Queue, call: AbortCall, count: int,
                    requests: list[_Request], pending: PendingCall | None = None) -> None:
        """One call carrying ``count`` ids of ``requests``, retried while it fails transiently;
        then the next batch, if any. The call keeps its slot until its last attempt."""
        engine = queue.engine
        attempts = 1 + engine.settings.abort.retries
        try:
            for attempt in range(1, attempts + 1):
                answer = await self._post(engine, call, pending if attempt == 1 else None)
                self._metrics.child(self._metrics.abort_calls, engine.name,
                                    answer.outcome).inc()
                retry = answer.transient and attempt < attempts
                self._log_attempt(engine, count, requests, answer, attempt, attempts, retry)
                if not retry:
                    break
                await asyncio.sleep(backoff(attempt))
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

    def _release(self, queue: _Queue) -> None:
        queue.in_flight -= 1
        self._in_flight -= 1

    async def _post(self, engine: EngineAdapter, call: AbortCall,
                    pending: PendingCall | None = None) -> _Answer:
        """One attempt at ``call``, bounded by ``abort.timeout_s``; never raises but
        ``CancelledError`` (any other exception is an ``error`` answer, so a call task always
        gives back its slot). ``pending``: the attempt already written by :meth:`_flush`, else
        written here, at once on the engine's warm connection (:mod:`sidecar.abort_wire`); the
        timeout counts from this step. A redirect is never followed: the ids (and the key) would
        go to another origin, and its 200 would say an abort was taken that was not."""
        timeout_s = engine.settings.abort.timeout_s
        sent = time.monotonic()
        try:
            pool = self._pool(engine)
            if pending is None:
                pending = pool.begin(call.path, call.json, engine.abort_headers())
            async with asyncio.timeout(timeout_s):
                status = await pool.answer(pending)
        except TimeoutError as exc:
            return _Answer("timeout", f"no answer within {timeout_s}s", _TIMEOUT_HINT,
                           time.monotonic() - sent, transient(exc))
        except AbortWireError as exc:
            return _Answer("error", f"{exc.kind}: {exc}", _ERROR_HINTS[exc.kind],
                           time.monotonic() - sent, transient(exc))
        except ssl.SSLError as exc:
            return _Answer("error", f"TLS: {type(exc).__name__}", "a TLS error with the engine",
                           time.monotonic() - sent, False)
        except Exception as exc:  # noqa: BLE001 - a call must never take its slot with it
            # Only the type is logged: the message may quote a header.
            return _Answer("error", f"unexpected {type(exc).__name__}", _UNEXPECTED_HINT,
                           time.monotonic() - sent, False)
        took = time.monotonic() - sent
        if 200 <= status < 300:
            return _Answer(_OK, f"HTTP {status}", "", took, False)
        return _Answer(f"http_{status}", f"HTTP {status}", ABORT_STATUS_HINTS.get(status, ""),
                       took, transient(status))

    def _settle(self, engine: EngineAdapter, requests: list[_Request], outcome: str) -> None:
        for request in requests:
            request.calls -= 1
            if request.resend is not None and outcome.startswith("http_"):
                # Refused (403 without --enable-scale-out, 401, 404, ...): re-sending cannot
                # help. A timeout or a lost connection does not stop them: an overloaded engine
                # is when registrations come late.
                request.resend.stopped = True
            if request.settle(outcome):
                self._finish(engine, request)

    def _cancel_waiting(self, queue: _Queue) -> None:
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

    def _finish(self, engine: EngineAdapter, request: _Request) -> None:
        """Every id of ``request`` was answered (or will never be sent): count and report it
        (a re-send is counted only in ``abort_calls_total`` and ``abort_resent_ids_total``),
        or, with a confirmation still open, re-send until the verdict (:meth:`_verdict`)."""
        if not request.first:
            return
        request.answered = True
        outcome = request.outcome or _OK
        resend = request.resend
        confirmation = request.confirmation
        if confirmation is not None:
            if confirmation.open:
                if outcome == _OK:
                    # The engine's verdict decides; re-sends meanwhile, the first once the
                    # engine had time to end the response (it aborts after it answers: vLLM's
                    # endpoint starts the abort in a task).
                    self._confirming[request] = engine
                    if resend is not None and not resend.stopped and not self._closed:
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
        elif resend is not None and outcome == _OK and not resend.stopped and not self._closed:
            queue = self._queue(engine)
            resend.due = min(max(resend.due, time.monotonic()), resend.until)
            self._schedule_resend(queue, resend)
        self._report(engine, request, outcome)

    def _verdict(self, engine: EngineAdapter, request: _Request, verdict: str) -> None:
        """The engine's verdict on ``request`` (:class:`~sidecar.confirm.Confirmation`): no more
        re-sends; reported now if its first call was answered, else by :meth:`_finish`."""
        resend = request.resend
        if resend is not None:
            resend.stopped = True
            if (verdict == CONFIRMED and resend.widen_from <= request.noticed_at
                    and resend.resends >= MULTI_RESENDS):
                self._multi_at[engine.base_url] = time.monotonic()
        if request.answered:
            self._report(engine, request, _verdict_outcome(request.outcome or _OK, verdict))

    def _report(self, engine: EngineAdapter, request: _Request, outcome: str) -> None:
        """Count ``request``'s final ``outcome`` once, observe its latency, tell its access
        line."""
        self._confirming.pop(request, None)
        confirmation = request.confirmation
        decided = confirmation.decided_at if confirmation is not None else None
        latency = (decided or time.monotonic()) - request.noticed_at
        metrics = self._metrics
        metrics.child(metrics.aborted_requests, engine.name, outcome).inc()
        if outcome == _OK:
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
                            request.sidecar_id, engine.name, " ".join(request.ids[:_LOGGED_IDS]),
                            latency, resend.calls)
        if request.request_log is not None:
            request.request_log.abort_done(outcome, latency)

    @staticmethod
    def _log_attempt(engine: EngineAdapter, count: int, requests: list[_Request],
                     answer: _Answer, attempt: int, attempts: int, retry: bool) -> None:
        named = " ".join(r.sidecar_id for r in requests[:_LOGGED_IDS])
        if len(requests) > _LOGGED_IDS:
            named += f" (+{len(requests) - _LOGGED_IDS} more)"
        if answer.outcome == _OK:
            resent = sum(not r.first for r in requests)
            # Re-sends alone (many, spread until a confirmation) at DEBUG.
            log.log(logging.DEBUG if resent == len(requests) else logging.INFO,
                    "engine %s accepted an abort call naming %d id(s) of %d request(s) [%s]%s "
                    "in %.1f ms (attempt %d of %d; an engine ignores ids it does not know yet)",
                    engine.name, count, len(requests), named,
                    f", {resent} of them re-sent" if resent else "", answer.took * 1000,
                    attempt, attempts)
            return
        hint = f" ({answer.hint})" if answer.hint else ""
        if retry:
            then = f"retrying in {backoff(attempt) * 1000:.0f} ms"
        elif answer.transient:
            then = "no retries left"
        else:
            then = "not retried"
        log.warning("abort call to engine %s: %d id(s) of %d request(s) [%s] failed: %s%s "
                    "(%s after %.1f ms); attempt %d of %d, %s", engine.name, count,
                    len(requests), named, answer.detail, hint, answer.outcome,
                    answer.took * 1000, attempt, attempts, then)


def _waits_for_pacer(resend: _Resend, now: float) -> bool:
    """True if ``resend`` waits, not due yet in effect: the engine's answer to its earlier
    calls is held or unread while clients leave (:attr:`Confirmation.held`), and its bound
    (``until``) is not reached."""
    confirmation = resend.confirmation
    return (confirmation is not None and not resend.stopped and now < resend.until
            and confirmation.held)


def _verdict_outcome(answered: str, verdict: str) -> str:
    """A confirmable request's outcome: the engine's verdict, unless nothing was confirmed and
    its first call had failed (``timeout``, ``error``): then that failure."""
    return answered if verdict == UNCONFIRMED and answered != _OK else verdict


def _spread(engine: EngineAdapter) -> tuple[int, bool]:
    """The abort connections to keep warm for ``engine``, and whether to spread them over the
    engine's API-server processes (an engine whose aborts are confirmed:
    :class:`~sidecar.abort_wire.AbortPool`)."""
    settings = engine.settings.abort
    if engine.confirms and settings.confirm_timeout_s > 0:
        return settings.connections, True
    return WARM, False


def _tried_by(tried: list[set[int]], conn: object) -> int:
    """How many of the requests whose abort connections ``tried`` holds went on ``conn``."""
    return sum(id(conn) in t for t in tried)
