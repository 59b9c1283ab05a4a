"""What the front door (:mod:`sidecar.door`) gives every request it admits: a :class:`Ticket`,
the bookkeeping the proxy and the tunnel share.

A ticket holds the request's sidecar request id (:func:`new_request_id`: 32 hex characters), its
access line (:class:`~sidecar.logs.RequestLog`) and its count in
``cancel_sidecar_in_flight_requests`` from its making to :meth:`Ticket.done`, which counts it in
``cancel_sidecar_requests_total`` and ends its access line. :meth:`Ticket.tag` puts the id on
the upstream request's head (``X-Request-Id``, the client's own kept as
``X-Client-Request-Id``). :class:`sidecar.proxy.Exchange` and :class:`sidecar.tunnel.Tunnel`
extend it (a subclass, not a member: no second object per request).
"""

from __future__ import annotations

import secrets

from aiohttp import web
from multidict import CIMultiDict

from sidecar.headers import CLIENT_REQUEST_ID, DEADLINE_HEADER, REQUEST_ID
from sidecar.logs import RequestLog
from sidecar.metrics import Metrics
from sidecar.route import RouteTarget
from sidecar.runtime import Runtime


def new_request_id() -> str:
    """A fresh sidecar request id: 32 lowercase hex characters, 128 random bits
    (``secrets.token_hex``; ``uuid4().hex`` has the same shape with 122, and took ~3.8 us here
    against ~1.0).

    Its uniqueness is what keeps one request's abort off every other's: docs/semantics.md
    section 1."""
    return secrets.token_hex(16)


class Ticket:
    """One admitted request: ``request`` routed to ``target`` (``target_path``: the origin-form
    target for the engine) on the config generation ``runtime``, counted in ``metrics``."""

    # Slots, here and in the subclasses: an instance dict past 30 keys leaves CPython's
    # shared-key table (1.6 KiB per request instead of 0.3; each idle stream holds one).
    __slots__ = ("_in_flight", "access", "id", "metrics", "request", "runtime", "target",
                 "target_path")

    def __init__(self, request: web.Request, runtime: Runtime, target: RouteTarget,
                 target_path: str, metrics: Metrics) -> None:
        self.request = request
        self.runtime = runtime
        self.target = target
        self.target_path = target_path  # origin-form path and query for the upstream
        self.metrics = metrics
        self.id = new_request_id()
        self.access = RequestLog(self.id, request.method, request.path, target.prefix,
                                 target.engine.name, request.headers.get(REQUEST_ID))
        self._in_flight = metrics.child(metrics.in_flight, target.prefix)
        self._in_flight.inc()

    def tag(self, headers: CIMultiDict[str]) -> str | None:
        """Tag the upstream request's ``headers`` with this request's id (every engine
        involved: :meth:`RouteTarget.tag`) after moving the client's ``X-Request-Id`` (its first
        value) to ``X-Client-Request-Id`` and dropping ``X-Sidecar-Deadline-S``. Returns the
        client's id (``None``: it sent none)."""
        client_id = headers.popall(REQUEST_ID, None)
        headers.popall(DEADLINE_HEADER, None)
        if client_id:
            headers[CLIENT_REQUEST_ID] = client_id[0]
        self.target.tag(self.request.path, self.id, headers)
        return client_id[0] if client_id else None

    def done(self, status_class: str, status: int | None, bytes_sent: int,
             client_disconnected: bool, phase: str | None) -> None:
        """The handler ended: counted under ``status_class`` (``2xx``.., ``disconnected``,
        ``cancelled``), no longer in flight, and the access line told (``status`` sent, or
        ``None``; ``bytes_sent`` body bytes; where it stopped)."""
        metrics = self.metrics
        self._in_flight.dec()
        metrics.child(metrics.requests, self.target.prefix, status_class).inc()
        self.access.handler_done(status, bytes_sent, client_disconnected, phase)
