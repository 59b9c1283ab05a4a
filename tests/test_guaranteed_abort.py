"""Guaranteed abort: a client that leaves at any instant from its last body byte on leaves no
generation running at the engine, even while the engine is still registering the request's ids.

vLLM and SGLang learn a request's engine ids only some time after the whole body arrived (chat
template, tokenization, media fetches); an abort naming an id not registered yet is a no-op,
answered 200 (``../shared/notes/cancellation-facts.md``). The fakes of ``tests/fakes/kinds.py``
do the same (``register_delay``, ``register_stagger``) and keep generating for a closed request
until every id is aborted or it reaches its last token, so "nothing ran to its end" is the
engine's observation, never the sidecar's word (no log or metric is read here).

Matrix (``test_no_engine_id_outlives_its_client``, one test per engine kind and abort window;
the sidecar is :func:`sidecar.server.start`, the production wiring the CLI runs, in this process
(``start_sidecar``), so its clock and the engine's advance together when this loaded machine
deschedules the process (a sidecar process of its own may send a body seconds before the starved
engine loop reads it); one delay at a time, its clients launched ``LAUNCH_STEP_S`` apart with the
routes and instants interleaved):

============  ================================================================================
kinds         ``vllm``, ``sglang``
delays        0, 2 ms, 20 ms, 300 ms (default ``abort`` settings: ``resend_window_s`` 2.0,
              ``resend_max_interval_s`` 0.2, what the defaults cover) and 2 s
              (``resend_window_s`` 2.5); whole body -> first id registered; a multi-id request
              registers one id every ``STAGGER_S``
routes        streaming chat, JSON chat, a 4-prompt streaming completion, a batch (vLLM
              ``/v1/chat/completions/batch`` with 3 conversations, SGLang ``/generate`` with 3
              texts), and for SGLang a streaming ``/v1/responses`` (its rid is the body's
              ``request_id``; vLLM's Responses turns: ``test_responses_tool_turns.py``), each
              generating 200 tokens x 20 ms (4 s) once registered
instants      after the client's last body byte: 0 (the same loop step), 1 ms, 10 ms, 100 ms;
              relative to the engine: ``engine_has_body`` (the moment it has the whole body),
              ``before_registration`` (``MARGIN_S``, at most half the delay, before the first id
              is registered) and ``after_registration`` (right after the last id is)
ways          ``rst`` (SO_LINGER 0), ``fin`` (close), ``half`` (shutdown(SHUT_WR), then read until
              the sidecar closes): all three for vLLM; for SGLang (one abort call per id, ~15 per
              id in a window) one per route and instant, rotating over the delays
============  ================================================================================

Per case: if the engine got the whole body, every engine id of the request is stopped (aborted
after its registration) and none runs to its end; the calls naming each id stop (none later than
the registration window's end + ``GUARD_S``, time this process was descheduled excluded) and
number at least one and at most :func:`tests.harness.support.max_calls` (the documented
schedule: the first call, re-sends 5 ms after it doubling up to ``resend_max_interval_s``, the last
when the window closes, plus one for coalescing). A bystander per route and delay (short, read to
its end by aiohttp) runs to its end and none of its ids is ever named, though re-sends of the others
go on after it completed. A body that never reached the engine whole (the client left while the
sidecar was still relaying it: on this loaded machine that happens even 100 ms after the last byte)
needs no abort; such cases are allowed at the client-timed instants only, and counted in the printed
summary (run with ``-s``), with the number of cases whose first abort the engine ignored because it
came before the registration (the race this module is about).

``test_after_the_window_one_call`` proves the other side of the bound, through the real
``python -m sidecar``: a request that ends after its window (``resend_window_s`` 0.3) gets
exactly one call per id. ``test_cancel_api_and_deadline_inside_the_registration``: the same
guarantee when the cancel API or a deadline ends the request while the engine registers it.
``test_resends_never_hold_back_a_first_abort``: with a slow abort endpoint (50 ms a call) and a
crowd's re-sends under way, a newly cut request's first abort still reaches the engine within
``FIRST_ABORT_S`` and it is stopped ("the abort leaves first", issue 11).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from sidecar.config import parse_config
from sidecar.server import Servers
from tests.fakes.kinds import KindEngine, SGLangEngine, VLLMEngine, Work
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.support import (
    API_KEY,
    FOREVER,
    Stalls,
    max_calls,
    ms,
    raw_client,
    request_body,
    settle,
)

pytestmark = pytest.mark.timeout(90)

GEN = "tokens=200&interval=0.02"  # 4 s after registration: a missed abort shows as a finished id
BYSTANDER_GEN = "tokens=10&interval=0.01"
STAGGER_S = 0.005  # between successive ids' registration of a multi-id request (delay > 0)
MARGIN_S = 0.05  # ``before_registration``: this long (at most half the delay) before it
FIRST_ABORT_S = 2.0  # test_resends_never_hold_back_a_first_abort: the late request's first call
GUARD_S = 1.0  # lag allowed after the window's end (this loop runs sidecar, engine and clients)

DELAYS = {"0": 0.0, "2ms": 0.002, "20ms": 0.02, "300ms": 0.3, "2s": 2.0}
# window -> (engines.local.abort settings beyond the key, the delays run against it)
WINDOWS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "default": ({}, ["0", "2ms", "20ms", "300ms"]),  # resend_window_s 2.0 (the default)
    "2.5s": ({"resend_window_s": 2.5}, ["2s"]),
}
# instant -> seconds after the client's last body byte, or a name relative to the engine
INSTANTS: dict[str, float | str] = {
    "0": 0.0, "1ms": 0.001, "10ms": 0.01, "100ms": 0.1,
    "engine_has_body": "body", "before_registration": "before",
    "after_registration": "after",
}
# The client-timed instants: the sidecar may not have relayed the whole body by then (it is a
# process of its own on a loaded machine), and then the engine never gets it and nothing is owed.
MAY_MISS_THE_ENGINE = {"0", "1ms", "10ms", "100ms"}
LAUNCH_STEP_S = 0.008  # between starting successive clients: no burst of connects at t=0
HOWS = ("rst", "fin", "half")

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}
PROMPTS_4 = {"prompt": ["a", "b", "c", "d"]}
# kind -> route -> (path, body without "stream", stream?)
ROUTES: dict[str, dict[str, tuple[str, dict[str, Any], bool]]] = {
    "vllm": {
        "chat-stream": ("/v1/chat/completions", CHAT_BODY, True),
        "chat-json": ("/v1/chat/completions", CHAT_BODY, False),
        "completions-4-prompts": ("/v1/completions", PROMPTS_4, True),
        "chat-batch-3": ("/v1/chat/completions/batch", {"messages": [
            [{"role": "user", "content": c}] for c in "abc"]}, False),
    },
    "sglang": {
        "chat-stream": ("/v1/chat/completions", CHAT_BODY, True),
        "chat-json": ("/v1/chat/completions", CHAT_BODY, False),
        "completions-4-prompts": ("/v1/completions", PROMPTS_4, True),
        "generate-batch-3": ("/generate", {"text": ["a", "b", "c"]}, False),
        "responses-stream": ("/v1/responses", {"input": "hi"}, True),  # rid: the request_id
    },
}
FAKES: dict[str, Callable[[], KindEngine]] = {
    "vllm": lambda: VLLMEngine(API_KEY), "sglang": lambda: SGLangEngine(API_KEY)}


@dataclass
class Case:
    """One client of the matrix: its route, the instant and way it leaves, what it saw."""

    route: str
    instant: str
    how: str
    tag: str
    delay: str = "0"  # a DELAYS key
    sent_at: float = 0.0  # its last body byte went to the kernel
    left_at: float | None = None

    @property
    def label(self) -> str:
        return f"{self.delay}/{self.route}/{self.instant}/{self.how}"


@dataclass
class Deployment:
    """A fake engine of one kind, the sidecar in front of it and its abort settings."""

    kind: str
    fake: KindEngine
    port: int
    window_s: float
    max_interval_s: float
    stalls: Stalls
    admin: int = 0  # the admin listener's port (the cancel API)
    by_tag: dict[str, Work] = field(default_factory=dict)

    def work(self, tag: str) -> Work | None:
        if tag not in self.by_tag:
            for w in self.fake.works[len(self.by_tag):]:
                if isinstance(w.body, dict) and isinstance(w.body.get("tag"), str):
                    self.by_tag[w.body["tag"]] = w
        return self.by_tag.get(tag)

    async def until(self, predicate: Callable[[], bool], what: str,
                    within_s: float = 10.0) -> None:
        await self.stalls.wait(self.fake.watch.until(predicate, FOREVER), what, within_s)

    async def arrived(self, tag: str) -> Work:
        """Wait for the engine to have the whole body of request ``tag``."""
        await self.until(lambda: self.work(tag) is not None, f"the engine to get {tag} whole")
        work = self.work(tag)
        assert work is not None
        return work


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[KindEngine]]:
    """Fake engines to stop at teardown. Requested before ``start_sidecar``, so they stop after
    the in-process sidecar: its re-sends still due never meet a closed engine port."""
    started: list[KindEngine] = []
    yield started
    for fake in started:
        await fake.stop()


@asynccontextmanager
async def deploy(kind: str, stalls: Stalls, abort: dict[str, Any] | None = None, *,
                 start_sidecar: Callable[..., Any] | None = None,
                 fakes: list[KindEngine] | None = None,
                 tmp_path: Path | None = None) -> AsyncIterator[Deployment]:
    """The fake engine of ``kind`` and the sidecar in front of it: :func:`sidecar.server.start`
    in this process (``start_sidecar``), or the real ``python -m sidecar`` (``tmp_path``).

    In this process, the sidecar's clock (body sent, re-sends due) and the engine's (body read,
    registration due) run on one loop, so a loaded machine that deschedules the process delays
    both alike; a sidecar process of its own may send the body seconds before this starved loop
    reads it, which would move the registration past a window that the sidecar rightly counts
    from its send."""
    fake = FAKES[kind]()
    await fake.start()
    if fakes is not None:
        fakes.append(fake)  # stopped by the fixture, after the sidecar
    try:
        engine = {"kind": kind, "url": fake.url,
                  "abort": {"api_key": API_KEY, "timeout_s": 2.0, **(abort or {})}}
        tree = config_tree(fake.url, api_key=API_KEY, engines={"local": engine},
                           log_level="WARNING")
        settings = parse_config(yaml.safe_dump(tree), "<test>", env={})
        aborts = settings.engines["local"].abort
        if start_sidecar is not None:
            servers: Servers = await start_sidecar(settings)
            yield Deployment(kind, fake, servers.proxy_port, aborts.resend_window_s,
                             aborts.resend_max_interval_s, stalls, servers.admin_port or 0)
        else:
            assert tmp_path is not None
            async with cli_process(tmp_path, tree) as cli:
                yield Deployment(kind, fake, cli.proxy_port, aborts.resend_window_s,
                                 aborts.resend_max_interval_s, stalls, cli.admin_port)
    finally:
        if fakes is None:
            await fake.stop()


def query(delay_s: float, multi: bool, gen: str = GEN) -> str:
    stagger = f"&register_stagger={STAGGER_S}" if multi and delay_s > 0 else ""
    return f"?{gen}&register_delay={delay_s}{stagger}"


async def run_victim(d: Deployment, case: Case, delay_s: float) -> None:
    """Send the request whole, leave at ``case.instant`` by ``case.how``."""
    path, body, stream = ROUTES[d.kind][case.route]
    multi = len(d.fake.derive(path, {"X-Request-Id": "x"}, dict(body))[1]) > 1
    async with raw_client(d.port, d.stalls) as c:
        c.send("POST", path + query(delay_s, multi),
               request_body({**body, "tag": case.tag}, stream), [("X-Request-Id", case.tag)])
        case.sent_at = time.monotonic()
        instant = INSTANTS[case.instant]
        if isinstance(instant, float):
            if instant:
                await asyncio.sleep(instant)  # the instant under test, not a synchronisation
        else:
            work = await d.arrived(case.tag)  # "body": leave at once
            if instant == "before":
                margin = min(MARGIN_S, delay_s / 2)
                await asyncio.sleep(max(0.0, work.started + delay_s - margin - time.monotonic()))
            elif instant == "after":
                await d.until(work.known.is_set, f"{case.tag}'s ids to be registered")
        case.left_at = c.disconnect(case.how)
        if case.how == "half":  # we still read: the sidecar must close the connection
            await d.stalls.wait(c.reader.read(), f"{case.tag}: the sidecar to close after EOF")


async def run_bystander(d: Deployment, route: str, delay_s: float, tag: str) -> str:
    """A request on ``route`` read to its end through the sidecar (aiohttp)."""
    path, body, stream = ROUTES[d.kind][route]
    multi = len(d.fake.derive(path, {"X-Request-Id": "x"}, dict(body))[1]) > 1
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{d.port}{path}{query(delay_s, multi, BYSTANDER_GEN)}",
            json={**body, "stream": stream, "tag": tag}) as r:
        text = await r.text()
        assert r.status == 200, f"bystander {tag}: expected 200, got {r.status}: {text[:200]}"
        return text


def calls_naming(fake: KindEngine, engine_id: str) -> list[float]:
    return [c.at for c in fake.calls if engine_id in c.ids]


def _call_times(fake: KindEngine, work: Work) -> dict[str, list[str]]:
    """Engine id -> when calls named it, after the engine had the body."""
    return {i: [ms(t - work.started) for t in calls_naming(fake, i)] for i in work.engine_ids}


def judge(d: Deployment, case: Case) -> tuple[str | None, dict[str, Any]]:
    """(what is wrong with ``case``, or None; figures for the summary)."""
    work = d.work(case.tag)
    figures: dict[str, Any] = {"delivered": work is not None}
    if work is None:
        head = next((h for h in d.fake.heads
                     if h.headers.get("X-Client-Request-Id") == case.tag), None)
        if case.instant in MAY_MISS_THE_ENGINE:
            return None, figures
        return (f"{case.label}: expected the engine to get the whole body (the client left "
                f"{case.instant} after it); it never did (head seen: {head is not None})",
                figures)
    assert case.left_at is not None
    window_end = work.started + d.window_s
    problems: list[str] = []
    ran = sorted(work.ran_to_end)
    if ran or work.stopped_at is None:
        problems.append(
            f"expected every engine id stopped before its end; ran to its end: {ran}, "
            f"stopped_at={work.stopped_at}; registered "
            f"{ {i: ms(t - work.started) for i, t in work.registered.items()} } after the body, "
            f"client left {ms(case.left_at - work.started)} after the engine had the body; "
            f"aborts before registration (ignored) "
            f"{ {i: [ms(t - work.started) for t in ts] for i, ts in work.ignored.items()} }; "
            f"calls naming its ids at {_call_times(d.fake, work)}")
    bound = max_calls(case.left_at, window_end, d.max_interval_s)
    late_allowed = window_end + GUARD_S
    most = 0
    for engine_id in work.engine_ids:
        times = calls_naming(d.fake, engine_id)
        most = max(most, len(times))
        if not times:
            problems.append(f"expected at least one abort call naming {engine_id}, got none")
        if len(times) > bound:
            problems.append(f"expected at most {bound} calls naming {engine_id} (the documented "
                            f"re-send schedule), got {len(times)}")
        late = [t for t in times if t > late_allowed + d.stalls.within(window_end, t)]
        if late:
            problems.append(f"expected no call naming {engine_id} after the window's end + "
                            f"{GUARD_S} s; got calls {[ms(t - window_end) for t in late]} after "
                            f"the window's end")
    figures.update(calls=most, first_ignored=any(work.ignored.values()),
                   left_after_body_ms=(case.left_at - work.started) * 1000)
    if problems:
        return f"{case.label} ({work.engine_ids}): " + "; ".join(problems), figures
    return None, figures


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("kind", sorted(ROUTES))
async def test_no_engine_id_outlives_its_client(kind: str, window: str, stalls: Stalls,
                                                fakes: list[KindEngine],
                                                start_sidecar: Callable[..., Any]) -> None:
    abort, delays = WINDOWS[window]
    async with deploy(kind, stalls, abort, start_sidecar=start_sidecar, fakes=fakes) as d:
        assert all(d.window_s > DELAYS[delay] + 0.2 for delay in delays), (
            f"the window ({d.window_s} s) must cover every delay {delays} with room to spare")
        problems = [p for delay in delays for p in await group(d, delay)]
    assert not problems, (f"{len(problems)} clients or bystanders wrong:\n"
                          + "\n".join(problems[:40]))


def group_cases(kind: str, delay: str) -> list[Case]:
    """The clients of one delay: every route x instant x way; for SGLang (one abort call per
    id, so ~15 calls per id in a window) one way per route and instant, rotating, so every way
    meets every route and instant over the delays without flooding this loop's fake."""
    cases = []
    for r, route in enumerate(ROUTES[kind]):
        for i, instant in enumerate(INSTANTS):
            if DELAYS[delay] == 0 and instant == "before_registration":
                continue
            hows = HOWS if kind == "vllm" else (HOWS[(r + i + list(DELAYS).index(delay)) % 3],)
            cases += [Case(route, instant, how, f"{kind}-{delay}-{route}-{instant}-{how}",
                           delay) for how in hows]
    random.Random(len(cases)).shuffle(cases)  # routes and instants interleaved
    return cases


