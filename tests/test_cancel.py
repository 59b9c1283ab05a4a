"""Cancellation, end to end, on the vLLM kind: sidecar request ids, client-chosen ids, a
disconnect while the body is still being sent, disconnect metrics and the CLI's logs. The
disconnect matrix (every phase, RST/FIN/half-close, every route) runs for every engine kind in
:mod:`tests.test_cancel_every_kind`.

Everything runs through the production wiring: :func:`sidecar.server.start` (the ``sidecar`` and
``start_sidecar`` fixtures, ``AppRunner`` with handler cancellation, what the CLI runs) and, in
the ``test_cli_*`` tests, the real ``python -m sidecar`` subprocess. Clients are raw sockets
(exact disconnect timing: ``rst`` = SO_LINGER 0 + close, ``fin`` = close, ``half`` = shutdown of
the write side only) and aiohttp clients; the engine is :mod:`tests.fakes.engine` on 127.0.0.1.

Timing: as described in :mod:`tests.harness.support` (event-driven waits, process stalls excluded,
latencies compared with ``GUARD_S`` and printed with ``-s``).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from sidecar.server import ReadyLine, Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness.support import (
    CHAT,
    COMPLETIONS,
    FOREVER,
    GENERATE,
    GUARD_S,
    WAIT_S,
    Stalls,
    disconnect_counts,
    metrics,
    ms,
    no_event,
    one_abort,
    raw_client,
    request_body,
    samples,
    settle,
    upstream_closed,
    wait_metric,
)

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parent.parent


# name -> (path, body, engine request ids for sidecar id <id>)
ROUTES: dict[str, tuple[str, dict[str, Any], Callable[[str], list[str]]]] = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": "hi"}]},
             lambda i: [f"chatcmpl-{i}"]),
    "completions-3-prompts": (COMPLETIONS, {"prompt": ["a", "b", "c"]},
                              lambda i: [f"cmpl-{i}-0", f"cmpl-{i}-1", f"cmpl-{i}-2"]),
    "completions-1-prompt": (COMPLETIONS, {"prompt": "a"}, lambda i: [f"cmpl-{i}-0"]),
    "generate": (GENERATE, {"token_ids": [1, 2, 3]}, lambda i: [f"generate-tokens-{i}"]),
}

# phase -> (query, stream?, the phase label the sidecar counts)
PHASES: dict[str, tuple[str, bool, str]] = {
    "queued": ("?first_byte_delay=5", True, "before_first_byte"),
    "non_streaming": ("?tokens=1000&interval=0.01", False, "awaiting_response"),
    "mid_stream": ("?tokens=1000&interval=0.01", True, "streaming"),
}


# -- sidecar request ids ------------------------------------------------------------------------

async def test_every_request_gets_a_unique_sidecar_id(engine: FakeEngine,
                                                      sidecar: Servers) -> None:
    seen: list[str] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(20):
            async with s.post(f"http://127.0.0.1:{sidecar.proxy_port}/echo", data=b"x") as r:
                echoed = await r.json()
                rid = r.headers.get("X-Request-Id", "")
            upstream = [v for k, v in echoed["headers"] if k.lower() == "x-request-id"]
            assert upstream == [rid], f"engine got X-Request-Id {upstream}, client got {rid!r}"
            assert "X-Client-Request-Id" not in r.headers, "no client id was sent"
            assert re.fullmatch(r"[0-9a-f]{32}", rid), f"expected a 32-hex sidecar id, got {rid!r}"
            seen.append(rid)
    assert len(set(seen)) == 20, f"expected 20 distinct ids, got {seen}"


CLIENT_IDS = {
    "same": [("X-Request-Id", "shared-id")],
    "comma": [("X-Request-Id", "x, y")],
    "long": [("X-Request-Id", "L" * 4000)],
    "two-headers": [("X-Request-Id", "a"), ("X-Request-Id", "b")],
    "body-field": [],  # the body's "request_id" field is set below
}


@pytest.mark.parametrize("kind", sorted(CLIENT_IDS))
async def test_client_chosen_ids_never_reach_an_abort(engine: FakeEngine, sidecar: Servers,
                                                      stalls: Stalls, kind: str) -> None:
    """Two clients send the same id; disconnecting A aborts A's request only, B completes."""
    headers = CLIENT_IDS[kind]
    body = request_body({"messages": [], "request_id": "victim"}, stream=True)
    port = sidecar.proxy_port
    async with raw_client(port, stalls) as b, raw_client(port, stalls) as a:
        b.send("POST", f"{CHAT}?tokens=40&interval=0.01", body, headers)
        status_b, head_b = await b.head()
        await b.read_until(b"data:")
        a.send("POST", f"{CHAT}?tokens=1000&interval=0.01", body, headers)
        status_a, head_a = await a.head()
        await a.read_until(b"data:")
        assert status_a == status_b == 200, f"expected 200 twice, got {status_a}, {status_b}"
        at = a.disconnect("rst")
        ids, aborted_at = await one_abort(engine, stalls, port)
        rest_b = await b.read_until(b"data: [DONE]\n\n")
    a_id, b_id = head_a["X-Request-Id"], head_b["X-Request-Id"]
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[{kind}] abort {ms(latency)} after A left{stalls.note(at, aborted_at)}")
    assert ids == [f"chatcmpl-{a_id}"], f"expected only A's id chatcmpl-{a_id}, got {ids}"
    assert a_id != b_id and re.fullmatch(r"[0-9a-f]{32}", a_id), (a_id, b_id)
    assert rest_b.count(b"data:") == 40, f"B expected its whole stream, got {rest_b[-200:]!r}"
    gens = {g.request_id: g for g in engine.record.generations}
    assert gens[b_id].finished and gens[b_id].closed_at is None, "B must complete, unaborted"
    assert gens[a_id].stopped_at is not None, "A must be stopped at the engine (aborted)"
    client_value = headers[0][1] if headers else None
    for head in (head_a, head_b):
        assert head.get("X-Client-Request-Id") == client_value, (
            f"expected X-Client-Request-Id {client_value!r:.40} in the response, "
            f"got {head.get('X-Client-Request-Id')!r:.40}")
    for seen in engine.watch.on(CHAT):
        assert seen.headers.getall("X-Request-Id") in ([a_id], [b_id]), (
            f"engine must see only the sidecar id, got {seen.headers.getall('X-Request-Id')}")
        assert seen.headers.get("X-Client-Request-Id") == client_value, (
            f"engine expected X-Client-Request-Id {client_value!r:.40}, "
            f"got {seen.headers.get('X-Client-Request-Id')!r:.40}")


