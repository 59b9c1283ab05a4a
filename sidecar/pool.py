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

from sidecar.config import UpstreamSettings
from sidecar.errors import UpstreamConnectError, UpstreamConnectTimeout
from sidecar.read_pacer import ReadPacer
from sidecar.relay import Origin, UpstreamConnection, UpstreamResponse
from sidecar.tasks import TaskSet


class FirstByteTimer:
    """``upstream.first_byte_timeout_s`` of the responses a pool's requests wait for: one loop
    timer, at the earliest of their deadlines, for all of them. ``asyncio.timeout`` around each
    request armed and cancelled a timer of its own, on the way to the first byte: ~7 us warm and
    ~27 us on the bench prober's path, where the cache is cold, as the request went upstream and
    ~10 more as its head came back (measured on the bench machine).

    A response still waiting at its deadline is told (:meth:`UpstreamResponse.expire
    <sidecar.relay.UpstreamResponse.expire>`); the timer then scans what is left and is armed at
    the earliest deadline again. With one timeout per pool it fires about once per timeout.
    """

    def __init__(self) -> None:
        self._waiting: dict[UpstreamResponse, tuple[float, float]] = {}  # (deadline, timeout)
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # the loop time the timer is armed at

    def start(self, response: UpstreamResponse, deadline: float, timeout_s: float) -> None:
        """``response`` must have its head by ``deadline`` (loop time), ``timeout_s`` after its
        attempt began."""
        self._waiting[response] = (deadline, timeout_s)
        if self._timer is None or deadline < self._at:
            self._arm(response.connection.loop, deadline)

    def stop(self, response: UpstreamResponse) -> None:
        """The wait for ``response``'s head is over, whichever way."""
        self._waiting.pop(response, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = deadline
        self._timer = loop.call_at(deadline, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        earliest = None
        for response, (deadline, timeout_s) in list(self._waiting.items()):
            if deadline <= now:
                del self._waiting[response]
                response.expire(timeout_s)
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self._arm(loop, earliest)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting.clear()


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
        self.first_byte = FirstByteTimer()

    def reuse(self, origin: Origin) -> UpstreamConnection | None:
        """An idle connection to ``origin``, now; ``None`` if there is none."""
        idle = self._idle.get(origin.host_field)
        while idle:
            connection = idle.pop()
            connection.idle = False
            if connection.keepalive is not None:
                connection.keepalive.cancel()
                connection.keepalive = None
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
        try:
            async with asyncio.timeout(timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: UpstreamConnection(self, origin), origin.host, origin.port, ssl=tls)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"no connection to {origin} within {timeout_s}s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {origin}: {exc}") from exc
        connection = protocol
        connection.in_use = True
        self._all.add(connection)
        return connection

    def idle(self, connection: UpstreamConnection) -> None:
        """A connection that finished a response with keep-alive."""
        connection.in_use = False
        connection.idle = True
        self._release()
        loop = connection.loop
        connection.keepalive = loop.call_later(self.settings.keepalive_timeout_s,
                                               connection.close)
        self._idle.setdefault(connection.origin.host_field, []).append(connection)

    def lost(self, connection: UpstreamConnection) -> None:
        """``connection`` closed: forget it (and free its slot if it was in use)."""
        if connection not in self._all:
            return
        self._all.discard(connection)
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
        self.first_byte.close()
        await self.tasks.drain(0)
