"""The ``openai`` engine kind: an OpenAI-compatible server with no abort endpoint (TGI, llama.cpp,
Ollama, a hosted API). A disconnect closes the upstream connection at once and calls nothing.

Production wiring (``start_sidecar``: :func:`sidecar.server.start`, handler cancellation on);
the server is :class:`tests.fakes.engine.FakeEngine`, which also serves vLLM's abort path: every
test checks that nothing but the proxied request (and ``/health`` from :func:`settle`) reached
it. Helpers and the ``stalls`` fixture (time this process did not run is excused) come from
``tests/test_cancel.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from engine import build_adapters
from sidecar.config import load_config, parse_config
from sidecar.errors import ConfigError
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.upstreams import refused_port
from tests.harness.support import (
    CHAT,
    WAIT_S,
    Stalls,
    disconnect_counts,
    metrics,
    no_event,
    raw_client,
    request_body,
    samples,
    settle,
    upstream_closed,
)
from tests.test_logs import AccessLines, access_lines_handler  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def openai_settings(url: str, **engine: Any) -> Any:
    """One ``openai``-kind engine at ``url`` behind the sidecar; ``engine`` adds keys to it."""
    return sidecar_settings(url, engines={"local": {"kind": "openai", "url": url, **engine}})


async def start(start_sidecar: Callable[..., Any], engine: FakeEngine, **extra: Any) -> Servers:
    servers: Servers = await start_sidecar(openai_settings(engine.url, **extra))
    return servers


async def assert_nothing_aborted(engine: FakeEngine, servers: Servers) -> None:
    """No abort call arrives (waited for, then a full round trip through the sidecar), no
    request but the generation and ``/health`` reached the server, and the metrics agree."""
    assert await no_event(engine.record.abort_event), (
        f"expected no abort call, got {engine.record.aborted_ids()}")
    await settle(servers.proxy_port)
    assert engine.record.aborts == [], f"expected no abort call, got {engine.record.aborts}"
    others = [(s.method, s.path) for s in engine.watch.seen
              if (s.method, s.path) not in {("POST", CHAT), ("GET", "/health")}]
    assert others == [], f"expected only the proxied requests at the server, got {others}"
    values = await metrics(servers.admin_port or 0)
    for name in ("cancel_sidecar_abort_calls_total", "cancel_sidecar_aborted_requests_total"):
        assert samples(values, name) == {}, f"expected no {name}, got {samples(values, name)}"


# -- a disconnect closes the upstream connection and calls nothing ------------------------------


async def test_access_line_says_disconnected_and_nothing_aborted(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls,
        access_lines: AccessLines) -> None:
    access_lines.want = 1
    servers = await start(start_sidecar, engine)
    async with raw_client(servers.proxy_port, stalls) as c:
        c.send("POST", CHAT + "?tokens=1000", request_body(BODY, True))
        _, head = await c.head()
        await c.read_until(b"data:")
        c.disconnect("fin")
        await upstream_closed(engine, stalls)
    await stalls.wait(access_lines.enough.wait(), "the access line")
    line = access_lines.lines[0]
    expected = {"request_id": head["X-Request-Id"], "engine": "local", "status": 200,
                "client_disconnected": True, "phase": "streaming", "abort": None,
                "abort_latency_s": None}
    assert {k: line.get(k) for k in expected} == expected, f"expected {expected}, got {line}"


async def test_completed_stream_is_byte_identical_and_tagged(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    """A request that completes is untouched: the same bytes as straight from the server, which
    saw the sidecar id as ``X-Request-Id`` (the id on the client's response)."""
    servers = await start(start_sidecar, engine)
    query = "?tokens=50&interval=0.001"
    async with aiohttp.ClientSession() as s, asyncio.timeout(WAIT_S):
        async with s.post(f"http://127.0.0.1:{servers.proxy_port}{CHAT}{query}",
                          json={**BODY, "stream": True}) as r:
            via_sidecar = await r.read()
            rid = r.headers["X-Request-Id"]
        async with s.post(f"{engine.url}{CHAT}{query}", json={**BODY, "stream": True},
                          headers={"X-Request-Id": rid}) as r:
            direct = await r.read()
    assert via_sidecar == direct, (
        f"expected the server's bytes unchanged ({len(direct)} bytes), got {len(via_sidecar)}")
    assert via_sidecar.endswith(b"data: [DONE]\n\n"), via_sidecar[-100:]
    assert engine.record.generations[0].request_id == rid, (
        f"expected the server to see X-Request-Id {rid}, got "
        f"{engine.record.generations[0].request_id}")
    assert all(g.finished and g.closed_at is None for g in engine.record.generations)
    await assert_nothing_aborted(engine, servers)
    assert disconnect_counts(await metrics(servers.admin_port or 0)) == {}


# -- /readyz: only the health path, never an abort probe ----------------------------------------

async def _readyz(servers: Servers) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(f"http://127.0.0.1:{servers.admin_port}/readyz") as r:
            return r.status, await r.json()


@pytest.mark.parametrize("health_path", [None, "/health"])
async def test_ready_when_the_server_answers_its_health_path(
        engine: FakeEngine, start_sidecar: Callable[..., Any], health_path: str | None) -> None:
    extra = {} if health_path is None else {"health_path": health_path}
    servers = await start(start_sidecar, engine, **extra)
    status, body = await _readyz(servers)
    assert (status, body) == (200, {"ready": True, "engines": {"local": "ok"}}), (status, body)
    want = health_path or "/v1/models"
    seen = [(s.method, s.path) for s in engine.watch.seen]
    assert seen == [("GET", want)], f"expected only GET {want} (no abort probe), got {seen}"
    assert engine.record.aborts == [], f"expected no abort probe, got {engine.record.aborts}"


async def test_not_ready_when_the_health_path_fails(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers = await start(start_sidecar, engine, health_path="/status/503")
    status, body = await _readyz(servers)
    assert status == 503 and body["engines"]["local"] == f"{engine.url}/status/503 answered 503", (
        status, body)
    seen = [(s.method, s.path) for s in engine.watch.seen]
    assert seen == [("GET", "/status/503")], f"expected only the health GET, got {seen}"


async def test_not_ready_when_the_server_is_unreachable(
        start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(
        openai_settings(f"http://127.0.0.1:{refused_port()}"))
    status, body = await _readyz(servers)
    assert status == 503 and body["engines"]["local"].startswith("nothing listens at"), (
        status, body)


# -- config --------------------------------------------------------------------------------------

def _config(engine: dict[str, Any]) -> str:
    return yaml.safe_dump({"engines": {"local": {"kind": "openai",
                                                 "url": "http://127.0.0.1:8090", **engine}},
                           "routes": [{"prefix": "/", "engine": "local"}]})


@pytest.mark.parametrize("abort", [{"path": "/abort"}, {"api_key": "sk-secret-key"}, {}])
def test_abort_settings_on_an_openai_engine_are_rejected(abort: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config({"abort": abort}), "<test>", env={})
    problems = info.value.problems
    assert [p.location for p in problems] == ["engines.local.abort"], problems
    assert "has no abort endpoint" in problems[0].message, problems[0].message
    assert "sk-secret-key" not in str(info.value), f"the key leaked: {info.value}"


def test_openai_engine_defaults_and_health_path() -> None:
    settings = parse_config(_config({}), "<test>", env={})
    adapter = build_adapters(settings.engines)["local"]
    assert (adapter.aborts, adapter.abort_path, adapter.health_path) == (
        False, None, "/v1/models"), vars(adapter)
    assert adapter.forbidden_paths() == frozenset(), adapter.forbidden_paths()
    assert adapter.engine_request_ids("POST", CHAT, "abc", None) == ()
    headers: dict[str, str] = {}
    adapter.tag(CHAT, "abc", headers)
    assert headers == {"X-Request-Id": "abc"}, headers
    with pytest.raises(ValueError, match="no abort endpoint"):
        adapter.abort_calls(("abc",))
    custom = parse_config(_config({"health_path": "/api/version"}), "<test>", env={})
    assert build_adapters(custom.engines)["local"].health_path == "/api/version"
    vllm = sidecar_settings("http://127.0.0.1:8000")
    assert build_adapters(vllm.engines)["local"].health_path == "/health"
    with pytest.raises(ConfigError) as info:
        parse_config(_config({"health_path": "v1/models"}), "<test>", env={})
    assert [p.location for p in info.value.problems] == ["engines.local.health_path"], (
        info.value.problems)


def test_example_config_is_valid() -> None:
    path = Path(__file__).resolve().parent.parent / "config" / "examples" / "openai.yaml"
    settings = load_config(path, env={})
    assert (settings.listen.port, str(settings.engines["llama"].url)) == (
        8081, "http://127.0.0.1:8080/"), settings
    assert build_adapters(settings.engines)["llama"].health_path == "/health"
