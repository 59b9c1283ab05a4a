"""Confirmed aborts: behind N API-server processes the abort reaches the owner, and the engine's
own word (the request's response ending aborted) is what stops the re-sends.

vLLM run as ``vllm serve --api-server-count N`` answers 200 to an abort that reaches another
process than the request's owner and changes nothing (``../shared/notes/cancellation-facts.md``).
The fake of ``tests/fakes/kinds.py`` plays that (``VLLMEngine(api_servers=N, accept=...)``: each
connection belongs to one process, chosen skewed towards idle ones; ``AbortCall.missed``) and,
like vLLM, ends an aborted response at once with ``"finish_reason": "abort"``. "Stopped" is read
at the engine (``Work``), never from the sidecar's logs.

- ``test_no_engine_id_outlives_its_client_behind_n_processes`` (N = 1, 2, 8): streaming chat,
  JSON chat and a 4-prompt streaming completion, each left by RST, FIN and half-close at
  instants from the last body byte (inside the registration window: the engine registers the ids
  20 ms after the body) to mid-generation, with bystanders read to their end: every id stopped,
  none ran on, no bystander id ever named, calls per request within ``abort.max_calls``, every
  outcome ``confirmed``; with N > 1 some calls missed (the case exists) and were re-sent.
- ``test_storm_behind_8_processes_through_the_cli``: 400 streams through ``python -m sidecar``,
  200 reset at once: all 200 stopped, the other 200 byte-identical to their end.
- ``test_registration_race_confirmed_with_fewer_calls``: one process, ids registered 50 ms after
  the body, the client gone at once: confirmed, in fewer calls than the blind schedule of a
  2 s window (:func:`tests.harness.support.max_calls`).
- ``test_first_call_fans_out_once_several_processes_seen`` (N = 1, 4): clients that leave one
  after another; behind 4 processes, once a request needed 2 re-sends, every first call goes on
  ``abort.fanout`` connections at once; behind one, one call per request.
- ``test_abort_connections_last_through_idle_spells_and_bursts``: behind 8 processes that
  give a new connection to the one with the fewest (vLLM 0.32), the 16 abort connections of
  startup (2 per process) stay the same connections through idle spells (kept alive with
  ``GET /version``) and a burst of 48 aborts (its extra connections closed after it).
- ``test_unconfirmed_after_the_bound`` and ``test_finished_when_the_engine_ends_first``: the
  other two verdicts, their metric, WARNING and upstream close.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from sidecar.abort_wire import RECYCLE_S
from sidecar.config import parse_config
from sidecar.server import Servers
from tests.fakes.engine import FakeEngine
from tests.fakes.kinds import VLLMEngine, Work, stream_bytes
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.rawhttp import dechunk
from tests.harness.support import (
    API_KEY,
    FOREVER,
    Stalls,
    max_calls,
    metrics,
    ms,
    raw_client,
    request_body,
    sample,
    settle,
    wait_metric,
)

pytestmark = pytest.mark.timeout(120)

GEN = "tokens=150&interval=0.02"  # 3 s once registered: a missed abort shows as ran_to_end
REGISTER_S = 0.02
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
ROUTES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "chat-stream": ("/v1/chat/completions", CHAT, True),
    "chat-json": ("/v1/chat/completions", CHAT, False),
    "completions-4": ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, True),
}
# seconds after the last body byte (0: the same step; 0.01: the engine registering; later:
# generating)
INSTANTS = {"0": 0.0, "10ms": 0.01, "100ms": 0.1, "500ms": 0.5}
HOWS = ("rst", "fin", "half")
MAX_CALLS = 64  # the default engines.*.abort.max_calls
STEP_S = 0.01  # between launching two clients
ACCEPT = "least_connections"  # vLLM 0.32: tests/e2e/probe_api_servers.py


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[VLLMEngine]]:
    """Requested before ``start_sidecar``: stopped after the sidecar."""
    started: list[VLLMEngine] = []
    yield started
    for fake in started:
        await fake.stop()


async def deploy(fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], processes: int,
                 upstream: dict[str, Any] | None = None,
                 **abort: Any) -> tuple[VLLMEngine, Servers]:
    """A fake vLLM of ``processes`` API-server processes and a sidecar in front of it with the
    ``abort`` settings (and ``upstream``'s, if given), its abort connections warm."""
    fake = VLLMEngine(API_KEY, api_servers=processes, accept=ACCEPT, seed=processes)
    await fake.start()
    fakes.append(fake)
    sections: dict[str, Any] = {} if upstream is None else {"upstream": upstream}
    tree = config_tree(fake.url, api_key=API_KEY, log_level="WARNING", engines={"local": {
        "kind": "vllm", "url": fake.url, "abort": {"api_key": API_KEY, **abort}}}, **sections)
    servers: Servers = await start_sidecar(parse_config(yaml.safe_dump(tree), "<test>", env={}))
    await warm(fake)
    return fake, servers


async def warm(fake: VLLMEngine, connections: int = 16) -> None:
    """Wait for the sidecar's warm abort connections (``abort.connections``, opened apart) to be
    open at the engine, as a deployment's are before traffic: each was accepted by the process
    with the fewest connections then, so every process holds some (vLLM 0.32's launcher)."""
    assert await fake.watch.until(lambda: len(fake.connections) >= connections, 5.0), (
        f"expected {connections} abort connections, the engine saw {len(fake.connections)}")


def by_tag(fake: VLLMEngine, tag: str) -> Work | None:
    return next((w for w in fake.works
                 if isinstance(w.body, dict) and w.body.get("tag") == tag), None)


def idle(work: Work) -> bool:
    return not work.running


def calls_naming(fake: VLLMEngine, engine_id: str) -> int:
    return sum(engine_id in c.ids for c in fake.calls)


async def leave(port: int, stalls: Stalls, route: str, instant: str, how: str, tag: str,
                query: str) -> None:
    path, body, stream = ROUTES[route]
    async with raw_client(port, stalls) as c:
        c.send("POST", f"{path}?{query}", request_body({**body, "tag": tag}, stream),
               [("X-Request-Id", tag)])
        if INSTANTS[instant]:
            await asyncio.sleep(INSTANTS[instant])  # the instant under test
        c.disconnect(how)
        if how == "half":
            await stalls.wait(c.reader.read(), f"{tag}: the sidecar to close after EOF")


async def bystander(port: int, route: str, tag: str) -> str:
    path, body, stream = ROUTES[route]
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}{path}?tokens=10&interval=0.01",
            json={**body, "stream": stream, "tag": tag}, headers={"X-Request-Id": tag}) as r:
        text = await r.text()
        assert r.status == 200, f"bystander {tag}: {r.status} {text[:200]}"
        return text


