"""Engine reads held while clients leave: :class:`ReadPacer`, the storm-pacing policy of the
relay, one per pool of engine connections (:class:`sidecar.pool.UpstreamPool`, its ``reads``)::

    ReadPacer (one per pool): while clients leave, reads are held and relayed a few per loop
        turn, so that the lost connections' aborts are queued first; the responses of the
        clients that left (read for an abort's confirmation) are not read at all until the
        clients stop leaving (parked)

The byte path stays :mod:`sidecar.relay`'s: while :attr:`ReadPacer.holding`, a connection's
``data_received`` keeps the read as bytes instead of parsing it, and a turn of the pacer hands
them back to it (``relay_held``, the connection as :class:`Paced` describes it). Why, and what it
costs the streams that go on: :class:`ReadPacer`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections import deque
from typing import Protocol

log = logging.getLogger(__name__)

CLOCK_RESOLUTION_S = 0.001  # uvloop's clock and timers count milliseconds
HOLD_S = 0.01  # reads are held this long after a client left with its abort queued (ReadPacer)
MAX_PARK_S = 0.05  # a parked connection is read again at most this long after it was parked
MAX_COLLECTOR_PAUSE_S = 1.0  # the garbage collector waits at most this long for a storm's end
MAX_HELD_BYTES = 65536  # a connection's held reads are relayed at once beyond this


class CollectorPause:
    """Python's cyclic garbage collector waits while clients leave (while any pool's
    :class:`ReadPacer` holds), at most ``MAX_COLLECTOR_PAUSE_S`` at a time.

    Why: a storm allocates fast (each lost connection's abort, teardown and confirmation), so
    the young generation fills in it, and a collection stops everything: 1-2 ms for a young one
    with :data:`sidecar.server.GC_YOUNG_THRESHOLD` objects, 10-28 ms when it takes the middle
    generation along (measured with ``gc.callbacks`` in ``python -m bench``'s storm, 1,000
    streams: a young collection in a quarter of the storms, each adding its pause to that
    storm's last aborts). Paused, the collection runs after the storm, with the aborts out.
    One per process (the collector is the process's): :data:`COLLECTOR`. It enables again
    only what it disabled."""

    __slots__ = ("holders", "loop", "paused_at")

    def __init__(self) -> None:
        self.holders = 0  # pacers holding now, in ``loop``
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop of the holds counted
        self.paused_at: float | None = None  # loop time it disabled the collector at

    def begin(self, now: float) -> None:
        """A pacer started holding at loop time ``now`` (in the running loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            # The holds counted were another loop's, one that stopped while its pools held
            # (their ends never come): they count no more.
            self.loop, self.holders = loop, 0
            self._resume()
        self.holders += 1
        if self.paused_at is None and gc.isenabled():
            gc.disable()
            self.paused_at = now
        else:
            self.check(now)

    def check(self, now: float) -> None:
        """Clients still leave at loop time ``now``: enable the collector again if it waited
        ``MAX_COLLECTOR_PAUSE_S`` already (clients that never stop leaving, or a pacer that
        never ended its hold: a pool dropped without ``close``)."""
        if self.paused_at is not None and now - self.paused_at > MAX_COLLECTOR_PAUSE_S:
            self._resume()

    def end(self) -> None:
        """A pacer stopped holding."""
        self.holders = max(0, self.holders - 1)
        if self.holders == 0:
            self._resume()

    def _resume(self) -> None:
        if self.paused_at is not None:
            self.paused_at = None
            gc.enable()


COLLECTOR = CollectorPause()


class Paced(Protocol):
    """A connection whose engine reads the pacer holds: a
    :class:`sidecar.relay.UpstreamConnection`."""

    queued: bool  # in the pacer's line
    parked: bool  # its reading is paused by the pacer (ReadPacer.park)
    unparked_at: float  # loop time at which the pacer last resumed its reading

    @property
    def watched(self) -> bool:
        """True if its response is read for a watcher (its client left), not for a client."""

    def relay_held(self) -> bool:
        """Relay the held reads; False if none were held."""

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ReadPacer:
    """Holds the engines' reads back while clients are leaving, so that the aborts go first.

    Why: when hundreds of clients leave at once, each lost connection costs the proxy ~20-40 us
    before its abort is queued (uvloop reads the reset, the proxy derives the ids), and the
    streams that go on keep their engines' reads coming, ~40-60 us each to relay. Relayed as
    they arrive, a burst of reads sat between the resets: in ``python -m bench``'s storm (500 of
    1,000 streams reset at once, 100 ms/token) the sidecar noticed the last reset 35-60 ms after
    its client's close, behind 150-200 relayed reads at a time.

    So for ``HOLD_S`` after a client left with its abort queued (:meth:`hold`, from
    :meth:`sidecar.relay.UpstreamConnection.retire`), every read of this pool's connections is
    kept as bytes (:meth:`sidecar.relay.UpstreamConnection.data_received`) and relayed later,
    in arrival order per connection: ``per_busy_turn`` connections' reads in a loop turn that
    follows lost connections, ``per_turn`` in other turns, until none waits. A connection
    whose reads wait adds the next ones to them (never out of order); one whose held bytes pass
    ``MAX_HELD_BYTES`` is relayed at once (bounded memory); its ``connection_lost`` relays them
    first (the engine's last bytes, then its close). The streams that go on pay for it in
    inter-token latency during the storm, a loop turn or a few per read. Reads of a response
    whose client left (read for an abort's confirmation: :mod:`sidecar.confirm`) wait for a
    turn that no client left in: nobody waits for them, and hundreds of engine ends read
    between the resets would delay the aborts of the clients still leaving.

    Such a response whose client left while the pacer holds is not even read (:meth:`park`):
    its connection's reading is paused until holding ends, or ``MAX_PARK_S`` at most (clients
    that never stop leaving), and only then does the engine's end (the confirmation) come in.
    Held, each of those reads still cost uvloop's read and a call into the proxy (~5-10 us): in
    the storm above, 400-1,000 of them fell between the resets, the engines answering the
    first abort calls, and the last abort call left ~6-10 ms later than with the upstream
    closed at once (``abort.confirm_timeout_s: 0``).
    """

    __slots__ = ("_handle", "_park_timer", "_parked", "_timer", "_waiting", "_watched", "busy",
                 "held_reads", "holding", "per_busy_turn", "per_turn", "until")

    def __init__(self, per_turn: int = 16, per_busy_turn: int = 2) -> None:
        self.per_turn = per_turn
        self.per_busy_turn = per_busy_turn
        self.holding = False  # reads are kept, not relayed as they arrive
        self.busy = False  # a client left since the last turn: clients are still leaving
        self.until = 0.0  # loop time at which holding ends, unless a client leaves again
        self.held_reads = 0  # reads held so far (not relayed as they arrived)
        self._waiting: deque[Paced] = deque()
        # Responses whose client left (sidecar.relay.Watcher: an abort's confirmation): nobody
        # waits for their bytes, so they are relayed only in turns no client left in.
        self._watched: deque[Paced] = deque()
        self._handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._parked: list[Paced] = []  # reading paused until holding ends (park)
        self._park_timer: asyncio.TimerHandle | None = None

    def hold(self) -> None:
        """A client left and its abort is queued: hold reads for ``HOLD_S`` from now."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.holding:
            COLLECTOR.check(now)
        else:
            COLLECTOR.begin(now)
        self.holding = self.busy = True
        self.until = now + HOLD_S
        if self._timer is None:
            self._timer = loop.call_at(self.until, self._expire)

    def park(self, connection: Paced) -> bool:
        """While holding, pause the reading of ``connection`` (whose client left: read only
        for an abort's confirmation) until holding ends, at most ``MAX_PARK_S``; False (nothing
        done) when not holding."""
        if not self.holding or connection.parked:
            return self.holding
        connection.pause_reading()
        connection.parked = True
        self._parked.append(connection)
        if self._park_timer is None:
            self._park_timer = asyncio.get_running_loop().call_later(MAX_PARK_S, self._unpark)
        return True

    def _unpark(self) -> None:
        """Read every parked connection again (the engine's ends come in the next poll)."""
        if self._park_timer is not None:
            self._park_timer.cancel()
            self._park_timer = None
        parked, self._parked = self._parked, []
        now = asyncio.get_running_loop().time()
        for connection in parked:
            connection.parked = False
            connection.unparked_at = now
            connection.resume_reading()

    def wait(self, connection: Paced) -> None:
        """``connection`` has reads held: relay them in a coming turn (once in line)."""
        if connection.queued:
            return
        connection.queued = True
        if connection.watched:
            self._watched.append(connection)
        else:
            self._waiting.append(connection)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self._turn)

    def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        # Within half a clock tick of the end counts as the end: a re-arm rounded to 0 ms
        # would turn the loop without sleeping until the tick.
        if loop.time() + CLOCK_RESOLUTION_S / 2 < self.until:
            self._timer = loop.call_at(self.until, self._expire)
        else:
            self._timer = None
            self.holding = self.busy = False
            COLLECTOR.end()
            if self._parked:
                self._unpark()

    def close(self) -> None:
        """The pool closed every connection (their held bytes are dropped): stop holding."""
        for timer in (self._timer, self._handle, self._park_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._handle = self._park_timer = None
        self._parked.clear()
        self._waiting.clear()
        self._watched.clear()
        if self.holding:
            COLLECTOR.end()
        self.holding = self.busy = False

    def _turn(self) -> None:
        self._handle = None
        busy, self.busy = self.busy, False
        waiting = self._waiting
        budget = self.per_busy_turn if busy else self.per_turn
        while budget > 0 and (waiting or (self._watched and not busy)):
            connection = waiting.popleft() if waiting else self._watched.popleft()
            connection.queued = False
            try:
                relayed = connection.relay_held()
            except Exception:
                # A sidecar bug: that response is given up; the others go on.
                log.exception("relaying held engine reads failed; closing that connection")
                connection.close()
                relayed = True
            if relayed:  # a connection with nothing held (closed meanwhile) costs nothing
                budget -= 1
        if (waiting or self._watched) and self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self._turn)
