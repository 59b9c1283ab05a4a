"""A scriptable fake engine on 127.0.0.1 for precise fault injection.

It speaks enough of vLLM's HTTP surface for the sidecar: ``/v1/chat/completions``,
``/v1/completions``, ``/inference/v1/generate`` and ``/v1/responses`` (SSE when the body says
``"stream": true``, else one JSON document), the abort endpoint ``/inference/v1/abort_requests``,
``/health``, and ``/echo`` (answers with what it received). Behaviour per request comes from
query parameters, which the sidecar forwards untouched:

- ``tokens`` (int, default 20) and ``interval`` (seconds between SSE events, default 0.01)
- ``first_byte_delay`` (seconds before the response headers)
- ``die_after`` (events) with ``die=fin|rst``: the engine dies mid-stream
- ``hang_after_done`` (seconds): after ``data: [DONE]``, wait this long before the final chunk
- ``chunk`` (bytes): for ``/bytes``, the body size
- ``hold`` (seconds), on any route: wait this long before the handler runs (a slow
  non-generating route such as ``GET /v1/models``)
- ``body_pieces`` (int, default 1) and ``body_interval`` (seconds, default 0.1): a
  non-streaming answer's JSON body, with its ``Content-Length`` in the head, is written in this
  many pieces, ``body_interval`` apart (the head and the first piece at once): a JSON response
  still being relayed when the client, the cancel API or a deadline ends it

Everything it sees is recorded on :class:`EngineRecord` for the test to inspect, with events a
test can await instead of sleeping.

Transparency routes (``tests/test_proxy.py``): ``/sink`` (streams the body in, answers its length
and SHA-256), ``/status/{code}`` (that status with two Set-Cookie fields), ``/gzip`` (a gzip body
byte for byte), ``/peer`` and ``/peer_stream`` (which upstream connection carried the request;
used by ``tests/faults/test_upstream_faults.py``).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.readiness import PROBE_PREFIX

ABORT_PATH = "/inference/v1/abort_requests"
ABORT_RESET = 0  # in EngineRecord.abort_script: reset the abort call's connection, no answer


@dataclass
class Generation:
    """One generating request as the engine saw it."""

    request_id: str | None
    path: str
    body: Any
    started: float
    events_sent: int = 0
    finished: bool = False  # the engine wrote its whole response, not aborted
    closed_at: float | None = None  # the connection went away before the end
    aborted_at: float | None = None  # an abort named it: it ended at once, "abort" (as vLLM)
    abort: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def stopped_at(self) -> float | None:
        """When the engine stopped it before its end: aborted, or its connection closed."""
        return self.aborted_at if self.aborted_at is not None else self.closed_at


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
    # Readiness probes (/readyz, the CLI's startup check: one id named
    # cancel-sidecar-readiness-probe-*), kept apart from the aborts above; they get
    # abort_key's 401 and abort_status only, never abort_script, abort_gate or abort_delay.
    probes: list[AbortRecord] = field(default_factory=list)
    abort_status: int = 200
    abort_delay: float = 0.0  # seconds before answering an abort call
    # Abort-fault knobs (tests/faults): statuses for the next abort calls in arrival order, then
    # abort_status again (ABORT_RESET: reset the connection instead of answering); a key the
    # Authorization header must carry, else 401; a gate every abort call waits for while unset.
    abort_script: list[int] = field(default_factory=list)
    abort_key: str | None = None
    abort_gate: asyncio.Event | None = None
    abort_redirect: str | None = None  # answer every abort call (probes too) 307 to this URL
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)
    stopped_event: asyncio.Event = field(default_factory=asyncio.Event)  # aborted or closed
    # False: abort calls end nothing (an engine whose aborts never reach the request's owner,
    # e.g. another of vLLM's API-server processes): the sidecar cannot confirm.
    abort_ends: bool = True
    started_event: asyncio.Event = field(default_factory=asyncio.Event)

    def aborted_ids(self) -> list[str]:
        return [i for a in self.aborts for i in a.ids]

    async def wait_abort(self, guard_s: float = 5.0) -> AbortRecord:
        await asyncio.wait_for(self.abort_event.wait(), guard_s)
        return self.aborts[0]


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _until(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile."""
    if seconds > 0 and not event.is_set():
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass


def _float(request: web.Request, name: str, default: float) -> float:
    return float(request.query.get(name, default))


