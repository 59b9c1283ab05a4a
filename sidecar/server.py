"""Production wiring: the runners, sites and settings the CLI uses, importable by tests.

The one setting that matters most: ``handler_cancellation=True``. aiohttp's production default
is ``False`` (its test server turns it on), and without it a lost client connection never
reaches the handler, so the sidecar would never notice a disconnect.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app import make_admin_app, make_app
from sidecar.config import Settings

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class Servers:
    """The running proxy and admin listeners; ``ports`` are the bound ports (config port 0 -> a
    free one)."""

    proxy: web.AppRunner
    admin: web.AppRunner | None
    proxy_port: int
    admin_port: int | None

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish (bounded), then clean up."""
        if self.admin is not None:
            await self.admin.cleanup()
        await self.proxy.cleanup()


def _bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])


async def start(settings: Settings, registry: CollectorRegistry | None = None) -> Servers:
    """Start the proxy and admin listeners exactly as production runs them."""
    registry = registry or CollectorRegistry()
    app = make_app(settings, registry)
    proxy = web.AppRunner(app, handler_cancellation=True, access_log=None,
                          shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await proxy.setup()
    await web.TCPSite(proxy, settings.listen.host, settings.listen.port, backlog=4096).start()
    proxy_port = _bound_port(proxy)
    admin = None
    admin_port = None
    if settings.admin is not None:
        admin = web.AppRunner(make_admin_app(app), access_log=None, shutdown_timeout=1.0)
        await admin.setup()
        await web.TCPSite(admin, settings.admin.host, settings.admin.port).start()
        admin_port = _bound_port(admin)
    log.info("proxy listening on %s:%d, admin on %s", settings.listen.host, proxy_port,
             f"{settings.admin.host}:{admin_port}" if settings.admin else "(disabled)")
    return Servers(proxy, admin, proxy_port, admin_port)