@pytest.mark.parametrize("processes", [1, 2, 8])
async def test_no_engine_id_outlives_its_client_behind_n_processes(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls,
        processes: int) -> None:
    fake, servers = await deploy(fakes, start_sidecar, processes)
    port, admin = servers.proxy_port, servers.admin_port or 0
    cases = [(r, i, h) for r in ROUTES for i in INSTANTS for h in HOWS]
    random.Random(processes).shuffle(cases)
    jobs: list[Coroutine[Any, Any, str | None]] = []
    for n, (route, instant, how) in enumerate(cases):
        tag = f"v{n}-{route}-{instant}-{how}"
        jobs.append(leave(port, stalls, route, instant, how, tag,
                          f"{GEN}&register_delay={REGISTER_S}"))
        if n % 6 == 0:
            jobs.append(bystander(port, route, f"bystander{n}-{route}"))
    results = await asyncio.gather(*(_later(n * STEP_S, j) for n, j in enumerate(jobs)))
    answers = [r for r in results if r is not None]
    assert all(r.endswith("data: [DONE]\n\n") or (r.startswith("{") and json.loads(r)[
        "choices"][0]["finish_reason"] == "stop") for r in answers), (
        f"a bystander did not get its whole answer: {[r[-80:] for r in answers]}")

    victims = {tag: w for n, (route, instant, how) in enumerate(cases)
               if (w := by_tag(fake, tag := f"v{n}-{route}-{instant}-{how}")) is not None}
    assert len(victims) >= len(cases) - 9, (
        f"expected the engine to get (nearly) every body whole, got {len(victims)} of "
        f"{len(cases)}")  # the 0 ms instant may cut the body before the engine has it
    await stalls.wait(fake.watch.until(lambda: not any(w.running for w in victims.values()),
                                       FOREVER), "every victim stopped at the engine", 10.0)
    problems = []
    for tag, work in victims.items():
        if work.ran_to_end or work.stopped_at is None:
            problems.append(f"{tag}: ran to its end {sorted(work.ran_to_end)} (process "
                            f"{work.process}, missed {work.missed}, ignored {work.ignored})")
        for engine_id in work.engine_ids:
            count = calls_naming(fake, engine_id)
            if not 1 <= count <= MAX_CALLS:
                problems.append(f"{tag}: {count} calls named {engine_id}, expected 1..{MAX_CALLS}")
    named = {i for c in fake.calls for i in c.ids}
    for work in fake.works:
        if isinstance(work.body, dict) and str(work.body.get("tag", "")).startswith("bystander"):
            assert not named & set(work.engine_ids), f"a bystander's id was named: {work}"
    by_process = Counter(c.process for c in fake.calls)
    assert not problems, "\n".join([*problems, f"calls per process {sorted(by_process.items())}"])

    await wait_metric(stalls, admin, "cancel_sidecar_aborted_requests_total", len(victims),
                      engine="local", outcome="confirmed")
    values = await metrics(admin)
    for outcome in ("accepted", "unconfirmed", "finished"):
        assert sample(values, "cancel_sidecar_aborted_requests_total", engine="local",
                      outcome=outcome) == 0, f"expected no {outcome} outcome"
    missed = sum(len(c.missed) for c in fake.calls)
    calls = [sum(calls_naming(fake, i) for i in w.engine_ids[:1]) for w in victims.values()]
    print(f"[N={processes}] {len(victims)} victims stopped; calls per request median "
          f"{sorted(calls)[len(calls) // 2]} max {max(calls)}; {missed} ids missed "
          f"(another process), {len(fake.ignored)} ignored (registering)")
    if processes > 1:
        assert missed > 0, "with several processes some calls must have missed (the case)"


