"""Typed keys for the state kept on the aiohttp application objects (``web.AppKey``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.abort import Aborter
from sidecar.config import Settings
from sidecar.inflight import InflightRecord
from sidecar.metrics import Metrics
from sidecar.tasks import TaskSet

if TYPE_CHECKING:
    from sidecar.proxy import Exchange
    from sidecar.readiness import Readiness
    from sidecar.runtime import Runtimes

# The settings the proxy app was built with; reloads replace RUNTIME's generation, not this.
SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", Metrics)
TASKS = web.AppKey("tasks", TaskSet)
ABORTER = web.AppKey("aborter", Aborter)
# False in a --workers worker: its supervisor aborts what dead processes left (sidecar.inflight).
RECOVERS = web.AppKey("recovers", bool)
# This process's record of in-flight engine work (sidecar.inflight); None: no record kept
# (lifecycle.record_dir null, or its directory cannot be written).
RECORD: web.AppKey[InflightRecord | None] = web.AppKey("record")
# The current config generation (settings, adapters, router, upstream sessions) and the
# in-flight count: sidecar.runtime. Each request reads it once, in app._proxy.
RUNTIME: web.AppKey[Runtimes] = web.AppKey("runtime")
# Requests in flight by sidecar request id (the X-Request-Id returned to the client), for the
# cancel API (sidecar.cancel): added when proxy.handle creates the Exchange, removed as it ends.
# On the proxy app; the admin listener of the same process (or a --workers worker's control
# listener) reads it through cancel.local_canceller.
EXCHANGES: web.AppKey[dict[str, Exchange]] = web.AppKey("exchanges")
# Engine readiness with the last verdict per engine (sidecar.readiness), on the admin app:
# /readyz and the startup check share it, so their verdicts and log lines agree.
READINESS: web.AppKey[Readiness] = web.AppKey("readiness")
