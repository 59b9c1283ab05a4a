"""Races between the three ways a request ends early: a cancel API call, its deadline expiring and
its client disconnecting (a TCP reset), arriving at (nearly) the same time.

Whichever asks first wins, and however they interleave:

- the engine gets exactly one abort call, naming exactly the request's ids, and its connection
  for the request is closed;
- the request is counted once: exactly one of ``cancelled_requests_total``,
  ``deadline_exceeded_total`` and ``client_disconnects_total`` moves, by one, and
  ``requests_total`` moves once (``cancelled`` or ``disconnected``), matching the access line's
  ``cancel_reason`` and ``client_disconnected``;
- the cancel API answers ``200`` if its cancel is the one that ended the request, else ``404``
  (already ending by a deadline or a disconnect), never a 5xx;
- a client still connected gets the winner's own ending (``499``/``504`` JSON before the head,
  the winner's SSE error event and the end of the stream mid-stream), never ``data: [DONE]``;
- nothing raises and nothing logs an error or a traceback.

Each test runs ``ROUNDS`` requests in a row. The deadline races fire the other ending at
``OFFSETS_S`` around the deadline (counted from when the request was written, which the sidecar
reads a fraction of a millisecond later), so early rounds tend to go one way and late rounds the
other; the cancel call and the reset alternate which is written first, in the same event-loop
turn or 1-2 turns apart. The winners are printed (``-s``) and in every failure message. The
cancel call is written on an admin connection opened beforehand, and a reset is ``SO_LINGER`` 0 +
close, so each leaves this process at once, in the loop turn the test chose.

Production wiring (:func:`sidecar.server.start`), the fake engine of :mod:`tests.fakes.engine`,
raw sockets; waits are event-driven with a guard (``WAIT_S``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import pytest

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness import rawhttp
from tests.harness.support import metrics
from tests.test_cancel_api import chat_body

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
QUIET_S = 0.3  # how long to wait for a second abort that must not come (then a settle request)
ROUNDS = 10
DEADLINE_S = 0.2
# When the other ending fires, relative to the deadline (seconds): from clearly before to
# clearly after, most of them within the sidecar's own jitter.
OFFSETS_S = [-0.004, -0.002, -0.001, -0.0005, 0.0, 0.0, 0.0005, 0.001, 0.002, 0.004]
CHAT = "/v1/chat/completions"
LONG = "tokens=1000&interval=0.01"  # ~10 s: streamed, or computed before a non-streaming answer
HEADER = "X-Sidecar-Deadline-S"

CANCEL, DEADLINE, DISCONNECT = "cancel", "deadline", "disconnect"
COUNTERS = {CANCEL: "cancel_sidecar_cancelled_requests_total",
            DEADLINE: "cancel_sidecar_deadline_exceeded_total",
            DISCONNECT: "cancel_sidecar_client_disconnects_total"}
REASONS = {CANCEL: "cancelled via API", DEADLINE: "deadline exceeded", DISCONNECT: None}
STATUS_CLASS = {CANCEL: "cancelled", DEADLINE: "cancelled", DISCONNECT: "disconnected"}
# What a client still connected gets from each sidecar ending: status, error type.
ENDINGS = {CANCEL: (499, "cancelled"), DEADLINE: (504, "deadline_exceeded")}


def error_event(error_type: str) -> bytes:
    message = "request cancelled" if error_type == "cancelled" else "deadline exceeded"
    return b"data: " + json.dumps({"error": {"message": message, "type": error_type,
                                             "param": None, "code": None}}).encode() + b"\n\n"


class AccessLines(logging.Handler):
    """The access lines of ``sidecar.access``, by request id, with a wait for one to appear
    (it is written once the handler is done and the abort has its outcome)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, list[dict[str, Any]]] = {}
        self.written = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(record.__dict__["access"])
        self.lines.setdefault(fields["request_id"], []).append(fields)
        self.written.set()

    async def of(self, request_id: str) -> list[dict[str, Any]]:
        async with asyncio.timeout(WAIT_S):
            while request_id not in self.lines:
                self.written.clear()
                await self.written.wait()
        return self.lines[request_id]


@dataclass
class Race:
    servers: Servers
    engine: FakeEngine
    access: AccessLines

    @property
    def admin_port(self) -> int:
        assert self.servers.admin_port is not None
        return self.servers.admin_port


