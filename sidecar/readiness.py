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

An engine whose health endpoint answers 2xx but whose abort endpoint does not (any of the abort
hints above, or no answer from it) is *up without aborts*. What that makes it is the engine's
``abort.when_unavailable`` (:class:`~sidecar.config.WhenAbortUnavailable`): ``not_ready`` (the
default) keeps the hint as its verdict; ``close_only`` makes it ``"ok"``, so that ``/readyz``
answers 200 and the pod serves, with a disconnect closing the upstream connection only. The
abort calls are still sent there: a refused one closes the upstream at once
(:mod:`sidecar.abort`), each counts in ``cancel_sidecar_abort_calls_total`` (``http_403``...),
and the first one after the engine is fixed aborts, with no wait for a re-check.

:class:`Readiness` runs the check over every engine of the current config generation, remembers
each engine's last state and logs only changes (INFO ``engine X ready (...)``; WARNING
``engine X not ready: HINT``, naming ``when_unavailable: close_only`` when only the abort
endpoint failed; WARNING ``engine X serving close-only: HINT`` under ``close_only``), whoever
asked: ``/readyz`` or :meth:`Readiness.watch`, the startup check the CLI starts once the
listeners are up (in the supervisor under ``--workers``). Each check also sets
``cancel_sidecar_engine_ready`` and ``cancel_sidecar_engine_abort_unavailable``
(:class:`~sidecar.metrics.ReadinessMetrics`) when the admin listener exports metrics.
The watch never blocks or fails the start (in a pod the engine usually starts after the
sidecar): it re-checks every ``RECHECK_FIRST_S`` seconds, doubling up to ``RECHECK_MAX_S``,
until every engine is ready with its aborts (one serving close-only is re-checked on, so that
its gauge and log say when it is fixed even where nothing polls ``/readyz``), and is cancelled
when the sidecar stops. The abort key is sent, never logged.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import NamedTuple

import aiohttp
from aiohttp import web

from engine import EngineAdapter
from sidecar.abort_call import ABORT_STATUS_HINTS
from sidecar.config import EngineKind, WhenAbortUnavailable
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


class Verdict(NamedTuple):
    """One engine's check: ``hint`` is ``"ok"`` or what to fix; ``abort_only`` says the health
    endpoint answered 2xx and only the abort endpoint failed (the engine is up without aborts)."""

    hint: str
    abort_only: bool = False


async def check_engine(session: aiohttp.ClientSession, adapter: EngineAdapter) -> Verdict:
    """Its :class:`Verdict` (see the module docstring), within ``READY_TIMEOUT_S``."""
    url = adapter.base_url + adapter.health_path
    healthy = False
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            async with session.get(url, allow_redirects=False) as resp:
                await resp.read()
                if resp.status >= 300:
                    return Verdict(f"{url} answered {resp.status}")
            healthy = True
            probe = (f"{PROBE_PREFIX}{uuid.uuid4().hex}",)
            for call in adapter.abort_calls(probe) if adapter.aborts else ():
                url = adapter.base_url + call.path
                async with session.post(url, json=call.json, allow_redirects=False,
                                        headers=adapter.abort_headers()) as resp:
                    await resp.read()
                    if resp.status >= 300:
                        return Verdict(abort_hint(adapter, call.path, resp.status), True)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Verdict(error_hint(adapter, url, exc), healthy)
    return Verdict(OK)


class Readiness:
    """The readiness of the engines of ``runtimes.current``, and the log of its changes."""

    def __init__(self, runtimes: Runtimes, metrics: ReadinessMetrics | None = None) -> None:
        self._runtimes = runtimes
        self._metrics = metrics
        self._last: dict[str, Verdict] = {}
        self._close_only: set[str] = set()  # engines serving close-only at the last check

    async def check(self) -> dict[str, str]:
        """Check every engine concurrently; engine name -> ``"ok"`` (ready: it may get traffic)
        or what to fix. An engine up without aborts is ``"ok"`` if its
        ``abort.when_unavailable`` is ``close_only``, else its hint. Logs each engine whose
        state changed since the last check (the first check logs them all)."""
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
        checked = dict(zip(names, verdicts, strict=True))
        close_only = {name for name, verdict in checked.items() if verdict.abort_only and
                      runtime.adapters[name].settings.abort.when_unavailable
                      is WhenAbortUnavailable.CLOSE_ONLY}
        for name, verdict in checked.items():
            if self._last.get(name) != verdict or (name in close_only) != (
                    name in self._close_only):
                self._log_change(name, verdict, name in close_only,
                                 runtime.adapters[name].aborts)
        results = {name: OK if name in close_only else verdict.hint
                   for name, verdict in checked.items()}
        if self._metrics is not None:
            for name, verdict in checked.items():
                self._metrics.engine_ready.labels(engine=name).set(
                    1 if results[name] == OK else 0)
                self._metrics.engine_abort_unavailable.labels(engine=name).set(
                    1 if verdict.abort_only else 0)
            for gone in self._last.keys() - checked.keys():  # removed by a reload
                self._metrics.engine_ready.remove(gone)
                self._metrics.engine_abort_unavailable.remove(gone)
        self._last, self._close_only = checked, close_only
        return results

    @property
    def close_only(self) -> dict[str, str]:
        """Engines served close-only at the last check (``"ok"`` in its results), and why their
        abort endpoint cannot be used: the hint that says what to fix."""
        return {name: self._last[name].hint for name in sorted(self._close_only)}

    @staticmethod
    def _log_change(name: str, verdict: Verdict, close_only: bool, aborts: bool) -> None:
        if verdict.hint == OK:
            log.info("engine %s ready (%s)", name, "health ok, abort endpoint ok" if aborts
                     else "health ok; its kind has no abort endpoint")
        elif close_only:
            log.warning("engine %s serving close-only: its abort endpoint is unusable (%s); "
                        "engines.%s.abort.when_unavailable is close_only, so /readyz says ready "
                        "and a disconnect only closes the upstream connection (the engine may "
                        "generate on for nobody); cancel_sidecar_engine_abort_unavailable is 1",
                        name, verdict.hint, name)
        elif verdict.abort_only:
            log.warning("engine %s not ready: %s (or, to serve without aborts meanwhile, set "
                        "engines.%s.abort.when_unavailable: close_only)", name, verdict.hint,
                        name)
        else:
            log.warning("engine %s not ready: %s", name, verdict.hint)

    async def watch(self) -> None:
        """The startup check: :meth:`check` now, then again after ``RECHECK_FIRST_S`` seconds,
        doubling up to ``RECHECK_MAX_S``, until every engine is ready and none serves
        close-only. Cancel it to stop."""
        delay = RECHECK_FIRST_S
        while not all(v == OK for v in (await self.check()).values()) or self._close_only:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECHECK_MAX_S)


# Engine readiness with the last verdict per engine, on the admin app: /readyz and the startup
# check share it, so their verdicts and log lines agree.
READINESS = web.AppKey("readiness", Readiness)


async def startup_check(admin: web.AppRunner | None, runtimes: Runtimes) -> None:
    """:meth:`Readiness.watch` with the admin listener's :class:`Readiness` (shared with
    ``/readyz``), or a new one when there is no admin listener. Started by the CLI once the
    listeners are up; never fails the start (the engine often starts after the sidecar)."""
    readiness = admin.app[READINESS] if admin is not None else Readiness(runtimes)
    await readiness.watch()