class FakeEngine:
    """The fake engine application and its record."""

    def __init__(self) -> None:
        self.record = EngineRecord()
        self.app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate",
                     "/v1/responses"):
            self.app.router.add_post(path, self.generate)
        self.app.router.add_post(ABORT_PATH, self.abort)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_route("*", "/echo{tail:.*}", self.echo)
        self.app.router.add_get("/bytes", self.bytes_)
        self.app.router.add_get("/v1/models", self.models)
        self._add_proxy_test_routes()
        self._add_cancel_test_routes()
        self._add_slow_client_routes()
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.scheme = "http"

    async def start(self, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        """Listen on 127.0.0.1:``port`` (0: a free port), e.g. a port a sidecar already
        points at, for an engine that comes up after the sidecar; over TLS with ``tls`` (a
        server context: :attr:`url` is then ``https://``)."""
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=tls).start()
        self.port = self.runner.addresses[0][1]
        self.scheme = "https" if tls is not None else "http"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

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
        seen = AbortRecord(time.monotonic(), ids, request.headers.get("Authorization"), raw)
        record = self.record
        probe = len(ids) == 1 and str(ids[0]).startswith(PROBE_PREFIX)
        if probe:
            record.probes.append(seen)
        else:
            record.aborts.append(seen)
            record.abort_event.set()
        if record.abort_key is not None and (
                request.headers.get("Authorization") != f"Bearer {record.abort_key}"):
            return web.Response(status=401)
        if record.abort_redirect is not None:
            raise web.HTTPTemporaryRedirect(record.abort_redirect)
        if probe:
            return web.Response(status=record.abort_status)
        status = record.abort_script.pop(0) if record.abort_script else record.abort_status
        if record.abort_gate is not None:
            await record.abort_gate.wait()
        if record.abort_delay:
            await asyncio.sleep(record.abort_delay)
        if status == ABORT_RESET:
            self._die(request, "rst")
            return web.Response()  # never sent: the connection is gone
        if 200 <= status < 300 and record.abort_ends:
            self._end_aborted([str(i) for i in ids])
        return web.Response(status=status)

    def _end_aborted(self, ids: list[str]) -> None:
        """vLLM's abort: every running generation an id names (its X-Request-Id inside the
        engine id: ``chatcmpl-{id}``, ``cmpl-{id}-{i}``, ``resp_{id}_{k}``...) ends at once,
        a stream with a last chunk whose finish_reason is "abort" and ``data: [DONE]``, a JSON
        answer at once with that finish_reason."""
        now = time.monotonic()
        for gen in self.record.generations:
            if (gen.request_id and not gen.finished and gen.stopped_at is None
                    and any(gen.request_id in i for i in ids)):
                gen.aborted_at = now
                gen.abort.set()
                self.record.stopped_event.set()
                self.watch.changed()

    async def listen_again(self) -> tuple[web.BaseSite, int]:
        """Another listening socket (a free port) for the same engine, e.g. one a test closes
        with ``site.stop()``: that closes the listener only, its established connections stay."""
        assert self.runner is not None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self.runner, sock)
        await site.start()
        return site, int(sock.getsockname()[1])

    def drop_idle_connections(self) -> int:
        """Close (RST) every connection not serving a request now, e.g. the sidecar's warm abort
        connection: with the listener stopped too, nothing reaches the engine any more but
        the requests in progress. Returns how many were closed."""
        assert self.runner is not None and self.runner.server is not None
        idle = [c for c in self.runner.server.connections
                if c._current_request is None and c.transport is not None]
        for handler in idle:
            assert handler.transport is not None
            handler.transport.abort()
        return len(idle)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        gen = Generation(request.headers.get("X-Request-Id"), request.path, body,
                         time.monotonic())
        self.record.generations.append(gen)
        self.record.started_event.set()
        self.watch.changed()  # a test can await a generation starting
        try:
            return await self._generate(request, body, gen)
        except (asyncio.CancelledError, ConnectionResetError):
            gen.closed_at = time.monotonic()
            self.record.closed_event.set()
            self.record.stopped_event.set()
            raise

    async def _generate(self, request: web.Request, body: Any,
                        gen: Generation) -> web.StreamResponse:
        tokens = int(request.query.get("tokens", "20"))
        interval = _float(request, "interval", 0.01)
        die_after = int(request.query.get("die_after", "-1"))
        await _until(gen.abort, _float(request, "first_byte_delay", 0.0))
        if not body.get("stream"):
            await _until(gen.abort, tokens * interval)
            answer: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion",
                      "choices": [{"index": 0, "text": "x" * tokens}]}
            if gen.abort.is_set():
                answer["choices"][0]["finish_reason"] = "abort"
                return web.json_response(answer)
            if int(request.query.get("body_pieces", "1")) > 1:
                return await self._json_in_pieces(request, answer, gen)
            gen.finished = True
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(tokens):
            if i == die_after:
                self._die(request, request.query.get("die", "fin"))
                return response
            if gen.abort.is_set():
                await response.write(_sse({"id": gen.request_id, "choices": [
                    {"text": "", "finish_reason": "abort"}]}) + _sse("[DONE]"))
                await response.write_eof()
                return response
            await response.write(_sse({"id": gen.request_id, "choices": [{"text": f"t{i}"}]}))
            gen.events_sent += 1
            await _until(gen.abort, interval)
        await response.write(_sse("[DONE]"))
        gen.finished = True
        await asyncio.sleep(_float(request, "hang_after_done", 0.0))
        await response.write_eof()
        return response

    async def _json_in_pieces(self, request: web.Request, answer: dict[str, Any],
                              gen: Generation) -> web.StreamResponse:
        """``answer`` as JSON with its Content-Length, in ``body_pieces`` writes
        ``body_interval`` seconds apart."""
        data = json.dumps(answer).encode()
        pieces = int(request.query["body_pieces"])
        size = -(-len(data) // pieces)  # ceil: exactly ``pieces`` writes for a long enough body
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(data)
        await response.prepare(request)
        for start in range(0, len(data), size):
            if start:
                await asyncio.sleep(_float(request, "body_interval", 0.1))
            await response.write(data[start:start + size])
            gen.events_sent += 1
        gen.finished = True
        await response.write_eof()
        return response

    @staticmethod
    def _die(request: web.Request, how: str) -> None:
        transport = request.transport
        assert transport is not None
        if how == "rst":
            sock = transport.get_extra_info("socket")
            linger_on_zero = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # l_onoff=1, l_linger=0
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_on_zero)
            transport.abort()
        else:
            transport.close()

    # Routes for tests/test_proxy.py: transparency checks that need more than /echo.

    def _add_proxy_test_routes(self) -> None:
        self.peers: list[int] = []  # upstream-side client port of every /peer* request, in order
        self.sink_first_chunk = asyncio.Event()  # /sink read its first body bytes
        self.peer_stream_closed = asyncio.Event()  # a /peer_stream connection went away early
        self.app.router.add_route("*", "/sink", self.sink)
        self.app.router.add_route("*", "/status/{code:\\d+}", self.status)
        self.app.router.add_get("/gzip", self.gzip_)
        self.app.router.add_route("*", "/peer", self.peer)
        self.app.router.add_get("/peer_stream", self.peer_stream)

    def _peer(self, request: web.Request) -> int:
        assert request.transport is not None
        port = int(request.transport.get_extra_info("peername")[1])
        self.peers.append(port)
        return port

    async def sink(self, request: web.Request) -> web.Response:
        """Reads the body as it streams in; answers its length, SHA-256 and request headers."""
        digest = hashlib.sha256()
        size = 0
        while chunk := await request.content.readany():
            digest.update(chunk)
            size += len(chunk)
            self.sink_first_chunk.set()
        return web.json_response({
            "body_len": size, "sha256": digest.hexdigest(),
            "headers": [[k, v] for k, v in request.headers.items()],
        })

    async def status(self, request: web.Request) -> web.Response:
        """``/status/{code}``: that status, a custom header, two Set-Cookie fields, a body."""
        code = int(request.match_info["code"])
        headers = CIMultiDict([("X-Custom", "custom value"), ("Set-Cookie", "a=1; Path=/"),
                               ("Set-Cookie", "b=2; HttpOnly"), ("Content-Type", "text/plain")])
        body = None if code in (204, 304) else f"status {code} body\n".encode()
        return web.Response(status=code, body=body, headers=headers)

    async def gzip_(self, request: web.Request) -> web.StreamResponse:
        """:func:`gzip_body` as ``Content-Encoding: gzip``, chunked in three writes (or with a
        Content-Length if ``?chunked=0``); ``X-Seen-Accept-Encoding`` says what the engine got."""
        body = gzip_body()
        response = web.StreamResponse(headers={
            "Content-Encoding": "gzip", "Content-Type": "application/json",
            "X-Seen-Accept-Encoding": request.headers.get("Accept-Encoding", "<none>")})
        if request.query.get("chunked") == "0":
            response.content_length = len(body)
        await response.prepare(request)
        third = len(body) // 3
        for part in (body[:third], body[third:2 * third], body[2 * third:]):
            await response.write(part)
        await response.write_eof()
        return response

    async def peer(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"peer": self._peer(request)})

    async def peer_stream(self, request: web.Request) -> web.StreamResponse:
        """SSE like the generate routes (``tokens``, ``interval``), with ``X-Upstream-Peer``."""
        port = self._peer(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Upstream-Peer": str(port)})
        try:
            await response.prepare(request)
            for i in range(int(request.query.get("tokens", "20"))):
                await response.write(_sse({"n": i}))
                await asyncio.sleep(_float(request, "interval", 0.01))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.peer_stream_closed.set()
            raise
        return response


    # Routes for tests/test_cancel.py: a middleware records every request (``self.watch``), and
    # an abort endpoint that never answers.

    def _add_cancel_test_routes(self) -> None:
        self.watch = Watch()
        self.app.middlewares.append(_watch_middleware(self.watch))
        self.app.router.add_post(HANG_ABORT_PATH, self.hang_abort)

    async def hang_abort(self, request: web.Request) -> web.Response:
        """Records the abort call like :meth:`abort`, then never answers."""
        raw = await request.read()
        ids = json.loads(raw).get("request_ids", [])
        self.record.aborts.append(AbortRecord(time.monotonic(), ids,
                                              request.headers.get("Authorization"), raw))
        self.record.abort_event.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


    # Routes for tests/faults/test_slow_clients.py: a stream as fast as the connection takes it.

    def _add_slow_client_routes(self) -> None:
        self.flood = Flood()
        self.app.router.add_get("/flood", self.flood_)

    async def flood_(self, request: web.Request) -> web.StreamResponse:
        """``size`` bytes (default 256 MiB, rounded down to whole events) of SSE in
        :func:`flood_event` events, written as fast as the connection takes them, then
        ``data: [DONE]``. ``self.flood.written`` counts the bytes handed on by each awaited
        write (aiohttp's write waits while the socket's send buffer is full)."""
        flood = self.flood
        events = int(request.query.get("size", str(256 * 1024 * 1024))) // FLOOD_EVENT_BYTES
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            for i in range(events):
                await response.write(flood_event(i))
                flood.written += FLOOD_EVENT_BYTES
            await response.write(_sse("[DONE]"))
            flood.written += len(_sse("[DONE]"))
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            flood.closed = True
            raise
        flood.finished = True
        return response


FLOOD_EVENT_BYTES = 65536


@dataclass
class Flood:
    """What ``/flood`` has written so far (bytes), and how it ended."""

    written: int = 0
    finished: bool = False
    closed: bool = False  # the connection went away before the end


def flood_event(i: int) -> bytes:
    """Event ``i`` of ``/flood``: ``data: <i> ppp...\n\n``, :data:`FLOOD_EVENT_BYTES` long."""
    head = b"data: %08d " % i
    return head + b"p" * (FLOOD_EVENT_BYTES - len(head) - 2) + b"\n\n"


def flood_sha256(size: int) -> tuple[int, str]:
    """(length, SHA-256) of the whole ``/flood?size=size`` body, ``[DONE]`` included."""
    digest = hashlib.sha256()
    events = size // FLOOD_EVENT_BYTES
    for i in range(events):
        digest.update(flood_event(i))
    digest.update(_sse("[DONE]"))
    return events * FLOOD_EVENT_BYTES + len(_sse("[DONE]")), digest.hexdigest()


def gzip_body() -> bytes:
    """The exact bytes ``/gzip`` sends: a gzip member (mtime 0, so deterministic) of JSON."""
    text = json.dumps({"text": "hello sidecar " * 4000}).encode()
    return gzip.compress(text, compresslevel=6, mtime=0)


# Recording and routes for tests/test_cancel.py: every request as the engine saw it, whatever
# its route, and an abort endpoint that never answers.

HANG_ABORT_PATH = "/hang/abort_requests"


@dataclass
class Seen:
    """One request as it reached the engine (any route), recorded by the fake's middleware.

    ``body_bytes`` is how many request body bytes had arrived when the handler ended or failed;
    ``failed_at``/``error`` say the handler was cancelled or raised (e.g. the connection went
    away while the engine was still reading the body).
    """

    method: str
    path: str
    request_id: str | None
    headers: CIMultiDictProxy[str]
    content_length: int | None
    started: float
    ended_at: float | None = None
    failed_at: float | None = None
    error: str | None = None
    body_bytes: int = 0


class Watch:
    """What the engine saw on every route, with a way to await any condition over it."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    def changed(self) -> None:
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    async def until(self, predicate: Callable[[], bool], within_s: float) -> bool:
        """Wait until ``predicate()`` holds (checked whenever a request starts, ends or fails);
        ``False`` if it still does not after ``within_s`` seconds."""
        if predicate():
            return True
        waiter = (predicate, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter[1]), within_s)
            return True
        except TimeoutError:
            return predicate()
        finally:
            self._waiters.remove(waiter)
            waiter[1].cancel()

    def on(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]


def _watch_middleware(watch: Watch) -> Any:
    @web.middleware
    async def watch_requests(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                             ) -> web.StreamResponse:
        seen = Seen(request.method, request.path, request.headers.get("X-Request-Id"),
                    request.headers, request.content_length, time.monotonic())
        watch.seen.append(seen)
        watch.changed()
        try:
            if "hold" in request.query:
                await asyncio.sleep(float(request.query["hold"]))
            response = await handler(request)
        except BaseException as exc:
            seen.failed_at = time.monotonic()
            seen.error = type(exc).__name__
            seen.body_bytes = request.content.total_bytes
            watch.changed()
            raise
        seen.ended_at = time.monotonic()
        seen.body_bytes = request.content.total_bytes
        watch.changed()
        return response

    return watch_requests
