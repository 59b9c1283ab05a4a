"""The two aiohttp applications: the proxy (every path) and the admin listener.

State lives on the application under typed keys (:mod:`sidecar.keys`), created and torn down in
one ``cleanup_ctx`` generator: upstream sessions, engine adapters, the abort machinery. Teardown
order: stop taking requests (the runner), let abort calls finish (bounded), close sessions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine import build_adapters
from sidecar.abort import MAX_CONCURRENT_CALLS, Aborter
from sidecar.config import Settings
from sidecar.keys import ABORTER, ADAPTERS, METRICS, REGISTRY, ROUTER, SESSIONS, SETTINGS, TASKS
from sidecar.metrics import Metrics
from sidecar.proxy import handle
from sidecar.route import Router
from sidecar.tasks import TaskSet
from sidecar.upstream import make_session

log = logging.getLogger(__name__)

ABORT_DRAIN_S = 5.0


async def _engines_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    adapters = build_adapters(settings.engines)
    app[ADAPTERS] = adapters
    app[ROUTER] = Router(settings, adapters)
    app[TASKS] = tasks = TaskSet()
    pooled = make_session(settings.upstream)
    fresh = make_session(settings.upstream, fresh=True)
    app[SESSIONS] = (pooled, fresh)
    abort_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=MAX_CONCURRENT_CALLS),
        cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)
    app[ABORTER] = Aborter(abort_session, tasks, app[METRICS])
    try:
        yield
    finally:
        await tasks.drain(ABORT_DRAIN_S)
        await asyncio.gather(pooled.close(), fresh.close(), abort_session.close())


def make_app(settings: Settings, registry: CollectorRegistry) -> web.Application:
    """The proxy application: every method and path goes through :func:`sidecar.proxy.handle`.

    ``client_max_size`` only limits ``request.read()``, which the proxy never calls: bodies
    stream through uncapped.
    """
    app = web.Application(handler_args={"max_field_size": 65536})
    app[SETTINGS] = settings
    app[REGISTRY] = registry
    app[METRICS] = Metrics(registry)
    app.cleanup_ctx.append(_engines_ctx)
    app.router.add_route("*", "/{path:.*}", handle)
    return app


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready when every engine answers its health path (``GET /health``) with 2xx within 2 s."""
    proxy_app = request.app[PROXY_APP]
    session = proxy_app[SESSIONS][0]
    results: dict[str, str] = {}
    for name, adapter in proxy_app[ADAPTERS].items():
        try:
            async with asyncio.timeout(2.0):
                async with session.get(adapter.base_url + "/health") as resp:
                    await resp.read()
                    results[name] = "ok" if resp.status < 300 else f"HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            results[name] = f"unreachable: {type(exc).__name__}"
    ready = all(v == "ok" for v in results.values())
    return web.json_response({"ready": ready, "engines": results}, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


PROXY_APP = web.AppKey("proxy_app", web.Application)


def make_admin_app(proxy_app: web.Application) -> web.Application:
    """The admin application: ``/healthz``, ``/readyz``, ``/metrics`` (Prometheus text)."""
    app = web.Application()
    app[PROXY_APP] = proxy_app
    app[REGISTRY] = proxy_app[REGISTRY]
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app
