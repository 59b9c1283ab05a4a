"""Real vLLM: a client that resets 0-50 ms after its last body byte leaves nothing running
(issue 11, "Guaranteed abort").

Why it can fail: vLLM 0.32 learns a request's external id only in ``AsyncLLM.add_request``
(``v1/engine/async_llm.py``), after rendering the chat template and tokenizing the prompt(s); an
abort naming an id it does not know yet is dropped silently (``v1/engine/output_processor.py``,
``abort_requests``) and still answered 200. Behind :class:`HideDisconnectMiddleware` vLLM never
notices that the client left, so a request whose one abort came too early generates to
``max_tokens`` for nobody. The sidecar re-sends the ids while the engine may still be registering
them (``engines.NAME.abort.resend_window_s`` after it sent the body upstream).

Setup, once per module: the tiny model (``E2E_MODEL_KWARGS``, 8k context); one vLLM with
``--enable-scale-out``, the disconnect-hiding middleware and ``VLLM_SERVER_DEV_MODE=1``, the last
only for this test's own clean-up: after a case leaked, ``POST /abort_requests`` with no ids
(dev mode: abort everything) lets the next case start on an idle engine; the sidecar's CLI in
front with the default abort settings.

Cases: streaming chat and JSON chat with a ~3,500-token prompt, a streaming completion of four
~1,500-token prompts (four engine ids); each reset 0, 1, 5, 15, 50 and 100 ms after the last
body byte, one case at a time; then twice 15 clients at once (each kind 5 times), reset 0-260 ms
after their bodies. Every prompt is new (random words),
so vLLM's prefix cache never shortens a prefill. A client is a blocking socket in its own
thread: it sends head and body, waits until its kernel reports every byte acknowledged
(``TIOCOUTQ`` == 0: "the last body byte" is in the sidecar's kernel), sleeps the delay and closes
with ``SO_LINGER`` 0, which sends a RST.

Proof, from vLLM's own ``GET /metrics`` (sampled every 10 ms by :class:`MetricsSampler`): from
when the re-send window closes, within ``GUARD_S``, ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` are 0 and ``vllm:generation_tokens_total`` stays the same for
``QUIET_S``. Per-case figures are printed as a table at the end of the module (also without
``-s``) and written to a JSON file whose path is printed.
"""

from __future__ import annotations

import fcntl
import json
import random
import socket
import struct
import termios
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from sidecar.config import AbortSettings
from tests.e2e.test_vllm_e2e import (  # model_dir: the same fixture (and model build)
    model_dir,
    running_engine,
    running_sidecar,
    sidecar_counter,
)
from tests.harness.e2e.measure import MetricsSampler, Sample
from tests.harness.e2e.sidecar_process import SidecarProcess, start_sidecar
from tests.harness.e2e.vllm_server import VLLMServer, read_metrics

__all__ = ["model_dir"]  # a fixture shared with tests/e2e/test_vllm_e2e.py

# No reruns (the other e2e modules allow two): a rerun that passes would hide an intermittent
# leak, which is exactly what this module looks for. Every wait has its own guard instead.
# The first test's timeout includes the engine start (STARTUP_S at most).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
STARTUP_S = 600.0   # ~40 s on an idle 2-core box; minutes when other jobs share it

# The window the sidecar re-sends in, from its own defaults (the module runs the default config).
RESEND_WINDOW_S: float = AbortSettings.model_fields["resend_window_s"].default
GUARD_S = 5.0       # after the window closed, nothing may run or wait later than this
QUIET_S = 1.0       # ... and from then on no token may be counted for this long
MAX_TOKENS = 4000   # a missed abort runs ~20 s or more here: plainly visible
CHAT_WORDS = 3500   # ~1 token per word with the tiny model's tokenizer (checked below)
COMPLETION_WORDS = 1500
COMPLETION_PROMPTS = 4
DELAYS_MS = (0, 1, 5, 15, 50, 100)
# A burst's 15 clients (kinds in turn) reset this long after their bodies. Wider than DELAYS_MS:
# with 15 bodies at once the sidecar may still be sending bodies upstream 150 ms later on a busy
# box (seen: all 15 resets of 0-70 ms landed while it was, so the engine never had a whole
# body); the later ones land while vLLM tokenizes the 15 prompts.
BURST_DELAYS_MS = (0, 5, 10, 15, 25, 35, 50, 65, 80, 100, 120, 150, 180, 220, 260)
BURSTS = 2
MIN_CHAT_TOKENS = 3000
MIN_COMPLETION_TOKENS = 1200

