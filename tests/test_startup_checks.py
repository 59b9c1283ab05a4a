"""The startup check: once the listeners are up, the CLI checks every engine as ``/readyz``
does (:mod:`sidecar.readiness`), logs one line per engine saying it is ready or exactly what to
fix, re-checks in the background until every engine is ready, and logs only changes.

Production wiring: the real ``python -m sidecar`` (:mod:`tests.harness.cli_process`) against the
fake engine on 127.0.0.1; ``/readyz`` is asked on the CLI's admin port and must carry the same hint.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.app import ABORT_DRAIN_S
from tests.fakes.engine import FakeEngine
from tests.fakes.upstreams import refused_port
from tests.harness.cli_process import CliProcess, cli_process, config_tree
from tests.harness.support import metrics, sample

pytestmark = pytest.mark.timeout(90)

KEY = "cli-key"  # config_tree's abort key: must never reach the log
CHECK_S = 20.0  # guard: a hint or ready line after the change that causes it (re-check <= 4 s)
READY = "engine local ready (health ok, abort endpoint ok)"
SCALE_OUT = ("start vLLM with --enable-scale-out (its abort endpoint "
             "/inference/v1/abort_requests is disabled)")


async def _readyz(cli: CliProcess) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(f"http://127.0.0.1:{cli.admin_port}/readyz") as resp:
            return resp.status, await resp.json()


def _lines(cli: CliProcess, text: str) -> list[str]:
    return [line for line in cli.stderr_lines if text in line]


def _probes(engine: FakeEngine) -> int:
    return len(engine.record.probes)


async def test_vllm_403_logs_the_scale_out_hint_once_then_ready_once_fixed(
        engine: FakeEngine, tmp_path: Path) -> None:
    engine.record.abort_status = 403  # vLLM started without --enable-scale-out
    async with cli_process(tmp_path, config_tree(engine.url)) as cli:
        await cli.wait_log(SCALE_OUT, CHECK_S)
        status, body = await _readyz(cli)
        assert (status, body) == (503, {"ready": False, "engines": {"local": SCALE_OUT}}), (
            f"expected /readyz 503 with the same hint, got {status} {body}")
        # At least one background re-check with the same answer before the fix: still one line.
        assert await engine.watch.until(lambda: _probes(engine) >= 3, CHECK_S), (
            f"expected a background re-check within {CHECK_S} s, saw {_probes(engine)} probes")
        engine.record.abort_status = 200
        await cli.wait_log(READY, CHECK_S)
        status, body = await _readyz(cli)
        assert (status, body) == (200, {"ready": True, "engines": {"local": "ok"}}), (
            status, body)
        warnings = _lines(cli, "not ready")
        assert len(warnings) == 1 and SCALE_OUT in warnings[0], (
            f"expected exactly one not-ready line (changes only), got {warnings}")
        assert len(_lines(cli, READY)) == 1, _lines(cli, READY)
        assert KEY not in cli.stderr, "the abort api_key reached the log"


async def test_engine_not_listening_at_start(tmp_path: Path) -> None:
    port = refused_port()
    url = f"http://127.0.0.1:{port}"
    late = FakeEngine()
    try:
        async with cli_process(tmp_path, config_tree(url)) as cli:
            hint = f"nothing listens at {url}: is the engine up? (retrying)"
            await cli.wait_log(hint, CHECK_S)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{cli.proxy_port}/v1/completions",
                                        json={"prompt": "x"}) as resp:
                    assert resp.status == 502, f"expected 502 with no engine, got {resp.status}"
            status, body = await _readyz(cli)
            assert (status, body["engines"]) == (503, {"local": hint}), (status, body)
            await late.start(port)
            await cli.wait_log(READY, CHECK_S)
            assert len(_lines(cli, hint)) == 1, f"expected the hint once, got {_lines(cli, hint)}"
            assert (await _readyz(cli))[0] == 200
            assert KEY not in cli.stderr, "the abort api_key reached the log"
    finally:
        await late.stop()


@pytest.mark.parametrize("failure", ["401", "404"])
async def test_abort_key_and_path_hints(engine: FakeEngine, tmp_path: Path,
                                        failure: str) -> None:
    tree = config_tree(engine.url)
    if failure == "401":
        engine.record.abort_key = "the-engines-key"
        hint = ("the engine rejected engines.local.abort.api_key: set it to the engine's "
                "--api-key")
    else:
        tree["engines"]["local"]["abort"]["path"] = "/no/such/abort"
        hint = ("no abort endpoint at /no/such/abort: check engines.local.abort.path (vLLM: "
                "/inference/v1/abort_requests; SGLang: /abort_request) or the engine version")
    async with cli_process(tmp_path, tree) as cli:
        await cli.wait_log(f"engine local not ready: {hint}", CHECK_S)
        status, body = await _readyz(cli)
        assert (status, body["engines"]) == (503, {"local": hint}), (status, body)
        assert KEY not in cli.stderr, "the abort api_key reached the log"


async def test_openai_kind_gets_a_health_check_and_no_abort_probe(
        engine: FakeEngine, tmp_path: Path) -> None:
    tree = config_tree(engine.url)
    tree["engines"] = {"local": {"kind": "openai", "url": engine.url}}
    async with cli_process(tmp_path, tree) as cli:
        await cli.wait_log("engine local ready (health ok; its kind has no abort endpoint)",
                           CHECK_S)
        seen = {(s.method, s.path) for s in engine.watch.seen}
        assert seen == {("GET", "/v1/models")}, f"expected only the health GET, got {seen}"
        assert engine.record.probes == [] and engine.record.aborts == [], engine.record.probes


async def test_health_failure_hint(engine: FakeEngine, tmp_path: Path) -> None:
    tree = config_tree(engine.url)
    tree["engines"] = {"local": {"kind": "openai", "url": engine.url,
                                 "health_path": "/status/503"}}
    async with cli_process(tmp_path, tree) as cli:
        hint = f"{engine.url}/status/503 answered 503"
        await cli.wait_log(f"engine local not ready: {hint}", CHECK_S)
        status, body = await _readyz(cli)
        assert (status, body["engines"]) == (503, {"local": hint}), (status, body)


async def test_workers_run_the_startup_check_once(engine: FakeEngine, tmp_path: Path) -> None:
    engine.record.abort_status = 403
    async with cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli:
        await cli.wait_log(SCALE_OUT, CHECK_S)
        engine.record.abort_status = 200
        await cli.wait_log(READY, CHECK_S)
        assert len(_lines(cli, SCALE_OUT)) == 1 and len(_lines(cli, READY)) == 1, (
            "expected one hint and one ready line (the supervisor's check only), got "
            f"{_lines(cli, SCALE_OUT)} {_lines(cli, READY)}")


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_close_only_is_re_checked_until_the_engine_can_abort(
        engine: FakeEngine, tmp_path: Path, workers: str) -> None:
    """``abort.when_unavailable: close_only`` through the CLI (the supervisor's admin
    listener under ``--workers``): /readyz 200 and the gauge 1 while vLLM answers 403; the
    startup check keeps re-checking on its own (nobody asks /readyz meanwhile), so the fix is
    logged and the gauge back to 0 without a probe."""
    engine.record.abort_status = 403
    tree = config_tree(engine.url)
    tree["engines"]["local"]["abort"]["when_unavailable"] = "close_only"
    async with cli_process(tmp_path, tree, "--workers", workers) as cli:
        await cli.wait_log(f"engine local serving close-only: its abort endpoint is unusable "
                           f"({SCALE_OUT})", CHECK_S)
        status, body = await _readyz(cli)
        assert (status, body) == (200, {"ready": True, "engines": {"local": "ok"},
                                        "close_only": {"local": SCALE_OUT}}), (
            f"expected /readyz 200 under close_only, naming what to fix, got {status} {body}")
        gauges = await metrics(cli.admin_port)
        assert sample(gauges, "cancel_sidecar_engine_abort_unavailable", engine="local") == 1, (
            gauges)
        engine.record.abort_status = 200
        await cli.wait_log(READY, CHECK_S)
        gauges = await metrics(cli.admin_port)
        unavailable = gauges.get(("cancel_sidecar_engine_abort_unavailable",
                                  frozenset({("engine", "local")})))
        assert unavailable == 0, f"expected the gauge back to 0, got {unavailable}"
        assert len(_lines(cli, "serving close-only")) == 1, _lines(cli, "serving close-only")


async def test_stop_does_not_wait_for_the_startup_check(tmp_path: Path) -> None:
    """SIGTERM while the check still waits for an engine that never comes: the check is
    cancelled at once; left to the app teardown it would hold the stop for ABORT_DRAIN_S."""
    url = f"http://127.0.0.1:{refused_port()}"
    async with cli_process(tmp_path, config_tree(url)) as cli:
        await cli.wait_log("nothing listens at", CHECK_S)
        cli.signal(signal.SIGTERM)
        assert await cli.wait_exit() == 0, cli.stderr
        match = re.search(r"stopped in (\d+\.\d+) s", cli.stderr)
        assert match and float(match[1]) < ABORT_DRAIN_S - 1, (
            f"expected a stop well under {ABORT_DRAIN_S} s, got {match and match[0]}; "
            f"stderr:\n{cli.stderr}")
        assert "background task" not in cli.stderr, cli.stderr
