"""End to end on a real vLLM engine: the sidecar (its CLI, as a subprocess) stops generation when
the client leaves, and changes nothing when it stays.

Setup, once per module: a small random Llama (``tests/harness/e2e/tiny_model.py``, preset
``E2E_MODEL_KWARGS``) built under ``tests/e2e/.cache``; one vLLM server with
``--enable-scale-out`` (the abort endpoint) and ``HideDisconnectMiddleware`` (vLLM itself never
sees a disconnect, as behind a body-buffering ASGI layer); one ``python -m sidecar`` in front.

Proof comes from vLLM's own ``/metrics`` (``vllm:num_requests_running``,
``vllm:generation_tokens_total``), sampled every 10 ms by :class:`MetricsSampler`:

- without the sidecar, a disconnected request keeps running and generating;
- through the sidecar, running drops to 0 and the token counter stops, for streaming and
  non-streaming chat and completions, and for a completion with three prompts;
- requests that are not disconnected come back byte-identical: JSON answers equal a direct
  request's after normalising the per-request ``id`` and ``created`` fields; a stream equals the
  bytes vLLM wrote on the sidecar's connection (a byte recorder in between); and
  ``X-Request-Id`` is the id vLLM used;
- the ``openai`` SDK works through the sidecar, and abandoning its stream aborts the engine.
- the cancel API (``POST /v1/requests/{id}/cancel``) and a deadline (``X-Sidecar-Deadline-S``)
  stop a request whose client stays connected, streaming (final SSE error event, no ``[DONE]``)
  and non-streaming (499 / 504 JSON), and vLLM stops running it.

The measured figures are printed as a table (``pytest -s``) and written to
``tests/e2e/.last_results.json``. The target is "stops within 100 ms"; the assertions use a
generous 5 s guard: on this 2-core box vLLM's API process (or the test process) can stall for
~2 s (seen once in a CI-like run: a 2 s gap between /metrics samples), not the sidecar's doing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm  # noqa: F401
except (ImportError, RuntimeError, OSError) as exc:  # a broken torch stack raises RuntimeError
    pytest.skip(f"real-engine e2e tests need vLLM (pip install '.[e2e]'): import vllm failed: "
                f"{exc!r}", allow_module_level=True)

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.upstreams import RawServer
from tests.harness import rawhttp
from tests.harness.e2e.measure import MetricsSampler, RawClient, StopReport
from tests.harness.e2e.sidecar_process import SidecarProcess, start_sidecar
from tests.harness.e2e.tiny_model import E2E_MODEL_KWARGS, build_tiny_model
from tests.harness.e2e.vllm_server import (
    HIDE_DISCONNECT_MIDDLEWARE,
    VLLMServer,
    read_metrics,
    start_vllm_server,
)

# A failed e2e test is run again, at most twice, and the failure stays in the report ("R"):
# on this 2-core machine vLLM's API process or the test process stalls for ~2 s now and then
# (about one module run in six here), which no guard short of hiding the figures can absorb.
# The sidecar's own timing is tested without a real engine in tests/test_cancel.py.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.flaky(reruns=2)]

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS_PATH = HERE / ".last_results.json"
MAX_MODEL_LEN = 8192
LONG_TOKENS = 4000      # long enough never to finish during a test (~15 s at ~250 tokens/s)
STOP_GUARD_S = 5.0      # the assertion; the goal is 0.1 s, the printed figures say how close
QUIET_S = 0.5           # after the engine went idle, watch this long that no token is counted
DIRECT_WATCH_S = 2.0    # without the sidecar, watch this long that generation goes on
STARTED_TOKENS = 20     # a request counts as generating once this many tokens were counted
# Tokens per engine request in DIRECT_WATCH_S that show it still generating: a stopped request
# makes 0-1. Not a rate: on this shared 2-core box vLLM made from 3.5 (two requests running) to
# 130 tokens per request in that window.
STILL_GENERATING_TOKENS = 3

PROMPTS = ["the quick brown fox", "one two three four", "hello world engine"]
CASES: dict[str, tuple[str, dict[str, Any], int, str]] = {
    # name: (path, body, engine requests, how the client leaves)
    "chat stream": ("/v1/chat/completions",
                    {"messages": [{"role": "user", "content": PROMPTS[0]}], "stream": True},
                    1, "abort"),
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": PROMPTS[0]}]}, 1, "close"),
    "completion stream": ("/v1/completions", {"prompt": PROMPTS[1], "stream": True}, 1, "close"),
    "completion": ("/v1/completions", {"prompt": PROMPTS[1]}, 1, "abort"),
    "completion 3 prompts": ("/v1/completions", {"prompt": PROMPTS, "stream": True}, 3, "abort"),
}


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model(CACHE / "e2e-llama-8k", **E2E_MODEL_KWARGS)


@contextmanager
def running_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, *,
                   enable_scale_out: bool = True,
                   extra_env: dict[str, str] | None = None,
                   startup_timeout: float = 180.0) -> Iterator[VLLMServer]:
    """vLLM on the tiny model with the disconnect-hiding middleware; stopped at the end.
    ``extra_env``: more environment for the server (e.g. ``VLLM_SERVER_DEV_MODE``);
    ``startup_timeout``: seconds until ``/health`` answers and the warm-up is done."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = start_vllm_server(model_dir, max_model_len=MAX_MODEL_LEN, log_path=log,
                               middleware=[HIDE_DISCONNECT_MIDDLEWARE],
                               enable_scale_out=enable_scale_out, extra_env=extra_env,
                               startup_timeout=startup_timeout)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def running_sidecar(engine: VLLMServer, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[SidecarProcess]:
    """The sidecar's CLI in front of ``engine``; at the end, SIGTERM and an exit 0 checked."""
    sc = start_sidecar(engine.base_url, tmp_path_factory.mktemp("sidecar"))
    try:
        yield sc
    finally:
        status = sc.stop()
    assert status == 0, (f"expected the sidecar to exit 0 on SIGTERM, got {status}; log tail:\n"
                         f"{sc.log_text()[-3000:]}")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with running_engine(model_dir, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def sidecar(engine: VLLMServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[SidecarProcess]:
    with running_sidecar(engine, tmp_path_factory) as sc:
        yield sc


@pytest.fixture(scope="module")
def results(model_dir: Path) -> Iterator[dict[str, Any]]:
    """Figures the tests measured; printed as a table and saved when the module is done."""
    table: dict[str, Any] = {"model": str(model_dir), "cases": {}}
    yield table
    if table["cases"]:
        RESULTS_PATH.write_text(json.dumps(table, indent=2) + "\n")
        print("\n" + format_table(table))


@pytest.fixture
def sampler(engine: VLLMServer) -> Iterator[MetricsSampler]:
    with MetricsSampler(engine.base_url, interval=0.01) as s:
        yield s
    assert s.errors <= 2, f"expected /metrics to answer (re-connects allowed), {s.errors} failed"


@pytest.fixture(autouse=True)
def idle_engine(engine: VLLMServer) -> None:
    """Each test starts with an idle engine (a previous failure may have left work behind)."""
    deadline = time.monotonic() + 30
    while (m := read_metrics(engine.base_url))["running"] or m["waiting"]:
        assert time.monotonic() < deadline, f"expected an idle engine before the test, got {m}"
        time.sleep(0.1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


# --- helpers ----------------------------------------------------------------------------------

def engine_ids(path: str, request_id: str, prompts: int) -> list[str]:
    """vLLM 0.32's external ids (tests/e2e/VLLM_FACTS_CHECKED.md)."""
    if path == "/v1/chat/completions":
        return [f"chatcmpl-{request_id}"]
    return [f"cmpl-{request_id}-{i}" for i in range(prompts)]


def long_body(model: Path, body: dict[str, Any]) -> dict[str, Any]:
    return {"model": str(model), "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "temperature": 0, **body}


async def start_generating(base_url: str, model: Path, case: str, sampler: MetricsSampler,
                           headers: dict[str, str] | None = None, others: int = 0) -> RawClient:
    """Send ``case`` and return once the engine runs all its requests (on top of ``others``
    already running) and has counted tokens."""
    path, body, prompts, _ = CASES[case]
    base = sampler.read_once().generation_tokens
    client = await RawClient.post(base_url, path, long_body(model, body), headers)
    try:
        if body.get("stream"):
            await client.read_head()
            assert client.status == 200, f"expected 200 for {case}, got {client.status}"
            await client.read_events(3)
        await sampler.wait_for(
            lambda s: (s.running == others + prompts
                       and s.generation_tokens >= base + STARTED_TOKENS),
            guard_s=30, what=f"{others} + {prompts} running request(s) and {STARTED_TOKENS} tokens")
    except BaseException:
        await client.disconnect("abort")
        raise
    return client


def rate_before(sampler: MetricsSampler, t0: float, span: float = 0.5) -> float:
    """Tokens/s counted in the ``span`` seconds before ``t0``."""
    window = [s for s in sampler.snapshot() if t0 - span <= s.t <= t0]
    if len(window) < 2 or window[-1].t == window[0].t:
        return 0.0
    return (window[-1].generation_tokens - window[0].generation_tokens) / (
        window[-1].t - window[0].t)


def sidecar_counter(sc: SidecarProcess, name: str, **labels: str) -> float:
    """Sum of the sidecar's admin-port counter ``name`` over samples matching ``labels``."""
    import urllib.request

    with urllib.request.urlopen(f"{sc.admin_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def ended_by_engine(sc: SidecarProcess) -> float:
    """Requests whose abort vLLM answered by ending them, read on their own upstream connection
    (``sidecar.confirm``): ``confirmed`` (the response ended with ``finish_reason`` ``abort``)
    plus ``finished`` (it ended without: vLLM ends a stream aborted before its first token with
    ``data: [DONE]`` alone). Whether vLLM stopped is read at its /metrics, not here."""
    return sum(sidecar_counter(sc, "cancel_sidecar_aborted_requests_total", outcome=outcome)
               for outcome in ("confirmed", "finished"))


def normalise(raw: bytes, object_id: str) -> bytes:
    """Replace what vLLM makes per request: ``"id":"<object_id>"`` (built from the request id:
    ``chatcmpl-{X-Request-Id}`` / ``cmpl-{X-Request-Id}``, ``openai/*/serving.py``) and
    ``"created":<unix seconds>`` (``int(time.time())`` when the request arrived). Every other
    byte must match."""
    out, n = re.subn(rb'"id":\s*"' + re.escape(object_id.encode()) + rb'"', b'"id":"<ID>"', raw)
    assert n >= 1, f"expected {object_id!r} as the response id in {raw[:300]!r}"
    return re.sub(rb'"created":\s*\d+', b'"created":0', out)


def format_table(table: dict[str, Any]) -> str:
    rows = [("case", "direct: tokens in watch", "sidecar: ms to running=0",
             "ms to last token", "tokens after disconnect", "tok/s", "max /metrics gap ms")]
    for case, r in table["cases"].items():
        d, s = r.get("direct"), r.get("sidecar")
        rows.append((
            case,
            f"{d['tokens_after']} in {d['window_s']:.1f}s, running {d['running_at_end']}"
            if d else "-",
            f"{s['ms_to_idle']}" if s else "-",
            f"{s['ms_to_last_token']}" if s else "-",
            f"{s['tokens_after']}" if s else "-",
            f"{(s or d or {}).get('rate_tok_s', 0):.0f}",
            "/".join(str(x["max_gap_ms"]) for x in (d, s) if x),
        ))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "e2e results (vLLM /metrics, polled every 10 ms):\n" + "\n".join(lines)


def record(results: dict[str, Any], case: str, kind: str, report: StopReport,
           rate: float) -> None:
    results["cases"].setdefault(case, {})[kind] = {**report.as_dict(), "rate_tok_s": round(rate)}


async def abort_direct(http: aiohttp.ClientSession, engine: VLLMServer, ids: list[str]) -> None:
    async with http.post(f"{engine.base_url}/inference/v1/abort_requests",
                         json={"request_ids": ids}) as resp:
        assert resp.status == 200, f"expected 200 from the abort endpoint, got {resp.status}"


# --- (a) without the sidecar ------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
async def test_without_sidecar_disconnected_request_keeps_generating(
        case: str, engine: VLLMServer, model_dir: Path, sampler: MetricsSampler,
        http: aiohttp.ClientSession, results: dict[str, Any]) -> None:
    path, _, prompts, how = CASES[case]
    request_id = f"e2e-direct-{uuid.uuid4().hex[:8]}"
    client = await start_generating(engine.base_url, model_dir, case, sampler,
                                    {"X-Request-Id": request_id})
    try:
        t0 = await client.disconnect(how)
        await asyncio.sleep(DIRECT_WATCH_S)  # an observation window, not a synchronisation
        await sampler.wait_for(lambda s: s.t > t0 + DIRECT_WATCH_S, guard_s=30,
                               what="a /metrics sample at the end of the watch window")
        report = sampler.stop_report(t0)
        record(results, case, "direct", report, rate_before(sampler, t0))
        late = [s for s in sampler.snapshot() if s.t > t0 + 0.2]
        assert all(s.running == prompts for s in late), (
            f"expected vLLM (disconnect hidden) to keep {prompts} request(s) running for "
            f"{DIRECT_WATCH_S}s after the client left; samples: {late[:3]} ... {late[-3:]}")
        assert report.tokens_after >= STILL_GENERATING_TOKENS * prompts, (
            f"expected generation to go on after the disconnect, got {report}")
    finally:
        await abort_direct(http, engine, engine_ids(path, request_id, prompts))
        await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, guard_s=30,
                               what="an idle engine after our own abort call")


# --- (b) through the sidecar ------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
async def test_through_sidecar_disconnect_stops_generation(
        case: str, engine: VLLMServer, sidecar: SidecarProcess, model_dir: Path,
        sampler: MetricsSampler, results: dict[str, Any]) -> None:
    how = CASES[case][3]
    aborts_before = ended_by_engine(sidecar)
    client = await start_generating(sidecar.base_url, model_dir, case, sampler)
    t0 = await client.disconnect(how)
    await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, guard_s=20,
                           what=f"running == 0 after the client left through the sidecar ({case})")
    await asyncio.sleep(QUIET_S)  # watch that no token is counted any more
    report = sampler.stop_report(t0)
    record(results, case, "sidecar", report, rate_before(sampler, t0))
    assert report.ms_to_idle is not None and report.ms_to_idle < STOP_GUARD_S * 1000, (
        f"expected running == 0 within {STOP_GUARD_S}s of the disconnect, got {report}")
    assert report.ms_to_last_token < STOP_GUARD_S * 1000, (
        f"expected the token counter to stop within {STOP_GUARD_S}s, got {report}")
    quiet = [s for s in sampler.snapshot() if s.t > time.monotonic() - QUIET_S]
    assert len({s.generation_tokens for s in quiet}) == 1, (
        f"expected no token counted in the last {QUIET_S}s, samples: {quiet[:2]}..{quiet[-2:]}")
    aborts_after = ended_by_engine(sidecar)
    assert aborts_after == aborts_before + 1, (
        f"expected the sidecar to abort exactly one request (vLLM ended it: confirmed; "
        f"re-sends are counted apart), counter went "
        f"{aborts_before} -> {aborts_after}")


# --- (b2) every other generating route, through the sidecar -----------------------------------

# name: (path, body without "model", engine requests). Bodies as vLLM 0.32 accepts them
# (tests/e2e/probe_ids.py proved each route's id format with direct abort calls).
ROUTE_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "messages stream": ("/v1/messages", {
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": LONG_TOKENS,
        "stream": True, "ignore_eos": True}, 1),
    "responses stream": ("/v1/responses", {
        "input": PROMPTS[0], "max_output_tokens": LONG_TOKENS, "stream": True,
        "ignore_eos": True, "request_id": "resp_chosen-by-client"}, 1),
    "chat batch, 2 conversations": ("/v1/chat/completions/batch", {
        "messages": [[{"role": "user", "content": PROMPTS[0]}],
                     [{"role": "user", "content": PROMPTS[1]}]],
        "max_tokens": LONG_TOKENS, "ignore_eos": True}, 2),
    "generate stream": ("/inference/v1/generate", {
        "token_ids": [5, 6, 7, 8], "stream": True,
        "sampling_params": {"max_tokens": LONG_TOKENS, "ignore_eos": True}}, 1),
    "invocations (chat body)": ("/invocations", {
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": LONG_TOKENS,
        "stream": True, "ignore_eos": True}, 1),
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
async def test_through_sidecar_every_generating_route_is_aborted(
        case: str, sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler,
        results: dict[str, Any]) -> None:
    path, body, requests = ROUTE_CASES[case]
    aborts_before = ended_by_engine(sidecar)
    client = await RawClient.post(sidecar.base_url, path, {"model": str(model_dir), **body})
    try:
        if body.get("stream"):
            await client.read_head()
            assert client.status == 200, f"expected 200 for {case}, got {client.status}"
            await client.read_events(2)
        await sampler.wait_for(lambda s: s.running == requests, guard_s=30,
                               what=f"{requests} running request(s) for {case}")
    finally:
        t0 = await client.disconnect("abort")
    await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, guard_s=20,
                           what=f"running == 0 after the client left through the sidecar ({case})")
    report = sampler.stop_report(t0)
    record(results, case, "sidecar", report, rate_before(sampler, t0))
    assert report.ms_to_idle is not None and report.ms_to_idle < STOP_GUARD_S * 1000, (
        f"expected running == 0 within {STOP_GUARD_S}s of the disconnect, got {report}")
    aborts_after = ended_by_engine(sidecar)
    assert aborts_after == aborts_before + 1, (
        f"expected the sidecar to abort exactly one request (vLLM ended it: confirmed; "
        f"re-sends are counted apart), counter went "
        f"{aborts_before} -> {aborts_after}")


# --- (c) requests that stay: byte-identical -----------------------------------------------------

SHORT = {"max_tokens": 24, "temperature": 0, "seed": 7, "ignore_eos": True}
SAME_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]},
             "chatcmpl-"),
    "completion": ("/v1/completions", {"prompt": "the lazy dog"}, "cmpl-"),
}


