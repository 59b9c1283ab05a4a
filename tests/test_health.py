"""Admin health endpoints: /healthz (alive) and /readyz (engines reachable, abort usable), and
what /readyz says of an engine that is up but cannot abort (``abort.when_unavailable``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.kinds import VLLMEngine
from tests.fakes.upstreams import refused_port
from tests.harness.support import GUARD_S, WAIT_S, metrics, ms

SCALE_OUT = ("start vLLM with --enable-scale-out (its abort endpoint "
             "/inference/v1/abort_requests is disabled)")
READY = "cancel_sidecar_engine_ready"
UNAVAILABLE = "cancel_sidecar_engine_abort_unavailable"


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


# --- an engine that is up but cannot abort: abort.when_unavailable ---------------------------

@pytest_asyncio.fixture
async def no_scale_out() -> AsyncIterator[VLLMEngine]:
    """vLLM started without --enable-scale-out: its abort route answers 403."""
    fake = VLLMEngine(scale_out=False)
    await fake.start()
    yield fake
    await fake.stop()


def _settings(url: str, **abort: Any) -> Any:
    return sidecar_settings(url, engines={"local": {
        "kind": "vllm", "url": url, "abort": {"resend_window_s": 0, **abort}}})


async def _gauges(port: int | None) -> dict[str, float | None]:
    """The two readiness gauges of engine ``local`` (None: not exported)."""
    assert port is not None
    values = await metrics(port)
    return {name: values.get((name, frozenset({("engine", "local")}))) for name in
            (READY, UNAVAILABLE)}


async def test_an_engine_that_cannot_abort_is_not_ready_by_default(
        no_scale_out: VLLMEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """The default keeps today's safe rollout: the pod gets no traffic until vLLM can abort;
    the warning names both fixes."""
    caplog.set_level(logging.WARNING, logger="sidecar.readiness")
    servers: Servers = await start_sidecar(_settings(no_scale_out.url))
    status, body = await _get(servers.admin_port, "/readyz")
    assert (status, body) == (503, {"ready": False, "engines": {"local": SCALE_OUT}}), (
        f"expected 503 with the scale-out hint by default, got {status} {body}")
    assert await _gauges(servers.admin_port) == {READY: 0.0, UNAVAILABLE: 1.0}, (
        await _gauges(servers.admin_port))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"engine local not ready: {SCALE_OUT} (or, to serve without aborts "
                        "meanwhile, set engines.local.abort.when_unavailable: close_only)"], (
        warnings)


async def test_close_only_serves_an_engine_that_cannot_abort_and_says_so(
        no_scale_out: VLLMEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """``when_unavailable: close_only``: /readyz 200, the gauge 1 and one WARNING; a client
    that leaves gets its abort call sent (403) and its upstream connection closed at once, not
    held for the confirmation (``confirm_timeout_s`` 2 s); once vLLM can abort, the gauge is 0
    and the engine is logged ready."""
    caplog.set_level(logging.INFO, logger="sidecar.readiness")
    servers: Servers = await start_sidecar(_settings(no_scale_out.url,
                                                     when_unavailable="close_only"))
    for _ in range(2):  # a second probe changes nothing and logs nothing
        status, body = await _get(servers.admin_port, "/readyz")
        assert (status, body["ready"], body["engines"]) == (200, True, {"local": "ok"}), (
            f"expected 200 under close_only, got {status} {body}")
        assert set(body["close_only"]) == {"local"} and "--enable-scale-out" in body[
            "close_only"]["local"], f"expected what to fix under close_only, got {body}"
    assert await _gauges(servers.admin_port) == {READY: 1.0, UNAVAILABLE: 1.0}, (
        await _gauges(servers.admin_port))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"engine local serving close-only: its abort endpoint is unusable ({SCALE_OUT}); "
        "engines.local.abort.when_unavailable is close_only"), warnings

    url = f"http://127.0.0.1:{servers.proxy_port}/v1/chat/completions?tokens=3000&interval=0.01"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json={"messages": [], "stream": True})
        first = await asyncio.wait_for(resp.content.readline(), WAIT_S)
        assert resp.status == 200 and first.startswith(b"data: "), (resp.status, first)
        left = time.monotonic()
        resp.close()  # the client leaves
        closed = await no_scale_out.watch.until(
            lambda: bool(no_scale_out.works) and no_scale_out.works[0].closed_at is not None,
            WAIT_S)
    assert closed, "expected the upstream connection closed after the client left"
    work = no_scale_out.works[0]
    assert work.closed_at is not None and work.closed_at - left < GUARD_S, (
        f"expected the upstream closed within {ms(GUARD_S)} of the disconnect (a refused abort "
        f"closes it at once), it took {ms((work.closed_at or 0) - left)}")
    calls = no_scale_out.calls
    assert [(c.ids, c.status) for c in calls] == [(list(work.engine_ids), 403)], (
        f"expected one abort call naming the request's ids, answered 403, got {calls}")

    no_scale_out.scale_out = True  # vLLM restarted with --enable-scale-out
    status, body = await _get(servers.admin_port, "/readyz")
    assert (status, body) == (200, {"ready": True, "engines": {"local": "ok"}}), (status, body)
    assert await _gauges(servers.admin_port) == {READY: 1.0, UNAVAILABLE: 0.0}, (
        await _gauges(servers.admin_port))
    assert "engine local ready (health ok, abort endpoint ok)" in caplog.messages[-1], (
        caplog.messages)


async def test_close_only_never_makes_a_down_engine_ready(start_sidecar: Callable[..., Any]
                                                          ) -> None:
    """Only the abort endpoint may fail under close_only: an engine whose health check fails
    is not ready, and its abort endpoint is not called unavailable (it was never reached)."""
    servers: Servers = await start_sidecar(_settings(f"http://127.0.0.1:{refused_port()}",
                                                     when_unavailable="close_only"))
    status, body = await _get(servers.admin_port, "/readyz")
    assert status == 503 and body["engines"]["local"].startswith("nothing listens at"), (
        status, body)
    assert await _gauges(servers.admin_port) == {READY: 0.0, UNAVAILABLE: 0.0}, (
        await _gauges(servers.admin_port))
