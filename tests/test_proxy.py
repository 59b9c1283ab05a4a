"""Proxy behaviour: what a client sees through the sidecar, and what the engine sees.

Every test runs the sidecar as production does (:func:`sidecar.server.start`, or the CLI as a
subprocess) against real servers on 127.0.0.1: the fake engine, or a raw upstream from
:mod:`tests.fakes.upstreams` where the fake engine cannot misbehave enough. Clients are raw sockets
(:mod:`tests.harness.rawhttp`) wherever the wire matters, aiohttp or curl elsewhere. Upstream faults
(refused, timeouts, malformed, death mid-stream, stale keep-alive, pooling after a cut-short
response) are in :mod:`tests.faults.test_upstream_faults`, which shares the helpers here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from sidecar.server import ReadyLine, Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine, gzip_body
from tests.fakes.upstreams import RawRequest, RawUpstream
from tests.harness import rawhttp

GUARD_S = 5.0  # bound on any single wait that should take milliseconds
CLI_GUARD_S = 15.0  # bound on a CLI subprocess starting (imports) or exiting
REPO = Path(__file__).resolve().parent.parent
SSE_HEADERS = [("Content-Type", "application/json")]

StartSidecar = Callable[..., Any]


def proxy_url(servers: Servers, target: str) -> str:
    return f"http://127.0.0.1:{servers.proxy_port}{target}"


def post_json(target: str, body: dict[str, Any], version: str = "HTTP/1.1",
              extra: list[tuple[str, str]] | None = None) -> bytes:
    data = json.dumps(body).encode()
    headers = [*SSE_HEADERS, ("Content-Length", str(len(data))), *(extra or [])]
    return rawhttp.request_bytes("POST", target, headers, data, version)


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def assert_openai_error(status: int, body: bytes, expected_status: int, expected_type: str
                        ) -> dict[str, Any]:
    assert status == expected_status, (
        f"expected HTTP {expected_status} ({expected_type}), got {status}: {body[:300]!r}")
    try:
        doc = json.loads(body)
    except ValueError:
        pytest.fail(f"expected an OpenAI-style JSON error body, got {body[:300]!r}")
    error = doc.get("error") if isinstance(doc, dict) else None
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
        f"expected {{'error': {{message, type, param, code}}}}, got {doc!r}")
    assert error["type"] == expected_type, f"expected type {expected_type!r}, got {doc!r}"
    assert isinstance(error["message"], str) and error["message"], f"empty message in {doc!r}"
    assert error["code"] == expected_status, f"expected code {expected_status}, got {doc!r}"
    return error


@contextlib.asynccontextmanager
async def raw_upstream(respond: Callable[[RawRequest], bytes | None],
                       **options: Any) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(respond, **options)
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()


# --- Every method and path goes to the engine with the same path and query ---------------------

# Percent-encoded slash, tilde, space and UTF-8; an empty segment; repeated and empty query keys;
# '+' (not a space in a path or to a proxy).
RAW_TARGET = "/echo/a%2Fb/%7Euser/sp%20ace//x?x=1&x=2&y=%2F&z=a+b&e=&u=%E2%9C%93&x=3"


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
async def test_method_path_and_query_reach_engine_byte_for_byte(
        method: str, engine: FakeEngine, sidecar: Servers) -> None:
    body = b'{"k": "v"}' if method in ("POST", "PUT", "PATCH") else b""
    headers = [("Content-Length", str(len(body)))] if body else []
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(
            sidecar.proxy_port, rawhttp.request_bytes(method, RAW_TARGET, headers, body))
    assert resp.status == 200, f"{method}: expected 200 from /echo, got {resp.status} {resp.body!r}"
    echo = json.loads(resp.body)
    assert echo["method"] == method, f"engine saw method {echo['method']}, client sent {method}"
    assert echo["path_qs"] == RAW_TARGET, (
        f"engine saw target {echo['path_qs']!r}, client sent {RAW_TARGET!r}")
    assert echo["body"] == body.decode(), f"engine saw body {echo['body']!r}, sent {body!r}"


async def test_head_has_no_body_and_keeps_the_connection_usable(
        engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S), rawhttp.connect(sidecar.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("HEAD", "/echo/head?q=1"))
        head = await rawhttp.read_body(reader, await rawhttp.read_head(reader), "HEAD")
        assert head.status == 200, f"HEAD: expected 200, got {head.status}"
        # A body after the HEAD response would be parsed as the next status line.
        writer.write(rawhttp.request_bytes("GET", "/echo/after-head"))
        after = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    assert after.status == 200 and json.loads(after.body)["path_qs"] == "/echo/after-head", (
        f"GET after HEAD on one connection: got {after.status} {after.body!r}")
    assert [r["path"].split("?")[0] for r in engine.record.requests] == [
        "/echo/head", "/echo/after-head"], f"engine saw {engine.record.requests!r}"


# --- Request bodies stream through -------------------------------------------------------------

async def test_five_mib_body_goes_through_under_the_default_limit(engine: FakeEngine,
                                                                  sidecar: Servers) -> None:
    """Streamed, not buffered whole; ``downstream.max_body_bytes`` (64 MiB) is far above it.
    The limit itself: ``tests/faults/test_request_bodies.py``."""
    body = os.urandom(5 * 1024 * 1024)
    async with asyncio.timeout(GUARD_S * 2), aiohttp.ClientSession() as session:
        async with session.post(proxy_url(sidecar, "/sink"), data=io.BytesIO(body)) as resp:
            status, seen = resp.status, await resp.json()
    assert status == 200, f"5 MiB POST: expected 200, got {status}: {seen!r}"
    assert seen["body_len"] == len(body), f"engine got {seen['body_len']} bytes of {len(body)}"
    assert seen["sha256"] == hashlib.sha256(body).hexdigest(), "engine got different bytes"


async def test_chunked_upload_streams_before_the_body_is_complete(
        engine: FakeEngine, sidecar: Servers) -> None:
    parts = [b"first-part:" + b"a" * 1000, b"b" * 70000, b"c" * 3, b"d" * 300000]
    async with asyncio.timeout(GUARD_S), rawhttp.connect(sidecar.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [("Transfer-Encoding", "chunked")]))
        writer.write(b"%x\r\n%s\r\n" % (len(parts[0]), parts[0]))
        await writer.drain()
        # The engine reads the first bytes while the client still holds the rest back.
        await engine.sink_first_chunk.wait()
        for part in parts[1:]:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    whole = b"".join(parts)
    seen = json.loads(resp.body)
    assert resp.status == 200, f"chunked upload: expected 200, got {resp.status}"
    assert (seen["body_len"], seen["sha256"]) == (len(whole), hashlib.sha256(whole).hexdigest()), (
        f"engine got {seen['body_len']} bytes (sha {seen['sha256']}), client sent {len(whole)}")


async def test_expect_100_continue(engine: FakeEngine, sidecar: Servers) -> None:
    body = b"x" * 100_000
    async with asyncio.timeout(GUARD_S), rawhttp.connect(sidecar.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes("POST", "/sink", [
            ("Content-Length", str(len(body))), ("Expect", "100-continue")]))
        await writer.drain()
        interim = await rawhttp.read_head(reader)
        assert interim.status == 100, f"expected '100 Continue' before the body, got {interim!r}"
        writer.write(body)
        resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    seen = json.loads(resp.body)
    assert resp.status == 200 and seen["body_len"] == len(body), (
        f"expected 200 with {len(body)} bytes at the engine, got {resp.status}: {seen!r}")
    names = {k.lower() for k, _ in seen["headers"]}
    assert "expect" not in names, f"Expect is the sidecar's to answer, engine saw {names}"


# --- Responses stream back chunk by chunk, never re-encoded ------------------------------------

async def test_sse_events_reach_the_client_as_the_engine_writes_them(
        engine: FakeEngine, sidecar: Servers) -> None:
    tokens, interval = 6, 0.2
    async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
        async with session.post(
                proxy_url(sidecar, f"/v1/chat/completions?tokens={tokens}&interval={interval}"),
                json={"stream": True}) as resp:
            assert resp.status == 200, f"expected 200, got {resp.status}"
            seen_at_engine: list[tuple[int, bool]] = []  # engine state at each event's arrival
            events: list[bytes] = []
            while event := await resp.content.readuntil(b"\n\n"):
                gen = engine.record.generations[0]
                seen_at_engine.append((gen.events_sent, gen.finished))
                events.append(event)
    assert len(events) == tokens + 1 and events[-1] == b"data: [DONE]\n\n", (
        f"expected {tokens} events and [DONE], got {events!r}")
    sent_at_first, finished_at_first = seen_at_engine[0]
    assert not finished_at_first and sent_at_first <= 2, (
        f"first event should arrive while the engine is still generating; it arrived after the "
        f"engine had written {sent_at_first} events (finished={finished_at_first})")
    for i, (sent, _) in enumerate(seen_at_engine[:tokens]):
        # Event i is written, then the engine waits `interval` before event i+1: one event of
        # slack allows for scheduling, more would mean the sidecar held events back.
        assert sent <= i + 2, (
            f"event {i} reached the client only after the engine wrote {sent} events "
            f"(all arrivals: {seen_at_engine})")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
async def test_gzip_body_arrives_byte_identical(chunked: bool, engine: FakeEngine,
                                                sidecar: Servers) -> None:
    target = "/gzip" if chunked else "/gzip?chunked=0"
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, rawhttp.request_bytes("GET", target))
    assert resp.status == 200, f"expected 200, got {resp.status}"
    assert resp.get("Content-Encoding") == "gzip", f"Content-Encoding lost: {resp.headers}"
    assert resp.body == gzip_body(), (
        f"expected the engine's {len(gzip_body())} gzip bytes unchanged, got {len(resp.body)} "
        f"bytes starting {resp.body[:16]!r}")
    assert resp.get("X-Seen-Accept-Encoding") == "<none>", (
        f"client sent no Accept-Encoding, engine saw {resp.get('X-Seen-Accept-Encoding')!r}")
    assert resp.chunked == chunked and resp.ending == "complete", (
        f"framing: expected chunked={chunked}, complete; got {resp.headers}, {resp.ending}")


async def test_curl_gets_gzip_bytes_unchanged(engine: FakeEngine, sidecar: Servers,
                                              tmp_path: Path) -> None:
    out = tmp_path / "body.gz"
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--noproxy", "*", "-o", str(out), "-w", "%{http_code}",
        proxy_url(sidecar, "/gzip"), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), GUARD_S)
    assert proc.returncode == 0 and stdout == b"200", (
        f"curl: expected exit 0 and HTTP 200, got {proc.returncode} {stdout!r} {stderr!r}")
    assert out.read_bytes() == gzip_body(), "curl (no --compressed) got different gzip bytes"


async def test_sidecar_never_compresses(engine: FakeEngine, sidecar: Servers) -> None:
    size = 200_000
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, rawhttp.request_bytes(
            "GET", f"/bytes?size={size}", [("Accept-Encoding", "gzip, deflate, br")]))
    assert resp.status == 200, f"expected 200, got {resp.status}"
    assert resp.get("Content-Encoding") == "identity", (
        f"expected the engine's Content-Encoding: identity, got {resp.getall('Content-Encoding')}")
    assert resp.body == bytes(i % 251 for i in range(size)), (
        f"expected {size} identity bytes, got {len(resp.body)} starting {resp.body[:16]!r}")


# --- Status, headers and body preserved; hop-by-hop dropped both ways --------------------------

@pytest.mark.parametrize("status", [200, 201, 204, 404, 418, 500, 503])
async def test_status_headers_and_body_preserved(status: int, engine: FakeEngine,
                                                 sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port,
                                      rawhttp.request_bytes("GET", f"/status/{status}"))
    assert resp.status == status, f"expected {status}, got {resp.status} {resp.body!r}"
    expected_body = b"" if status == 204 else f"status {status} body\n".encode()
    assert resp.body == expected_body, f"expected body {expected_body!r}, got {resp.body!r}"
    assert resp.getall("Set-Cookie") == ["a=1; Path=/", "b=2; HttpOnly"], (
        f"expected two Set-Cookie fields in order, got {resp.headers}")
    assert resp.getall("X-Custom") == ["custom value"], f"custom header lost: {resp.headers}"
    assert re.fullmatch(r"[0-9a-f]{32}", resp.get("X-Request-Id") or ""), (
        f"expected the sidecar's X-Request-Id, got {resp.getall('X-Request-Id')}")


async def test_request_headers_rewritten_per_rfc9110(engine: FakeEngine, sidecar: Servers) -> None:
    request = rawhttp.request_bytes("GET", "/echo/headers", [
        ("Host", "client.example:8443"),
        ("Connection", "keep-alive, X-Hop-Named"),
        ("X-Hop-Named", "must not pass"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Connection", "keep-alive"),
        ("TE", "trailers"),
        ("Upgrade", "h2c"),
        ("Authorization", "Bearer client-token"),
        ("X-Forwarded-For", "203.0.113.7"),
        ("X-Forwarded-Proto", "https"),
        ("X-Custom", "one"),
        ("X-Custom", "two"),
    ])
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, request)
    assert resp.status == 200, f"expected 200, got {resp.status} {resp.body!r}"
    seen: list[tuple[str, str]] = [(k, v) for k, v in json.loads(resp.body)["headers"]]
    lower = {k.lower(): v for k, v in seen}
    for hop in ("x-hop-named", "keep-alive", "proxy-connection", "te", "upgrade"):
        assert hop not in lower, f"hop-by-hop {hop} reached the engine: {seen}"
    assert "x-hop-named" not in lower.get("connection", "").lower(), f"engine saw {seen}"
    assert lower["host"] == f"127.0.0.1:{engine.port}", f"expected the upstream's Host: {seen}"
    assert lower["authorization"] == "Bearer client-token", f"Authorization changed: {seen}"
    assert lower["x-forwarded-for"] == "203.0.113.7, 127.0.0.1", f"XFF not appended: {seen}"
    assert lower["x-forwarded-proto"] == "https, http", f"XFP not appended: {seen}"
    assert [v for k, v in seen if k.lower() == "x-custom"] == ["one", "two"], (
        f"repeated request header not kept: {seen}")
    assert lower["x-request-id"] == resp.get("X-Request-Id"), (
        f"engine got id {lower.get('x-request-id')}, client was told {resp.get('X-Request-Id')}")


async def test_forwarded_headers_start_with_the_client(engine: FakeEngine,
                                                       sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, rawhttp.request_bytes("GET", "/echo"))
    seen = {k.lower(): v for k, v in json.loads(resp.body)["headers"]}
    assert (seen.get("x-forwarded-for"), seen.get("x-forwarded-proto")) == ("127.0.0.1", "http"), (
        f"expected X-Forwarded-For: 127.0.0.1 and X-Forwarded-Proto: http, engine saw {seen}")


async def test_response_hop_by_hop_headers_dropped(start_sidecar: StartSidecar) -> None:
    body = b"hello"
    response = (b"HTTP/1.1 200 OK\r\n"
                b"Connection: keep-alive, X-Hop-Named\r\n"
                b"X-Hop-Named: secret\r\n"
                b"Keep-Alive: timeout=5, max=100\r\n"
                b"Proxy-Connection: keep-alive\r\n"
                b"TE: trailers\r\n"
                b"Upgrade: h2c\r\n"
                b"X-Kept: kept\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    async with raw_upstream(lambda _: response) as upstream:
        servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with asyncio.timeout(GUARD_S):
            resp = await rawhttp.exchange(servers.proxy_port, rawhttp.request_bytes("GET", "/x"))
    names = [k.lower() for k, _ in resp.headers]
    assert resp.status == 200 and resp.body == body, f"got {resp.status} {resp.body!r}"
    for hop in ("x-hop-named", "keep-alive", "proxy-connection", "te", "upgrade"):
        assert hop not in names, f"hop-by-hop {hop} reached the client: {resp.headers}"
    assert "x-hop-named" not in (resp.get("Connection") or "").lower(), f"{resp.headers}"
    assert resp.getall("X-Kept") == ["kept"], f"end-to-end header lost: {resp.headers}"
    assert resp.getall("Transfer-Encoding") in ([], ["chunked"]), (
        f"Transfer-Encoding is the sidecar's own framing, got {resp.headers}")


# --- HTTP/1.0 clients --------------------------------------------------------------------------

async def test_http10_client_gets_json(engine: FakeEngine, sidecar: Servers) -> None:
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(
            sidecar.proxy_port, post_json("/v1/chat/completions?tokens=3", {}, "HTTP/1.0"))
    assert resp.status == 200, f"HTTP/1.0 JSON: expected 200, got {resp.status} {resp.body!r}"
    assert not resp.chunked, f"chunked is not HTTP/1.0: {resp.headers}"
    assert json.loads(resp.body)["object"] == "chat.completion", f"got {resp.body!r}"


@pytest.mark.parametrize("extra", [[], [("Connection", "keep-alive")]],
                         ids=["plain", "keep_alive_asked"])
async def test_http10_client_gets_close_delimited_sse(
        extra: list[tuple[str, str]], engine: FakeEngine, sidecar: Servers) -> None:
    """A close-delimited body ends with the close, also for a client that asked for keep-alive
    (aiohttp kept that connection open: the client waited for an end that never came)."""
    async with asyncio.timeout(GUARD_S):
        resp = await rawhttp.exchange(sidecar.proxy_port, post_json(
            "/v1/chat/completions?tokens=5", {"stream": True}, "HTTP/1.0", extra))
    assert resp.status == 200, f"HTTP/1.0 SSE: expected 200, got {resp.status}"
    assert not resp.chunked and resp.get("Content-Length") is None, (
        f"expected a close-delimited body, got headers {resp.headers}")
    events = sse_events(resp.body)
    assert resp.ending == "eof" and len(events) == 6 and events[-1] == b"data: [DONE]", (
        f"expected 5 events, [DONE] and a clean close; got {resp.ending}: {events!r}")


# --- The sidecar's own error responses name both ids ---------------------------------------------

@pytest.mark.parametrize("case", ["engine_unreachable", "deadline_header_refused",
                                  "body_too_large"])
async def test_the_sidecars_own_errors_carry_both_request_ids(
        case: str, start_sidecar: StartSidecar) -> None:
    """docs/engines.md: a client's ``X-Request-Id`` comes back as ``X-Client-Request-Id``, the
    sidecar's own id as ``X-Request-Id``; on the answers the sidecar writes itself too (they had
    neither, or only the sidecar's)."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # closed below: nothing listens there
    settings = sidecar_settings(f"http://127.0.0.1:{dead_port}",
                                downstream={"max_body_bytes": 1000})
    servers = await start_sidecar(settings)
    headers = {"X-Request-Id": f"mine-{case}", "Content-Type": "application/json"}
    body = b"{}"
    if case == "deadline_header_refused":
        headers["X-Sidecar-Deadline-S"] = "soon"
    elif case == "body_too_large":
        body = b"x" * 5000
    expected = {"engine_unreachable": 502, "deadline_header_refused": 400,
                "body_too_large": 413}[case]
    async with asyncio.timeout(GUARD_S), aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{servers.proxy_port}/v1/chat/completions",
                                data=body, headers=headers) as resp:
            answer = await resp.json()
    assert resp.status == expected and answer["error"]["code"] == expected, (
        f"expected {expected} with an OpenAI-style body, got {resp.status} {answer}")
    assert resp.headers.get("X-Client-Request-Id") == f"mine-{case}", (
        f"expected the client's id back as X-Client-Request-Id, got {dict(resp.headers)}")
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers.get("X-Request-Id", "")), (
        f"expected the sidecar's own id as X-Request-Id, got {dict(resp.headers)}")


