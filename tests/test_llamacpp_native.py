"""The ``openai`` kind in front of llama.cpp's own C++ server (what ``llama-server`` runs), as the
``xllamacpp`` wheel bundles it (:mod:`tests.harness.llamacpp_native_server`).

The same tiny GGUF model, tap and sidecar as ``tests/test_llamacpp.py`` (llama-cpp-python's
Python server; :mod:`tests.harness.llamacpp_support`), one slot, one thread. What the server does
after a disconnect is read from its side: its process's CPU seconds, how long the next request waits
(one slot: a server still generating makes it wait), its ``/metrics`` (``llamacpp:n_decode_total``:
one ``llama_decode`` call per generated token with one slot busy), its ``/slots``
(``is_processing``, ``n_decoded``) and its log (``stop: cancel task, id_task = N`` when it drops
a request).

Measured with xllamacpp 2026.10.11549: the server stops. A stream is cancelled at its next
write (a token or two after the close). A non-streaming request is cancelled by the HTTP
thread waiting for its result, which checks the connection only when a 1-second wait for a
result of *any* task times out (llama.cpp's ``server_response::recv_with_timeout`` restarts the
wait on every result it is woken for): alone on the server it stops within ~1 s of the close,
but while another request streams (or anything polls ``/slots`` or ``/metrics`` more than once
a second) it runs on. So the single-slot tests read nothing from the server between the close
and the end of the watch window.

Runs under the interpreter named by ``CANCEL_SIDECAR_LLAMA_PYTHON`` (``make test-llamacpp``
installs ``xllamacpp`` into ``.venv-llama`` beside llama-cpp-python), else this one; one so named
that cannot import ``xllamacpp`` and ``gguf`` fails every test here. Marker ``llamacpp``.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.harness.llamacpp_support import (
    BASELINE,
    LLAMA_PY,
    LLAMA_REQUIRED,
    ROOT,
    WATCH_S,
    ServerProcess,
    Tap,
    TapConnection,
    chat,
    check_relayed_byte_for_byte,
    cpu_over,
    disconnect,
    free_port,
    interpreter_problem,
    leave_long_request,
    next_request_s,
    serving,
    sidecar_in_front,
    tapping,
    write_model,
)

LONG = 4000  # max_tokens of a generation the client leaves (~30 s here: 3 ms a token, then 8)
LONG_TWO_SLOTS = 1900  # the same on the two-slot server (2048 tokens of context per slot)
# How long the server may go on generating after the sidecar closed the connection: a stream
# stops at its next write; a JSON request at the next 1-second tick of its handler's wait.
STOP_WITHIN_S = {True: 0.5, False: 1.5}
# The server's log lines that start and cancel a task, with its own clock (minutes.seconds.
# milliseconds.microseconds since it started): "0.13.543.323 I slot launch_slot_: id  0 |
# task 59 | processing task, ..." and "0.49.901.463 W srv          stop: cancel task,
# id_task = 4060".
LOG_TIME = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) "
LAUNCH_LINE = re.compile(LOG_TIME + r"I slot launch_slot_: id +\d+ \| task (\d+) \|", re.M)
CANCEL_LINE = re.compile(LOG_TIME + r"W srv +stop: cancel task, id_task = (\d+)$", re.M)

LLAMA_PROBLEM = interpreter_problem("xllamacpp, gguf, numpy")

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(LLAMA_PROBLEM is not None and not LLAMA_REQUIRED, reason=(
        f"{LLAMA_PY} cannot import xllamacpp and gguf (make test-llamacpp installs them; "
        "or set CANCEL_SIDECAR_LLAMA_PYTHON to an interpreter that can)")),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if LLAMA_PROBLEM is not None:  # only reached when CANCEL_SIDECAR_LLAMA_PYTHON names it
        pytest.fail(f"CANCEL_SIDECAR_LLAMA_PYTHON names an unusable interpreter: {LLAMA_PROBLEM}")
    return write_model(tmp_path_factory.mktemp("llamacpp-native"))


def _native(model: Path, slots: int) -> Iterator[ServerProcess]:
    port = free_port()
    with serving([LLAMA_PY, "-m", "tests.harness.llamacpp_native_server", str(model), str(port),
                  str(slots)], port, model.parent / f"server-{slots}-slots.log",
                 cwd=ROOT) as running:
        yield running


@pytest.fixture(scope="module")
def native(model: Path) -> Iterator[ServerProcess]:
    """llama.cpp's server with one slot."""
    yield from _native(model, 1)


@pytest.fixture(scope="module")
def native_two_slots(model: Path) -> Iterator[ServerProcess]:
    """llama.cpp's server with two slots: two requests generate at once."""
    yield from _native(model, 2)


@pytest_asyncio.fixture
async def tap(native: ServerProcess) -> AsyncIterator[Tap]:
    async with tapping(native) as relay:
        yield relay


