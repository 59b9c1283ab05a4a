"""The same cancellation tests for every engine kind: a client that leaves, in any phase and in
any way, gets its upstream connection closed and the engine's work for it stopped, with no
other client's work touched.

Each kind runs against the fake of ``tests/fakes/kinds.py`` that follows that kind's documented
behaviour (vLLM: ids from ``X-Request-Id``, exact-id aborts; SGLang: the body ``rid``, batch
children, always-200 aborts, prefix matching; openai: no abort endpoint), and a fifth case is a
vLLM started without ``--enable-scale-out`` (its abort route answers 403). The fakes keep
generating for a closed request until it is aborted, so "the work stopped" is shown by the
engine, not by the sidecar's word. What each kind must show:

============================  ==============================================================
``vllm``                      one abort call naming exactly the request's engine ids; stopped
``sglang``                    one ``/abort_request`` call per engine id (each exactly once); stopped
``openai``                    no call of any kind; the close is the stop
``vllm-abort-disabled``       one call naming the ids, answered 403 and not retried; the work
                              goes on (the sidecar cannot stop it), and the operator learns it
                              from ``abort_calls_total{outcome="http_403"}`` and ``/readyz`` 503
============================  ==============================================================

Every case also checks: the upstream connection closed within ``GUARD_S`` (for ``vllm`` and
``sglang``, whose aborted responses end at once: the response ended, which is the sidecar's
confirmation, :mod:`sidecar.confirm`), the disconnect
counted with its phase, and a concurrent request on the same engine streamed to its end
untouched. Production wiring throughout (``start_sidecar``: :func:`sidecar.server.start`, the
``AppRunner`` the CLI runs, handler cancellation on) and, in ``test_cli_*``, the real
``python -m sidecar`` subprocess; clients are raw sockets (``rst``, ``fin``, ``half``), aiohttp
and the ``openai`` SDK. Timing as in :mod:`tests.harness.support`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.kinds import KindEngine, OpenAIEngine, SGLangEngine, VLLMEngine, Work
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.support import (
    API_KEY,
    FOREVER,
    QUIET_S,
    Stalls,
    disconnect_counts,
    metrics,
    ms,
    raw_client,
    request_body,
    sample,
    settle,
)

pytestmark = pytest.mark.timeout(60)

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})


@dataclass(frozen=True)
class Kind:
    """One engine kind under test: how to make its fake and configure it, its routes, and
    what a disconnect must do to it (``stops``: the work ends; ``calls``: abort calls made)."""

    make: Callable[[], KindEngine]
    engine: Callable[[str], dict[str, Any]]  # the ``engines.local`` config for the fake's url
    routes: dict[str, tuple[str, dict[str, Any]]]  # name -> (path, body without "stream")
    stops: bool = True
    calls: bool = True
    abort_status: int = 200


def _abortable(kind: str) -> Callable[[str], dict[str, Any]]:
    return lambda url: {"kind": kind, "url": url, "abort": {"api_key": API_KEY, "timeout_s": 2.0,
                                                                    "resend_window_s": 0}}


KINDS: dict[str, Kind] = {
    "vllm": Kind(lambda: VLLMEngine(API_KEY), _abortable("vllm"), {
        "chat": CHAT,
        "completions-1-prompt": ("/v1/completions", {"prompt": "a"}),
        "completions-3-prompts": ("/v1/completions", {"prompt": ["a", "b", "c"]}),
        "generate": ("/inference/v1/generate", {"token_ids": [1, 2, 3]}),
    }),
    "sglang": Kind(lambda: SGLangEngine(API_KEY), _abortable("sglang"), {
        "chat": CHAT,
        "completions-3-prompts": ("/v1/completions", {"prompt": ["a", "b", "c"]}),
        "generate": ("/generate", {"text": "a"}),
        "generate-2-texts": ("/generate", {"text": ["a", "b"]}),
    }),
    "openai": Kind(OpenAIEngine, lambda url: {"kind": "openai", "url": url}, {
        "chat": CHAT,
        "completions": ("/v1/completions", {"prompt": "a"}),
    }, stops=True, calls=False),
    "vllm-abort-disabled": Kind(lambda: VLLMEngine(API_KEY, scale_out=False),
                                _abortable("vllm"), {"chat": CHAT}, stops=False,
                                abort_status=403),
}

# phase -> (query, stream?, the phase label the sidecar counts)
PHASES: dict[str, tuple[str, bool, str]] = {
    "queued": ("?first_byte_delay=30", True, "before_first_byte"),
    "non_streaming": ("?tokens=3000&interval=0.01", False, "awaiting_response"),
    "mid_stream": ("?tokens=3000&interval=0.01", True, "streaming"),
}
BYSTANDER = "?tokens=40&interval=0.01"


@dataclass
class Deployment:
    """A fake engine of one kind and the sidecar in front of it (its proxy and admin ports)."""

    name: str  # the KINDS key
    kind: Kind
    fake: KindEngine
    port: int
    admin: int


@pytest_asyncio.fixture
async def deployment(request: pytest.FixtureRequest, start_sidecar: Callable[..., Any]
                     ) -> AsyncIterator[Deployment]:
    """The fake engine of kind ``request.param`` and the sidecar in front of it."""
    kind = KINDS[request.param]
    fake = kind.make()
    await fake.start()
    settings = sidecar_settings(fake.url, engines={"local": kind.engine(fake.url)},
                                lifecycle={"grace_period_s": 1.0})
    servers: Servers = await start_sidecar(settings)
    yield Deployment(request.param, kind, fake, servers.proxy_port, servers.admin_port or 0)
    await fake.stop()


def kind_routes(*kinds: str) -> list[Any]:
    """``(deployment, route)`` parameters, ids ``kind-route``."""
    return [pytest.param(k, r, id=f"{k}-{r}") for k in kinds for r in KINDS[k].routes]


async def until(stalls: Stalls, fake: KindEngine, predicate: Callable[[], bool], what: str
                ) -> None:
    await stalls.wait(fake.watch.until(predicate, FOREVER), what)


async def whole_stream(port: int, path: str, body: dict[str, Any]) -> str:
    """A streaming request read to its end through the sidecar (aiohttp)."""
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}{path}{BYSTANDER}", json={**body, "stream": True}) as r:
        assert r.status == 200, f"bystander: expected 200, got {r.status}"
        return await r.text()


async def quiet(stalls: Stalls, d: Deployment, predicate: Callable[[], bool]) -> bool:
    """True if ``predicate`` stays false for ``QUIET_S`` and after a round trip through the
    sidecar (:func:`settle`): whatever the sidecar was about to send has had its chance."""
    if await d.fake.watch.until(predicate, QUIET_S):
        return False
    await settle(d.port)
    return not predicate()


def named(fake: KindEngine) -> list[str]:
    return [i for c in fake.calls for i in c.ids]


async def check_stopped(stalls: Stalls, d: Deployment, victim: Work, at: float, label: str
                        ) -> None:
    """What the kind promises after ``victim``'s client left at ``at``: see the module
    docstring's table."""
    fake, kind = d.fake, d.kind
    # A kind whose abort stops the work ends the response aborted (the sidecar reads that as the
    # engine's confirmation, then releases the connection); a close-only one, or one that
    # refuses the abort, sees its connection close.
    if kind.calls and kind.stops:
        await until(stalls, fake, lambda: victim.stopped_at is not None,
                    "the engine to stop the work (aborted: the response ended)")
        ended = victim.closed_at or victim.stopped_at
    else:
        await until(stalls, fake, lambda: victim.closed_at is not None,
                    "the upstream (engine) connection to close")
        ended = victim.closed_at
    assert ended is not None
    closed = stalls.check("the upstream end", at, ended)
    note = f"upstream ended {ms(closed)}"
    if kind.calls:
        await until(stalls, fake, lambda: sorted(named(fake)) == sorted(victim.engine_ids),
                    f"abort calls naming {victim.engine_ids}")
        last = max(c.at for c in fake.calls)
        note += f", last abort call {ms(stalls.check('the abort', at, last))}"
    if kind.stops:
        await until(stalls, fake, lambda: victim.stopped_at is not None, "the work to stop")
        assert victim.stopped_at is not None
        note += f", work stopped {ms(stalls.check('the work to stop', at, victim.stopped_at))}"
    await settle(d.port)
    print(f"[{d.name} {label}] {note}{stalls.note(at, victim.stopped_at or ended)}")
    calls = fake.calls
    if not kind.calls:
        assert calls == [] and fake.unknown_paths == [], (
            f"a close-only engine must get no call; got {calls}, {fake.unknown_paths}")
        assert victim.stopped_at == victim.closed_at
        return
    assert sorted(named(fake)) == sorted(victim.engine_ids), (
        f"expected each of {victim.engine_ids} named exactly once, got {[c.ids for c in calls]}")
    per_call = len(victim.engine_ids) if isinstance(fake, VLLMEngine) else 1
    assert all(len(c.ids) == per_call for c in calls), (
        f"expected {per_call} id(s) per call, got {[c.ids for c in calls]}")
    for call in calls:
        assert call.authorization == f"Bearer {API_KEY}", call.authorization
        assert call.status == kind.abort_status, (call.status, kind.abort_status)
    values = await metrics(d.admin)
    outcome = "accepted" if kind.abort_status == 200 else f"http_{kind.abort_status}"
    assert sample(values, "cancel_sidecar_abort_calls_total", engine="local",
                  outcome=outcome) == len(calls), f"expected {len(calls)} {outcome} calls"
    if not kind.stops:
        assert victim.running, f"the engine was not told to stop, yet {victim}"
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{d.admin}/readyz") as r:
            text = await r.text()
        assert r.status == 503 and "--enable-scale-out" in text, (r.status, text)


