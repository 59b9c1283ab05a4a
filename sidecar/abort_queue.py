"""The abort queue of each engine, the records it holds and their timers: what
:class:`sidecar.abort.Aborter` keeps of an abort between :meth:`~sidecar.abort.Aborter.abort` and
the answer of its last call::

    Queue          one engine adapter's waiting requests (first calls ahead of re-sends), its
                   calls in flight, its scheduled flush and its re-sends due (a heap, one timer)
    Request        one request's abort (or one re-send of it), from queued to its outcome
    Resend         one request's re-sends at one engine: when, how wide, how many calls
    EarliestTimer  one event-loop timer for many due times
    Bounds         the confirmations' bounds, under one such timer

The bounds a queue keeps (``MAX_CALLS_PER_ENGINE``, ``RESEND_SLOTS``, ``MAX_QUEUED_IDS``) are told
in :mod:`sidecar.abort`'s docstring; :meth:`Queue.make_room` decides who gives way when the queue
is full. When a request's calls are sent and re-sent is the Aborter's; how one call is made and
what its outcome means is :mod:`sidecar.abort_call`'s.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import EngineAdapter
from sidecar.abort_call import ACCEPTED
from sidecar.confirm import BOUND_EARLY_S, Confirmation
from sidecar.logs import RequestLog

MAX_CALLS_PER_ENGINE = 8
MAX_QUEUED_IDS = 16384  # per engine, waiting for a slot: at most ~8 MB held while an engine hangs
RESEND_SLOTS = 2  # re-sends start only while fewer calls are in flight: first calls go first


@dataclass(slots=True, eq=False)
class Request:
    """One request's abort, from :meth:`sidecar.abort.Aborter.abort` to its outcome."""

    ids: tuple[str, ...]
    sidecar_id: str
    noticed_at: float  # time.monotonic() when the disconnect was noticed
    request_log: RequestLog | None
    unsent: int  # ids (the last ones) not yet taken into a call
    calls: int = 0  # calls carrying some of its ids, not yet answered
    outcome: str | None = None  # the first outcome that was not accepted, else accepted
    resend: Resend | None = None  # its re-sends, if it ended inside the registration window
    first: bool = True  # False for a re-send: counted in no request-level metric
    copies: int = 1  # calls it makes at once, each on another abort connection (confirming)
    confirmation: Confirmation | None = None  # the engine's word that the work stopped
    answered: bool = False  # its first call(s) ended; with a confirmation: awaiting the verdict

    def settle(self, outcome: str) -> bool:
        """Record a call's ``outcome``; True once every id was sent and answered."""
        if self.outcome is None or self.outcome == ACCEPTED:
            self.outcome = outcome
        return self.unsent == 0 and self.calls == 0


