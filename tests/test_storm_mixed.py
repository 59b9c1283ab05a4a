"""A disconnect storm mixed across engine kinds, phases, ways of leaving and keep-alive
connections, through the production wiring (:func:`sidecar.server.start`), checked at the
engines.

Two engines behind one sidecar: a vLLM-kind engine (abort by id) on ``/v1/chat/completions`` and
an OpenAI-kind engine (close only) on ``/v1/completions``. At once, ``CUT`` clients leave (RST,
FIN or half-close) while their request streams, waits for its first byte, or waits for a JSON
answer; a tenth of them are keep-alive connections whose first request completed before the
second one was cut. Meanwhile ``COMPLETING`` requests run to their end. The variants: the
abort endpoint answers at once, slowly (0.2 s), or the sidecar is stopped (the drain) right
after the clients left.

Checked at the engines: every cut vLLM request stopped by the first abort call naming it (none
runs to its end for nobody; a call naming it later is a re-send made because the engine's end
was read late, and comes after the stop), every cut OpenAI request's connection closed, no request
that completed (the keep-alive connections' first requests included) ever named, no upstream
connection left serving a request. Checked at the sidecar: one access line per request with its
phase, ``client_disconnected`` and abort outcome; the disconnect, request and upstream error
counters; its own file descriptors back to what the idle connections explain; no abort task
left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import yaml

from sidecar.abort_wire import WARM
from sidecar.config import parse_config
from sidecar.server import Servers
from tests.fakes.kinds import OpenAIEngine, VLLMEngine, Work, stream_bytes
from tests.harness.support import WAIT_S, RawClient, Stalls, metrics, sample, samples

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"  # -> the vLLM engine
COMPLETIONS = "/v1/completions"  # -> the OpenAI engine
API_KEY = "sekret-key"
LONG = "tokens=5000&interval=0.02"  # runs ~100 s unless stopped
CUT = 240
COMPLETING = 30
COMPLETING_TOKENS = 40
MAX_CALLS = 64  # engines.*.abort.max_calls' default


@dataclass
class Plan:
    """One request of the storm."""

    marker: str
    path: str
    phase: str  # the phase the sidecar should log for it, or "completed"
    how: str  # rst, fin, half; "" for one that completes
    keepalive: bool = False  # a first, completed request on the same connection before it
    request_id: str | None = None  # the sidecar id, once known
    first_id: str | None = None  # the keep-alive connection's first (completed) request's id


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(dict(getattr(record, "access", {})))


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[tuple[VLLMEngine, OpenAIEngine]]:
    vllm, openai = VLLMEngine(API_KEY), OpenAIEngine()
    await vllm.start()
    await openai.start()
    yield vllm, openai
    await vllm.stop()
    await openai.stop()


def plans() -> list[Plan]:
    kinds = [(CHAT, "streaming"), (CHAT, "before_first_byte"), (CHAT, "awaiting_response"),
             (COMPLETIONS, "streaming"), (COMPLETIONS, "before_first_byte")]
    hows = ["rst", "fin", "half"]
    out = []
    for i in range(CUT):
        path, phase = kinds[i % len(kinds)]
        out.append(Plan(f"cut-{i}", path, phase, hows[(i // len(kinds)) % 3],
                        keepalive=i % 10 == 0))
    out += [Plan(f"done-{i}", CHAT if i % 2 else COMPLETIONS, "completed", "")
            for i in range(COMPLETING)]
    return out


def query(plan: Plan) -> str:
    if plan.phase == "completed":
        return f"tokens={COMPLETING_TOKENS}&interval=0.01"
    if plan.phase == "before_first_byte":
        return "first_byte_delay=100&tokens=1"
    return LONG


def body(plan: Plan, stream: bool) -> bytes:
    payload: dict[str, Any] = {"marker": plan.marker, "stream": stream}
    payload["messages" if plan.path == CHAT else "prompt"] = [] if plan.path == CHAT else "hi"
    return json.dumps(payload).encode()


async def read_response(client: RawClient) -> tuple[int, dict[str, str], bytes]:
    """A whole response (Content-Length or chunked) on a kept-alive connection."""
    status, headers = await client.head()
    if "Content-Length" in headers:
        data = await client.stalls.wait(client.reader.readexactly(int(headers["Content-Length"])),
                                        "a response body")
        return status, dict(headers), data
    data = b""
    while True:
        size = int((await client.read_until(b"\r\n")).strip(), 16)
        chunk = await client.stalls.wait(client.reader.readexactly(size + 2), "a chunk")
        data += chunk[:-2]
        if size == 0:
            return status, dict(headers), data


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def engine_connections(*kind_engines: Any) -> tuple[int, int]:
    """(connections open at the engines, of which serving a request now)."""
    conns = [c for e in kind_engines for c in e.runner.server.connections]
    return len(conns), sum(1 for c in conns if c._current_request is not None)


@pytest.mark.parametrize("variant", ["prompt", "slow_abort", "stop"])
async def test_mixed_storm_stops_exactly_the_cut_work(
        engines: tuple[VLLMEngine, OpenAIEngine], start_sidecar: Callable[..., Any],
        stalls: Stalls, variant: str) -> None:
    vllm, openai = engines
    if variant == "slow_abort":
        vllm.abort_delay_s = 0.2
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {
            "v": {"kind": "vllm", "url": vllm.url,
                  "abort": {"api_key": API_KEY, "timeout_s": 5.0, "resend_window_s": 0}},
            "o": {"kind": "openai", "url": openai.url}},
        "routes": [{"prefix": CHAT, "engine": "v"}, {"prefix": COMPLETIONS, "engine": "o"}],
    }
    access = AccessLines()
    logger = logging.getLogger("sidecar.access")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(access)
    try:
        await storm(vllm, openai, await start_sidecar(parse_config(yaml.safe_dump(tree),
                                                                   "<test>", env={})),
                    stalls, variant, access)
    finally:
        logger.removeHandler(access)
        logger.setLevel(level)


async def storm(vllm: VLLMEngine, openai: OpenAIEngine, servers: Servers, stalls: Stalls,
                variant: str, access: AccessLines) -> None:
    port, admin = servers.proxy_port, servers.admin_port or 0
    # the warm abort connections are open: the baseline counts them
    assert await vllm.watch.until(lambda: engine_connections(vllm)[0] >= WARM, WAIT_S), (
        f"expected the sidecar's {WARM} warm abort connections at the vLLM engine")
    base_fds, (base_conns, _) = own_fds(), engine_connections(vllm, openai)
    all_plans = plans()
    cut = [p for p in all_plans if p.phase != "completed"]
    gate = asyncio.Semaphore(64)
    clients: dict[str, RawClient] = {}

    async def start(plan: Plan) -> None:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = clients[plan.marker] = RawClient(reader, writer, stalls)
        if plan.keepalive:
            first = Plan(plan.marker + "-first", plan.path, "completed", "")
            client.send("POST", f"{plan.path}?tokens=2&interval=0", body(first, False))
            status, first_headers, _ = await read_response(client)
            assert status == 200, f"keep-alive first request: expected 200, got {status}"
            plan.first_id = first_headers["X-Request-Id"]
        stream = plan.phase != "awaiting_response"
        client.send("POST", f"{plan.path}?{query(plan)}", body(plan, stream))
        if plan.phase == "streaming":
            status, headers = await client.head()
            plan.request_id = headers["X-Request-Id"]
            await client.read_until(b"data: ")

    await asyncio.gather(*(start(p) for p in cut))

    def arrived(engine: Any, n: int) -> Callable[[], bool]:
        return lambda: sum(1 for w in engine.works
                           if str((w.body or {}).get("marker", "")).startswith("cut-")) >= n
    n_chat = sum(1 for p in cut if p.path == CHAT)
    assert await vllm.watch.until(arrived(vllm, n_chat), WAIT_S), (
        f"expected {n_chat} cut requests at the vLLM engine")
    assert await openai.watch.until(arrived(openai, len(cut) - n_chat), WAIT_S), (
        f"expected {len(cut) - n_chat} cut requests at the OpenAI engine")

    async def complete(plan: Plan) -> None:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = RawClient(reader, writer, stalls)
        client.send("POST", f"{plan.path}?{query(plan)}", body(plan, True))
        status, headers, data = await read_response(client)
        assert status == 200 and data.startswith(b"data: {"), (
            f"expected a stream for {plan.marker}, got {status}: {data[:80]!r}")
        # Byte for byte what the engine wrote, though its reads were held during the storm
        # (sidecar.read_pacer.ReadPacer): the engine names the stream in each event.
        ident = json.loads(data.split(b"\n", 1)[0][len(b"data: "):])["id"]
        assert data == stream_bytes(ident, COMPLETING_TOKENS), (
            f"expected the whole stream of {plan.marker} unchanged, got {len(data)} bytes "
            f"ending {data[-60:]!r}")
        plan.request_id = headers["X-Request-Id"]
        writer.close()

    completing = asyncio.gather(*(complete(p) for p in all_plans if p.phase == "completed"))
    await asyncio.sleep(0.1)  # some of them mid-stream when the storm comes
    for plan in cut:
        clients[plan.marker].disconnect(plan.how)
    stopping = None
    if variant == "stop":
        stopping = asyncio.ensure_future(servers.stop(grace_s=5.0))
    await stalls.wait(completing, "the completing requests to end", within_s=30)
    for plan in cut:
        if plan.how == "half":
            clients[plan.marker].writer.close()
    if stopping is not None:
        await stalls.wait(stopping, "the sidecar to stop", within_s=30)

    # every cut request stopped at its engine
    def settled() -> bool:
        works = [w for w in vllm.works + openai.works
                 if str((w.body or {}).get("marker", "")).startswith("cut-")]
        return all(not w.running for w in works)
    assert await vllm.watch.until(settled, 30) or settled(), "cut requests still running"
    await asyncio.sleep(0.3)  # stray calls, late close
    marker_of = {w.request_id_header: (w.body or {}).get("marker") for w in vllm.works}
    by_marker: dict[str, Work] = {str((w.body or {}).get("marker")): w
                                  for w in vllm.works + openai.works}
    named = Counter(i for call in vllm.calls for i in call.ids)
    problems: list[str] = []
    resent = 0  # calls naming a cut id after the engine had stopped it
    for plan in cut:
        work = by_marker.get(plan.marker)
        if work is None:
            problems.append(f"{plan.marker}: never reached its engine")
            continue
        if work.ran_to_end:
            problems.append(f"{plan.marker} ({plan.path}, {plan.phase}, {plan.how}): ran to "
                            f"its end for nobody")
        if plan.path == CHAT:
            for engine_id in work.engine_ids:
                # The first call naming it stopped it. A call after that is a re-send made
                # because the engine's end was read late (docs/semantics.md §2d: re-sends until
                # the verdict, CONFIRM_WAIT_S after the first answer): a no-op, harmless, never
                # the one that stopped the work, and within abort.max_calls.
                naming = sorted((c for c in vllm.calls if engine_id in c.ids),
                                key=lambda c: c.at)
                aborted_at = work.aborted.get(engine_id)
                first = naming[0] if naming else None
                late = [c for c in naming[1:] if aborted_at is None or c.at < aborted_at]
                no_op = first is None or engine_id in first.ignored + first.missed
                if no_op or aborted_at is None or late or len(naming) > MAX_CALLS:
                    problems.append(f"{plan.marker} ({plan.phase}, {plan.how}): {engine_id} "
                                    f"named {len(naming)} times, expected the first call to "
                                    f"stop it (aborted at {aborted_at}, calls at "
                                    f"{[c.at for c in naming][:5]}, first a no-op: {no_op})")
                resent += len(naming) - 1
            if not work.aborted:
                problems.append(f"{plan.marker} ({plan.phase}, {plan.how}): not stopped by an "
                                f"abort (stopped_at {work.stopped_at})")
        elif work.closed_at is None:
            problems.append(f"{plan.marker} ({plan.phase}, {plan.how}): connection not closed")
    completed_ids = {f"chatcmpl-{p.first_id}" for p in cut if p.first_id}
    completed_ids |= {f"chatcmpl-{p.request_id}" for p in all_plans if p.phase == "completed"}
    wrongly = sorted(i for i in named if i in completed_ids)
    if wrongly:
        problems.append(f"{len(wrongly)} completed request(s) named in an abort call: "
                        f"{[marker_of.get(i.removeprefix('chatcmpl-')) for i in wrongly][:5]}")
    assert not problems, f"{len(problems)} problem(s) at the engines:\n" + "\n".join(problems[:20])
    print(f"[storm/{variant}] {resent} re-send(s) after the engine had stopped the work")

    # the sidecar's own view
    lines = access.lines
    per_id = Counter(line.get("request_id") for line in lines)
    twice = [i for i, n in per_id.items() if n > 1]
    assert not twice, f"expected one access line per request, got several for {twice[:3]}"
    line_of = {line["request_id"]: line for line in lines}
    expected_requests = len(all_plans) + sum(1 for p in cut if p.keepalive)
    assert len(lines) == expected_requests, (
        f"expected {expected_requests} access lines, got {len(lines)}")
    bad_lines = []
    for plan in cut:
        work = by_marker[plan.marker]
        rid = work.request_id_header if plan.path == CHAT else plan.request_id
        if rid is None:
            continue
        line = line_of.get(rid)
        # The engine's word: it ended the stream aborted, or (a stream near its end whose first
        # abort came while the ids were registering) it ended on its own first.
        want_abort = {"confirmed", "finished"} if plan.path == CHAT else {None}
        if (line is None or line["phase"] != plan.phase or not line["client_disconnected"]
                or line["abort"] not in want_abort):
            bad_lines.append(f"{plan.marker} ({plan.how}): expected phase {plan.phase}, "
                             f"client_disconnected, abort {want_abort}; got {line}")
    assert not bad_lines, "access lines:\n" + "\n".join(bad_lines[:10])

    if variant != "stop":
        values = await metrics(admin)
        disconnects = sum(samples(values, "cancel_sidecar_client_disconnects_total").values())
        requests: Counter[str] = Counter()
        for labels, value in samples(values, "cancel_sidecar_requests_total").items():
            requests[dict(labels)["status_class"]] += int(value)
        errors = samples(values, "cancel_sidecar_upstream_errors_total")
        in_flight = sum(samples(values, "cancel_sidecar_in_flight_requests").values())
        print(f"[storm/{variant}] disconnects {disconnects}, requests {requests}, "
              f"upstream errors {errors}, abort calls {len(vllm.calls)}")
        assert disconnects == len(cut), f"expected {len(cut)} disconnects, got {disconnects}"
        assert requests.get("disconnected") == len(cut), (
            f"expected {len(cut)} requests disconnected, got {requests}")
        assert not errors, f"expected no upstream error, got {errors}"
        assert in_flight == 0, f"expected nothing in flight, got {in_flight}"
        assert sample(values, "cancel_sidecar_client_disconnects_total",
                      route=CHAT, phase="streaming") > 0

    # nothing left open or running
    for client in clients.values():
        client.writer.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while loop.time() < deadline:
        conns, busy = engine_connections(vllm, openai)
        if busy == 0 and own_fds() <= base_fds + 2 * (conns - base_conns):
            break
        await asyncio.sleep(0.05)
    conns, busy = engine_connections(vllm, openai)
    fds = own_fds()
    print(f"[storm/{variant}] fds {base_fds} -> {fds}, engine connections {base_conns} -> "
          f"{conns} ({busy} serving)")
    assert busy == 0, f"expected no upstream connection still serving a request, got {busy}"
    assert fds <= base_fds + 2 * (conns - base_conns), (
        f"expected this process's fds back to {base_fds} + 2 per idle connection kept "
        f"({conns - base_conns}); got {fds}")
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("abort ")]
    assert not left, f"expected no abort task left, got {left[:5]}"