# -- disconnect in every phase ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("route", ["chat", "completions-3-prompts"])
async def test_disconnect_while_sending_the_body_closes_upstream_without_abort(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, route: str, how: str) -> None:
    """The engine never got a whole request, so it has nothing to abort: none is sent."""
    path, body, _ = ROUTES[route]
    raw = json.dumps({**body, "stream": True, "pad": "p" * 20000}).encode()
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send_head("POST", path + "?tokens=1000", [], len(raw))
        c.writer.write(raw[: len(raw) // 2])
        await c.writer.drain()
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(path)), FOREVER),
                          "the engine to receive the request head and part of the body")
        at = c.disconnect(how)
        seen = engine.watch.on(path)[0]
        await stalls.wait(engine.watch.until(lambda: seen.failed_at is not None, FOREVER),
                          "the engine's body read to fail (upstream closed)")
        assert seen.failed_at is not None
    closed = stalls.check("the upstream close", at, seen.failed_at)
    print(f"[{route} {how}] upstream closed {ms(closed)} after the client left mid-body "
          f"({seen.body_bytes} of {seen.content_length} bytes arrived, {seen.error})"
          f"{stalls.note(at, seen.failed_at)}")
    assert seen.content_length == len(raw), f"engine saw Content-Length {seen.content_length}"
    assert seen.body_bytes < len(raw), f"engine got the whole body: {seen.body_bytes} bytes"
    assert engine.record.generations == [], "the engine must never have parsed the request"
    assert await no_event(engine.record.abort_event), (
        f"expected no abort for an incomplete request, got {engine.record.aborted_ids()}")
    await settle(sidecar.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    values = await metrics(sidecar.admin_port or 0)
    assert disconnect_counts(values) == {("/", "request_body"): 1}, disconnect_counts(values)
    assert samples(values, "cancel_sidecar_abort_calls_total") == {}, "no abort call expected"


async def test_aiohttp_client_closing_a_stream_aborts(engine: FakeEngine, sidecar: Servers,
                                                      stalls: Stalls) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{sidecar.proxy_port}{COMPLETIONS}?tokens=1000",
                          json={"prompt": ["a", "b", "c"], "stream": True}) as r:
            rid = r.headers["X-Request-Id"]
            first = await stalls.wait(r.content.readline(), "an SSE line")
            assert first.startswith(b"data:"), f"expected an SSE event, got {first!r}"
            at = time.monotonic()
            r.close()
        closed_at = await upstream_closed(engine, stalls)
        ids, aborted_at = await one_abort(engine, stalls, sidecar.proxy_port)
    closed = stalls.check("the upstream close", at, closed_at)
    latency = stalls.check("the abort", at, aborted_at)
    print(f"[aiohttp close] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    assert ids == [f"cmpl-{rid}-{i}" for i in range(3)], f"expected 3 ids for {rid}, got {ids}"


# -- no abort when there is nothing to abort ----------------------------------------------------


@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/echo")])
async def test_non_generating_route_disconnect_closes_upstream_without_abort(
        engine: FakeEngine, sidecar: Servers, stalls: Stalls, method: str, path: str,
        how: str) -> None:
    body = b'{"prompt": "x"}' if method == "POST" else None
    async with raw_client(sidecar.proxy_port, stalls) as c:
        c.send(method, f"{path}?hold=5", body)
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(path)), FOREVER),
                          f"{method} {path} to reach the engine")
        at = c.disconnect(how)
        seen = engine.watch.on(path)[0]
        await stalls.wait(engine.watch.until(lambda: seen.failed_at is not None, FOREVER),
                          "the upstream request to be closed")
        assert seen.failed_at is not None
    closed = stalls.check("the upstream close", at, seen.failed_at)
    print(f"[{method} {path} {how}] upstream closed {ms(closed)}{stalls.note(at, seen.failed_at)}")
    assert await no_event(engine.record.abort_event), (
        f"expected no abort for {path}, got {engine.record.aborted_ids()}")
    await settle(sidecar.proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    counts = disconnect_counts(await metrics(sidecar.admin_port or 0))
    assert counts == {("/", "awaiting_response"): 1}, counts


# -- disconnect metrics -------------------------------------------------------------------------

async def test_disconnect_metric_counts_each_phase_per_route(
        engine: FakeEngine, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    routes = [{"prefix": "/v1", "engine": "local"}, {"prefix": "/", "engine": "local"}]
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=routes))
    port = servers.proxy_port
    # request_body on /v1
    raw = request_body({"messages": [], "pad": "p" * 20000}, True)
    async with raw_client(port, stalls) as c:
        c.send_head("POST", CHAT, [], len(raw))
        c.writer.write(raw[:100])
        await c.writer.drain()
        await stalls.wait(engine.watch.until(lambda: bool(engine.watch.on(CHAT)), FOREVER),
                          "the request to reach the engine")
        c.disconnect("rst")
        await stalls.wait(engine.watch.until(
            lambda: engine.watch.on(CHAT)[0].failed_at is not None, FOREVER),
            "the upstream connection to close")
    # before_first_byte on / (the generate route lies outside /v1)
    async with raw_client(port, stalls) as c:
        c.send("POST", f"{GENERATE}?first_byte_delay=5", request_body({}, True))
        await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
        c.disconnect("fin")
        await stalls.wait(engine.record.stopped_event.wait(),
                          "the engine to stop it (aborted, or its connection closed)")
    # streaming on /v1
    async with raw_client(port, stalls) as c:
        c.send("POST", f"{COMPLETIONS}?tokens=1000", request_body({"prompt": "a"}, True))
        await c.read_until(b"data:")
        c.disconnect("rst")
        await stalls.wait(engine.watch.until(  # aborted: it ends (confirmed), or is cut
            lambda: sum(s.failed_at is not None or s.ended_at is not None
                        for s in engine.watch.on(COMPLETIONS)) == 1,
            FOREVER), "the engine's handler to end")
    await settle(port)
    values = await metrics(servers.admin_port or 0)
    counts = disconnect_counts(values)
    assert counts == {("/v1", "request_body"): 1, ("/", "before_first_byte"): 1,
                      ("/v1", "streaming"): 1}, f"unexpected disconnect counts {counts}"
    requests = {(dict(k)["route"], dict(k)["status_class"]): v
                for k, v in samples(values, "cancel_sidecar_requests_total").items()}
    assert requests.get(("/v1", "disconnected")) == 2, requests
    assert requests.get(("/", "disconnected")) == 1, requests


