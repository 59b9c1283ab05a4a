"""Engine reads held while clients leave (:class:`sidecar.read_pacer.ReadPacer`), on real sockets.

While a client that left has its abort queued, the pool's reads are held and relayed a few per
loop turn, so that the next lost connections' aborts are queued first. What must not change:
every byte relayed, in order; an engine that closes right after its last bytes (a response
delimited by the close) still ends whole, its held bytes relayed before the close is handled.
A task re-arms the hold in every loop turn, as a storm's stream of lost connections does, so
that every read of the test arrives while reads are held, whatever the machine's speed.

The engine is a raw asyncio server that writes what each test scripts; each client is a raw
socket the relay writes to (:class:`sidecar.relay.Downstream`). ``STREAMS`` requests run at
once, more than a busy turn relays (``ReadPacer.per_busy_turn``), so that reads wait turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sidecar.config import UpstreamSettings
from sidecar.confirm import CONFIRMED, Confirmation
from sidecar.pool import UpstreamPool
from sidecar.read_pacer import HOLD_S, MAX_COLLECTOR_PAUSE_S, MAX_PARK_S
from sidecar.relay import Downstream, UpstreamConnection, origin
from tests.test_tls_upstream import make_certificates

pytestmark = pytest.mark.timeout(30)

GUARD_S = 10.0
STREAMS = 8
HEAD = b"GET /stream HTTP/1.1\r\nHost: engine\r\n\r\n"


class Engine:
    """Answers each connection's request with ``writes``, one write per item, a few
    milliseconds apart (so that each is a read of its own at the relay); if ``close``, the
    last item goes out with the close, so that both arrive in the same loop turn."""

    def __init__(self, writes: list[bytes], close: bool) -> None:
        self.writes = writes
        self.close = close
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for data in self.writes[:-1]:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(self.writes[-1])
        if not self.close:
            await reader.read()  # until the relay closes
        writer.close()


class Client:
    """A client's end: a local server whose accepted socket collects what the relay writes;
    ``transport`` is the relay's side of it."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.ended = asyncio.Event()  # the relay's side closed and every byte was read
        self.transport: asyncio.Transport | None = None
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        async def collect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                self.received += data
            self.ended.set()
            writer.close()
        self.server = await asyncio.start_server(collect, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, "127.0.0.1", port)

    async def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def holding(pool: UpstreamPool) -> AsyncIterator[None]:
    """Re-arm the pool's hold in every loop turn, as a storm's lost connections do (every turn
    busy: ``per_busy_turn`` connections' reads relayed per turn); on the way out, wait for the
    hold to end (``HOLD_S`` after the last)."""
    async def keep() -> None:
        while True:
            pool.reads.hold()
            await asyncio.sleep(0)
    task = asyncio.create_task(keep(), name="a client leaves every turn")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(2 * HOLD_S)


async def relay_one(pool: UpstreamPool, url: str, client: Client) -> bytes:
    """One request relayed to ``client``: the bytes the client got, once the relay closed."""
    connection = await pool.connection(origin(url))
    response = connection.send(HEAD, [], head_only=False)
    await response.head
    assert client.transport is not None
    await response.relay(Downstream(client.transport, chunked=False), read_timeout_s=None)
    assert response.complete, "expected the response read to its end"
    client.transport.close()
    await client.ended.wait()
    return bytes(client.received)


async def relay_through(writes: list[bytes], close: bool, per_busy_turn: int = 2
                        ) -> tuple[list[bytes], UpstreamPool]:
    """``STREAMS`` requests relayed at once while reads are held (``per_busy_turn``
    connections' reads relayed per turn): what each client got, and the pool."""
    engine, clients = Engine(writes, close), [Client() for _ in range(STREAMS)]
    await engine.start()
    for client in clients:
        await client.start()
    pool = UpstreamPool(UpstreamSettings())
    pool.reads.per_busy_turn = per_busy_turn
    try:
        async with holding(pool), asyncio.timeout(GUARD_S):
            bodies = await asyncio.gather(*(relay_one(pool, engine.url, c) for c in clients))
    finally:
        await pool.close()
        for client in clients:
            await client.stop()
        assert engine.server is not None
        engine.server.close()
        await engine.server.wait_closed()
    assert not pool.reads.holding
    return bodies, pool


