"""Abort endpoint faults, through the production wiring (:func:`sidecar.server.start`).

Whatever the engine's abort endpoint does (401, 403, 404, 500, 503, reset, refused, slow,
hanging): the upstream connection is closed at once, other requests complete meanwhile, each
attempt is bounded by ``abort.timeout_s``, retried only where :mod:`sidecar.abort_call` says a
re-send is safe and useful, counted by outcome on the admin ``/metrics``, logged with the request
id and a hint but never the key, and the request's final outcome reaches its access line once.

Nothing queues without bound: against a hanging endpoint the per-engine queue fills up to exactly
``MAX_QUEUED_IDS``, the overflow is ``dropped``, and the queued ids go out once each when the
endpoint recovers; aborts still pending when the sidecar stops end ``cancelled``.

The engine is :mod:`tests.fakes.engine` (abort knobs: ``abort_status``, ``abort_script``,
``abort_key``, ``abort_gate``, ``abort_delay``; a second listening socket closed mid-stream for
"refused"); clients are raw sockets cut with a TCP reset. Timing as in ``tests/test_cancel.py``:
event-driven waits, guard bounds with this process's stalls excluded. Run with ``-s`` for the
numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.vllm import MAX_IDS_PER_CALL
from sidecar.abort_call import ABORT_STATUS_HINTS, backoff
from sidecar.abort_queue import MAX_CALLS_PER_ENGINE, MAX_QUEUED_IDS
from sidecar.app import ABORT_DRAIN_S
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import ABORT_PATH, ABORT_RESET, HANG_ABORT_PATH, FakeEngine
from tests.harness.support import (
    API_KEY,
    CHAT,
    COMPLETIONS,
    FOREVER,
    GUARD_S,
    WAIT_S,
    RawClient,
    Stalls,
    metrics,
    ms,
    raw_client,
    request_body,
    samples,
    upstream_closed,
    wait_metric,
)

pytestmark = pytest.mark.timeout(90)

RETRIES = 2  # abort.retries in these tests (the default)
TIMEOUT_S = 0.5  # abort.timeout_s for the slow and hanging endpoints
FAILING = "failing"  # the engine config whose abort endpoint misbehaves; chat is routed to it

Values = dict[tuple[str, frozenset[tuple[str, str]]], float]




@dataclass(frozen=True)
class Fault:
    """What one abort-endpoint fault must lead to."""

    received: int  # abort calls that reach the engine
    attempts: dict[str, int]  # cancel_sidecar_abort_calls_total{engine=failing} by outcome
    final: str  # the request's outcome: aborted_requests_total and its access line
    hint: str  # in every failed attempt's log line


TIMEOUT_HINT = "did not answer within abort.timeout_s"
FAULTS: dict[str, Fault] = {
    "http_401": Fault(1, {"http_401": 1}, "http_401", ABORT_STATUS_HINTS[401]),
    "http_403": Fault(1, {"http_403": 1}, "http_403", ABORT_STATUS_HINTS[403]),
    "http_404": Fault(1, {"http_404": 1}, "http_404", ABORT_STATUS_HINTS[404]),
    "http_500": Fault(1, {"http_500": 1}, "http_500", ABORT_STATUS_HINTS[500]),
    "http_503": Fault(1 + RETRIES, {"http_503": 1 + RETRIES}, "http_503",
                      ABORT_STATUS_HINTS[503]),
    # The call is accepted, then the engine ends the stream aborted: confirmed.
    "http_503_then_ok": Fault(2, {"http_503": 1, "accepted": 1}, "confirmed",
                              ABORT_STATUS_HINTS[503]),
    "reset": Fault(1 + RETRIES, {"error": 1 + RETRIES}, "error",
                   "the connection was lost before an answer"),
    "refused": Fault(0, {"error": 1 + RETRIES}, "error",
                     "nothing accepts connections at the engine's url"),
    "slow": Fault(1, {"timeout": 1}, "timeout", TIMEOUT_HINT),
    "hang": Fault(1, {"timeout": 1}, "timeout", TIMEOUT_HINT),
}


def access_lines(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """The access lines logged so far, by sidecar request id."""
    lines: dict[str, dict[str, Any]] = {}
    for record in caplog.records:
        fields = getattr(record, "access", None)
        if record.name == "sidecar.access" and fields is not None:
            assert fields["request_id"] not in lines, f"two access lines for {fields}"
            lines[fields["request_id"]] = dict(fields)
    return lines


def engine_samples(values: Values, name: str, engine: str) -> dict[str, float]:
    """Non-zero samples of ``name`` for ``engine``, by outcome."""
    return {dict(k)["outcome"]: v for k, v in samples(values, name).items()
            if dict(k)["engine"] == engine}


def assert_no_key(caplog: pytest.LogCaptureFixture) -> None:
    assert API_KEY not in caplog.text, "the abort api key appeared in the logs"
    assert all(API_KEY not in r.getMessage() for r in caplog.records), "api key in a log record"


async def arrange(engine: FakeEngine, fault: str) -> tuple[dict[str, Any], str, Any]:
    """Make the fake engine's abort endpoint fail as ``fault`` says. Returns the ``failing``
    engine config, the abort path the engine sees and, for ``refused``, the listening site to
    close once the stream runs."""
    record, url, path, site = engine.record, engine.url, ABORT_PATH, None
    timeout_s = TIMEOUT_S if fault in ("slow", "hang") else 2.0
    if fault == "http_401":
        record.abort_key = "the-engine-expects-another-key"
    elif fault == "http_404":
        path = "/no/such/abort"
    elif fault == "http_503_then_ok":
        record.abort_script = [503]
    elif fault == "reset":
        record.abort_script = [ABORT_RESET] * (1 + RETRIES)
    elif fault == "refused":
        site, port = await engine.listen_again()  # the stream and the abort go here
        url = f"http://127.0.0.1:{port}"
    elif fault == "slow":
        record.abort_delay = 30.0  # far past timeout_s
    elif fault == "hang":
        path = HANG_ABORT_PATH
    elif fault.startswith("http_"):
        record.abort_status = int(fault[5:])
    config = {"kind": "vllm", "url": url, "abort": {"path": path, "api_key": API_KEY,
                                                    "timeout_s": timeout_s, "retries": RETRIES,
                                                    "resend_window_s": 0}}
    return config, path, site


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_abort_failure_never_delays_close_or_other_traffic(
        engine: FakeEngine, start_sidecar: Callable[..., Any], caplog: pytest.LogCaptureFixture,
        stalls: Stalls, fault: str) -> None:
    caplog.set_level(logging.DEBUG)
    expect = FAULTS[fault]
    config, abort_path, site = await arrange(engine, fault)
    timeout_s = config["abort"]["timeout_s"]
    settings = sidecar_settings(engine.url, engines={FAILING: config},
                                routes=[{"prefix": CHAT, "engine": FAILING},
                                        {"prefix": "/", "engine": "local"}])
    servers: Servers = await start_sidecar(settings)
    port, admin = servers.proxy_port, servers.admin_port or 0

    async with raw_client(port, stalls) as c:
        c.send("POST", f"{CHAT}?tokens=1000", request_body({"messages": []}, True))
        _, head = await c.head()
        await c.read_until(b"data:")
        if site is not None:
            await site.stop()  # new connections refused from now on ...
            engine.drop_idle_connections()  # ... and the warm abort connection gone
            await c.read_until(b"data:")  # ... while the established stream still flows
            await c.read_until(b"data:")
        at = c.disconnect("rst")
        closed_at = await upstream_closed(engine, stalls)
    rid = head["X-Request-Id"]
    if fault == "refused":
        await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1,
                          engine=FAILING, outcome="error")
    else:
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(abort_path)),
                                             FOREVER), f"an abort call at {abort_path}")
    first_seen = time.monotonic()

    # Other traffic, while the abort call fails, is retried or hangs: on the failing engine's
    # config too, unless it refuses new connections.
    others: list[tuple[str, dict[str, Any]]] = [(COMPLETIONS, {"prompt": "a"})]
    if fault != "refused":
        others.append((CHAT, {"messages": []}))
    async with aiohttp.ClientSession() as s:
        for path, body in others:
            async with s.post(f"http://127.0.0.1:{port}{path}?tokens=5&interval=0.001",
                              json={**body, "stream": True}) as r:
                text = await r.read()
                assert r.status == 200 and text.endswith(b"data: [DONE]\n\n"), (
                    f"{path}: expected a complete stream during the abort, got {r.status} "
                    f"{text[-100:]!r}")
    done_at = time.monotonic()
    if fault in ("slow", "hang"):
        call = engine.watch.on(abort_path)[0]
        # Only meaningful if the requests were done well within timeout_s of process time.
        if done_at - call.started - stalls.within(call.started, done_at) < timeout_s / 2:
            assert call.ended_at is None and call.failed_at is None, (
                f"expected the abort call still pending while other requests completed: {call}")
        else:
            print(f"[{fault}] pending-abort ordering not checked: the requests took "
                  f"{ms(done_at - call.started)}")
    closed = stalls.check("the upstream close", at, closed_at)
    print(f"[{fault}] upstream closed {ms(closed)}; {len(others)} other request(s) took "
          f"{ms(done_at - first_seen)} during the abort{stalls.note(at, done_at)}")

    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1,
                      (1 + RETRIES) * timeout_s + WAIT_S, engine=FAILING, outcome=expect.final)
    if expect.final == "timeout":
        call = engine.watch.on(abort_path)[0]
        await stalls.wait(engine.watch.until(lambda: call.failed_at is not None, FOREVER),
                          "the abort connection to be closed")
        assert call.failed_at is not None
        lasted = call.failed_at - call.started
        stalled = stalls.within(call.started, call.failed_at)
        print(f"[{fault}] abort call cut after {ms(lasted)} (timeout_s={timeout_s})"
              f"{stalls.note(call.started, call.failed_at)}")
        assert timeout_s - 0.2 < lasted and lasted - stalled < timeout_s + GUARD_S, (
            f"expected the abort call bounded by timeout_s={timeout_s}, it lasted {ms(lasted)} "
            f"({ms(stalled)} of it with this process stalled)")

    # Calls: exactly as many as designed reached the engine, each naming exactly this request.
    received = engine.watch.on(abort_path)
    assert len(received) == expect.received, (
        f"expected {expect.received} abort call(s) at {abort_path}, got {len(received)}")
    if fault == "refused":
        assert engine.watch.on(ABORT_PATH) == [], "expected no abort call to get through"
    if fault != "http_404":  # 404: the fake has no handler there to record the body
        assert [a.ids for a in engine.record.aborts] == [[f"chatcmpl-{rid}"]] * expect.received
        assert all(a.authorization == f"Bearer {API_KEY}" for a in engine.record.aborts)

    values = await metrics(admin)
    calls = engine_samples(values, "cancel_sidecar_abort_calls_total", FAILING)
    assert calls == expect.attempts, f"abort_calls_total: expected {expect.attempts}, got {calls}"
    assert not engine_samples(values, "cancel_sidecar_abort_calls_total", "local"), (
        "expected no abort call for the requests that completed")
    requests = engine_samples(values, "cancel_sidecar_aborted_requests_total", FAILING)
    assert requests == {expect.final: 1}, (
        f"aborted_requests_total: expected the final outcome {expect.final} once, got {requests}")
    latency = sample_count(values, FAILING, "cancel_sidecar_abort_confirm_seconds_count")
    assert latency == (1 if expect.final == "confirmed" else 0), (
        f"abort_confirm_seconds: expected one observation only for a confirmed abort, got "
        f"{latency}")
    line = access_lines(caplog).get(rid)
    assert line is not None and line["abort"] == expect.final, (
        f"expected the access line of {rid} with abort={expect.final}, got {line}")
    assert isinstance(line["abort_latency_s"], float), line

    # Logs: one WARNING per failed attempt, naming the request and the hint; never the key.
    failed = sum(n for outcome, n in expect.attempts.items() if outcome != "accepted")
    warnings = [r for r in caplog.records if r.name == "sidecar.abort"
                and r.levelno == logging.WARNING and rid in r.getMessage()]
    messages = [w.getMessage() for w in warnings]
    assert len(warnings) == failed, f"expected {failed} warning(s) naming {rid}, got {messages}"
    assert all(expect.hint in m for m in messages), (
        f"expected the hint {expect.hint!r} in every warning, got {messages}")
    retried = sum(expect.attempts.values()) - 1
    assert all("retrying in" in m for m in messages[:retried]), messages
    gaps = [b.created - a.created for a, b in pairwise(warnings)]
    if gaps:
        print(f"[{fault}] {len(warnings)} failed attempts, {ms(min(gaps))}..{ms(max(gaps))} "
              f"apart (backoff {[ms(backoff(k)) for k in range(1, len(gaps) + 1)]})")
    for k, gap in enumerate(gaps, 1):
        assert gap > 0.8 * backoff(k), (
            f"expected retry {k} at least {ms(backoff(k))} after the attempt before, "
            f"got {ms(gap)}")
    assert_no_key(caplog)


def sample_count(values: Values, engine: str,
                 name: str = "cancel_sidecar_abort_latency_seconds_count") -> float:
    return values.get((name, frozenset({("engine", engine)})), 0.0)


# -- nothing queues without bound ---------------------------------------------------------------

async def open_completions(port: int, stalls: Stalls, prompts: int) -> tuple[RawClient, str]:
    """An endless ``/v1/completions`` stream of ``prompts`` prompts (that many engine ids) on a
    raw socket, read to its first event; returns the client and the sidecar request id."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = RawClient(reader, writer, stalls)
    body = request_body({"prompt": ["p"] * prompts}, True)
    client.send("POST", f"{COMPLETIONS}?tokens=100000&interval=0.2", body)
    status, head = await client.head()
    assert status == 200, f"expected a 200 stream, got {status}"
    await client.read_until(b"data:")
    return client, head["X-Request-Id"]


