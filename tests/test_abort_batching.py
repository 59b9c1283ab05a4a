"""Abort batching under a disconnect storm, through the production wiring.

The bug this guards: with one abort call per request, a 64-connection abort pool and
``abort.timeout_s`` counting the wait for a pooled connection, 400 streams cut at once against an
abort endpoint answering after 0.5 s lost half their aborts as ``timeout`` (the engine never got
those calls). Now ids of requests that disconnect together go out in a few large calls, at most
``MAX_CALLS_PER_ENGINE`` at once, and every request's outcome is counted.

Clients are raw sockets, cut with a TCP reset (SO_LINGER 0 + ``transport.abort()``) all in the
same event-loop turn; the engine is :mod:`tests.fakes.engine` with ``abort_delay`` set. Run with
``-s`` to see the numbers. The first calls' batching is the subject: confirmation (its re-sends
until the engine ends each request, ``tests/test_confirmed_aborts.py``) is off here
(``abort.confirm_timeout_s: 0``), so every id is named exactly once and ends ``accepted``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from engine.vllm import MAX_IDS_PER_CALL
from sidecar.abort_queue import MAX_CALLS_PER_ENGINE
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import ABORT_PATH, FakeEngine
from tests.harness.support import (
    COMPLETIONS,
    GUARD_S,
    WAIT_S,
    RawClient,
    Stalls,
    metrics,
    ms,
    request_body,
    samples,
    wait_metric,
)

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
CUT = 400  # streams cut at once
COMPLETE = 50  # streams that run to their end meanwhile
ABORT_DELAY_S = 0.5  # the engine's abort endpoint answers after this
CONNECT_AT_ONCE = 64  # connections opened concurrently while setting up (listen backlog)




@dataclass
class Storm:
    cut_ids: list[str]  # engine request ids of the streams cut
    completed_ids: list[str]  # engine request ids of the streams that completed
    last_close: float  # time.monotonic() of the last client reset


async def open_stream(port: int, stalls: Stalls, query: str) -> tuple[RawClient, str]:
    """A chat stream on a raw socket, read up to its first SSE event; returns the client and
    the engine request id (``chatcmpl-<sidecar id>``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = RawClient(reader, writer, stalls)
    client.send("POST", f"{CHAT}?{query}", request_body({"messages": []}, True))
    status, head = await client.head()
    assert status == 200, f"expected a 200 stream, got {status}"
    await client.read_until(b"data:")
    return client, f"chatcmpl-{head['X-Request-Id']}"


def reset(client: RawClient) -> None:
    sock = client.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.writer.transport.abort()


async def storm(port: int, stalls: Stalls, cut: int, complete: int) -> Storm:
    """Open ``cut`` endless streams, start ``complete`` short ones, reset the ``cut`` ones in
    one event-loop turn, then read the short ones to their end."""
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)

    async def opened(query: str) -> tuple[RawClient, str]:
        async with gate:
            return await open_stream(port, stalls, query)

    endless = await asyncio.gather(*(opened("tokens=100000&interval=0.2") for _ in range(cut)))
    short = await asyncio.gather(*(opened("tokens=15&interval=0.05") for _ in range(complete)))
    for client, _ in endless:
        reset(client)
    last_close = time.monotonic()

    async def finish(client: RawClient) -> None:
        await client.read_until(b"data: [DONE]\n\n")
        await client.read_until(b"0\r\n\r\n")  # the chunked body's end
        client.writer.close()

    await stalls.wait(asyncio.gather(*(finish(c) for c, _ in short)),
                      f"{complete} short streams to complete")
    return Storm([i for _, i in endless], [i for _, i in short], last_close)


async def until_aborted(engine: FakeEngine, stalls: Stalls, ids: list[str]) -> None:
    """Wait until the engine has answered abort calls naming every one of ``ids``."""
    wanted = set(ids)
    done = await stalls.wait(
        engine.watch.until(lambda: wanted <= set(engine.record.aborted_ids()), WAIT_S),
        f"abort calls naming all {len(wanted)} cut requests")
    named = wanted & set(engine.record.aborted_ids())
    assert done, (f"expected all {len(wanted)} cut requests named in abort calls within "
                  f"{WAIT_S}s; got {len(named)} in {len(engine.record.aborts)} call(s)")