# --- The CLI -----------------------------------------------------------------------------------

async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", *args, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), CLI_GUARD_S)
    assert proc.returncode is not None
    return proc.returncode, stdout.decode(), stderr.decode()


async def test_cli_check_config_accepts_the_default_config() -> None:
    code, out, err = await run_cli("--check-config", "--config", "config/sidecar.yaml")
    assert code == 0, f"expected exit 0 for config/sidecar.yaml, got {code}: {out} {err}"


async def test_cli_check_config_lists_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 70000},
        "upstream": {"first_byte_timeout_s": -1, "bogus_key": 1},
        "engines": {"local": {"kind": "tgi", "url": "http://127.0.0.1:8000"}},
        "routes": [{"prefix": "v1", "engine": "nowhere"}],
    }))
    code, out, err = await run_cli("--check-config", "--config", str(bad))
    assert code == 1, f"expected exit 1 for a bad config, got {code}: {out} {err}"
    for location in ("listen.port", "upstream.first_byte_timeout_s", "upstream.bogus_key",
                     "engines.local.kind", "routes.0.prefix", "routes.0.engine"):
        assert re.search(rf"^\s*- {re.escape(location)}:", err, re.M), (
            f"expected a problem located at {location}, stderr was:\n{err}")


async def test_cli_proxies_a_request(engine: FakeEngine, tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine.url}},
        "routes": [{"prefix": "/", "engine": "local"}],
    }))
    with (tmp_path / "stderr.log").open("w+b") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--config", str(config), cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=stderr)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), CLI_GUARD_S)).decode()
            ready = ReadyLine.parse(line)
            assert ready is not None, f"expected the ready line, got {line!r}"
            async with asyncio.timeout(GUARD_S):
                resp = await rawhttp.exchange(ready.proxy_port, post_json(
                    "/v1/chat/completions?tokens=3", {"stream": True}))
            events = sse_events(resp.body)
            assert resp.status == 200 and len(events) == 4 and events[-1] == b"data: [DONE]", (
                f"expected 3 events and [DONE] through the CLI, got {resp.status} {events}")
            assert engine.record.generations[0].request_id == resp.get("X-Request-Id"), (
                "the engine should see the id the client is told")
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), CLI_GUARD_S)
            assert code == 0, f"expected exit 0 after SIGTERM, got {code}"
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            stderr.seek(0)
            log = stderr.read().decode()
        assert "Traceback" not in log, f"the CLI logged a traceback:\n{log}"
