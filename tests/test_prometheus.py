"""A real Prometheus scrapes the real sidecar, and the counters come back through its query API.

The sidecar runs as its CLI (one process, and ``--workers 2``, whose admin listener sums the
workers' metric files) in front of three fake engines of kind vllm: ``good`` (an abort ends the
request aborted: ``confirmed``) behind ``/v1/chat``, ``flaky`` (abort and its readiness probe
answer 503; no retries) behind ``/v1/completions``, and one whose aborts answer 200 and end
nothing, as ``deaf`` (``unconfirmed`` after ``abort.confirm_timeout_s``) behind ``/inference``
and as ``blind`` (``confirm_timeout_s: 0``: ``accepted``) behind ``/v1/responses``; ``flaky``'s
url again as ``closing``, with no route and ``abort.when_unavailable: close_only`` (ready, its
abort endpoint unavailable: served close-only). A script of
completed streams, disconnects, failed and unconfirmed aborts, an unabortable request (vLLM beam
search), engine resets mid-stream and refused bodies runs in two phases: the
first creates every series and waits for Prometheus to scrape it, so the rates and quantiles of
the second have a baseline. Prometheus (``tests.harness.prometheus_server``, scrape and rule
interval 1 s) also loads ``config/monitoring/alerts.yaml``; every rule must evaluate, and the alerts
the script provokes must be pending or firing. Every panel query of
``config/monitoring/dashboard.json`` must return data.

Abort calls are asserted only as present (a lead change re-sends aborts: their number per early
end is not fixed); the requests-level counters are exact.
"""

from __future__ import annotations

import asyncio
import json
import math
from functools import partial
from operator import le
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.engine import FakeEngine
from tests.harness.cli_process import cli_process
from tests.harness.prometheus_server import PROMETHEUS, Prometheus, prometheus_server

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "config" / "monitoring"
DASHBOARD = MONITORING / "dashboard.json"
ALERTS = MONITORING / "alerts.yaml"
SCRAPED_S = 30.0  # guard: the script's counters visible through Prometheus
MAX_BODY = 1024
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval becomes here

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None,
                       reason="prometheus not installed (Debian: apt-get install prometheus)"),
    pytest.mark.timeout(180),
]


def _tree(good: FakeEngine, flaky: FakeEngine, deaf: FakeEngine) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {
            "good": {"kind": "vllm", "url": good.url, "abort": {"timeout_s": 2.0}},
            "flaky": {"kind": "vllm", "url": flaky.url,
                      "abort": {"timeout_s": 2.0, "retries": 0}},
            "deaf": {"kind": "vllm", "url": deaf.url,
                     "abort": {"timeout_s": 2.0, "confirm_timeout_s": 0.3,
                               "resend_window_s": 0.1}},
            "blind": {"kind": "vllm", "url": deaf.url,
                      "abort": {"timeout_s": 2.0, "confirm_timeout_s": 0}},
            "closing": {"kind": "vllm", "url": flaky.url,
                        "abort": {"retries": 0, "when_unavailable": "close_only"}},
        },
        "routes": [{"prefix": "/v1/chat", "engine": "good"},
                   {"prefix": "/v1/completions", "engine": "flaky"},
                   {"prefix": "/inference", "engine": "deaf"},
                   {"prefix": "/v1/responses", "engine": "blind"}],
        "downstream": {"max_body_bytes": MAX_BODY},
        "log_level": "INFO",
    }