@pytest_asyncio.fixture
async def proxy(tap: Tap) -> AsyncIterator[str]:
    """The sidecar in front of the one-slot server (through the tap); its base URL."""
    async with sidecar_in_front(tap) as url:
        yield url


@pytest_asyncio.fixture
async def tap_two_slots(native_two_slots: ServerProcess) -> AsyncIterator[Tap]:
    async with tapping(native_two_slots) as relay:
        yield relay


async def _metrics(session: aiohttp.ClientSession, server: ServerProcess) -> dict[str, float]:
    """The server's ``/metrics`` samples (``llamacpp:*``), read from the server directly."""
    async with session.get(f"{server.url}/metrics") as resp:
        text = await resp.text()
    assert resp.status == 200, f"expected /metrics, got {resp.status}: {text[:300]}"
    return {name: float(value) for name, value in
            (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


async def _slots(session: aiohttp.ClientSession, server: ServerProcess) -> list[dict[str, Any]]:
    """The server's ``/slots``: one object per slot."""
    async with session.get(f"{server.url}/slots") as resp:
        slots: list[dict[str, Any]] = await resp.json()
    return slots


def _log_times(server: ServerProcess, line: re.Pattern[str]) -> dict[int, float]:
    """Task id -> when the server logged ``line`` for it (seconds on the server's clock)."""
    return {int(task): int(m) * 60 + int(sec) + int(ms) / 1e3 + int(us) / 1e6
            for m, sec, ms, us, task in line.findall(server.output())}


def _ran_on_s(server: ServerProcess, task: int, conn: TapConnection) -> float:
    """Seconds the server kept ``task`` after the sidecar closed its connection ``conn``: the
    time from its launch to its cancel on the server's clock, less the time from the request to
    the close on ours (the server launches a task within milliseconds of its request)."""
    held_s = _log_times(server, CANCEL_LINE)[task] - _log_times(server, LAUNCH_LINE)[task]
    assert conn.client_closed_at is not None
    return held_s - (conn.client_closed_at - conn.sent_at)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_native_answers_relay_byte_for_byte(proxy: str, tap: Tap, stream: bool) -> None:
    await check_relayed_byte_for_byte(proxy, tap, stream)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_native_disconnect_closes_upstream_at_once_and_the_server_stops(
        native: ServerProcess, proxy: str, tap: Tap, stream: bool) -> None:
    """Measured (xllamacpp 2026.10.11549, one slot): the server cancels the request the client
    left, streaming or not, within ``STOP_WITHIN_S`` of the close (its log's clock), is idle for
    the rest of the window, and answers the next request as an idle server does."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        idle_next_s = await next_request_s(proxy, session)  # the next request's time when idle
        decoded_before = (await _metrics(session, native))["llamacpp:n_decode_total"]
        cancelled_before = set(_log_times(native, CANCEL_LINE))
        left = await leave_long_request(native, proxy, tap, session, LONG, stream)
        # Nothing reaches the server in this window: a /slots or /metrics answer would wake
        # a JSON request's handler and put off its connection check (module docstring).
        used = await cpu_over(native, WATCH_S)
        decoded = (await _metrics(session, native))["llamacpp:n_decode_total"] - decoded_before
        slot = (await _slots(session, native))[0]
        next_at = time.monotonic()
        next_s = await next_request_s(proxy, session)

    cancelled = sorted(set(_log_times(native, CANCEL_LINE)) - cancelled_before)
    ran_on_s = _ran_on_s(native, cancelled[0], left.conn) if len(cancelled) == 1 else None
    generated = round(decoded) - BASELINE  # the baseline request's tokens came first
    # A stream: the role chunk, then one event per token, as far as the server got before the
    # close. A JSON answer sends nothing until the end.
    sent = left.conn.from_server.count(b"data: ") - 1 if stream else 0
    next_limit_s = idle_next_s + 0.5
    # The baseline's tokens are the fastest (each later one attends over a longer context), so
    # a server that ran on would still be generating LONG for at least this long:
    run_on_s = LONG * left.per_token_s - (next_at - left.sent_at)
    print(f"llama.cpp native {'stream' if stream else 'JSON'}: generating costs "
          f"{left.rate:.2f} CPU s/s, {left.per_token_s * 1000:.1f} ms/token; upstream closed "
          f"{left.close_s * 1000:.1f} ms after the disconnect; the server cancelled tasks "
          f"{cancelled}, "
          f"{'-' if ran_on_s is None else f'{ran_on_s * 1000:.0f} ms'} after the close, having "
          f"generated {generated} of {LONG} tokens ({sent} sent before the close); server CPU "
          f"in the {WATCH_S:g} s after: {used:.2f} s; next request answered in "
          f"{next_s * 1000:.0f} ms (idle: {idle_next_s * 1000:.0f} ms; a run-on would have "
          f"made it wait > {run_on_s:.1f} s)", file=sys.stderr)
    assert run_on_s > 2 * next_limit_s, (
        f"expected {LONG} tokens to outlast the window and the next request's limit at "
        f"{left.per_token_s * 1000:.1f} ms a token (else these checks could not tell a run-on), "
        f"got {run_on_s:.1f} s left")
    assert left.close_s < 0.5, f"expected the upstream closed at once, got {left.close_s:.3f} s"
    assert ran_on_s is not None and ran_on_s < STOP_WITHIN_S[stream], (
        f"expected the server's log to say it cancelled the task the client left within "
        f"{STOP_WITHIN_S[stream]} s of the close, got tasks {cancelled}, {ran_on_s} s")
    assert not slot["is_processing"], f"expected the slot idle after the window, got {slot}"
    assert used < 0.5 * left.rate * WATCH_S, (
        f"expected the server mostly idle after the close (< 50% of {left.rate * WATCH_S:.2f} "
        f"CPU s in {WATCH_S:g} s), got {used:.2f} CPU s")
    assert 0 <= generated < LONG, f"expected fewer than {LONG} tokens generated, got {generated}"
    if stream:
        assert generated - sent <= STOP_WITHIN_S[stream] / left.per_token_s, (
            f"expected at most {STOP_WITHIN_S[stream]} s of tokens after the close, got "
            f"{generated - sent} beyond the {sent} sent")
    assert next_s < next_limit_s, (
        f"expected the next request answered as on an idle server (< {next_limit_s:.2f} s), "
        f"got {next_s:.2f} s")


async def _read_all(resp: aiohttp.ClientResponse) -> None:
    async for _ in resp.content.iter_any():
        pass


async def test_native_json_disconnect_goes_unnoticed_while_another_request_streams(
        native_two_slots: ServerProcess, tap_two_slots: Tap) -> None:
    """Measured (xllamacpp 2026.10.11549, two slots): a JSON request whose client left runs on
    while another request streams, and is cancelled only ~1 s after that stream ends: the
    streaming request's results keep waking the waiting handler, so its 1-second wait never
    times out and it never checks its connection."""
    server, tap = native_two_slots, tap_two_slots
    async with sidecar_in_front(tap) as proxy, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=180)) as session:
        streaming = await session.post(f"{proxy}/v1/chat/completions",
                                       json=chat(LONG_TWO_SLOTS, True))
        reader = asyncio.ensure_future(_read_all(streaming))
        try:
            left = await disconnect(proxy, tap, session, LONG_TWO_SLOTS, stream=False)
            await asyncio.sleep(WATCH_S)  # watching a fixed window, not waiting for an event
            slots = await _slots(session, server)
        finally:
            streaming.close()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        by_mode = {slot["params"]["stream"]: slot for slot in slots if slot["is_processing"]}
        assert set(by_mode) == {True, False}, (
            f"expected both requests generating {WATCH_S:g} s after the JSON client left (the "
            f"JSON one unnoticed), got {[(s['id_task'], s['is_processing']) for s in slots]}")
        json_task_id, stream_task_id = by_mode[False]["id_task"], by_mode[True]["id_task"]
        # The log, not /slots: polling the server would itself keep the handler's wait awake.
        for _ in range(100):  # up to 5 s
            if json_task_id in _log_times(server, CANCEL_LINE):
                break
            await asyncio.sleep(0.05)  # a file has no event to await
    cancel_at = _log_times(server, CANCEL_LINE)
    after_stream_s = (cancel_at[json_task_id] - cancel_at[stream_task_id]
                      if {json_task_id, stream_task_id} <= set(cancel_at) else None)
    ran_on_s = _ran_on_s(server, json_task_id, left.conn) if json_task_id in cancel_at else None
    print(f"llama.cpp native, two slots: the JSON request's upstream closed "
          f"{left.close_s * 1000:.1f} ms after its client left; {WATCH_S:g} s later it was "
          f"still generating ({by_mode[False]['next_token'][0]['n_decoded']} of "
          f"{LONG_TWO_SLOTS} tokens) beside the stream; the server cancelled it "
          f"{'never' if ran_on_s is None else f'{ran_on_s:.2f} s'} after its close, "
          f"{'-' if after_stream_s is None else f'{after_stream_s:.2f} s'} after the stream's "
          f"client left", file=sys.stderr)
    assert left.close_s < 0.5, f"expected the upstream closed at once, got {left.close_s:.3f} s"
    assert after_stream_s is not None and after_stream_s < 2.0, (
        f"expected the JSON request cancelled within 2 s of the stream's cancel (once no other "
        f"request streams), got {after_stream_s}; log tail:\n{server.output()[-2000:]}")
