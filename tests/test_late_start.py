"""A late start: vLLM registers a request later than every re-send, and the stream's own start
sends the abort again (``engines.*.abort.late_start_s``, :mod:`sidecar.confirm`).

vLLM sends a chat or completions stream's first byte only once it registered the request, and it
can register one seconds after its body (a real vLLM under a burst of 15 long prompts registered
one more than 2 s after its body: the registration window and the confirmation's bound had
passed, its upstream was closed, and behind a disconnect-hiding layer it ran for nobody). The
fake of ``tests/fakes/kinds.py`` does the same (``register_delay``; blind to its connections:
only an abort stops it). Every "stopped" is read at the engine (``Work``), never from the sidecar.

Settings: registration window and confirmation bound 0.3 s each, the engine registering 1.0 s
after the body (late), the client gone 50 ms after its last body byte, before any response byte.

- ``test_a_request_registered_late_stops_once_registered[stream-*]`` (1 and 4 API-server
  processes): stopped at the engine within ``STARTED_ABORT_S`` of its registration,
  ``confirmed``; with ``late_start_s: 0`` the same request runs to its end
  (``test_without_late_start_a_late_request_runs_on``: the case this covers fails without);
- ``test_a_late_start_has_calls_of_its_own``: ``max_calls: 3``, all spent inside the first bound
  (as an engine marked as having several API-server processes spends 64, 8 at a time): the late
  start still names the ids, and the stream stops (before: it ran to its end, ``finished``);
- ``test_a_request_registered_late_stops_once_registered[JSON-*]`` (1 and 4 API-server
  processes): a JSON chat sends nothing until its whole answer, so nothing tells its start; it is
  watched on all the same while its ids are re-sent at doubling gaps, widening: stopped at the
  engine within as long again as it registered after the bound (plus a guard), ``confirmed``;
  with ``late_start_s: 0`` its upstream closes at the bound and it runs to its end
  (``test_without_late_start_a_late_request_runs_on``);
- ``test_a_json_wait_that_spent_its_calls_ends_unconfirmed``: ``max_calls: 3``, spent by the
  wait's first two re-sends: ``unconfirmed`` at the third's due, the upstream closed then;
- ``test_a_request_whose_body_was_not_kept`` (stream, JSON; ``replay_buffer_bytes`` under the
  body, so no copy says ``"stream": true``): the stream is still stopped within
  ``STARTED_ABORT_S`` of its registration as a late start (its head says ``text/event-stream``;
  a reviewer's find: it took the JSON wait and ran to the next re-send), the JSON request by
  the wait's re-sends, and not counted as a late start;
- ``test_a_start_later_than_late_start_s_is_unconfirmed``: the wait ends at ``late_start_s``
  after the disconnect, upstream closed then, outcome ``unconfirmed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.server import Servers
from tests.fakes.kinds import VLLMEngine, Work
from tests.harness.support import (
    FOREVER,
    Stalls,
    metrics,
    ms,
    raw_client,
    request_body,
    sample,
    wait_metric,
)
from tests.test_confirmed_aborts import deploy as deploy_fake
from tests.test_confirmed_aborts import fakes

__all__ = ["fakes"]  # a fixture shared with tests/test_confirmed_aborts.py

pytestmark = pytest.mark.timeout(120)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BOUND_S = 0.3  # resend_window_s and confirm_timeout_s
REGISTER_S = 1.0  # body -> registered: after the bound
GEN = "tokens=150&interval=0.02"  # 3 s once registered: a missed abort shows as ran_to_end
LEFT_S = 0.05  # last body byte -> the client's RST
STARTED_ABORT_S = 0.5  # registered -> stopped: one round trip on an idle box; a guard bound


async def deploy(fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], processes: int,
                 upstream: dict[str, Any] | None = None,
                 **abort: Any) -> tuple[VLLMEngine, Servers]:
    """:func:`tests.test_confirmed_aborts.deploy` with this module's window and bound."""
    return await deploy_fake(fakes, start_sidecar, processes, upstream,
                             resend_window_s=BOUND_S, confirm_timeout_s=BOUND_S, **abort)