async def _later(delay_s: float, job: Any) -> Any:
    await asyncio.sleep(delay_s)  # staggered launch: no burst of connects at t=0
    return await job


async def test_storm_behind_8_processes_through_the_cli(
        fakes: list[VLLMEngine], stalls: Stalls, tmp_path: Path) -> None:
    fake = VLLMEngine(API_KEY, api_servers=8, accept=ACCEPT, seed=8)
    await fake.start()
    fakes.append(fake)
    tree = config_tree(fake.url, api_key=API_KEY, log_level="WARNING", engines={"local": {
        "kind": "vllm", "url": fake.url, "abort": {"api_key": API_KEY}}})
    streams, tokens = 400, 60
    async with cli_process(tmp_path, tree) as cli:
        await warm(fake)
        clients = []
        for n in range(streams):
            c = await asyncio.open_connection("127.0.0.1", cli.proxy_port)
            c[1].write(_raw_post(f"s{n}", f"tokens={tokens}&interval=0.05"))
            clients.append(c)
        firsts = [await stalls.wait(reader.readuntil(b"data:"), "a storm stream's first event")
                  for reader, _ in clients]  # every stream is generating
        for _, writer in clients[::2]:
            writer.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
            writer.transport.abort()
        left = [f"s{n}" for n in range(0, streams, 2)]
        kept = [(f"s{n}", clients[n][0]) for n in range(1, streams, 2)]
        rests = await asyncio.gather(*(stalls.wait(r.read(), f"{t} to its end", 30.0)
                                       for t, r in kept))
        bodies = [firsts[n] + rest for n, rest in zip(range(1, streams, 2), rests, strict=True)]
        await stalls.wait(fake.watch.until(
            lambda: all((w := by_tag(fake, t)) is not None and not w.running for t in left),
            FOREVER), "every reset stream stopped at the engine", 10.0)
        values = await metrics(cli.admin_port)
        for _, writer in clients[1::2]:
            writer.close()
    for tag in left:
        work = by_tag(fake, tag)
        assert work is not None and work.stopped_at is not None and not work.ran_to_end, (
            f"{tag} ran on: {work}")
    for (tag, _), body in zip(kept, bodies, strict=True):
        work = by_tag(fake, tag)
        assert work is not None and work.tag is not None
        expected = stream_bytes(work.tag, tokens)  # the engine's id: the sidecar's
        assert dechunk(body) == expected, f"{tag}: stream not byte-identical"
    named = {i for c in fake.calls for i in c.ids}
    ids = {t: w.engine_ids[0] for t in [*left, *(t for t, _ in kept)]
           if (w := by_tag(fake, t)) is not None}
    assert not named & {ids[t] for t, _ in kept}, "a completed stream's id was named"
    per_request = [calls_naming(fake, ids[t]) for t in left]
    assert max(per_request) <= MAX_CALLS, f"calls per request over the bound: {max(per_request)}"
    confirmed = sample(values, "cancel_sidecar_aborted_requests_total", engine="local",
                       outcome="confirmed")
    print(f"storm: {len(left)} reset, all stopped; calls per request median "
          f"{sorted(per_request)[len(per_request) // 2]} max {max(per_request)}; "
          f"{sum(len(c.missed) for c in fake.calls)} ids missed; confirmed {confirmed}")
    assert confirmed == len(left), f"expected {len(left)} confirmed, got {confirmed}"


