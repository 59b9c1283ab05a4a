"""A soak: many requests, 50 at a time, each cut at a random phase (seeded), through a sidecar in
its own process (:mod:`tests.harness.load.sidecar_process`, production wiring), in front of the
vLLM fake of :mod:`tests.fakes.kinds`, which registers each request's ids a random 0-50 ms after its
whole body arrived (``register_delay``, seeded): an abort before that is a no-op at the engine,
and a request whose connection closed generates for nobody until it is aborted by id or reaches
its last token.

Phases: ``body`` (leave while sending the request body), ``after_body`` (leave in the same loop
step that wrote the last body byte), ``registering`` (the engine has the whole body; leave at a
random point of its registration delay), ``queued`` (the engine, its ids registered, holds the
request in ``first_byte_delay``), ``first_byte`` (the engine generates; the client reads
nothing), ``mid_stream`` (after 1-15 events), ``after_last`` (right after ``data: [DONE]``),
``complete`` (read to the end, checked byte for byte); a client leaves with a TCP reset or an
orderly close (FIN), also chosen at random. Checked per request, with the engine as the ground
truth: a request the engine had whole and whose connection closed before its end is stopped
(every id aborted after its registration) and no id of it runs to its end (``left running``
must be 0), with between 1 and :func:`tests.harness.support.max_calls` calls naming its id (the
documented re-send schedule of the default ``abort`` settings); a completed one (``complete``,
``after_last``) is never named, and one whose body never arrived whole (``body``; maybe
``after_body``) has no work at the engine; a client that left while the engine was finishing
anyway may be named, within the same bound (counted as raced). Then the sidecar process's file
descriptors, its connections to the engine and its asyncio tasks must come back to their levels
before any traffic (right after the last request up to the idle keep-alive pool, at most
``CONCURRENCY`` connections: fds may exceed the baseline by that many; once the proxy pool's
``keepalive_timeout_s`` expired, only the abort calls' pool, at most ``MAX_CALLS_PER_ENGINE``
connections), no object of the sidecar's may ever need the cyclic garbage collector (each one
freed by reference counting once done: ``count_cycles`` of
:mod:`tests.harness.load.sidecar_process`), and its resident memory after a warm-up slice must
grow by less than 10 % over the rest.

Why the cycles: Python's small-object allocator keeps an arena as long as one object lives in
it, so garbage that waits for a collection raises the resident memory for good. Each response
the relay read was such garbage (its parser calls its bound methods) until 2026-12-05: after
6,000 requests ~60,000 objects waited for a middle-generation collection, pymalloc's arenas grew
from 24 to 36 while its live bytes fell, and the RSS grew 8-11 % after warm-up at 2,000
requests, +30 % at 20,000; with no cycles, +4 % and +1 %.

Size: ``CANCEL_SIDECAR_SOAK_N`` requests (default 2000; the full size is 20000). Run with ``-s``
for the numbers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from sidecar.abort_queue import MAX_CALLS_PER_ENGINE
from sidecar.config import AbortSettings
from tests.fakes.kinds import Head, VLLMEngine, Work, stream_bytes
from tests.harness import rawhttp
from tests.harness.cli_process import config_tree
from tests.harness.load.common import chat_request, ms, percentile, reset, size_from_env
from tests.harness.load.sidecar_process import SidecarProcess, sidecar_process
from tests.harness.support import max_calls, metrics, samples

pytestmark = [pytest.mark.load, pytest.mark.timeout(1800)]

N = size_from_env("CANCEL_SIDECAR_SOAK_N", 2000)
SEED = 20260
CONCURRENCY = 50
WARM_UP = max(200, N // 10)  # requests before the memory baseline
GUARD_S = 20.0  # bound on each wait for one request's step, and for the sidecar to settle
RSS_GROWTH = 0.10
KEEPALIVE_S = 1.0  # idle pooled upstream connections close after this
# The abort calls' own pool keeps up to one connection per call in flight to an engine, with
# aiohttp's default keep-alive (15 s), not upstream.keepalive_timeout_s.
# A vLLM engine's aborts are confirmed: its pool keeps abort.connections warm (spread over its
# API-server processes: sidecar.abort_wire), more than the calls in flight.
WARM = AbortSettings().connections
ABORT_POOL = max(MAX_CALLS_PER_ENGINE, WARM)
TASK_TOLERANCE = 0  # asyncio tasks: back to the baseline exactly
PHASES = ("body", "after_body", "registering", "queued", "first_byte", "mid_stream",
          "after_last", "complete")
# A cut request generates for 4 s or more once registered: far longer than an abort takes even
# on a loaded machine, so an id that runs to its end was missed, not merely raced.
QUERIES = {
    "body": "tokens=5&interval=0.01",
    "after_body": "tokens=200&interval=0.02",
    "registering": "tokens=200&interval=0.02",
    "queued": "first_byte_delay=5&tokens=5",
    "first_byte": "tokens=200&interval=0.02",
    "mid_stream": "tokens=200&interval=0.02",
    "after_last": "tokens=5&interval=0.01",
    "complete": "tokens=5&interval=0.01",
}
# the client leaves before the end (after_body: maybe before the engine had the whole body)
DISCONNECTED = ("after_body", "registering", "queued", "first_byte", "mid_stream")
MAX_REGISTER_DELAY_S = 0.05  # each request's ids are registered U(0, this) after its body
ABORT = AbortSettings()  # the defaults: resend_window_s, resend_max_interval_s


@dataclass
class Outcome:
    tag: str
    phase: str
    left_at: float | None = None  # when the client left (before its response ended)


class EngineIndex:
    """The fake engine's records by request tag, kept up to date incrementally."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.seen: dict[str, Head] = {}
        self.works: dict[str, Work] = {}
        self._seen_at = self._works_at = 0

    def update(self) -> None:
        for head in self.engine.heads[self._seen_at:]:
            tag = head.headers.get("X-Client-Request-Id")
            if tag:
                self.seen[tag] = head
        self._seen_at = len(self.engine.heads)
        for work in self.engine.works[self._works_at:]:
            if isinstance(work.body, dict) and "tag" in work.body:
                self.works[work.body["tag"]] = work
        self._works_at = len(self.engine.works)

    async def until(self, what: str, predicate: Callable[[], bool]) -> None:
        def check() -> bool:
            self.update()
            return predicate()
        assert await self.engine.watch.until(check, GUARD_S), (
            f"expected {what} within {GUARD_S} s; it did not happen")


