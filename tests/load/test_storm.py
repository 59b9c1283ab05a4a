"""A disconnect storm at scale: N streams through a sidecar in its own process, half of them cut
at once with a TCP reset.

The sidecar runs in a process of its own (:mod:`tests.harness.load.sidecar_process`, production
wiring), and so does the fake engine (:mod:`tests.harness.load.engine_process`): the N clients run
here, and their work cannot delay the engine's recording of an abort call (with the engine in this
process, the POST reached its handler ~80 ms after the sidecar sent it, measured). A client's reset
time is taken when its socket is actually closed: uvloop's ``transport.abort()`` closes it one loop
turn later (``loop.call_soon``), so the time is read by a callback queued right behind it. Checked:
every cut request's engine id is named exactly once over all abort calls, no surviving request is
named, every surviving stream arrives byte for byte as the engine sent it, and the engine sees the
upstream connection of every cut stream close. Printed (run with ``-s``): the time from each
client's reset to the engine receiving the abort call naming its id, median/p99/max.

Size: ``CANCEL_SIDECAR_STORM_N`` streams (default 200; the full size is 1000).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import psutil
import pytest

from tests.harness import rawhttp
from tests.harness.cli_process import config_tree
from tests.harness.load.common import (
    LoopLag,
    chat_request,
    expected_stream,
    ms,
    percentile,
    reset,
    size_from_env,
)
from tests.harness.load.engine_process import EngineProcess, engine_process
from tests.harness.load.sidecar_process import sidecar_process
from tests.harness.support import metrics, sample

pytestmark = [pytest.mark.load, pytest.mark.timeout(300)]

N = size_from_env("CANCEL_SIDECAR_STORM_N", 200)
INTERVAL_S = 0.02  # between SSE events
# 3 s of events plus time for the openings: the survivors still stream when the cut comes
SURVIVOR_TOKENS = 150 + N // 4
CONNECT_AT_ONCE = 64  # connections being opened at a time
GUARD_S = 30.0 + N * 0.03  # bound on each wait (opening, cut -> aborts, survivors' ends)


@dataclass
class Stream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    sidecar_id: str
    head: rawhttp.RawResponse
    closed_at: float = 0.0  # time.monotonic() once the client's reset was sent

    @property
    def engine_id(self) -> str:
        return f"chatcmpl-{self.sidecar_id}"


async def open_stream(port: int, query: str, tag: str) -> Stream:
    """A chat stream read up to (not past) its response head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head, body = chat_request(query, tag)
    writer.write(head + body)
    response = await rawhttp.read_head(reader)
    assert response.status == 200, f"expected a 200 stream, got {response.status}"
    sidecar_id = response.get("X-Request-Id")
    assert sidecar_id, "expected an X-Request-Id on the response, got none"
    return Stream(reader, writer, sidecar_id, response)


@dataclass
class Cut:
    """What happened after the cut."""

    bodies: list[rawhttp.RawResponse]  # the survivors' responses, in order
    cut_at: float  # time.monotonic() of the first reset
    worst_lag: float  # how late this process's loop ran, from the cut to the last abort
    finished_in: float  # seconds from the cut to the last survivor's end


def cut_now(cut: list[Stream]) -> asyncio.Future[None]:
    """Reset every ``cut`` stream in this event-loop turn; done once every socket is closed
    (each reset is sent then), with each ``closed_at`` set right after its own close."""
    loop = asyncio.get_running_loop()
    all_closed = loop.create_future()

    def closed(stream: Stream) -> None:
        stream.closed_at = time.monotonic()
        if stream is cut[-1]:
            all_closed.set_result(None)

    for stream in cut:
        reset(stream.writer)  # uvloop closes the socket in a callback queued here ...
        loop.call_soon(closed, stream)  # ... so this one runs right after it
    return all_closed


async def cut_and_finish(engine: EngineProcess, cut: list[Stream],
                         reading: Sequence[asyncio.Future[rawhttp.RawResponse]]) -> Cut:
    """Reset every ``cut`` stream in one event-loop turn, wait for the abort calls naming them
    and for the engine to see their upstream connections close, then for the survivors' ends."""
    cut_ids = {s.engine_id for s in cut}
    cut_sidecar_ids = {s.sidecar_id for s in cut}
    async with LoopLag() as lag:
        await cut_now(cut)
        cut_at = cut[0].closed_at
        done = await engine.until(engine.fetch_aborts,
                                  lambda: cut_ids <= set(engine.aborted_ids()), GUARD_S)
        last_abort = time.monotonic()
    named = cut_ids & set(engine.aborted_ids())
    assert done, (f"expected all {len(cut)} cut requests named in abort calls within {GUARD_S}"
                  f" s; got {len(named)}")

    closed: set[str | None] = set()

    async def fetch_closed() -> None:
        closed.update(await engine.closed())

    upstreams_closed = await engine.until(fetch_closed, lambda: cut_sidecar_ids <= closed,
                                          GUARD_S)
    assert upstreams_closed, (
        f"expected the engine to stop all {len(cut)} cut streams (aborted, or their upstream "
        f"connections closed) within {GUARD_S} s; got {len(cut_sidecar_ids & closed)}")
    async with asyncio.timeout(GUARD_S):
        bodies = await asyncio.gather(*reading)
    return Cut(bodies, cut_at, lag.worst(cut_at, last_abort), time.monotonic() - cut_at)


