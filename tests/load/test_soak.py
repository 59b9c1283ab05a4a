"""A soak: many requests, 50 at a time, each cut at a random phase (seeded), through a sidecar in
its own process (:mod:`tests.load.sidecar_process`, production wiring).

Phases: ``body`` (leave while sending the request body), ``queued`` (the engine holds the
request in ``first_byte_delay``), ``first_byte`` (the engine generates; the client reads
nothing), ``mid_stream`` (after 1-15 events), ``after_last`` (right after ``data: [DONE]``),
``complete`` (read to the end, checked byte for byte); a client leaves with a TCP reset or an
orderly close (FIN), also chosen at random. Checked per request, with the engine as
the ground truth: a request the engine had whole and had not finished when its client left is
aborted exactly once; a completed one (``complete``, ``after_last``) and one whose body never
arrived whole is never aborted; a client that left while the engine was finishing anyway may be
aborted at most once (counted as raced). Then the sidecar process's file descriptors, its
connections to the engine and its asyncio tasks must come back to their levels before any
traffic (right after the last request up to the idle keep-alive pool, at most
``CONCURRENCY`` connections: fds may exceed the baseline by that many; once the proxy pool's
``keepalive_timeout_s`` expired, only the abort calls' pool, at most ``MAX_CALLS_PER_ENGINE``
connections), and its resident memory after a warm-up
slice must grow by less than 10 % over the rest.

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

from sidecar.abort import MAX_CALLS_PER_ENGINE
from tests import rawhttp
from tests.cli_process import config_tree
from tests.fake_engine import FakeEngine, Generation, Seen
from tests.load.common import chat_request, expected_stream, reset, size_from_env
from tests.load.sidecar_process import SidecarProcess, sidecar_process
from tests.support import metrics, sample

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
ABORT_POOL = MAX_CALLS_PER_ENGINE
TASK_TOLERANCE = 0  # asyncio tasks: back to the baseline exactly
PHASES = ("body", "queued", "first_byte", "mid_stream", "after_last", "complete")
QUERIES = {
    "body": "tokens=5&interval=0.01",
    "queued": "first_byte_delay=5&tokens=5",
    "first_byte": "tokens=50&interval=0.02",
    "mid_stream": "tokens=40&interval=0.02",
    "after_last": "tokens=5&interval=0.01",
    "complete": "tokens=5&interval=0.01",
}
DISCONNECTED = ("queued", "first_byte", "mid_stream")  # the client leaves before the end


@dataclass
class Outcome:
    tag: str
    phase: str


class EngineIndex:
    """The fake engine's records by request tag, kept up to date incrementally."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.seen: dict[str, Seen] = {}
        self.generations: dict[str, Generation] = {}
        self._seen_at = self._gen_at = 0

    def update(self) -> None:
        record = self.engine.record
        for seen in self.engine.watch.seen[self._seen_at:]:
            tag = seen.headers.get("X-Client-Request-Id")
            if tag:
                self.seen[tag] = seen
        self._seen_at = len(self.engine.watch.seen)
        for gen in record.generations[self._gen_at:]:
            if isinstance(gen.body, dict) and "tag" in gen.body:
                self.generations[gen.body["tag"]] = gen
        self._gen_at = len(record.generations)

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
    head, body = chat_request(QUERIES[phase], tag, body_extra=4000)
    head = head.replace(b"\r\n\r\n", f"\r\nX-Request-Id: {tag}\r\n\r\n".encode())
    outcome = Outcome(tag, phase)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(GUARD_S):
            if phase == "body":
                writer.write(head + body[: len(body) // 2])
                await index.until(f"the engine to see request {tag}", lambda: tag in index.seen)
                leave(writer, how)
            elif phase in ("queued", "first_byte"):
                writer.write(head + body)
                await index.until(f"the engine to start generating {tag}",
                                  lambda: tag in index.generations)
                leave(writer, how)
            else:
                writer.write(head + body)
                response = await rawhttp.read_head(reader)
                assert response.status == 200, f"{tag}: expected 200, got {response.status}"
                if phase == "mid_stream":
                    for _ in range(random.Random(tag).randint(1, 15)):
                        await reader.readuntil(b"\n\n")
                    leave(writer, how)
                elif phase == "after_last":
                    await reader.readuntil(b"data: [DONE]\n\n")
                    leave(writer, how)
                else:
                    await rawhttp.read_body(reader, response, "POST")
                    sidecar_id = response.get("X-Request-Id") or ""
                    want = expected_stream(sidecar_id, 5)
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

    def __str__(self) -> str:
        return (f"fds {self.fds}, upstream connections {self.upstream}, tasks {self.tasks}, "
                f"RSS {self.rss / 2**20:.1f} MiB")


async def levels(sidecar: SidecarProcess, engine_port: int) -> Levels:
    proc = psutil.Process(sidecar.pid)
    upstream = sum(1 for c in proc.net_connections("tcp")
                   if c.raddr and c.raddr.port == engine_port
                   and c.status == psutil.CONN_ESTABLISHED)
    return Levels(proc.num_fds(), upstream, await sidecar.tasks(), proc.memory_info().rss)


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


async def test_soak_aborts_exactly_the_cut_requests_and_leaks_nothing(
        engine: FakeEngine, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    plan = [(f"soak-{k}", rng.choice(PHASES), rng.choice(("rst", "fin"))) for k in range(N)]
    index = EngineIndex(engine)
    tree = config_tree(engine.url, upstream={"keepalive_timeout_s": KEEPALIVE_S})
    async with sidecar_process(tmp_path, tree) as sidecar:
        before = await levels(sidecar, engine.port)
        started = time.monotonic()
        outcomes = await run(sidecar.proxy_port, index, plan[:WARM_UP])
        warm = await settled(sidecar, engine.port, before)
        outcomes += await run(sidecar.proxy_port, index, plan[WARM_UP:])
        took = time.monotonic() - started
        await index.until("every generation finished or closed", lambda: all(
            g.finished or g.closed_at is not None for g in engine.record.generations))
        index.update()
        must = {f"chatcmpl-{index.generations[o.tag].request_id}" for o in outcomes
                if o.phase in DISCONNECTED and not index.generations[o.tag].finished}
        await index.until(f"abort calls naming all {len(must)} cut requests",
                          lambda: must <= set(engine.record.aborted_ids()))
        values = await metrics(sidecar.admin_port)
        after = await settled(sidecar, engine.port, before)
        # No event tells when a pooled connection expires: give the proxy pool's timer time.
        await asyncio.sleep(3 * KEEPALIVE_S)
        idle = await settled(sidecar, engine.port, before, pool=ABORT_POOL)

    named = Counter(engine.record.aborted_ids())
    phases = Counter(o.phase for o in outcomes)
    raced = 0
    problems: list[str] = []
    for o in outcomes:
        gen = index.generations.get(o.tag)
        engine_id = f"chatcmpl-{gen.request_id}" if gen else None
        count = named.get(engine_id, 0) if engine_id else 0
        if o.phase == "body":
            if gen is not None:
                problems.append(f"{o.tag}: expected the engine never to get the whole body")
        elif gen is None:
            problems.append(f"{o.tag} ({o.phase}): expected a generation at the engine, none")
        elif o.phase in DISCONNECTED and not gen.finished:
            if count != 1:
                problems.append(f"{o.tag} ({o.phase}): expected aborted once, got {count}")
        elif o.phase in DISCONNECTED:
            raced += 1
            if count > 1:
                problems.append(f"{o.tag} ({o.phase}, raced): expected aborted at most once, "
                                f"got {count}")
        elif count:
            problems.append(f"{o.tag} ({o.phase}): expected no abort, got {count}")
    calls = sample(values, "cancel_sidecar_abort_calls_total", engine="local", outcome="accepted")
    aborted = sample(values, "cancel_sidecar_aborted_requests_total", engine="local",
                     outcome="accepted")
    growth = (after.rss - warm.rss) / warm.rss
    print(f"\n[soak] N={N}, concurrency {CONCURRENCY}, seed {SEED}: {took:.1f} s "
          f"({N / took:.0f} req/s); phases {dict(phases)}; {len(set(named))} aborted in "
          f"{len(engine.record.aborts)} call(s), {raced} raced (engine finished anyway)\n"
          f"[soak] before:  {before}\n[soak] warm-up: {warm} (after {WARM_UP} requests)\n"
          f"[soak] after:   {after}\n[soak] idle:    {idle} (proxy pool expired)\n"
          f"[soak] RSS growth after warm-up {growth:+.1%}")
    assert not problems, f"{len(problems)} request(s) wrong, e.g. {problems[:5]}"
    assert set(named) <= {f"chatcmpl-{g.request_id}" for g in index.generations.values()}, (
        "expected only ids of requests the engine had to be aborted")
    assert (calls, aborted) == (len(engine.record.aborts), len(set(named))), (
        f"expected the sidecar to count {len(engine.record.aborts)} ok calls for "
        f"{len(set(named))} requests; got {calls} calls, {aborted} requests")
    assert after.upstream <= CONCURRENCY, (
        f"expected at most {CONCURRENCY} pooled upstream connections, got {after.upstream}")
    assert after.fds <= before.fds + after.upstream, (
        f"expected fds back to {before.fds} + {after.upstream} pooled; got {after.fds}")
    # ``before`` already holds the warm abort connection (sidecar.abort_wire).
    assert (idle.upstream <= ABORT_POOL
            and idle.fds == before.fds + idle.upstream - before.upstream), (
        f"expected, once the proxy's keep-alive pool expired, at most {ABORT_POOL} (abort) "
        f"connections to the engine and {before.fds} fds + those beyond the "
        f"{before.upstream} before; got {idle.upstream} "
        f"connections and {idle.fds} fds")
    assert after.tasks <= before.tasks + TASK_TOLERANCE, (
        f"expected asyncio tasks back to {before.tasks}; got {after.tasks}")
    assert growth < RSS_GROWTH, (
        f"expected RSS to grow < {RSS_GROWTH:.0%} after warm-up ({warm.rss} bytes); got "
        f"{after.rss} bytes ({growth:+.1%})")


