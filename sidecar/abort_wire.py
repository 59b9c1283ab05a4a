"""The abort call's wire: warm HTTP/1.1 keep-alive connections per engine, written to at once.

Why not aiohttp's client here (it serves every proxied request): an abort must be on the wire
before the sidecar spends time on anything else for the requests whose clients left (their
handlers' teardown, access lines, metrics), and when many clients leave at once that is
hundreds of handler steps. aiohttp 3.14's ``ClientSession.post`` writes the request body from a
task of its own (``ClientRequest.send`` starts ``write_bytes``; eagerly only on Python 3.12+),
a loop turn later, behind every handler the same disconnect storm woke; and it opens a
connection only when asked, so the first abort after an idle spell (the engine closes idle
connections: uvicorn after 5 s) also waits for a TCP handshake. Here :meth:`AbortPool.begin`
writes the whole call into a socket that is already open, in the caller's own step, and returns
a future for the answer::

    AbortPool (one per engine origin)
      idle   WARM connections kept open; one that closes is reopened; one idle for RECYCLE_S is
             closed and replaced, so the engine's own idle timeout (uvicorn: 5 s) never closes
             a connection under a call
      begin  an idle connection: transport.write(head + body) now, in the caller's step
      answer the status; with no idle connection at begin: open one (a handshake), write
    AbortConnection (asyncio.Protocol): one call at a time, the answer parsed by httptools
      (llhttp, the parser uvicorn uses); closed on Connection: close, a timeout or bad bytes

Several API-server processes behind one port (``vllm serve --api-server-count N``): each
connection is accepted by one process for its life, and an abort only reaches the requests of the
process that accepted its connection (``../shared/notes/cancellation-facts.md``). For an engine
whose aborts are confirmed (:mod:`sidecar.confirm`) the pool spreads: it keeps ``size``
connections (``engines.*.abort.connections``), opens them ``SPREAD_GAP_S`` apart (a connection
the kernel completed waits in the listen backlog until a process calls ``accept``, and the
process awake first takes every connection queued: uvloop accepts until the backlog is empty;
apart, each is a race of its own among the processes), and hands out the least recently used
idle one, so that successive calls for one request go to other connections, and other
processes, than the call that just missed; among the idle ones, those the call's requests tried
least go first (``tried`` of :meth:`AbortPool.begin`), so each request's calls go round every
connection in turn. vLLM 0.32 gives each new connection to the API-server process with the
fewest open connections (``entrypoints/launchers/launcher.py``; measured by
``tests/e2e/probe_api_servers.py``: 16 connections held and opened one after another split
8/8 over 2 processes, 4/4/4/4 over 4), so ``size`` warm connections reach every process of
up to ``size / 2``. Those connections must then last: a connection opened later, while some
processes hold many proxied streams, goes to the processes with the fewest connections, never to
the busy owner of those streams. So a spread pool keeps exactly ``size`` connections of its own
(``member``): one opened for a burst of calls beyond them is closed after its answer, and instead
of being recycled an idle member is kept open by a cheap request (``keepalive``, e.g. vLLM's
``GET /version``) every ``RECYCLE_S``, before the engine's idle timeout closes it. A member the
engine closes anyway is reopened (a new accept race, as at startup).

Only what an abort call needs: ``POST`` with a JSON body and the bearer key, a status back, the
answer body read and dropped, never a redirect followed. Failures raise :class:`AbortWireError`
(``transient``: worth another attempt, as :func:`sidecar.abort_call.transient` decides for
statuses). A call written to a reused connection that the engine closed before answering (it
closed its idle end just as the call went out) is written once more on a fresh connection at
once: re-sending an abort is safe (see :mod:`sidecar.abort`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from sidecar.errors import SidecarError

log = logging.getLogger(__name__)

WARM = 8  # idle connections kept open per engine, one per call an engine may have in flight
# (sidecar.abort.MAX_CALLS_PER_ENGINE): in a storm's long loop turn a call leaves every
# sidecar.abort.FLUSH_AGE_S, and their answers are read only once the turn ends. With 4, ids
# queued after the 4th call waited for the turn's end: queued -> written p99 6.7 ms, 2.5 with 8
# (median of 8 storms, python -m bench's storm at 100 ms/token, traced)
RECYCLE_S = 4.0  # an idle connection older than this is replaced (uvicorn closes idle ones at 5 s)
REOPEN_BACKOFF_S = 1.0  # between attempts to reopen the warm connection of an unreachable engine
MAX_IDLE = 8  # idle connections kept after a burst of concurrent calls (at least ``size``)
# Between two new spread connections, seconds: each is accepted in a race of its own.
SPREAD_GAP_S = 0.02


class AbortWireError(SidecarError):
    """An abort call got no answer: ``kind`` is ``connect`` (nothing accepts connections),
    ``lost`` (the connection closed before the answer) or ``protocol`` (an answer that is not
    HTTP/1.x); ``transient`` for the first two."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.transient = kind in ("connect", "lost")