def calls_at(engine: FakeEngine, count: int) -> bool:
    return len(engine.watch.on(ABORT_PATH)) == count


def engine_ids(rid: str, prompts: int) -> list[str]:
    return [f"cmpl-{rid}-{i}" for i in range(prompts)]


async def test_hanging_abort_endpoint_queues_at_most_max_queued_ids_then_drains(
        engine: FakeEngine, start_sidecar: Callable[..., Any], caplog: pytest.LogCaptureFixture,
        stalls: Stalls) -> None:
    """The first request fills every call slot (8 calls hang); the next ones wait until the
    queue holds exactly ``MAX_QUEUED_IDS``; one more request, no smaller than any waiting one,
    is dropped (a smaller one would make the largest give way: the next test). When the endpoint
    recovers,
    every waiting id goes out exactly once."""
    caplog.set_level(logging.INFO)
    engine.record.abort_gate = gate = asyncio.Event()  # every abort call hangs until set
    engines = {FAILING: {"kind": "vllm", "url": engine.url,
                         "abort": {"api_key": API_KEY, "timeout_s": 60.0,
                                   "resend_window_s": 0,
                                   # one call per id: confirmation (its re-sends) off
                                   "confirm_timeout_s": 0}}}
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, engines=engines, routes=[{"prefix": "/", "engine": FAILING}]))
    port, admin = servers.proxy_port, servers.admin_port or 0
    in_flight = MAX_CALLS_PER_ENGINE * MAX_IDS_PER_CALL  # 4096 ids in the hanging calls
    big = 4000
    fills, rest = divmod(MAX_QUEUED_IDS, big)
    plan = [big] + [big] * fills + [rest] + [big]  # 4000 sent; 4 x 4000 + 384 wait; 4000
    assert plan[0] <= in_flight and rest > 0
    streams = [await open_completions(port, stalls, n) for n in plan]

    started = time.monotonic()
    for k, (client, _) in enumerate(streams, 1):
        client.disconnect("rst")
        await wait_metric(stalls, admin, "cancel_sidecar_client_disconnects_total", k,
                          route="/", phase="streaming")
        if k == 1:  # its ids fill every slot before the next request is cut
            await stalls.wait(engine.watch.until(
                partial(calls_at, engine, MAX_CALLS_PER_ENGINE), FOREVER),
                f"{MAX_CALLS_PER_ENGINE} abort calls at the engine")
    dropped_rid = streams[-1][1]
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1,
                      engine=FAILING, outcome="dropped")
    queued_by = time.monotonic()
    sent_while_hanging = sum(len(a.ids) for a in engine.record.aborts)
    calls_while_hanging = len(engine.record.aborts)
    warnings = [r.getMessage() for r in caplog.records if r.name == "sidecar.abort"
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and dropped_rid in warnings[0] and "full" in warnings[0], (
        f"expected one WARNING naming the dropped request {dropped_rid}, got {warnings}")
    line = access_lines(caplog).get(dropped_rid)
    assert line is not None and line["abort"] == "dropped", (
        f"expected the dropped request's access line with abort=dropped, got {line}")
    assert (calls_while_hanging, sent_while_hanging) == (MAX_CALLS_PER_ENGINE, plan[0]), (
        f"expected {MAX_CALLS_PER_ENGINE} calls carrying {plan[0]} ids while the endpoint "
        f"hangs, got {calls_while_hanging} carrying {sent_while_hanging}")

    gate.set()  # the endpoint recovers
    kept = len(plan) - 1
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", kept,
                      engine=FAILING, outcome="accepted")
    drained = time.monotonic()
    calls = engine.watch.on(ABORT_PATH)
    overlap = max(sum(1 for c in calls if c.started <= s.started < (c.ended_at or 1e18))
                  for s in calls)
    sizes = [len(a.ids) for a in engine.record.aborts]
    print(f"[queue bound] {sum(plan)} ids cut: {sent_while_hanging} in {calls_while_hanging} "
          f"hanging calls, {MAX_QUEUED_IDS} queued, {plan[-1]} dropped "
          f"({ms(queued_by - started)}{stalls.note(started, queued_by)}); after recovery "
          f"{len(calls) - calls_while_hanging} more calls, drained in {ms(drained - queued_by)}, "
          f"at most {overlap} in flight")
    named = Counter(engine.record.aborted_ids())
    wanted = [i for (_, rid), n in zip(streams[:-1], plan[:-1], strict=True)
              for i in engine_ids(rid, n)]
    assert len(wanted) == plan[0] + MAX_QUEUED_IDS
    assert set(named) == set(wanted), (
        f"expected exactly the {len(wanted)} ids of the kept requests named; missing "
        f"{len(set(wanted) - set(named))}, unexpected {sorted(set(named) - set(wanted))[:5]}")
    twice = {i: n for i, n in named.items() if n > 1}
    assert not twice, f"expected every id named once; named more often: {list(twice)[:5]}"
    assert max(sizes) <= MAX_IDS_PER_CALL and overlap <= MAX_CALLS_PER_ENGINE, (sizes, overlap)
    values = await metrics(admin)
    requests = engine_samples(values, "cancel_sidecar_aborted_requests_total", FAILING)
    assert requests == {"accepted": kept, "dropped": 1}, f"aborted_requests_total: got {requests}"
    calls_by = engine_samples(values, "cancel_sidecar_abort_calls_total", FAILING)
    assert calls_by == {"accepted": len(calls)}, f"abort_calls_total: got {calls_by}"
    lines = access_lines(caplog)
    outcomes = Counter(lines[rid]["abort"] for _, rid in streams)
    assert outcomes == {"accepted": kept, "dropped": 1}, f"access lines: got {outcomes}"
    assert_no_key(caplog)


