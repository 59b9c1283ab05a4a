"""Fake engines, one per engine kind, each following that kind's documented request-id and
abort behaviour. Written from the facts, never from the adapters in ``engine/``, so a test can
catch an adapter that disagrees with them. Used by ``tests/test_cancel_every_kind.py`` (the same
cancellation tests for every kind) and ``tests/test_fanout.py`` (a router in front of several).

One scheduler model behind three front ends. A :class:`Work` is one client request as the engine
holds it: the id it was told, the engine request ids its scheduler runs it under, and whether it
ran to its end or was stopped early. An engine that can abort keeps generating for a request
whose connection closed, as vLLM and SGLang do whenever their own disconnect check is broken
(the case the sidecar exists for), until that request is aborted by id or ``LINGER_S`` passes;
so a disconnect test passes only if the abort named the right ids. A close-only engine stops a
request when its connection closes: that is its only way to stop.

- :class:`VLLMEngine` (``../shared/notes/vllm-facts.md``, README "Request ids", checked against
  vLLM 0.32 in ``tests/e2e/VLLM_FACTS_CHECKED.md``): the id is the ``X-Request-Id`` header;
  ``/v1/chat/completions`` runs as ``chatcmpl-{id}``, ``/v1/completions`` as ``cmpl-{id}-{i}``
  one per prompt (``-0`` for a single prompt), ``/inference/v1/generate`` as
  ``generate-tokens-{id}``. ``POST /inference/v1/abort_requests {"request_ids": [...]}`` aborts
  exactly the named live ids, ignores unknown ones, answers 200; without ``--enable-scale-out``
  (``scale_out=False``) the route answers 403 to every call.
- :class:`SGLangEngine` (``tests/sglang_facts.md``, SGLang 0.5.23): the id is the body's ``rid``
  (``X-Request-Id`` is ignored; a fresh uuid4 hex if absent); a batch (``/generate`` ``text`` or
  ``input_ids`` a list of lists, ``/v1/completions`` ``prompt`` a list of strings) runs as
  ``{rid}_{i}``; ``n > 1`` runs every sample under a fresh uuid4 hex. ``POST /abort_request
  {"rid"}`` always answers 200; a rid that is not exactly a live request's is ignored (one
  tokenizer worker), otherwise every live request whose id starts with it is aborted (the
  scheduler's prefix match).
- :class:`OpenAIEngine`: an OpenAI-compatible server without an abort endpoint (TGI,
  llama.cpp's server, Ollama): it picks its own ids; every path it does not serve is a 404 and
  recorded in ``unknown_paths``.

Requests: POST on a generating path with a JSON object body (``"stream": true`` for SSE). Query
parameters (the sidecar forwards them untouched): ``tokens`` (default 20) events ``interval``
seconds apart (default 0.01), after ``first_byte_delay`` seconds queued (no response head yet).
A positive integer ``max_tokens`` in the body caps ``tokens``, as every engine caps its output
(llm-d's prefill legs ask for ``max_tokens: 1``). ``prefill_only=True`` makes the engine a
disaggregated prefill server: every request ends after one token, whatever it asks (SGLang's
``--disaggregation-mode prefill`` ends a request once its prefill is done and its KV handed to
the decode server; llm-d's SGLang connector sends the prefill leg the client's body unchanged).
``GET /v1/models`` (``hold`` seconds before answering) and ``GET /health`` answer on every kind.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web

from sidecar.readiness import PROBE_PREFIX
from tests.fake_engine import Watch

LINGER_S = 10.0  # how long an abortable engine goes on with a request whose connection closed


@dataclass
class Work:
    """One client request as the engine holds it (one or more engine request ids).

    Times are ``time.monotonic()``; ``stopped_at`` is when the engine stopped working on it
    before its end (every engine id aborted, or, on a close-only engine, the connection closed).
    """

    path: str
    request_id_header: str | None  # the X-Request-Id the engine received
    tag: str | None  # the id the engine took for the request (None: one it picked itself)
    engine_ids: tuple[str, ...]
    started: float
    aborted: dict[str, float] = field(default_factory=dict)  # engine id -> when aborted
    closed_at: float | None = None  # its connection went away before the response ended
    stopped_at: float | None = None
    finished: bool = False  # it ran to its end (for a client, or for nobody)
    events: int = 0  # SSE token events written to its connection
    stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def running(self) -> bool:
        return not self.finished and self.stopped_at is None


@dataclass
class ModelsRequest:
    """One ``GET /v1/models``: when it arrived, and when its connection went away early."""

    started: float
    closed_at: float | None = None


@dataclass
class AbortCall:
    """One call to the engine's abort endpoint: the ids it named and what it was answered."""

    at: float
    ids: list[str]
    authorization: str | None
    status: int
    body: Any = None  # the call's JSON body