def _sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def _text(events: list[bytes]) -> str:
    """The generated text of a chat stream: every delta's content, joined."""
    parts = []
    for event in events:
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("case", list(SAME_CASES))
async def test_completed_request_is_byte_identical_through_sidecar(
        case: str, engine: VLLMServer, sidecar: SidecarProcess, model_dir: Path,
        http: aiohttp.ClientSession) -> None:
    """Non-streaming: identical bytes after normalising ``id``/``created``."""
    path, body, prefix = SAME_CASES[case]
    payload = {"model": str(model_dir), **SHORT, **body}
    direct_id = f"e2e-same-{uuid.uuid4().hex[:8]}"
    async with http.post(engine.base_url + path, json=payload,
                         headers={"X-Request-Id": direct_id}) as resp:
        assert resp.status == 200, f"expected 200 from vLLM, got {resp.status}"
        direct_type, direct = resp.headers["Content-Type"], await resp.read()
    async with http.post(sidecar.base_url + path, json=payload) as resp:
        assert resp.status == 200, f"expected 200 through the sidecar, got {resp.status}"
        proxied_type, proxied = resp.headers["Content-Type"], await resp.read()
        sidecar_id = resp.headers["X-Request-Id"]
    assert proxied_type == direct_type, (direct_type, proxied_type)
    assert normalise(proxied, prefix + sidecar_id) == normalise(direct, prefix + direct_id), (
        f"expected identical bodies after normalising id/created:\n direct  {direct!r}"
        f"\n sidecar {proxied!r}")