async def test_one_huge_request_never_crowds_out_small_ones(
        engine: FakeEngine, start_sidecar: Callable[..., Any], caplog: pytest.LogCaptureFixture,
        stalls: Stalls) -> None:
    """A hostile tester's attack: one client's completion with a prompt list as long as the whole
    queue, cut while the abort endpoint hangs, then small requests cut: the huge one gives way
    (``dropped``), every small one is aborted once the endpoint recovers."""
    caplog.set_level(logging.INFO)
    engine.record.abort_gate = gate = asyncio.Event()
    engines = {FAILING: {"kind": "vllm", "url": engine.url,
                         "abort": {"api_key": API_KEY, "timeout_s": 60.0,
                                   "resend_window_s": 0,
                                   # one call per id: confirmation (its re-sends) off
                                   "confirm_timeout_s": 0}}}
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, engines=engines, routes=[{"prefix": "/", "engine": FAILING}]))
    port, admin = servers.proxy_port, servers.admin_port or 0
    in_flight = MAX_CALLS_PER_ENGINE * MAX_IDS_PER_CALL
    plan = [in_flight, MAX_QUEUED_IDS, 1, 1, 1, 2]  # fill the slots; fill the queue; victims
    streams = [await open_completions(port, stalls, n) for n in plan]
    for k, (client, _) in enumerate(streams, 1):
        client.disconnect("rst")
        await wait_metric(stalls, admin, "cancel_sidecar_client_disconnects_total", k,
                          route="/", phase="streaming")
        if k == 1:
            await stalls.wait(engine.watch.until(
                partial(calls_at, engine, MAX_CALLS_PER_ENGINE), FOREVER),
                f"{MAX_CALLS_PER_ENGINE} abort calls at the engine")
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1,
                      engine=FAILING, outcome="dropped")
    gate.set()
    victims = streams[2:]
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1 + len(victims),
                      engine=FAILING, outcome="accepted")
    named = Counter(engine.record.aborted_ids())
    huge_rid = streams[1][1]
    for (_, rid), n in zip(victims, plan[2:], strict=True):
        assert all(named[i] == 1 for i in engine_ids(rid, n)), (
            f"expected the small request {rid} aborted once, got "
            f"{[named[i] for i in engine_ids(rid, n)]}")
    assert not any(i.startswith(f"cmpl-{huge_rid}-") for i in named), (
        "the huge request gave way: none of its ids is sent")
    lines = access_lines(caplog)
    assert lines[huge_rid]["abort"] == "dropped", lines[huge_rid]
    assert [lines[rid]["abort"] for _, rid in victims] == ["accepted"] * len(victims), lines
    assert_no_key(caplog)


