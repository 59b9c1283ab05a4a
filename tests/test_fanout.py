"""Fan-out: a route that names several abort engines (``routes[].abort``) aborts each of them,
concurrently, with the ids its own kind derives; no engine outside the list is called.

The deployment is the one of ``config/examples/fanout.yaml``: the sidecar proxies to a router of
kind ``openai`` (it has no abort endpoint) and aborts the prefill and decode engines of kind
``vllm`` behind it. A fourth engine (``bystander``, vllm) serves another route, without a list.
All four are :class:`tests.fakes.engine.FakeEngine` servers on 127.0.0.1; the router streams the
response (a real router forwards the request, with the sidecar's ``X-Request-Id``, to both
engines; the fakes stand in for that: they only receive aborts). The sidecar runs through the
production wiring (``start_sidecar``: :func:`sidecar.server.start`).

Timing as in :mod:`tests.test_cancel`: event-driven waits with generous limits, process stalls
excluded, latencies compared with ``GUARD_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from engine import build_adapters
from sidecar.config import Settings, load_config, parse_config
from sidecar.errors import ConfigError
from sidecar.server import Servers
from tests.fakes.engine import HANG_ABORT_PATH, FakeEngine
from tests.fakes.kinds import OpenAIEngine, SGLangEngine, VLLMEngine, Work
from tests.harness.support import (
    API_KEY,
    COMPLETIONS,
    GUARD_S,
    Stalls,
    metrics,
    ms,
    no_event,
    raw_client,
    request_body,
    samples,
    settle,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"prompt": ["a", "b", "c"]}  # a 3-prompt /v1/completions: cmpl-{id}-0..2
ABORTED = ("prefill", "decode")
PHASES = {"mid_stream": "?tokens=1000&interval=0.01", "queued": "?first_byte_delay=30"}


def has_stopped(work: Work) -> bool:
    return work.stopped_at is not None


def expected_ids(sidecar_id: str) -> list[str]:
    return [f"cmpl-{sidecar_id}-{i}" for i in range(3)]


class Deployment:
    """The four fake engines by name: ``router`` (openai, proxied), ``prefill`` and
    ``decode`` (vllm, aborted by the fan-out route ``/``), ``bystander`` (vllm, the engine of
    route ``/v1/chat``, which has no ``abort`` list)."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.engines = engines

    def __getitem__(self, name: str) -> FakeEngine:
        return self.engines[name]

    def settings(self, abort: dict[str, dict[str, Any]] | None = None) -> Settings:
        """The fan-out config; ``abort`` adds to an engine's ``abort`` section."""
        def vllm(name: str) -> dict[str, Any]:
            section = {"api_key": API_KEY, "timeout_s": 2.0, "resend_window_s": 0,
                       **(abort or {}).get(name, {})}
            return {"kind": "vllm", "url": self[name].url, "abort": section}

        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "engines": {"router": {"kind": "openai", "url": self["router"].url},
                        **{name: vllm(name) for name in ("prefill", "decode", "bystander")}},
            "routes": [{"prefix": "/", "engine": "router", "abort": list(ABORTED)},
                       {"prefix": "/v1/chat", "engine": "bystander"}],
        }
        return parse_config(yaml.safe_dump(tree), "<test>", env={})


@pytest_asyncio.fixture
async def deployment() -> AsyncIterator[Deployment]:
    engines = {name: FakeEngine() for name in ("router", "prefill", "decode", "bystander")}
    for fake in engines.values():
        await fake.start()
    yield Deployment(engines)
    for fake in engines.values():
        await fake.stop()


