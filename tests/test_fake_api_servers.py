"""The vLLM fake with several API-server processes (``VLLMEngine(api_servers=N)``), tested on
its own: real aiohttp clients and raw sockets on 127.0.0.1, no sidecar.

What it models (``../shared/notes/cancellation-facts.md``, "vLLM with several API-server
processes"): each TCP connection belongs to the process that accepted it for its whole life; an
abort call aborts only the ids its own process owns and answers 200 for the others, changing
nothing; an aborted response ends at once with ``finish_reason`` ``"abort"`` (``end_on_abort``);
a process busy streaming accepts new connections less often (``accept="idle"``).

Which process a connection lands on is made known by ``accept="round_robin"`` (connection ``i``
to process ``i % N``) and checked against ``engine.connections`` each time. A client
:class:`Conn` is one aiohttp session over one keep-alive connection. The statistical tests are
seeded, so their bounds hold on every run, and each bound is far from what the wrong policy
gives.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.fakes.kinds import VLLMEngine, Work
from tests.harness.rawhttp import exchange, request_bytes

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # guard on any wait for an expected event
PROMPT_S = 0.5  # "at once": abort answered -> response ended (the lazy end waits 1 s, a stream 2 s)
STREAM = "?tokens=200&interval=0.01"  # 2 s of tokens: long enough to abort, short enough to end
LONG = "?tokens=3000&interval=0.01"  # 30 s: runs for the whole test
CHAT = "/v1/chat/completions"
ABORT = VLLMEngine.abort_path
MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def running(**options: Any) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(**options)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


class Conn:
    """One client connection (an aiohttp session limited to one keep-alive connection), opened
    by a ``GET /health`` so that the engine has picked its process before it is used."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.session = aiohttp.ClientSession(
            engine.url, connector=aiohttp.TCPConnector(limit=1),
            timeout=aiohttp.ClientTimeout(total=WAIT_S))
        self.process = -1

    async def open(self, expect: int) -> Conn:
        """Open the connection; it must land on process ``expect``."""
        before = len(self.engine.connections)
        async with self.session.get("/health") as response:
            assert response.status == 200, f"/health answered {response.status}"
        new = self.engine.connections[before:]
        assert [c.process for c in new] == [expect], (
            f"expected one new connection on process {expect}, got {new}")
        self.process = expect
        return self

    async def abort(self, *ids: str) -> int:
        """One abort call on this connection naming ``ids``; its status."""
        async with self.session.post(ABORT, json={"request_ids": list(ids)}) as response:
            await response.read()
            return response.status

    async def close(self) -> None:
        await self.session.close()


@asynccontextmanager
async def conns(engine: VLLMEngine, *processes: int) -> AsyncIterator[list[Conn]]:
    """Connections opened in order, each asserted to land on the process given for it."""
    opened: list[Conn] = []
    try:
        for process in processes:
            opened.append(await Conn(engine).open(process))
        yield opened
    finally:
        for conn in opened:
            await conn.close()


async def event(response: aiohttp.ClientResponse) -> bytes:
    """The next SSE event's data (``[DONE]`` as ``b"[DONE]"``), within the guard."""
    raw = await asyncio.wait_for(response.content.readuntil(b"\n\n"), WAIT_S)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n"), f"not an SSE event: {raw!r}"
    return raw[len(b"data: "):-2]


async def tokens(response: aiohttp.ClientResponse, count: int) -> None:
    """Read ``count`` token events; each must be a token, not the end."""
    for _ in range(count):
        data = await event(response)
        assert data != b"[DONE]", "the stream ended while it should have gone on"
        choice = json.loads(data)["choices"][0]
        assert "finish_reason" not in choice, f"expected a token event, got {data!r}"


async def the_end(response: aiohttp.ClientResponse) -> tuple[int, str | None]:
    """Read to the stream's end: (token events before it, the final chunk's finish_reason);
    the end must be that chunk, then ``[DONE]``, then EOF."""
    count = 0
    while True:
        choice = json.loads(await event(response))["choices"][0]
        if "finish_reason" in choice:
            break
        count += 1
    assert await event(response) == b"[DONE]", "the final chunk was not followed by [DONE]"
    rest = await asyncio.wait_for(response.content.read(), WAIT_S)
    assert rest == b"", f"bytes after [DONE]: {rest!r}"
    return count, choice["finish_reason"]