class AbortConnection(asyncio.Protocol):
    """One keep-alive connection to an engine; one call in flight at a time."""

    def __init__(self, pool: AbortPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[int] | None = None  # the call in flight
        self.answered_any = False  # a reused connection: a loss before any answer is stale
        self.idle_since = 0.0
        self.member = False  # one of a spread pool's ``size`` connections (module docstring)
        self._got_bytes = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(AbortWireError("protocol", f"not an HTTP answer: {type(exc).__name__}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(AbortWireError("lost", "the connection was lost before an answer"))
        self._pool.lost(self)

    # httptools callbacks
    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        self.answered_any = True
        keep = self._parser.should_keep_alive()
        if answer is not None and not answer.done():
            answer.set_result(self._parser.get_status_code())
        if keep and self.open:
            self._pool.idle_again(self)
        else:
            self.close()

    def send(self, data: bytes) -> asyncio.Future[int]:
        """Write one call; the future gets the answer's status or an :class:`AbortWireError`."""
        assert self.transport is not None and self.answer is None
        self.answer = asyncio.get_running_loop().create_future()
        self._got_bytes = False
        self.transport.write(data)
        return self.answer

    @property
    def open(self) -> bool:
        """True while the connection can carry a call (connected, not closing)."""
        return self.transport is not None and not self.transport.is_closing()

    @property
    def stale_loss(self) -> bool:
        """True if the call in flight met a reused connection the engine had closed: nothing of
        an answer came back, so it can be written again on a new connection."""
        return self.answered_any and not self._got_bytes

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: AbortWireError) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_exception(exc)


@dataclass(frozen=True, slots=True)
class PendingCall:
    """An abort call :meth:`AbortPool.begin` wrote (``conn`` and ``answer`` set), or could not
    write yet for want of an idle connection (both ``None``)."""

    data: bytes
    conn: AbortConnection | None
    answer: asyncio.Future[int] | None


class AbortPool:
    """The abort connections of one engine origin (``base_url``: ``http[s]://host:port``)."""

    def __init__(self, base_url: str, *, warm: bool = True, size: int = WARM,
                 spread: bool = False) -> None:
        parts = urlsplit(base_url)
        self.warm = warm  # keep ``size`` connections open; else idle ones just expire
        self.size = size
        # Spread (module docstring): new warm connections SPREAD_GAP_S apart, and calls take
        # the least recently used idle connection.
        self.spread = spread
        self._secure = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._secure else 80)
        self._authority = parts.netloc.encode("idna")
        # One TLS context for the pool's life (each recycle opens a connection).
        self._ssl = ssl.create_default_context() if self._secure else None
        self._idle: deque[AbortConnection] = deque()
        self._members = 0  # a spread pool's own connections, idle or busy
        # A spread pool's request that keeps an idle member open (see keep_alive), else None.
        self.keepalive: bytes | None = None
        self._keeping = False  # the warm connection is being (re)opened
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._recycler: asyncio.TimerHandle | None = None
        self._keeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Open the warm connection of a ``warm`` pool (in the background; an engine not up yet
        is retried every ``REOPEN_BACKOFF_S``)."""
        self._keep_warm()

    def begin(self, path: str, body: Any, headers: dict[str, str],
              tried: Callable[[AbortConnection], int] | None = None) -> PendingCall:
        """``POST path`` with ``body`` as JSON and ``headers``, written now, in the caller's
        step, if a warm connection is idle (else :meth:`answer` opens one). ``tried``: how many
        of the call's requests a connection already carried (a spread pool takes the idle one
        least tried, the least recently used of those). Raises ``UnicodeEncodeError`` for a
        header that is not latin-1 (the config refuses keys outside ASCII)."""
        data = self._request(path, body, headers)
        conn = self._take_idle(tried)
        return PendingCall(data, conn, None if conn is None else conn.send(data))

    async def answer(self, call: PendingCall) -> int:
        """The status of the call :meth:`begin` started. Raises :class:`AbortWireError`;
        ``asyncio.CancelledError`` closes the connection (its answer would be unread)."""
        conn, answer = call.conn, call.answer
        if conn is None or answer is None:
            conn = await self._open()
            answer = conn.send(call.data)
        try:
            return await answer
        except AbortWireError as exc:
            if not (exc.kind == "lost" and conn.stale_loss):
                raise
            # The engine closed its idle end as the call went out: once more, on a new one.
            return await (await self._open()).send(call.data)
        except BaseException:
            conn.close()
            raise
        finally:
            self._keep_warm()

    def keep_alive(self, path: str | None, headers: dict[str, str]) -> None:
        """Keep a spread pool's idle members open with ``GET path`` (a cheap route the engine
        answers in its API-server process: :attr:`EngineAdapter.keepalive_path`) every
        ``RECYCLE_S`` instead of replacing them; ``None``: replace them."""
        self.keepalive = None if path is None else self._request(path, None, headers, "GET")

    def _request(self, path: str, body: Any, headers: dict[str, str],
                 method: str = "POST") -> bytes:
        # Header values come from validated config (abort.api_key: no control characters).
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self._authority,
                *(f"{k}: {v}".encode("latin-1") for k, v in headers.items())]
        if body is None:
            return b"\r\n".join(head) + b"\r\n\r\n"
        payload = json.dumps(body, separators=(",", ":")).encode()
        head += [b"Content-Type: application/json", b"Content-Length: %d" % len(payload)]
        return b"\r\n".join(head) + b"\r\n\r\n" + payload

    def idle(self) -> bool:
        """True if a call :meth:`begin` starts now is written at once."""
        return any(c.open for c in self._idle)

    def _take_idle(self, tried: Callable[[AbortConnection], int] | None = None
                   ) -> AbortConnection | None:
        if self.spread and tried is not None and self._idle:
            # The least recently used among the connections these requests tried least: a
            # request's calls go round every connection (and so every process) in turn.
            best = min(self._idle, key=lambda c: (not c.open, tried(c)))  # first: the LRU
            if best.open:
                self._idle.remove(best)
                return best
        while self._idle:
            # Spread: the least recently used (another process than the last call's, maybe);
            # else the most recently used, the least likely to be stale.
            conn = self._idle.popleft() if self.spread else self._idle.pop()
            if conn.open:
                return conn
        return None

    async def _open(self) -> AbortConnection:
        try:
            _, conn = await self._loop.create_connection(
                lambda: AbortConnection(self), self._host, self._port, ssl=self._ssl)
        except ssl.SSLError:
            raise  # an OSError too, but not a transient "connect" failure: it would repeat
        except OSError as exc:
            raise AbortWireError("connect", f"{type(exc).__name__}: {exc}") from exc
        return conn

    def idle_again(self, conn: AbortConnection) -> None:
        if self.spread and not conn.member and not self._closed and self._members < self.size:
            conn.member = True
            self._members += 1
        if self._closed or (not conn.member if self.spread
                            else len(self._idle) >= max(MAX_IDLE, self.size)):
            conn.close()  # a spread pool keeps its members only (module docstring)
            return
        conn.idle_since = self._loop.time()
        self._idle.append(conn)
        if self._recycler is None:
            self._recycler = self._loop.call_later(RECYCLE_S, self._recycle)

    def lost(self, conn: AbortConnection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)
        if conn.member:
            conn.member = False
            self._members -= 1
        self._keep_warm()

    def _recycle(self) -> None:
        """Keep alive (a spread pool with ``keepalive``) or replace (any other) the idle
        connections older than ``RECYCLE_S``, before the engine drops them."""
        self._recycler = None
        now = self._loop.time()
        for conn in [c for c in self._idle if now - c.idle_since >= RECYCLE_S]:
            self._idle.remove(conn)
            if conn.member and self.keepalive is not None:
                # Answered, it is idle again (on_message_complete); lost, it is reopened.
                conn.send(self.keepalive).add_done_callback(_consume)
            else:
                conn.close()  # its connection_lost reopens the warm one (a warm pool)
        if self._idle:
            oldest = min(c.idle_since for c in self._idle)
            self._recycler = self._loop.call_at(oldest + RECYCLE_S, self._recycle)

    def _keep_warm(self) -> None:
        if not self.warm or self._closed or self._keeping or self._enough():
            return
        self._keeping = True
        # Not a TaskSet task: it lives as long as the pool (an unreachable engine is retried
        # forever) and must not hold the shutdown drain; close() cancels it. Strongly held.
        self._keeper = self._loop.create_task(
            self._reopen(), name=f"abort connection {self._host}:{self._port}: keep warm")

    async def _reopen(self) -> None:
        try:
            while not self._closed and not self._enough():
                try:
                    conn = await self._open()
                except (AbortWireError, ssl.SSLError) as exc:
                    log.debug("abort connection to %s:%d: %s; retrying in %.0f s", self._host,
                              self._port, exc, REOPEN_BACKOFF_S)
                    await asyncio.sleep(REOPEN_BACKOFF_S)
                    continue
                self.idle_again(conn)
                if self.spread:
                    await asyncio.sleep(SPREAD_GAP_S)
        finally:
            self._keeping = False

    def _enough(self) -> bool:
        """True if the pool holds the connections it keeps: ``size`` members (spread), or
        ``size`` idle ones (any other)."""
        return (self._members if self.spread else len(self._idle)) >= self.size

    async def close(self) -> None:
        """Close every connection and stop keeping one warm."""
        self._closed = True
        if self._recycler is not None:
            self._recycler.cancel()
        if self._keeper is not None and not self._keeper.done():
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        while self._idle:
            self._idle.pop().close()


def _consume(answer: asyncio.Future[int]) -> None:
    """Retrieve a keep-alive request's outcome, which nobody awaits (a loss reopens the
    connection, :meth:`AbortPool.lost`)."""
    if not answer.cancelled():
        answer.exception()