def leave(writer: asyncio.StreamWriter, how: str) -> None:
    """Disconnect: ``rst`` (a TCP reset) or ``fin`` (an orderly close)."""
    if how == "rst":
        reset(writer)
    else:
        writer.transport.close()


async def one_request(port: int, index: EngineIndex, tag: str, phase: str, how: str
                      ) -> Outcome:
    rng = random.Random(tag)
    delay = rng.uniform(0.0, MAX_REGISTER_DELAY_S)
    head, body = chat_request(f"{QUERIES[phase]}&register_delay={delay:.4f}", tag,
                              body_extra=4000)
    head = head.replace(b"\r\n\r\n", f"\r\nX-Request-Id: {tag}\r\n\r\n".encode())
    outcome = Outcome(tag, phase)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    def gone() -> None:
        outcome.left_at = time.monotonic()
        leave(writer, how)

    try:
        async with asyncio.timeout(GUARD_S):
            if phase == "body":
                writer.write(head + body[: len(body) // 2])
                await index.until(f"the engine to see request {tag}", lambda: tag in index.seen)
                leave(writer, how)
            elif phase == "after_body":
                writer.write(head + body)
                gone()  # in the same loop step as the last body byte
            elif phase == "registering":
                writer.write(head + body)
                await index.until(f"the engine to get {tag} whole", lambda: tag in index.works)
                work = index.works[tag]
                # the instant under test, within the registration delay (not a synchronisation)
                await asyncio.sleep(max(0.0, work.started + rng.uniform(0.0, delay)
                                        - time.monotonic()))
                gone()
            elif phase in ("queued", "first_byte"):
                writer.write(head + body)
                await index.until(f"the engine to start generating {tag}", lambda: (
                    tag in index.works and index.works[tag].known.is_set()))
                gone()
            else:
                writer.write(head + body)
                response = await rawhttp.read_head(reader)
                assert response.status == 200, f"{tag}: expected 200, got {response.status}"
                if phase == "mid_stream":
                    for _ in range(rng.randint(1, 15)):
                        await reader.readuntil(b"\n\n")
                    gone()
                elif phase == "after_last":
                    await reader.readuntil(b"data: [DONE]\n\n")
                    leave(writer, how)
                else:
                    await rawhttp.read_body(reader, response, "POST")
                    sidecar_id = response.get("X-Request-Id") or ""
                    want = stream_bytes(sidecar_id, 5)
                    assert response.ending == "complete" and response.body == want, (
                        f"{tag}: expected the engine's {len(want)} bytes, complete; got "
                        f"{len(response.body)} bytes, {response.ending}")
                    writer.close()
    finally:
        writer.transport.abort()
    return outcome


@dataclass
class Levels:
    fds: int
    upstream: int  # ESTABLISHED connections from the sidecar to the engine
    tasks: int
    rss: int
    cyclic: dict[str, int]  # the sidecar's objects the cyclic collector found, by type

    def __str__(self) -> str:
        return (f"fds {self.fds}, upstream connections {self.upstream}, tasks {self.tasks}, "
                f"RSS {self.rss / 2**20:.1f} MiB, objects left to the cyclic collector "
                f"{sum(self.cyclic.values())}")


async def levels(sidecar: SidecarProcess, engine_port: int) -> Levels:
    proc = psutil.Process(sidecar.pid)
    upstream = sum(1 for c in proc.net_connections("tcp")
                   if c.raddr and c.raddr.port == engine_port
                   and c.status == psutil.CONN_ESTABLISHED)
    tasks, cyclic = await sidecar.stats()
    return Levels(proc.num_fds(), upstream, tasks, proc.memory_info().rss, cyclic)


async def warm_levels(sidecar: SidecarProcess, engine_port: int) -> Levels:
    """The baseline before any traffic: once the sidecar's ``WARM`` abort connections are open
    (:mod:`sidecar.abort_wire` opens them in the background at startup; a reading taken while
    some are still connecting counts their fds but not their connections), for at most
    ``GUARD_S``."""
    deadline = time.monotonic() + GUARD_S
    while (now := await levels(sidecar, engine_port)).upstream < WARM:
        if time.monotonic() > deadline:
            raise AssertionError(f"expected the {WARM} warm abort connections to open within "
                                 f"{GUARD_S}s; {now.upstream} are")
        await asyncio.sleep(0.05)
    return now


async def settled(sidecar: SidecarProcess, engine_port: int, base: Levels, *,
                  pool: int = CONCURRENCY) -> Levels:
    """Poll (no event exists for another process's sockets) until the sidecar is back to
    ``base``, give or take at most ``pool`` idle pooled upstream connections (and their fds),
    for at most ``GUARD_S``; returns the last reading."""
    deadline = time.monotonic() + GUARD_S
    while True:
        now = await levels(sidecar, engine_port)
        if ((now.fds <= base.fds + now.upstream and now.upstream <= pool
             and now.tasks <= base.tasks + TASK_TOLERANCE) or time.monotonic() > deadline):
            return now
        await asyncio.sleep(0.1)


async def run(port: int, index: EngineIndex, plan: list[tuple[str, str, str]]
              ) -> list[Outcome]:
    queue = iter(plan)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        for tag, phase, how in queue:
            outcomes.append(await one_request(port, index, tag, phase, how))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


def abort_counts(values: dict[tuple[str, frozenset[tuple[str, str]]], float]
                 ) -> tuple[float, float]:
    """(abort call attempts, requests with a final abort outcome) on the sidecar's /metrics,
    whatever the outcome: a call the engine got may still end ``timeout`` at the sidecar when
    this loaded loop answers it late."""
    return (sum(outcomes_of(values, "cancel_sidecar_abort_calls_total").values()),
            sum(outcomes_of(values, "cancel_sidecar_aborted_requests_total").values()))


def outcomes_of(values: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str
                ) -> dict[str, float]:
    """outcome -> count of the sample ``name`` on the sidecar's /metrics."""
    return {dict(labels).get("outcome", "?"): v for labels, v in samples(values, name).items()}


async def counted(sidecar: SidecarProcess, engine: VLLMEngine
                  ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics once the sidecar has counted every call the engine answered (it counts on the
    answer, which may still be on its way): polled (no event crosses the process boundary),
    for at most ``GUARD_S``; the last reading."""
    deadline = time.monotonic() + GUARD_S
    while True:
        values = await metrics(sidecar.admin_port)
        want = (len(engine.calls), len({i for c in engine.calls for i in c.ids}))
        if abort_counts(values) == want or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


def check(o: Outcome, work: Work | None, named: Counter[str], calls: dict[str, list[float]]
          ) -> tuple[str | None, str]:
    """(what is wrong with request ``o``, or None; its kind: ``cut``, ``raced``, ``completed``,
    ``never_whole`` or ``left_running``)."""
    if work is None:
        if o.phase in ("body", "after_body"):
            return None, "never_whole"
        return f"{o.tag} ({o.phase}): expected a work at the engine, none", "never_whole"
    count = sum(named[i] for i in work.engine_ids)
    times = sorted(t for i in work.engine_ids for t in calls.get(i, []))
    if o.phase == "body":
        return f"{o.tag}: expected the engine never to get the whole body", "completed"
    if o.phase not in DISCONNECTED:
        if count or not work.finished:
            return (f"{o.tag} ({o.phase}): expected it run to its end and never named; got "
                    f"finished={work.finished}, named {count} time(s)"), "completed"
        return None, "completed"
    assert o.left_at is not None
    bound = max_calls(o.left_at, work.started + ABORT.resend_window_s,
                      ABORT.resend_max_interval_s)
    if work.closed_at is None and work.stopped_at is None:  # it had finished before it left
        if count > bound:
            return (f"{o.tag} ({o.phase}, raced): expected at most {bound} calls naming it, "
                    f"got {count}"), "raced"
        return None, "raced"
    if work.ran_to_end or work.stopped_at is None:
        return (f"{o.tag} ({o.phase}): expected stopped before its end; ran to its end "
                f"{sorted(work.ran_to_end)}, registered "
                f"{[round(t - work.started, 4) for t in work.registered.values()]} s after its "
                f"body, client left {o.left_at - work.started:.4f} s after, "
                f"{sum(map(len, work.ignored.values()))} abort(s) ignored before registration "
                f"(or arrival), named {count} time(s), at "
                f"{[round(t - work.started, 4) for t in times]} s after its body"), "left_running"
    if not 1 <= count <= bound:
        return f"{o.tag} ({o.phase}): expected 1..{bound} calls naming it, got {count}", "cut"
    return None, "cut"


async def test_soak_aborts_exactly_the_cut_requests_and_leaks_nothing(tmp_path: Path) -> None:
    engine = VLLMEngine()
    await engine.start()
    try:
        await soak(engine, tmp_path)
    finally:
        await engine.stop()


async def soak(engine: VLLMEngine, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    plan = [(f"soak-{k}", rng.choice(PHASES), rng.choice(("rst", "fin"))) for k in range(N)]
    index = EngineIndex(engine)
    port = int(engine.url.rsplit(":", 1)[1])
    # The default abort settings (config_tree's own turns re-sends off for first-call counting).
    tree = config_tree(engine.url, upstream={"keepalive_timeout_s": KEEPALIVE_S}, engines={
        "local": {"kind": "vllm", "url": engine.url,
                  "abort": {"api_key": "cli-key", "timeout_s": 2.0}}})
    async with sidecar_process(tmp_path, tree, count_cycles=True) as sidecar:
        before = await warm_levels(sidecar, port)
        started = time.monotonic()
        outcomes = await run(sidecar.proxy_port, index, plan[:WARM_UP])
        warm = await settled(sidecar, port, before)
        outcomes += await run(sidecar.proxy_port, index, plan[WARM_UP:])
        took = time.monotonic() - started
        await index.until("every request at the engine stopped or at its end", lambda: all(
            not w.running for w in engine.works))
        index.update()
        # Re-sends go on for up to resend_window_s after the last body: let them end (no event
        # says "no more calls"), then read the counters.
        last = max((w.started for w in engine.works), default=time.monotonic())
        await asyncio.sleep(max(0.0, last + ABORT.resend_window_s + 1.0 - time.monotonic()))
        values = await counted(sidecar, engine)
        after = await settled(sidecar, port, before)
        # No event tells when a pooled connection expires: give the proxy pool's timer time.
        await asyncio.sleep(3 * KEEPALIVE_S)
        idle = await settled(sidecar, port, before, pool=ABORT_POOL)

    named = Counter(i for c in engine.calls for i in c.ids)
    call_times: dict[str, list[float]] = {}  # engine id -> when calls naming it arrived
    for call in engine.calls:
        for i in call.ids:
            call_times.setdefault(i, []).append(call.at)
    phases = Counter(o.phase for o in outcomes)
    kinds: Counter[str] = Counter()
    problems: list[str] = []
    for o in outcomes:
        problem, kind = check(o, index.works.get(o.tag), named, call_times)
        kinds[kind] += 1
        if problem:
            problems.append(problem)
    first = {i: times[0] for i, times in call_times.items()}
    latency = sorted(first[w.engine_ids[0]] - o.left_at for o in outcomes
                     if o.left_at is not None and (w := index.works.get(o.tag)) is not None
                     and w.engine_ids[0] in first) or [0.0]
    calls, aborted = abort_counts(values)
    growth = (after.rss - warm.rss) / warm.rss
    print(f"\n[soak] N={N}, concurrency {CONCURRENCY}, seed {SEED}: {took:.1f} s "
          f"({N / took:.0f} req/s); phases {dict(phases)}\n"
          f"[soak] disconnected with the whole body at the engine: {kinds['cut']} stopped, "
          f"{kinds['left_running']} left running (an id ran to its end), {kinds['raced']} "
          f"raced (engine finished anyway); {kinds['never_whole']} never had the whole body; "
          f"{kinds['completed']} completed\n"
          f"[soak] {len(set(named))} ids named in {len(engine.calls)} call(s), "
          f"{sum(named.values())} namings; {len(engine.ignored)} ignored (before registration or "
          f"arrival); "
          f"client left -> first call naming it: p50 {ms(percentile(latency, 0.5))}, p99 "
          f"{ms(percentile(latency, 0.99))}\n"
          f"[soak] before:  {before}\n[soak] warm-up: {warm} (after {WARM_UP} requests)\n"
          f"[soak] after:   {after}\n[soak] idle:    {idle} (proxy pool expired)\n"
          f"[soak] RSS growth after warm-up {growth:+.1%}\n"
          f"[soak] sidecar: abort calls {outcomes_of(values, 'cancel_sidecar_abort_calls_total')}"
          f", aborted requests {outcomes_of(values, 'cancel_sidecar_aborted_requests_total')}")
    assert kinds["left_running"] == 0 and not problems, (
        f"expected 0 generations left running and every request right; {kinds['left_running']} "
        f"left running, {len(problems)} request(s) wrong, e.g. {problems[:5]}")
    ids = {i for w in index.works.values() for i in w.engine_ids}
    assert set(named) <= ids, "expected only ids of requests the engine had to be aborted"
    assert (calls, aborted) == (len(engine.calls), len(set(named))), (
        f"expected the sidecar to count {len(engine.calls)} call attempts (every call the engine "
        f"got) for {len(set(named))} requests; got {calls} attempts, {aborted} requests")
    final = outcomes_of(values, "cancel_sidecar_aborted_requests_total")
    assert not {"cancelled", "dropped"} & set(final), (
        f"expected no request's abort to end cancelled (the sidecar was running) or dropped; "
        f"got {final}")
    assert after.upstream <= CONCURRENCY, (
        f"expected at most {CONCURRENCY} pooled upstream connections, got {after.upstream}")
    assert after.fds <= before.fds + after.upstream, (
        f"expected fds back to {before.fds} + {after.upstream} pooled; got {after.fds}")
    # ``before`` already holds the warm abort connections (sidecar.abort_wire).
    assert (idle.upstream <= ABORT_POOL
            and idle.fds == before.fds + idle.upstream - before.upstream), (
        f"expected, once the proxy's keep-alive pool expired, at most {ABORT_POOL} (abort) "
        f"connections to the engine and {before.fds} fds + those beyond the "
        f"{before.upstream} before; got {idle.upstream} "
        f"connections and {idle.fds} fds")
    assert after.tasks <= before.tasks + TASK_TOLERANCE, (
        f"expected asyncio tasks back to {before.tasks}; got {after.tasks}")
    assert not idle.cyclic, (
        f"expected every object of the sidecar's freed by reference counting; the cyclic "
        f"collector found {idle.cyclic}")
    assert growth < RSS_GROWTH, (
        f"expected RSS to grow < {RSS_GROWTH:.0%} after warm-up ({warm.rss} bytes); got "
        f"{after.rss} bytes ({growth:+.1%})")