def chunked(pieces: list[bytes]) -> list[bytes]:
    return [b"%x\r\n%b\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


async def test_held_reads_are_relayed_whole_and_in_order() -> None:
    events = [b"data: {\"i\":%d,\"text\":\"t%d\"}\n\n" % (i, i) for i in range(40)]
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    bodies, pool = await relay_through([head, *chunked(events)], close=False)
    for body in bodies:
        assert body == b"".join(events), f"expected the 40 events unchanged, got {body!r}"
    assert pool.reads.held_reads >= 20 * STREAMS, (
        f"expected the reads held (the test's premise), {pool.reads.held_reads}")


async def test_an_engine_closing_after_its_last_held_bytes_ends_the_response_whole() -> None:
    # Delimited by the close (no length, not chunked): the close is the end, and the bytes that
    # came with it, held, must be relayed before the close is handled. No turn relays held
    # reads here (every turn is busy, 0 per busy turn): the close is what relays them all.
    pieces = [b"piece %d;" % i for i in range(30)]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    bodies, pool = await relay_through([head, *pieces], close=True, per_busy_turn=0)
    for body in bodies:
        assert body == b"".join(pieces), f"expected every piece before the close, got {body!r}"
    assert pool.reads.held_reads >= 15 * STREAMS


async def test_bytes_on_an_idle_connection_are_never_held_for_the_next_request() -> None:
    """Bytes an engine sends on an idle pooled connection (no request in flight) close it at
    once, holding or not: held, they would wait for the pacer's turn while the pool hands the
    connection to the next request, which would read them as its response."""
    stale_sent = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none")
        await stale_sent.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await reader.read()
        writer.close()

    engine = await asyncio.start_server(serve, "127.0.0.1", 0)
    where = origin(f"http://127.0.0.1:{engine.sockets[0].getsockname()[1]}")
    pool = UpstreamPool(UpstreamSettings())
    try:
        async with asyncio.timeout(GUARD_S):
            connection = await pool.connection(where)
            first = connection.send(HEAD, [], head_only=False)
            await first.head
            assert first.complete and first.take_pending() == b"one"
            assert connection.idle, "expected the connection pooled after its response"
            pool.reads.hold()  # a client left: reads are held now
            stale_sent.set()
            while connection.open and connection.held_bytes == 0:  # noqa: ASYNC110 - per turn
                await asyncio.sleep(0)  # ahead of the pacer's turn, had the bytes been held
            assert not connection.open and connection.held_bytes == 0, (
                "expected the idle connection closed by its unsolicited bytes, not holding them")
            again = await pool.connection(where, fresh=False)
            assert again is not connection, "expected the next request on a new connection"
            again.close()
    finally:
        await pool.close()
        engine.close()
        await engine.wait_closed()
        await asyncio.sleep(2 * HOLD_S)


ABORTED_END = chunked([b'data: {"choices":[{"index":0,"finish_reason":"abort"}]}\n\n',
                       b"data: [DONE]\n\n"])


@contextlib.asynccontextmanager
async def watched_while_holding() -> AsyncIterator[tuple[UpstreamPool, UpstreamConnection,
                                                         Confirmation, asyncio.Future[str]]]:
    """One stream whose client left while clients leave: its response handed to a
    :class:`Confirmation` while the pool holds reads; the engine then sends its aborted end.
    Yields the pool, the connection, the confirmation and its verdict."""
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    engine = Engine([head, *ABORTED_END], close=False)
    await engine.start()
    pool = UpstreamPool(UpstreamSettings())
    try:
        async with asyncio.timeout(GUARD_S):
            yield await _watched(pool, engine)
    finally:
        await pool.close()
        assert engine.server is not None
        engine.server.close()
        await engine.server.wait_closed()
        await asyncio.sleep(2 * HOLD_S)


async def _watched(pool: UpstreamPool, engine: Engine) -> tuple[
        UpstreamPool, UpstreamConnection, Confirmation, asyncio.Future[str]]:
    connection = await pool.connection(origin(engine.url))
    response = connection.send(HEAD, [], head_only=False)
    await response.head
    verdict: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    confirmation = Confirmation(response)
    confirmation.arm(verdict.set_result, bound=time.monotonic() + 60)
    pool.reads.hold()  # the client left: its abort is queued (cancellation.Cancellation._abort_now)
    response.watch(confirmation)
    return pool, connection, confirmation, verdict


async def test_a_response_whose_client_left_is_not_read_while_clients_leave() -> None:
    """Parked (:meth:`ReadPacer.park`): the engine's end stays in the socket, unread, while the
    pool holds; once clients stop leaving it is read and confirms the abort."""
    async with watched_while_holding() as (pool, connection, confirmation, verdict):
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.03  # the engine wrote its end 2-4 ms after the head
        while loop.time() < until:
            pool.reads.hold()  # a client leaves every turn
            await asyncio.sleep(0)
        assert connection.parked and connection.held_bytes == 0, (
            f"expected the connection's reading paused, nothing read or held; parked "
            f"{connection.parked}, {connection.held_bytes} bytes held")
        assert confirmation.held and not verdict.done(), (
            "expected the confirmation waiting (held) with no verdict while clients leave")
        assert await verdict == CONFIRMED, "expected the end read once clients stopped"
        assert not connection.parked


async def test_a_parked_response_is_read_again_within_max_park_s() -> None:
    """Clients that never stop leaving: the parked connection is read again ``MAX_PARK_S``
    after it was parked, its bytes then held in the pacer's line like any other read (the
    confirmation's re-sends read them at their bound: :meth:`Confirmation.read_held`)."""
    async with watched_while_holding() as (pool, connection, confirmation, verdict):
        loop = asyncio.get_running_loop()
        parked_at = loop.time()
        assert connection.parked
        while connection.held_bytes == 0:  # a client leaves every turn
            pool.reads.hold()
            await asyncio.sleep(0)
        took = loop.time() - parked_at
        assert not connection.parked and pool.reads.holding
        assert MAX_PARK_S - 0.002 <= took < MAX_PARK_S + 1.0, (
            f"expected it read again {MAX_PARK_S} s after it was parked, took {took:.3f} s")
        assert not verdict.done()
        confirmation.read_held()  # what a re-send does at its bound
        assert verdict.done() and verdict.result() == CONFIRMED


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_an_end_waiting_in_the_socket_is_unread_until_the_relay_reads_it(
        tls: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """:attr:`Confirmation.unread`, what the abort's re-sends ask before counting a call that
    changed nothing (:meth:`sidecar.abort_queue.Resend.judge`): False while the engine sent
    nothing new, and once what it sent was read (an abort event without the end yet); True
    while the engine's end waits unread (here parked, as a storm's busy loop leaves it): in the
    socket, or over TLS in the transport's own buffer (it reads on while paused); the end then
    read gives the verdict."""
    go = [asyncio.Event(), asyncio.Event()]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await go[0].wait()
        writer.write(ABORTED_END[0])  # the abort event, no end yet
        await go[1].wait()
        writer.write(b"".join(ABORTED_END[1:]))  # [DONE] and the last chunk
        await reader.read()
        writer.close()

    context = None
    if tls:  # the engine's certificate signed by a CA the pool trusts (SSL_CERT_FILE)
        ca_path, cert_path, key_path = make_certificates(tmp_path)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_path))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_path, key_path)
    engine = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    scheme = "https" if tls else "http"
    pool = UpstreamPool(UpstreamSettings())
    try:
        async with asyncio.timeout(GUARD_S):
            connection = await pool.connection(
                origin(f"{scheme}://127.0.0.1:{engine.sockets[0].getsockname()[1]}"))
            response = connection.send(HEAD, [], head_only=False)
            await response.head
            verdict: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            confirmation = Confirmation(response)
            confirmation.arm(verdict.set_result, bound=time.monotonic() + 60)
            response.watch(confirmation)  # no client leaving: read at once, not parked
            assert not connection.parked
            assert not confirmation.unread, "expected nothing unread: the engine sent nothing"
            go[0].set()
            while not confirmation.aborted:  # noqa: ASYNC110 - read in some coming turn
                await asyncio.sleep(0.001)
            assert confirmation.open and not confirmation.unread, (
                "expected the abort event read and nothing else waiting")
            assert confirmation.pieces >= 1
            pool.reads.hold()  # clients leave: this one's reading paused, as a busy loop's
            assert pool.reads.park(connection) and connection.parked
            go[1].set()
            loop = asyncio.get_running_loop()
            until = loop.time() + 2.0
            while not confirmation.unread and loop.time() < until:
                pool.reads.hold()
                await asyncio.sleep(0.001)
            assert confirmation.unread, "expected the end seen waiting unread while parked"
            assert not verdict.done(), "expected no verdict while the end waits unread"
            assert await verdict == CONFIRMED, "expected the end read once clients stopped"
    finally:
        await pool.close()
        engine.close()
        await engine.wait_closed()
        await asyncio.sleep(2 * HOLD_S)


