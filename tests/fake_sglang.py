"""A fake SGLang server on 127.0.0.1 that follows SGLang 0.5.23's documented id behaviour
(``tests/sglang_facts.md``), written from the facts, not from the adapter, so the tests can
catch an adapter that disagrees with them.

- ``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``: the id is the body's
  ``rid`` (``X-Request-Id`` ignored; a fresh uuid4 hex if absent). A batch (``text`` or
  ``prompt`` a list, ``input_ids`` a list of lists) runs as ``{rid}_{i}``; ``n > 1`` runs every
  sample under a fresh uuid4 hex. Streams SSE (``tokens`` events, ``interval`` seconds apart,
  query parameters) after ``queue`` seconds waiting in the queue (no response headers yet);
  an abort ends the stream with ``finish_reason: abort``. A request whose connection closed
  stays live (abortable) for ``LINGER_S``, as the engine keeps generating for a gone client.
- ``POST /abort_request`` ``{"rid", "abort_all"}``: always 200. As with one tokenizer worker,
  an empty rid or one that is not exactly a live request's is ignored; otherwise every live
  request whose rid ``startswith`` it is aborted (the scheduler's prefix match).
- ``GET /health``: 200.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

LINGER_S = 5.0  # how long a request outlives its closed connection
GENERATING = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass
class Run:
    """One engine request (one prompt, one sample) as the fake scheduler holds it."""

    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class SGLangRecord:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    request_id_headers: list[str | None] = field(default_factory=list)
    rids: list[list[str]] = field(default_factory=list)  # the engine rids of each request
    abort_calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # rids actually aborted
    completed: list[str] = field(default_factory=list)  # rids that ran to their end
    closed: list[str] = field(default_factory=list)  # rids whose connection went away
    received: asyncio.Event = field(default_factory=asyncio.Event)
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)  # set on every call
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)


def _batch(path: str, body: dict[str, Any]) -> int | None:
    value = body.get("text") if path == "/generate" else body.get("prompt")
    if path == "/generate" and value is None:
        value = body.get("input_ids")
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return None


def _n(path: str, body: dict[str, Any]) -> int:
    params = body.get("sampling_params") if path == "/generate" else body
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) else 1


class FakeSGLang:
    def __init__(self) -> None:
        self.record = SGLangRecord()
        self.live: dict[str, Run] = {}
        app = web.Application()
        for path in GENERATING:
            app.router.add_post(path, self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    def _rids(self, path: str, body: dict[str, Any]) -> list[str]:
        rid = body.get("rid")
        base = rid if isinstance(rid, str) else uuid.uuid4().hex
        size, n = _batch(path, body), _n(path, body)
        if n > 1:  # regenerate_rid: every sample gets a fresh id
            return [uuid.uuid4().hex for _ in range((size or 1) * n)]
        return [base] if size is None else [f"{base}_{i}" for i in range(size)]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.record.bodies.append(body)
        self.record.request_id_headers.append(request.headers.get("X-Request-Id"))
        runs = [Run(rid) for rid in self._rids(request.path, body)]
        self.record.rids.append([r.rid for r in runs])
        self.live.update((r.rid, r) for r in runs)
        self.record.received.set()
        tokens = int(request.query.get("tokens", 20))
        interval = float(request.query.get("interval", 0.01))
        try:
            await self._wait(runs, float(request.query.get("queue", 0)))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(tokens):
                if all(r.aborted.is_set() for r in runs):
                    break
                await response.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
                await self._wait(runs, interval)
            reason = "abort" if all(r.aborted.is_set() for r in runs) else "stop"
            await response.write(
                f'data: {{"choices":[{{"finish_reason":"{reason}"}}]}}\n\n'.encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            self.record.completed.extend(r.rid for r in runs if not r.aborted.is_set())
        except asyncio.CancelledError:
            # The engine keeps running a request whose connection closed (until aborted, or
            # LINGER_S here): an abort that arrives after the close must still find it.
            self.record.closed.extend(r.rid for r in runs)
            self.record.closed_event.set()
            asyncio.get_running_loop().call_later(LINGER_S, self._forget, runs)
            raise
        self._forget(runs)
        return response

    def _forget(self, runs: list[Run]) -> None:
        for r in runs:
            self.live.pop(r.rid, None)

    @staticmethod
    async def _wait(runs: list[Run], seconds: float) -> None:
        """Sleep ``seconds``, or less if every run is aborted meanwhile."""
        waits = [asyncio.ensure_future(r.aborted.wait()) for r in runs]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.ALL_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.record.abort_calls.append(body)
        rid = body.get("rid") or ""
        if body.get("abort_all"):
            hits = list(self.live)
        elif rid and rid in self.live:  # one tokenizer worker: exact id, then prefix match
            hits = [r for r in self.live if r.startswith(rid)]
        else:
            hits = []
        for hit in hits:
            if not self.live[hit].aborted.is_set():
                self.live[hit].aborted.set()
                self.record.aborted.append(hit)
        self.record.abort_event.set()
        return web.Response()  # 200 whatever the id