# -- the real CLI -------------------------------------------------------------------------------

CLI_KEY = "cli-sekret-key-1234"
CLI_GUARD_S = 2 * GUARD_S  # a second process, descheduled on its own on a loaded machine


@asynccontextmanager
async def cli_sidecar(tmp_path: Path, engine: FakeEngine) -> AsyncIterator[tuple[int, int, Path]]:
    """``python -m sidecar --config FILE`` with free ports; yields (proxy port, admin port,
    stderr file). Stops it with SIGTERM and checks it exits 0."""
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine.url,
                              "abort": {"api_key": CLI_KEY, "timeout_s": 1.0,
                                        "resend_window_s": 0}}},
        "routes": [{"prefix": "/", "engine": "local"}],
        "log_level": "DEBUG",
    }))
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--config", str(config), cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            ready = ReadyLine.parse(line)
            assert ready is not None and ready.admin_port is not None, (
                f"expected the ready line, got {line!r}; stderr: {stderr_path.read_text()}")
            yield ready.proxy_port, ready.admin_port, stderr_path
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.communicate(), 10)
            except TimeoutError:
                proc.kill()
                await proc.communicate()
                raise AssertionError("the CLI did not stop within 10 s of SIGTERM") from None
    assert proc.returncode == 0, (f"expected exit 0 after SIGTERM, got {proc.returncode}; "
                                  f"stderr: {stderr_path.read_text()}")


