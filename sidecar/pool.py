"""The pool of engine connections: :class:`UpstreamPool`, one per config generation::

    UpstreamPool (one per config generation): keep-alive connections per engine origin, each
        idle one closed after ``keepalive_timeout_s``; ``max_connections`` bounds those in use

A connection (:class:`sidecar.relay.UpstreamConnection`, where its bytes are relayed) is opened
here, TLS for an ``https`` origin, and carries one request at a time; it comes back
(:meth:`UpstreamPool.idle`) only from a response read to its end with keep-alive. The pool's
:class:`sidecar.read_pacer.ReadPacer` (``reads``) holds its connections' reads while clients
leave.

Errors are :mod:`sidecar.errors`: :class:`UpstreamConnectError`/:class:`UpstreamConnectTimeout`
(connect).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from sidecar.config import UpstreamSettings
from sidecar.errors import UpstreamConnectError, UpstreamConnectTimeout
from sidecar.read_pacer import CLOCK_RESOLUTION_S, ReadPacer
from sidecar.relay import Origin, UpstreamConnection, UpstreamResponse
from sidecar.tasks import TaskSet

K = TypeVar("K")


class Deadlines(Generic[K]):
    """Deadlines a fixed ``after_s`` from when each is set, on one loop timer for all of them:
    the pool's first-byte timeouts (``upstream.first_byte_timeout_s``, set as a request goes
    upstream) and the idle connections' keep-alive (``keepalive_timeout_s``). A timer per
    request, armed and cancelled on its way to the first byte, cost ~7 us warm and ~27 us on
    the bench prober's path as ``asyncio.timeout``, where the cache is cold, and ~10 us more
    as the head came back (measured on the bench machine; ``python -m bench.ab``: -10 us of time
    to first token at the median, -7 us of CPU per request).

    Set in order on one clock with one ``after_s``, they fall due in the order they were set:
    the timer is armed at the oldest one still set; a firing calls ``expire`` for each one due,
    then is armed at the next. One cleared before it falls due costs a dict deletion; the
    timer, armed at an older one, then fires for nothing once and moves on, about once per
    ``after_s`` under steady traffic.
    """

    def __init__(self, after_s: float, expire: Callable[[K], None]) -> None:
        self.after_s = after_s
        self._expire = expire
        self._due: dict[K, float] = {}  # in the order set: loop time each falls due
        self._timer: asyncio.TimerHandle | None = None

    def set(self, key: K, loop: asyncio.AbstractEventLoop) -> None:
        """``key`` falls due ``after_s`` from now (set again: from now, at the back)."""
        due = self._due
        due.pop(key, None)
        at = due[key] = loop.time() + self.after_s
        if self._timer is None:
            self._timer = loop.call_at(at, self._fire, loop)

    def clear(self, key: K) -> None:
        """``key`` is not due any more (never an error)."""
        self._due.pop(key, None)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        due = self._due
        while due:
            key, at = next(iter(due.items()))
            # Due within the clock's resolution counts as due: uvloop rounds a timer's delay to
            # whole milliseconds, fires at most that early, and a delay rounded to 0 runs in the
            # next loop pass: re-armed there, it would spin until the clock ticks.
            if at - now > CLOCK_RESOLUTION_S:
                self._timer = loop.call_at(at, self._fire, loop)
                return
            del due[key]
            self._expire(key)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due.clear()


class UpstreamPool:
    """Keep-alive connections to the engines of one config generation.

    Idle connections are kept ``keepalive_timeout_s`` (below the engine's own idle timeout, so
    the engine is rarely the one closing them) and reused most recent first;
    ``max_connections`` (0: no limit) bounds connections in use and being opened: a request
    over it waits for one to be released.
    """

    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None
        self.tasks = TaskSet()  # request bodies still being uploaded
        self.reads = ReadPacer()
        timeout_s = settings.first_byte_timeout_s
        # The responses waiting for their head (sidecar.upstream): None, no first-byte timeout.
        self.first_byte: Deadlines[UpstreamResponse] | None = None if timeout_s is None else (
            Deadlines(timeout_s, lambda response: response.expire(timeout_s)))
        self._keepalive: Deadlines[UpstreamConnection] = Deadlines(
            settings.keepalive_timeout_s, UpstreamConnection.close)

    def reuse(self, origin: Origin) -> UpstreamConnection | None:
        """An idle connection to ``origin``, now; ``None`` if there is none."""
        idle = self._idle.get(origin.host_field)
        while idle:
            connection = idle.pop()
            connection.idle = False
            self._keepalive.clear(connection)
            if connection.open:
                connection.in_use = connection.reused = True
                self._in_use += 1
                return connection
        return None

    async def connection(self, origin: Origin, fresh: bool = False) -> UpstreamConnection:
        """An idle connection to ``origin`` (unless ``fresh``) or a new one. Raises
        :class:`UpstreamConnectError` or :class:`UpstreamConnectTimeout`."""
        limit = self.settings.max_connections
        while True:
            # Looked at again after each wait: the slot released may be a connection gone
            # back idle, to be reused rather than joined by a new one.
            if not fresh and (connection := self.reuse(origin)) is not None:
                return connection
            if not limit or self._in_use < limit:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # pass the slot on
                raise
        self._in_use += 1
        try:
            return await self._connect(origin)
        except BaseException:
            self._release()
            raise

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.connect_timeout_s
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        made: list[UpstreamConnection] = []

        def connection_for() -> UpstreamConnection:
            made.append(UpstreamConnection(self, origin))
            return made[-1]

        try:
            async with asyncio.timeout(timeout_s):
                _, protocol = await loop.create_connection(
                    connection_for, origin.host, origin.port, ssl=tls)
        except BaseException as exc:
            # Given up once connected (cancelled: the client left): uvloop closes the transport
            # without connection_lost, so the connection and its transport would point at each
            # other until the cyclic collector runs.
            for connection in made:
                connection.transport = None
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectTimeout(
                    f"no connection to {origin} within {timeout_s}s") from exc
            if isinstance(exc, OSError):
                raise UpstreamConnectError(f"cannot connect to {origin}: {exc}") from exc
            raise
        connection = protocol
        connection.in_use = True
        self._all.add(connection)
        return connection

    def idle(self, connection: UpstreamConnection) -> None:
        """A connection that finished a response with keep-alive."""
        connection.in_use = False
        connection.idle = True
        self._release()
        self._keepalive.set(connection, connection.loop)
        self._idle.setdefault(connection.origin.host_field, []).append(connection)

    def lost(self, connection: UpstreamConnection) -> None:
        """``connection`` closed: forget it (and free its slot if it was in use)."""
        if connection not in self._all:
            return
        self._all.discard(connection)
        self._keepalive.clear(connection)
        if connection.idle:
            connection.idle = False
            self._idle[connection.origin.host_field].remove(connection)
        if connection.in_use:
            connection.in_use = False
            self._release()

    def _release(self) -> None:
        self._in_use -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection (at a generation's end, once no request uses it)."""
        for connection in list(self._all):
            connection.idle = False
            connection.close()
        self._idle.clear()
        self.reads.close()
        self._keepalive.close()
        if self.first_byte is not None:
            self.first_byte.close()
        await self.tasks.drain(0)