@dataclass(slots=True, eq=False)
class Resend:
    """One request's re-sends at one engine: its ids again, at ``due`` (``time.monotonic()``),
    then after ``gap`` seconds doubling up to the engine's ``resend_max_interval_s``, the last
    one at ``until`` (the registration window's end)."""

    ids: tuple[str, ...]
    sidecar_id: str
    until: float
    due: float
    gap: float
    stopped: bool = False  # refused (re-sending cannot help), the engine confirmed, or
    # its re-send gave way in a full queue
    pending: Request | None = None  # the last re-send queued (one at a time per request)
    # With a confirmation: each re-send makes ``width`` calls at once on as many abort
    # connections, ``width`` doubling up to ``abort.fanout`` from ``widen_from`` (the ids are
    # surely registered then); ``calls`` counts every call naming the ids (the first too), at
    # most ``abort.max_calls``.
    confirming: bool = False
    confirmation: Confirmation | None = None
    tried: set[int] = field(default_factory=set)  # id()s of the abort connections it went on
    widen_from: float = 0.0
    width: int = 1
    calls: int = 1
    # Re-sends that the engine's response shows changed nothing (judge): at most
    # MULTI_RESENDS are counted (sidecar.abort).
    misses: int = 0
    undecided: int = 0  # re-sends that found bytes unread, not judged yet
    undecided_at: int = 0  # Confirmation.pieces at the last of them
    slot: int = -1  # the tie-breaker of its entry in the re-send heap: an older one is stale
    # Waiting for a JSON answer's late registration (sidecar.abort.Aborter._late_wait): its
    # gaps double without resend_max_interval_s's cap.
    blind: bool = False

    def left(self, request: Request) -> None:
        """``request``, a re-send of this one, was answered, or left its line unsent: the next
        re-send may be queued. (It and :attr:`pending` point at each other: dropped here, they
        are freed by reference counting, not left to the cyclic collector.)"""
        if self.pending is request:
            self.pending = None

    def restart(self, now: float, until: float, due: float, gap: float, blind: bool) -> None:
        """Start the re-sends over for a request the engine registered late (``now``: the
        ``time.monotonic()`` of deciding so; :meth:`sidecar.abort.Aborter._late_start`,
        ``_late_wait``): due at ``due``, then after ``gap`` doubling, the last at ``until``;
        ``blind``: without ``resend_max_interval_s``'s cap. As a first call: one call wide,
        ``calls`` and the misses from 0 (every call before came before the registration), and
        ``widen_from`` = ``now``, after the disconnect, so none of its misses marks the engine
        as having several API-server processes (``Aborter._verdict``)."""
        self.until, self.due, self.gap, self.blind = until, due, gap, blind
        self.width, self.widen_from, self.misses, self.undecided, self.calls = 1, now, 0, 0, 0

    def advance(self, max_interval_s: float) -> bool:
        """Move to the next re-send; False once the one at ``until`` was made."""
        if self.due >= self.until:
            return False
        self.gap = min(self.gap * 2, max_interval_s)
        self.due = min(self.due + self.gap, self.until)
        return True

    def widen(self, now: float, several: bool, fanout: int, max_calls: int) -> int:
        """The calls the next re-send makes at once (counted in ``calls``), and ``width`` for the
        one after: wider each time, on other abort connections and so other API-server
        processes; at once ``abort.fanout`` at an engine seen with ``several`` of them."""
        if several:
            self.width = fanout
        copies = min(self.width, max_calls - self.calls)
        if now >= self.widen_from or several:
            self.width = min(self.width * 2, fanout)
        self.calls += copies
        return copies

    def judge(self, pieces: int, unread: bool) -> None:
        """Count the re-send going out now, and the undecided ones before it, as misses where
        the engine's response shows they changed nothing. ``pieces``: the body pieces read from
        it so far (:attr:`Confirmation.pieces`); ``unread``: something it sent waits unread
        (:attr:`Confirmation.unread`). Nothing unread: a miss. Something unread: undecided,
        since it may be the end; decided at a later re-send, each a miss once pieces were read
        since (they were not the end: no verdict came). The caller skips this once the abort
        mark was read (the engine stopped; its end is on its way)."""
        if self.undecided and pieces > self.undecided_at:
            self.misses += self.undecided
            self.undecided = 0
        if unread:
            self.undecided += 1
            self.undecided_at = pieces
        else:
            self.misses += 1

    def waits_for_pacer(self, now: float) -> bool:
        """True if this re-send waits, not due yet in effect: the engine's answer to its earlier
        calls is held or unread while clients leave (:attr:`Confirmation.held`), and its bound
        (``until``) is not reached."""
        confirmation = self.confirmation
        return (confirmation is not None and not self.stopped and now < self.until
                and confirmation.held)

    def waits_for_close(self, now: float) -> bool:
        """True if this re-send waits because the engine closed the connection of the response
        it confirms and that close is still to be handled (:attr:`Confirmation.closing`: its
        verdict comes then; naming the ids again would change nothing), and its bound
        (``until``) is not reached."""
        confirmation = self.confirmation
        return (confirmation is not None and not self.stopped and now < self.until
                and confirmation.closing)