class ByteRecorder(RawServer):
    """A TCP forwarder on 127.0.0.1 in front of ``target_port`` that keeps every byte the
    target sent, per connection (``sent``), so a test can compare what vLLM wrote on the
    sidecar's connection with what the client read."""

    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self.sent: list[bytearray] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        kept = bytearray()
        self.sent.append(kept)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       keep: bytearray | None) -> None:
            try:
                while data := await src.read(65536):
                    if keep is not None:
                        keep += data
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, kept),
                             return_exceptions=True)


async def test_stream_reaches_the_client_exactly_as_vllm_sent_it(
        engine: VLLMServer, model_dir: Path, http: aiohttp.ClientSession,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A streaming chat through a sidecar whose engine connection passes a byte recorder: the
    client reads exactly the SSE bytes vLLM wrote on that connection, every event and
    ``data: [DONE]`` last. Compared with what vLLM sent for this very request, so vLLM's own
    framing (it coalesces deltas into one event when its API process falls behind) cannot make
    it differ; a direct request with the same seed must still produce the same text."""
    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                                          "stream": True}
    payload = {"model": str(model_dir), **SHORT, **body}
    recorder = ByteRecorder(int(engine.base_url.rsplit(":", 1)[1]))
    await recorder.start()
    sc = start_sidecar(f"http://127.0.0.1:{recorder.port}", tmp_path_factory.mktemp("recorded"))
    try:
        async with http.post(sc.base_url + path, json=payload) as resp:
            assert resp.status == 200, f"expected 200 through the sidecar, got {resp.status}"
            proxied = await resp.read()
            sidecar_id = resp.headers["X-Request-Id"]
        async with http.post(engine.base_url + path, json=payload) as resp:
            assert resp.status == 200, f"expected 200 from vLLM, got {resp.status}"
            direct = await resp.read()
    finally:
        status = sc.stop()
        await recorder.stop()
    assert status == 0, f"expected the sidecar to exit 0 on SIGTERM, got {status}"
    answers = [bytes(raw) for raw in recorder.sent if f"chatcmpl-{sidecar_id}".encode() in raw]
    assert len(answers) == 1, (
        f"expected one engine connection carrying chatcmpl-{sidecar_id}, got {len(answers)}")
    recorded = rawhttp.reader_of(answers[0])
    answer = await rawhttp.read_body(recorded, await rawhttp.read_head(recorded))
    assert answer.chunked and answer.ending == "complete", (
        f"expected a whole chunked stream from vLLM, got {answer.headers}, {answer.ending}")
    sent = answer.body
    differ = next((i for i, (a, b) in enumerate(zip(proxied, sent, strict=False)) if a != b),
                  None)
    assert proxied == sent, (
        f"expected the client to read exactly the {len(sent)} bytes vLLM sent, got "
        f"{len(proxied)}; first difference at byte {differ}")
    events = _sse_events(proxied)
    assert events[-1] == b"data: [DONE]" and len(events) > 3, events[-3:]
    assert _text(events) == _text(_sse_events(direct)), (
        f"expected the same generated text as a direct request:\n direct  "
        f"{_text(_sse_events(direct))!r}\n sidecar {_text(events)!r}")


async def test_x_request_id_is_the_id_vllm_used(
        engine: VLLMServer, sidecar: SidecarProcess, model_dir: Path,
        http: aiohttp.ClientSession) -> None:
    for path, body, prefix in (SAME_CASES["chat"], SAME_CASES["completion"]):
        async with http.post(sidecar.base_url + path,
                             json={"model": str(model_dir), **SHORT, **body},
                             headers={"X-Request-Id": "client-chosen"}) as resp:
            assert resp.status == 200, f"expected 200 through the sidecar, got {resp.status}"
            header = resp.headers.get("X-Request-Id")
            data = await resp.json()
        assert header and header != "client-chosen", (
            f"expected a sidecar-minted X-Request-Id, got {header!r}")
        assert data["id"] == f"{prefix}{header}", (
            f"expected vLLM's response id {prefix}{header} for {path}, got {data['id']!r}")


# --- (d) the openai SDK -------------------------------------------------------------------------

async def test_openai_sdk_streaming_chat_completes(
        sidecar: SidecarProcess, model_dir: Path) -> None:
    async with openai.AsyncOpenAI(base_url=sidecar.base_url + "/v1", api_key="x",
                                  max_retries=0, timeout=60) as client:
        stream = await client.chat.completions.create(
            model=str(model_dir), messages=[{"role": "user", "content": "hello"}],
            max_tokens=32, temperature=0, stream=True, extra_body={"ignore_eos": True})
        async with stream:
            chunks = [c async for c in stream]
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert finishes == ["length"], f"expected one finish_reason 'length', got {finishes}"
    assert text, "expected generated text in the stream"


@pytest.mark.parametrize("how", ["close the stream", "cancel the task"])
async def test_openai_sdk_abandoned_stream_is_aborted(
        how: str, sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler,
        results: dict[str, Any]) -> None:
    got_chunks = asyncio.Event()
    leave = asyncio.Event()  # set once the test saw the engine running the request

    async with openai.AsyncOpenAI(base_url=sidecar.base_url + "/v1", api_key="x",
                                  max_retries=0, timeout=60) as client:
        async def consume() -> None:
            stream = await client.chat.completions.create(
                model=str(model_dir), messages=[{"role": "user", "content": "hello"}],
                max_tokens=LONG_TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            async with stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 5:
                        got_chunks.set()
                        await leave.wait()
                        if how == "close the stream":
                            return  # leaving `async with` closes the stream

        task = asyncio.create_task(consume(), name=f"openai consumer ({how})")
        async with asyncio.timeout(30):
            await got_chunks.wait()
        await sampler.wait_for(lambda s: s.running == 1, guard_s=10, what="one running request")
        t0 = time.monotonic()
        leave.set()
        if how == "cancel the task":
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel the task" else _nothing():
            await task
        await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, guard_s=20,
                               what=f"running == 0 after the SDK client left ({how})")
    await asyncio.sleep(QUIET_S)
    report = sampler.stop_report(t0)
    record(results, f"openai SDK, {how}", "sidecar", report, rate_before(sampler, t0))
    assert report.ms_to_idle is not None and report.ms_to_idle < STOP_GUARD_S * 1000, (
        f"expected running == 0 within {STOP_GUARD_S}s after the SDK client left, got {report}")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- (e) the cancel API and deadlines on the real engine ----------------------------------------

DEADLINE_S = 1.0        # X-Sidecar-Deadline-S for the deadline tests (the default route has none)
CHAT_ID_HEAD = re.compile(  # a chat request's X-Request-Id, as the sidecar sends it upstream
    rb"POST /v1/chat/completions HTTP/1\.1\r\n(?:[^\r\n]+\r\n)*?x-request-id: *([^\r\n]+)\r\n",
    re.IGNORECASE)


class IdTap:
    """A byte relay between a sidecar and vLLM that notes the ``X-Request-Id`` of each chat
    request going upstream: the only way to learn a non-streaming request's id before its
    response head (which carries it) arrives. Bytes and closes pass through unchanged."""

    def __init__(self, engine: VLLMServer) -> None:
        self.engine = engine
        self.ids: list[str] = []
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> IdTap:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.engine.host, self.engine.port)
        seen = bytearray()

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, tap: bool) -> None:
            try:
                while data := await r.read(65536):
                    if tap:
                        seen.extend(data)
                        for m in CHAT_ID_HEAD.finditer(seen):
                            self.ids.append(m[1].decode())
                        del seen[:max((m.end() for m in CHAT_ID_HEAD.finditer(seen)),
                                      default=0)]
                    w.write(data)
                    await w.drain()
            except ConnectionError:
                pass
            finally:
                w.close()

        tasks = [asyncio.create_task(pipe(down_r, up_w, True)),
                 asyncio.create_task(pipe(up_r, down_w, False))]
        self.tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.difference_update(tasks)


async def call_cancel(sc: SidecarProcess, request_id: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(
            f"{sc.admin_url}/v1/requests/{request_id}/cancel",
            timeout=aiohttp.ClientTimeout(total=30)) as r:
        return r.status, await r.json()


async def read_to_end_of_chunked(client: RawClient, guard_s: float = 30.0) -> tuple[bytes, bool]:
    """Read the rest of a chunked body: (raw bytes, True if it ended with the last chunk
    ``0\\r\\n\\r\\n``; False if the connection ended first: a body cut short)."""
    raw = b""
    async with asyncio.timeout(guard_s):
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = await client.reader.read(65536)
            if not data:
                return raw, False
            raw += data
    return raw, True


async def read_json_body(client: RawClient, guard_s: float = 30.0) -> dict[str, Any]:
    async with asyncio.timeout(guard_s):
        body = await client.reader.readexactly(int(client.headers["content-length"]))
    data: dict[str, Any] = json.loads(body)
    return data


def last_sse_error(raw: bytes) -> dict[str, Any]:
    """The last ``data:`` event of a (still chunk-framed) SSE body, which must be an error."""
    events = re.findall(rb"data: [^\n]*", raw)
    assert events, f"expected SSE events, got {raw[-300:]!r}"
    assert b"[DONE]" not in raw, f"expected no data: [DONE] after an ending, got {raw[-300:]!r}"
    last: dict[str, Any] = json.loads(events[-1][6:])
    assert "error" in last, f"expected a final error event, got {events[-1]!r}"
    error: dict[str, Any] = last["error"]
    return error


async def assert_engine_stopped(sampler: MetricsSampler, t0: float, results: dict[str, Any],
                                case: str, what: str) -> StopReport:
    """vLLM idle within STOP_GUARD_S of ``t0``, and no token counted in the next QUIET_S."""
    await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0, guard_s=20,
                           what=f"running == 0 after {what}")
    await asyncio.sleep(QUIET_S)  # watch that no token is counted any more
    report = sampler.stop_report(t0)
    record(results, case, "sidecar", report, rate_before(sampler, t0))
    assert report.ms_to_idle is not None and report.ms_to_idle < STOP_GUARD_S * 1000, (
        f"expected running == 0 within {STOP_GUARD_S}s of {what}, got {report}")
    assert report.ms_to_last_token < STOP_GUARD_S * 1000, (
        f"expected the token counter to stop within {STOP_GUARD_S}s of {what}, got {report}")
    quiet = [s for s in sampler.snapshot() if s.t > time.monotonic() - QUIET_S]
    assert len({s.generation_tokens for s in quiet}) == 1, (
        f"expected no token counted in the last {QUIET_S}s, samples: {quiet[:2]}..{quiet[-2:]}")
    print(f"\n{case}: running == 0 {report.ms_to_idle} ms after {what}, last token at "
          f"{report.ms_to_last_token} ms, {report.tokens_after} tokens after")
    return report


async def test_cancel_api_stops_a_streaming_request_on_vllm(
        sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler,
        results: dict[str, Any]) -> None:
    """The client stays connected and keeps reading; only the cancel API stops the request
    (vLLM never sees a disconnect here: without the sidecar's abort it would go on)."""
    aborts_before = ended_by_engine(sidecar)
    client = await start_generating(sidecar.base_url, model_dir, "chat stream", sampler)
    try:
        request_id = client.headers["x-request-id"]
        reading = asyncio.create_task(read_to_end_of_chunked(client))  # the client keeps reading
        t0 = time.monotonic()
        status, answer = await call_cancel(sidecar, request_id)
        answered_ms = (time.monotonic() - t0) * 1000
        raw, ended = await reading
    finally:
        await client.disconnect("close")
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "streaming"}), (status, answer)
    assert ended, f"expected the chunked stream to end with its last chunk, got {raw[-200:]!r}"
    error = last_sse_error(raw)
    assert error["type"] == "cancelled", error
    report = await assert_engine_stopped(sampler, t0, results, "cancel API, chat stream",
                                         "the cancel call")
    print(f"cancel API answered in {answered_ms:.0f} ms; running == 0 at {report.ms_to_idle} ms")
    aborts_after = ended_by_engine(sidecar)
    assert aborts_after == aborts_before + 1, (
        f"expected exactly one successful abort call, counter went {aborts_before} -> "
        f"{aborts_after}")