async def work_of(engine: VLLMEngine, rid: str) -> Work:
    """The work of request ``rid``, once it arrived."""
    def arrived() -> bool:
        return any(w.request_id_header == rid for w in engine.works)
    assert await engine.watch.until(arrived, WAIT_S), f"request {rid} never reached the engine"
    return next(w for w in engine.works if w.request_id_header == rid)


def port_of(engine: VLLMEngine) -> int:
    port: int = engine.runner.addresses[0][1]
    return port


async def one_connection(engine: VLLMEngine) -> int:
    """A fresh connection with one request on it (then closed); the process it landed on."""
    before = len(engine.connections)
    answer = await asyncio.wait_for(exchange(port_of(engine), request_bytes(
        "GET", "/health", [("Connection", "close")])), WAIT_S)
    assert answer.status == 200, f"/health answered {answer.status}"
    assert len(engine.connections) == before + 1, "a new connection was not recorded once"
    return engine.connections[-1].process


# -- the defaults ------------------------------------------------------------------------------

async def test_one_api_server_owns_every_connection() -> None:
    """Without ``api_servers`` every connection is process 0 and an abort from any of them
    hits: the behaviour every older test relies on."""
    async with running() as engine, conns(engine, 0, 0, 0) as (a, b, _):
        async with a.session.post(CHAT + STREAM, json={**MESSAGES, "stream": True},
                                  headers={"X-Request-Id": "r0"}) as response:
            await tokens(response, 2)
            assert await b.abort("chatcmpl-r0") == 200
            assert engine.calls[-1].process == 0 and engine.calls[-1].missed == [], (
                f"expected a hit from process 0, got {engine.calls[-1]}")
            work = await work_of(engine, "r0")
            assert work.process == 0 and work.stopped_at is not None, work
        assert engine.missed == [], engine.missed


# -- ownership of connections and ids ------------------------------------------------------

async def test_connection_keeps_its_process() -> None:
    """Requests on one keep-alive connection all go to the process that took its first one."""
    async with running(api_servers=3, accept="round_robin") as engine, \
            conns(engine, 0, 1, 2) as (_, b, _):
        for _ in range(3):
            assert await b.abort("chatcmpl-none") == 200
        assert [c.process for c in engine.calls] == [1, 1, 1], engine.calls
        assert len(engine.connections) == 3, f"expected 3 connections, got {engine.connections}"


async def test_stream_missed_then_hit_ends_at_once() -> None:
    """A stream on process 0: an abort on process 1's connection is answered 200, recorded as
    missed, and the stream goes on; one on process 0's ends it at once with ``abort``."""
    async with running(api_servers=2, accept="round_robin", end_on_abort=True) as engine, \
            conns(engine, 0, 1, 0) as (owner_conn, other, same):
        async with owner_conn.session.post(CHAT + STREAM, json={**MESSAGES, "stream": True},
                                           headers={"X-Request-Id": "r1"}) as response:
            await tokens(response, 3)
            work = await work_of(engine, "r1")
            assert work.process == 0, f"expected the stream on process 0, got {work.process}"

            assert await other.abort("chatcmpl-r1") == 200
            call = engine.calls[-1]
            assert (call.process, call.missed, call.ignored) == (1, ["chatcmpl-r1"], []), call
            assert [i for _, i in engine.missed] == ["chatcmpl-r1"], engine.missed
            assert list(work.missed) == ["chatcmpl-r1"] and work.running, work
            events = work.events
            await tokens(response, 5)
            assert work.events >= events + 5 and not work.aborted, work

            assert await same.abort("chatcmpl-r1") == 200
            answered = time.monotonic()
            call = engine.calls[-1]
            assert (call.process, call.missed, call.ignored) == (0, [], []), call
            made, reason = await the_end(response)
            took = time.monotonic() - answered
        assert reason == "abort", f"expected finish_reason abort, got {reason!r}"
        assert took < PROMPT_S, f"the stream ended {took:.3f} s after the abort, not at once"
        assert made < 200 - 8, f"{made} more token events: the abort did not stop the stream"
        assert list(work.aborted) == ["chatcmpl-r1"] and not work.ran_to_end, work
        assert work.closed_at is None, "end_on_abort waited for the connection to close"


