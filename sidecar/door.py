"""The front door: every request on the proxy listener is admitted here or refused, then handed
to the proxy or the tunnel::

    request ──► admit: origin-form target (400) -> route (404) -> not an abort endpoint (403)
                -> a transfer coding the proxy relays (501) -> a valid deadline header (400)
            ──► an upgrade (tunnel.wants_tunnel) ──► tunnel.relay (spliced, never aborted)
                anything else                    ──► proxy.serve  (aborted if it ends early)

A refusal is answered here with an OpenAI-style JSON error and its own access line
(:func:`refuse`); it carries no ``X-Request-Id``. What an admitted request is given, the same on
both paths (its sidecar id, access line and counts), is :class:`sidecar.ticket.Ticket`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from sidecar import proxy, tunnel
from sidecar.headers import REQUEST_ID, unsupported_transfer_coding
from sidecar.keys import METRICS
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.replies import error_response
from sidecar.route import RouteTarget
from sidecar.runtime import Runtime
from sidecar.ticket import new_request_id
from sidecar.upstream import origin_form


class Refused(Exception):
    """An admission check failed: ``response`` is the refusal to send (:func:`refuse`)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def refuse(request: web.Request, status: int, message: str, error_type: str,
           target: RouteTarget | None = None, metrics: Metrics | None = None) -> web.Response:
    """A request the proxy answers itself with an OpenAI-style JSON error, with its own access
    line; once routed (``target``), the line names the route and engine, and
    ``cancel_sidecar_requests_total`` counts it (``metrics``): an unrouted request has no route
    label to count under."""
    request_id, client_id = new_request_id(), request.headers.get(REQUEST_ID)
    response = error_response(status, message, error_type, request_id, client_id)
    route, engine = (None, None) if target is None else (target.prefix, target.engine.name)
    RequestLog(request_id, request.method, request.path, route, engine, client_id
               ).handler_done(status, response.content_length or 0, False, None)
    if target is not None and metrics is not None:
        metrics.child(metrics.requests, target.prefix, f"{status // 100}xx").inc()
    return response


def admit(request: web.Request, runtime: Runtime,
          metrics: Metrics) -> tuple[RouteTarget, str, float | None]:
    """Every admission check of ``request`` on the config generation ``runtime``, in order (the
    module docstring). Returns its route, its origin-form target for the engine and its
    deadline in seconds (``None``: none); raises :class:`Refused` with the refusal, counted in
    ``metrics`` once routed."""
    target_path = origin_form(request.raw_path, request.rel_url.raw_path_qs)
    if target_path is None:  # before routing: "*" matches only a catch-all route
        raise Refused(refuse(request, 400, "the request target must be a path",
                             "invalid_request"))
    target = runtime.router.match(request.path)
    if target is None:
        raise Refused(refuse(request, 404, f"no route for path {json.dumps(request.path)}",
                             "route_not_found"))
    if request.path.rstrip("/") in target.forbidden_paths:
        # Only the sidecar aborts: a client must not abort other clients' requests.
        raise Refused(refuse(request, 403, "the engine's abort endpoint is not exposed to "
                             "clients", "forbidden", target, metrics))
    if unsupported_transfer_coding(request.headers):
        refusal = refuse(request, 501, "only the chunked transfer coding is supported",
                         "not_implemented", target, metrics)
        refusal.force_close()  # the body is left unread
        raise Refused(refusal)
    try:
        return target, target_path, target.deadline_s(request.headers)
    except ValueError as exc:
        raise Refused(refuse(request, 400, str(exc), "invalid_request", target,
                             metrics)) from exc


Serving = Coroutine[Any, Any, web.StreamResponse]


def handle(request: web.Request, runtime: Runtime, app: web.Application) -> Serving:
    """Serve one request on the proxy listener with the config generation ``runtime`` it
    started on: admitted (:func:`admit`) or refused, then relayed by the tunnel (an upgrade:
    :func:`sidecar.tunnel.relay`) or the proxy (:func:`sidecar.proxy.serve`). The proxy's state
    (metrics, aborter, requests in flight) is read from ``app``
    (:func:`sidecar.app.proxy_handler`, which awaits what this returns: the dispatch is not a
    coroutine of its own, one frame less on every request's start)."""
    received = asyncio.get_running_loop().time()  # the head was just parsed: the deadline
    # counts from here
    metrics = app[METRICS]
    try:
        target, target_path, deadline_s = admit(request, runtime, metrics)
    except Refused as refused:
        return _answer(refused.response)
    if tunnel.wants_tunnel(request):  # Connection: Upgrade (a WebSocket): relayed, never aborted
        return tunnel.relay(request, runtime, target, target_path, received, deadline_s,
                            metrics)
    return proxy.serve(request, runtime, target, target_path, received, deadline_s, metrics,
                       app)


async def _answer(refusal: web.Response) -> web.StreamResponse:
    return refusal