async def test_the_collector_waits_while_clients_leave() -> None:
    """:class:`CollectorPause`: no cyclic collection while a pool holds (a storm), the
    collector enabled again once holding ends; one disabled by someone else stays disabled."""
    pool = UpstreamPool(UpstreamSettings())
    try:
        # An earlier test's loop may have stopped while its pool held, the collector paused:
        # the first hold in this loop forgets that pause and makes its own.
        pool.reads.hold()
        assert not gc.isenabled(), "expected the collector paused while a client leaves"
        await asyncio.sleep(2 * HOLD_S)
        assert not pool.reads.holding and gc.isenabled(), (
            "expected the collector running again once the hold ended")
        gc.disable()  # someone else's choice: not ours to undo
        pool.reads.hold()
        await asyncio.sleep(2 * HOLD_S)
        assert not gc.isenabled(), "expected a collector disabled before to stay disabled"
    finally:
        gc.enable()
        await pool.close()


async def test_the_collector_waits_at_most_max_collector_pause_s() -> None:
    """Clients that never stop leaving: the collector runs again ``MAX_COLLECTOR_PAUSE_S``
    after it was paused, while the pool still holds."""
    pool = UpstreamPool(UpstreamSettings())
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(GUARD_S):
            pool.reads.hold()
            paused_at = loop.time()
            while not gc.isenabled():
                pool.reads.hold()  # a client leaves every turn
                await asyncio.sleep(0.001)
            took = loop.time() - paused_at
            assert pool.reads.holding
            assert MAX_COLLECTOR_PAUSE_S <= took < MAX_COLLECTOR_PAUSE_S + 1.0, (
                f"expected the collector back after {MAX_COLLECTOR_PAUSE_S} s, took {took:.3f} s")
    finally:
        gc.enable()
        await pool.close()
        assert not pool.reads.holding and gc.isenabled()


def test_a_loop_that_stopped_while_holding_leaves_no_pause_behind() -> None:
    """A loop that stops while its pool holds never ends that hold (its timers never run):
    the next loop's first hold forgets it, and the collector runs again when that one ends
    (the test process's loops come and go so; a sidecar's one loop ends only at exit)."""
    async def hold_and_leave() -> None:
        UpstreamPool(UpstreamSettings()).reads.hold()  # never closed

    async def hold_and_end() -> bool:
        pool = UpstreamPool(UpstreamSettings())
        try:
            pool.reads.hold()
            await asyncio.sleep(2 * HOLD_S)
            return not pool.reads.holding and gc.isenabled()
        finally:
            await pool.close()

    try:
        with asyncio.Runner() as runner:
            runner.run(hold_and_leave())
        assert not gc.isenabled(), "the test's premise: the stopped loop left it paused"
        with asyncio.Runner() as runner:
            assert runner.run(hold_and_end()), (
                "expected the collector running once the new loop's hold ended")
    finally:
        gc.enable()
