"""One abort call: its attempts on the engine's abort connections, their retries and backoff, and
each answer's outcome, hint and log line.

:class:`sidecar.abort.Aborter` decides what a call carries and when it leaves (its batches come
from :mod:`sidecar.abort_queue`'s queues) and gives it a slot; :func:`make_call` makes it,
retries it while it fails transiently and hands back its last :class:`Answer`, whose outcome the
Aborter records for every request the call carried. The connections it goes on are
:class:`Pools`' (one :class:`~sidecar.abort_wire.AbortPool` per engine origin).

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

Outcomes of an attempt: ``accepted`` (a 2xx), ``http_<status>``, ``timeout``, ``error``;
``cancel_sidecar_abort_calls_total`` counts every attempt by its outcome. One log line per attempt
that failed (ids, requests, outcome, hint, whether it is retried) and one per call that succeeded;
the bearer key is never logged. The lines keep the logger ``sidecar.abort``, as they were before
they moved here.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine import AbortCall, EngineAdapter
from sidecar.abort_wire import WARM, AbortPool, AbortWireError, PendingCall
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

log = logging.getLogger("sidecar.abort")  # the abort path's lines: one logger (docstring)

ACCEPTED = "accepted"  # the outcome of an attempt the engine answered with 2xx
LOGGED_IDS = 8  # sidecar request ids named in a call's log line; the access lines have the rest
RETRY_BACKOFF_S = 0.05  # before the first retry, seconds; doubles for each further one
RETRY_BACKOFF_MAX_S = 1.0
RETRY_STATUSES = frozenset({502, 503, 504})
MAX_COLD_POOLS = 256  # abort connection pools of engines not in the config (per-request targets)

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
class Answer:
    """How one attempt of an abort call ended."""

    outcome: str  # accepted, http_<status>, timeout, error
    detail: str  # for the log: "HTTP 503", "ClientConnectorError: ...", "no answer within ..."
    hint: str  # what it usually means, or ""
    took: float  # seconds from sending to the answer
    transient: bool  # worth another attempt


class Carried(Protocol):
    """What a call's log line tells of a request whose ids it carries
    (:class:`sidecar.abort_queue.Request`)."""

    sidecar_id: str
    first: bool  # False for a re-send


class Pools:
    """The abort connections, one :class:`~sidecar.abort_wire.AbortPool` per engine origin:
    they survive config reloads. Configured engines' pools are kept warm; others (per-request
    targets) are not, and at most ``MAX_COLD_POOLS`` are kept."""

    def __init__(self, tasks: TaskSet) -> None:
        self._tasks = tasks
        self._pools: dict[str, AbortPool] = {}
        self._warm: set[str] = set()

    def warm(self, engines: list[EngineAdapter]) -> None:
        """Open warm abort connections to each engine that aborts (at startup and after a
        reload), so the first abort after it waits for no handshake."""
        for engine in engines:
            if engine.aborts:
                self._warm.add(engine.base_url)
                pool = self.get(engine)
                pool.size, pool.spread = _spread(engine)
                pool.keep_alive(engine.keepalive_path, engine.abort_headers())
                if not pool.warm:
                    pool.warm = True
                    pool.start()

    def get(self, engine: EngineAdapter) -> AbortPool:
        """``engine``'s pool, started if it is new (then the least recently used cold pool is
        closed beyond ``MAX_COLD_POOLS``)."""
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
        await asyncio.gather(*(pool.close() for pool in self._pools.values()))


async def make_call(pools: Pools, metrics: Metrics, engine: EngineAdapter, call: AbortCall,
                    count: int, requests: Sequence[Carried],
                    pending: PendingCall | None = None) -> Answer:
    """One call carrying ``count`` ids of ``requests``, retried while it fails transiently, each
    attempt counted and logged; returns the last attempt's answer. ``pending``: the first
    attempt, already written (:func:`_post`). ``CancelledError`` (the sidecar stopping) is
    raised as it comes."""
    attempts = 1 + engine.settings.abort.retries
    for attempt in range(1, attempts + 1):
        answer = await _post(pools, engine, call, pending if attempt == 1 else None)
        metrics.child(metrics.abort_calls, engine.name, answer.outcome).inc()
        retry = answer.transient and attempt < attempts
        _log_attempt(engine, count, requests, answer, attempt, attempts, retry)
        if not retry:
            break
        await asyncio.sleep(backoff(attempt))
    return answer


async def _post(pools: Pools, engine: EngineAdapter, call: AbortCall,
                pending: PendingCall | None = None) -> Answer:
    """One attempt at ``call``, bounded by ``abort.timeout_s``; never raises but
    ``CancelledError`` (any other exception is an ``error`` answer, so a call task always
    gives back its slot). ``pending``: the attempt already written by
    :meth:`sidecar.abort.Aborter._flush`, else written here, at once on the engine's warm
    connection (:mod:`sidecar.abort_wire`); the timeout counts from this step. A redirect is
    never followed: the ids (and the key) would go to another origin, and its 200 would say an
    abort was taken that was not."""
    timeout_s = engine.settings.abort.timeout_s
    sent = time.monotonic()
    try:
        pool = pools.get(engine)
        if pending is None:
            pending = pool.begin(call.path, call.json, engine.abort_headers())
        async with asyncio.timeout(timeout_s):
            status = await pool.answer(pending)
    except TimeoutError as exc:
        return Answer("timeout", f"no answer within {timeout_s}s", _TIMEOUT_HINT,
                      time.monotonic() - sent, transient(exc))
    except AbortWireError as exc:
        return Answer("error", f"{exc.kind}: {exc}", _ERROR_HINTS[exc.kind],
                      time.monotonic() - sent, transient(exc))
    except ssl.SSLError as exc:
        return Answer("error", f"TLS: {type(exc).__name__}", "a TLS error with the engine",
                      time.monotonic() - sent, False)
    except Exception as exc:  # noqa: BLE001 - a call must never take its slot with it
        # Only the type is logged: the message may quote a header.
        return Answer("error", f"unexpected {type(exc).__name__}", _UNEXPECTED_HINT,
                      time.monotonic() - sent, False)
    took = time.monotonic() - sent
    if 200 <= status < 300:
        return Answer(ACCEPTED, f"HTTP {status}", "", took, False)
    return Answer(f"http_{status}", f"HTTP {status}", ABORT_STATUS_HINTS.get(status, ""),
                  took, transient(status))


def _log_attempt(engine: EngineAdapter, count: int, requests: Sequence[Carried],
                 answer: Answer, attempt: int, attempts: int, retry: bool) -> None:
    named = " ".join(r.sidecar_id for r in requests[:LOGGED_IDS])
    if len(requests) > LOGGED_IDS:
        named += f" (+{len(requests) - LOGGED_IDS} more)"
    if answer.outcome == ACCEPTED:
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


def _spread(engine: EngineAdapter) -> tuple[int, bool]:
    """The abort connections to keep warm for ``engine``, and whether to spread them over the
    engine's API-server processes (an engine whose aborts are confirmed:
    :class:`~sidecar.abort_wire.AbortPool`)."""
    settings = engine.settings.abort
    if engine.confirms and settings.confirm_timeout_s > 0:
        return settings.connections, True
    return WARM, False
