"""Fake engines, one per engine kind, each following that kind's documented request-id and
abort behaviour. Written from the facts, never from the adapters in ``engine/``, so a test can
catch an adapter that disagrees with them. Used by ``tests/test_cancel_every_kind.py`` (the same
cancellation tests for every kind) and ``tests/test_fanout.py`` (a router in front of several).

One scheduler model behind three front ends. A :class:`Work` is one client request as the engine
holds it: the id it was told, the engine request ids its scheduler runs it under, when each id
became known, and whether each ran to its end or was stopped early. An engine that can abort
keeps generating for a request whose connection closed, as vLLM and SGLang do whenever their own
disconnect check is broken (the case the sidecar exists for), until that request is aborted by
id, reaches its last token, or ``LINGER_S`` passes; so a disconnect test passes only if the
abort named the right ids. A close-only engine stops a request when its connection closes: that
is its only way to stop.

Registration (``../shared/notes/cancellation-facts.md``). A real engine learns a request's ids
only some time after it received the whole body: vLLM registers them in
``AsyncLLM.add_request`` -> ``OutputProcessor.add_request`` after rendering the chat template,
tokenizing and fetching media; SGLang's tokenizer manager makes a rid live only after
tokenizing. An abort naming an id that is not registered yet is a no-op there (vLLM's
``OutputProcessor.abort_requests`` pops an unknown id to nothing; SGLang drops a rid that is
not live) and is answered 200 all the same; the request is then admitted and runs. The fakes do
the same: ``registration_delay_s`` (constructor, default 0: registered at once, the behaviour
every older test relies on) or the per-request query parameter ``register_delay`` (seconds from
the whole body's arrival to the first id's registration) and ``register_stagger`` (seconds
between successive ids of a multi-id request: vLLM adds a prompt list one prompt at a time). An
abort naming a not-yet-registered id, or one whose request has not even arrived (an abort can
overtake its request on another connection), is recorded (``Work.ignored``,
``AbortCall.ignored``, ``KindEngine.ignored``) and changes nothing. A request starts generating
(its response head, its first-byte delay and tokens) once all its ids are registered, whether or
not its connection is still open; ``Work.ran_to_end`` says, per engine id, which ids reached
their last token un-aborted.

- :class:`VLLMEngine` (``../shared/notes/vllm-facts.md``, docs/engines.md, checked against
  vLLM 0.32 in ``tests/e2e/VLLM_FACTS_CHECKED.md``): the id is the ``X-Request-Id`` header;
  ``/v1/chat/completions`` runs as ``chatcmpl-{id}``, ``/v1/completions`` as ``cmpl-{id}-{i}``
  one per prompt (``-0`` for a single prompt), ``/v1/chat/completions/batch`` (``messages`` a
  list of conversations) as ``chatcmpl-{id}_{i}`` one per conversation, ``/inference/v1/generate``
  as ``generate-tokens-{id}``; speech to text (a multipart form) as ``transcribe-{id}`` or
  ``translate-{id}``, ``-{i}`` per chunk with the form field ``fake_chunks`` > 1.
  ``POST /inference/v1/abort_requests {"request_ids": [...]}`` aborts
  exactly the named live ids, ignores unknown ones, answers 200; without ``--enable-scale-out``
  (``scale_out=False``) the route answers 403 to every call.

  Several API servers (``vllm serve --api-server-count N``: ``api_servers=N``; facts and sources
  in ``../shared/notes/cancellation-facts.md``, "vLLM with several API-server processes"): N
  processes share one listening socket and each TCP connection belongs to the one that
  accepted it, for its whole life. The fake picks it as it accepts the connection (aiohttp's
  ``Server.connection_made``; kept per transport) by ``accept``: ``"random"`` (uniform,
  ``random.Random(seed)``), ``"round_robin"``, ``"idle"`` (process k with probability proportional
  to ``1 / (1 + running_k) ** 2``, ``running_k`` its works still running: a process busy streaming
  accepts less often) or ``"least_connections"`` (the process with the fewest open connections:
  what vLLM 0.32 does, ``entrypoints/launchers/launcher.py``, measured by
  ``tests/e2e/probe_api_servers.py``; a request's own connection makes its owner the busiest, so
  fresh connections go elsewhere), and records it in ``connections``. A request's ids belong to
  that process (``Work.process``), and an abort call aborts only ids its own process owns; ids
  live or pending in another process are answered 200 and change nothing (``AbortCall.missed``,
  ``Work.missed``, ``missed``), as ``AsyncLLM.abort`` drops ids it does not own. Ids pending in
  the call's own process, or not
  seen at all, are ``ignored`` as above.
  ``end_on_abort=True`` ends an aborted response at once, as vLLM does: a stream with a final
  chunk whose ``finish_reason`` is ``"abort"`` then ``data: [DONE]``, a JSON answer with the
  tokens made so far and that ``finish_reason`` (the default: the sidecar reads that end as the
  engine's confirmation, :mod:`sidecar.confirm`). With ``False`` an aborted response waits up to
  1 s for its connection to close before that end (the older model, for a sidecar that closes
  the upstream with its abort); the SGLang fake takes ``end_on_abort`` too.
- :class:`SGLangEngine` (``tests/sglang_facts.md``, SGLang 0.5.23): the id is the body's ``rid``
  (``X-Request-Id`` is ignored; a fresh uuid4 hex if absent); a batch (``/generate`` ``text`` or
  ``input_ids`` a list of lists, ``/v1/completions`` ``prompt`` a list of strings) runs as
  ``{rid}_{i}``; ``n > 1`` runs every sample under a fresh uuid4 hex; ``/v1/responses`` runs
  under the body's ``request_id`` (default ``resp_`` + a uuid4 hex). ``POST /abort_request
  {"rid"}`` always answers 200; a rid that is not exactly a live request's is ignored (one
  tokenizer worker), otherwise every live request whose id starts with it is aborted (the
  scheduler's prefix match).
- :class:`OpenAIEngine`: an OpenAI-compatible server without an abort endpoint (TGI,
  llama.cpp's server, Ollama): it picks its own ids; every path it does not serve is a 404 and
  recorded in ``unknown_paths``.

Requests: POST on a generating path with a JSON object body (``"stream": true`` for SSE). Query
parameters (the sidecar forwards them untouched): ``register_delay`` and ``register_stagger``
(above), then ``tokens`` (default 20) events ``interval`` seconds apart (default 0.01), after
``first_byte_delay`` seconds queued (no response head yet). :func:`stream_bytes` is the exact
SSE body of a stream that ran to its end. ``GET /v1/models`` (``hold`` seconds before answering)
and ``GET /health`` answer on every kind. ``heads`` records every generating request whose head
arrived, whether or not its body then arrived whole. A positive integer ``max_tokens`` in the
body caps ``tokens``, as every engine caps its output (llm-d's prefill legs ask for
``max_tokens: 1``).
``prefill_only=True`` makes the engine a disaggregated prefill server: every request ends after
one token, whatever it asks (SGLang's ``--disaggregation-mode prefill`` ends a request once its
prefill is done and its KV handed to the decode server; llm-d's SGLang connector sends the
prefill leg the client's body unchanged).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web

from sidecar.readiness import PROBE_PREFIX
from tests.fakes.engine import Watch

LINGER_S = 10.0  # the longest an abortable engine goes on with a request whose connection closed
# how a new connection picks its API server
ACCEPT_POLICIES = ("random", "round_robin", "idle", "least_connections")
PROCESS = web.RequestKey("process", int)  # the API-server process that accepted a request's
#                                           connection (set by KindEngine's first middleware)


@dataclass
class Work:
    """One client request as the engine holds it (one or more engine request ids).

    Times are ``time.monotonic()``; ``started`` is when the whole body had arrived;
    ``stopped_at`` is when the engine stopped working on it before its end (every engine id
    aborted, or, on a close-only engine, the connection closed).
    """

    path: str
    request_id_header: str | None  # the X-Request-Id the engine received
    tag: str | None  # the id the engine took for the request (None: one it picked itself)
    engine_ids: tuple[str, ...]
    started: float
    body: Any = None  # the JSON body as the engine received it
    process: int = 0  # the API-server process that owns its ids (accepted its connection)
    length_s: float | None = None  # registration -> last token, seconds (None: not generated here)
    tokens: int = 0  # its SSE token events in all, ``interval_s`` apart
    interval_s: float = 0.0
    registered: dict[str, float] = field(default_factory=dict)  # engine id -> when it became known
    ignored: dict[str, list[float]] = field(default_factory=dict)  # engine id -> aborts naming it
    #                                                                before it was registered
    missed: dict[str, list[float]] = field(default_factory=dict)  # engine id -> aborts naming it
    #                                              that another API-server process received
    aborted: dict[str, float] = field(default_factory=dict)  # engine id -> when aborted
    ran_to_end: dict[str, float] = field(default_factory=dict)  # engine id -> when it reached its
    #                                                   last token un-aborted (client or nobody)
    closed_at: float | None = None  # its connection went away before the response ended
    stopped_at: float | None = None
    finished: bool = False  # it ran to its end (for a client, or for nobody)
    events: int = 0  # SSE token events written to its connection
    stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    known: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # all ids registered

    @property
    def running(self) -> bool:
        return not self.finished and self.stopped_at is None

    @property
    def registered_at(self) -> float | None:
        """When its last id was registered (it then generates), or ``None`` before that."""
        if len(self.registered) < len(self.engine_ids):
            return None
        return max(self.registered.values(), default=self.started)


@dataclass
class Head:
    """A generating request whose head reached the engine; ``whole``: its body arrived too."""

    path: str
    headers: Mapping[str, str]
    at: float
    whole: bool = False


@dataclass
class ModelsRequest:
    """One ``GET /v1/models``: when it arrived, and when its connection went away early."""

    started: float
    closed_at: float | None = None


@dataclass
class Connection:
    """One TCP connection as the engine's API servers saw it: the process that accepted it
    (chosen when it was accepted, kept for its life), when, its first request's path (``""``
    until one came), the client's address (``(host, port)``, ``None`` if it was gone), when it
    closed (``None`` while open) and the paths of its requests, in order."""

    process: int
    at: float
    path: str
    peer: tuple[str, int] | None
    closed_at: float | None = None
    paths: list[str] = field(default_factory=list)


@dataclass
class AbortCall:
    """One call to the engine's abort endpoint: the ids it named and what it was answered."""

    at: float
    ids: list[str]
    authorization: str | None
    status: int
    body: Any = None  # the call's JSON body
    process: int = 0  # the API-server process that accepted the call's connection
    ignored: list[str] = field(default_factory=list)  # named ids not registered yet: no-ops
    missed: list[str] = field(default_factory=list)  # named ids live or pending in another
    #                                                  process: no-ops too


