"""A storm of disconnects whose engine reacts to the abort before the sidecar tore the handlers
down, through the production wiring.

The sidecar queues a disconnected request's abort at once and tears its handler down later,
at most ``TeardownPacer.per_turn`` per loop turn (:mod:`sidecar.downstream`). So when hundreds
of clients leave at once, the engine can answer the abort (end its side) before a handler's
turn comes: such a handler is woken by the engine, not by its cancellation. It must end as the
disconnect it is: counted in ``client_disconnects_total`` and ``requests_total{status_class=
"disconnected"}``, never as an upstream error, with the upstream connection closed.

The engine here holds each non-streaming chat request until its id is aborted, then at once
either answers it (``finish_reason: abort``, as vLLM does) or drops the connection without an
answer (the ``_left_first`` path of :mod:`sidecar.proxy`). Clients are raw sockets, all reset
in one loop turn.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.harness.support import GUARD_S, RawClient, Stalls, metrics, request_body, sample, samples

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
ABORT_PATH = "/inference/v1/abort_requests"
CUT = 300  # requests whose clients leave at once


@dataclass
class AbortingEngine:
    """Holds every chat request until aborted, then ends it at once as ``on_abort`` says:
    ``answer`` (200 JSON, finish_reason abort) or ``drop`` (close the connection unanswered)."""

    on_abort: str
    held: dict[str, asyncio.Event] = field(default_factory=dict)  # engine id -> aborted
    arrivals: Counter[str] = field(default_factory=Counter)  # engine id -> times received
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)  # ended by the engine on their abort
    closed: set[str] = field(default_factory=set)  # closed by the sidecar while held
    want: int = 0
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(ABORT_PATH, self.abort)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        engine_id = f"chatcmpl-{request.headers['X-Request-Id']}"
        self.arrivals[engine_id] += 1
        aborted = self.held[engine_id] = asyncio.Event()
        if len(self.held) >= self.want:
            self.arrived.set()
        try:
            await aborted.wait()
        except asyncio.CancelledError:
            self.closed.add(engine_id)
            raise
        self.ended.add(engine_id)
        if self.on_abort == "drop":
            assert request.transport is not None
            request.transport.abort()  # aiohttp then cancels this handler (handler_cancellation)
            await asyncio.Event().wait()
        return web.json_response({"id": engine_id, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": ""},
             "finish_reason": "abort"}]})

    async def abort(self, request: web.Request) -> web.Response:
        ids = (await request.json())["request_ids"]
        self.aborted.extend(ids)
        for engine_id in ids:
            if (event := self.held.get(engine_id)) is not None:
                event.set()
        return web.json_response({})


@pytest_asyncio.fixture(params=["answer", "drop"])
async def aborting_engine(request: pytest.FixtureRequest) -> AsyncIterator[AbortingEngine]:
    engine = AbortingEngine(request.param)
    await engine.start()
    yield engine
    await engine.stop()


def reset(client: RawClient) -> None:
    sock = client.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.writer.transport.abort()


async def test_engine_ending_its_side_on_the_abort_is_still_the_disconnect(
        aborting_engine: AbortingEngine, start_sidecar: Callable[..., Any],
        stalls: Stalls) -> None:
    engine = aborting_engine
    engine.want = CUT
    settings = sidecar_settings(engine.url)
    servers: Servers = await start_sidecar(settings)
    port, admin = servers.proxy_port, servers.admin_port or 0
    gate = asyncio.Semaphore(64)

    async def send() -> RawClient:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = RawClient(reader, writer, stalls)
        client.send("POST", CHAT, request_body({"messages": []}, False))
        return client

    clients = await asyncio.gather(*(send() for _ in range(CUT)))
    await stalls.wait(engine.arrived.wait(), f"all {CUT} requests held by the engine")
    for client in clients:
        reset(client)

    async def settled() -> bool:
        values = await metrics(admin)
        return sum(samples(values, "cancel_sidecar_requests_total").values()) >= CUT

    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD_S
    while not await settled() and loop.time() < deadline:  # noqa: ASYNC110 - another
        await asyncio.sleep(0.05)  # process's metrics: no event to await
    values = await metrics(admin)
    print(f"[pacing/{engine.on_abort}] {CUT} cut: {len(engine.aborted)} ids aborted, "
          f"{len(engine.ended)} ended by the engine after their abort, {len(engine.closed)} "
          "closed by the sidecar first")

    again = {i: n for i, n in engine.arrivals.items() if n > 1}
    assert not again, (
        f"expected each request sent to the engine once (no re-send once its client left); "
        f"{len(again)} sent again, e.g. {list(again.items())[:3]}")
    assert sorted(engine.aborted) == sorted(engine.held), (
        f"expected each of the {CUT} held requests aborted once; got {len(engine.aborted)} "
        f"namings of {len(set(engine.aborted))} ids")
    requests = samples(values, "cancel_sidecar_requests_total")
    assert requests == {frozenset({("route", "/"), ("status_class", "disconnected")}): CUT}, (
        f"expected all {CUT} requests counted as disconnected, got {requests}")
    disconnects = sum(samples(values, "cancel_sidecar_client_disconnects_total").values())
    assert disconnects == CUT, f"expected {CUT} client disconnects, got {disconnects}"
    errors = samples(values, "cancel_sidecar_upstream_errors_total")
    assert not any(errors.values()), (
        f"expected no upstream error (the engine ended its side on the sidecar's abort), "
        f"got {errors}")
    assert sample(values, "cancel_sidecar_in_flight_requests", route="/") == 0, (
        "expected no request left in flight")
    assert engine.ended | engine.closed == set(engine.held), (
        f"expected every held request ended (by its abort) or closed; {len(engine.ended)} "
        f"ended, {len(engine.closed)} closed of {CUT}")
    assert engine.ended, (
        "expected the engine to end some requests on their abort before the sidecar closed "
        "them (the case under test); it ended none: the teardown was never behind")
