"""Per-request abort targets (``routes[].abort_from_header``): llm-d's prefill pod, named per
request in ``x-prefiller-host-port``, is aborted too when the client leaves, with the ids the
prefill leg runs under there, and only if the header's value is allowed.

The deployment is the decode pod of ``config/examples/llm-d.yaml``: client (raw socket) ->
cancel-sidecar -> the routing sidecar (:class:`tests.fakes.routing_sidecar.RoutingSidecar`, a fake
written from llm-d's source: it sends the prefill leg to the engine the header names, as
llm-d's NIXL v2 or SGLang connector does, and the decode leg to the local decoder) -> a prefill
engine and a decode engine of one kind (:mod:`tests.fakes.kinds`: they go on with a request
whose connection closed until it is aborted by the right ids). The sidecar proxies to the
routing sidecar (kind ``openai``), aborts the decoder (``routes[].abort``) and, per request, the
engine the header names, with the kind and abort settings of the template engine ``prefill``
(whose own url, ``http://prefill.invalid:8000``, is never called). Production wiring
(``start_sidecar``: :func:`sidecar.server.start`).

What is right when (each checked at the fake engines' records):

=====================  ========================================================================
client leaves           the prefill engine
=====================  ========================================================================
during the prefill      gets an abort naming the ids its leg runs under, and stops
after the prefill leg   gets the same call, a no-op there (its leg already finished; vLLM and
finished (decoding)     SGLang ignore ids they no longer run): the sidecar cannot see from the
                        decode pod whether that leg is done (with SGLang, Mooncake and P2P it
                        runs concurrently with decode), and an abort for a finished id is free
after the end           no call anywhere
=====================  ========================================================================

A header the sidecar refuses (off the allowlist, no port, another scheme, a userinfo, a path,
several values) is never called, even while the routing sidecar runs a prefill leg there; it
is counted in ``cancel_sidecar_header_abort_targets_total{verdict}``, logged without the value's
secrets, and the request is served with the header forwarded unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
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
from sidecar.targets import MAX_TARGETS, HeaderTargets, parse_value
from tests.fakes.kinds import KindEngine, SGLangEngine, VLLMEngine
from tests.fakes.routing_sidecar import PREFILL_HEADER, RoutingSidecar
from tests.harness.cli_process import cli_process
from tests.harness.support import (
    API_KEY,
    COMPLETIONS,
    FOREVER,
    QUIET_S,
    Stalls,
    metrics,
    ms,
    raw_client,
    request_body,
    samples,
    settle,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"prompt": ["a", "b", "c"]}  # vLLM: cmpl-{id}-0..2; SGLang: {id}_0..2
TEMPLATE_URL = "http://prefill.invalid:8000"  # the template's url: never called
KINDS = ("vllm", "sglang")
METRIC = "cancel_sidecar_header_abort_targets_total"


def expected_ids(kind: str, sid: str) -> set[str]:
    return ({f"cmpl-{sid}-{i}" for i in range(3)} if kind == "vllm"
            else {f"{sid}_{i}" for i in range(3)})


@dataclass
class Pod:
    """A decode pod and one prefill pod: the engines, the routing sidecar, the config."""

    kind: str
    prefill: KindEngine
    decode: KindEngine
    routing: RoutingSidecar

    @property
    def prefill_host_port(self) -> str:
        return self.prefill.url.removeprefix("http://")

    def settings(self, allow: list[str] | None = None) -> Settings:
        return parse_config(yaml.safe_dump(self.tree(allow)), "<test>", env={})

    def tree(self, allow: list[str] | None = None) -> dict[str, Any]:
        abort = {"api_key": API_KEY, "timeout_s": 2.0}
        return {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "engines": {
                "routing-sidecar": {"kind": "openai", "url": self.routing.url},
                "decode": {"kind": self.kind, "url": self.decode.url, "abort": abort},
                "prefill": {"kind": self.kind, "url": TEMPLATE_URL, "abort": abort}},
            "routes": [{"prefix": "/", "engine": "routing-sidecar", "abort": ["decode"],
                        "abort_from_header": {"header": PREFILL_HEADER, "engine": "prefill",
                                              "allow": allow or ["127.0.0.0/8"]}}],
        }

    def union(self, engine: KindEngine) -> set[str]:
        return {i for call in engine.calls for i in call.ids}


@pytest_asyncio.fixture(params=KINDS)
async def pod(request: pytest.FixtureRequest) -> AsyncIterator[Pod]:
    kind: str = request.param
    if kind == "vllm":  # its prefill leg asks for max_tokens 1 (NIXL v2)
        prefill: KindEngine = VLLMEngine(API_KEY)
        decode: KindEngine = VLLMEngine(API_KEY)
    else:  # SGLang's prefill server ends every request after its prefill
        prefill, decode = SGLangEngine(API_KEY, prefill_only=True), SGLangEngine(API_KEY)
    await prefill.start()
    await decode.start()
    routing = RoutingSidecar(decode.url, "nixlv2" if kind == "vllm" else "sglang")
    await routing.start()
    yield Pod(kind, prefill, decode, routing)
    for server in (routing, prefill, decode):
        await server.stop()


@pytest_asyncio.fixture
async def vllm_pod() -> AsyncIterator[Pod]:
    prefill, decode = VLLMEngine(API_KEY), VLLMEngine(API_KEY)
    await prefill.start()
    await decode.start()
    routing = RoutingSidecar(decode.url, "nixlv2")
    await routing.start()
    yield Pod("vllm", prefill, decode, routing)
    for server in (routing, prefill, decode):
        await server.stop()


async def until(stalls: Stalls, engine: KindEngine | RoutingSidecar, predicate: Callable[[], bool],
                what: str) -> None:
    await stalls.wait(engine.watch.until(predicate, FOREVER), what)


def verdicts(values: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, float]:
    return {dict(k)["verdict"]: v for k, v in samples(values, METRIC).items()}


def check_calls(pod: Pod, engine: KindEngine, sid: str, where: str) -> None:
    """Every call at ``engine`` names only the request's ids, all of them, with the key."""
    want = expected_ids(pod.kind, sid)
    assert engine.calls and pod.union(engine) == want, (
        f"{where}: expected abort calls naming {sorted(want)}, got "
        f"{[c.ids for c in engine.calls]}")
    assert all(set(c.ids) <= want and c.status == 200 and c.authorization == f"Bearer {API_KEY}"
               for c in engine.calls), [(c.ids, c.status, c.authorization) for c in engine.calls]


