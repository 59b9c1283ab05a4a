"""End to end on a real vLLM started WITHOUT ``--enable-scale-out``: its abort endpoint
(``POST /inference/v1/abort_requests``) answers 403 (``tests/e2e/VLLM_FACTS_CHECKED.md``), so the
sidecar cannot stop a request there, and must say so instead of pretending.

Setup, once per module (after ``test_vllm_e2e.py``'s engine is gone): the same tiny model, one
vLLM with ``HideDisconnectMiddleware`` (vLLM never sees a disconnect) and no scale-out, and the
sidecar's CLI in front. Shown here:

- the startup check logs the fix (``start vLLM with --enable-scale-out``) and ``/readyz`` is 503
  with the same hint, for as long as the engine runs that way;
- a client that leaves mid-stream: the sidecar closes the upstream connection and makes one abort
  call, answered 403, counted as ``abort_calls_total{outcome="http_403"}`` and never retried; and
  vLLM (which cannot see the disconnect) keeps the request running and generating: the honest
  outcome, proven on vLLM's own ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_vllm_e2e import (  # model_dir and sampler: the same fixtures
    DIRECT_WATCH_S,
    STILL_GENERATING_TOKENS,
    model_dir,
    running_engine,
    running_sidecar,
    sampler,
    sidecar_counter,
    start_generating,
)
from tests.harness.e2e.measure import MetricsSampler
from tests.harness.e2e.sidecar_process import SidecarProcess
from tests.harness.e2e.vllm_server import VLLMServer

__all__ = ["model_dir", "sampler"]  # fixtures shared with tests/e2e/test_vllm_e2e.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.flaky(reruns=2)]

HINT = "start vLLM with --enable-scale-out"
ANSWER_S = 10.0  # how long the sidecar's startup check / abort call may take to show up


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with running_engine(model_dir, tmp_path_factory, enable_scale_out=False) as server:
        yield server


@pytest.fixture(scope="module")
def sidecar(engine: VLLMServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[SidecarProcess]:
    with running_sidecar(engine, tmp_path_factory) as sc:
        yield sc


def readyz(sc: SidecarProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{sc.admin_url}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:  # it holds the connection open until closed
            return e.code, e.read().decode()


def test_the_403_is_reported_with_its_fix_and_readiness_stays_false(
        engine: VLLMServer, sidecar: SidecarProcess) -> None:
    direct = urllib.request.Request(f"{engine.base_url}/inference/v1/abort_requests",
                                    data=json.dumps({"request_ids": ["x"]}).encode(),
                                    headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(direct, timeout=5)
    refused.value.close()  # it holds the connection open until closed
    assert refused.value.code == 403, f"expected vLLM's own 403, got {refused.value.code}"
    deadline = time.monotonic() + ANSWER_S
    while HINT not in sidecar.log_text():
        assert time.monotonic() < deadline, (
            f"expected the startup check to log {HINT!r}; log:\n{sidecar.log_text()[-3000:]}")
        time.sleep(0.1)
    status, body = readyz(sidecar)
    assert status == 503 and HINT in body, f"expected /readyz 503 naming the fix: {status} {body}"
    assert json.loads(body)["engines"]["local"] != "ok", body


async def test_a_client_that_leaves_gets_one_refused_abort_and_the_engine_goes_on(
        sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler) -> None:
    refused_before = sidecar_counter(sidecar, "cancel_sidecar_abort_calls_total",
                                     outcome="http_403")
    # A rerun finds the refused requests of the earlier attempts still running, as they should:
    # nothing here can stop them. They are counted, and this attempt's request comes on top.
    others = int(sampler.read_once().running)
    client = await start_generating(sidecar.base_url, model_dir, "chat stream", sampler,
                                    others=others)
    t0 = await client.disconnect("abort")
    deadline = time.monotonic() + ANSWER_S
    while sidecar_counter(sidecar, "cancel_sidecar_abort_calls_total",
                          outcome="http_403") < refused_before + 1:
        assert time.monotonic() < deadline, "expected one abort call answered 403"
        await asyncio.sleep(0.05)
    await asyncio.sleep(DIRECT_WATCH_S)  # an observation window, not a synchronisation
    await sampler.wait_for(lambda s: s.t > t0 + DIRECT_WATCH_S, guard_s=30,
                           what="a /metrics sample at the end of the watch window")
    report = sampler.stop_report(t0)
    late = [s for s in sampler.snapshot() if s.t > t0 + 0.2]
    print(f"\n[no scale-out] abort refused (403); {report.tokens_after} tokens generated in the "
          f"{DIRECT_WATCH_S}s after the client left")
    assert all(s.running == others + 1 for s in late), (
        f"expected vLLM to keep the request running (the abort was refused) on top of "
        f"{others} already running; {late[-3:]}")
    # Not a rate: the rate over the 0.5 s before the disconnect (the request's first tokens, a
    # few /metrics samples) is too noisy on a shared box to bound the window after it.
    assert report.tokens_after >= STILL_GENERATING_TOKENS, (
        f"expected generation to go on ({STILL_GENERATING_TOKENS}+ tokens in the window), "
        f"got {report}")
    refused = sidecar_counter(sidecar, "cancel_sidecar_abort_calls_total", outcome="http_403")
    ok = sidecar_counter(sidecar, "cancel_sidecar_abort_calls_total", outcome="accepted")
    assert (refused, ok) == (refused_before + 1, 0), (
        f"expected exactly one refused call (403 is never retried) and none ok: {refused}, {ok}")
    assert sidecar_counter(sidecar, "cancel_sidecar_client_disconnects_total") >= 1