class KindEngine:
    """The scheduler model and HTTP surface shared by every kind; subclasses say how a request
    gets its ids (:meth:`derive`) and what their abort endpoint does."""

    kind: ClassVar[str]
    generating: ClassVar[tuple[str, ...]]
    # The adapter's keepalive_path (engine/<kind>.py): answered, never counted as unknown.
    keepalive_path: ClassVar[str | None] = None
    aborts: ClassVar[bool] = True  # the engine keeps a closed request running until aborted

    def __init__(self, api_key: str | None = None, *, registration_delay_s: float = 0.0,
                 prefill_only: bool = False, end_on_abort: bool = True, api_servers: int = 1,
                 accept: str = "random", seed: int = 0) -> None:
        if api_servers < 1:
            raise ValueError(f"api_servers must be >= 1, got {api_servers}")
        self.api_key = api_key  # the abort endpoint answers 401 without this bearer key
        self.prefill_only = prefill_only  # every request ends after one token (a P/D prefill)
        self.end_on_abort = end_on_abort  # an aborted response ends at once (see _respond)
        self.api_servers = api_servers  # API-server processes behind the one port
        self.accept = accept  # how a new connection picks one (ACCEPT_POLICIES; may change)
        self._rng = random.Random(seed)  # the "random" and "idle" choices
        self._open = [0] * api_servers  # open connections per process (least_connections)
        self._accepted = 0  # connections accepted so far (the "round_robin" turn)
        # transport -> its process, for the connection's life (aiohttp's RequestHandler takes
        # no weak reference, its transport does, on asyncio's loop and on uvloop)
        # transport -> its index in connections
        self._processes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.connections: list[Connection] = []  # every connection, in order of accept
        # whole body -> ids known, seconds, unless a request's ``register_delay`` says otherwise
        self.registration_delay_s = registration_delay_s
        self.heads: list[Head] = []
        self.works: list[Work] = []
        self.pending: dict[str, Work] = {}  # engine id -> its work, until it is registered
        self.ignored: list[tuple[float, str]] = []  # (when, engine id): aborts before registration
        self.missed: list[tuple[float, str]] = []  # (when, engine id): aborts another process got
        self.abort_delay_s = 0.0  # seconds each abort call takes to be applied and answered
        self._ids_seen: set[str] = set()  # every engine id of every request that arrived
        self._too_early: dict[str, list[float]] = {}  # id -> aborts before its request arrived
        self.calls: list[AbortCall] = []
        self.probes: list[AbortCall] = []  # the sidecar's readiness probes, kept apart
        self.unknown_paths: list[str] = []
        self.model_requests: list[ModelsRequest] = []
        self.live: dict[str, Work] = {}  # engine id -> its work, while it runs
        self.watch = Watch()  # await any condition over works/calls: watch.until(predicate, s)
        self.app = web.Application(middlewares=[self._assign_process, self._unknown])
        for path in self.generating:
            self.app.router.add_post(path, self.generate)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        if self.keepalive_path is not None:
            self.app.router.add_get(self.keepalive_path, self.keepalive)
        self._add_abort_route()
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []  # registrations still due
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        server = self.runner.server
        assert server is not None
        made = server.connection_made

        lost = server.connection_lost

        open_by: dict[int, Connection] = {}  # id(handler) -> its connection, while open

        def accepted(handler: Any, transport: asyncio.Transport) -> None:
            # The process is chosen as the connection is accepted.
            open_by[id(handler)] = self.connections[self._accept(transport)]
            made(handler, transport)

        def gone(handler: Any, exc: BaseException | None = None) -> None:
            connection = open_by.pop(id(handler), None)
            if connection is not None:
                self._open[connection.process] -= 1
                connection.closed_at = time.monotonic()
                self.watch.changed()
            lost(handler, exc)

        server.connection_made = accepted  # type: ignore[method-assign]
        server.connection_lost = gone  # type: ignore[method-assign]
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        for timer in self._timers:
            timer.cancel()
        for task in self._tasks:
            task.cancel()

    @property
    def accept(self) -> str:
        """How a new connection picks its API-server process: ``"random"`` (uniform),
        ``"round_robin"`` (connection ``i`` to process ``i % api_servers``) or ``"idle"``
        (process ``k`` with probability proportional to ``1 / (1 + running_k) ** 2``,
        ``running_k`` its works still running: :meth:`running_per_process`) or
        ``"least_connections"`` (the process with the fewest open connections, ties at random:
        what vLLM 0.32's launcher does, ``entrypoints/launchers/launcher.py``)."""
        return self._accept_policy

    @accept.setter
    def accept(self, policy: str) -> None:
        if policy not in ACCEPT_POLICIES:
            raise ValueError(f"accept must be one of {', '.join(ACCEPT_POLICIES)}, got {policy!r}")
        self._accept_policy = policy

    def running_per_process(self) -> list[int]:
        """How many works each API-server process runs now (admitted, not finished or stopped;
        one with its connection closed that goes on for nobody counts)."""
        running = [0] * self.api_servers
        works = {id(w): w for w in (*self.live.values(), *self.pending.values())}
        for work in works.values():
            if work.running:
                running[work.process] += 1
        return running

    def process_of(self, request: web.Request) -> int:
        """The API-server process that accepted ``request``'s connection (chosen by ``accept``
        when the connection was accepted, recorded in ``connections``)."""
        transport = request.transport
        index = self._processes.get(transport) if transport is not None else None
        if index is None:  # accepted before the hook saw it (never, in practice)
            index = self._accept(transport)
        connection = self.connections[index]
        if not connection.path:
            connection.path = request.path
        connection.paths.append(request.path)
        return connection.process

    def _accept(self, transport: Any) -> int:
        """Choose the process for a newly accepted connection; its index in ``connections``."""
        process = self._choose()
        self._open[process] += 1
        self._accepted += 1
        peer = transport.get_extra_info("peername") if transport is not None else None
        index = len(self.connections)
        if transport is not None:
            self._processes[transport] = index
        self.connections.append(Connection(process, time.monotonic(), "",
                                           (str(peer[0]), int(peer[1])) if peer else None))
        self.watch.changed()
        return index

    def _choose(self) -> int:
        if self.api_servers == 1:
            return 0
        if self.accept == "round_robin":
            return self._accepted % self.api_servers
        if self.accept == "idle":
            weights = [1 / (1 + r) ** 2 for r in self.running_per_process()]
            return self._rng.choices(range(self.api_servers), weights)[0]
        if self.accept == "least_connections":  # vLLM 0.32's launcher; ties at random
            fewest = min(self._open)
            return self._rng.choice([k for k, n in enumerate(self._open) if n == fewest])
        return self._rng.randrange(self.api_servers)

    def _split_owned(self, ids: list[str], process: int) -> tuple[list[str], list[str]]:
        """Split the ids an abort call on ``process`` named into (those it may act on: its own
        and unknown ones, the ids another process holds live or pending). The latter are
        recorded as missed (``missed``, ``Work.missed``): the call is a no-op for them."""
        now = time.monotonic()
        mine: list[str] = []
        elsewhere: list[str] = []
        for engine_id in ids:
            work = self.live.get(engine_id) or self.pending.get(engine_id)
            if work is None or work.process == process:
                mine.append(engine_id)
                continue
            elsewhere.append(engine_id)
            work.missed.setdefault(engine_id, []).append(now)
            self.missed.append((now, engine_id))
        if elsewhere:
            self.watch.changed()
        return mine, elsewhere

    # -- what subclasses define ---------------------------------------------------------------

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        """(the id the engine takes for the request, its engine request ids)."""
        raise NotImplementedError

    def _add_abort_route(self) -> None:
        """Add the kind's abort endpoint, if it has one."""

    # -- the scheduler ------------------------------------------------------------------------

    def admit(self, path: str, headers: Mapping[str, str], body: dict[str, Any], *,
              delay_s: float | None = None, stagger_s: float = 0.0,
              length_s: float | None = None, process: int = 0) -> Work:
        """Take a request whose whole body arrived (as :meth:`generate` does, or a router that
        forwards one). Its ids are registered ``delay_s`` seconds later (default
        ``registration_delay_s``; id ``i`` another ``i * stagger_s`` later), at once if both
        are 0. ``length_s``: registration -> last token, for a request that goes on after its
        connection closed (``None``: until aborted or ``LINGER_S``). ``process``: the
        API-server process that owns its ids."""
        tag, ids = self.derive(path, headers, body)
        work = Work(path, headers.get("X-Request-Id"), tag, ids, time.monotonic(), body,
                    process=process, length_s=length_s)
        self.works.append(work)
        self._ids_seen.update(ids)
        for i in ids:  # an abort that overtook the request itself was as much a no-op
            if i in self._too_early:
                work.ignored[i] = self._too_early.pop(i)
        delay = self.registration_delay_s if delay_s is None else delay_s
        if delay <= 0 and stagger_s <= 0:
            self._register(work, ids)
        else:
            self.pending.update((i, work) for i in ids)
            loop = asyncio.get_running_loop()
            self._timers += [loop.call_later(delay + k * stagger_s, self._register, work, (i,))
                             for k, i in enumerate(ids)]
        self.watch.changed()
        return work

    def _register(self, work: Work, ids: tuple[str, ...]) -> None:
        """``ids`` of ``work`` become known: abortable from now on. Once all are, it generates
        (and, if its connection already closed, goes on for nobody: :meth:`_linger`)."""
        now = time.monotonic()
        for i in ids:
            self.pending.pop(i, None)
            work.registered[i] = now
            if work.running:
                self.live[i] = work
        if work.registered_at is not None and not work.known.is_set():
            work.known.set()
            if work.closed_at is not None and work.running and self.aborts:
                self._start_linger(work)
        self.watch.changed()

    def abort_ids(self, ids: list[str]) -> list[str]:
        """Abort the live engine requests named; a work stops once all its ids are aborted. An
        id not registered yet is ignored and recorded; other unknown ids are ignored. Returns
        the ignored not-yet-registered ids."""
        now = time.monotonic()
        early: list[str] = []
        for engine_id in ids:
            work = self.live.pop(engine_id, None)
            if work is None:
                early += self._ignore(engine_id, now)
                continue
            work.aborted[engine_id] = now
            if not any(self.live.get(i) is work for i in work.engine_ids):
                work.stopped_at = now
                work.stop.set()
        self.watch.changed()
        return early

    def _ignore(self, engine_id: str, now: float) -> list[str]:
        """An abort named ``engine_id`` while it was not live: recorded if it is still to be
        registered, or its request has not even arrived (the no-op a real engine makes of it;
        the latter is put on the request's ``Work.ignored`` when it arrives)."""
        work = self.pending.get(engine_id)
        if work is not None:
            work.ignored.setdefault(engine_id, []).append(now)
        elif engine_id not in self._ids_seen and not engine_id.startswith(PROBE_PREFIX):
            self._too_early.setdefault(engine_id, []).append(now)
        else:
            return []
        self.ignored.append((now, engine_id))
        return [engine_id]

    def _end(self, work: Work) -> None:
        if work.running:
            work.finished = True
            now = time.monotonic()
            work.ran_to_end.update((i, now) for i in work.engine_ids if self.live.get(i) is work)
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
        elif work.running and work.known.is_set():  # goes on for nobody until aborted or its end
            self._start_linger(work)
        # (not registered yet: it lingers from its registration, see _register)
        self.watch.changed()

    def _start_linger(self, work: Work) -> None:
        task = asyncio.get_running_loop().create_task(
            self._linger(work), name=f"{self.kind} linger {work.engine_ids[0]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _linger(self, work: Work) -> None:
        """Generate for nobody until every id is aborted, the last token, or ``LINGER_S``. The
        last token is due ``length_s`` after the registration, or, for a stream behind that
        schedule (a slow reader), after its remaining events."""
        left = LINGER_S
        if work.length_s is not None and work.registered_at is not None:
            due = max(work.registered_at + work.length_s - time.monotonic(),
                      (work.tokens - work.events) * work.interval_s if work.events else 0.0)
            left = min(left, max(0.0, due))
        await _wait(work.stop, left)
        self._end(work)

    # -- HTTP ---------------------------------------------------------------------------------

    @web.middleware
    async def _assign_process(self, request: web.Request, handler: Any) -> web.StreamResponse:
        request[PROCESS] = self.process_of(request)
        response: web.StreamResponse = await handler(request)
        return response

    @web.middleware
    async def _unknown(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPNotFound:
            self.unknown_paths.append(request.path)
            self.watch.changed()
            raise

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def keepalive(self, request: web.Request) -> web.Response:
        """``GET keepalive_path`` (vLLM's ``/version``, SGLang's ``/get_model_info``): a cheap
        answer, recorded in its connection's ``paths``."""
        return web.json_response({"version": "fake"})

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
        head = Head(request.path, request.headers, time.monotonic())
        self.heads.append(head)
        self.watch.changed()
        body: Any
        if request.content_type.startswith("multipart/"):  # speech to text: a form
            form = await request.post()
            body = {k: v for k, v in form.items() if isinstance(v, str)}
            for v in form.values():
                if isinstance(v, web.FileField):
                    v.file.close()  # the audio: not read
            body["stream"] = body.get("stream") == "true"
        else:
            try:
                body = json.loads(await request.read())
            except ValueError:
                body = None
        head.whole = True
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object"}},
                                     status=400)
        query = request.query
        tokens, interval = int(query.get("tokens", 20)), float(query.get("interval", 0.01))
        length = float(query.get("first_byte_delay", 0)) + tokens * interval
        delay = float(query["register_delay"]) if "register_delay" in query else None
        work = self.admit(request.path, request.headers, body, delay_s=delay,
                          stagger_s=float(query.get("register_stagger", 0)), length_s=length,
                          process=request[PROCESS])
        work.tokens, work.interval_s = tokens, interval
        try:
            await work.known.wait()  # at once unless registration is delayed
            return await self._respond(request, body, work)
        except (asyncio.CancelledError, ConnectionResetError):
            self._closed(work)
            raise

    async def _respond(self, request: web.Request, body: dict[str, Any],
                       work: Work) -> web.StreamResponse:
        """The response: JSON after all its tokens, or an SSE stream of them. An aborted one
        ends with ``finish_reason`` ``"abort"``: at once with ``end_on_abort`` (a JSON answer
        then holds only the tokens made before the abort), else only after waiting up to 1 s
        for the connection to close (:meth:`_until_closed`)."""
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
            begun = time.monotonic()
            await _wait(work.stop, tokens * interval)
            reason = "abort" if work.stop.is_set() else "stop"
            if work.stop.is_set() and self.end_on_abort:  # the tokens made until the abort
                made = (time.monotonic() - begun) / interval if interval > 0 else tokens
                tokens = min(tokens, int(made))
            elif work.stop.is_set():
                # Aborted before its answer (the sidecar's abort can arrive before its upstream
                # close): record the connection going away if it does before the answer would.
                await self._until_closed(request, work)
            answer = web.json_response({"id": ident, "choices": [
                {"index": 0, "text": "x" * tokens, "finish_reason": reason}]})
            self._end(work)
            return answer
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
        if work.stop.is_set() and not self.end_on_abort:  # as for JSON above
            await self._until_closed(request, work)
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
                         body, request[PROCESS])
        if self.api_key is not None and call.authorization != f"Bearer {self.api_key}":
            call.status = 401
        probe = len(ids) == 1 and ids[0].startswith(PROBE_PREFIX)
        (self.probes if probe else self.calls).append(call)
        self.watch.changed()
        return call