# -- the prefill engine gets its abort exactly when it should ---------------------------------

async def test_leaving_during_prefill_aborts_the_prefill_pod_with_its_legs_ids(
        pod: Pod, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers: Servers = await start_sidecar(pod.settings())
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + "?first_byte_delay=30&tokens=1000",
                    request_body(PROMPTS, stream=True), [(PREFILL_HEADER, pod.prefill_host_port)])
        await until(stalls, pod.prefill, lambda: bool(pod.prefill.works),
                    "the prefill leg at the prefill engine")
        at = client.disconnect("rst")
        work = pod.prefill.works[0]
        await until(stalls, pod.prefill, lambda: work.stopped_at is not None,
                    "the prefill work to stop")
    await settle(servers.proxy_port)
    forwarded = pod.routing.requests[0]
    sid = forwarded.legs[0].request_ids[0]
    assert forwarded.header_values == [pod.prefill_host_port], (
        f"expected the header forwarded unchanged, got {forwarded.header_values}")
    prefill_leg = forwarded.legs[0]
    if pod.kind == "vllm":  # NIXL v2: Header.Add of its own uuid; the engine takes the first
        assert len(prefill_leg.request_ids) == 2 and prefill_leg.body["max_tokens"] == 1, (
            f"expected llm-d's prefill leg (two X-Request-Id values, max_tokens 1), got "
            f"{prefill_leg.request_ids} {prefill_leg.body}")
        assert work.request_id_header == sid, (work.request_id_header, sid)
        assert [leg.role for leg in forwarded.legs] == ["prefill"], forwarded.legs
    else:  # SGLang: the sidecar's rid in the body, both legs at once
        assert work.tag == sid and pod.decode.works[0].stopped_at is not None, (
            work.tag, sid, pod.decode.works)
    check_calls(pod, pod.prefill, sid, "the prefill engine")
    took = stalls.check("the prefill work to stop", at, work.stopped_at or 0)
    counts = verdicts(await metrics(servers.admin_port or 0))
    assert counts == {"allowed": 1}, f"expected one allowed header target, got {counts}"
    print(f"[{pod.kind}] prefill stopped {ms(took)} after the client left")