class EarliestTimer:
    """One event-loop timer for many due times (``time.monotonic()``): set at the earliest and
    moved only when that gets earlier, so a storm of aborts pushes its due times (re-sends,
    confirmation bounds) without a timer each. The callback calls :meth:`fired` first."""

    __slots__ = ("_at", "_handle")

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def at_most(self, due: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``due``, or earlier if the timer is already set earlier."""
        if self._handle is not None:
            if self._at <= due:
                return
            self._handle.cancel()
        self._at = due
        self._handle = asyncio.get_running_loop().call_later(
            max(0.0, due - time.monotonic()), callback)

    def fired(self) -> None:
        self._handle = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Bounds:
    """Confirmations to expire at their bound (``time.monotonic()``): one timer for all of them
    (a heap), set at the earliest and moved only when that gets earlier."""

    __slots__ = ("_heap", "_order", "_timer")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Confirmation]] = []
        self._order = itertools.count()  # ties in the heap
        self._timer = EarliestTimer()

    def add(self, confirmation: Confirmation) -> None:
        """Expire ``confirmation`` at its bound (:attr:`Confirmation.bound`), and again at each
        later one it moves to (a late start: :meth:`Confirmation.expire`)."""
        heapq.heappush(self._heap, (confirmation.bound, next(self._order), confirmation))
        self._timer.at_most(confirmation.bound, self._due)

    def clear(self) -> None:
        self._timer.cancel()
        self._heap.clear()

    def _due(self) -> None:
        self._timer.fired()
        now = time.monotonic()
        bounds = self._heap
        # Within a clock tick counts as due: a re-arm rounded to 0 ms would turn the loop
        # without sleeping until the tick.
        while bounds and bounds[0][0] <= now + BOUND_EARLY_S:
            confirmation = heapq.heappop(bounds)[2]
            confirmation.expire(now)  # a no-op for one decided or closed already
            if confirmation.open:  # its bound moved later
                heapq.heappush(bounds, (confirmation.bound, next(self._order), confirmation))
        if bounds:
            self._timer.at_most(bounds[0][0], self._due)


@dataclass(slots=True, eq=False)
class Queue:
    """One engine adapter's waiting requests and calls in flight."""

    engine: EngineAdapter
    waiting: deque[Request] = field(default_factory=deque)  # first calls: always ahead
    waiting_ids: int = 0
    resending: deque[Request] = field(default_factory=deque)  # re-sends, one per request
    resending_ids: int = 0
    in_flight: int = 0
    flush_scheduled: bool = False
    batch_since: float = 0.0  # time.monotonic() the first id waiting for the flush was queued
    flush_token: object = None  # the scheduled flush task's, so a stale done-callback is known
    resends: list[tuple[float, int, Resend]] = field(default_factory=list)  # heap by due
    resend_timer: EarliestTimer = field(default_factory=EarliestTimer)

    def take(self, limit: int, *, resends: bool) -> tuple[tuple[str, ...], list[Request]]:
        """Up to ``limit`` waiting ids, oldest first, first calls before re-sends (those only if
        ``resends``), and the requests they belong to. A request with more ids than fit is
        split; its remaining ids stay first in line."""
        ids: list[str] = []
        requests: list[Request] = []
        for line in (self.waiting, self.resending) if resends else (self.waiting,):
            taken = len(ids)
            while line and len(ids) < limit:
                request = line[0]
                if request.resend is not None and request.resend.stopped and not request.first:
                    line.popleft()  # confirmed (or refused) while it waited: not sent
                    self.resending_ids -= request.unsent
                    request.unsent = 0
                    request.resend.left(request)
                    continue
                start = len(request.ids) - request.unsent
                count = min(request.unsent, limit - len(ids))
                ids.extend(request.ids[start:start + count])
                request.unsent -= count
                request.calls += 1
                requests.append(request)
                if request.unsent == 0:
                    line.popleft()
            if line is self.waiting:
                self.waiting_ids -= len(ids) - taken
            else:
                self.resending_ids -= len(ids) - taken
        return tuple(ids), requests

    def ready(self) -> bool:
        """Something to send now: a first call while a slot is free, a re-send while one of
        the ``RESEND_SLOTS`` is."""
        return bool((self.waiting and self.in_flight < MAX_CALLS_PER_ENGINE)
                    or (self.resending and self.in_flight < RESEND_SLOTS))

    def idle(self) -> bool:
        return (not self.waiting and not self.resending and self.in_flight == 0
                and not self.flush_scheduled and not self.resends)

    def put(self, request: Request, drop: Callable[[Queue, Request], None]) -> bool:
        """Put ``request``'s ids in line, a re-send behind every first call; False if they are
        not: a re-send that does not fit the bound is skipped (it never pushes out a first
        call), a first call that does not fit makes room (:meth:`make_room`) or is dropped."""
        ids = request.ids
        if not request.first:
            if self.resending_ids + len(ids) > MAX_QUEUED_IDS:
                return False
            self.resending.append(request)
            self.resending_ids += len(ids)
        else:
            while (self.resending and self.waiting_ids + self.resending_ids + len(ids)
                   > MAX_QUEUED_IDS):  # re-sends give way first: that request's end
                evicted = self.resending.pop()
                self.resending_ids -= evicted.unsent
                if evicted.resend is not None:
                    evicted.resend.stopped = True
                    evicted.resend.left(evicted)
            if (self.waiting_ids + len(ids) > MAX_QUEUED_IDS
                    and not self.make_room(request, drop)):
                return False
            self.waiting.append(request)
            self.waiting_ids += len(ids)
        return True

    def make_room(self, request: Request, drop: Callable[[Queue, Request], None]) -> bool:
        """Fit ``request`` into this full queue; True if it now fits.

        The waiting request with the most unsent ids gives way while it has more than
        ``request``; otherwise ``request`` itself is dropped. So one client's request with
        thousands of ids (a completion with a long prompt list) can never crowd out the aborts
        of many small ones. A dropped request is handed to ``drop`` (it ends ``dropped``:
        counted, logged, access line).
        """
        need = len(request.ids)
        while self.waiting_ids + need > MAX_QUEUED_IDS:
            biggest = max(self.waiting, key=lambda r: r.unsent, default=None)
            if biggest is None or biggest.unsent <= need:
                drop(self, request)
                return False
            self.waiting.remove(biggest)
            self.waiting_ids -= biggest.unsent
            drop(self, biggest)
        return True