@pytest.fixture
async def race(engine: FakeEngine, start_sidecar: Callable[..., Any],
               caplog: pytest.LogCaptureFixture) -> AsyncIterator[Race]:
    caplog.set_level(logging.INFO, logger="sidecar.access")
    access = AccessLines()
    logger = logging.getLogger("sidecar.access")
    logger.addHandler(access)
    try:
        yield Race(await start_sidecar(sidecar_settings(engine.url)), engine, access)
    finally:
        logger.removeHandler(access)
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    bad = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in records
           if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], f"expected no error and no traceback logged, got {bad}"


def reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), now."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def ends(race: Race) -> tuple[Counter[str], Counter[str]]:
    """The three early-end counters (summed over labels) and requests_total by status class."""
    values = await metrics(race.admin_port)
    early: Counter[str] = Counter()
    classes: Counter[str] = Counter()
    for (name, labels), value in values.items():
        for kind, counter in COUNTERS.items():
            if name == counter:
                early[kind] += int(value)
        if name == "cancel_sidecar_requests_total":
            classes[dict(labels)["status_class"]] += int(value)
    return early, classes


async def one_round(race: Race, *, stream: bool, deadline: bool, cancel: bool, rst: bool,
                    offset_s: float = 0.0, cancel_first: bool = True, turns: int = 0
                    ) -> tuple[str, bool]:
    """One request ended by the given endings at once (the cancel call and the reset written
    ``turns`` event-loop turns apart, ``cancel_first`` or not); checks every invariant of the
    module docstring. Returns the winner (``cancel``, ``deadline`` or ``disconnect``) and the
    access line's ``client_disconnected``."""
    engine, loop = race.engine, asyncio.get_running_loop()
    early_before, classes_before = await ends(race)
    started = len(engine.record.generations)
    body = chat_body(stream=stream)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if deadline:
        headers.append((HEADER, str(DEADLINE_S)))
    async with asyncio.timeout(WAIT_S), rawhttp.connect(race.admin_port) as (
            admin_reader, admin_writer), rawhttp.connect(race.servers.proxy_port) as (
            reader, writer):
        writer.write(rawhttp.request_bytes("POST", f"{CHAT}?{LONG}", headers, body))
        sent_at = loop.time()
        assert await engine.watch.until(lambda: len(engine.record.generations) > started,
                                        WAIT_S), "expected the engine to start generating"
        request_id = engine.record.generations[started].request_id
        assert request_id is not None
        head = None
        if stream:  # the response has begun: the race happens mid-stream
            head = await rawhttp.read_head(reader)
            assert head.status == 200 and head.chunked, f"expected a chunked 200, got {head}"
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)  # the first event, whole
        if deadline:
            await asyncio.sleep(max(0.0, sent_at + DEADLINE_S + offset_s - loop.time()))
        cancel_call = rawhttp.request_bytes("POST", f"/v1/requests/{request_id}/cancel",
                                            [("Content-Length", "0")])
        triggers: list[tuple[Callable[[], None], bool]] = [
            (lambda: admin_writer.write(cancel_call), cancel), (lambda: reset(writer), rst)]
        wanted = [trigger for trigger, on in triggers if on]
        for n, trigger in enumerate(wanted if cancel_first else wanted[::-1]):
            for _ in range(turns if n else 0):
                await asyncio.sleep(0)  # one event-loop turn
            trigger()
        answer = None
        if cancel:
            answer = await rawhttp.read_body(admin_reader, await rawhttp.read_head(admin_reader),
                                             "POST")
        response = None
        if not rst:
            if head is None:
                head = await rawhttp.read_head(reader)
            response = await rawhttp.read_body(reader, head, "POST")
    lines = await race.access.of(request_id)
    early_after, classes_after = await ends(race)

    moved = early_after - early_before
    what = (f"request {request_id} (stream={stream}, offset {offset_s * 1000:+.1f} ms): "
            f"counters moved {dict(moved)}, access {lines}, cancel API "
            f"{answer and (answer.status, answer.body)}, client "
            f"{response and (response.status, response.ending, response.body[-160:])}")
    assert sum(moved.values()) == 1 and len(moved) == 1, (
        f"expected exactly one early-end counter +1: {what}")
    (winner,) = moved
    assert {CANCEL: cancel, DEADLINE: deadline, DISCONNECT: rst}[winner], (
        f"counted as {winner}, which was not in the race: {what}")
    assert classes_after - classes_before == Counter({STATUS_CLASS[winner]: 1}), (
        f"expected requests_total{{status_class={STATUS_CLASS[winner]}}} +1, got "
        f"{dict(classes_after - classes_before)}: {what}")
    assert len(lines) == 1, f"expected one access line: {what}"
    line = lines[0]
    assert (line["cancel_reason"], line["abort"]) == (REASONS[winner], "confirmed"), (
        f"expected cancel_reason {REASONS[winner]!r} and abort ok: {what}")
    if winner == DISCONNECT:
        assert line["client_disconnected"] is True, f"expected client_disconnected: {what}"

    expected_ids = [f"chatcmpl-{request_id}"]
    gen = engine.record.generations[started]
    assert await engine.watch.until(lambda: gen.stopped_at is not None, WAIT_S), (
        f"expected the engine to stop the request (aborted, or its connection closed): {what}")
    assert not gen.finished, f"the engine must not have finished: {what}"
    # One call, and it stopped the work; a later one may only be a re-send because the engine's
    # end was read late (docs/semantics.md §2d, CONFIRM_WAIT_S), after the stop.
    calls = [a for a in engine.record.aborts if expected_ids[0] in a.ids]
    assert calls and calls[0].ids == expected_ids and gen.aborted_at is not None and all(
        a.ids == expected_ids and a.at >= gen.aborted_at for a in calls[1:]), (
        f"expected one abort call with {expected_ids} that stopped it (aborted at "
        f"{gen.aborted_at}), any other after that: {[(a.at, a.ids) for a in calls]}; {what}")

    if answer is not None:
        phase = "streaming" if stream else "awaiting_response"
        if winner == CANCEL:
            assert (answer.status, json.loads(answer.body)) == (
                200, {"id": request_id, "cancelled": True, "phase": phase}), (
                f"the cancel won: expected 200: {what}")
        else:
            assert answer.status == 404 and json.loads(answer.body)["error"]["type"] == (
                "not_found"), f"the {winner} won: expected the cancel API's 404: {what}"
    if response is not None:
        assert winner in ENDINGS, f"a connected client cannot be a disconnect: {what}"
        status, error_type = ENDINGS[winner]
        assert b"[DONE]" not in response.body, f"no [DONE] after an early end: {what}"
        if stream:
            assert (response.status, response.ending) == (200, "complete"), (
                f"expected the stream ended properly: {what}")
            assert response.body.endswith(error_event(error_type)), (
                f"expected the {winner}'s error event last: {what}")
            assert response.body.count(b'"error"') == 1, f"expected one error event: {what}"
        else:
            assert (response.status, response.ending) == (status, "complete"), (
                f"expected the {winner}'s {status}: {what}")
            assert json.loads(response.body)["error"]["type"] == error_type, what
    return winner, line["client_disconnected"]