async def group(d: Deployment, delay: str) -> list[str]:
    """Every client of ``delay`` (:func:`group_cases`), launched ``LAUNCH_STEP_S`` apart, with a
    bystander per route; then the checks of the module docstring. Returns what is wrong."""
    stalls, kind, delay_s = d.stalls, d.kind, DELAYS[delay]
    cases = group_cases(kind, delay)
    started = time.monotonic()
    calls_before = len(d.fake.calls)
    bystanders = {route: asyncio.ensure_future(run_bystander(
        d, route, delay_s, f"bystander-{delay}-{route}")) for route in ROUTES[kind]}

    async def launch(k: int, case: Case) -> None:
        await asyncio.sleep(k * LAUNCH_STEP_S)  # spread the connects (not a synchronisation)
        await run_victim(d, case, delay_s)

    await stalls.wait(asyncio.gather(*(launch(k, c) for k, c in enumerate(cases))),
                      f"all {len(cases)} clients to send and leave", 60.0)
    texts = {r: await stalls.wait(t, f"the bystander on {r}") for r, t in bystanders.items()}

    delivered = [w for c in cases if (w := d.work(c.tag)) is not None]
    await d.until(lambda: all(not w.running for w in delivered),
                  "every delivered request to stop or run to its end", delay_s + 10.0)
    # The re-sends must stop: wait out every window + the guard (an event-or-timeout wait for a
    # late call), then one round trip through the sidecar.
    last_end = max((w.started + d.window_s for w in delivered), default=time.monotonic())
    checked = [calls_before]

    def late_call() -> bool:
        calls = d.fake.calls
        late = any(c.at > last_end + GUARD_S for c in calls[checked[0]:])
        checked[0] = len(calls)
        return late

    await d.fake.watch.until(late_call, max(0.0, last_end + GUARD_S - time.monotonic()) + 0.2)
    await settle(d.port)
    took = time.monotonic() - started

    problems: list[str] = []
    figures: dict[str, dict[str, Any]] = {}
    for case in cases:
        problem, figures[case.tag] = judge(d, case)
        if problem:
            problems.append(problem)
    named = Counter(i for c in d.fake.calls for i in c.ids)
    for route, text in texts.items():
        name = f"{delay}/bystander {route}"
        work = d.work(f"bystander-{delay}-{route}")
        assert work is not None, f"{name}: the engine never got it"
        if not (work.finished and not work.aborted
                and sorted(work.ran_to_end) == sorted(work.engine_ids)):
            problems.append(f"{name}: expected it to run to its end untouched, got "
                            f"finished={work.finished} aborted={work.aborted}")
        if hit := {i: named[i] for i in work.engine_ids if named[i]}:
            problems.append(f"{name} completed, yet its ids were named: {hit}")
        if ROUTES[kind][route][2] and not text.endswith("data: [DONE]\n\n"):
            problems.append(f"{name}: expected its whole stream, got {text[-120:]!r}")
    seen = list(figures.values())
    missed = Counter(c.instant for c in cases if not figures[c.tag]["delivered"])
    print(f"\n[{kind} delay {delay}, window {d.window_s} s] {len(cases)} clients, "
          f"{len(delivered)} delivered whole (left before the engine had the body, by instant: "
          f"{dict(missed)}), {sum(1 for f in seen if f.get('first_ignored'))} with an abort "
          f"ignored before registration, {len(d.fake.calls) - calls_before} abort calls, at "
          f"most {max((f.get('calls', 0) for f in seen), default=0)} naming one id; "
          f"{sum(len(w.ran_to_end) for w in delivered)} engine id(s) ran to their end; "
          f"{len(problems)} wrong; {took:.1f} s{stalls.note(started, time.monotonic())}")
    return problems