# -- a disconnect in every phase, every way, on every route of every kind ----------------------

@pytest.mark.parametrize("how", ["rst", "fin", "half"])
@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize(("deployment", "route"), kind_routes(*KINDS), indirect=["deployment"])
async def test_disconnect_stops_exactly_the_clients_work(
        deployment: Deployment, stalls: Stalls, route: str, phase: str, how: str) -> None:
    d, fake = deployment, deployment.fake
    path, body = d.kind.routes[route]
    query, stream, phase_label = PHASES[phase]
    bystander = asyncio.ensure_future(whole_stream(d.port, path, body))
    await until(stalls, fake, lambda: len(fake.works) == 1, "the bystander to reach the engine")
    async with raw_client(d.port, stalls) as c:
        c.send("POST", path + query, request_body(body, stream), [("X-Request-Id", "client")])
        sidecar_id = None
        if phase == "mid_stream":
            status, head = await c.head()
            assert status == 200, f"expected a 200 stream, got {status}"
            sidecar_id = head["X-Request-Id"]
            await c.read_until(b"data:")
        await until(stalls, fake, lambda: len(fake.works) == 2, "the request to reach the engine")
        victim = fake.works[1]
        at = c.disconnect(how)
        await check_stopped(stalls, d, victim, at, f"{route} {phase} {how}")
    rest = await stalls.wait(bystander, "the bystander's whole stream")
    assert rest.count("data:") == 42 and rest.endswith("data: [DONE]\n\n"), rest[-200:]
    other = fake.works[0]
    assert other.finished and not other.aborted, f"the bystander must run to its end: {other}"
    assert not set(other.engine_ids) & set(named(fake)), "the bystander's ids were named"
    assert victim.request_id_header not in (None, "client")
    if sidecar_id is not None:
        assert victim.request_id_header == sidecar_id, (victim.request_id_header, sidecar_id)
    if victim.tag is not None:
        assert victim.tag == victim.request_id_header, (
            f"the engine took id {victim.tag!r}, not the sidecar's {victim.request_id_header!r}")
    counts = disconnect_counts(await metrics(d.admin))
    assert counts == {("/", phase_label): 1}, f"expected one {phase_label} disconnect: {counts}"


