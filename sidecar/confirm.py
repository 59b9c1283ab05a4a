"""Confirmation: the engine says, on the request's own upstream connection, that the work stopped.

An abort call answered 200 is not work stopped. vLLM ignores ids it does not know yet (the
registration window: :mod:`sidecar.abort`) and, run with several API-server processes
(``vllm serve --api-server-count N``), ids another process owns: each process keeps its own map
of request ids (``vllm/v1/engine/output_processor.py``, ``external_req_ids``) and the abort
endpoint only looks in the map of the process that accepted the call's connection, answering 200
either way (``../shared/notes/cancellation-facts.md``). SGLang drops a rid that is not live yet.

What the engine still sends on the request's connection tells the truth. An aborted vLLM stream
ends at once with a chunk whose ``finish_reason`` is ``"abort"``, then ``data: [DONE]``; an
aborted JSON request answers early with its partial output and ``"finish_reason": "abort"``
(``vllm/v1/engine/__init__.py``: ``FinishReason.ABORT``; measured 2 ms after the call that hit
its owner). SGLang ends an aborted request with ``finish_reason`` ``{"type": "abort", ...}`` on
its native routes and ``"abort"`` on the OpenAI ones (:data:`ABORT_MARK` has every shape). A
call that missed changes nothing there.

So once a client leaves, the proxy keeps the upstream connection open and hands the response to
a :class:`Confirmation` (:meth:`sidecar.relay.UpstreamResponse.watch`), which reads what the
engine still sends, forwards nothing, and gives one verdict:

- ``confirmed``: the response ended carrying the abort mark (:data:`ABORT_MARK`): the engine
  stopped the work because it was aborted;
- ``finished``: it ended without the mark (the engine finished on its own first, or answered an
  error, or closed the connection): the work is over all the same;
- ``unconfirmed``: nothing ended by the bound (``engines.*.abort.confirm_timeout_s`` after the
  disconnect, or the registration window's end if later); the connection is then closed (an
  engine whose own disconnect detection works stops on that).

A late start. vLLM sends a chat or completions stream's first byte only once it registered the
request (``EngineAdapter.registered_once_streaming``), and a request can register seconds after
its body: a long prompt tokenized behind others, an API process busy (a real vLLM on a 2-core
box, under a burst of 15 prompts of 1,500-3,500 tokens, registered one more than 2 s after its
body, past every re-send; it then ran 527 tokens for nobody). So a stream whose engine had sent
nothing by the bound is not given up: it is watched on, up to ``engines.*.abort.late_start_s``
after the disconnect, with no call made; when its head comes (:meth:`Confirmation.began`) the
aborter is told (``on_start``): it names the ids again at once, then re-sends them as after a
disconnect, for a new bound.

A late registration of a JSON answer. vLLM sends a non-streaming chat or completions answer whole,
at its end, so nothing on its connection says when it registered: a JSON request whose engine had
sent nothing by the bound is watched on the same way, up to ``late_start_s`` after the
disconnect, and meanwhile its ids are named again at doubling gaps (``on_wait``:
:meth:`sidecar.abort.Aborter._late_wait`), so one the engine registers ``t`` seconds into the
wait stops within about ``t`` more; its answer, cut short with the abort mark, confirms it.

The abort's re-sends (:mod:`sidecar.abort`) go on until the verdict. The mark is searched only in
bytes that arrive after the disconnect, over piece boundaries; text a model generates cannot
forge it, since JSON escapes its quotes (``\\"finish_reason\\"``).
"""

from __future__ import annotations

import re
import select
import time
from collections.abc import Callable

from sidecar.headers import is_event_stream
from sidecar.relay import UpstreamResponse

BOUND_EARLY_S = 0.002  # a confirmation's bound this close is reached (the loop's timers: 1 ms)

CONFIRMED = "confirmed"
FINISHED = "finished"
UNCONFIRMED = "unconfirmed"