@pytest.mark.parametrize("kind", sorted(ROUTES))
async def test_after_the_window_one_call(kind: str, stalls: Stalls, tmp_path: Path) -> None:
    """``resend_window_s`` 0.3, through the real ``python -m sidecar``: a request registered at
    once whose client leaves 0.6 s after the engine had its body (after the window) gets
    exactly one call per id, on every route, every way; the work stops."""
    async with deploy(kind, stalls, {"resend_window_s": 0.3}, tmp_path=tmp_path) as d:
        await one_call_after_the_window(d, kind)


async def one_call_after_the_window(d: Deployment, kind: str) -> None:
    stalls = d.stalls
    cases = [Case(route, "0.6s", how, f"{kind}-late-{route}-{how}")
             for route in ROUTES[kind] for how in HOWS]

    async def leave_late(case: Case) -> None:
        path, body, stream = ROUTES[kind][case.route]
        async with raw_client(d.port, stalls) as c:
            c.send("POST", path + f"?{GEN}", request_body({**body, "tag": case.tag}, stream))
            case.sent_at = time.monotonic()
            work = await d.arrived(case.tag)
            await asyncio.sleep(max(0.0, work.started + 0.6 - time.monotonic()))  # the instant
            case.left_at = c.disconnect(case.how)
            if case.how == "half":
                await stalls.wait(c.reader.read(), f"{case.tag}: the sidecar to close")

    await stalls.wait(asyncio.gather(*(leave_late(c) for c in cases)), "the clients", 20.0)
    works = [d.work(c.tag) for c in cases]
    await d.until(lambda: all(w is not None and w.stopped_at is not None for w in works),
                  "every request to stop")
    ids = [i for w in works if w is not None for i in w.engine_ids]

    def more_calls() -> bool:
        return any(n > 1 for n in Counter(i for c in d.fake.calls for i in c.ids).values())

    await d.fake.watch.until(more_calls, 0.5)  # a re-send would be due within 5 ms
    await settle(d.port)
    named = Counter(i for c in d.fake.calls for i in c.ids)
    wrong = {i: named[i] for i in ids if named[i] != 1}
    assert not wrong, f"expected exactly one call naming each id after the window, got {wrong}"
    ran = [w.ran_to_end for w in works if w is not None and w.ran_to_end]
    assert not ran, f"expected no id to run to its end, got {ran}"