# -- leaving after the end costs nothing ------------------------------------------------------

@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("end", ["json", "stream-terminator", "stream-done"])
@pytest.mark.parametrize("deployment", sorted(KINDS), indirect=True)
async def test_client_leaving_right_after_the_end_costs_nothing(
        deployment: Deployment, stalls: Stalls, end: str, how: str) -> None:
    """``stream-done``: the client closes on ``data: [DONE]``, maybe before the sidecar relayed
    the chunked terminator; the engine is finished, so that is no disconnect either."""
    d = deployment
    path, body = d.kind.routes["chat"]
    stream = end != "json"
    async with raw_client(d.port, stalls) as c:
        c.send("POST", f"{path}?tokens=5&interval=0.001", request_body(body, stream))
        status, head = await c.head()
        assert status == 200, f"expected 200, got {status}"
        if stream:
            await c.read_until(b"data: [DONE]\n\n")
            if end == "stream-terminator":
                await c.read_until(b"\r\n0\r\n\r\n")
        else:
            await stalls.wait(c.reader.readexactly(int(head["Content-Length"])), "the body")
        c.disconnect(how)
    assert await quiet(stalls, d, lambda: bool(d.fake.calls)), f"no abort: {d.fake.calls}"
    work = d.fake.works[0]
    assert work.finished and work.closed_at is None and not work.aborted, work
    assert disconnect_counts(await metrics(d.admin)) == {}