async def leave_early(fake: VLLMEngine, servers: Servers, stalls: Stalls, stream: bool,
                      register_s: float = REGISTER_S) -> tuple[Work, float]:
    """A chat request whose client resets ``LEFT_S`` after its body, before any response byte;
    returns its work at the engine and the client's close time."""
    async with raw_client(servers.proxy_port, stalls) as c:
        c.send("POST", f"/v1/chat/completions?{GEN}&register_delay={register_s}",
               request_body({**CHAT, "tag": "late"}, stream))
        await stalls.wait(fake.watch.until(lambda: bool(fake.works), FOREVER),
                          "the engine to get the body")
        await asyncio.sleep(LEFT_S)
        left = c.disconnect("rst")
    work = fake.works[-1]
    assert work.registered_at is None, f"registered before the client left: {work}"
    return work, left


async def stopped_once_registered(fake: VLLMEngine, servers: Servers, stalls: Stalls,
                                  stream: bool, register_s: float = REGISTER_S) -> None:
    """A request registered ``register_s`` after its body (after the bound), its client gone
    before its first byte: stopped at the engine once registered (a stream within
    ``STARTED_ABORT_S`` of its registration: its head starts it; a JSON request within as long
    again as it registered into the wait, plus that guard: a re-send of the wait), the calls
    before ignored, ``confirmed``, and counted as a late start only if a stream."""
    work, left = await leave_early(fake, servers, stalls, stream=stream, register_s=register_s)
    await stalls.wait(fake.watch.until(lambda: not work.running, FOREVER),
                      "the late request stopped at the engine", 10.0)
    registered = work.registered_at
    assert registered is not None and registered - left > BOUND_S, (
        f"expected it registered after the bound: {work}")
    assert not work.ran_to_end and work.stopped_at is not None, f"it ran on: {work}"
    late = registered - left - BOUND_S  # into the wait
    within = STARTED_ABORT_S if stream else late + STARTED_ABORT_S
    assert work.stopped_at - registered <= within, (
        f"stopped {ms(work.stopped_at - registered)} after its registration, "
        f"{ms(late)} into the wait, expected within {ms(within)}: {work}")
    assert work.ignored, "expected the calls before the registration to be ignored (the case)"
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="confirmed")
    values = await metrics(servers.admin_port or 0)
    assert sample(values, "cancel_sidecar_aborted_requests_total", engine="local",
                  outcome="unconfirmed") == 0
    assert sample(values, "cancel_sidecar_abort_late_starts_total",
                  engine="local") == int(stream)


@pytest.mark.parametrize("processes", [1, 4])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "JSON"])
async def test_a_request_registered_late_stops_once_registered(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls,
        processes: int, stream: bool) -> None:
    """A stream's head says it registered: its ids go again then (a late start). A JSON
    answer's first byte comes with its end, so nothing says when the engine registers it:
    watched on past the bound, its ids re-sent meanwhile at doubling gaps, and its answer, cut
    short with the abort mark, confirms it (not a late start: nothing started)."""
    fake, servers = await deploy(fakes, start_sidecar, processes, late_start_s=5.0)
    await stopped_once_registered(fake, servers, stalls, stream)