# vLLM (every OpenAI route, stream or JSON): "finish_reason":"abort". SGLang 0.5.23
# (srt/managers/schedule_batch.py FINISH_ABORT, tokenizer_manager.py _handle_abort_req; read by
# the team in its wheels): its OpenAI chat and completions routes the same; native /generate
# "finish_reason":{"type":"abort","message":"Aborted",...}; /v1/responses (0.5.20+) a failed
# response whose error message is "Aborted"; an abort caught in the grammar queue an error
# "Aborted by AbortReq.". A JSON encoder may put spaces after the colons.
# vLLM's /v1/responses with a harmony model: the response's "status":"cancelled"
# (openai/responses/serving.py); with other models an aborted response ends "completed", no mark.
ABORT_MARK = re.compile(rb'"finish_reason"\s*:\s*(?:"abort"|\{\s*"type"\s*:\s*"abort")'
                        rb'|"message"\s*:\s*"Abort(?:ed|ed by AbortReq\.| in waiting queue'
                        rb'| before prefill)"|"status"\s*:\s*"cancelled"')
_TAIL = 64  # bytes of the previous pieces kept, so a mark split over two pieces is found


class Confirmation:
    """Watches one request's upstream response after its abort was queued, until a verdict.

    Made by the proxy, armed by the aborter (:meth:`arm`: who hears the verdict; the aborter
    calls :meth:`expire` at the bound), then handed the response
    (:meth:`~sidecar.relay.UpstreamResponse.watch`). ``verdict`` is ``None`` until then one of
    :data:`CONFIRMED`, :data:`FINISHED`, :data:`UNCONFIRMED`; ``decided_at`` its
    ``time.monotonic()``. :meth:`close` gives up without a verdict (the abort was refused, or
    the sidecar stops): the connection is closed at once.
    """

    __slots__ = ("_on_start", "_on_verdict", "_on_wait", "_tail", "aborted", "bound",
                 "decided_at", "late_until", "paused", "pieces", "response", "verdict")

    def __init__(self, response: UpstreamResponse) -> None:
        self.response = response
        self.verdict: str | None = None
        self.decided_at: float | None = None
        self.aborted = False  # the abort mark was seen
        self.pieces = 0  # body pieces the engine sent after the disconnect, read so far
        self.paused = False  # sidecar.relay.Watcher: nobody slow behind it
        self.bound = 0.0  # time.monotonic() of the verdict unconfirmed, unless one came first
        # While waiting for a late start (module docstring): its end (else None: none waited).
        self.late_until: float | None = None
        self._tail = b""
        self._on_verdict: Callable[[str], None] | None = None
        self._on_start: Callable[[], None] | None = None
        self._on_wait: Callable[[], None] | None = None

    def arm(self, on_verdict: Callable[[str], None], bound: float,
            on_start: Callable[[], None] | None = None, late_until: float | None = None,
            on_wait: Callable[[], None] | None = None) -> None:
        """``on_verdict`` is called once with the verdict (not after :meth:`close`), at the
        latest at ``bound`` (``time.monotonic()``), when :meth:`expire` is called: one timer for
        every confirmation (:class:`sidecar.abort.Aborter`'s), not one each, since a storm's
        disconnects arm hundreds in a loop turn. ``late_until``: a stream the engine has sent
        nothing of by then waits for its start until this instead (module docstring);
        ``on_start`` is called when its head comes meanwhile (a stream), ``on_wait`` when the
        wait begins (a JSON answer: nothing it sends before its end tells its start)."""
        self._on_verdict = on_verdict
        self.bound = bound
        self._on_start = on_start
        self.late_until = late_until
        self._on_wait = on_wait

    @property
    def open(self) -> bool:
        """True while no verdict was given and the watch was not closed."""
        return self.verdict is None and self._on_verdict is not None

    @property
    def waiting_start(self) -> bool:
        """True while a late start (or a JSON answer's late registration) is awaited: past its
        first bound, the engine silent."""
        return self.open and self.late_until is not None and self.bound == self.late_until

    # sidecar.relay.Watcher
    def began(self) -> None:
        """The engine began the response after the client left: a stream (its head says
        ``text/event-stream``) waited for as a late start has its ids named again by the aborter
        (``on_start``); a JSON answer's head comes with its end, which decides."""
        if (self.waiting_start and self._on_start is not None
                and is_event_stream(self.response.headers)):
            self._on_start()

    def write(self, piece: bytes) -> None:
        self.pieces += 1
        if self.aborted:
            return
        window = self._tail + piece
        if ABORT_MARK.search(window) is not None:
            self.aborted = True
        else:
            self._tail = window[-_TAIL:]

    def ended(self) -> None:
        if self.open:
            self._decide(CONFIRMED if self.aborted else FINISHED)

    @property
    def held(self) -> bool:
        """True while what the engine sent waits in :class:`sidecar.read_pacer.ReadPacer` because
        clients are still leaving: held (:meth:`read_held` would do now what the pacer does
        soon) or not read at all yet (parked: :meth:`~sidecar.read_pacer.ReadPacer.park`)."""
        return self.open and self.response.connection.reads_held

    @property
    def closing(self) -> bool:
        """True while the engine's close is read but not yet handled, so no verdict yet: uvloop
        closes the transport on reading a FIN or a reset and calls ``connection_lost`` (which
        ends the response: :meth:`ended`) in a later loop step; in between only the transport's
        ``is_closing()`` tells. Seen up to ~11 ms after 300 parked responses were read again at
        once (tests/test_teardown_pacing.py). Longer only if the engine half-closed with request
        bytes still unsent (uvloop waits for its write buffer to drain)."""
        transport = self.response.connection.transport
        return self.open and transport is not None and transport.is_closing()

    @property
    def unread(self) -> bool:
        """True while what the engine sent on the request's upstream connection waits unhandled,
        so it may be the end that confirms: bytes (or the engine's close) in the kernel's
        receive buffer that the event loop has not read yet; bytes a TLS transport took from
        the socket but has not handed to the relay (``get_read_buffer_size()``: it reads on
        while paused); a close read but not handled (:attr:`closing`). One ``poll(2)`` that
        does not wait; an error in asking counts as unread (no miss is counted on a guess).

        Why: after a storm's disconnects an engine's end can wait there across re-sends.
        Measured in ``python -m bench``'s storm (6 storms a run, 500 of 1,000 streams reset,
        one-process engine): a storm that marked the engine as having several API-server
        processes (:data:`sidecar.abort.MULTI_RESENDS`) had 73-168 requests confirmed only
        after their 2nd re-send, every one with its end (266 bytes, ``FIONREAD``) unread in
        the socket at both re-sends, 16-20 ms after the pacer resumed its reading: the loop's
        turns were 10-35 ms long then, and uvloop runs due timers before the turn's poll. In 9
        of 25 runs a later storm's first calls then went 8 wide (a stream named in 8-16
        calls). Not counting those: 0 of 10.
        What waits may also be a token of a stream the calls missed: the aborter counts that
        re-send once the bytes were read and were not the end
        (:meth:`sidecar.abort_queue.Resend.judge`)."""
        if not self.open:
            return False
        transport = self.response.connection.transport
        if transport is None:
            return False
        if transport.is_closing():
            return True
        try:
            buffered = getattr(transport, "get_read_buffer_size", None)
            if buffered is not None and buffered() > 0:
                return True
            sock = transport.get_extra_info("socket")
            if sock is None:
                return False
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def read_held(self) -> None:
        """Parse what the engine sent that the relay holds back while clients leave
        (:class:`sidecar.read_pacer.ReadPacer`), before deciding to re-send: it may be the end."""
        if self.open:
            self.response.connection.relay_held()

    def close(self) -> None:
        """Stop watching without a verdict and close the upstream connection now."""
        # They hold the aborter's request: a cycle.
        self._on_verdict = self._on_start = self._on_wait = None
        self.response.close()

    def expire(self, now: float) -> None:
        """A bound was reached (``now``, within a clock tick of :attr:`bound`, or a bound moved
        later since: then nothing): :data:`UNCONFIRMED` if no verdict came, unless the stream
        is still silent and a late start may be waited for (:attr:`late_until`): then
        :attr:`bound` moves there, and ``on_wait`` is told (:meth:`arm`)."""
        if not self.open or now < self.bound - BOUND_EARLY_S:
            return
        response = self.response
        if (self.late_until is not None and self.bound < self.late_until
                and response.head_bytes == 0 and self.pieces == 0):
            self.bound = self.late_until
            if self._on_wait is not None:
                self._on_wait()
            return
        self._decide(UNCONFIRMED)

    def give_up(self) -> None:
        """Nothing can confirm it any more (a late start that cannot be aborted again):
        :data:`UNCONFIRMED` now, if no verdict came."""
        if self.open:
            self._decide(UNCONFIRMED)

    def _decide(self, verdict: str) -> None:
        self.verdict = verdict
        self.decided_at = time.monotonic()
        self.response.close()  # a no-op for a response read to its end; never left open
        on_verdict, self._on_verdict = self._on_verdict, None
        self._on_start = self._on_wait = None  # they hold the aborter's request: a cycle
        if on_verdict is not None:
            on_verdict(verdict)