def registry_samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.labels.get("outcome", ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and s.value}


async def test_aborts_pending_at_stop_end_cancelled(
        engine: FakeEngine, start_sidecar: Callable[..., Any], caplog: pytest.LogCaptureFixture,
        stalls: Stalls) -> None:
    """Every slot holds a hanging call and one more request waits behind them; the sidecar
    stops: after ``ABORT_DRAIN_S`` all of them end ``cancelled``, counted and logged."""
    caplog.set_level(logging.INFO)
    engine.record.abort_gate = asyncio.Event()  # never set: the endpoint hangs
    engines = {"local": {"kind": "vllm", "url": engine.url,
                         "abort": {"api_key": API_KEY, "timeout_s": 60.0,
                                   "resend_window_s": 0,
                                   # one call per id: confirmation (its re-sends) off
                                   "confirm_timeout_s": 0}}}
    registry = CollectorRegistry()
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, engines=engines),
                                           registry)
    admin = servers.admin_port or 0
    cut = MAX_CALLS_PER_ENGINE + 1
    streams = [await open_completions(servers.proxy_port, stalls, 1) for _ in range(cut)]
    for k, (client, _) in enumerate(streams, 1):
        client.disconnect("rst")
        if k <= MAX_CALLS_PER_ENGINE:
            await stalls.wait(engine.watch.until(partial(calls_at, engine, k), FOREVER),
                              f"abort call {k} at the engine")
    await wait_metric(stalls, admin, "cancel_sidecar_client_disconnects_total", cut,
                      route="/", phase="streaming")

    started = time.monotonic()
    await servers.stop(grace_s=1.0)
    stopped = time.monotonic()
    took = stalls.check("the stop", started, stopped, ABORT_DRAIN_S + 2 * GUARD_S)
    print(f"[stop] {MAX_CALLS_PER_ENGINE} hanging calls + 1 waiting request: stopped in "
          f"{ms(took)} (ABORT_DRAIN_S={ABORT_DRAIN_S}){stalls.note(started, stopped)}")
    requests = registry_samples(registry, "cancel_sidecar_aborted_requests_total")
    assert requests == {"cancelled": cut}, (
        f"aborted_requests_total: expected {cut} cancelled, got {requests}")
    calls = registry_samples(registry, "cancel_sidecar_abort_calls_total")
    assert calls == {}, f"expected no call counted (none was answered), got {calls}"
    lines = access_lines(caplog)
    outcomes = {rid: lines.get(rid, {}).get("abort") for _, rid in streams}
    assert set(outcomes.values()) == {"cancelled"}, f"access lines: got {outcomes}"
    assert len(engine.watch.on(ABORT_PATH)) == MAX_CALLS_PER_ENGINE, (
        "expected the waiting request never sent")
    assert_no_key(caplog)