async def test_a_late_start_has_calls_of_its_own(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    fake, servers = await deploy(fakes, start_sidecar, 1, late_start_s=5.0, max_calls=3)
    work, _ = await leave_early(fake, servers, stalls, stream=True)
    await stalls.wait(fake.watch.until(lambda: not work.running, FOREVER),
                      "the late stream stopped at the engine", 10.0)
    engine_id = work.engine_ids[0]
    before = [c for c in fake.calls if engine_id in c.ids and c.at < (work.registered_at or 0)]
    assert len(before) == 3, f"expected max_calls (3) calls before the registration: {before}"
    assert not work.ran_to_end and work.stopped_at is not None, f"it ran on: {work}"
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="confirmed")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "JSON"])
async def test_without_late_start_a_late_request_runs_on(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls,
        stream: bool) -> None:
    """``late_start_s: 0``: unconfirmed at the bound, the upstream closed, and the blind engine
    runs the request for nobody: what the test above covers."""
    fake, servers = await deploy(fakes, start_sidecar, 1, late_start_s=0)
    work, left = await leave_early(fake, servers, stalls, stream=stream)
    await stalls.wait(fake.watch.until(lambda: work.closed_at is not None, FOREVER),
                      "the upstream closed at the bound")
    assert work.closed_at is not None and work.closed_at - left < REGISTER_S, work
    await stalls.wait(fake.watch.until(lambda: not work.running, FOREVER),
                      "the request to end at the engine", 10.0)
    assert work.ran_to_end, f"expected it to run to its end for nobody: {work}"
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="unconfirmed")


async def test_a_json_wait_that_spent_its_calls_ends_unconfirmed(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """``max_calls: 3``: the wait's re-sends at bound + 0.2 s (one call) and + 0.6 s (two)
    spend it; at the next due (+ 1.4 s) nothing more can stop the request, so it is
    unconfirmed and its upstream closed then, not kept open to ``late_start_s`` (5 s)."""
    fake, servers = await deploy(fakes, start_sidecar, 1, late_start_s=5.0, max_calls=3)
    work, left = await leave_early(fake, servers, stalls, stream=False, register_s=3.0)
    await stalls.wait(fake.watch.until(lambda: work.closed_at is not None, FOREVER),
                      "the upstream closed once the wait's calls were spent", 10.0)
    assert work.closed_at is not None
    waited = work.closed_at - left
    assert BOUND_S + 1.2 <= waited < BOUND_S + 2.5, (
        f"the upstream was closed {ms(waited)} after the client left, expected ~"
        f"{ms(BOUND_S + 1.4)} (the wait's third re-send due)")
    engine_id = work.engine_ids[0]
    waits = [c for c in fake.calls if engine_id in c.ids and c.at > left + BOUND_S]
    assert len(waits) == 3, f"expected the wait's 3 calls (1, then 2): {waits}"
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="unconfirmed")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "JSON"])
async def test_a_request_whose_body_was_not_kept(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls,
        stream: bool) -> None:
    """``upstream.replay_buffer_bytes`` under the body: no copy says ``"stream": true``, so
    before its head a stream looks like a JSON request. Registered 2 s after the body (well
    into the wait): a stream is still a late start (stopped within ``STARTED_ABORT_S`` of its
    registration, counted), a JSON request is stopped by the wait's re-sends (its head, with
    its end, is no start: not counted)."""
    fake, servers = await deploy(fakes, start_sidecar, 1, {"replay_buffer_bytes": 16},
                                 late_start_s=5.0)
    await stopped_once_registered(fake, servers, stalls, stream, register_s=2.0)


async def test_a_start_later_than_late_start_s_is_unconfirmed(
        fakes: list[VLLMEngine], start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """The wait for a start ends ``late_start_s`` after the disconnect: upstream closed then
    (not at the bound, not later), outcome unconfirmed."""
    fake, servers = await deploy(fakes, start_sidecar, 1, late_start_s=1.0)
    work, left = await leave_early(fake, servers, stalls, stream=True, register_s=3.0)
    await stalls.wait(fake.watch.until(lambda: work.closed_at is not None, FOREVER),
                      "the upstream closed at late_start_s")
    assert work.closed_at is not None
    waited = work.closed_at - left
    assert 0.9 <= waited < 2.5, (
        f"the upstream was closed {ms(waited)} after the client left, expected ~1 s "
        f"(late_start_s)")
    await wait_metric(stalls, servers.admin_port or 0, "cancel_sidecar_aborted_requests_total",
                      1, engine="local", outcome="unconfirmed")