async def test_disconnect_storm_aborts_every_request_in_few_calls(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    engine.record.abort_delay = ABORT_DELAY_S
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, confirm=False))
    port, admin = servers.proxy_port, servers.admin_port or 0

    run = await storm(port, stalls, CUT, COMPLETE)
    await until_aborted(engine, stalls, run.cut_ids)
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", CUT,
                      engine="local", outcome="accepted")

    aborts = engine.record.aborts
    named = Counter(engine.record.aborted_ids())
    last_call = max(a.at for a in aborts)
    print(f"[storm] {CUT} streams cut, {COMPLETE} completed: {len(aborts)} abort call(s) "
          f"(sizes {[len(a.ids) for a in aborts]}); last client close -> last abort call "
          f"{ms(last_call - run.last_close)}{stalls.note(run.last_close, last_call)}")
    twice = {i: n for i, n in named.items() if n > 1}
    assert not twice, f"expected every id named once; named more often: {twice}"
    missing = set(run.cut_ids) - set(named)
    assert not missing, f"expected all {CUT} cut requests aborted; missing {len(missing)}"
    completed = set(run.completed_ids) & set(named)
    assert not completed, f"expected no completed request aborted; got {sorted(completed)}"
    strangers = set(named) - set(run.cut_ids)
    assert not strangers, f"expected only the cut requests' ids; also got {sorted(strangers)}"
    assert all(a.ids for a in aborts), "expected no abort call with an empty id list"
    assert len(aborts) <= CUT // 10, (
        f"expected the {CUT} aborts batched into at most {CUT // 10} calls, got {len(aborts)}")
    values = await metrics(admin)
    calls = samples(values, "cancel_sidecar_abort_calls_total")
    assert calls == {frozenset({("engine", "local"), ("outcome", "accepted")}): len(aborts)}, (
        f"expected {len(aborts)} ok calls and no timeout, got {calls}")


async def test_lone_disconnect_is_aborted_at_once(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, confirm=False))
    client, engine_id = await open_stream(servers.proxy_port, stalls, "tokens=100000")
    reset(client)
    at = time.monotonic()
    await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
    arrived = engine.record.aborts[0].at
    took = stalls.check("the abort call of a lone disconnect", at, arrived, GUARD_S)
    print(f"[lone] client reset -> abort call {ms(took)}{stalls.note(at, arrived)}")
    assert engine.record.aborts[0].ids == [engine_id], (
        f"expected one call naming {engine_id}, got {[a.ids for a in engine.record.aborts]}")


async def test_metrics_count_requests_and_calls_apart(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    cut, complete = 120, 10
    engine.record.abort_delay = 0.3
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, confirm=False))
    port, admin = servers.proxy_port, servers.admin_port or 0

    run = await storm(port, stalls, cut, complete)
    await until_aborted(engine, stalls, run.cut_ids)
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", cut,
                      engine="local", outcome="accepted")
    values = await metrics(admin)
    received = len(engine.record.aborts)
    print(f"[metrics] {cut} requests aborted in {received} call(s)")
    requests = samples(values, "cancel_sidecar_aborted_requests_total")
    assert requests == {frozenset({("engine", "local"), ("outcome", "accepted")}): cut}, (
        f"aborted_requests_total: expected {cut} ok, got {requests}")
    calls = samples(values, "cancel_sidecar_abort_calls_total")
    assert calls == {frozenset({("engine", "local"), ("outcome", "accepted")}): received}, (
        f"abort_calls_total: expected the {received} calls the engine received, got {calls}")
    latency = samples(values, "cancel_sidecar_abort_latency_seconds_count")
    assert latency == {frozenset({("engine", "local")}): cut}, (
        f"abort_latency_seconds: expected one observation per request ({cut}), got {latency}")
    disconnects = samples(values, "cancel_sidecar_client_disconnects_total")
    assert sum(disconnects.values()) == cut, (
        f"client_disconnects_total: expected {cut}, got {disconnects}")
    assert received <= cut // 10, (
        f"expected at most {cut // 10} calls for {cut} requests, got {received}")


def calls_seen(engine: FakeEngine, count: int) -> bool:
    return len(engine.watch.on(ABORT_PATH)) >= count