_WORDS = ("the a engine request client server proxy abort cancel stream token model tiny llama "
          "sidecar chat completion prompt reply user assistant hello world quick brown fox jumps "
          "over lazy dog data time run stop start wait fast slow one two three four five six "
          "seven eight nine ten and or but if then else while for with from into about").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass(frozen=True)
class Kind:
    path: str
    engine_requests: int
    body: Callable[[random.Random], dict[str, Any]]


KINDS: dict[str, Kind] = {
    "chat stream": Kind("/v1/chat/completions", 1, lambda rng: {
        "messages": [{"role": "user", "content": words(rng, CHAT_WORDS)}], "stream": True}),
    "chat JSON": Kind("/v1/chat/completions", 1, lambda rng: {
        "messages": [{"role": "user", "content": words(rng, CHAT_WORDS)}]}),
    f"completion {COMPLETION_PROMPTS} prompts": Kind(
        "/v1/completions", COMPLETION_PROMPTS, lambda rng: {
            "prompt": [words(rng, COMPLETION_WORDS) for _ in range(COMPLETION_PROMPTS)],
            "stream": True}),
}
CASES = [(kind, delay) for kind in KINDS for delay in DELAYS_MS]
BURST_CASES = [(list(KINDS)[i % len(KINDS)], delay) for i, delay in enumerate(BURST_DELAYS_MS)]