ENDINGS = {"cancel_api": 499, "deadline": 504}  # the client's status when its request ends early


@pytest.mark.parametrize("kind", sorted(ROUTES))
async def test_cancel_api_and_deadline_inside_the_registration(
        kind: str, stalls: Stalls, fakes: list[KindEngine],
        start_sidecar: Callable[..., Any]) -> None:
    """The client stays connected; its request ends early while the engine (300 ms delay) is
    still registering its ids: by the cancel API the moment the engine has the whole body, or
    by its ``X-Sidecar-Deadline-S`` of 0.05 s. The same guarantee as after a disconnect: the
    client gets its 499/504, every id is stopped, none runs to its end, the calls stay within
    the bound and the window."""
    delay_s = 0.3
    async with deploy(kind, stalls, start_sidecar=start_sidecar, fakes=fakes) as d:
        cases = [Case(route, ending, "stay", f"{kind}-{ending}-{route}", "300ms")
                 for route in ROUTES[kind] for ending in ENDINGS]

        async def end_early(case: Case) -> None:
            path, body, stream = ROUTES[kind][case.route]
            multi = len(d.fake.derive(path, {"X-Request-Id": "x"}, dict(body))[1]) > 1
            headers = [("X-Request-Id", case.tag)]
            if case.instant == "deadline":
                headers.append(("X-Sidecar-Deadline-S", "0.05"))
            async with raw_client(d.port, stalls) as c:
                c.send("POST", path + query(delay_s, multi),
                       request_body({**body, "tag": case.tag}, stream), headers)
                case.sent_at = case.left_at = time.monotonic()  # the deadline: no earlier
                if case.instant == "cancel_api":
                    work = await d.arrived(case.tag)
                    sidecar_id = (work.request_id_header if kind == "vllm"
                              else (work.tag or "").removeprefix("resp_"))
                    case.left_at = time.monotonic()
                    async with aiohttp.ClientSession() as s, s.post(
                            f"http://127.0.0.1:{d.admin}/v1/requests/{sidecar_id}/cancel") as r:
                        answer = await r.json()
                    assert r.status == 200 and answer.get("cancelled") is True, (
                        f"{case.tag}: expected the cancel API to answer 200 cancelled, got "
                        f"{r.status} {answer}")
                status, _ = await c.head()
                assert status == ENDINGS[case.instant], (
                    f"{case.tag}: expected {ENDINGS[case.instant]}, got {status}")

        await stalls.wait(asyncio.gather(*(end_early(c) for c in cases)), "the clients", 20.0)
        works = [w for c in cases if (w := d.work(c.tag)) is not None]
        assert len(works) == len(cases), (
            f"expected the engine to get all {len(cases)} bodies, got {len(works)}")
        await d.until(lambda: all(not w.running for w in works),
                      "every request to stop or run to its end", 10.0)
        last_end = max(w.started for w in works) + d.window_s
        await d.fake.watch.until(lambda: any(c.at > last_end + GUARD_S for c in d.fake.calls),
                                 max(0.0, last_end + GUARD_S - time.monotonic()) + 0.2)
        await settle(d.port)
        problems = [p for c in cases if (p := judge(d, c)[0])]
        ignored = sum(1 for w in works if any(w.ignored.values()))
        print(f"\n[{kind} cancel API / deadline, delay 300 ms] {len(cases)} requests, {ignored} "
              f"with an abort ignored before registration, {len(d.fake.calls)} calls, "
              f"{len(problems)} wrong")
    assert not problems, f"{len(problems)} of {len(cases)} wrong:\n" + "\n".join(problems)