class Script:
    """The client side of the scenario, through the sidecar's proxy port."""

    def __init__(self, session: aiohttp.ClientSession, proxy: str, good: FakeEngine,
                 flaky: FakeEngine, deaf: FakeEngine) -> None:
        self.session = session
        self.proxy = proxy
        self.good = good
        self.flaky = flaky
        self.deaf = deaf

    async def complete(self) -> None:
        async with self.session.post(f"{self.proxy}/v1/chat/completions?tokens=3",
                                     json={"messages": [], "stream": True}) as resp:
            body = await resp.read()
        assert resp.status == 200 and body.endswith(b"data: [DONE]\n\n"), (
            f"expected a whole stream, got {resp.status} ending {body[-80:]!r}")

    async def leave(self, path: str, engine: FakeEngine, **body: Any) -> None:
        """Stream, read the first event, disconnect; wait until the engine stopped the request
        (aborted, or its connection closed: after the verdict at an engine that confirms)."""
        stopped = len([g for g in engine.record.generations if g.stopped_at is not None])
        resp = await self.session.post(f"{self.proxy}{path}?tokens=2000&interval=0.01",
                                       json={"stream": True, **body})
        first = await asyncio.wait_for(resp.content.readline(), 10)
        assert first.startswith(b"data: "), f"expected an SSE event, got {first!r}"
        resp.close()
        ok = await engine.watch.until(
            lambda: len([g for g in engine.record.generations
                         if g.stopped_at is not None]) > stopped, within_s=10)
        assert ok, "expected the engine's request to be stopped after the client left"

    async def leave_before_head(self, path: str, engine: FakeEngine, **body: Any) -> None:
        """A non-streaming request the client leaves while the engine works on it."""
        started = len(engine.record.generations)
        task = asyncio.ensure_future(self.session.post(
            f"{self.proxy}{path}?tokens=2000&interval=0.01", json=body))
        ok = await engine.watch.until(lambda: len(engine.record.generations) > started,
                                      within_s=10)
        assert ok, f"expected the engine to get the request, got {engine.record.generations}"
        task.cancel()  # the client leaves: its connection is closed
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await engine.watch.until(lambda: engine.record.generations[started].closed_at
                                      is not None, within_s=10)
        assert ok, "expected the engine's request to be closed after the client left"

    async def engine_resets(self) -> None:
        """The engine resets the connection after one event (an upstream MidStream error)."""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with self.session.post(
                    f"{self.proxy}/v1/chat/completions?tokens=10&die_after=1&die=rst",
                    json={"messages": [], "stream": True}) as resp:
                await resp.read()

    async def too_large(self) -> None:
        async with self.session.post(f"{self.proxy}/v1/chat/completions",
                                     data=b"x" * (4 * MAX_BODY),
                                     headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
        assert resp.status == 413, f"expected 413 for a body over {MAX_BODY}, got {resp.status}"

    async def run(self, *, completes: int, good: int, flaky: int, deaf: int, blind: int,
                  unabortable: int, resets: int, too_large: int) -> None:
        for _ in range(completes):
            await self.complete()
        for _ in range(good):
            await self.leave("/v1/chat/completions", self.good, messages=[])
        for _ in range(flaky):
            await self.leave("/v1/completions", self.flaky, prompt="x")
        for _ in range(deaf):
            await self.leave("/inference/v1/generate", self.deaf, prompt="x")
        for _ in range(blind):
            await self.leave("/v1/responses", self.deaf, input="x")
        for _ in range(unabortable):
            # Non-streaming: a streamed chat beam search is only detected before its head
            # (engine.vllm).
            await self.leave_before_head("/v1/chat/completions", self.good, messages=[],
                                         use_beam_search=True)
        for _ in range(resets):
            await self.engine_resets()
        for _ in range(too_large):
            await self.too_large()


PHASE_1 = {"completes": 1, "good": 1, "flaky": 1, "deaf": 1, "blind": 1, "unabortable": 1,
           "resets": 1, "too_large": 1}
PHASE_2 = {"completes": 3, "good": 4, "flaky": 2, "deaf": 2, "blind": 2, "unabortable": 0,
           "resets": 2, "too_large": 1}
TOTAL = {k: PHASE_1[k] + PHASE_2[k] for k in PHASE_1}


async def _seen(prom: Prometheus, phase: dict[str, int]) -> None:
    """Wait until Prometheus has scraped the counters of ``phase`` (cumulative)."""
    left = sum(phase[k] for k in ("good", "flaky", "deaf", "blind", "unabortable"))
    for expr, want in [
        ('sum(cancel_sidecar_requests_total{status_class="disconnected"})', left),
        *((f'sum(cancel_sidecar_aborted_requests_total{{engine="{e}"}})', phase[e])
          for e in ("good", "flaky", "deaf", "blind")),
        ("sum(cancel_sidecar_upstream_errors_total)", phase["resets"]),
        ("sum(cancel_sidecar_downstream_errors_total)", phase["too_large"]),
        ('sum(cancel_sidecar_abort_confirm_seconds_count{engine="good"})', phase["good"]),
        ('sum(cancel_sidecar_abort_latency_seconds_count{engine="blind"})', phase["blind"]),
    ]:
        await prom.until(expr, partial(le, want), SCRAPED_S)  # want <= value


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, ``$__rate_interval`` resolved."""
    board = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            queries.append((panel["title"],
                            target["expr"].replace("$__rate_interval", RATE_WINDOW)))
    return queries


@pytest.mark.parametrize("workers", [1, 2], ids=["single", "workers2"])
async def test_prometheus_reads_the_sidecar_counters_alerts_and_dashboard(
        tmp_path: Path, workers: int) -> None:
    good, flaky, deaf = FakeEngine(), FakeEngine(), FakeEngine()
    flaky.record.abort_status = 503
    deaf.record.abort_ends = False
    for engine in (good, flaky, deaf):
        await engine.start()
    args = ("--workers", str(workers)) if workers > 1 else ()
    try:
        async with cli_process(tmp_path, _tree(good, flaky, deaf), *args) as cli, \
                prometheus_server(tmp_path, [f"127.0.0.1:{cli.admin_port}"],
                                  rule_files=(ALERTS,)) as prom, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            script = Script(session, f"http://127.0.0.1:{cli.proxy_port}", good, flaky, deaf)
            await script.run(**PHASE_1)
            await _seen(prom, PHASE_1)
            # At least one more scrape with phase 1's values: the baseline of the rates.
            await asyncio.sleep(2 * 1.0)
            await script.run(**PHASE_2)
            await _seen(prom, TOTAL)
            await _check_counters(prom)
            await _check_rules_and_alerts(prom)
            await _check_dashboard(prom, workers)
    finally:
        for engine in (good, flaky, deaf):
            await engine.stop()


async def _check_counters(prom: Prometheus) -> None:
    requests = await prom.values("sum by (route, status_class) (cancel_sidecar_requests_total)",
                                 "route", "status_class")
    assert requests.get(("/v1/chat", "disconnected")) == TOTAL["good"] + TOTAL["unabortable"], (
        f"expected {TOTAL['good'] + TOTAL['unabortable']} disconnected at /v1/chat, got "
        f"{requests}")
    assert requests.get(("/v1/completions", "disconnected")) == TOTAL["flaky"], (
        f"expected {TOTAL['flaky']} disconnected at /v1/completions, got {requests}")
    for route, kind in (("/inference", "deaf"), ("/v1/responses", "blind")):
        assert requests.get((route, "disconnected")) == TOTAL[kind], (
            f"expected {TOTAL[kind]} disconnected at {route}, got {requests}")
    assert requests.get(("/v1/chat", "4xx")) == TOTAL["too_large"], (
        f"expected {TOTAL['too_large']} 4xx (413) at /v1/chat, got {requests}")
    assert requests.get(("/v1/chat", "2xx"), 0) >= TOTAL["completes"], (
        f"expected at least {TOTAL['completes']} 2xx at /v1/chat, got {requests}")

    phases = await prom.values(
        "sum by (phase) (cancel_sidecar_client_disconnects_total)", "phase")
    want_p = {("streaming",): TOTAL["good"] + TOTAL["flaky"] + TOTAL["deaf"] + TOTAL["blind"],
              ("awaiting_response",): TOTAL["unabortable"]}
    assert phases == want_p, f"expected disconnects by phase {want_p}, got {phases}"

    aborted = await prom.values(
        "sum by (engine, outcome) (cancel_sidecar_aborted_requests_total)", "engine", "outcome")
    want = {("good", "confirmed"): TOTAL["good"], ("flaky", "http_503"): TOTAL["flaky"],
            ("deaf", "unconfirmed"): TOTAL["deaf"], ("blind", "accepted"): TOTAL["blind"]}
    assert aborted == want, f"expected aborted requests {want}, got {aborted}"

    calls = await prom.values("sum by (engine, outcome) (cancel_sidecar_abort_calls_total)",
                              "engine", "outcome")
    want_c = {("good", "accepted"), ("flaky", "http_503"), ("deaf", "accepted"),
              ("blind", "accepted")}
    assert calls.keys() == want_c and all(v >= 1 for v in calls.values()), (
        f"expected abort calls with outcomes {sorted(want_c)}, got {calls}")
    # Re-sent until the verdict: the deaf engine's requests named in more than one call.
    per_request = await prom.values(
        "sum by (engine) (cancel_sidecar_abort_calls_per_request_count)", "engine")
    want_n = {("good",): TOTAL["good"], ("flaky",): TOTAL["flaky"], ("deaf",): TOTAL["deaf"]}
    assert per_request == want_n, f"expected calls per request observed {want_n}, got " \
                                  f"{per_request}"
    deaf_calls = await prom.scalar(
        'sum(cancel_sidecar_abort_calls_per_request_sum{engine="deaf"})')
    assert deaf_calls > TOTAL["deaf"], (
        f"expected more than one abort call per unconfirmed request, got {deaf_calls} calls "
        f"for {TOTAL['deaf']}")

    unabortable = await prom.values(
        "sum by (engine, reason) (cancel_sidecar_unabortable_requests_total)", "engine", "reason")
    want_u = {("good", "vllm_beam_search"): TOTAL["unabortable"]}
    assert unabortable == want_u, f"expected unabortable {want_u}, got {unabortable}"

    upstream = await prom.values("sum by (engine, kind) (cancel_sidecar_upstream_errors_total)",
                                 "engine", "kind")
    want_up = {("good", "MidStream"): TOTAL["resets"]}
    assert upstream == want_up, f"expected upstream errors {want_up}, got {upstream}"

    ready = await prom.values("cancel_sidecar_engine_ready", "engine")
    assert ready == {("good",): 1.0, ("flaky",): 0.0, ("deaf",): 1.0, ("blind",): 1.0,
                     ("closing",): 1.0}, (
        f"expected good, deaf, blind and closing (close_only) ready (1) and flaky not (0), "
        f"got {ready}")
    unavailable = await prom.values("cancel_sidecar_engine_abort_unavailable", "engine")
    assert unavailable == {("good",): 0.0, ("flaky",): 1.0, ("deaf",): 0.0, ("blind",): 0.0,
                           ("closing",): 1.0}, (
        f"expected the abort endpoint unavailable at flaky and closing (503) only, got "
        f"{unavailable}")

    # Rates over the window: phase 2 happened inside it.
    rate = await prom.scalar(
        f"sum(rate(cancel_sidecar_client_disconnects_total[{RATE_WINDOW}]))")
    assert rate > 0, f"expected a positive disconnect rate, got {rate}"
    rate = await prom.scalar(
        f'sum(rate(cancel_sidecar_aborted_requests_total{{outcome="http_503"}}[{RATE_WINDOW}]))')
    assert rate > 0, f"expected a positive rate of failed aborts, got {rate}"

    # The fake engines answer aborts at once, and good ends the request at once: p50 and p99
    # in the millisecond buckets.
    for q in (0.5, 0.99):
        for metric, engine in (("abort_latency_seconds", "blind"),
                               ("abort_confirm_seconds", "good")):
            latency = await prom.scalar(
                f"histogram_quantile({q}, sum by (le) (rate("
                f'cancel_sidecar_{metric}_bucket{{engine="{engine}"}}[{RATE_WINDOW}])))')
            assert 0 < latency <= 0.25, (
                f"expected {metric} p{q * 100:g} at {engine} in (0, 0.25] s, got {latency}")


async def _check_rules_and_alerts(prom: Prometheus) -> None:
    rules = await prom.rules()
    health = [(r["name"], r["health"], r.get("lastError")) for r in rules]
    assert len(rules) == 11 and all(h == "ok" for _, h, _ in health), (
        f"expected 10 healthy rules, got {health}")
    # Rules are evaluated every second; the alerts this script provokes appear within a few.
    want = {("CancelSidecarRequestsNotAborted", "flaky"), ("CancelSidecarEngineNotReady", "flaky"),
            ("CancelSidecarUnabortableRequests", "good"),
            ("CancelSidecarAbortsUnconfirmed", "deaf"),
            ("CancelSidecarEngineCloseOnly", "closing")}
    active: set[tuple[str, str]] = set()
    for _ in range(40):
        active = {(a["labels"]["alertname"], a["labels"].get("engine", ""))
                  for a in await prom.alerts() if a["state"] in ("pending", "firing")}
        if want <= active:
            break
        await asyncio.sleep(0.25)
    assert want <= active, f"expected alerts {sorted(want)} pending or firing, got {sorted(active)}"
    # Confirmed, unconfirmed and accepted aborts are not failures: only flaky's http_503.
    not_aborted = {e for a, e in active if a == "CancelSidecarRequestsNotAborted"}
    assert not_aborted == {"flaky"}, (
        f"expected CancelSidecarRequestsNotAborted for flaky only, got {sorted(not_aborted)}")
    # Each engine without aborts has one of the two: out of service (flaky, not_ready) or
    # served close-only (closing).
    for alert, engine in (("CancelSidecarEngineNotReady", "flaky"),
                          ("CancelSidecarEngineCloseOnly", "closing")):
        got = {e for a, e in active if a == alert}
        assert got == {engine}, f"expected {alert} for {engine} only, got {sorted(got)}"


async def _check_dashboard(prom: Prometheus, workers: int) -> None:
    empty = []
    for title, expr in dashboard_queries():
        if workers == 1 and "cancel_sidecar_workers_replaced" in expr:
            continue  # a supervisor's counter: --workers N only (the panel says so)
        result = await prom.query(expr)
        values = [float(s["value"][1]) for s in result]
        if not values or all(math.isnan(v) for v in values):
            empty.append((title, expr, result))
    assert not empty, f"expected data from every dashboard query, got none for {empty}"


def test_dashboard_panels_each_query_the_prometheus_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables.get("datasource", {}).get("type") == "datasource", (
        f"expected a datasource variable, got {variables}")
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles)), f"expected unique panel titles, got {titles}"
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (
            f"expected panel {panel['title']!r} on ${{datasource}}, got {panel['datasource']}")
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), (
            f"expected PromQL targets in panel {panel['title']!r}, got {panel['targets']}")
        assert panel.get("description"), f"expected a description on {panel['title']!r}"
