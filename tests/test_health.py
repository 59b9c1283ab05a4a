"""Admin health endpoints: /healthz (alive) and /readyz (engines reachable, abort usable)."""

from __future__ import annotations

from typing import Any

import aiohttp

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fake_engine import FakeEngine
from tests.upstreams import refused_port


async def _get(port: int | None, path: str) -> tuple[int, Any]:
    assert port is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status, await resp.json()


async def test_ready_when_engine_healthy_and_abort_usable(engine: FakeEngine,
                                                         sidecar: Servers) -> None:
    assert await _get(sidecar.admin_port, "/healthz") == (200, {"status": "ok"})
    status, body = await _get(sidecar.admin_port, "/readyz")
    assert (status, body) == (200, {"ready": True, "engines": {"local": "ok"}}), (status, body)
    probes = engine.record.probes
    assert len(probes) == 1 and len(probes[0].ids) == 1, (
        f"expected one abort call naming exactly one probe id, got {probes}")
    assert probes[0].ids[0].startswith("cancel-sidecar-readiness-probe-"), probes[0].ids
    assert probes[0].authorization == "Bearer sekret-key", probes[0].authorization
    assert engine.record.aborts == [], "a readiness probe is no abort"


async def test_not_ready_when_abort_endpoint_is_disabled(engine: FakeEngine,
                                                        sidecar: Servers) -> None:
    engine.record.abort_status = 403  # what vLLM answers without --enable-scale-out
    status, body = await _get(sidecar.admin_port, "/readyz")
    assert status == 503, f"expected 503 while aborts cannot work, got {status} {body}"
    assert "--enable-scale-out" in body["engines"]["local"], body


async def test_not_ready_when_engine_unreachable(start_sidecar: Any) -> None:
    servers: Servers = await start_sidecar(
        sidecar_settings(f"http://127.0.0.1:{refused_port()}"))
    status, body = await _get(servers.admin_port, "/readyz")
    assert status == 503 and body["engines"]["local"].startswith("nothing listens at"), (
        status, body)
    assert await _get(servers.admin_port, "/healthz") == (200, {"status": "ok"})