class AccessLines(logging.Handler):
    """The access lines' fields, by sidecar request id."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[str, dict[str, Any]] = {}
        self.arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "access", {}))
        self.lines[fields.get("request_id", "")] = fields
        self.arrived.set()


@pytest.fixture(name="access_lines")
def access_lines_handler() -> Iterator[AccessLines]:
    logger = logging.getLogger("sidecar.access")
    handler, level = AccessLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def disconnect_mid_request(servers: Servers, router: FakeEngine, stalls: Stalls,
                                 phase: str) -> tuple[str, float]:
    """A 3-prompt completion through the sidecar, left by its client (RST) while streaming or
    while queued. Returns the sidecar request id (as the router saw it) and when the client
    left."""
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + PHASES[phase], request_body(PROMPTS, stream=True),
                    [("X-Request-Id", "client-chosen")])
        if phase == "mid_stream":
            status, _ = await client.head()
            assert status == 200, f"expected a 200 stream, got {status}"
            await client.read_until(b"data:")
        else:
            await stalls.wait(router.record.started_event.wait(), "the router to get the request")
        at = client.disconnect("rst")
        await stalls.wait(router.record.closed_event.wait(), "the router connection to close")
    sidecar_id = router.record.generations[0].request_id
    assert sidecar_id is not None and sidecar_id != "client-chosen", (
        f"the router must see the sidecar's id, got {sidecar_id!r}")
    return sidecar_id, at


async def both_aborts(deployment: Deployment, stalls: Stalls) -> None:
    for name in ABORTED:
        await stalls.wait(deployment[name].record.abort_event.wait(), f"an abort call at {name}")


def aborted_requests(values: dict[tuple[str, frozenset[tuple[str, str]]], float]
                     ) -> dict[tuple[str, str], float]:
    return {(dict(k)["engine"], dict(k)["outcome"]): v
            for k, v in samples(values, "cancel_sidecar_aborted_requests_total").items()}


# -- each listed engine gets its abort ----------------------------------------------------------

@pytest.mark.parametrize("phase", sorted(PHASES))
async def test_disconnect_aborts_every_listed_engine_with_its_ids(
        deployment: Deployment, start_sidecar: Callable[..., Any], stalls: Stalls,
        access_lines: AccessLines, phase: str) -> None:
    servers: Servers = await start_sidecar(deployment.settings())
    sidecar_id, at = await disconnect_mid_request(servers, deployment["router"], stalls, phase)
    await both_aborts(deployment, stalls)
    await settle(servers.proxy_port)
    arrivals = {}
    for name in ABORTED:
        aborts = deployment[name].record.aborts
        assert [a.ids for a in aborts] == [expected_ids(sidecar_id)], (
            f"{name}: expected one abort call naming {expected_ids(sidecar_id)}, got "
            f"{[a.ids for a in aborts]}")
        assert aborts[0].authorization == f"Bearer {API_KEY}", aborts[0].authorization
        arrivals[name] = stalls.check(f"the abort at {name}", at, aborts[0].at)
    for name in ("router", "bystander"):
        assert not deployment[name].watch.on("/inference/v1/abort_requests"), (
            f"{name} is in no abort list, yet it got an abort call")
    print(f"[{phase}] " + ", ".join(f"{n} abort {ms(t)}" for n, t in arrivals.items()))
    counts = aborted_requests(await metrics(servers.admin_port or 0))
    assert counts == {("prefill", "accepted"): 1, ("decode", "accepted"): 1}, (
        f"expected one aborted request counted per engine, got {counts}")
    await stalls.wait(access_lines.arrived.wait(), "the access line")
    line = access_lines.lines.get(sidecar_id, {})
    assert (line.get("engine"), line.get("abort")) == ("router", "accepted"), (
        f"expected the access line of {sidecar_id} with engine router and abort ok, got {line}")


MIXED_PHASES = {"mid_stream": ("?tokens=3000&interval=0.01", True),
                "queued": ("?first_byte_delay=30", True),
                "non_streaming": ("?tokens=3000&interval=0.01", False)}


@pytest.mark.parametrize("phase", sorted(MIXED_PHASES))
async def test_mixed_kinds_each_stop_the_work_under_their_own_ids(
        start_sidecar: Callable[..., Any], stalls: Stalls, phase: str) -> None:
    """A router (kind openai) forwards a 3-prompt completion to a vLLM prefill engine and an
    SGLang decode engine (``tests/fakes/kinds.py``: the request runs on both, under each kind's
    own ids, and goes on after the router's connection closes). The client leaves: each engine
    gets its own kind's abort (vLLM one call with ``cmpl-{id}-0..2``, SGLang one call per
    ``{id}_{i}``, the ``rid`` the sidecar wrote into the body), and its work stops."""
    prefill, decode = VLLMEngine(API_KEY), SGLangEngine(API_KEY)
    router = OpenAIEngine(forward_to=(prefill, decode))
    for fake in (prefill, decode, router):
        await fake.start()
    try:
        abort = {"api_key": API_KEY, "timeout_s": 2.0, "resend_window_s": 0}
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
            "engines": {"router": {"kind": "openai", "url": router.url},
                        "prefill": {"kind": "vllm", "url": prefill.url, "abort": abort},
                        "decode": {"kind": "sglang", "url": decode.url, "abort": abort}},
            "routes": [{"prefix": "/", "engine": "router", "abort": ["prefill", "decode"]}],
        }
        servers: Servers = await start_sidecar(parse_config(yaml.safe_dump(tree), "<test>",
                                                            env={}))
        query, stream = MIXED_PHASES[phase]
        async with raw_client(servers.proxy_port, stalls) as client:
            client.send("POST", COMPLETIONS + query, request_body(PROMPTS, stream),
                        [("X-Request-Id", "client-chosen")])
            if phase == "mid_stream":
                await client.head()
                await client.read_until(b"data:")
            await stalls.wait(router.watch.until(lambda: bool(router.works), 3600),
                              "the router to get the request")
            at = client.disconnect("rst")
            works = {"prefill": prefill.works[0], "decode": decode.works[0]}
            for name, fake in (("prefill", prefill), ("decode", decode)):
                work = works[name]
                await stalls.wait(fake.watch.until(partial(has_stopped, work), 3600),
                                  f"the work at {name} to stop")
        await settle(servers.proxy_port)
        sid = works["prefill"].request_id_header
        assert sid is not None and sid != "client-chosen" and works["decode"].tag == sid, (
            sid, works["decode"].tag)
        assert [c.ids for c in prefill.calls] == [[f"cmpl-{sid}-{i}" for i in range(3)]], (
            [c.ids for c in prefill.calls])
        assert sorted(c.ids[0] for c in decode.calls) == [f"{sid}_{i}" for i in range(3)], (
            [c.ids for c in decode.calls])
        assert router.calls == [] and router.unknown_paths == [], router.unknown_paths
        stopped = {n: stalls.check(f"the work at {n} to stop", at, w.stopped_at or 0)
                   for n, w in works.items()}
        print(f"[mixed {phase}] " + ", ".join(f"{n} stopped {ms(t)}" for n, t in stopped.items()))
    finally:
        for fake in (router, prefill, decode):
            await fake.stop()


async def test_fanout_calls_are_concurrent(deployment: Deployment,
                                           start_sidecar: Callable[..., Any],
                                           stalls: Stalls) -> None:
    """prefill (listed first) holds its abort call unanswered; decode's call still arrives,
    within GUARD_S of prefill's: the calls do not wait for each other's answer."""
    gate = deployment["prefill"].record.abort_gate = asyncio.Event()
    servers: Servers = await start_sidecar(deployment.settings())
    sidecar_id, at = await disconnect_mid_request(servers, deployment["router"], stalls,
                                                  "mid_stream")
    await both_aborts(deployment, stalls)
    prefill, decode = (deployment[n].record.aborts[0] for n in ABORTED)
    assert not gate.is_set(), "prefill's call must still be unanswered when decode's arrives"
    gate.set()
    gap = abs(decode.at - prefill.at) - stalls.within(min(prefill.at, decode.at),
                                                        max(prefill.at, decode.at))
    assert gap < GUARD_S, (
        f"expected both abort calls to start together; they arrived {ms(gap)} apart")
    for record in (prefill, decode):
        assert record.ids == expected_ids(sidecar_id), record.ids
    print(f"decode's call arrived {ms(decode.at - prefill.at)} after prefill's "
          f"(prefill unanswered), {ms(decode.at - at)} after the client left")


@pytest.mark.parametrize("fault", ["http_500", "hang"])
async def test_one_failing_engine_does_not_stop_the_others(
        deployment: Deployment, start_sidecar: Callable[..., Any], stalls: Stalls,
        access_lines: AccessLines, fault: str) -> None:
    abort: dict[str, dict[str, Any]]
    if fault == "http_500":
        deployment["prefill"].record.abort_status = 500
        abort = {"prefill": {"retries": 0}}
    else:
        abort = {"prefill": {"path": HANG_ABORT_PATH, "timeout_s": 0.5, "retries": 0}}
    servers: Servers = await start_sidecar(deployment.settings(abort))
    sidecar_id, at = await disconnect_mid_request(servers, deployment["router"], stalls,
                                                  "mid_stream")
    await both_aborts(deployment, stalls)
    decode = deployment["decode"].record.aborts
    assert [a.ids for a in decode] == [expected_ids(sidecar_id)], [a.ids for a in decode]
    stalls.check("the abort at decode", at, decode[0].at)
    await stalls.wait(access_lines.arrived.wait(), "the access line")
    outcome = "timeout" if fault == "hang" else "http_500"
    line = access_lines.lines.get(sidecar_id, {})
    assert line.get("abort") == outcome, (
        f"expected the access line's abort to be the failed engine's {outcome}, got {line}")
    counts = aborted_requests(await metrics(servers.admin_port or 0))
    assert counts == {("prefill", outcome): 1, ("decode", "accepted"): 1}, counts


async def test_completed_request_aborts_nothing_anywhere(
        deployment: Deployment, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers: Servers = await start_sidecar(deployment.settings())
    url = f"http://127.0.0.1:{servers.proxy_port}{COMPLETIONS}?tokens=5"
    async with aiohttp.ClientSession() as session, session.post(
            url, json={**PROMPTS, "stream": True}) as response:
        text = await response.text()
    assert response.status == 200 and text.endswith("data: [DONE]\n\n"), text[-200:]
    assert await no_event(deployment["prefill"].record.abort_event), "prefill got an abort"
    await settle(servers.proxy_port)
    calls = {name: fake.record.aborts for name, fake in deployment.engines.items()}
    assert not any(calls.values()), f"a completed request must abort nothing, got {calls}"


async def test_route_without_abort_list_aborts_its_own_engine_only(
        deployment: Deployment, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """The single-engine default beside a fan-out route: ``/v1/chat`` -> bystander, no
    ``abort`` key, aborts bystander only."""
    servers: Servers = await start_sidecar(deployment.settings())
    bystander = deployment["bystander"]
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", "/v1/chat/completions?tokens=1000&interval=0.01",
                    request_body({"messages": []}, stream=True))
        status, head = await client.head()
        assert status == 200, f"expected a 200 stream, got {status}"
        await client.read_until(b"data:")
        client.disconnect("rst")
        await stalls.wait(bystander.record.abort_event.wait(), "an abort call at bystander")
    await settle(servers.proxy_port)
    assert [a.ids for a in bystander.record.aborts] == [[f"chatcmpl-{head['X-Request-Id']}"]], (
        [a.ids for a in bystander.record.aborts])
    others = {n: f.record.aborts for n, f in deployment.engines.items() if n != "bystander"}
    assert not any(others.values()), f"only bystander may be aborted, got {others}"


async def test_client_cannot_call_an_abort_engines_endpoint_through_the_router(
        deployment: Deployment, start_sidecar: Callable[..., Any]) -> None:
    """The router (kind openai) has no abort path of its own, but it may forward a client's
    call to prefill's or decode's: the route refuses their abort paths too."""
    servers: Servers = await start_sidecar(deployment.settings())
    url = f"http://127.0.0.1:{servers.proxy_port}/inference/v1/abort_requests"
    async with aiohttp.ClientSession() as session, session.post(
            url, json={"request_ids": ["someone-else"]}) as response:
        assert response.status == 403, f"expected 403, got {response.status}"
    assert not deployment["router"].watch.seen, "the router must not see the call"


# -- /readyz ------------------------------------------------------------------------------------

async def test_readyz_probes_every_abort_engine(deployment: Deployment,
                                                start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(deployment.settings())
    url = f"http://127.0.0.1:{servers.admin_port}/readyz"
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            ready = (response.status, await response.json())
        assert ready[0] == 200, f"expected ready with every engine up, got {ready}"
        deployment["decode"].record.abort_status = 403
        async with session.get(url) as response:
            status, body = response.status, await response.json()
    assert status == 503 and body["ready"] is False, (status, body)
    assert "--enable-scale-out" in body["engines"]["decode"], body
    assert {n: v for n, v in body["engines"].items() if n != "decode"} == {
        "router": "ok", "prefill": "ok", "bystander": "ok"}, body


# -- config -------------------------------------------------------------------------------------

def _config(routes: list[dict[str, Any]]) -> str:
    return yaml.safe_dump({
        "engines": {"router": {"kind": "openai", "url": "http://127.0.0.1:8000"},
                    "prefill": {"kind": "vllm", "url": "http://127.0.0.1:8100"},
                    "decode": {"kind": "vllm", "url": "http://127.0.0.1:8200"}},
        "routes": routes})


@pytest.mark.parametrize(("abort", "problem"), [
    (["prefill", "nowhere"], ("routes.0.abort.1", "names no defined engine")),
    (["router", "decode"], ("routes.0.abort.0", "no abort endpoint")),
    (["prefill", "decode", "prefill"], ("routes.0.abort.2", "duplicates routes.0.abort.0")),
    ([], ("routes.0.abort", "at least 1")),
])
def test_config_errors_are_located(abort: list[str], problem: tuple[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config([{"prefix": "/", "engine": "router", "abort": abort}]),
                     "<test>", env={})
    found = [(p.location, p.message) for p in info.value.problems]
    assert len(found) == 1 and found[0][0] == problem[0] and problem[1] in found[0][1], (
        f"expected one problem at {problem[0]} saying {problem[1]!r}, got {found}")


def test_abort_list_is_complete_and_defaults_to_the_engine() -> None:
    settings = parse_config(_config([
        {"prefix": "/v1", "engine": "router", "abort": ["decode", "prefill"]},
        {"prefix": "/p", "engine": "prefill"},
        {"prefix": "/", "engine": "router"}]), "<test>", env={})
    assert [r.abort_engines() for r in settings.routes] == [
        ("decode", "prefill"), ("prefill",), ("router",)], settings.routes


def test_example_config_is_valid() -> None:
    settings = load_config(REPO / "config" / "examples" / "fanout.yaml", env={})
    engines = {n: (e.kind.value, str(e.url)) for n, e in settings.engines.items()}
    assert engines == {"router": ("openai", "http://127.0.0.1:8000/"),
                       "prefill": ("vllm", "http://127.0.0.1:8100/"),
                       "decode": ("vllm", "http://127.0.0.1:8200/")}, engines
    assert [(r.engine, r.abort_engines()) for r in settings.routes] == [
        ("router", ("prefill", "decode"))], settings.routes
    assert all(a.aborts for n, a in build_adapters(settings.engines).items() if n != "router")
