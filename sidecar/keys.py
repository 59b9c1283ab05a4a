"""Typed keys for the state kept on the aiohttp application objects (``web.AppKey``) whose types
come from below the request path: the settings, the metrics, the task set, the abort machinery,
the in-flight record and the config generation. A key typed by a class of the request path lives
beside that class: ``proxy.EXCHANGES``, ``readiness.READINESS``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.abort import Aborter
from sidecar.config import Settings
from sidecar.inflight import InflightRecord
from sidecar.metrics import Metrics
from sidecar.runtime import Runtimes
from sidecar.tasks import TaskSet

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
# in-flight count: sidecar.runtime. Each request reads it once, in app.proxy_handler.
RUNTIME = web.AppKey("runtime", Runtimes)