async def test_calls_in_flight_are_bounded_and_the_slot_wait_is_not_timed(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """``MAX_CALLS_PER_ENGINE`` single-request waves fill every slot; four more waves wait and
    go out together in the next call. The waiting ones need about 2 x ``abort_delay`` in all,
    more than ``timeout_s``: they still end ok, since the timeout bounds the call alone."""
    delay_s, timeout_s, extra = 0.8, 1.2, 4
    engine.record.abort_delay = delay_s
    engines = {"local": {"kind": "vllm", "url": engine.url, "abort": {"timeout_s": timeout_s,
                                                                    "resend_window_s": 0,
                                                                    "confirm_timeout_s": 0}}}
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, engines=engines))
    port, admin = servers.proxy_port, servers.admin_port or 0
    waves = MAX_CALLS_PER_ENGINE + extra
    streams = [await open_stream(port, stalls, "tokens=100000&interval=0.2")
               for _ in range(waves)]
    started = time.monotonic()
    for k, (client, _) in enumerate(streams, 1):
        reset(client)
        if k <= MAX_CALLS_PER_ENGINE:  # wait for its own call to reach the engine
            seen = await engine.watch.until(partial(calls_seen, engine, k), WAIT_S)
            assert seen, f"expected abort call {k} at the engine within {WAIT_S}s"
        else:  # no slot is free: wait for the sidecar to have queued it
            await wait_metric(stalls, admin, "cancel_sidecar_client_disconnects_total", k,
                              route="/", phase="streaming")
    queued_by = time.monotonic()
    ids = [i for _, i in streams]
    await until_aborted(engine, stalls, ids)
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", waves,
                      2 * timeout_s + WAIT_S, engine="local", outcome="accepted")

    calls = engine.watch.on(ABORT_PATH)
    overlap = max(sum(1 for c in calls if c.started <= s.started < (c.ended_at or 1e18))
                  for s in calls)
    sizes = [len(a.ids) for a in engine.record.aborts]
    print(f"[slots] {waves} waves: {len(calls)} calls, sizes {sizes}, at most {overlap} in "
          f"flight{stalls.note(started, queued_by)}")
    assert overlap <= MAX_CALLS_PER_ENGINE, (
        f"expected at most {MAX_CALLS_PER_ENGINE} abort calls in flight, got {overlap}")
    named = Counter(engine.record.aborted_ids())
    assert sorted(named) == sorted(ids) and set(named.values()) == {1}, (
        f"expected each of the {waves} ids named once, got {dict(named)}")
    if queued_by - started - stalls.within(started, queued_by) < delay_s / 2:
        assert sizes[MAX_CALLS_PER_ENGINE:] == [extra], (
            f"expected the {extra} waiting requests in one call after the first "
            f"{MAX_CALLS_PER_ENGINE}, got call sizes {sizes}")
    values = await metrics(admin)
    outcomes = samples(values, "cancel_sidecar_abort_calls_total")
    assert outcomes == {frozenset({("engine", "local"), ("outcome", "accepted")}): len(calls)}, (
        f"expected {len(calls)} ok calls and no timeout (slot wait not timed), got {outcomes}")


@pytest.mark.parametrize("chunk_fails", [False, True], ids=["all-ok", "one-chunk-500"])
async def test_request_with_more_ids_than_one_call_is_split_naming_each_once(
        engine: FakeEngine, start_sidecar: Callable[..., Any], caplog: pytest.LogCaptureFixture,
        stalls: Stalls, chunk_fails: bool) -> None:
    """A ``/v1/completions`` request of 1300 prompts has 1300 engine ids: the ``Aborter`` splits
    them over calls of at most ``MAX_IDS_PER_CALL``, each id named once. The request gets one
    outcome: ok, or the first call's failure (500 is never retried)."""
    caplog.set_level(logging.INFO)
    prompts = 2 * MAX_IDS_PER_CALL + 276
    if chunk_fails:
        engine.record.abort_script = [200, 500]  # the second call to arrive fails
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, confirm=False))
    port, admin = servers.proxy_port, servers.admin_port or 0
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = RawClient(reader, writer, stalls)
    client.send("POST", f"{COMPLETIONS}?tokens=100000&interval=0.2",
                request_body({"prompt": ["p"] * prompts}, True))
    status, head = await client.head()
    assert status == 200, f"expected a 200 stream, got {status}"
    await client.read_until(b"data:")
    rid = head["X-Request-Id"]
    reset(client)
    outcome = "http_500" if chunk_fails else "accepted"
    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", 1,
                      engine="local", outcome=outcome)

    sizes = sorted(len(a.ids) for a in engine.record.aborts)
    print(f"[split] {prompts} ids in calls of {sizes}")
    assert sizes == [prompts - 2 * MAX_IDS_PER_CALL, MAX_IDS_PER_CALL, MAX_IDS_PER_CALL], (
        f"expected {prompts} ids split into calls of at most {MAX_IDS_PER_CALL}, got {sizes}")
    named = Counter(engine.record.aborted_ids())
    assert named == Counter(f"cmpl-{rid}-{i}" for i in range(prompts)), (
        f"expected each of cmpl-{rid}-0..{prompts - 1} named once; got {len(named)} distinct, "
        f"{sum(named.values())} in all")
    values = await metrics(admin)
    requests = samples(values, "cancel_sidecar_aborted_requests_total")
    assert requests == {frozenset({("engine", "local"), ("outcome", outcome)}): 1}, (
        f"aborted_requests_total: expected one request, {outcome}; got {requests}")
    calls = {dict(k)["outcome"]: v
             for k, v in samples(values, "cancel_sidecar_abort_calls_total").items()}
    assert calls == ({"accepted": 2, "http_500": 1} if chunk_fails else {"accepted": 3}), calls
    latency = samples(values, "cancel_sidecar_abort_latency_seconds_count")
    assert sum(latency.values()) == (0 if chunk_fails else 1), (
        f"abort_latency_seconds: expected one observation only if ok, got {latency}")
    lines = [r.__dict__["access"] for r in caplog.records if r.name == "sidecar.access"]
    assert len(lines) == 1 and lines[0]["abort"] == outcome, (
        f"expected one access line with abort={outcome}, got {lines}")