# -- client-chosen ids never reach an abort -------------------------------------------------

async def client_a_leaves(d: Deployment, stalls: Stalls, body: dict[str, Any],
                          headers: list[tuple[str, str]]) -> tuple[Work, Work, str]:
    """Clients A and B send the same client-chosen ids; A leaves mid-stream. Returns (A's work,
    B's work, B's whole stream)."""
    path = d.kind.routes["chat"][0]
    async with raw_client(d.port, stalls) as b, raw_client(d.port, stalls) as a:
        b.send("POST", f"{path}?tokens=40&interval=0.01", request_body(body, True), headers)
        assert (await b.head())[0] == 200
        await b.read_until(b"data:")
        a.send("POST", f"{path}?tokens=3000&interval=0.01", request_body(body, True), headers)
        assert (await a.head())[0] == 200
        await a.read_until(b"data:")
        at = a.disconnect("rst")
        await check_stopped(stalls, d, d.fake.works[1], at, "client-chosen ids")
        rest_b = (await b.read_until(b"data: [DONE]\n\n")).decode()
    return d.fake.works[1], d.fake.works[0], rest_b


@pytest.mark.parametrize("deployment", ["vllm", "sglang"], indirect=True)
async def test_client_chosen_ids_never_reach_an_abort(deployment: Deployment,
                                                      stalls: Stalls) -> None:
    """Both clients send the same ``X-Request-Id``, body ``request_id`` and body ``rid``: the
    ids vLLM and SGLang would otherwise run them under."""
    body = {**CHAT[1], "request_id": "victim", "rid": "victim"}
    a, b, rest_b = await client_a_leaves(deployment, stalls, body, [("X-Request-Id", "victim")])
    assert rest_b.count("data:") == 41 and b.finished and not b.aborted, (rest_b[-200:], b)
    assert a.tag != b.tag and "victim" not in (a.tag, b.tag), (a.tag, b.tag)


# -- routes that generate nothing -------------------------------------------------------------

@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("deployment", sorted(KINDS), indirect=True)
async def test_non_generating_route_disconnect_calls_no_abort(
        deployment: Deployment, stalls: Stalls, how: str) -> None:
    d, fake = deployment, deployment.fake
    async with raw_client(d.port, stalls) as c:
        c.send("GET", "/v1/models?hold=30")
        await until(stalls, fake, lambda: bool(fake.model_requests), "the request to arrive")
        at = c.disconnect(how)
        seen = fake.model_requests[0]
        await until(stalls, fake, lambda: seen.closed_at is not None, "the upstream close")
    assert seen.closed_at is not None
    stalls.check("the upstream close", at, seen.closed_at)
    assert await quiet(stalls, d, lambda: bool(fake.calls)), f"no abort: {fake.calls}"
    counts = disconnect_counts(await metrics(d.admin))
    assert counts == {("/", "awaiting_response"): 1}, counts


# -- real clients: aiohttp and the openai SDK -------------------------------------------------

@pytest.mark.parametrize("deployment", sorted(KINDS), indirect=True)
async def test_openai_sdk_closing_a_stream(deployment: Deployment, stalls: Stalls) -> None:
    d = deployment
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused",
                                max_retries=0)
    query = {"tokens": "3000", "interval": "0.01"}
    stream = await client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_query=query)
    async for _ in stream:
        break
    at = time.monotonic()
    await stream.close()
    await client.close()
    await check_stopped(stalls, d, d.fake.works[0], at, "openai sdk")


