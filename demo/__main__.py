"""The main job, end to end, in a few minutes: ``.venv/bin/python -m demo`` from the repo root.

1. Build a small random Llama under ``tests/e2e/.cache`` (no download; gibberish output).
2. Start a real vLLM server (CPU) with ``--enable-scale-out`` (its abort endpoint) and
   ``HideDisconnectMiddleware``: like an ASGI layer that buffers request bodies, it keeps vLLM
   from noticing that a client left.
3. Start the sidecar through its CLI (``python -m sidecar --config ...``) in front of it.
4. A client starts a long streaming chat, reads a few events and disconnects: once straight to
   vLLM, once through the sidecar. vLLM's own ``/metrics`` show what happens next.

Every process is stopped on exit, on Ctrl-C and on errors.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness.e2e.measure import MetricsSampler, RawClient
from tests.harness.e2e.sidecar_process import SidecarProcess, start_sidecar
from tests.harness.e2e.tiny_model import E2E_MODEL_KWARGS, build_tiny_model
from tests.harness.e2e.vllm_server import (
    HIDE_DISCONNECT_MIDDLEWARE,
    VLLMServer,
    read_metrics,
    start_vllm_server,
)

REPO = Path(__file__).resolve().parents[1]
WATCH_S = 3.0  # how long to watch the engine after each disconnect


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Outcome:
    """One abandoned request. ``wasted``: tokens vLLM generated for it that the client never
    received (settled ``vllm:generation_tokens_total`` delta minus tokens the client read);
    ``stopped_ms``: client close -> ``vllm:num_requests_running`` == 0 (None: not by itself)."""

    wasted: int
    stopped_ms: float | None
    watched_s: float


SETTLE_S = 1.0  # vLLM's token counter lags its engine; read it only after this long idle


async def settled_tokens(engine: VLLMServer) -> float:
    with MetricsSampler(engine.base_url) as sampler:
        await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, 60, "an idle engine")
    await asyncio.sleep(SETTLE_S)
    return (await asyncio.to_thread(read_metrics, engine.base_url))["generation_tokens"]


async def abort_directly(engine: VLLMServer, engine_id: str) -> None:
    reader, writer = await asyncio.open_connection(engine.host, engine.port)
    payload = json.dumps({"request_ids": [engine_id]}).encode()
    writer.write(b"POST /inference/v1/abort_requests HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(payload), payload))
    await reader.read()
    writer.close()
    await writer.wait_closed()


async def leave_mid_stream(base_url: str, model: Path, engine: VLLMServer, label: str,
                           direct: bool) -> Outcome:
    """Start a long streaming chat at ``base_url``, read 5 events, disconnect, watch /metrics."""
    body = {"model": str(model), "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True}
    before = await settled_tokens(engine)
    headers = {"X-Request-Id": "demo-direct"} if direct else None
    with MetricsSampler(engine.base_url) as sampler:
        say(f"{label}: starting a 4000-token streaming chat")
        client = await RawClient.post(base_url, "/v1/chat/completions", body, headers)
        try:
            await client.read_head()
            await sampler.wait_for(lambda s: s.running >= 1, 30, "a running request")
            # Read, then leave at once: tokens the client did not read count as wasted, so
            # the client must not pause between reading and leaving.
            events = await client.read_events(6)  # the role event, then 5 tokens
        finally:
            t0 = await client.disconnect("abort")
        say(f"{label}: read 5 tokens, disconnected; watching vLLM /metrics for {WATCH_S:.0f} s")
        await asyncio.sleep(WATCH_S)
        report = sampler.stop_report(t0)
    if report.running_at_end:
        say(f"{label}: still generating {WATCH_S:.0f} s after the client left; "
            "stopping it with an abort call of our own")
        await abort_directly(engine, "chatcmpl-demo-direct")
    received = content_events(events)
    wasted = int(await settled_tokens(engine) - before) - received
    return Outcome(wasted, report.ms_to_idle if not report.running_at_end else None,
                   report.window_s)


def content_events(events: list[bytes]) -> int:
    """How many of the SSE ``data:`` lines ``events`` carry generated text: a chat chunk whose
    ``choices[].delta.content`` is a non-empty string. vLLM's first chunk of a chat stream only
    names the role (``"delta": {"role": "assistant", "content": ""}``,
    ``vllm/entrypoints/openai/serving_chat.py``): no token, not counted; neither is ``[DONE]``.
    Raises ``ValueError`` for a line that is not JSON."""
    count = 0
    for event in events:
        payload = event.removeprefix(b"data: ").strip()
        if payload == b"[DONE]":
            continue
        choices = json.loads(payload).get("choices") or []
        if any((c.get("delta") or {}).get("content") for c in choices):
            count += 1
    return count


async def run(model: Path, engine: VLLMServer, sidecar: SidecarProcess) -> None:
    direct = await leave_mid_stream(engine.base_url, model, engine, "without sidecar", True)
    through = await leave_mid_stream(sidecar.base_url, model, engine, "through sidecar", False)
    d_idle = f"never (aborted by hand after {direct.watched_s:.0f} s)" \
        if direct.stopped_ms is None else f"{direct.stopped_ms:.0f} ms"
    t_idle = "never" if through.stopped_ms is None else f"{through.stopped_ms:.0f} ms"
    print()
    print(f"{'':38}{'without sidecar':>38}{'through sidecar':>18}")
    print(f"{'tokens generated, never received':38}{direct.wasted:>38}{through.wasted:>18}")
    print(f"{'client close -> vLLM stops generating':38}{d_idle:>38}{t_idle:>18}")
    print()
    say("figures from vLLM's own /metrics: vllm:num_requests_running polled every 10 ms; "
        "vllm:generation_tokens_total read once the engine was idle")


def main() -> int:
    sys.path.insert(0, str(REPO))
    engine: VLLMServer | None = None
    sidecar: SidecarProcess | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="cancel-sidecar-demo-") as tmp:
            say("building a small random Llama under tests/e2e/.cache (once, ~5 s)")
            model = build_tiny_model(REPO / "tests/e2e/.cache/e2e-llama-8k", **E2E_MODEL_KWARGS)
            say("starting vLLM (CPU; ~30-60 s) with --enable-scale-out and a middleware that "
                "hides client disconnects from it")
            engine = start_vllm_server(model, max_model_len=8192,
                                       log_path=Path(tmp) / "vllm.log",
                                       middleware=[HIDE_DISCONNECT_MIDDLEWARE])
            say(f"vLLM up at {engine.base_url} after {engine.start_seconds:.0f} s")
            sidecar = start_sidecar(engine.base_url, Path(tmp) / "sidecar")
            say(f"sidecar (python -m sidecar) up: proxy {sidecar.base_url}, "
                f"admin {sidecar.admin_url}")
            asyncio.run(run(model, engine, sidecar))
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if sidecar is not None:
            say("stopping the sidecar")
            sidecar.stop()
        if engine is not None:
            say("stopping vLLM")
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
