"""A lone engine id whose engine streamed response bytes is not always registered yet.

Since 8fc36a4 (``sidecar/proxy.py`` ``Exchange._abort_now``: ``registered = len(ids) == 1 and
bool(self.tail)``) a request with one engine id that had relayed any response body byte gets
its first abort call only: no re-sends inside the registration window, on the premise that
vLLM streams a request's first chunk only after ``add_request``. That holds for chat
completions (``chat_completion_stream_generator``). It does not hold for a streaming,
non-background ``POST /v1/responses`` (engine id ``resp_{id}_0``): vLLM's
``OpenAIServingResponses.responses_stream_generator`` (``vllm/entrypoints/openai/responses/
serving.py``) yields ``response.created`` and ``response.in_progress`` before it first iterates
``result_generator``, and ``_generate_with_builtin_tools`` calls ``engine_client.generate``
(whose first step is ``add_request``) only when iterated. So those two events reach the client
before the id is registered; on an API server busy enough to register late, a client that leaves
on them gets one abort vLLM ignores, and the request runs for nobody.

The engine here is :class:`tests.fakes.responses.ResponsesEngine` with that order: the head
and both events at once, the id registered ``register_delay`` later, then the tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from tests.conftest import sidecar_settings
from tests.fakes.kinds import _wait
from tests.fakes.responses import ResponsesEngine, pydantic_bool
from tests.harness.support import API_KEY, Stalls, raw_client

pytestmark = pytest.mark.timeout(60)

RESPONSES = "/v1/responses"
REGISTER_S = 0.4  # body whole -> resp_{id}_0 registered (tokenizing, rendering: a busy server)


class CreatedFirstEngine(ResponsesEngine):
    """A streaming non-background ``POST /v1/responses`` as vLLM serves it: the head,
    ``response.created`` and ``response.in_progress`` first, the engine id registered
    ``register_delay`` seconds after the body, then ``tokens`` deltas ``interval`` apart."""

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if pydantic_bool(body.get("background")) or not body.get("stream"):
            return await super().create(request)
        query = request.query
        tokens, interval = int(query.get("tokens", 20)), float(query.get("interval", 0.01))
        work = self.admit(request.path, request.headers, body,
                          delay_s=float(query.get("register_delay", 0)),
                          length_s=tokens * interval)
        work.tokens, work.interval_s = tokens, interval
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            for kind in ("response.created", "response.in_progress"):
                event = {"type": kind, "response": {"id": work.tag, "status": "in_progress"}}
                await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
            await work.known.wait()
            for i in range(tokens):
                if work.stop.is_set():
                    break
                delta = {"type": "response.output_text.delta", "delta": f"t{i}"}
                await response.write(f"data: {json.dumps(delta)}\n\n".encode())
                work.events += 1
                await _wait(work.stop, interval)
            self._end(work)
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self._closed(work)
            raise
        return response


@pytest_asyncio.fixture
async def responses_engine() -> AsyncIterator[CreatedFirstEngine]:
    engine = CreatedFirstEngine(API_KEY)
    await engine.start()
    yield engine
    await engine.stop()


async def test_reset_on_response_created_is_aborted_once_registered(
        responses_engine: CreatedFirstEngine, start_sidecar: Callable[..., Any],
        stalls: Stalls) -> None:
    engine = responses_engine
    # the documented defaults: re-sends for 2 s from the body, intervals up to 0.2 s
    settings = sidecar_settings(engine.url, engines={"local": {
        "kind": "vllm", "url": engine.url,
        "abort": {"api_key": API_KEY, "timeout_s": 2.0}}})
    servers = await start_sidecar(settings)
    body = json.dumps({"model": "m", "input": "hi", "stream": True}).encode()
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", f"{RESPONSES}?register_delay={REGISTER_S}&tokens=2000&interval=0.005",
                    body)
        status, _ = await client.head()
        assert status == 200, f"expected the stream's 200 head, got {status}"
        await client.read_until(b"\n\n")  # event: response.created
        left = client.disconnect("rst")
    work = engine.works[-1]
    await stalls.wait(work.known.wait(), f"resp id registered {REGISTER_S}s after the body")
    registered = time.monotonic()
    stopped = await engine.watch.until(lambda: work.stopped_at is not None, 1.0)
    named = [round(c.at - left, 3) for c in engine.calls if work.engine_ids[0] in c.ids]
    assert stopped, (
        f"expected {work.engine_ids[0]} aborted within 1 s of its registration (a re-send "
        f"inside the 2 s window; the client left {registered - left:.3f} s before it "
        f"registered, on the response.created event); got it still running after "
        f"{time.monotonic() - registered:.2f} s: named in {len(named)} call(s) at {named} s "
        f"after the client left, {len(work.ignored.get(work.engine_ids[0], []))} of them "
        f"before it was registered (ignored)")
