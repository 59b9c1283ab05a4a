"""A killed sidecar on a real vLLM: its restart aborts what the dead process left running.

vLLM 0.32 (CPU build, the tiny slow model) is started as ``vllm serve --api-server-count 2``
with the disconnect-hiding middleware (``tests/harness/e2e/vllm_server.py``): a request whose
connection closes runs on to ``max_tokens`` (~40 s here) unless it is aborted by id. The sidecar's
CLI carries streaming chats, JSON chats and a 4-prompt streaming completion; it is killed with
SIGKILL (the OOM killer), which closes every upstream connection and aborts nothing. The test first
checks the premise at vLLM's ``/metrics``: the work still runs after the kill. Then the same config
is started again (the same ``lifecycle.record_dir``: :mod:`sidecar.inflight`) and ``/metrics`` must
show nothing running or waiting ``QUIET_AFTER_S`` after it listens, and no token counted after that.
Printed: when vLLM went idle, counted from the restart's listening.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_vllm_api_servers import (
    MAX_MODEL_LEN,
    STARTUP_S,
    chat_body,
    completion_body,
    open_stream,
    sweep,
)
from tests.e2e.test_vllm_e2e import CACHE
from tests.harness.e2e.measure import RawClient
from tests.harness.e2e.sidecar_process import SidecarProcess, start_sidecar
from tests.harness.e2e.tiny_model import SLOW_MODEL_KWARGS, build_tiny_model
from tests.harness.e2e.vllm_server import (
    HIDE_DISCONNECT_MIDDLEWARE,
    VLLMServer,
    read_metrics,
    start_vllm_server,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STREAMS = 3
JSONS = 2
QUIET_AFTER_S = 2.0
POLL_S = 0.05


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model(CACHE / "slow-llama-8k", **SLOW_MODEL_KWARGS)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    log = tmp_path_factory.mktemp("vllm-crash") / "vllm.log"
    server = start_vllm_server(model_dir, max_model_len=MAX_MODEL_LEN, log_path=log,
                               middleware=[HIDE_DISCONNECT_MIDDLEWARE], api_server_count=2,
                               extra_env={"VLLM_SERVER_DEV_MODE": "1"}, startup_timeout=STARTUP_S)
    try:
        yield server
    finally:
        server.stop()


def _kill(sc: SidecarProcess) -> None:
    sc.proc.kill()
    sc.proc.wait(timeout=10)


async def _load(sc: SidecarProcess, model: Path) -> list[RawClient]:
    """Streams reading events, JSON chats whose answers are still being generated, and a
    4-prompt completion: everything in flight when the sidecar dies."""
    clients = [await open_stream(sc, "/v1/chat/completions", chat_body(model, stream=True))
               for _ in range(STREAMS)]
    clients.append(await open_stream(sc, "/v1/completions", completion_body(model)))
    for _ in range(JSONS):
        clients.append(await RawClient.post(sc.base_url, "/v1/chat/completions",
                                            chat_body(model, stream=False)))
    return clients


async def test_a_killed_sidecar_s_streams_stop_after_its_restart(
        engine: VLLMServer, model_dir: Path, tmp_path: Path) -> None:
    sweep(engine)
    first = start_sidecar(engine.base_url, tmp_path / "first")
    try:
        clients = await _load(first, model_dir)
        deadline = time.monotonic() + 30
        while (m := read_metrics(engine.base_url))["running"] < STREAMS + 4 + JSONS:
            assert time.monotonic() < deadline, f"expected every request running, got {m}"
            await asyncio.sleep(POLL_S)
    finally:
        _kill(first)
    for client in clients:
        client.writer.close()
    await asyncio.sleep(0.5)
    left = read_metrics(engine.base_url)
    assert left["running"] + left["waiting"] >= STREAMS + 4 + JSONS, (
        f"the premise: behind the disconnect-hiding middleware vLLM runs on after the sidecar "
        f"died, got {left}")
    again = start_sidecar(engine.base_url, tmp_path / "again")
    listening = time.monotonic()
    try:
        idle_at = None
        while time.monotonic() - listening < QUIET_AFTER_S:
            m = read_metrics(engine.base_url)
            if not m["running"] and not m["waiting"] and idle_at is None:
                idle_at = time.monotonic() - listening
            await asyncio.sleep(POLL_S)
        m = read_metrics(engine.base_url)
        assert not m["running"] and not m["waiting"], (
            f"expected nothing running at vLLM {QUIET_AFTER_S} s after the restart listened, "
            f"got {m}; sidecar log tail:\n{again.log_text()[-3000:]}")
        tokens = m["generation_tokens"]
        await asyncio.sleep(1.0)
        quiet = read_metrics(engine.base_url)["generation_tokens"] - tokens
        assert quiet == 0, f"vLLM counted {quiet} tokens after it went idle"
        log = again.log_text()
        assert "left running by a dead sidecar process" in log, log[-3000:]
        print(f"\n{STREAMS} streams, {JSONS} JSON chats and a 4-prompt completion "
              f"({left['running']:.0f} running at vLLM 0.5 s after the SIGKILL): idle "
              f"{(idle_at or 0) * 1000:.0f} ms after the restart listened; 0 tokens after")
    finally:
        again.stop()
        sweep(engine)