async def test_leaving_during_decode_sends_the_prefill_pod_a_no_op_abort(
        pod: Pod, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """The prefill leg has finished (one token) and the decoder streams: the prefill engine
    gets the same call, which finds nothing running there; the decode work stops."""
    servers: Servers = await start_sidecar(pod.settings())
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + "?tokens=1000&interval=0.01",
                    request_body(PROMPTS, stream=True), [(PREFILL_HEADER, pod.prefill_host_port)])
        status, _ = await client.head()
        assert status == 200, f"expected a 200 stream, got {status}"
        await client.read_until(b"data:")
        await until(stalls, pod.prefill, lambda: bool(pod.prefill.works)
                    and pod.prefill.works[0].finished, "the prefill leg to finish")
        at = client.disconnect("rst")
        decode_work = pod.decode.works[0]
        await until(stalls, pod.decode, lambda: decode_work.stopped_at is not None,
                    "the decode work to stop")
        await until(stalls, pod.prefill, lambda: bool(pod.prefill.calls),
                    "the abort call at the prefill engine")
    await settle(servers.proxy_port)
    sid = pod.routing.requests[0].legs[0].request_ids[0]
    check_calls(pod, pod.prefill, sid, "the prefill engine")
    check_calls(pod, pod.decode, sid, "the decode engine")
    prefill_work = pod.prefill.works[0]
    assert prefill_work.finished and prefill_work.stopped_at is None and not prefill_work.aborted, (
        f"expected the finished prefill work untouched by the abort, got {prefill_work}")
    stalls.check("the decode work to stop", at, decode_work.stopped_at or 0)


async def test_after_the_end_nothing_is_called(
        pod: Pod, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    servers: Servers = await start_sidecar(pod.settings())
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + "?tokens=5", request_body(PROMPTS, stream=True),
                    [(PREFILL_HEADER, pod.prefill_host_port)])
        status, _ = await client.head()
        assert status == 200, f"expected a 200 stream, got {status}"
        await client.read_until(b"data: [DONE]\n\n")
        client.disconnect("rst")
    await asyncio.sleep(QUIET_S)
    await settle(servers.proxy_port)
    assert pod.prefill.calls == [] and pod.decode.calls == [], (
        f"a complete request must abort nothing, got prefill {pod.prefill.calls}, decode "
        f"{pod.decode.calls}")
    assert all(w.finished for w in (*pod.prefill.works, *pod.decode.works)), (
        pod.prefill.works, pod.decode.works)
    counts = verdicts(await metrics(servers.admin_port or 0))
    assert counts == {}, f"expected no header target counted without an early end, got {counts}"


async def test_a_deadline_during_prefill_aborts_the_prefill_pod_too(
        vllm_pod: Pod, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """Every early end that aborts takes the same path (``Cancellation.abort_plan``): here the
    client's own deadline (``X-Sidecar-Deadline-S``) passes while the prefill engine works."""
    pod = vllm_pod
    servers: Servers = await start_sidecar(pod.settings())
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + "?first_byte_delay=30&tokens=1000",
                    request_body(PROMPTS, stream=True),
                    [(PREFILL_HEADER, pod.prefill_host_port), ("X-Sidecar-Deadline-S", "0.5")])
        status, _ = await client.head()
        assert status == 504, f"expected the deadline's 504, got {status}"
    work = pod.prefill.works[0]
    await until(stalls, pod.prefill, lambda: work.stopped_at is not None,
                "the prefill work to stop")
    sid = pod.routing.requests[0].legs[0].request_ids[0]
    check_calls(pod, pod.prefill, sid, "the prefill engine")
    counts = verdicts(await metrics(servers.admin_port or 0))
    assert counts == {"allowed": 1}, f"expected one allowed header target, got {counts}"


# -- a refused header is never called ---------------------------------------------------------

# name -> (value, given the prefill engine's host:port; allowlist; does llm-d send a prefill leg)
REFUSED: dict[str, tuple[Callable[[str], str], list[str], bool]] = {
    "not_allowed": (lambda hp: hp, ["10.0.0.0/8", "prefill.test"], True),
    "userinfo": (lambda hp: f"admin:hunter2@{hp}", ["127.0.0.0/8"], True),
    "several_values": (lambda hp: f"{hp},{hp}", ["127.0.0.0/8"], True),
    "scheme": (lambda hp: f"https://{hp}", ["127.0.0.0/8"], False),
    "malformed": (lambda hp: hp.partition(":")[0], ["127.0.0.0/8"], False),
    "path": (lambda hp: f"{hp}/v1", ["127.0.0.0/8"], False),
}


