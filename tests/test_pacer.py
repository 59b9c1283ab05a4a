"""The pacing of what follows lost connections (:class:`sidecar.downstream.TeardownPacer`), and
of the engines' reads held meanwhile (:class:`sidecar.read_pacer.ReadPacer`), turn by turn, on a
real uvloop event loop.

A turn right after one in which connections were lost, or within ``hold_s`` of the last loss
(clients still leaving), is busy: it runs at most ``follow_ups_per_busy_turn`` follow-ups (the
engine-side shutdowns) and ``per_busy_turn`` teardowns, so that the aborts of the disconnects
still arriving go first. A quiet turn runs every follow-up waiting and up to ``per_turn``
teardowns. The turn-by-turn tests set ``hold_s=0`` (busy only in the turn after a loss); the
hold is tested on its own. The end to end effect
(abort latency in a storm) is measured by ``python -m bench``; these tests pin the policy.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, cast

from sidecar.downstream import DownstreamHandler, TeardownPacer
from sidecar.read_pacer import HOLD_S, ReadPacer
from sidecar.relay import UpstreamConnection


class Handler:
    """Stands for a :class:`DownstreamHandler`: records its teardown."""

    def __init__(self, name: str, done: list[str]) -> None:
        self.name = name
        self.done = done

    def torn_down(self, exc: BaseException | None) -> None:
        self.done.append(self.name)


def lose(pacer: TeardownPacer, count: int, done: list[str], tag: str) -> None:
    """``count`` lost connections, each with its shutdown follow-up, as the proxy does them."""
    for i in range(count):
        pacer.follow_up(partial(done.append, f"{tag}-end-{i}"))
        pacer.defer(cast(DownstreamHandler, Handler(f"{tag}-teardown-{i}", done)), None)


async def one_turn() -> None:
    await asyncio.sleep(0)  # the pacer's turn was queued first: it runs, then this task


def counts(done: list[str], since: int) -> tuple[int, int]:
    new = done[since:]
    return sum("-end-" in d for d in new), sum("-teardown-" in d for d in new)


async def test_after_a_burst_one_busy_turn_then_quiet_ones() -> None:
    pacer = TeardownPacer(hold_s=0)
    done: list[str] = []
    lose(pacer, 40, done, "a")
    seen: list[tuple[int, int]] = []
    for _ in range(5):
        before = len(done)
        await one_turn()
        seen.append(counts(done, before))
    assert seen == [(4, 1), (36, 16), (0, 16), (0, 7), (0, 0)], (
        f"expected a busy turn (4 shutdowns, 1 teardown), then quiet ones (every shutdown, 16 "
        f"teardowns each), got (shutdowns, teardowns) per turn {seen}")
    ends = [d for d in done if "-end-" in d]
    teardowns = [d for d in done if "-teardown-" in d]
    assert ends == [f"a-end-{i}" for i in range(40)], f"expected oldest first, got {ends}"
    assert teardowns == [f"a-teardown-{i}" for i in range(40)], (
        f"expected oldest first, got {teardowns}")


async def test_while_clients_keep_leaving_every_turn_is_busy() -> None:
    pacer = TeardownPacer(hold_s=0)
    done: list[str] = []
    seen: list[tuple[int, int]] = []
    for turn in range(6):
        lose(pacer, 10, done, f"t{turn}")  # more clients leave before each turn
        before = len(done)
        await one_turn()
        seen.append(counts(done, before))
    assert seen == [(4, 1)] * 6, (
        f"expected every turn busy while clients keep leaving (4 shutdowns, 1 teardown), got "
        f"{seen}")
    before = len(done)
    await one_turn()
    assert counts(done, before) == (60 - 24, 16), (
        f"expected the first quiet turn to run every shutdown left and 16 teardowns, got "
        f"{counts(done, before)}")


async def test_turns_stay_busy_for_hold_s_after_the_last_loss() -> None:
    """A storm's resets come in bursts, one per poll of the sockets: a turn between two bursts
    stays busy for ``hold_s`` after the last loss (4 follow-ups at most, not all), then turns
    are quiet (every follow-up)."""
    pacer = TeardownPacer()
    assert pacer.hold_s == HOLD_S, "expected the teardowns held as long as the engines' reads"
    loop = asyncio.get_running_loop()
    done: list[str] = []
    lose(pacer, 2, done, "a")
    lost_at = loop.time()
    await one_turn()
    await one_turn()
    assert counts(done, 0) == (2, 2), f"expected both lost connections handled, got {done}"
    for i in range(10):  # follow-ups alone: no client left in the turn before
        pacer.follow_up(partial(done.append, f"b-end-{i}"))
    before = len(done)
    await one_turn()
    if loop.time() - lost_at < HOLD_S:  # else the loop stalled past the hold: nothing to judge
        assert counts(done, before) == (4, 0), (
            f"expected a busy turn within hold_s of the last loss (4 follow-ups), got "
            f"{counts(done, before)}")
    await asyncio.sleep(HOLD_S + 0.005)  # uvloop's timers count milliseconds
    for i in range(10):
        pacer.follow_up(partial(done.append, f"c-end-{i}"))
    before = len(done)
    await one_turn()
    assert counts(done, before) == (10, 0), (
        f"expected a quiet turn once hold_s passed (all 10 follow-ups), got "
        f"{counts(done, before)}")


async def test_follow_ups_alone_run_in_the_next_turn() -> None:
    """A follow-up with no lost connection in the turn before (nothing deferred) is not held."""
    pacer = TeardownPacer()
    done: list[Any] = []
    for i in range(10):
        pacer.follow_up(partial(done.append, i))
    await one_turn()
    assert done == list(range(10)), f"expected all 10 follow-ups in the next turn, got {done}"


async def test_a_failing_follow_up_does_not_stop_the_others() -> None:
    pacer = TeardownPacer()
    done: list[str] = []

    def broken() -> None:
        raise RuntimeError("a sidecar bug")

    pacer.follow_up(broken)
    pacer.follow_up(lambda: done.append("after"))
    await one_turn()
    assert done == ["after"], f"expected the next follow-up to run, got {done}"


# --- the engines' reads held while clients leave (sidecar.read_pacer.ReadPacer) -----------------

class HeldReads:
    """Stands for an :class:`UpstreamConnection` with reads held: records their relay (or
    raises, if ``broken``) and its close."""

    def __init__(self, name: str, done: list[str], broken: bool = False,
                 watched: bool = False) -> None:
        self.name = name
        self.done = done
        self.broken = broken
        self.queued = False
        self.watched = watched  # read for an abort's confirmation: its client left

    def relay_held(self) -> bool:
        if self.broken:
            raise RuntimeError("a sidecar bug")
        self.done.append(self.name)
        return True

    def close(self) -> None:
        self.done.append(f"{self.name} closed")


def held(reads: ReadPacer, count: int, done: list[str], tag: str, watched: bool = False) -> None:
    for i in range(count):
        reads.wait(cast(UpstreamConnection, HeldReads(f"{tag}-{i}", done, watched=watched)))


async def test_reads_wait_two_per_busy_turn_then_sixteen_per_quiet_turn() -> None:
    reads = ReadPacer()
    done: list[str] = []
    reads.hold()  # a client left: this turn is busy
    held(reads, 40, done, "a")
    seen = []
    for _ in range(5):
        before = len(done)
        await one_turn()
        seen.append(len(done) - before)
    assert seen == [2, 16, 16, 6, 0], (
        f"expected a busy turn (2 connections' reads), then quiet ones (16), got {seen}")
    assert done == [f"a-{i}" for i in range(40)], f"expected oldest first, got {done}"


async def test_reads_for_a_confirmation_wait_for_a_quiet_turn() -> None:
    """Reads of responses whose client left (an abort's confirmation reads them) are relayed
    only in turns no client left in; the streams that go on keep their two per busy turn."""
    reads = ReadPacer()
    done: list[str] = []
    held(reads, 20, done, "w", watched=True)
    held(reads, 6, done, "a")
    seen = []
    for _ in range(3):
        reads.hold()  # another client leaves before each turn
        before = len(done)
        await one_turn()
        seen.append(done[before:])
    assert seen == [["a-0", "a-1"], ["a-2", "a-3"], ["a-4", "a-5"]], (
        f"expected only the live streams' reads, 2 per busy turn, got {seen}")
    await one_turn()  # quiet: 16 of the watched
    await one_turn()
    assert done[6:] == [f"w-{i}" for i in range(20)], (
        f"expected the watched reads in quiet turns, oldest first, got {done[6:]}")


async def test_while_clients_keep_leaving_reads_wait_two_per_turn() -> None:
    reads = ReadPacer()
    done: list[str] = []
    held(reads, 30, done, "a")
    seen = []
    for _ in range(5):
        reads.hold()  # another client leaves before each turn
        before = len(done)
        await one_turn()
        seen.append(len(done) - before)
    assert seen == [2] * 5, f"expected 2 per turn while clients keep leaving, got {seen}"


async def test_holding_ends_hold_s_after_the_last_client_left() -> None:
    reads = ReadPacer()
    assert not reads.holding
    loop = asyncio.get_running_loop()
    reads.hold()
    first = loop.time()
    await asyncio.sleep(HOLD_S * 0.8)
    reads.hold()  # another client: the hold runs HOLD_S from this one
    await asyncio.sleep(HOLD_S * 0.4)  # past the first hold's end, within the second's
    if loop.time() < reads.until - 0.002:  # a stalled loop cannot tell; only then checked
        assert loop.time() > first + HOLD_S and reads.holding, (
            "expected reads still held within HOLD_S of the last hold, past the first's")
    await asyncio.sleep(HOLD_S + 0.005)  # uvloop's timers count milliseconds
    assert not reads.holding, "expected the hold over HOLD_S after the last client left"


async def test_a_failing_relay_closes_its_connection_and_the_others_go_on() -> None:
    reads = ReadPacer()
    done: list[str] = []
    reads.wait(cast(UpstreamConnection, HeldReads("broken", done, broken=True)))
    held(reads, 3, done, "a")
    await one_turn()
    assert done == ["broken closed", "a-0", "a-1", "a-2"], (
        f"expected the broken one closed and the others relayed in the same turn, got {done}")
    held(reads, 1, done, "b")
    await one_turn()
    assert done[-1] == "b-0", f"expected the pacer to go on turning, got {done}"
