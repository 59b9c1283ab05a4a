"""Tokens a real vLLM engine generates after a client disconnects: direct versus via the sidecar.

For the report: on the e2e suite's real vLLM 0.32 engine (CPU build, small random Llama, one
stream decoding ~110-380 tokens/s on this shared 2-core box), behind a middleware that hides
client disconnects from vLLM, a client reads 64 tokens of a streaming chat and resets its
connection. Straight to vLLM the engine generates on to ``max_tokens`` for nobody (capped at
``DIRECT_MAX_TOKENS`` = 1024 here, so the direct figure is "all that was left", bounded by the
cap); through the sidecar it accepts 0-2 more tokens in most runs. "Tokens generated after the
disconnect" are output tokens vLLM's scheduler accepted for the request after the client's close
instant, counted inside the engine core, so tokens generated before the close but still on their
way to the client are not waste. Measured 2026-11-29 over 30 sidecar runs: median 1, 25 runs <=
5 (the target); 3 runs got 8-21 tokens because vLLM's API process answered the abort call 24-65
ms late under CPU contention, one got 6 (its detail was lost), and one got 742 after an
unexplained 2.4 s gap between the sidecar noticing the close and its call leaving (not seen
again in 25 runs); otherwise the sidecar's call leaves within ~2 ms of the close (median 0.4
ms).

Method (``run``): one vLLM server (``tests.harness.e2e.vllm_server``,
``HideDisconnectMiddleware``, the ``E2E_MODEL_KWARGS`` model), one sidecar CLI subprocess
(``tests.harness.e2e.sidecar_process``), a raw client (``tests.harness.e2e.measure.RawClient``) that
resets its connection once vLLM's ``continuous_usage_stats`` say it has received 64 tokens, and
``MetricsSampler`` polling ``/metrics`` every 10 ms (``stop_ms_sidecar``: close ->
``vllm:num_requests_running`` == 0). vLLM's own counter cannot give the figure:
``vllm:generation_tokens_total`` is counted in the API process, which skips every output of a
request once it has handled its abort (``v1/engine/output_processor.py`` lines 712-715, "Ignore
output for already-aborted request"), while the engine core goes on stepping until the ABORT message
reaches it; and the client's own count lags the engine by up to ~450 tokens when the box is loaded.
So the vLLM processes get probes through a generated ``sitecustomize`` (on the ``PYTHONPATH`` of the
vLLM subprocess only; no vLLM file changes): the engine core logs ``(time, request id, output
tokens)`` after every ``Scheduler.update_from_output``, each ABORT reaching its input thread, and
each ``Scheduler.finish_requests``; the API process logs when ``AsyncLLM.abort`` starts. Times are
``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process on the machine), so they line up
with the client's close and with the sidecar's log lines (wall clock, ms, converted).

The chain after the close (``chain_ms`` of each trial; vLLM 0.32 source under
``site-packages/vllm``), and what bounds the sidecar figure:

1. the sidecar notices the reset and queues the abort (~0 ms), sends the call (0.0-2.3 ms);
2. vLLM's API process answers 200 *before* it aborts anything
   (``entrypoints/scale_out/token_in_token_out/api_router.py`` line 97,
   ``asyncio.create_task(engine_client(raw_request).abort(request_ids))``);
3. ``AsyncLLM.abort`` (``v1/engine/async_llm.py`` lines 911-919) drops the request from the
   output processor (the counter stops here) and sends ABORT over ZMQ
   (``v1/engine/core_client.py`` line 1301);
4. the engine core's input thread puts it on ``aborts_queue`` (``v1/engine/core.py`` line 1928);
   the busy loop applies it right before the current step's output is accepted (``core.py``
   lines 678-682: ``_process_aborts_queue()``, then ``update_from_output``), so the step in
   flight yields no token;
5. ``vllm:num_requests_running`` reads 0 at ``/metrics`` 20-120 ms after the close (metric
   publication plus the poll; not the engine).

A token counts against the sidecar only when a step *ends* between the close and step 4; a step
is ~2.5-8 ms here (one token per step: ``platforms/cpu.py`` line 331 turns async scheduling off
on CPU). So the figure is about (close -> step 4) / step time. The sidecar's share of that is
< ~2 ms; the rest, typically 3-15 ms and up to ~70 ms, is vLLM's HTTP handler, background task
and ZMQ hop, in an API process that shares one core with the sidecar, this client and its
``/metrics`` poller (vLLM binds its compute threads to the other core,
``utils/ompmultiprocessing.py``).

Run: ``flock /tmp/bench.lock /work/main/.venv/bin/python -m bench.vllm_waste [--quick]``
(full: 5 runs each way, ~2 min including vLLM's start; quick: 1 each way, ~1 min).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.machinery
import itertools
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

PROBE_ENV = "BENCH_VLLM_PROBE_FILE"
REPO = Path(__file__).resolve().parents[1]

READ_TOKENS = 64           # tokens the client reads before it leaves (~0.25 s at 250 tokens/s)
RATE_FROM_TOKEN = 16       # the decode rate is measured from this token to the close
DIRECT_MAX_TOKENS = 1024   # cap of the direct runs: vLLM generates until here for nobody
SIDECAR_MAX_TOKENS = 4000  # never reached through the sidecar (~16 s)
QUIET_S = 0.5              # after running == 0, watch this long that nothing more is counted
FULL_RUNS, QUICK_RUNS = 5, 1


# --- probes, installed in the vLLM processes by the generated sitecustomize ---------------------

def install_probes() -> None:
    """Patch vLLM classes as they are imported (this process and its children) to append JSON
    lines to the file named by ``$BENCH_VLLM_PROBE_FILE``: ``step`` (per scheduled request after
    each engine step: ``id`` internal request id, ``n`` output tokens so far),
    ``abort_received`` (the engine core's input thread got an ABORT message), ``finish``
    (``Scheduler.finish_requests``: ids, status, output tokens) and ``api_abort``
    (``AsyncLLM.abort`` entered, external ids). ``t`` is ``time.monotonic()`` seconds."""
    path = os.environ[PROBE_ENV]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "t": time.monotonic(), "pid": os.getpid(), **fields})
        os.write(fd, line.encode() + b"\n")  # O_APPEND: one atomic write per line

    def patch_scheduler(module: ModuleType) -> None:
        cls = module.Scheduler
        update, finish = cls.update_from_output, cls.finish_requests

        def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            reqs = [self.requests.get(i) for i in scheduler_output.num_scheduled_tokens]
            out = update(self, scheduler_output, model_runner_output)
            for req in reqs:
                if req is not None:
                    emit("step", id=req.request_id, n=req.num_output_tokens)
            return out

        def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            emit("finish", ids=ids, status=str(finished_status),
                 n=[getattr(self.requests.get(i), "num_output_tokens", None) for i in ids])
            return finish(self, ids, finished_status)

        cls.update_from_output, cls.finish_requests = update_from_output, finish_requests

    def patch_async_llm(module: ModuleType) -> None:
        cls = module.AsyncLLM
        abort = cls.abort

        async def abort_probe(self: Any, request_id: Any, internal: bool = False) -> None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            emit("api_abort", ids=ids, internal=internal)
            await abort(self, ids, internal)

        cls.abort = abort_probe

    class AbortsQueue(queue.Queue):  # type: ignore[type-arg]
        def put_nowait(self, item: Any) -> None:
            emit("abort_received", ids=list(item) if not isinstance(item, str) else [item])
            super().put_nowait(item)

    def patch_engine_core(module: ModuleType) -> None:
        cls = module.EngineCore
        init = cls.__init__

        def init_probe(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.aborts_queue = AbortsQueue()  # the input thread puts every ABORT here

        cls.__init__ = init_probe

    sys.meta_path.insert(0, _PatchOnImport({
        "vllm.v1.engine.core": patch_engine_core,
        "vllm.v1.core.sched.scheduler": patch_scheduler,
        "vllm.v1.engine.async_llm": patch_async_llm,
    }))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Run ``patches[name](module)`` right after module ``name`` is executed."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self._patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


SITECUSTOMIZE = f"""\
import os
if os.environ.get({PROBE_ENV!r}):
    from bench.vllm_waste import install_probes
    install_probes()
"""


def read_probes(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.startswith("{")]


# --- one run -------------------------------------------------------------------------------------

@dataclass
class Trial:
    """One abandoned request. Times in ms from the client's close; None: not seen."""

    kind: str                      # "direct" or "sidecar"
    received: int = 0              # tokens the client had received at the close (vLLM's usage)
    events: int = 0                # SSE events they came in (fewer: vLLM merged deltas)
    client_rate: float = 0.0       # tokens/s the client received before leaving
    engine_rate: float = 0.0       # tokens/s the engine accepted for the request before the close
    at_close: int = 0              # output tokens the engine had accepted at the close instant
    at_end: int = 0                # output tokens when the request left the scheduler
    after_close: int = 0           # at_end - at_close: the figure
    counter_after_close: int = 0   # settled generation_tokens_total delta - at_close
    stop_ms: float | None = None   # /metrics: first sample with running == waiting == 0
    chain_ms: dict[str, float | None] = field(default_factory=dict)
    sidecar_log: list[str] = field(default_factory=list)


async def _trial(kind: str, base_url: str, model: Path, engine: Any, probes: Path,
                 sidecar: Any | None, interval: float) -> Trial:
    from demo.__main__ import settled_tokens
    from tests.harness.e2e.measure import MetricsSampler, RawClient

    max_tokens = DIRECT_MAX_TOKENS if kind == "direct" else SIDECAR_MAX_TOKENS
    body = {"model": str(model), "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    before = await settled_tokens(engine)
    probe_mark = len(read_probes(probes))
    log_mark = len(sidecar.log_text()) if sidecar is not None else 0
    trial = Trial(kind)
    with MetricsSampler(engine.base_url, interval=interval) as sampler:
        client = await RawClient.post(base_url, "/v1/chat/completions", body)
        arrivals: list[tuple[float, int]] = []  # (monotonic s, completion tokens received)
        try:
            await client.read_head()
            assert client.status == 200, f"expected 200 from {base_url}, got {client.status}"
            # stop_report needs a sample from before the close (the first one can be slow)
            await sampler.wait_for(lambda s: s.running >= 1, 30, "a running request")
            while not arrivals or arrivals[-1][1] < READ_TOKENS:
                (event,) = await client.read_events(1)
                tokens = _completion_tokens(event)
                if tokens:
                    arrivals.append((time.monotonic(), tokens))
        finally:
            wall0 = time.time()
            t0 = await client.disconnect("abort")
        await sampler.wait_for(lambda s: s.running == 0 and s.waiting == 0,
                               60 if kind == "direct" else 20, f"an idle engine ({kind})")
        await asyncio.sleep(QUIET_S)
        report = sampler.stop_report(t0)
    settled = await settled_tokens(engine)
    trial.received = arrivals[-1][1]
    trial.events = len(arrivals)
    first = next(a for a in arrivals if a[1] >= RATE_FROM_TOKEN)
    span = arrivals[-1][0] - first[0]
    trial.client_rate = (arrivals[-1][1] - first[1]) / span if span > 0 else 0.0
    trial.stop_ms = report.ms_to_idle
    chain = trial.chain_ms
    chain["running_0_at_metrics"] = report.ms_to_idle
    chain["last_counter_increase"] = report.ms_to_last_token

    _engine_view(trial, read_probes(probes)[probe_mark:], t0)
    trial.counter_after_close = int(settled - before) - trial.at_close
    if sidecar is not None:
        found = _sidecar_chain(sidecar.log_text()[log_mark:], wall0)
        trial.sidecar_log = found.pop("sidecar_log")
        chain.update(found)
    return trial


def _engine_view(trial: Trial, events: list[dict[str, Any]], t0: float) -> None:
    """Fill ``trial`` from the probe lines written during it (see :func:`install_probes`)."""
    chain = trial.chain_ms
    steps = [e for e in events if e["ev"] == "step"]
    ids = {e["id"] for e in steps}
    assert len(ids) == 1, f"expected one request in the engine during the trial, saw {ids}"
    before_close = [e for e in steps if e["t"] <= t0]
    after = [e for e in steps if e["t"] > t0]
    trial.at_close = before_close[-1]["n"] if before_close else 0
    trial.at_end = steps[-1]["n"]
    trial.after_close = trial.at_end - trial.at_close
    trial.engine_rate = _engine_rate(before_close)
    chain["last_token_in_engine"] = _ms(after[-1]["t"] - t0) if after else 0.0
    api = next((e for e in events if e["ev"] == "api_abort"), None)
    finish = next((e for e in events if e["ev"] == "finish"), None)
    chain["vllm_api_abort_task"] = _ms(api["t"] - t0) if api else None
    received = next((e for e in events if e["ev"] == "abort_received"), None)
    chain["engine_core_abort_received"] = _ms(received["t"] - t0) if received else None
    chain["engine_core_abort_applied"] = _ms(finish["t"] - t0) if finish else None
    chain["last_step_before_close"] = _ms(before_close[-1]["t"] - t0) if before_close else None
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(before_close[-20:])]
    chain["step_interval_before_close"] = _ms(statistics.median(gaps)) if gaps else None


def _engine_rate(steps: list[dict[str, Any]]) -> float:
    """Tokens/s the engine accepted for one request, from token ``RATE_FROM_TOKEN`` on (past
    the prefill and the first, slower steps); 0.0 if too few steps."""
    window = [e for e in steps if e["n"] >= RATE_FROM_TOKEN]
    if len(window) < 2 or window[-1]["t"] <= window[0]["t"]:
        return 0.0
    tokens: int = window[-1]["n"] - window[0]["n"]
    seconds: float = window[-1]["t"] - window[0]["t"]
    return tokens / seconds


async def _unobserved_rate(model: Path, engine: Any, probes: Path) -> float:
    """The engine's decode rate for one stream with nobody polling ``/metrics`` and the client
    reading the whole stream (``DIRECT_MAX_TOKENS`` tokens): what the engine does when the
    measurement does not share its 2 cores."""
    from tests.harness.e2e.measure import RawClient

    mark = len(read_probes(probes))
    body = {"model": str(model), "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": DIRECT_MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    client = await RawClient.post(engine.base_url, "/v1/chat/completions", body)
    try:
        await client.read_head()
        async with asyncio.timeout(60):
            while (line := await client.reader.readline()) and b"[DONE]" not in line:
                pass
    finally:
        await client.disconnect("close")
    return _engine_rate([e for e in read_probes(probes)[mark:] if e["ev"] == "step"])


def _completion_tokens(event: bytes) -> int:
    """``usage.completion_tokens`` of an SSE chat event (vLLM adds it to every event with
    ``stream_options.continuous_usage_stats``): the tokens the client has received so far, also
    when vLLM's API process, falling behind, merged several tokens into one event. 0: none."""
    if not event.startswith(b"data: {"):
        return 0
    return int((json.loads(event[6:]).get("usage") or {}).get("completion_tokens") or 0)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _sidecar_chain(log: str, wall0: float) -> dict[str, Any]:
    """From the sidecar's JSON log (wall clock, ms resolution): when it noticed the disconnect
    (its "upstream closed, aborting" line), when the abort call went out and was answered (the
    "engine ... aborted ... in X ms" line: its time minus X), ms after the close at ``wall0``;
    ``sidecar_log``: the trial's log lines (not the access line), as "+MS ms LEVEL message"."""
    out: dict[str, Any] = {"sidecar_noticed": None, "abort_call_sent": None,
                           "abort_call_answered": None, "sidecar_log": []}
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ts = datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).timestamp()
        msg = rec.get("msg", "")
        if msg != "request":  # the access line's fields are in the metrics already
            out["sidecar_log"].append(f"{_ms(ts - wall0):+.0f} ms {rec['level']} {msg}")
        if "upstream closed, aborting" in msg and out["sidecar_noticed"] is None:
            out["sidecar_noticed"] = _ms(ts - wall0)
        elif (msg.startswith("engine ") and " aborted " in msg
              and out["abort_call_answered"] is None):
            took = float(msg.split(" in ")[1].split(" ms")[0])
            answered = out["abort_call_answered"] = _ms(ts - wall0)
            out["abort_call_sent"] = round(answered - took, 2)
    return out


async def _measure(model: Path, engine: Any, sidecar: Any, probes: Path, runs: int,
                   interval: float, say: Callable[[str], None]) -> tuple[float, list[Trial]]:
    unobserved = await _unobserved_rate(model, engine, probes)
    say(f"decode rate, one stream, nobody polling /metrics: {unobserved:.0f} tokens/s")
    trials = []
    for i in range(runs):
        for kind, url, sc in (("direct", engine.base_url, None),
                              ("sidecar", sidecar.base_url, sidecar)):
            trial = await _trial(kind, url, model, engine, probes, sc, interval)
            say(f"run {i + 1}/{runs} {kind}: {trial.after_close} tokens after the close "
                f"({trial.engine_rate:.0f} tokens/s, stop {trial.stop_ms} ms)")
            trials.append(trial)
    return unobserved, trials


def run(quick: bool = False, say: Callable[[str], None] | None = None,
        metrics_interval: float = 0.01) -> dict[str, Any]:
    """Start vLLM (real engine, CPU, disconnect-hiding middleware) and the sidecar CLI, abandon
    ``runs`` streams each way, stop everything (also on errors and Ctrl-C), return the figures:
    ``tokens_per_s`` (median engine decode rate of one stream before the close), ``direct`` and
    ``sidecar`` (tokens after the close, per run), ``stop_ms_sidecar`` (close ->
    ``vllm:num_requests_running`` == 0 at ``/metrics``), ``runs``, ``notes``, and ``detail``
    (every trial, with its chain of events in ms after the close).

    Raises ``RuntimeError`` if vLLM or the sidecar does not start, ``AssertionError`` if the engine
    does not behave as expected (e.g. does not go idle)."""
    from tests.harness.e2e.sidecar_process import start_sidecar
    from tests.harness.e2e.tiny_model import E2E_MODEL_KWARGS, build_tiny_model
    from tests.harness.e2e.vllm_server import (
        HIDE_DISCONNECT_MIDDLEWARE,
        REPO_ROOT,
        start_vllm_server,
    )

    say = say or (lambda msg: None)
    runs = QUICK_RUNS if quick else FULL_RUNS
    engine = sidecar = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-waste-") as tmp_dir:
            tmp = Path(tmp_dir)
            (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
            probes = tmp / "probes.jsonl"
            say("building the e2e model under tests/e2e/.cache (once)")
            model = build_tiny_model(REPO / "tests/e2e/.cache/e2e-llama-8k", **E2E_MODEL_KWARGS)
            say("starting vLLM (~30-60 s)")
            engine = start_vllm_server(
                model, max_model_len=8192, log_path=tmp / "vllm.log",
                middleware=[HIDE_DISCONNECT_MIDDLEWARE],
                extra_env={PROBE_ENV: str(probes),
                           "PYTHONPATH": os.pathsep.join((str(tmp), str(REPO_ROOT)))})
            say(f"vLLM up in {engine.start_seconds:.0f} s; starting the sidecar")
            sidecar = start_sidecar(engine.base_url, tmp / "sidecar")
            assert read_probes(probes), "expected probe lines from vLLM (sitecustomize not loaded?)"
            unobserved, trials = asyncio.run(
                _measure(model, engine, sidecar, probes, runs, metrics_interval, say))
    finally:
        if sidecar is not None:
            sidecar.stop()
        if engine is not None:
            engine.stop()
    direct = [t for t in trials if t.kind == "direct"]
    through = [t for t in trials if t.kind == "sidecar"]
    return {
        "tokens_per_s": round(statistics.median(t.engine_rate for t in trials), 1),
        "direct": [t.after_close for t in direct],
        "sidecar": [t.after_close for t in through],
        "stop_ms_sidecar": [t.stop_ms for t in through],
        "runs": runs,
        "notes": _notes(metrics_interval),
        "tokens_per_s_unobserved": round(unobserved, 1),
        "metrics_interval_s": metrics_interval,
        "detail": [asdict(t) for t in trials],
    }


def _notes(interval: float) -> str:
    return (
        f"Real vLLM 0.32 (CPU build) serving the e2e suite's random Llama (hidden 512, 4 layers, "
        f"float32) on a 2-core box shared with other jobs, behind a middleware that hides client "
        f"disconnects from vLLM; one streaming chat at a time; the client resets its connection "
        f"once vLLM's continuous usage stats say it has received {READ_TOKENS} tokens. 'Tokens "
        f"after the disconnect' = output tokens vLLM's scheduler accepted for the request after "
        f"the client's close instant, from a probe in the engine core (count after every step, "
        f"CLOCK_MONOTONIC shared with the client): tokens generated before the close but still "
        f"in flight to the client are not waste; a step that ends after the close counts "
        f"against the sidecar even if it began before. Direct runs are capped at max_tokens="
        f"{DIRECT_MAX_TOKENS}: there the figure is the cap minus what the engine had generated "
        f"at the close (the client can lag the engine by hundreds of tokens on a loaded box, "
        f"which lowers it), not a property of vLLM. vllm:generation_tokens_total cannot give "
        f"the figure: it stops counting a request once the API process has handled its abort, "
        f"before the engine core has (detail: counter_after_close). tokens_per_s: median over "
        f"all trials of the engine's decode rate for the stream before the close; it varies "
        f"~2x between runs with the load on the box. stop_ms_sidecar: from /metrics polled every "
        f"{interval * 1000:.0f} ms (tens of ms late). Sidecar log times have ms resolution."
    )


# --- CLI ------------------------------------------------------------------------------------------

CHAIN_ORDER = (
    "step_interval_before_close",   # the engine's step time (1 token per step)
    "last_step_before_close",       # the engine accepted its last pre-close token here
    "sidecar_noticed",              # sidecar log, ms resolution (can read up to 1 ms early)
    "abort_call_sent",              # sidecar log: answered minus the call's own duration
    "abort_call_answered",          # sidecar log: vLLM's empty 200
    "vllm_api_abort_task",          # vLLM API process: AsyncLLM.abort starts (background task)
    "engine_core_abort_received",   # engine core input thread: ABORT message in
    "engine_core_abort_applied",    # Scheduler.finish_requests: the request leaves the batch
    "last_token_in_engine",         # last token accepted after the close (0: none)
    "last_counter_increase",        # /metrics: vllm:generation_tokens_total stops
    "running_0_at_metrics",         # /metrics: vllm:num_requests_running == 0
)


def format_table(result: dict[str, Any]) -> str:
    rows = [("run", "direct", "sidecar", "sidecar stop ms", "tokens/s")]
    through = [t for t in result["detail"] if t["kind"] == "sidecar"]
    for i, (d, s, ms, t) in enumerate(zip(result["direct"], result["sidecar"],
                                          result["stop_ms_sidecar"], through, strict=True)):
        rows.append((str(i + 1), str(d), str(s), str(ms), f"{t['engine_rate']:.0f}"))
    chains = [t["chain_ms"] for t in result["detail"] if t["kind"] == "sidecar"]
    lines = [f"tokens generated after the disconnect (real vLLM, {result['tokens_per_s']:.0f} "
             f"tokens/s for one stream)"]
    lines += ["  ".join(c.rjust(16) for c in r) for r in rows]
    lines.append("sidecar chain, ms after the client's close (median over runs):")
    for key in CHAIN_ORDER:
        values = [c[key] for c in chains if c.get(key) is not None]
        if values:
            lines.append(f"  {key:24} {statistics.median(values):8.1f}   "
                         f"(runs: {', '.join(f'{v:.1f}' for v in values)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_waste", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 run each way instead of 5")
    parser.add_argument("--metrics-interval", type=float, default=0.01, metavar="S",
                        help="seconds between /metrics polls during a trial (default 0.01)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))

    def say(msg: str) -> None:
        print(f"[vllm_waste {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        result = run(quick=args.quick, say=say, metrics_interval=args.metrics_interval)
    except KeyboardInterrupt:
        say("interrupted; every process stopped")
        return 130
    print(json.dumps(result, indent=2))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
