"""A scriptable fake engine on 127.0.0.1 for precise fault injection.

It speaks enough of vLLM's HTTP surface for the sidecar: ``/v1/chat/completions``,
``/v1/completions`` and ``/inference/v1/generate`` (SSE when the body says ``"stream": true``,
else one JSON document), the abort endpoint ``/inference/v1/abort_requests``, ``/health``, and
``/echo`` (answers with what it received). Behaviour per request comes from query parameters,
which the sidecar forwards untouched:

- ``tokens`` (int, default 20) and ``interval`` (seconds between SSE events, default 0.01)
- ``first_byte_delay`` (seconds before the response headers)
- ``die_after`` (events) with ``die=fin|rst``: the engine dies mid-stream
- ``chunk`` (bytes): for ``/bytes``, the body size

Everything it sees is recorded on :class:`EngineRecord` for the test to inspect, with events a
test can await instead of sleeping.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

ABORT_PATH = "/inference/v1/abort_requests"


@dataclass
class Generation:
    """One generating request as the engine saw it."""

    request_id: str | None
    path: str
    body: Any
    started: float
    events_sent: int = 0
    finished: bool = False  # the engine wrote its whole response
    closed_at: float | None = None  # the connection went away before the end


@dataclass
class AbortRecord:
    at: float
    ids: list[str]
    authorization: str | None
    raw: bytes


@dataclass
class EngineRecord:
    """What the fake engine saw."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    aborts: list[AbortRecord] = field(default_factory=list)
    abort_status: int = 200
    abort_delay: float = 0.0  # seconds before answering an abort call
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)
    started_event: asyncio.Event = field(default_factory=asyncio.Event)

    def aborted_ids(self) -> list[str]:
        return [i for a in self.aborts for i in a.ids]

    async def wait_abort(self, timeout: float = 5.0) -> AbortRecord:
        await asyncio.wait_for(self.abort_event.wait(), timeout)
        return self.aborts[0]


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def _float(request: web.Request, name: str, default: float) -> float:
    return float(request.query.get(name, default))


class FakeEngine:
    """The fake engine application and its record."""

    def __init__(self) -> None:
        self.record = EngineRecord()
        self.app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate"):
            self.app.router.add_post(path, self.generate)
        self.app.router.add_post(ABORT_PATH, self.abort)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_route("*", "/echo{tail:.*}", self.echo)
        self.app.router.add_get("/bytes", self.bytes_)
        self.app.router.add_get("/v1/models", self.models)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.record.requests.append({"path": request.path_qs, "headers": request.headers})
        return web.json_response({
            "method": request.method,
            "path_qs": request.raw_path,
            "version": f"{request.version.major}.{request.version.minor}",
            "headers": [[k, v] for k, v in request.headers.items()],
            "body_len": len(body),
            "body": body.decode("latin-1") if len(body) <= 65536 else None,
        }, headers={"X-Upstream": "fake", "Set-Cookie": "a=1", "Keep-Alive": "timeout=5"})

    async def bytes_(self, request: web.Request) -> web.Response:
        size = int(request.query.get("size", "1024"))
        return web.Response(body=bytes(i % 251 for i in range(size)),
                            headers={"Content-Encoding": request.query.get("encoding", "identity")})

    async def abort(self, request: web.Request) -> web.Response:
        raw = await request.read()
        ids = json.loads(raw).get("request_ids", [])
        self.record.aborts.append(AbortRecord(time.monotonic(), ids,
                                              request.headers.get("Authorization"), raw))
        self.record.abort_event.set()
        if self.record.abort_delay:
            await asyncio.sleep(self.record.abort_delay)
        return web.Response(status=self.record.abort_status)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        gen = Generation(request.headers.get("X-Request-Id"), request.path, body,
                         time.monotonic())
        self.record.generations.append(gen)
        self.record.started_event.set()
        try:
            return await self._generate(request, body, gen)
        except (asyncio.CancelledError, ConnectionResetError):
            gen.closed_at = time.monotonic()
            self.record.closed_event.set()
            raise

    async def _generate(self, request: web.Request, body: Any,
                        gen: Generation) -> web.StreamResponse:
        tokens = int(request.query.get("tokens", "20"))
        interval = _float(request, "interval", 0.01)
        die_after = int(request.query.get("die_after", "-1"))
        await asyncio.sleep(_float(request, "first_byte_delay", 0.0))
        if not body.get("stream"):
            await asyncio.sleep(tokens * interval)
            gen.finished = True
            return web.json_response({"id": gen.request_id, "object": "chat.completion",
                                      "choices": [{"index": 0, "text": "x" * tokens}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(tokens):
            if i == die_after:
                self._die(request, request.query.get("die", "fin"))
                return response
            await response.write(_sse({"id": gen.request_id, "choices": [{"text": f"t{i}"}]}))
            gen.events_sent += 1
            await asyncio.sleep(interval)
        await response.write(_sse("[DONE]"))
        gen.finished = True
        await response.write_eof()
        return response

    @staticmethod
    def _die(request: web.Request, how: str) -> None:
        transport = request.transport
        assert transport is not None
        if how == "rst":
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            transport.abort()
        else:
            transport.close()