async def no_second_abort(race: Race, rounds: int) -> None:
    """After the last round: no abort call arrives within ``QUIET_S`` nor before a full request
    through the sidecar; every abort call named exactly one round's request."""
    record = race.engine.record
    record.abort_event.clear()
    with suppress(TimeoutError):
        await asyncio.wait_for(record.abort_event.wait(), QUIET_S)
    async with asyncio.timeout(WAIT_S):
        settle = await rawhttp.exchange(race.servers.proxy_port,
                                        rawhttp.request_bytes("GET", "/health"))
    assert settle.status == 200, settle
    expected = [[f"chatcmpl-{g.request_id}"] for g in record.generations]
    assert len(expected) == rounds, f"expected {rounds} generations, got {len(expected)}"
    assert [a.ids for a in record.aborts] == expected, (
        f"expected one abort call per round, in order: {expected}, got "
        f"{[a.ids for a in record.aborts]}")


async def run_rounds(race: Race, **kind: Any) -> None:
    """``ROUNDS`` rounds: the deadline offsets sweep ``OFFSETS_S``; the cancel call and the
    reset alternate which goes first, written in the same turn, then 1 and 2 turns apart."""
    winners: Counter[tuple[str, bool]] = Counter()
    for i in range(ROUNDS):
        winners[await one_round(race, offset_s=OFFSETS_S[i], cancel_first=i % 2 == 0,
                                turns=i // 2 % 3, **kind)] += 1
    await no_second_abort(race, ROUNDS)
    print(f"\n{kind}: (winner, client_disconnected) {dict(winners)}")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
async def test_cancel_api_racing_the_deadline(race: Race, stream: bool) -> None:
    await run_rounds(race, stream=stream, deadline=True, cancel=True, rst=False)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
async def test_disconnect_racing_a_cancel_api_call(race: Race, stream: bool) -> None:
    await run_rounds(race, stream=stream, deadline=False, cancel=True, rst=True)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
async def test_disconnect_racing_the_deadline(race: Race, stream: bool) -> None:
    await run_rounds(race, stream=stream, deadline=True, cancel=False, rst=True)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
async def test_disconnect_cancel_and_deadline_at_once(race: Race, stream: bool) -> None:
    await run_rounds(race, stream=stream, deadline=True, cancel=True, rst=True)
