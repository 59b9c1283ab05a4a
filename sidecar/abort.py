"""Abort: tell an engine to stop work for request ids whose client is gone.

Each call runs in its own named task (:class:`~sidecar.tasks.TaskSet`), so it survives the
cancelled handler that asked for it, and never delays the upstream close or other traffic. It is
bounded by the engine's ``abort.timeout_s``, on a connection pool of its own (at most
``MAX_CONCURRENT_CALLS`` at once). Outcomes are counted and logged with the sidecar request id;
the bearer key is never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import aiohttp

from engine import AbortCall, EngineAdapter
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

MAX_CONCURRENT_CALLS = 64


class Aborter:
    """Fires abort calls in the background and records their outcome."""

    def __init__(self, session: aiohttp.ClientSession, tasks: TaskSet, metrics: Metrics) -> None:
        self._session = session
        self._tasks = tasks
        self._metrics = metrics

    def abort(self, engine: EngineAdapter, ids: tuple[str, ...], sidecar_id: str,
              noticed_at: float, request_log: RequestLog | None = None) -> None:
        """Start aborting ``ids`` (non-empty) at ``engine``; returns at once.

        ``noticed_at`` is the ``time.monotonic()`` at which the disconnect was noticed; the
        abort latency metric is measured from it. ``request_log`` is told of every call and
        its outcome (``cancelled`` if the sidecar stopped first), so the request's access line
        waits for them.
        """
        for call in engine.abort_calls(ids):
            task = self._tasks.spawn(self._call(engine, call, sidecar_id, noticed_at),
                                     name=f"abort {engine.name} {sidecar_id}")
            if request_log is not None:
                request_log.abort_started()
                task.add_done_callback(partial(_report, request_log, noticed_at))

    async def _call(self, engine: EngineAdapter, call: AbortCall, sidecar_id: str,
                    noticed_at: float) -> str:
        """One abort call; returns its outcome (``ok``, ``http_<status>``, ``timeout``,
        ``error``)."""
        url = engine.base_url + call.path
        try:
            async with asyncio.timeout(engine.settings.abort.timeout_s):
                async with self._session.post(url, json=call.json,
                                              headers=engine.abort_headers()) as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            outcome, detail = "timeout", f"no answer within {engine.settings.abort.timeout_s}s"
        except aiohttp.ClientError as exc:
            outcome, detail = "error", f"{type(exc).__name__}: {exc}"
        else:
            outcome = "ok" if 200 <= status < 300 else f"http_{status}"
            detail = f"HTTP {status}"
        elapsed = time.monotonic() - noticed_at
        self._metrics.abort_calls.labels(engine.name, outcome).inc()
        if outcome == "ok":
            self._metrics.abort_latency.labels(engine.name).observe(elapsed)
            log.info("request %s: engine %s aborted %s in %.1f ms", sidecar_id, engine.name,
                     call.json, elapsed * 1000)
        else:
            hint = ""
            if outcome == "http_403":
                hint = " (vLLM answers 403 when started without --enable-scale-out)"
            elif outcome == "http_401":
                hint = " (check engines.*.abort.api_key)"
            log.warning("request %s: abort at engine %s failed: %s%s", sidecar_id, engine.name,
                        detail, hint)
        return outcome


def _report(request_log: RequestLog, noticed_at: float, task: asyncio.Task[str]) -> None:
    """Done-callback of an abort task: runs even if the task was cancelled before it began."""
    if task.cancelled():
        outcome = "cancelled"
    elif task.exception() is not None:
        outcome = "error"  # already logged by the TaskSet
    else:
        outcome = task.result()
    request_log.abort_done(outcome, time.monotonic() - noticed_at)