async def test_cli_notices_mid_stream_disconnect(engine: FakeEngine, tmp_path: Path,
                                                 stalls: Stalls) -> None:
    async with cli_sidecar(tmp_path, engine) as (port, admin, stderr):
        async with raw_client(port, stalls) as c:
            c.send("POST", f"{COMPLETIONS}?tokens=1000",
                   request_body({"prompt": ["a", "b", "c"]}, True), [("X-Request-Id", "mine")])
            _, head = await c.head()
            await c.read_until(b"data:")
            at = c.disconnect("rst")
            closed_at = await upstream_closed(engine, stalls)
            await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
        rid = head["X-Request-Id"]
        await settle(port)
        await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1, WAIT_S,
                          engine="local", outcome="accepted")
        counts = disconnect_counts(await metrics(admin))
    abort = engine.record.aborts
    closed = stalls.check("the upstream close", at, closed_at, CLI_GUARD_S)
    latency = stalls.check("the abort", at, abort[0].at, CLI_GUARD_S)
    print(f"[cli mid-stream] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, abort[0].at)}")
    assert [a.ids for a in abort] == [[f"cmpl-{rid}-{i}" for i in range(3)]], abort
    assert abort[0].authorization == f"Bearer {CLI_KEY}", abort[0].authorization
    assert engine.record.generations[0].request_id == rid
    assert counts == {("/", "streaming"): 1}, counts
    log = stderr.read_text()
    assert rid in log and "accepted an abort call" in log, (
        f"expected the abort logged with {rid}: {log}")
    assert CLI_KEY not in log, "the api key appeared in the CLI's log"


async def test_cli_notices_half_close_while_queued_and_logs_abort_failure(
        engine: FakeEngine, tmp_path: Path, stalls: Stalls) -> None:
    engine.record.abort_status = 500
    async with cli_sidecar(tmp_path, engine) as (port, admin, stderr):
        async with raw_client(port, stalls) as c:
            c.send("POST", f"{CHAT}?first_byte_delay=5", request_body({"messages": []}, True))
            await stalls.wait(engine.record.started_event.wait(), "the engine to start the request")
            at = c.disconnect("half")
            closed_at = await upstream_closed(engine, stalls)
            await stalls.wait(engine.record.abort_event.wait(), "an abort call at the engine")
        await wait_metric(stalls, admin, "cancel_sidecar_abort_calls_total", 1, WAIT_S,
                          engine="local", outcome="http_500")
        counts = disconnect_counts(await metrics(admin))
        # Other traffic is unaffected.
        await settle(port)
    rid = engine.record.generations[0].request_id
    aborted_at = engine.record.aborts[0].at
    closed = stalls.check("the upstream close", at, closed_at, CLI_GUARD_S)
    latency = stalls.check("the abort", at, aborted_at, CLI_GUARD_S)
    print(f"[cli half-close queued] upstream closed {ms(closed)}, abort {ms(latency)}"
          f"{stalls.note(at, aborted_at)}")
    assert engine.record.aborted_ids() == [f"chatcmpl-{rid}"], engine.record.aborted_ids()
    assert counts == {("/", "before_first_byte"): 1}, counts
    log = stderr.read_text()
    failure = [line for line in log.splitlines() if "WARNING" in line and "abort" in line]
    assert any(str(rid) in line and "HTTP 500" in line for line in failure), (
        f"expected a WARNING naming {rid} and HTTP 500, got: {log}")
    assert CLI_KEY not in log, "the api key appeared in the CLI's log"