@pytest.mark.parametrize("reason", sorted(REFUSED))
async def test_refused_header_is_never_called_counted_and_served(
        vllm_pod: Pod, start_sidecar: Callable[..., Any], stalls: Stalls,
        caplog: pytest.LogCaptureFixture, reason: str) -> None:
    caplog.set_level(logging.INFO)
    pod = vllm_pod
    make, allow, prefill_leg = REFUSED[reason]
    value = make(pod.prefill_host_port)
    servers: Servers = await start_sidecar(pod.settings(allow))
    url = f"http://127.0.0.1:{servers.proxy_port}{COMPLETIONS}?tokens=5"
    async with aiohttp.ClientSession() as session, session.post(
            url, json={**PROMPTS, "stream": True}, headers={PREFILL_HEADER: value}) as response:
        text = await response.text()
    assert response.status == 200 and text.endswith("data: [DONE]\n\n"), (
        f"expected the request served, got {response.status} {text[-200:]!r}")
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", COMPLETIONS + "?first_byte_delay=30&tokens=1000",
                    request_body(PROMPTS, stream=True), [(PREFILL_HEADER, value)])
        if prefill_leg:  # the routing sidecar runs a prefill leg there: it must not be aborted
            await until(stalls, pod.prefill, lambda: len(pod.prefill.works) == 2,
                        "the prefill leg at the prefill engine")
        else:
            await until(stalls, pod.decode, lambda: len(pod.decode.works) == 2,
                        "the request at the decoder")
        client.disconnect("rst")
        await until(stalls, pod.decode, lambda: bool(pod.decode.calls),
                    "the abort call at the decoder (routes[].abort)")
    await asyncio.sleep(QUIET_S)
    await settle(servers.proxy_port)
    seen = [r.header_values for r in pod.routing.requests]
    assert seen == [[value], [value]], f"expected the header forwarded unchanged, got {seen}"
    assert pod.prefill.calls == [], (
        f"a refused header ({reason}) must never be called, got {pod.prefill.calls}")
    if prefill_leg:
        assert pod.prefill.works[1].running, "the prefill leg goes on: nothing may abort it"
    counts = verdicts(await metrics(servers.admin_port or 0))
    assert counts == {reason: 1}, f"expected one refusal counted as {reason}, got {counts}"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "hunter2" not in logged and "admin:" not in logged, "a userinfo was logged"
    assert f"({reason}" in logged or (reason == "not_allowed" and "not in the route's" in logged), (
        f"expected a warning saying {reason}")


async def test_cli_aborts_an_allowed_prefill_pod_and_never_logs_a_userinfo(
        vllm_pod: Pod, tmp_path: Path, stalls: Stalls) -> None:
    """The real ``python -m sidecar``: a request naming the prefill pod is aborted there when
    its client leaves; one naming it with ``user:password@`` is not, and the process's whole
    log never shows the password (nor the abort key)."""
    pod = vllm_pod
    tree = {**pod.tree(), "log_level": "DEBUG"}
    async with cli_process(tmp_path, tree) as cli:
        for value in (f"admin:hunter2@{pod.prefill_host_port}", pod.prefill_host_port):
            count = len(pod.prefill.works)

            def started(n: int = count) -> bool:
                return len(pod.prefill.works) > n

            def decode_aborted(n: int = count) -> bool:
                return len(pod.decode.calls) > n

            async with raw_client(cli.proxy_port, stalls) as client:
                client.send("POST", COMPLETIONS + "?first_byte_delay=30&tokens=1000",
                            request_body(PROMPTS, stream=True), [(PREFILL_HEADER, value)])
                await until(stalls, pod.prefill, started, "the prefill leg at the prefill engine")
                client.disconnect("rst")
            await until(stalls, pod.decode, decode_aborted, "the decoder's abort call")
        work = pod.prefill.works[1]
        await until(stalls, pod.prefill, lambda: work.stopped_at is not None,
                    "the allowed prefill work to stop")
        await cli.wait_log("abort target (userinfo")
    sid = pod.routing.requests[1].legs[0].request_ids[0]
    assert pod.union(pod.prefill) == expected_ids("vllm", sid), [c.ids for c in pod.prefill.calls]
    assert pod.prefill.works[0].running, "the refused (userinfo) prefill leg must not be aborted"
    assert "hunter2" not in cli.stderr and API_KEY not in cli.stderr, (
        "a userinfo password or the abort key appeared in the log")


