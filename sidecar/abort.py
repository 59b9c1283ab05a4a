"""Abort: tell an engine to stop work for request ids whose client is gone.

:meth:`Aborter.abort` only queues a request's ids and returns. Per engine, a flush scheduled with
``loop.call_soon`` packs everything queued in that event-loop turn into as few calls as the
engine allows (:attr:`~engine.base.EngineAdapter.max_ids_per_call`; vLLM takes a list), so a
lone abort waits for nothing and a burst of disconnects becomes a few large calls::

    abort(ids) ──► engine queue ──(call_soon flush)──► call task (TaskSet) ──► POST abort path
                    ▲                                      │ answer: outcome to each request
                    └─────── next batch, when a slot frees ┘

Bounds (module constants):

- at most ``MAX_CALLS_PER_ENGINE`` calls in flight per engine and ``MAX_CONCURRENT_CALLS`` in
  all (the abort session's pool size, so a call never waits for a pooled connection). Ids that
  arrive while every slot is busy wait and join the next batch;
- at most ``MAX_QUEUED_IDS`` ids wait per engine. A request whose ids would exceed that is not
  sent: its outcome is ``dropped`` (counted and logged), never silently lost;
- ``abort.timeout_s`` bounds each call from sending to the answer, not the wait for a slot.

Each call runs in its own named task, so it survives the cancelled handler that asked for it and
never delays the upstream close or other traffic. Outcomes: ``ok``, ``http_<status>``,
``timeout``, ``error``; for a request also ``dropped``, and ``cancelled`` if the sidecar stopped
first. ``cancel_sidecar_abort_calls_total`` counts calls; every request gets the outcome of the
call(s) that carried its ids in ``cancel_sidecar_aborted_requests_total``, the latency histogram
and its access line. One log line per call (ids, requests, outcome, latency); the bearer key is
never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from engine import AbortCall, EngineAdapter
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

MAX_CALLS_PER_ENGINE = 8
MAX_CONCURRENT_CALLS = 64  # over all engines; also the abort session's pool size (sidecar.app)
MAX_QUEUED_IDS = 16384  # per engine, waiting for a slot: at most ~8 MB held while an engine hangs
_LOGGED_IDS = 8  # sidecar request ids named in a call's log line; the access lines have the rest
_OK = "ok"

# What an abort endpoint's refusal usually means; for the logs and /readyz.
ABORT_STATUS_HINTS = {
    401: "the engine rejected abort.api_key",
    403: "the abort endpoint is disabled: start vLLM with --enable-scale-out",
    404: "no abort endpoint at abort.path",
}


@dataclass(slots=True, eq=False)
class _Request:
    """One request's abort, from :meth:`Aborter.abort` to its outcome."""

    ids: tuple[str, ...]
    sidecar_id: str
    noticed_at: float  # time.monotonic() when the disconnect was noticed
    request_log: RequestLog | None
    unsent: int  # ids (the last ones) not yet taken into a call
    calls: int = 0  # calls carrying some of its ids, not yet answered
    outcome: str | None = None  # the first outcome that was not ok, else ok

    def settle(self, outcome: str) -> bool:
        """Record a call's ``outcome``; True once every id was sent and answered."""
        if self.outcome is None or self.outcome == _OK:
            self.outcome = outcome
        return self.unsent == 0 and self.calls == 0


@dataclass(slots=True, eq=False)
class _Queue:
    """One engine adapter's waiting requests and calls in flight."""

    engine: EngineAdapter
    waiting: deque[_Request] = field(default_factory=deque)
    waiting_ids: int = 0
    in_flight: int = 0
    flush_scheduled: bool = False

    def take(self, limit: int) -> tuple[tuple[str, ...], list[_Request]]:
        """Up to ``limit`` waiting ids, oldest first, and the requests they belong to. A request
        with more ids than fit is split; its remaining ids stay first in line."""
        ids: list[str] = []
        requests: list[_Request] = []
        while self.waiting and len(ids) < limit:
            request = self.waiting[0]
            start = len(request.ids) - request.unsent
            count = min(request.unsent, limit - len(ids))
            ids.extend(request.ids[start:start + count])
            request.unsent -= count
            request.calls += 1
            requests.append(request)
            if request.unsent == 0:
                self.waiting.popleft()
        self.waiting_ids -= len(ids)
        return tuple(ids), requests

    def idle(self) -> bool:
        return not self.waiting and self.in_flight == 0 and not self.flush_scheduled