class KindEngine:
    """The scheduler model and HTTP surface shared by every kind; subclasses say how a request
    gets its ids (:meth:`derive`) and what their abort endpoint does."""

    kind: ClassVar[str]
    generating: ClassVar[tuple[str, ...]]
    aborts: ClassVar[bool] = True  # the engine keeps a closed request running until aborted

    def __init__(self, api_key: str | None = None, *, prefill_only: bool = False) -> None:
        self.api_key = api_key  # the abort endpoint answers 401 without this bearer key
        self.prefill_only = prefill_only  # every request ends after one token (a P/D prefill)
        self.works: list[Work] = []
        self.calls: list[AbortCall] = []
        self.probes: list[AbortCall] = []  # the sidecar's readiness probes, kept apart
        self.unknown_paths: list[str] = []
        self.model_requests: list[ModelsRequest] = []
        self.live: dict[str, Work] = {}  # engine id -> its work, while it runs
        self.watch = Watch()  # await any condition over works/calls: watch.until(predicate, s)
        self.app = web.Application(middlewares=[self._unknown])
        for path in self.generating:
            self.app.router.add_post(path, self.generate)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self._add_abort_route()
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        for task in self._tasks:
            task.cancel()

    # -- what subclasses define ---------------------------------------------------------------

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        """(the id the engine takes for the request, its engine request ids)."""
        raise NotImplementedError

    def _add_abort_route(self) -> None:
        """Add the kind's abort endpoint, if it has one."""

    # -- the scheduler ------------------------------------------------------------------------

    def admit(self, path: str, headers: Mapping[str, str], body: dict[str, Any]) -> Work:
        """Start running a request (as :meth:`generate` does, or a router that forwards one)."""
        tag, ids = self.derive(path, headers, body)
        work = Work(path, headers.get("X-Request-Id"), tag, ids, time.monotonic())
        self.works.append(work)
        self.live.update((i, work) for i in ids)
        self.watch.changed()
        return work

    def abort_ids(self, ids: list[str]) -> None:
        """Abort the live engine requests named; a work stops once all its ids are aborted."""
        now = time.monotonic()
        for engine_id in ids:
            work = self.live.pop(engine_id, None)
            if work is None:
                continue
            work.aborted[engine_id] = now
            if not any(self.live.get(i) is work for i in work.engine_ids):
                work.stopped_at = now
                work.stop.set()
        self.watch.changed()

    def _end(self, work: Work) -> None:
        if work.running:
            work.finished = True
        for i in work.engine_ids:
            if self.live.get(i) is work:
                del self.live[i]
        self.watch.changed()

    def _closed(self, work: Work) -> None:
        """The request's connection went away before its response ended."""
        work.closed_at = time.monotonic()
        if not self.aborts:
            work.stopped_at = work.closed_at
            work.stop.set()
            self._end(work)
        elif work.running:  # goes on for nobody until aborted or LINGER_S
            task = asyncio.get_running_loop().create_task(
                self._linger(work), name=f"{self.kind} linger {work.engine_ids[0]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.watch.changed()

    async def _linger(self, work: Work) -> None:
        await _wait(work.stop, LINGER_S)
        self._end(work)

    # -- HTTP ---------------------------------------------------------------------------------

    @web.middleware
    async def _unknown(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            self.unknown_paths.append(request.path)
            self.watch.changed()
            raise

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``, after ``hold`` seconds; ``model_requests`` records each one."""
        seen = ModelsRequest(time.monotonic())
        self.model_requests.append(seen)
        self.watch.changed()
        try:
            await asyncio.sleep(float(request.query.get("hold", 0)))
        except asyncio.CancelledError:
            seen.closed_at = time.monotonic()
            self.watch.changed()
            raise
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object"}},
                                     status=400)
        work = self.admit(request.path, request.headers, body)
        try:
            return await self._respond(request, body, work)
        except (asyncio.CancelledError, ConnectionResetError):
            self._closed(work)
            raise

    async def _respond(self, request: web.Request, body: dict[str, Any],
                       work: Work) -> web.StreamResponse:
        tokens = int(request.query.get("tokens", 20))
        cap = body.get("max_tokens")
        if type(cap) is int and cap > 0:
            tokens = min(tokens, cap)
        if self.prefill_only:
            tokens = min(tokens, 1)
        interval = float(request.query.get("interval", 0.01))
        await _wait(work.stop, float(request.query.get("first_byte_delay", 0)))
        ident = work.tag or work.engine_ids[0]
        if not body.get("stream"):
            await _wait(work.stop, tokens * interval)
            reason = "abort" if work.stop.is_set() else "stop"
            if work.stop.is_set():
                # Aborted before its answer (the sidecar's abort can arrive before its upstream
                # close): record the connection going away if it does before the answer would.
                await self._until_closed(request, work)
            response = web.json_response({"id": ident, "choices": [
                {"index": 0, "text": "x" * tokens, "finish_reason": reason}]})
            self._end(work)
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(tokens):
            if work.stop.is_set():
                break
            await response.write(_sse({"id": ident, "choices": [{"index": 0, "text": f"t{i}"}]}))
            work.events += 1
            if work.events == 1:
                self.watch.changed()
            await _wait(work.stop, interval)
        reason = "abort" if work.stop.is_set() else "stop"
        await response.write(_sse({"id": ident, "choices": [{"index": 0, "text": "",
                                                             "finish_reason": reason}]}))
        await response.write(b"data: [DONE]\n\n")
        self._end(work)
        await response.write_eof()
        return response

    async def _until_closed(self, request: web.Request, work: Work, within_s: float = 1.0
                            ) -> None:
        """Wait up to ``within_s`` for the request's connection to close; if it does, that is
        :meth:`_closed` (the connection went away before the response)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                work.closed_at = time.monotonic()
                self.watch.changed()
                return
            await asyncio.sleep(0.001)

    def _record_call(self, request: web.Request, body: Any, ids: list[str], status: int
                     ) -> AbortCall:
        """Record an abort call (a readiness probe apart) and say whether it is authorised."""
        call = AbortCall(time.monotonic(), ids, request.headers.get("Authorization"), status,
                         body)
        if self.api_key is not None and call.authorization != f"Bearer {self.api_key}":
            call.status = 401
        probe = len(ids) == 1 and ids[0].startswith(PROBE_PREFIX)
        (self.probes if probe else self.calls).append(call)
        self.watch.changed()
        return call


class VLLMEngine(KindEngine):
    """vLLM's request ids and abort endpoint (see the module docstring)."""

    kind = "vllm"
    generating = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate")
    abort_path = "/inference/v1/abort_requests"

    def __init__(self, api_key: str | None = None, *, scale_out: bool = True,
                 prefill_only: bool = False) -> None:
        self.scale_out = scale_out  # False: started without --enable-scale-out
        super().__init__(api_key, prefill_only=prefill_only)

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        rid = headers.get("X-Request-Id") or uuid.uuid4().hex
        if path == "/v1/chat/completions":
            return rid, (f"chatcmpl-{rid}",)
        if path == "/v1/completions":
            prompt = body.get("prompt")
            many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            return rid, tuple(f"cmpl-{rid}-{i}" for i in range(len(prompt) if many else 1))
        return rid, (f"generate-tokens-{rid}",)

    def _add_abort_route(self) -> None:
        self.app.router.add_post(self.abort_path, self.abort)

    async def abort(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        ids = [str(i) for i in body.get("request_ids", [])]
        call = self._record_call(request, body, ids, 200 if self.scale_out else 403)
        if call.status == 200:
            self.abort_ids(ids)  # in the background in vLLM; unknown ids ignored
        return web.Response(status=call.status)


class SGLangEngine(KindEngine):
    """SGLang's request ids and abort endpoint (see the module docstring)."""

    kind = "sglang"
    generating = ("/generate", "/v1/completions", "/v1/chat/completions")
    abort_path = "/abort_request"

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        rid = body.get("rid")
        base = rid if isinstance(rid, str) else uuid.uuid4().hex
        size, n = _sglang_batch(path, body), _sglang_n(path, body)
        if n > 1:  # regenerate_rid: every sample gets a fresh id
            return base, tuple(uuid.uuid4().hex for _ in range((size or 1) * n))
        return base, ((base,) if size is None else tuple(f"{base}_{i}" for i in range(size)))

    def _add_abort_route(self) -> None:
        self.app.router.add_post(self.abort_path, self.abort)

    async def abort(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        rid = str(body.get("rid") or "")
        call = self._record_call(request, body, [rid], 200)
        if call.status == 200:
            if body.get("abort_all"):
                self.abort_ids(list(self.live))
            elif rid in self.live:  # one tokenizer worker: exact id, then the prefix match
                self.abort_ids([i for i in self.live if i.startswith(rid)])
        return web.Response(status=call.status)  # 200 whatever the id


class OpenAIEngine(KindEngine):
    """An OpenAI-compatible server without an abort endpoint; ``forward_to``: engines it
    forwards every generating request to (a prefill/decode router: the request lives on each)."""

    kind = "openai"
    generating = ("/v1/chat/completions", "/v1/completions")
    aborts = False

    def __init__(self, forward_to: tuple[KindEngine, ...] = ()) -> None:
        self.forward_to = forward_to
        self.forwarded: dict[int, list[tuple[KindEngine, Work]]] = {}  # id(work) -> behind it
        super().__init__()

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        return None, (f"own-{uuid.uuid4().hex}",)

    def admit(self, path: str, headers: Mapping[str, str], body: dict[str, Any]) -> Work:
        behind = [(e, e.admit(path, headers, body)) for e in self.forward_to]
        work = super().admit(path, headers, body)
        self.forwarded[id(work)] = behind
        return work

    def _end(self, work: Work) -> None:
        # A response the router finished is finished on every engine behind it; one whose
        # connection closed goes on there (a router that does not pass disconnects on).
        if work.running:
            for engine, behind in self.forwarded.get(id(work), []):
                engine._end(behind)
        super()._end(work)


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile."""
    if seconds > 0 and not event.is_set():
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass


def _sglang_batch(path: str, body: dict[str, Any]) -> int | None:
    value = body.get("text") if path == "/generate" else body.get("prompt")
    if path == "/generate" and value is None:
        value = body.get("input_ids")
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return None


def _sglang_n(path: str, body: dict[str, Any]) -> int:
    params = body.get("sampling_params") if path == "/generate" else body
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) else 1