def request_body(model: Path, kind: str) -> dict[str, Any]:
    """A fresh body of ``kind`` (new random words: no prefix-cache hit), generating long."""
    rng = random.Random(uuid.uuid4().int)
    return {"model": str(model), "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, **KINDS[kind].body(rng)}


# --- the client -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reset:
    """One client: the body was acknowledged at ``sent_at``, the RST went at ``reset_at``
    (``time.monotonic()`` seconds)."""

    kind: str
    delay_ms: int
    sent_at: float
    reset_at: float

    @property
    def actual_delay_ms(self) -> float:
        return (self.reset_at - self.sent_at) * 1000


def _unacked_bytes(sock: socket.socket) -> int:
    """Bytes in the socket's send queue, sent or not, that the peer has not acknowledged."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    value: int = struct.unpack("i", buf)[0]
    return value


def send_and_reset(base_url: str, kind: str, body: dict[str, Any], delay_ms: int,
                   start: threading.Barrier | None = None, guard_s: float = 10.0) -> Reset:
    """POST ``body`` on a new connection, then reset the connection ``delay_ms`` after the
    peer's kernel acknowledged its last byte. ``start``: wait there (all clients of a burst)
    between connecting and sending."""
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None, base_url
    payload = json.dumps(body).encode()
    head = (f"POST {KINDS[kind].path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=guard_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if start is not None:
            start.wait(timeout=guard_s)
        sock.sendall(head + payload)
        deadline = time.monotonic() + guard_s
        while (unacked := _unacked_bytes(sock)) > 0:
            assert time.monotonic() < deadline, (
                f"expected the sidecar's kernel to acknowledge the body within {guard_s}s, "
                f"{unacked} bytes still unacknowledged")
            time.sleep(0.0001)
        sent_at = time.monotonic()
        if delay_ms:
            time.sleep(max(0.0, sent_at + delay_ms / 1000 - time.monotonic()))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset_at = time.monotonic()
    finally:
        sock.close()  # with SO_LINGER 0: RST
    return Reset(kind, delay_ms, sent_at, reset_at)


# --- what the engine did ------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """vLLM's /metrics after the resets of one case (or one burst).

    ``tokens_after``: generation tokens counted after the (last) reset, until the engine settled
    (or, for a leak, until the guard ran out). ``ms_to_idle``: from the (last) reset to the first
    sample after the last one with anything running or waiting (None: nothing seen running after
    the reset). ``peak``: most requests running + waiting seen after the reset. ``left``: running +
    waiting when the guard ran out (0 unless it leaked).
    """

    leaked: bool
    tokens_after: int
    ms_to_idle: float | None
    peak: int
    left: int
    settled_s: float  # from the (last) reset to the start of the quiet period
    abort_calls: int = 0  # the sidecar's abort calls for the case (informative only)
    tracked: int = 0  # requests vLLM still tracked after the quiet period (see sweep())
    sidecar_phase: str = ""  # where the sidecar's access lines say it stopped (informative)


def busy(s: Sample) -> bool:
    return s.running > 0 or s.waiting > 0


def watch(sampler: MetricsSampler, reset_at: float, window_closes: float) -> Outcome:
    """Wait until, from some instant at least ``window_closes``, vLLM shows nothing running or
    waiting and no new token for ``QUIET_S``; that instant must come before ``window_closes +
    GUARD_S`` (else: a leak)."""
    deadline = window_closes + GUARD_S
    while True:
        samples = sampler.snapshot()
        after = [s for s in samples if s.t > reset_at]
        quiet_from = _quiet_from(after, window_closes)
        last = after[-1] if after else None
        if quiet_from is not None and last is not None and last.t - quiet_from.t >= QUIET_S:
            return _outcome(samples, reset_at, leaked=False, settled=quiet_from)
        if time.monotonic() > deadline + QUIET_S + 0.5:
            return _outcome(samples, reset_at, leaked=True, settled=last)
        time.sleep(0.05)


def _quiet_from(after: list[Sample], window_closes: float) -> Sample | None:
    """The first sample at or after ``window_closes`` from which every later sample is idle and
    has the same token count (None: the latest sample is busy or none is that late)."""
    quiet: Sample | None = None
    for prev, s in zip([None, *after], after, strict=False):
        moved = prev is not None and s.generation_tokens != prev.generation_tokens
        if busy(s) or moved or s.t < window_closes:
            quiet = None
        elif quiet is None:
            quiet = s
    return quiet


def _outcome(samples: list[Sample], reset_at: float, *, leaked: bool,
             settled: Sample | None) -> Outcome:
    before = [s for s in samples if s.t <= reset_at]
    after = [s for s in samples if s.t > reset_at]
    assert before and after, f"expected /metrics samples around the reset, got {samples[-3:]}"
    end = settled if settled is not None else after[-1]
    last_busy = max((i for i, s in enumerate(after) if busy(s) and s.t <= end.t), default=None)
    idle_at = None if last_busy is None or last_busy + 1 >= len(after) else after[last_busy + 1]
    return Outcome(
        leaked=leaked,
        tokens_after=int(end.generation_tokens - before[-1].generation_tokens),
        ms_to_idle=None if idle_at is None else round((idle_at.t - reset_at) * 1000, 1),
        peak=int(max(s.running + s.waiting for s in after)),
        left=int(after[-1].running + after[-1].waiting) if leaked else 0,
        settled_s=round(end.t - reset_at, 2),
    )


def sweep(engine: VLLMServer) -> int:
    """vLLM dev mode's ``POST /abort_requests`` without ids: abort every request vLLM's API
    process still tracks (``output_processor.request_states``, ``entrypoints/rl/online/
    api_router.py``) and return how many that was; then wait (guard 60 s) for an idle engine.

    The second witness, after /metrics: vLLM publishes its gauges and token counter once per
    engine step, and on a busy 2-core box one prefill step of a long prompt lasts seconds, so
    a request admitted after the abort can look idle on /metrics for longer than the quiet
    period (seen here: a 15 ms case looked idle and was found running in the next case). A
    request is done with when vLLM no longer tracks it."""
    req = urllib.request.Request(f"{engine.base_url}/abort_requests", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200, f"expected 200 from dev-mode /abort_requests, got {r.status}"
        answer = json.loads(r.read())
    assert answer.get("status") == "aborted", f"expected a dev-mode abort answer, got {answer}"
    wait_idle(engine, guard_s=60)
    tracked: int = answer["aborted"]
    return tracked


def wait_idle(engine: VLLMServer, guard_s: float = 30) -> None:
    deadline = time.monotonic() + guard_s
    while (m := read_metrics(engine.base_url))["running"] or m["waiting"]:
        assert time.monotonic() < deadline, f"expected an idle engine within {guard_s}s, got {m}"
        time.sleep(0.1)


def abort_calls(sc: SidecarProcess) -> int:
    return int(sidecar_counter(sc, "cancel_sidecar_abort_calls_total"))


def log_size(sc: SidecarProcess) -> int:
    return sc.log_path.stat().st_size


def sidecar_phases(sc: SidecarProcess, since: int) -> str:
    """Informative only (the proof is at the engine): the ``phase`` of the sidecar's access lines
    for the POSTs logged after byte ``since`` of its log, counted, e.g. ``before_first_byte``
    (the engine had the whole body: aborted) or ``request_body`` (it never had all of it: no
    abort)."""
    with open(sc.log_path, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    phases: dict[str, int] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == "sidecar.access" and entry.get("method") == "POST":
            phase = str(entry.get("phase"))
            phases[phase] = phases.get(phase, 0) + 1
    return ", ".join(f"{p} x{n}" if n > 1 else p for p, n in sorted(phases.items())) or "-"


def finish(engine: VLLMServer, sc: SidecarProcess, before: tuple[int, int],
           seen: Outcome) -> Outcome:
    """``seen`` (from /metrics) completed with the sweep's count (any request vLLM still tracked
    after the quiet period is a leak too) and, for the table, the sidecar's abort calls and
    phases since ``before`` (abort call count, log size)."""
    tracked = sweep(engine)
    return replace(seen, leaked=seen.leaked or tracked > 0, tracked=tracked,
                   abort_calls=abort_calls(sc) - before[0],
                   sidecar_phase=sidecar_phases(sc, before[1]))


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with running_engine(model_dir, tmp_path_factory,
                        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
                        startup_timeout=STARTUP_S) as server:
        yield server


@pytest.fixture(scope="module")
def sidecar(engine: VLLMServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[SidecarProcess]:
    with running_sidecar(engine, tmp_path_factory) as sc:
        yield sc


@pytest.fixture
def sampler(engine: VLLMServer) -> Iterator[MetricsSampler]:
    wait_idle(engine)  # a failure before may have left work behind
    with MetricsSampler(engine.base_url, interval=0.01) as s:
        yield s
    assert s.errors <= 2, f"expected /metrics to answer (re-connects allowed), {s.errors} failed"


@pytest.fixture(scope="module")
def table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[list[dict[str, Any]]]:
    """Rows the tests add; printed (past pytest's capture) and saved when the module is done."""
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    yield rows
    path = tmp_path_factory.mktemp("early-disconnect") / "early_disconnect.json"
    path.write_text(json.dumps(rows, indent=2) + "\n")
    text = format_table(rows, time.monotonic() - started) + f"\n(saved to {path})"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + text, flush=True)


