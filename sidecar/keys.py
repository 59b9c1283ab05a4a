"""Typed keys for the state kept on the aiohttp application objects (``web.AppKey``)."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from engine import EngineAdapter
from sidecar.abort import Aborter
from sidecar.config import Settings
from sidecar.metrics import Metrics
from sidecar.route import Router
from sidecar.tasks import TaskSet

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", Metrics)
TASKS = web.AppKey("tasks", TaskSet)
ADAPTERS = web.AppKey("adapters", dict[str, EngineAdapter])
ROUTER = web.AppKey("router", Router)
# (pooled, fresh): see sidecar.upstream.make_session.
SESSIONS = web.AppKey("sessions", tuple[aiohttp.ClientSession, aiohttp.ClientSession])
ABORTER = web.AppKey("aborter", Aborter)