# -- /readyz, config, the adapter cache ---------------------------------------------------------

async def test_readyz_does_not_probe_a_template_only_engine(
        vllm_pod: Pod, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(vllm_pod.settings())
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{servers.admin_port}/readyz") as response:
        status, body = response.status, await response.json()
    assert (status, body["engines"]) == (200, {"routing-sidecar": "ok", "decode": "ok"}), (
        f"expected ready with the template (url {TEMPLATE_URL}) not probed, got {status} {body}")


def _config(section: dict[str, Any]) -> str:
    return yaml.safe_dump({
        "engines": {"router": {"kind": "openai", "url": "http://127.0.0.1:8000"},
                    "prefill": {"kind": "vllm", "url": TEMPLATE_URL}},
        "routes": [{"prefix": "/", "engine": "router", "abort_from_header": section}]})


GOOD = {"header": "x-prefiller-host-port", "engine": "prefill", "allow": ["10.0.0.0/8"]}


@pytest.mark.parametrize(("change", "location", "message"), [
    ({"engine": "nowhere"}, "engine", "names no defined engine"),
    ({"engine": "router"}, "engine", "no abort endpoint"),
    ({"allow": []}, "allow", "at least 1"),
    ({"allow": ["10.0.0.1/8"]}, "allow.0", "host bits"),
    ({"allow": ["http://10.0.0.1"]}, "allow.0", "no port, scheme or path"),
    ({"allow": ["*"]}, "allow.0", "a host name"),
    ({"header": "x prefiller"}, "header", "HTTP header name"),
    ({"ports": [0]}, "ports.0", "greater than or equal to 1"),
    ({"hosts": ["a"]}, "hosts", "unknown key"),
])
def test_config_errors_are_located(change: dict[str, Any], location: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config({**GOOD, **change}), "<test>", env={})
    found = [(p.location, p.message) for p in info.value.problems]
    where = f"routes.0.abort_from_header.{location}"
    assert len(found) == 1 and found[0][0] == where and message in found[0][1], (
        f"expected one problem at {where} saying {message!r}, got {found}")


def test_example_config_is_valid() -> None:
    settings = load_config(REPO / "config" / "examples" / "llm-d.yaml", env={})
    (route,) = settings.routes
    assert route.abort_from_header is not None
    assert (route.engine, route.abort_engines(), route.abort_from_header.header,
            route.abort_from_header.engine) == (
        "routing-sidecar", ("decode",), "x-prefiller-host-port", "prefill"), route
    kinds = {n: e.kind.value for n, e in settings.engines.items()}
    assert kinds == {"routing-sidecar": "openai", "decode": "vllm", "prefill": "vllm"}, kinds
    assert all(a.aborts for n, a in build_adapters(settings.engines).items()
               if n != "routing-sidecar")


def test_adapters_are_cached_per_origin_and_bounded() -> None:
    settings = parse_config(_config(GOOD), "<test>", env={})
    section = settings.routes[0].abort_from_header
    assert section is not None
    template = build_adapters(settings.engines)["prefill"]
    targets = HeaderTargets(section, template, "/")
    first = parse_value(["10.0.0.1:8000"])
    assert not isinstance(first, str) and first is not None
    adapter = targets.adapter(first)
    assert (adapter.base_url, adapter.name, adapter.abort_path) == (
        "http://10.0.0.1:8000", "prefill", template.abort_path), vars(adapter)
    assert template.base_url == TEMPLATE_URL, "the template itself must not change"
    assert targets.adapter(first) is adapter, "expected the cached adapter for the same origin"
    start = time.monotonic()
    for i in range(MAX_TARGETS + 10):
        other = parse_value([f"10.0.{i // 250}.{i % 250 + 2}:8000"])
        assert not isinstance(other, str) and other is not None
        targets.adapter(other)
    assert len(targets) == MAX_TARGETS, (
        f"expected at most {MAX_TARGETS} adapters, got {len(targets)}")
    assert targets.adapter(first) is not adapter, "the least recently used origin must be evicted"
    assert time.monotonic() - start < 1.0, "building adapters must be cheap"