async def test_lazy_end_without_end_on_abort() -> None:
    """With ``end_on_abort=False`` an aborted stream waits for its connection to close (up to
    1 s) before its end: the older model, for a sidecar that closes with its abort."""
    async with running(api_servers=2, accept="round_robin", end_on_abort=False) as engine, \
            conns(engine, 0, 1, 0) as (owner_conn, _, same):
        async with owner_conn.session.post(CHAT + STREAM, json={**MESSAGES, "stream": True},
                                           headers={"X-Request-Id": "r2"}) as response:
            await tokens(response, 2)
            assert await same.abort("chatcmpl-r2") == 200
            answered = time.monotonic()
            _, reason = await the_end(response)
            took = time.monotonic() - answered
        assert reason == "abort", f"expected finish_reason abort, got {reason!r}"
        assert 0.9 < took < 0.9 + WAIT_S, f"the end came {took:.3f} s after the abort, not ~1 s"


async def test_json_missed_then_hit_answers_at_once() -> None:
    """A JSON chat on process 0: a missed abort changes nothing; a hit answers it at once with
    the partial output and ``finish_reason`` ``abort``."""
    async with running(api_servers=2, accept="round_robin", end_on_abort=True) as engine, \
            conns(engine, 0, 1, 0) as (owner_conn, other, same):
        async def chat() -> dict[str, Any]:
            async with owner_conn.session.post(CHAT + STREAM, json=MESSAGES,
                                               headers={"X-Request-Id": "r3"}) as response:
                assert response.status == 200, f"the chat answered {response.status}"
                answer: dict[str, Any] = await response.json()
                return answer

        task = asyncio.create_task(chat(), name="json chat r3")
        try:
            work = await work_of(engine, "r3")
            assert work.process == 0, f"expected the chat on process 0, got {work.process}"
            assert await other.abort("chatcmpl-r3") == 200
            assert engine.calls[-1].missed == ["chatcmpl-r3"], engine.calls[-1]
            assert work.running and not task.done(), f"a missed abort stopped the work: {work}"

            assert await same.abort("chatcmpl-r3") == 200
            answered = time.monotonic()
            answer = await asyncio.wait_for(task, WAIT_S)
            took = time.monotonic() - answered
        finally:
            task.cancel()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "abort", f"expected finish_reason abort, got {answer}"
        assert took < PROMPT_S, f"answered {took:.3f} s after the abort, not at once"
        assert len(choice["text"]) < 200, f"the whole output, not a partial one: {answer}"
        assert list(work.aborted) == ["chatcmpl-r3"] and work.closed_at is None, work


async def test_prompt_list_belongs_to_one_process() -> None:
    """A 4-prompt completion's 4 ids all belong to its connection's process: an abort from
    another misses all 4; the owner's aborts stop them, the work once all 4 are aborted."""
    async with running(api_servers=2, accept="round_robin", end_on_abort=True) as engine, \
            conns(engine, 0, 1, 0, 1) as (_, owner_conn, other, same):
        body = {"prompt": ["a", "b", "c", "d"], "stream": True}
        async with owner_conn.session.post("/v1/completions" + STREAM, json=body,
                                           headers={"X-Request-Id": "r4"}) as response:
            await tokens(response, 2)
            work = await work_of(engine, "r4")
            ids = [f"cmpl-r4-{i}" for i in range(4)]
            assert (work.process, list(work.engine_ids)) == (1, ids), work

            assert await other.abort(*ids) == 200
            assert engine.calls[-1].missed == ids, engine.calls[-1]
            assert [i for _, i in engine.missed] == ids, engine.missed
            assert await same.abort(*ids[:2]) == 200
            assert engine.calls[-1].missed == [] and sorted(work.aborted) == ids[:2], work
            await tokens(response, 2)  # two ids still run
            assert work.running, f"stopped with 2 of 4 ids aborted: {work}"

            assert await same.abort(*ids[2:]) == 200
            _, reason = await the_end(response)
        assert reason == "abort", f"expected finish_reason abort, got {reason!r}"
        assert sorted(work.aborted) == ids and work.stopped_at is not None, work