async def test_cancel_api_stops_a_non_streaming_request_on_vllm(
        engine: VLLMServer, model_dir: Path, sampler: MetricsSampler, results: dict[str, Any],
        tmp_path: Path) -> None:
    """A non-streaming chat has no response head (so no ``X-Request-Id``) before it is done: a
    second sidecar talks to vLLM through :class:`IdTap`, which reads the id on its way up."""
    async with IdTap(engine) as tap:
        sc = start_sidecar(tap.url, tmp_path / "tapped-sidecar")
        try:
            client = await start_generating(sc.base_url, model_dir, "chat", sampler)
            try:
                assert len(tap.ids) == 1, f"expected one chat request seen upstream: {tap.ids}"
                t0 = time.monotonic()
                status, answer = await call_cancel(sc, tap.ids[0])
                await client.read_head()
                body = await read_json_body(client)
            finally:
                await client.disconnect("close")
            assert (status, answer) == (200, {"id": tap.ids[0], "cancelled": True,
                                              "phase": "awaiting_response"}), (status, answer)
            assert client.status == 499, f"expected 499, got {client.status}: {body}"
            assert client.headers.get("x-request-id") == tap.ids[0], client.headers
            assert body["error"]["type"] == "cancelled", body
            await assert_engine_stopped(sampler, t0, results, "cancel API, chat",
                                        "the cancel call")
            aborts = ended_by_engine(sc)
            assert aborts == 1, f"expected exactly one request ended by vLLM's abort, got {aborts}"
        finally:
            status_code = sc.stop()
        assert status_code == 0, f"expected exit 0 on SIGTERM, got {status_code}"