async def test_a_call_keeps_its_slot_while_it_backs_off(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """Every slot holds a call that will answer 503; one more request waits. The 503s come
    together, and the waiting request's call goes out only after a retry was sent (it got a
    slot a retried call gave up), never during the backoff."""
    engine.record.abort_gate = gate = asyncio.Event()
    engine.record.abort_script = [503] * MAX_CALLS_PER_ENGINE  # then 200: the retries succeed
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, confirm=False))
    admin = servers.admin_port or 0
    streams = [await open_completions(servers.proxy_port, stalls, 1)
               for _ in range(MAX_CALLS_PER_ENGINE + 1)]
    for k, (client, _) in enumerate(streams[:-1], 1):
        client.disconnect("rst")
        await stalls.wait(engine.watch.until(partial(calls_at, engine, k), FOREVER),
                          f"abort call {k} at the engine")
    streams[-1][0].disconnect("rst")
    await wait_metric(stalls, admin, "cancel_sidecar_client_disconnects_total",
                      len(streams), route="/", phase="streaming")
    gate.set()
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", len(streams),
                      engine="local", outcome="accepted")

    waiting_id = f"cmpl-{streams[-1][1]}-0"
    first = {f"cmpl-{rid}-0" for _, rid in streams[:-1]}
    retries = [a for a in engine.record.aborts[MAX_CALLS_PER_ENGINE:] if set(a.ids) <= first]
    waiting = [a for a in engine.record.aborts if waiting_id in a.ids]
    print(f"[backoff slot] {len(retries)} retries; the waiting request's call arrived "
          f"{ms(waiting[0].at - min(r.at for r in retries))} after the first retry")
    assert len(retries) == MAX_CALLS_PER_ENGINE and len(waiting) == 1, (
        f"expected {MAX_CALLS_PER_ENGINE} retries and one call for the waiting request, got "
        f"{[a.ids for a in engine.record.aborts]}")
    assert waiting[0].at > min(r.at for r in retries), (
        "expected the waiting request's call only after a retried call gave its slot up; it "
        "went out during the backoff")
    values = await metrics(admin)
    calls = engine_samples(values, "cancel_sidecar_abort_calls_total", "local")
    assert calls == {"http_503": MAX_CALLS_PER_ENGINE, "accepted": MAX_CALLS_PER_ENGINE + 1}, calls


