"""The two aiohttp applications: the proxy (every path) and the admin listener.

State lives on the application under typed keys (:mod:`sidecar.keys`; ``proxy.EXCHANGES`` and
``readiness.READINESS`` beside their classes), created and torn down in one ``cleanup_ctx``
generator: the config generation (:class:`~sidecar.runtime.Runtimes`: engine adapters, router,
upstream sessions; swapped whole by :func:`reload`), the abort machinery.
Teardown order: stop taking requests and drain them (``server.Servers.stop``), let abort calls
finish (bounded), close sessions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import aiohttp
from aiohttp import hdrs, web
from aiohttp.web_request import BaseRequest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine import EngineAdapter
from sidecar import inflight
from sidecar.abort import Aborter
from sidecar.cancel import Canceller, add_cancel_route, local_canceller
from sidecar.config import Settings
from sidecar.door import handle, refuse
from sidecar.inflight import InflightRecord
from sidecar.keys import (
    ABORTER,
    METRICS,
    RECORD,
    RECOVERS,
    REGISTRY,
    RUNTIME,
    SETTINGS,
    TASKS,
)
from sidecar.metrics import Metrics, ReadinessMetrics
from sidecar.proxy import EXCHANGES, Exchange
from sidecar.readiness import OK, READINESS, Readiness
from sidecar.replies import error_response
from sidecar.runtime import Runtime, Runtimes, describe_changes
from sidecar.tasks import TaskSet
from sidecar.upstream import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

ABORT_DRAIN_S = 5.0


async def _engines_ctx(app: web.Application) -> AsyncIterator[None]:
    app[TASKS] = tasks = TaskSet()
    app[RUNTIME] = runtimes = Runtimes(Runtime.open(app[SETTINGS]), tasks)
    # Abort calls go over warm connections of their own (sidecar.abort_wire), opened now.
    app[ABORTER] = aborter = Aborter(tasks, app[METRICS])
    aborter.warm(list(runtimes.current.adapters.values()))
    app[RECORD] = record = open_record(app[SETTINGS].lifecycle.record_dir,
                                       runtimes.current.adapters, aborter, app[METRICS],
                                       recover=app[RECOVERS])
    try:
        yield
    finally:
        await tasks.drain(ABORT_DRAIN_S)
        await asyncio.gather(runtimes.close(), aborter.close())
        if record is not None:
            record.close()


def proxy_handler(app: web.Application) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """What serves every request on the proxy listener
    (:class:`sidecar.downstream.DownstreamRunner`'s ``handler``): :func:`sidecar.door.handle`
    on the config generation the request starts on, counted on it until it ends.

    The proxy has one route (every method, every path), so aiohttp's router, middleware chain
    and ``on_response_prepare`` signal are not run (``Application._handle``: ~36 us of a
    request's time to first byte on the bench machine, docs/semantics.md section 6a); what of
    them applies is done here: ``Expect`` is answered first (:func:`_expect`, with aiohttp's
    drain after it) and an aiohttp ``HTTPException`` of status >= 400 gets the proxy's
    OpenAI-style JSON body. ``request.app`` is not set on such requests: the proxy's state is
    read from ``app``.
    """
    async def serve(base: BaseRequest) -> web.StreamResponse:
        request = cast(web.Request, base)  # made by app's request factory
        try:
            if request.headers.get(hdrs.EXPECT):
                refusal = await _expect(request, app)
                await request.writer.drain()
                if refusal is not None:
                    return refusal
            runtimes = app[RUNTIME]
            runtime = runtimes.enter()
            try:
                return await handle(request, runtime, app)
            finally:
                runtimes.leave(runtime)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason, "invalid_request")
    return serve


def reload(app: web.Application, settings: Settings) -> tuple[list[str], list[str]]:
    """Apply ``settings`` (already validated) to new requests on the proxy ``app``; requests
    in flight finish on the config they started with.

    Returns (changes applied, changes ignored until a restart), as from
    :func:`sidecar.runtime.describe_changes`; nothing is swapped when nothing applies.
    """
    runtimes = app[RUNTIME]
    applied, ignored = describe_changes(runtimes.current.settings, settings)
    if applied:
        app[ABORTER].warm(list(runtimes.swap(settings).adapters.values()))
    return applied, ignored


def open_record(directory: Path | None, adapters: dict[str, EngineAdapter], aborter: Aborter,
                metrics: Metrics, *, recover: bool) -> InflightRecord | None:
    """This process's record of in-flight engine work in ``directory`` (``None``: none kept),
    after aborting what dead processes left there (``recover``: not in a ``--workers`` worker,
    whose supervisor does it). A directory that cannot be made or written is logged (ERROR)
    and no record is kept: the sidecar serves on."""
    if directory is None:
        return None
    try:
        if recover:
            for name, engine in adapters.items():  # exported from 0
                if engine.aborts:
                    metrics.recovered.labels(name, "found_at_start")
            for name, count in inflight.recover(directory, adapters, aborter,
                                                "found at start").aborted.items():
                metrics.recovered.labels(name, "found_at_start").inc(count)
        return InflightRecord.open(directory)
    except OSError as exc:
        log.error("lifecycle.record_dir %s cannot be used (%s): no record of in-flight requests "
                  "is kept, so if this sidecar is killed its requests run on at the engine; "
                  "make the directory writable for this user (or set lifecycle.record_dir)",
                  directory, exc)
        return None


def make_app(settings: Settings, registry: CollectorRegistry, *,
             recover: bool = True) -> web.Application:
    """The proxy application: its state, its startup and cleanup, and aiohttp's request
    settings; it has no routes: every method and path is served by :func:`proxy_handler`.

    ``client_max_size`` only limits ``request.read()``, which the proxy never calls: bodies
    stream through, bounded by ``downstream.max_body_bytes`` (:mod:`sidecar.upstream`).
    ``auto_decompress=False``: aiohttp's server would otherwise inflate a request body sent with
    ``Content-Encoding: gzip``/``deflate``/``br`` and the engine would get the inflated bytes
    still labelled compressed.
    """
    app = web.Application(handler_args={"max_field_size": MAX_HEADER_BYTES,
                                        "max_line_size": MAX_HEADER_BYTES,
                                        "auto_decompress": False})
    app[SETTINGS] = settings
    app[RECOVERS] = recover
    app[REGISTRY] = registry
    app[METRICS] = Metrics(registry)
    app[EXCHANGES] = {}
    app.cleanup_ctx.append(_engines_ctx)
    return app


async def _expect(request: web.Request, app: web.Application) -> web.StreamResponse | None:
    """Answer ``Expect`` before the body is read: invite the body only if it will be accepted.

    A ``Content-Length`` over ``downstream.max_body_bytes`` gets no ``100 Continue``: the proxy
    handler then answers 413 at once and the client never sends the body (RFC 9110 section 10.1.1
    lets a server answer with a final status instead). Otherwise as aiohttp's default expect
    handler (``web_urldispatcher._default_expect_handler``): ``100 Continue`` on HTTP/1.1, and a
    JSON 417 for any other expectation.
    """
    limit = app[RUNTIME].current.settings.downstream.max_body_bytes
    length = request.content_length
    if limit and length is not None and length > limit:
        return None
    if request.version != aiohttp.HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return refuse(request, 417, "only 'Expect: 100-continue' is supported",
                      "expectation_failed")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the response body
    return None


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready (200) when every engine is healthy and its abort endpoint (if any) usable, checked
    concurrently within ``readiness.READY_TIMEOUT_S`` each; else 503 with what to fix per engine
    (:mod:`sidecar.readiness`, the same check and hints as the startup check). An engine served
    close-only is ready, and named under ``close_only`` with what to fix."""
    readiness = request.app[READINESS]
    results = await readiness.check()
    ready = all(v == OK for v in results.values())
    body: dict[str, object] = {"ready": ready, "engines": results}
    if readiness.close_only:  # ready, but these cannot abort: what to fix
        body["close_only"] = readiness.close_only
    return web.json_response(body, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_admin_app(runtimes: Runtimes, registry: CollectorRegistry,
                   canceller: Canceller) -> web.Application:
    """The admin application: ``/healthz``, ``/readyz`` (the engines of ``runtimes.current``;
    its :class:`~sidecar.readiness.Readiness` under ``readiness.READINESS``, for the startup check),
    ``/metrics`` (Prometheus text of ``registry``, where the readiness verdicts are registered
    too), and the cancel API (:mod:`sidecar.cancel`)
    looking ids up with ``canceller`` (this process's requests, or the workers')."""
    app = web.Application()
    app[RUNTIME] = runtimes
    app[READINESS] = Readiness(runtimes, ReadinessMetrics(registry))
    app[REGISTRY] = registry
    admin = runtimes.current.settings.admin
    add_cancel_route(app, admin.cancel_token if admin is not None else None, canceller)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


def make_control_app(exchanges: dict[str, Exchange]) -> web.Application:
    """A ``--workers`` worker's control application: only the cancel API, for this worker's
    ``exchanges``, without a token (the supervisor checks it; the listener is a Unix socket in
    a directory only this user can enter, :mod:`sidecar.workers`)."""
    app = web.Application()
    add_cancel_route(app, None, local_canceller(exchanges))
    return app
