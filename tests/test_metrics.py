"""Metrics: scripted traffic through the production wiring, then the admin ``/metrics`` read
with prometheus_client's own parser, every count checked against what the script did.

One sidecar, four engine configs on the one fake engine, so each abort outcome has its engine:
``local`` (abort answers 200: ``ok``), ``forbidden`` (abort path ``/status/403``: ``http_403``),
``slow`` (abort path never answers, ``timeout_s`` 0.5: ``timeout``) and ``down`` (nothing
listens: ``502``). Each disconnect waits for its abort outcome before the next one starts, so
the script is sequential and every count is exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import HANG_ABORT_PATH, FakeEngine
from tests.fakes.upstreams import refused_port
from tests.harness.support import (
    FOREVER,
    WAIT_S,
    Stalls,
    metrics,
    raw_client,
    request_body,
    samples,
    wait_metric,
)

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
SLOW_ABORT_S = 0.5

Values = dict[tuple[str, frozenset[tuple[str, str]]], float]




def by(values: Values, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """Non-zero samples of ``name`` keyed by the values of ``labels``, in that order."""
    return {tuple(dict(k)[label] for label in labels): v
            for k, v in samples(values, name).items()}


async def until_metrics(stalls: Stalls, admin: int, what: str,
                        predicate: Callable[[Values], bool], within_s: float = WAIT_S) -> Values:
    """Poll ``/metrics`` until ``predicate`` holds (no event exists for it); fails saying
    ``what`` was expected and what the metrics were."""
    start = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while True:
            values = await metrics(admin, s)
            if predicate(values):
                return values
            now = time.monotonic()
            if now - start - stalls.within(start, now) > within_s:
                raise AssertionError(f"expected {what} within {within_s}s; metrics: {values}")
            await asyncio.sleep(0.02)


def sidecar_config(engine: FakeEngine) -> dict[str, Any]:
    def vllm(url: str, path: str | None = None, timeout_s: float = 2.0) -> dict[str, Any]:
        abort: dict[str, Any] = {"timeout_s": timeout_s, "resend_window_s": 0}
        if path is not None:
            abort["path"] = path
        return {"kind": "vllm", "url": url, "abort": abort}

    return {
        "engines": {
            "local": vllm(engine.url),
            "forbidden": vllm(engine.url, "/status/403"),
            "slow": vllm(engine.url, HANG_ABORT_PATH, SLOW_ABORT_S),
            "down": vllm(f"http://127.0.0.1:{refused_port()}"),
        },
        "routes": [
            {"prefix": "/v1/chat", "engine": "forbidden"},
            {"prefix": "/v1/completions", "engine": "slow"},
            {"prefix": "/down", "engine": "down"},
            {"prefix": "/", "engine": "local"},
        ],
    }


async def disconnect(engine: FakeEngine, stalls: Stalls, port: int, path: str, body: bytes,
                     streamed: bool) -> None:
    """Send ``body`` to ``path``; leave (RST) once the engine works on it (``streamed``: after
    the first SSE event), then wait for the engine to stop it (aborted: it ends the response,
    the sidecar's confirmation; or its connection closed)."""
    engine.record.started_event.clear()
    engine.record.stopped_event.clear()
    async with raw_client(port, stalls) as c:
        c.send("POST", path, body)
        if streamed:
            status, _ = await c.head()
            assert status == 200, f"expected a 200 stream from {path}, got {status}"
            await c.read_until(b"data:")
        else:
            await stalls.wait(engine.record.started_event.wait(),
                              f"the engine to start {path}")
        c.disconnect("rst")
        await stalls.wait(engine.record.stopped_event.wait(),
                          f"the engine to stop {path} (aborted, or its connection closed)")


async def test_metrics_count_scripted_traffic(engine: FakeEngine,
                                              start_sidecar: Callable[..., Any],
                                              stalls: Stalls) -> None:
    servers: Servers = await start_sidecar(
        sidecar_settings(engine.url, **sidecar_config(engine)))
    port, admin = servers.proxy_port, servers.admin_port or 0
    base = f"http://127.0.0.1:{port}"

    # Completed: 3 x 2xx and a 404 from the engine on "/", a 502 on "/down" (engine down).
    async with aiohttp.ClientSession() as s:
        for method, path, body, want in [
                ("POST", f"{GENERATE}?tokens=3&interval=0.001", {"stream": True}, 200),
                ("POST", f"{GENERATE}?tokens=3&interval=0.001", {"stream": False}, 200),
                ("GET", "/v1/models", None, 200),
                ("GET", "/no/such/route", None, 404),
                ("GET", "/down/v1/models", None, 502)]:
            async with asyncio.timeout(WAIT_S):
                async with s.request(method, base + path, json=body) as r:
                    await r.read()
            assert r.status == want, f"{method} {path}: expected {want}, got {r.status}"

    # Disconnects, one per phase; each waits for its abort outcome before the next.
    await disconnect(engine, stalls, port, f"{GENERATE}?first_byte_delay=5",
                     request_body({"token_ids": [1]}, True), streamed=False)
    await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1,
                      engine="local", outcome="accepted")
    await disconnect(engine, stalls, port, f"{GENERATE}?tokens=1000",
                     request_body({"token_ids": [1]}, True), streamed=True)
    await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 2,
                      engine="local", outcome="accepted")
    await disconnect(engine, stalls, port, f"{CHAT}?tokens=1000",
                     request_body({"messages": []}, False), streamed=False)
    await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1,
                      engine="forbidden", outcome="http_403")
    await disconnect(engine, stalls, port, f"{COMPLETIONS}?tokens=1000",
                     request_body({"prompt": "a"}, True), streamed=True)
    await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(HANG_ABORT_PATH)),
                                         FOREVER), "an abort call at the hanging endpoint")
    await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1,
                      SLOW_ABORT_S + WAIT_S, engine="slow", outcome="timeout")

    values = await until_metrics(
        stalls, admin, "no request in flight",
        lambda v: sum(samples(v, "cancel_sidecar_requests_total").values()) == 9
        and not samples(v, "cancel_sidecar_in_flight_requests"))

    requests = by(values, "cancel_sidecar_requests_total", "route", "status_class")
    assert requests == {("/", "2xx"): 3, ("/", "4xx"): 1, ("/down", "5xx"): 1,
                        ("/", "disconnected"): 2, ("/v1/chat", "disconnected"): 1,
                        ("/v1/completions", "disconnected"): 1}, (
        f"requests_total: expected 3 2xx, one 4xx, one 5xx, 4 disconnected; got {requests}")
    disconnects = by(values, "cancel_sidecar_client_disconnects_total", "route", "phase")
    assert disconnects == {("/", "before_first_byte"): 1, ("/", "streaming"): 1,
                           ("/v1/chat", "awaiting_response"): 1,
                           ("/v1/completions", "streaming"): 1}, (
        f"client_disconnects_total: expected one per phase; got {disconnects}")
    aborts = by(values, "cancel_sidecar_abort_calls_total", "engine", "outcome")
    assert aborts == {("local", "accepted"): 2, ("forbidden", "http_403"): 1,
                      ("slow", "timeout"): 1}, f"abort_calls_total: got {aborts}"
    latency = by(values, "cancel_sidecar_abort_confirm_seconds_count", "engine")
    assert latency == {("local",): 2}, (
        f"abort_confirm_seconds: expected 2 observations (the confirmed aborts), got {latency}")
    in_flight = {k: v for (n, k), v in values.items() if n == "cancel_sidecar_in_flight_requests"}
    assert in_flight and all(v == 0 for v in in_flight.values()), (
        f"in_flight_requests: expected 0 on every route, got {in_flight}")
    # Response heads received from the engine: 4 completed + 2 streams cut short. Not the 502
    # (no connection), nor the two disconnects before any response head.
    ttfb = by(values, "cancel_sidecar_upstream_time_to_first_byte_seconds_count", "engine")
    assert ttfb == {("local",): 5, ("slow",): 1}, (
        f"upstream_time_to_first_byte_seconds: expected 5 on local and 1 on slow, got {ttfb}")
    errors = by(values, "cancel_sidecar_upstream_errors_total", "engine", "kind")
    assert errors == {("down", "ConnectError"): 1}, f"upstream_errors_total: got {errors}"