async def test_a_redirect_is_never_followed(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """An abort endpoint answering ``307 Location: <another engine>``: the ids go nowhere else
    (no call reaches the other engine), the outcome is ``http_307``, not ``ok``, and ``/readyz``
    says what to fix. Following it would send the ids to another origin and report an abort
    that never happened."""
    elsewhere = FakeEngine()
    await elsewhere.start()
    try:
        engine.record.abort_redirect = f"{elsewhere.url}{ABORT_PATH}"
        servers: Servers = await start_sidecar(sidecar_settings(engine.url))
        async with raw_client(servers.proxy_port, stalls) as c:
            c.send("POST", f"{CHAT}?tokens=1000", request_body({"messages": []}, True))
            await c.head()
            await c.read_until(b"data:")
            c.disconnect("rst")
            await upstream_closed(engine, stalls)
        admin = servers.admin_port or 0
        await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1,
                          engine="local", outcome="http_307")
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}/readyz") as r:
            verdict = await r.json()
        assert r.status == 503 and "answered 307" in verdict["engines"]["local"], verdict
        assert len(engine.record.aborts) == 1, "a 307 is not retried"
        assert elsewhere.record.aborts == [] and elsewhere.record.probes == [], (
            "the redirect was followed: the ids reached another engine")
    finally:
        await elsewhere.stop()
