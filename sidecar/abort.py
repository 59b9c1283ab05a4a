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

import aiohttp

from engine import AbortCall, EngineAdapter
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
              noticed_at: float) -> None:
        """Start aborting ``ids`` (non-empty) at ``engine``; returns at once.

        ``noticed_at`` is the ``time.monotonic()`` at which the disconnect was noticed; the
        abort latency metric is measured from it.
        """
        for call in engine.abort_calls(ids):
            self._tasks.spawn(self._call(engine, call, sidecar_id, noticed_at),
                              name=f"abort {engine.name} {sidecar_id}")

    async def _call(self, engine: EngineAdapter, call: AbortCall, sidecar_id: str,
                    noticed_at: float) -> None:
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