@pytest.mark.parametrize("kind", sorted(ROUTES))
async def test_resends_never_hold_back_a_first_abort(
        kind: str, stalls: Stalls, fakes: list[KindEngine],
        start_sidecar: Callable[..., Any]) -> None:
    """The abort leaves first (issue 11): the engine's abort endpoint takes 50 ms a call; 60
    batch requests (3 ids each) disconnect at once, so their re-sends keep the endpoint busy for
    the whole window; 0.5 s later one more request, registered at once, disconnects. Its first
    abort must reach the engine within ``FIRST_ABORT_S`` (the crowd's own first calls, 180 ids
    at one call per id for SGLang through 8 slots, take ~1.1 s; re-sends of requests that
    were already named once must not go before a request never named yet) and it must not run
    to its end."""
    async with deploy(kind, stalls, start_sidecar=start_sidecar, fakes=fakes) as d:
        d.fake.abort_delay_s = 0.05
        path, body, stream = ROUTES[kind]["chat-batch-3" if kind == "vllm" else
                                          "generate-batch-3"]

        async def leave(tag: str) -> tuple[Work, float]:
            async with raw_client(d.port, stalls) as c:
                c.send("POST", f"{path}?{GEN}", request_body({**body, "tag": tag}, stream),
                       [("X-Request-Id", tag)])
                work = await d.arrived(tag)
                return work, c.disconnect("rst")

        crowd = await stalls.wait(asyncio.gather(*(leave(f"crowd-{k}") for k in range(60))),
                                  "the crowd to send and leave")
        await asyncio.sleep(0.5)  # the crowd's re-sends are under way (the instant under test)
        late, left = await stalls.wait(leave("late"), "the late request to send and leave")
        await d.until(lambda: any(set(late.engine_ids) & set(c.ids) for c in d.fake.calls),
                      "an abort call naming the late request", 30.0)
        first = min(c.at for c in d.fake.calls if set(late.engine_ids) & set(c.ids))
        await d.until(lambda: not late.running and all(not w.running for w, _ in crowd),
                      "every request to stop or run to its end")
        calls = len(d.fake.calls)
    took, stalled = first - left, stalls.within(left, first)
    print(f"\n[{kind} slow abort endpoint] late request's first abort {ms(took)} after its "
          f"client left{stalls.note(left, first)}; {calls} calls")
    assert took - stalled < FIRST_ABORT_S and not late.ran_to_end, (
        f"expected the late request's first abort call within {FIRST_ABORT_S} s of its client "
        f"leaving and the request stopped before its end; the call came after {ms(took)} "
        f"({ms(stalled)} of it with this process stalled), ran to its end: "
        f"{sorted(late.ran_to_end)}, stopped_at={late.stopped_at}")