async def test_metric_names_follow_prometheus_practice(engine: FakeEngine,
                                                       sidecar: Servers) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{sidecar.proxy_port}/v1/models") as r:
            await r.read()
        async with s.get(f"http://127.0.0.1:{sidecar.admin_port}/metrics") as r:
            text = await r.text()
    families = list(text_string_to_metric_families(text))
    assert families, "expected metric families on /metrics"
    # reason: a fixed set per counter (unabortable, kept, recovered requests)
    allowed_labels = {"route", "status_class", "phase", "engine", "outcome", "kind", "reason",
                      "le"}
    for family in families:
        assert family.name.startswith("cancel_sidecar_"), (
            f"expected the cancel_sidecar_ prefix, got {family.name}")
        names = {sample.name for sample in family.samples}
        if family.type == "counter":
            assert f"{family.name}_total" in names or not family.samples, (
                f"counter {family.name}: expected samples named {family.name}_total, got {names}")
        if family.type == "histogram":  # a count of things is unit-less: calls per request
            assert (family.name.endswith("_seconds")
                    or family.name == "cancel_sidecar_abort_calls_per_request"), (
                f"histogram {family.name}: expected a base unit suffix _seconds")
        labels = {label for sample in family.samples for label in sample.labels}
        assert labels <= allowed_labels, (
            f"{family.name}: expected low-cardinality labels {sorted(allowed_labels)}, got "
            f"{sorted(labels)}")
    types = {family.name: family.type for family in families}
    assert types.get("cancel_sidecar_requests") == "counter", types
    assert types.get("cancel_sidecar_in_flight_requests") == "gauge", types