class Aborter:
    """Batches abort ids per engine, sends them in background calls, records every outcome."""

    def __init__(self, session: aiohttp.ClientSession, tasks: TaskSet, metrics: Metrics) -> None:
        self._session = session
        self._tasks = tasks
        self._metrics = metrics
        self._queues: dict[EngineAdapter, _Queue] = {}  # adapters compare by identity
        self._in_flight = 0

    def abort(self, engine: EngineAdapter, ids: tuple[str, ...], sidecar_id: str,
              noticed_at: float, request_log: RequestLog | None = None) -> None:
        """Queue ``ids`` (non-empty) for an abort call at ``engine``; returns at once.

        ``noticed_at`` is the ``time.monotonic()`` at which the disconnect was noticed; the
        request's abort latency is measured from it to the answer of the (last) call that
        carried its ids. ``request_log`` is told the request's outcome once (``cancelled`` if
        the sidecar stopped first, ``dropped`` if the engine's queue was full), so the
        request's access line waits for it. Raises ``ValueError`` on an empty ``ids``.
        """
        if not ids:
            raise ValueError("refusing an empty id list: an engine may read it as 'abort all'")
        queue = self._queues.get(engine)
        if queue is None:
            queue = self._queues[engine] = _Queue(engine)
        request = _Request(ids, sidecar_id, noticed_at, request_log, len(ids))
        if request_log is not None:
            request_log.abort_started()
        if queue.waiting_ids + len(ids) > MAX_QUEUED_IDS:
            log.warning("request %s: abort queue of engine %s is full (%d ids waiting for one of "
                        "%d calls in flight); %d id(s) not aborted", sidecar_id, engine.name,
                        queue.waiting_ids, queue.in_flight, len(ids))
            request.unsent = 0
            request.settle("dropped")
            self._finish(engine, request)
            return
        queue.waiting.append(request)
        queue.waiting_ids += len(ids)
        if not queue.flush_scheduled:
            queue.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_flush, queue)

    def _scheduled_flush(self, queue: _Queue) -> None:
        queue.flush_scheduled = False
        self._flush(queue)

    def _flush(self, queue: _Queue) -> None:
        """Start calls for what ``queue`` has waiting, while slots are free."""
        engine = queue.engine
        while (queue.waiting and queue.in_flight < MAX_CALLS_PER_ENGINE
               and self._in_flight < MAX_CONCURRENT_CALLS):
            ids, requests = queue.take(engine.max_ids_per_call)
            call = engine.abort_call(ids)
            queue.in_flight += 1
            self._in_flight += 1
            self._tasks.spawn(self._send(queue, call, len(ids), requests),
                              name=f"abort {engine.name}: {len(ids)} id(s)")
        if queue.idle() and self._queues.get(engine) is queue:
            del self._queues[engine]

    async def _send(self, queue: _Queue, call: AbortCall, count: int,
                    requests: list[_Request]) -> None:
        """One call carrying ``count`` ids of ``requests``; then the next batch, if any."""
        engine = queue.engine
        try:
            outcome, detail, took = await self._post(engine, call)
        except asyncio.CancelledError:
            # The sidecar is stopping (TaskSet.drain): these requests, and what waits behind
            # the last call in flight, end as cancelled.
            self._release(queue)
            self._settle(engine, requests, "cancelled")
            if queue.in_flight == 0:
                self._cancel_waiting(queue)
            raise
        self._release(queue)
        self._metrics.abort_calls.labels(engine.name, outcome).inc()
        self._log_call(engine, count, requests, outcome, detail, took)
        self._settle(engine, requests, outcome)
        self._flush(queue)
        for other in list(self._queues.values()):  # a slot under MAX_CONCURRENT_CALLS is free
            if other.waiting and self._in_flight < MAX_CONCURRENT_CALLS:
                self._flush(other)

    def _release(self, queue: _Queue) -> None:
        queue.in_flight -= 1
        self._in_flight -= 1

    async def _post(self, engine: EngineAdapter, call: AbortCall) -> tuple[str, str, float]:
        """Send ``call``; returns (outcome, detail, seconds from sending to the answer)."""
        url = engine.base_url + call.path
        timeout_s = engine.settings.abort.timeout_s
        sent = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(url, json=call.json,
                                              headers=engine.abort_headers()) as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            outcome, detail = "timeout", f"no answer within {timeout_s}s"
        except aiohttp.ClientError as exc:
            outcome, detail = "error", f"{type(exc).__name__}: {exc}"
        else:
            outcome = _OK if 200 <= status < 300 else f"http_{status}"
            detail = f"HTTP {status}"
        return outcome, detail, time.monotonic() - sent

    def _settle(self, engine: EngineAdapter, requests: list[_Request], outcome: str) -> None:
        for request in requests:
            request.calls -= 1
            if request.settle(outcome):
                self._finish(engine, request)

    def _cancel_waiting(self, queue: _Queue) -> None:
        while queue.waiting:
            request = queue.waiting.popleft()
            queue.waiting_ids -= request.unsent
            request.unsent = 0
            if request.settle("cancelled"):
                self._finish(queue.engine, request)
        if queue.idle() and self._queues.get(queue.engine) is queue:
            del self._queues[queue.engine]

    def _finish(self, engine: EngineAdapter, request: _Request) -> None:
        """Every id of ``request`` was answered (or will never be sent): count and report it."""
        outcome = request.outcome or _OK
        latency = time.monotonic() - request.noticed_at
        self._metrics.aborted_requests.labels(engine.name, outcome).inc()
        if outcome == _OK:
            self._metrics.abort_latency.labels(engine.name).observe(latency)
        if request.request_log is not None:
            request.request_log.abort_done(outcome, latency)

    @staticmethod
    def _log_call(engine: EngineAdapter, count: int, requests: list[_Request], outcome: str,
                  detail: str, took: float) -> None:
        named = " ".join(r.sidecar_id for r in requests[:_LOGGED_IDS])
        if len(requests) > _LOGGED_IDS:
            named += f" (+{len(requests) - _LOGGED_IDS} more)"
        if outcome == _OK:
            log.info("engine %s aborted %d id(s) of %d request(s) [%s] in %.1f ms (one call)",
                     engine.name, count, len(requests), named, took * 1000)
            return
        known = ABORT_STATUS_HINTS.get(int(outcome[5:])) if outcome.startswith("http_") else None
        hint = f" ({known})" if known else ""
        log.warning("abort call to engine %s: %d id(s) of %d request(s) [%s] failed: %s%s "
                    "(%s after %.1f ms)", engine.name, count, len(requests), named, detail, hint,
                    outcome, took * 1000)