def no_confirmation(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with ``abort.confirm_timeout_s: 0``: the first calls' batching is measured here,
    each id named exactly once. With confirmation (the default) an id is also re-sent when the
    engine's end of its stream is read later than its re-send is due, as in a storm; that storm
    is ``tests/test_confirmed_aborts.py::test_storm_behind_8_processes_through_the_cli``."""
    tree["engines"]["local"]["abort"]["confirm_timeout_s"] = 0
    return tree


async def test_storm_cuts_half_and_aborts_exactly_those(tmp_path: Path) -> None:
    cut_n, survive_n = N // 2, N - N // 2
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)
    async with engine_process() as engine, \
            sidecar_process(tmp_path, no_confirmation(config_tree(engine.url))) as sidecar:

        async def opened(query: str, tag: str) -> Stream:
            async with gate:
                return await open_stream(sidecar.proxy_port, query, tag)

        started = time.monotonic()
        cpu = psutil.Process(sidecar.pid)
        cpu_before = sum(cpu.cpu_times()[:2])
        async with asyncio.timeout(GUARD_S):
            cut = await asyncio.gather(*(opened(f"tokens=100000&interval={INTERVAL_S}",
                                                f"cut-{k}") for k in range(cut_n)))
            survivors = await asyncio.gather(*(
                opened(f"tokens={SURVIVOR_TOKENS}&interval={INTERVAL_S}", f"keep-{k}")
                for k in range(survive_n)))
        opened_in = time.monotonic() - started
        reading = [asyncio.ensure_future(rawhttp.read_body(s.reader, s.head, "POST"))
                   for s in survivors]
        try:
            run = await cut_and_finish(engine, cut, reading)
        finally:
            for task in reading:
                task.cancel()
        busy = (sum(cpu.cpu_times()[:2]) - cpu_before) / (time.monotonic() - started)
        values = await metrics(sidecar.admin_port)
        for stream in survivors:
            stream.writer.close()
        aborts = await engine.fetch_aborts()

    named = Counter(engine.aborted_ids())
    first_call: dict[str, float] = {}  # engine id -> arrival of the first call naming it
    for at, ids in aborts:
        for engine_id in ids:
            first_call.setdefault(engine_id, at)
    latencies = [first_call[s.engine_id] - s.closed_at for s in cut]
    sizes = [len(ids) for _, ids in aborts]
    own = (sample(values, "cancel_sidecar_abort_latency_seconds_sum", engine="local")
           / max(1.0, sample(values, "cancel_sidecar_abort_latency_seconds_count",
                             engine="local")))
    print(f"\n[storm] N={N}: {cut_n} cut, {survive_n} survived; opened in {opened_in:.1f} s; "
          f"{len(sizes)} abort call(s), sizes {sizes}\n[storm] client reset -> abort call at "
          f"the engine: median {ms(median(latencies))}, p99 {ms(percentile(latencies, 0.99))}, "
          f"max {ms(max(latencies))}\n[storm] meanwhile this process's loop (the clients) "
          f"ran up to {ms(run.worst_lag)} late; the sidecar's own mean from noticing a "
          f"disconnect to the engine's answer: {ms(own)}; it used {busy:.0%} of a CPU from the "
          f"first connection to the last stream's end, {run.finished_in:.1f} s after the cut")

    twice = {i: n for i, n in named.items() if n > 1}
    assert not twice, f"expected every id named once; got these more often: {twice}"
    wrongly = {s.engine_id for s in survivors} & set(named)
    assert not wrongly, (f"expected no surviving request aborted; got {len(wrongly)}, e.g. "
                         f"{sorted(wrongly)[:3]}")
    strangers = set(named) - {s.engine_id for s in cut}
    assert not strangers, f"expected only cut requests' ids; also got {sorted(strangers)[:3]}"
    for stream, response in zip(survivors, run.bodies, strict=True):
        want = expected_stream(stream.sidecar_id, SURVIVOR_TOKENS)
        assert response.ending == "complete" and response.body == want, (
            f"expected request {stream.sidecar_id} to end complete with the engine's "
            f"{len(want)} bytes; got {response.ending} with {len(response.body)} bytes "
            f"({'identical prefix' if want.startswith(response.body) else 'different'})")