class VLLMEngine(KindEngine):
    """vLLM's request ids and abort endpoint (see the module docstring)."""

    kind = "vllm"
    generating = ("/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions",
                  "/inference/v1/generate", "/v1/audio/transcriptions", "/v1/audio/translations")
    abort_path = "/inference/v1/abort_requests"
    keepalive_path = "/version"

    def __init__(self, api_key: str | None = None, *, scale_out: bool = True,
                 registration_delay_s: float = 0.0, prefill_only: bool = False,
                 end_on_abort: bool = True, api_servers: int = 1, accept: str = "random",
                 seed: int = 0) -> None:
        """``api_servers``: ``vllm serve --api-server-count``; ``accept``: which process takes a
        new connection (:attr:`KindEngine.accept`), ``seed`` seeding its random choices;
        ``end_on_abort``: an aborted response ends at once, as vLLM's does (module docstring).
        """
        self.scale_out = scale_out  # False: started without --enable-scale-out
        super().__init__(api_key, registration_delay_s=registration_delay_s,
                         prefill_only=prefill_only, end_on_abort=end_on_abort,
                         api_servers=api_servers, accept=accept, seed=seed)

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        rid = headers.get("X-Request-Id") or uuid.uuid4().hex
        if path == "/v1/chat/completions":
            return rid, (f"chatcmpl-{rid}",)
        if path == "/v1/chat/completions/batch":  # messages: a list of conversations
            conversations = body.get("messages")
            count = len(conversations) if isinstance(conversations, list) else 0
            return rid, tuple(f"chatcmpl-{rid}_{i}" for i in range(max(count, 1)))
        if path == "/v1/completions":
            prompt = body.get("prompt")
            many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            count = len(prompt) if many and isinstance(prompt, list) else 1
            return rid, tuple(f"cmpl-{rid}-{i}" for i in range(count))
        if path.startswith("/v1/audio/"):  # one id per 30 s chunk (the form's fake_chunks)
            base = f"{'transcribe' if path.endswith('transcriptions') else 'translate'}-{rid}"
            chunks = int(body.get("fake_chunks", 1))
            return rid, (base,) if chunks == 1 else tuple(f"{base}-{i}" for i in range(chunks))
        return rid, (f"generate-tokens-{rid}",)

    def _add_abort_route(self) -> None:
        self.app.router.add_post(self.abort_path, self.abort)

    async def abort(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        ids = [str(i) for i in body.get("request_ids", [])]
        call = self._record_call(request, body, ids, 200 if self.scale_out else 403)
        if self.abort_delay_s:  # a slow endpoint: recorded on arrival, applied and answered late
            await asyncio.sleep(self.abort_delay_s)
        if call.status == 200:  # AsyncLLM.abort of the call's own process: others' ids dropped
            mine, call.missed = self._split_owned(ids, call.process)
            call.ignored = self.abort_ids(mine)  # in the background in vLLM; unknown ids ignored
        return web.Response(status=call.status)


class SGLangEngine(KindEngine):
    """SGLang's request ids and abort endpoint (see the module docstring)."""

    kind = "sglang"
    generating = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
    abort_path = "/abort_request"
    keepalive_path = "/get_model_info"

    def __init__(self, api_key: str | None = None, *, registration_delay_s: float = 0.0,
                 prefill_only: bool = False, end_on_abort: bool = True) -> None:
        """``end_on_abort``: an aborted response ends at once, in the same shape as the vLLM
        fake's (SGLang's own end of an aborted request is not checked here)."""
        super().__init__(api_key, registration_delay_s=registration_delay_s,
                         prefill_only=prefill_only, end_on_abort=end_on_abort)

    def derive(self, path: str, headers: Mapping[str, str], body: dict[str, Any]
               ) -> tuple[str | None, tuple[str, ...]]:
        if path == "/v1/responses":  # ResponsesRequest.request_id: rid=request.request_id
            request_id = body.get("request_id")
            tag = request_id if isinstance(request_id, str) else f"resp_{uuid.uuid4().hex}"
            return tag, (tag,)
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
        if self.abort_delay_s:  # a slow endpoint: recorded on arrival, applied and answered late
            await asyncio.sleep(self.abort_delay_s)
        if call.status == 200:
            if body.get("abort_all"):
                self.abort_ids(list(self.live))
            elif rid in self.live:  # one tokenizer worker: exact id, then the prefix match
                self.abort_ids([i for i in self.live if i.startswith(rid)])
            else:  # not live (yet): dropped
                call.ignored = self._ignore(rid, time.monotonic())
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

    def admit(self, path: str, headers: Mapping[str, str], body: dict[str, Any], *,
              delay_s: float | None = None, stagger_s: float = 0.0,
              length_s: float | None = None, process: int = 0) -> Work:
        behind = [(e, e.admit(path, headers, body)) for e in self.forward_to]
        work = super().admit(path, headers, body, delay_s=delay_s, stagger_s=stagger_s,
                             length_s=length_s, process=process)
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


def stream_bytes(ident: str, tokens: int) -> bytes:
    """The SSE body (de-chunked) of a stream of ``tokens`` events that ran to its end, as the
    fakes write it for request id ``ident``."""
    events = [_sse({"id": ident, "choices": [{"index": 0, "text": f"t{i}"}]})
              for i in range(tokens)]
    end = _sse({"id": ident, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
    return b"".join(events) + end + b"data: [DONE]\n\n"


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