async def test_deadline_stops_a_streaming_request_on_vllm(
        sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler,
        results: dict[str, Any]) -> None:
    path, body, _, _ = CASES["chat stream"]
    before = sidecar_counter(sidecar, "cancel_sidecar_deadline_exceeded_total", phase="streaming")
    sent = time.monotonic()
    client = await RawClient.post(sidecar.base_url, path, long_body(model_dir, body),
                                  {"X-Sidecar-Deadline-S": str(DEADLINE_S)})
    try:
        await client.read_head()
        assert client.status == 200, f"expected 200, got {client.status}"
        await client.read_events(3)
        raw, ended = await read_to_end_of_chunked(client)  # the client keeps reading
        elapsed = time.monotonic() - sent
    finally:
        await client.disconnect("close")
    assert ended, f"expected the chunked stream to end with its last chunk, got {raw[-200:]!r}"
    assert DEADLINE_S <= elapsed < DEADLINE_S + STOP_GUARD_S, (
        f"expected the stream to end {DEADLINE_S}s after the request (guard {STOP_GUARD_S}s), "
        f"got {elapsed:.3f}s")
    error = last_sse_error(raw)
    assert error["type"] == "deadline_exceeded", error
    generating = [s for s in sampler.snapshot() if sent < s.t < sent + DEADLINE_S]
    assert any(s.running == 1 for s in generating), (
        f"expected vLLM to run the request before the deadline, samples: {generating[-3:]}")
    report = await assert_engine_stopped(sampler, sent + DEADLINE_S, results,
                                         "deadline 1 s, chat stream", "the deadline")
    print(f"deadline {DEADLINE_S}s: the stream ended at {elapsed * 1000:.0f} ms; running == 0 "
          f"{report.ms_to_idle} ms after the deadline")
    after = sidecar_counter(sidecar, "cancel_sidecar_deadline_exceeded_total", phase="streaming")
    assert after == before + 1, f"expected one streaming deadline counted: {before} -> {after}"


