"""Engine readiness: one check for ``/readyz`` and for the startup check, and what to fix.

:func:`check_engine` decides whether one engine is ready: its ``GET <health path>`` answers 2xx
and, for a kind that aborts (not ``openai``), its abort endpoint accepts a real call naming one
id no request can have (``cancel-sidecar-readiness-probe-<uuid>``; vLLM and SGLang ignore
unknown ids, so it proves the route and the key only; never an empty list). Its verdict is
``"ok"`` or a hint that says exactly what to fix (:func:`abort_hint`, :func:`error_hint`)::

    vLLM 403            start vLLM with --enable-scale-out (its abort endpoint ... is disabled)
    401                 the engine rejected engines.X.abort.api_key: set it to its --api-key
    404                 no abort endpoint at PATH: check engines.X.abort.path (...) or the version
    connection refused  nothing listens at URL: is the engine up? (retrying)
    health non-2xx      URL/health answered STATUS

:class:`Readiness` runs the check over every engine of the current config generation, remembers
each engine's last verdict and logs only changes (INFO ``engine X ready (...)``, WARNING
``engine X not ready: HINT``), whoever asked: ``/readyz`` or :meth:`Readiness.watch`, the
startup check the CLI starts once the listeners are up (in the supervisor under ``--workers``).
Each verdict also sets ``cancel_sidecar_engine_ready`` (:class:`~sidecar.metrics.ReadinessMetrics`)
when the admin listener exports metrics.
The watch never blocks or fails the start (in a pod the engine usually starts after the
sidecar): it re-checks every ``RECHECK_FIRST_S`` seconds, doubling up to ``RECHECK_MAX_S``,
until every engine is ready, and is cancelled when the sidecar stops. The abort key is sent,
never logged.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import aiohttp
from aiohttp import web

from engine import EngineAdapter
from sidecar.abort import ABORT_STATUS_HINTS
from sidecar.config import EngineKind
from sidecar.keys import READINESS
from sidecar.metrics import ReadinessMetrics
from sidecar.runtime import Runtimes

log = logging.getLogger(__name__)

OK = "ok"
READY_TIMEOUT_S = 2.0  # per engine: the health GET and the abort probe together
RECHECK_FIRST_S = 2.0  # startup check: seconds before the first re-check; doubles per round
RECHECK_MAX_S = 30.0
PROBE_PREFIX = "cancel-sidecar-readiness-probe-"


def abort_hint(adapter: EngineAdapter, path: str, status: int) -> str:
    """What to fix when ``adapter``'s abort endpoint ``path`` answered ``status`` (not 2xx)."""
    name = adapter.name
    if status == 403 and adapter.kind is EngineKind.VLLM:
        return f"start vLLM with --enable-scale-out (its abort endpoint {path} is disabled)"
    if status == 401:
        if adapter.settings.abort.api_key is None:
            return (f"the engine wants a key on {path}: set engines.{name}.abort.api_key to "
                    "the engine's --api-key")
        return (f"the engine rejected engines.{name}.abort.api_key: set it to the engine's "
                "--api-key")
    if status == 404:
        return (f"no abort endpoint at {path}: check engines.{name}.abort.path (vLLM: "
                "/inference/v1/abort_requests; SGLang: /abort_request) or the engine version")
    hint = ABORT_STATUS_HINTS.get(status)
    return f"abort endpoint {path} answered {status}" + (f": {hint}" if hint else "")


def error_hint(adapter: EngineAdapter, url: str, exc: BaseException) -> str:
    """What to fix when a readiness request to ``url`` failed with ``exc`` (a timeout or an
    ``aiohttp.ClientError``)."""
    if isinstance(exc, TimeoutError):
        return f"{url} did not answer within {READY_TIMEOUT_S:g} s: is the engine overloaded?"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS to {adapter.base_url} failed ({type(exc).__name__}): check engines." \
               f"{adapter.name}.url and the engine's certificate"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"nothing listens at {adapter.base_url}: is the engine up? (retrying)"
    return f"{url} failed: {type(exc).__name__} (retrying)"


async def check_engine(session: aiohttp.ClientSession, adapter: EngineAdapter) -> str:
    """``"ok"``, or what to fix (see the module docstring), within ``READY_TIMEOUT_S``."""
    url = adapter.base_url + adapter.health_path
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            async with session.get(url, allow_redirects=False) as resp:
                await resp.read()
                if resp.status >= 300:
                    return f"{url} answered {resp.status}"
            probe = (f"{PROBE_PREFIX}{uuid.uuid4().hex}",)
            for call in adapter.abort_calls(probe) if adapter.aborts else ():
                url = adapter.base_url + call.path
                async with session.post(url, json=call.json, allow_redirects=False,
                                        headers=adapter.abort_headers()) as resp:
                    await resp.read()
                    if resp.status >= 300:
                        return abort_hint(adapter, call.path, resp.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return error_hint(adapter, url, exc)
    return OK


class Readiness:
    """The readiness of the engines of ``runtimes.current``, and the log of its changes."""

    def __init__(self, runtimes: Runtimes, metrics: ReadinessMetrics | None = None) -> None:
        self._runtimes = runtimes
        self._metrics = metrics
        self._last: dict[str, str] = {}

    async def check(self) -> dict[str, str]:
        """Check every engine concurrently; engine name -> ``"ok"`` or what to fix. Logs each
        engine whose verdict changed since the last check (the first check logs them all)."""
        runtime = self._runtimes.current
        # An abort_from_header template's own url is never called: nothing to probe there.
        names = [n for n in runtime.adapters if n not in runtime.router.templates_only]
        # A session of its own, never pooled: the proxy's pool stays the clients' own, and a
        # reload that closes the generation's sessions cannot cut a check short.
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False) as session:
            verdicts = await asyncio.gather(
                *(check_engine(session, runtime.adapters[n]) for n in names))
        results = dict(zip(names, verdicts, strict=True))
        for name, verdict in results.items():
            if self._last.get(name) == verdict:
                continue
            if verdict == OK:
                log.info("engine %s ready (%s)", name,
                         "health ok, abort endpoint ok" if runtime.adapters[name].aborts
                         else "health ok; its kind has no abort endpoint")
            else:
                log.warning("engine %s not ready: %s", name, verdict)
        if self._metrics is not None:
            for name, verdict in results.items():
                self._metrics.engine_ready.labels(engine=name).set(1 if verdict == OK else 0)
            for gone in self._last.keys() - results.keys():  # removed by a reload
                self._metrics.engine_ready.remove(gone)
        self._last = results
        return results

    async def watch(self) -> None:
        """The startup check: :meth:`check` now, then again after ``RECHECK_FIRST_S`` seconds,
        doubling up to ``RECHECK_MAX_S``, until every engine is ready. Cancel it to stop."""
        delay = RECHECK_FIRST_S
        while not all(v == OK for v in (await self.check()).values()):
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECHECK_MAX_S)


async def startup_check(admin: web.AppRunner | None, runtimes: Runtimes) -> None:
    """:meth:`Readiness.watch` with the admin listener's :class:`Readiness` (shared with
    ``/readyz``), or a new one when there is no admin listener. Started by the CLI once the
    listeners are up; never fails the start (the engine often starts after the sidecar)."""
    readiness = admin.app[READINESS] if admin is not None else Readiness(runtimes)
    await readiness.watch()