_LINGER_RST = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close() sends RST


def _raw_post(tag: str, query: str) -> bytes:
    body = request_body({**CHAT, "tag": tag}, True)
    return (f"POST /v1/chat/completions?{query} HTTP/1.1\r\nHost: x\r\nX-Request-Id: {tag}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body



async def test_registration_race_confirmed_with_fewer_calls(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    fake, servers = await deploy(fakes, start_sidecar, 1, resend_window_s=2.0)
    counts = []
    for n in range(5):
        tag = f"race{n}"
        path, body, _ = ROUTES["chat-stream"]
        async with raw_client(servers.proxy_port, stalls) as c:
            c.send("POST", f"{path}?{GEN}&register_delay=0.05",
                   request_body({**body, "tag": tag}, True))
            work = await _arrived(fake, stalls, tag)  # the engine has the body: leave now
            c.disconnect("rst")
        await stalls.wait(fake.watch.until(partial(idle, work), FOREVER),
                          f"{tag} stopped", 5.0)
        assert not work.ran_to_end and work.ignored, (
            f"expected the first abort ignored (registering) and the id stopped: {work}")
        await asyncio.sleep(0.3)  # any re-send still due would show by now
        counts.append(calls_naming(fake, work.engine_ids[0]))
    blind = max_calls(0.0, 2.0, 0.2)  # today's schedule over a 2 s window, for one id
    print(f"registration race: calls per request {counts} (blind re-sends: up to {blind})")
    assert max(counts) < blind - 2, f"expected fewer calls than the blind {blind}: {counts}"


@pytest.mark.parametrize("processes", [1, 4])
async def test_first_call_fans_out_once_several_processes_seen(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls,
        processes: int, caplog: pytest.LogCaptureFixture) -> None:
    """Clients that leave one after another mid-generation. Behind 4 processes some first
    calls miss, and a request confirmed only after 2 re-sends marks the engine as having
    several processes (one INFO line says so): from then every first call goes at once on
    ``abort.fanout`` (8) connections. Behind one process, never more than one call per request,
    and no such line."""
    caplog.set_level(logging.INFO, logger="sidecar.abort")
    fake, servers = await deploy(fakes, start_sidecar, processes)
    fanned: list[str] = []
    firsts: list[int] = []
    for n in range(30):
        tag = f"f{n}"
        path, body, _ = ROUTES["chat-stream"]
        async with raw_client(servers.proxy_port, stalls) as c:
            c.send("POST", f"{path}?{GEN}", request_body({**body, "tag": tag}, True))
            await stalls.wait(c.reader.readuntil(b"data:"), f"{tag}: its first event")
            work = await _arrived(fake, stalls, tag)
            c.disconnect("rst")
        await stalls.wait(fake.watch.until(partial(idle, work), FOREVER),
                          f"{tag} stopped", 5.0)
        assert not work.ran_to_end, f"{tag} ran on: {work}"
        engine_id = work.engine_ids[0]
        naming = [c.at for c in fake.calls if engine_id in c.ids]
        first = sum(at - naming[0] < 0.005 for at in naming)  # written in the same step
        firsts.append(first)
        if first > 1:
            fanned.append(tag)
        if len(fanned) >= 4:
            break
    print(f"[N={processes}] first calls per request, in order: {firsts}")
    marked = [r.getMessage() for r in caplog.records
              if "taken to have several API-server processes" in r.getMessage()]
    if processes == 1:
        assert firsts == [1] * 30, f"one process: one first call each, got {firsts}"
        assert not marked, f"expected the one-process engine never marked: {marked}"
        return
    assert len(marked) == 1 and "its first abort calls go on 8 connections" in marked[0], (
        f"expected one line saying the engine was marked (not again while marked): {marked}")
    assert fanned, f"the engine was never seen with several processes: {firsts}"
    start = firsts.index(8)
    assert start > 0 and firsts[:start] == [1] * start, (
        f"expected single first calls until the engine was seen with several processes, "
        f"then 8: {firsts}")
    assert firsts[start:] == [8] * (len(firsts) - start), (
        f"expected every first call from then on to fan out on 8 connections: {firsts}")


async def test_abort_connections_last_through_idle_spells_and_bursts(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """Behind 8 processes that give each new connection to the one with the fewest (vLLM
    0.32), the 16 abort connections opened at startup reach every process (2 each). They must
    last: a connection opened later, while some processes hold many streams, goes elsewhere
    than those busy owners. Idle for two recycle periods, every one is still the same open
    connection, kept alive by ``GET /version``; after a burst of 48 clients leaving at once,
    still the same 16 (any connection opened for the burst's calls closed after it), and every
    request stopped."""
    fake, servers = await deploy(fakes, start_sidecar, 8)
    members = [c for c in fake.connections[:16] if c.closed_at is None]
    assert len(members) == 16 and not any(c.paths for c in members), (
        f"expected the 16 abort connections first, unused: {fake.connections}")
    assert Counter(c.process for c in members) == dict.fromkeys(range(8), 2), (
        f"expected 2 abort connections per process at startup: {members}")
    await asyncio.sleep(2 * RECYCLE_S + 1)
    kept = [c for c in members if c.closed_at is None and "/version" in c.paths]
    assert len(kept) == 16, (
        f"expected all 16 abort connections kept open by GET /version over "
        f"{2 * RECYCLE_S + 1:.0f} s idle, got {len(kept)}: {members}")

    before = len(fake.connections)
    tags = [f"b{n}" for n in range(48)]
    path, body, _ = ROUTES["chat-stream"]
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(raw_client(servers.proxy_port, stalls))
                   for _ in tags]
        for c, tag in zip(clients, tags, strict=True):
            c.send("POST", f"{path}?{GEN}", request_body({**body, "tag": tag}, True),
                   [("X-Request-Id", tag)])
        works = [await _arrived(fake, stalls, tag) for tag in tags]
        await stalls.wait(fake.watch.until(
            lambda: all(w.engine_ids[0] in fake.live for w in works), 5.0), "all registered")
        for c in clients:
            c.disconnect("rst")
        await stalls.wait(fake.watch.until(lambda: not any(w.running for w in works),
                                           FOREVER), "every burst request stopped", 10.0)
    ran_on = [w for w in works if w.ran_to_end]
    assert not ran_on, f"{len(ran_on)} requests ran on: {ran_on[:3]}"
    extra = [c for c in fake.connections[before:] if c.path == fake.abort_path]
    await asyncio.sleep(0.2)  # the extra connections' close reaches the engine
    print(f"burst: {len(extra)} abort connections opened beyond the 16, "
          f"{sum(c.closed_at is None for c in extra)} still open")
    gone = [c for c in members if c.closed_at is not None]
    assert not gone, f"the burst closed {len(gone)} of the 16 abort connections: {gone}"
    assert not [c for c in extra if c.closed_at is None], (
        f"expected the connections opened for the burst closed after it: {extra}")


async def _arrived(fake: VLLMEngine, stalls: Stalls, tag: str) -> Work:
    await stalls.wait(fake.watch.until(lambda: by_tag(fake, tag) is not None, FOREVER),
                      f"the engine to get {tag}", 5.0)
    work = by_tag(fake, tag)
    assert work is not None
    return work


async def test_unconfirmed_after_the_bound(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls,
        caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose aborts never reach the request (every call lands on another process):
    re-sent up to max_calls, then ``unconfirmed`` at the bound, a WARNING naming the engine and
    the id, and the upstream closed then (not before)."""
    caplog.set_level(logging.WARNING)
    engine.record.abort_ends = False
    servers = await start_sidecar(_settings(engine, confirm_timeout_s=0.4, max_calls=6))
    async with raw_client(servers.proxy_port, stalls) as c:
        c.send("POST", "/v1/chat/completions?tokens=500&interval=0.01",
               request_body(CHAT, True))
        _, head = await c.head()
        await c.read_until(b"data:")
        left = c.disconnect("rst")
    await stalls.wait(engine.record.closed_event.wait(), "the upstream close at the bound")
    gen = engine.record.generations[-1]
    assert gen.closed_at is not None
    assert gen.closed_at - left >= 0.35, (
        f"the upstream was closed {ms(gen.closed_at - left)} after the client left: before the "
        f"bound of 400 ms")
    rid = head["X-Request-Id"]
    assert len(engine.record.aborts) == 6, (
        f"expected max_calls (6) calls, got {len(engine.record.aborts)}")
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="unconfirmed")
    assert any(r.levelno == logging.WARNING and rid in r.getMessage()
               and "did not confirm" in r.getMessage() and f"chatcmpl-{rid}" in r.getMessage()
               for r in caplog.records), caplog.text


async def test_finished_when_the_engine_ends_first(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """The engine ends the response on its own (finish_reason stop) after the client left and
    before any abort reached it: ``finished``, not ``confirmed``."""
    engine.record.abort_ends = False
    servers = await start_sidecar(_settings(engine))
    async with raw_client(servers.proxy_port, stalls) as c:
        c.send("POST", "/v1/chat/completions?tokens=8&interval=0.02", request_body(CHAT, True))
        await c.head()
        await c.read_until(b"data:")
        c.disconnect("rst")
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="finished")
    await settle(servers.proxy_port)
    gen = engine.record.generations[0]
    assert gen.finished and gen.closed_at is None, f"expected it to end on its own: {gen}"


def _settings(engine: FakeEngine, **abort: Any) -> Any:
    tree = config_tree(engine.url, api_key=API_KEY, log_level="WARNING", engines={"local": {
        "kind": "vllm", "url": engine.url, "abort": {"api_key": API_KEY, **abort}}})
    return parse_config(yaml.safe_dump(tree), "<test>", env={})