@pytest.mark.parametrize("deployment", sorted(KINDS), indirect=True)
async def test_aiohttp_client_cancelled_while_waiting(deployment: Deployment,
                                                      stalls: Stalls) -> None:
    d = deployment
    path, body = d.kind.routes["chat"]
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(
            f"http://127.0.0.1:{d.port}{path}?tokens=3000&interval=0.01",
            json={**body, "stream": False}))
        await until(stalls, d.fake, lambda: bool(d.fake.works), "the request to reach the engine")
        at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await check_stopped(stalls, d, d.fake.works[0], at, "aiohttp cancel")


# -- the cancel API and deadlines: the client stays, the work stops ----------------------------

ENDINGS = {  # how the request ends early -> (SDK status for a JSON answer, error type)
    "cancel_api": (499, "cancelled"),
    "deadline": (504, "deadline_exceeded"),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("deployment", sorted(KINDS), indirect=True)
async def test_cancel_api_and_deadline_stop_the_work_of_a_client_that_stays(
        deployment: Deployment, stalls: Stalls, ending: str, stream: bool) -> None:
    """The client (the openai SDK, its default retries on) stays connected; the admin cancel
    API or an ``X-Sidecar-Deadline-S`` of 0.5 s ends its request: the SDK raises the error the
    sidecar sent (mid-stream: the final SSE error event; else the 499/504 JSON) and does not
    retry, and the engine's work stops as after a disconnect (see the module docstring)."""
    d, fake = deployment, deployment.fake
    headers = {"X-Sidecar-Deadline-S": "0.5"} if ending == "deadline" else {}
    status, kind = ENDINGS[ending]
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused",
                                  default_headers=headers) as client:
        async def call() -> None:
            create = client.chat.completions.create
            messages: Any = [{"role": "user", "content": "hi"}]
            query = {"tokens": "3000", "interval": "0.01"}
            if stream:
                async for _ in await create(model="fake", messages=messages, stream=True,
                                            extra_query=query):
                    pass
            else:
                await create(model="fake", messages=messages, extra_query=query)

        task = asyncio.ensure_future(call())
        await until(stalls, fake, lambda: bool(fake.works) and (
            not stream or fake.works[0].events > 0), "the request to be generating")
        victim = fake.works[0]
        at = victim.started + 0.5
        if ending == "cancel_api":
            at = time.monotonic()
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{d.admin}/v1/requests/{victim.request_id_header}/cancel"
            ) as r:
                answer = await r.json()
            assert r.status == 200 and answer["cancelled"] is True, (r.status, answer)
        with pytest.raises(openai.APIError) as caught:
            await stalls.wait(task, "the SDK call to end")
        await check_stopped(stalls, d, victim, at, f"{ending} {'stream' if stream else 'json'}")
    error = caught.value
    assert isinstance(error.body, dict) and error.body.get("type") == kind, error.body
    if not stream:
        assert isinstance(error, openai.APIStatusError) and error.status_code == status, error
    assert len(fake.works) == 1, f"the SDK must not retry an ended request: {fake.works}"


# -- the production entrypoint: python -m sidecar ---------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_cli_stops_the_work_of_a_client_that_left(kind: str, tmp_path: Path,
                                                        stalls: Stalls) -> None:
    spec = KINDS[kind]
    fake = spec.make()
    await fake.start()
    try:
        tree = config_tree(fake.url, engines={"local": spec.engine(fake.url)})
        async with cli_process(tmp_path, tree) as cli:
            d = Deployment(kind, spec, fake, cli.proxy_port, cli.admin_port)
            path, body = spec.routes["chat"]
            async with raw_client(d.port, stalls) as c:
                c.send("POST", f"{path}?tokens=3000&interval=0.01", request_body(body, True))
                assert (await c.head())[0] == 200
                await c.read_until(b"data:")
                await until(stalls, fake, lambda: bool(fake.works), "the engine to get it")
                at = c.disconnect("rst")
                await check_stopped(stalls, d, fake.works[0], at, f"cli {kind}")
            assert API_KEY not in cli.stderr, "the abort key appeared in the log"
    finally:
        await fake.stop()