def format_table(rows: list[dict[str, Any]], seconds: float) -> str:
    head = ("case", "reset ms", "engine ids", "tokens after reset", "ms to running=0",
            "peak run+wait", "left run+wait", "still tracked", "sidecar abort calls", "verdict",
            "sidecar phase (informative)")
    lines = [head]
    for r in rows:
        lines.append((r["case"], r["delays"], str(r["ids"]), str(r["tokens_after"]),
                      "-" if r["ms_to_idle"] is None else str(r["ms_to_idle"]),
                      str(r["peak"]), str(r["left"]), str(r["tracked"]), str(r["abort_calls"]),
                      "LEAK" if r["leaked"] else "stopped", r["sidecar_phase"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    leaks = sum(r["leaked"] for r in rows)
    return (f"early disconnect on vLLM (/metrics every 10 ms; re-send window "
            f"{RESEND_WINDOW_S}s, guard {GUARD_S}s, quiet {QUIET_S}s): {leaks} of {len(rows)} "
            f"leaked, {seconds:.0f}s of tests\n" + "\n".join(out) + "\n"
            "ms to running=0: '-' if /metrics never showed it running after the reset; "
            "left: running+waiting when the guard ran out; still tracked: requests vLLM's API "
            "process still held after the quiet period (dev-mode sweep)")


def record(table: list[dict[str, Any]], case: str, resets: list[Reset], ids: int,
           outcome: Outcome) -> None:
    delays = sorted(r.actual_delay_ms for r in resets)
    shown = (f"{delays[0]:.1f}" if len(delays) == 1
             else f"{delays[0]:.1f}-{delays[-1]:.1f} ({len(delays)} clients)")
    table.append({"case": case, "delays": shown, "delays_ms": [round(d, 2) for d in delays],
                  "ids": ids, **asdict(outcome)})
    print(f"\n{case}: reset {shown} ms after the body -> {outcome}")


def first_sample(sampler: MetricsSampler, guard_s: float = 10.0) -> None:
    """Wait (guard ``guard_s``) until the sampler holds a sample: the figures need one from
    before the reset."""
    deadline = time.monotonic() + guard_s
    while sampler.latest() is None:
        assert time.monotonic() < deadline, (
            f"expected a /metrics sample within {guard_s}s, got none ({sampler.errors} errors)")
        time.sleep(0.01)


# --- tests --------------------------------------------------------------------------------------

def test_prompts_are_several_thousand_tokens(engine: VLLMServer, model_dir: Path) -> None:
    """The prompts are as long as the module says: vLLM's own count (``usage.prompt_tokens`` of
    a one-token request, sent to vLLM directly)."""
    for kind, minimum in (("chat JSON", MIN_CHAT_TOKENS),
                          (f"completion {COMPLETION_PROMPTS} prompts",
                           MIN_COMPLETION_TOKENS * COMPLETION_PROMPTS)):
        body = {**request_body(model_dir, kind), "max_tokens": 1, "stream": False}
        req = urllib.request.Request(f"{engine.base_url}{KINDS[kind].path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        started = time.monotonic()
        with urllib.request.urlopen(req, timeout=120) as r:
            count = json.loads(r.read())["usage"]["prompt_tokens"]
        print(f"\n{kind}: {count} prompt tokens, one token generated in "
              f"{time.monotonic() - started:.2f}s")
        assert count >= minimum, f"expected a {kind} prompt of >= {minimum} tokens, got {count}"


@pytest.mark.parametrize(("kind", "delay_ms"), CASES, ids=[f"{k}, {d} ms" for k, d in CASES])
def test_reset_after_the_body_leaves_nothing_running(
        kind: str, delay_ms: int, engine: VLLMServer, sidecar: SidecarProcess, model_dir: Path,
        sampler: MetricsSampler, table: list[dict[str, Any]]) -> None:
    before = abort_calls(sidecar), log_size(sidecar)
    body = request_body(model_dir, kind)
    first_sample(sampler)
    reset = send_and_reset(sidecar.base_url, kind, body, delay_ms)
    outcome = finish(engine, sidecar, before,
                     watch(sampler, reset.reset_at, reset.sent_at + RESEND_WINDOW_S))
    record(table, f"{kind}, {delay_ms} ms", [reset], KINDS[kind].engine_requests, outcome)
    assert not outcome.leaked, (
        f"expected nothing running or waiting at vLLM within {GUARD_S}s after the re-send window "
        f"closed, no token for {QUIET_S}s, and no request tracked by vLLM then, for a client "
        f"that reset {reset.actual_delay_ms:.1f} ms after its body ({kind}); got {outcome}")


@pytest.mark.parametrize("burst", range(1, BURSTS + 1))
def test_many_resets_at_once_leave_nothing_running(
        burst: int, engine: VLLMServer, sidecar: SidecarProcess, model_dir: Path,
        sampler: MetricsSampler, table: list[dict[str, Any]]) -> None:
    """15 clients at once (each kind 5 times), resets 0-260 ms after their bodies: vLLM's API
    process tokenizes ~65k prompt tokens while the aborts come."""
    before = abort_calls(sidecar), log_size(sidecar)
    bodies = [(kind, delay, request_body(model_dir, kind)) for kind, delay in BURST_CASES]
    start = threading.Barrier(len(bodies))
    first_sample(sampler)
    with ThreadPoolExecutor(len(bodies), thread_name_prefix="early-reset") as pool:
        futures = [pool.submit(send_and_reset, sidecar.base_url, kind, body, delay, start)
                   for kind, delay, body in bodies]
        resets = [f.result(timeout=60) for f in futures]
    # Figures from the first reset (tokens counted from then on); the window from the last body.
    outcome = finish(engine, sidecar, before,
                     watch(sampler, min(r.reset_at for r in resets),
                           max(r.sent_at for r in resets) + RESEND_WINDOW_S))
    ids = sum(KINDS[kind].engine_requests for kind, _ in BURST_CASES)
    record(table, f"burst {burst}: {len(BURST_CASES)} clients at once", resets, ids, outcome)
    assert not outcome.leaked, (
        f"expected nothing running or waiting at vLLM within {GUARD_S}s after the re-send windows "
        f"closed, no token for {QUIET_S}s, and no request tracked by vLLM then, after "
        f"{len(resets)} clients reset {BURST_DELAYS_MS[0]}-{BURST_DELAYS_MS[-1]} ms after their "
        f"bodies at once; got {outcome}")


# A late start (engines.*.abort.late_start_s, sidecar/confirm.py): a sidecar whose registration
# window is 0 and confirmation bound 1 ms, so vLLM registers a request after every call of the
# first bound; the default late_start_s then watches a stream on and names its id again once its
# head comes, and a JSON request (nothing of it comes before its end) on while its id is re-sent
# at doubling gaps. ``late_start_s: 0`` is the contrast (recorded in the table, not asserted: it
# depends on vLLM registering later than 1 ms after the disconnect; streams: 7 of 7 ran on,
# 218-400 tokens).
LATE_ABORT = {"resend_window_s": 0, "confirm_timeout_s": 0.001}
LATE_RESET_MS = 5  # at 0 ms the sidecar may still be writing the body upstream: nothing to abort
LATE_CASES = [("chat stream", 30.0, 1), ("chat stream", 30.0, 2), ("chat stream", 0.0, 1),
              ("chat JSON", 30.0, 1), ("chat JSON", 30.0, 2), ("chat JSON", 0.0, 1)]
LATE_PHASE = {"chat stream": "before_first_byte", "chat JSON": "awaiting_response"}
LATE_ATTEMPTS = 3  # resets per case until vLLM registers one past every call of the bound


@pytest.mark.parametrize(("kind", "late_start_s", "trial"), LATE_CASES,
                         ids=[f"{k}, late_start_s {s:g}, {n}" for k, s, n in LATE_CASES])
def test_a_request_registered_after_every_call_stops_once_registered(
        kind: str, late_start_s: float, trial: int, engine: VLLMServer, model_dir: Path,
        sampler: MetricsSampler, table: list[dict[str, Any]],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A chat request reset 5 ms after its body, vLLM registering it after the sidecar's
    registration window (0) and confirmation bound (1 ms) closed: with ``late_start_s`` a
    stream stops at vLLM once its head comes, a JSON request at a re-send after it registered
    (read at /metrics, and nothing tracked then), and the sidecar's log says it took that
    path."""
    sc = start_sidecar(engine.base_url, tmp_path_factory.mktemp("late-start"),
                       abort={**LATE_ABORT, "late_start_s": late_start_s})
    late, attempts = 0, 0
    try:
        # vLLM may register the request before the first call after all (a fast tokenization:
        # 1 of 4 streams in a fresh-clone CI): then the case is not exercised and is tried again,
        # each attempt asserting that nothing leaked (no rerun of the test: see pytestmark).
        while attempts < LATE_ATTEMPTS and not late:
            attempts += 1
            before = abort_calls(sc), log_size(sc)
            first_sample(sampler)
            reset = send_and_reset(sc.base_url, kind, request_body(model_dir, kind),
                                   LATE_RESET_MS)
            outcome = finish(engine, sc, before, watch(sampler, reset.reset_at, reset.sent_at))
            late = sc.log_text()[before[1]:].count("past the confirmation's bound")
            record(table, f"{kind} registered late, late_start_s {late_start_s:g}", [reset], 1,
                   outcome)
            if not late_start_s:
                break  # the contrast: recorded only
            assert not outcome.leaked, (
                f"expected the {kind} stopped at vLLM once registered (late_start_s "
                f"{late_start_s}), nothing running {GUARD_S}s after the reset; got {outcome}")
            assert outcome.sidecar_phase == LATE_PHASE[kind], (
                f"expected the client gone with the body at vLLM, before the first byte "
                f"({LATE_PHASE[kind]}); the sidecar's access line says "
                f"{outcome.sidecar_phase!r}")
    finally:
        assert sc.stop() == 0, f"expected the sidecar to exit 0; log tail:\n{sc.log_text()[-3000:]}"
    if late_start_s:
        assert late == 1, (
            f"expected the sidecar to log the late registration once (vLLM registered the "
            f"request past the 1 ms bound) in one of {attempts} attempt(s), got {late}: the case "
            f"was not exercised")