async def test_pending_ids_missed_elsewhere_ignored_at_home() -> None:
    """Ids not registered yet: an abort from another process misses them, one from their own
    process is ignored (the no-op before registration); neither stops the work."""
    async with running(api_servers=2, accept="round_robin") as engine, \
            conns(engine, 0, 1, 0) as (owner_conn, other, same):
        async def chat() -> None:
            async with owner_conn.session.post(CHAT + "?register_delay=30", json=MESSAGES,
                                               headers={"X-Request-Id": "r5"}) as response:
                await response.read()

        task = asyncio.create_task(chat(), name="pending chat r5")
        try:
            work = await work_of(engine, "r5")
            assert work.registered == {}, f"registered already: {work}"
            assert await other.abort("chatcmpl-r5") == 200
            assert (engine.calls[-1].missed, engine.calls[-1].ignored) == (["chatcmpl-r5"], [])
            assert await same.abort("chatcmpl-r5") == 200
            assert (engine.calls[-1].missed, engine.calls[-1].ignored) == ([], ["chatcmpl-r5"])
            assert list(work.missed) == ["chatcmpl-r5"] == list(work.ignored), work
            assert work.running and not task.done(), work
        finally:
            task.cancel()


# -- which process takes a new connection ------------------------------------------------------

async def test_idle_policy_prefers_idle_processes() -> None:
    """Process 0 runs 4 streams, process 1 none: with ``accept="idle"`` a new connection goes to
    process 0 with probability (1/25) / (1/25 + 1) = 1/26, about 8 of 200 (uniform: 100)."""
    async with running(api_servers=2, accept="round_robin", seed=0) as engine, \
            conns(engine, 0, 1, 0, 1, 0, 1, 0, 1) as opened:
        streams = [await stack_stream(conn, f"busy{i}") for i, conn in enumerate(opened[::2])]
        try:
            assert await engine.watch.until(lambda: engine.running_per_process() == [4, 0],
                                            WAIT_S), engine.running_per_process()
            engine.accept = "idle"
            landed = Counter([await one_connection(engine) for _ in range(200)])
            assert engine.running_per_process() == [4, 0], "the load changed during the test"
        finally:
            for response in streams:
                response.close()
        assert 0 < landed[0] <= 30, f"expected ~8 of 200 on the busy process, got {landed}"


async def stack_stream(conn: Conn, rid: str) -> aiohttp.ClientResponse:
    """Start a long stream on ``conn`` and read its first event; the caller closes it."""
    response = await conn.session.post(CHAT + LONG, json={**MESSAGES, "stream": True},
                                       headers={"X-Request-Id": rid})
    await tokens(response, 1)
    return response


async def test_random_policy_covers_every_process() -> None:
    """``accept="random"``: 200 connections reach all 8 processes, none takes more than twice
    its share, and the same seed gives the same sequence."""
    sequences = []
    for _ in range(2):
        async with running(api_servers=8, seed=7) as engine:
            sequences.append([await one_connection(engine) for _ in range(200)])
            gc.collect()
            kept = len(engine._processes)
        counts = Counter(sequences[-1])
        assert sorted(counts) == list(range(8)), f"not every process got a connection: {counts}"
        assert max(counts.values()) <= 50, f"far from uniform: {counts}"
        assert kept <= 5, f"the connection map kept {kept} of 200 closed connections"
    assert sequences[0] == sequences[1], "the same seed gave another sequence"


async def test_round_robin_and_bad_policies() -> None:
    """``round_robin`` cycles through the processes; a bad policy or count is refused."""
    async with running(api_servers=3, accept="round_robin") as engine:
        assert [await one_connection(engine) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="accept must be one of"):
        VLLMEngine(api_servers=2, accept="least_busy")
    with pytest.raises(ValueError, match="api_servers must be >= 1"):
        VLLMEngine(api_servers=0)