async def test_deadline_stops_a_non_streaming_request_on_vllm(
        sidecar: SidecarProcess, model_dir: Path, sampler: MetricsSampler,
        results: dict[str, Any]) -> None:
    path, body, _, _ = CASES["chat"]
    sent = time.monotonic()
    client = await RawClient.post(sidecar.base_url, path, long_body(model_dir, body),
                                  {"X-Sidecar-Deadline-S": str(DEADLINE_S)})
    try:
        await client.read_head()
        elapsed = time.monotonic() - sent
        answer = await read_json_body(client)
    finally:
        await client.disconnect("close")
    assert client.status == 504, f"expected 504, got {client.status}: {answer}"
    assert answer["error"]["type"] == "deadline_exceeded", answer
    assert DEADLINE_S <= elapsed < DEADLINE_S + STOP_GUARD_S, (
        f"expected the 504 {DEADLINE_S}s after the request (guard {STOP_GUARD_S}s), "
        f"got {elapsed:.3f}s")
    generating = [s for s in sampler.snapshot() if sent < s.t < sent + DEADLINE_S]
    assert any(s.running == 1 for s in generating), (
        f"expected vLLM to run the request before the deadline, samples: {generating[-3:]}")
    report = await assert_engine_stopped(sampler, sent + DEADLINE_S, results,
                                         "deadline 1 s, chat", "the deadline")
    print(f"deadline {DEADLINE_S}s: 504 at {elapsed * 1000:.0f} ms; running == 0 "
          f"{report.ms_to_idle} ms after the deadline")
