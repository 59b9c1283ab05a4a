"""Deadlines: ``routes[].max_duration_s``, lowered (never raised) by the client's
``X-Sidecar-Deadline-S``. On expiry the engine is aborted once with exactly the request's ids,
the upstream closed, and the client gets a JSON 504 before the head, or mid-SSE a final ``error``
event (``deadline_exceeded``) and a proper end of the stream.

Production wiring (:func:`sidecar.server.start`, the ``start_sidecar`` fixture), the fake engine
of :mod:`tests.fakes.engine`, raw-socket, aiohttp and openai SDK clients. Times are guard bounds:
a deadline of ``D`` must end the request after ``D`` and well before the engine would have.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from sidecar.config import load_config
from sidecar.errors import ConfigError
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness import rawhttp
from tests.harness.support import metrics
from tests.test_cancel_api import aborted_once, access_line, chat_body

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
CHAT = "/v1/chat/completions"
HEADER = "X-Sidecar-Deadline-S"
DEADLINE_EVENT = (b'data: {"error": {"message": "deadline exceeded", "type": '
                  b'"deadline_exceeded", "param": null, "code": null}}\n\n')
LONG_STREAM = "tokens=1000&interval=0.01"  # ~10 s of events
REPO = Path(__file__).resolve().parent.parent


def route(max_duration_s: float | None) -> list[dict[str, Any]]:
    return [{"prefix": "/", "engine": "local", "max_duration_s": max_duration_s}]


async def stream_raw(port: int, query: str, headers: list[tuple[str, str]] | None = None
                     ) -> tuple[rawhttp.RawResponse, float]:
    """POST a streaming chat request on a raw socket; the whole response and its duration."""
    body = chat_body(stream=True)
    started = time.monotonic()
    async with rawhttp.connect(port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"{CHAT}?{query}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
             *(headers or [])], body))
        head = await rawhttp.read_head(reader)
        response = await rawhttp.read_body(reader, head, "POST")
    return response, time.monotonic() - started


def assert_stream_cut_by_deadline(response: rawhttp.RawResponse, took: float,
                                  deadline: float) -> None:
    assert response.status == 200 and response.chunked, f"expected a chunked 200: {response}"
    assert response.ending == "complete", f"expected a proper end, got {response.ending}"
    assert response.body.endswith(DEADLINE_EVENT), (
        f"expected the deadline error event last, got {response.body[-200:]!r}")
    assert b"[DONE]" not in response.body, "a stream cut by its deadline must not send [DONE]"
    assert response.body.count(b"data: ") > 1, "expected events relayed before the deadline"
    assert deadline <= took < deadline + 4.0, (
        f"expected the stream ended at ~{deadline} s (guard +4 s), took {took:.3f} s")


async def test_deadline_mid_stream_ends_sse_with_an_error_event(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.access")
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    async with asyncio.timeout(WAIT_S):
        response, took = await stream_raw(servers.proxy_port, LONG_STREAM)
    assert_stream_cut_by_deadline(response, took, 0.5)
    request_id = response.get("X-Request-Id")
    assert request_id, response.headers
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)

    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "streaming")})
    assert values.get(("cancel_sidecar_deadline_exceeded_total", labels)) == 1.0, values
    cancelled = [v for (n, _), v in values.items()
                 if n == "cancel_sidecar_cancelled_requests_total" and v]
    assert cancelled == [], f"a deadline is not a cancel API call, got {cancelled}"
    expected = {"status": 200, "client_disconnected": False, "phase": "streaming",
                "cancel_reason": "deadline exceeded", "abort": "confirmed"}
    line = access_line(caplog, request_id)
    got = {k: line[k] for k in expected}
    assert got == expected, f"expected the access line {expected}, got {got}"


async def test_deadline_while_queued_answers_504_json(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    url = f"http://127.0.0.1:{servers.proxy_port}{CHAT}?first_byte_delay=30"
    started = time.monotonic()
    async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as session, session.post(
            url, data=chat_body(stream=True)) as response:
        body = await response.json()
    took = time.monotonic() - started
    assert response.status == 504, f"expected 504, got {response.status}: {body}"
    assert body["error"]["type"] == "deadline_exceeded", body
    assert 0.5 <= took < 4.5, f"expected the 504 at ~0.5 s (guard +4 s), took {took:.3f} s"
    request_id = response.headers.get("X-Request-Id")
    assert request_id, response.headers
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)
    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "before_first_byte")})
    assert values.get(("cancel_sidecar_deadline_exceeded_total", labels)) == 1.0, values


async def test_deadline_non_streaming_answers_504_and_the_sdk_does_not_retry(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    """The SDK retries a 5xx twice by default; ``X-Should-Retry: false`` stops it (a retry would
    run the request again to the same deadline: three times the engine work)."""
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    async with asyncio.timeout(WAIT_S), openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{servers.proxy_port}/v1", api_key="client-key",
            max_retries=2) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}],
                extra_query={"tokens": 1000, "interval": 0.01})
    assert caught.value.status_code == 504, f"got {caught.value!r}"
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert len(engine.record.generations) == 1, (
        f"expected no retry, the engine got {len(engine.record.generations)} requests")
    request_id = caught.value.response.headers.get("x-request-id")
    assert request_id, caught.value.response.headers
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)
    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "awaiting_response")})
    assert values.get(("cancel_sidecar_deadline_exceeded_total", labels)) == 1.0, values


async def test_the_header_shortens_the_route_deadline(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(5.0)))
    async with asyncio.timeout(WAIT_S):
        response, took = await stream_raw(servers.proxy_port, LONG_STREAM, [(HEADER, "0.3")])
    assert_stream_cut_by_deadline(response, took, 0.3)
    assert took < 4.0, f"the header's 0.3 s must win over the route's 5 s, took {took:.3f} s"
    await aborted_once(engine, [f"chatcmpl-{response.get('X-Request-Id')}"], servers.proxy_port)


async def test_the_header_cannot_lengthen_the_route_deadline(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    async with asyncio.timeout(WAIT_S):
        response, took = await stream_raw(servers.proxy_port, LONG_STREAM, [(HEADER, "10")])
    assert_stream_cut_by_deadline(response, took, 0.5)
    await aborted_once(engine, [f"chatcmpl-{response.get('X-Request-Id')}"], servers.proxy_port)


async def test_the_header_alone_sets_a_deadline_and_is_not_forwarded(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    async with asyncio.timeout(WAIT_S):
        response, took = await stream_raw(servers.proxy_port, LONG_STREAM, [(HEADER, "0.3")])
    assert_stream_cut_by_deadline(response, took, 0.3)
    await aborted_once(engine, [f"chatcmpl-{response.get('X-Request-Id')}"], servers.proxy_port)
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{servers.proxy_port}/echo", data=b"x",
            headers={HEADER: "30"}) as r:
        echoed = await r.json()
    assert r.status == 200, echoed
    forwarded = {k.lower() for k, _ in echoed["headers"]}
    assert HEADER.lower() not in forwarded, f"the header must not go upstream: {forwarded}"


@pytest.mark.parametrize("value", ["0", "-1", "abc", "", "nan", "inf", "1e99", "true", "1_0"])
async def test_an_invalid_header_is_400_and_nothing_goes_upstream(
        engine: FakeEngine, start_sidecar: Callable[..., Any], value: str) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(5.0)))
    async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{servers.proxy_port}{CHAT}", data=chat_body(stream=True),
            headers={HEADER: value}) as r:
        body = await r.json()
    assert r.status == 400, f"expected 400 for {HEADER}: {value!r}, got {r.status} {body}"
    assert body["error"]["type"] == "invalid_request" and HEADER in body["error"]["message"], body
    assert engine.watch.on(CHAT) == [], "an invalid deadline must send nothing upstream"
    assert engine.record.generations == [] and engine.record.aborts == []


async def test_a_repeated_header_is_400(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    async with asyncio.timeout(WAIT_S):
        response, _ = await stream_raw(servers.proxy_port, LONG_STREAM,
                                       [(HEADER, "1"), (HEADER, "2")])
    assert response.status == 400, f"expected 400, got {response.status} {response.body!r}"
    assert engine.watch.on(CHAT) == [], "a refused request must send nothing upstream"


async def test_a_request_done_before_its_deadline_is_never_aborted(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(1.0)))
    async with asyncio.timeout(WAIT_S):
        response, _ = await stream_raw(servers.proxy_port, "tokens=5&interval=0.01")
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{servers.proxy_port}{CHAT}?tokens=5&interval=0.01",
                data=chat_body(stream=False)) as r:
            plain = await r.json()
        await asyncio.sleep(1.5)  # past the deadline: a timer left armed would fire now
    assert response.status == 200 and response.ending == "complete", response
    assert response.body.endswith(b"data: [DONE]\n\n"), response.body[-100:]
    assert r.status == 200 and "choices" in plain, plain
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborts}"
    values = await metrics(servers.admin_port or 0)
    exceeded = [v for (n, _), v in values.items()
                if n == "cancel_sidecar_deadline_exceeded_total" and v]
    assert exceeded == [], f"expected no deadline exceeded, got {exceeded}"


async def test_openai_sdk_raises_api_error_on_a_stream_cut_by_the_deadline(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    texts: list[str] = []
    async with asyncio.timeout(WAIT_S), openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{servers.proxy_port}/v1", api_key="client-key",
            max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_query={"tokens": 1000, "interval": 0.01})
        request_id = raw.headers["x-request-id"]
        with pytest.raises(openai.APIError) as caught:
            async for chunk in raw.parse():
                texts.append(str(chunk))
    assert caught.value.message == "deadline exceeded", f"got {caught.value!r}"
    assert caught.value.body == {"message": "deadline exceeded", "type": "deadline_exceeded",
                                 "param": None, "code": None}, caught.value.body
    assert texts, "expected chunks before the deadline"
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)


@pytest.mark.parametrize("value", [0, -1, True, ".inf", ".nan", 10**9, "abc"])
def test_max_duration_s_is_validated_with_its_location(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        sidecar_settings("http://127.0.0.1:8000", routes=[
            {"prefix": "/v1", "engine": "local"},
            {"prefix": "/", "engine": "local", "max_duration_s": value}])
    assert "routes.1.max_duration_s" in str(caught.value), str(caught.value)


def test_max_duration_s_defaults_to_none_and_loads() -> None:
    settings = sidecar_settings("http://127.0.0.1:8000", routes=[
        {"prefix": "/v1", "engine": "local", "max_duration_s": 120},
        {"prefix": "/", "engine": "local"}])
    assert [r.max_duration_s for r in settings.routes] == [120.0, None]


def test_deadlines_example_loads() -> None:
    settings = load_config(REPO / "config/examples/deadlines.yaml", env={})
    limits = {r.prefix: r.max_duration_s for r in settings.routes}
    assert limits == {"/v1/chat/completions": 300.0, "/v1/completions": 300.0, "/": None}, limits


async def test_deadline_while_the_client_sends_its_body_answers_504_without_abort(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    body = chat_body(stream=True)
    half = len(body) // 2
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", CHAT, [("Content-Type", "application/json"),
                           ("Content-Length", str(len(body)))], body[:half]))
        await writer.drain()
        head = await rawhttp.read_head(reader)
        response = await rawhttp.read_body(reader, head, "POST")
        rest = await reader.read()  # the sidecar closes the connection: the body is never read
    assert head.status == 504, f"expected 504, got {head.status} {response.body!r}"
    assert json.loads(response.body)["error"]["type"] == "deadline_exceeded", response.body
    assert rest == b"", f"expected the connection closed after the 504, got {rest!r}"
    assert await engine.watch.until(
        lambda: bool(engine.watch.on(CHAT)) and engine.watch.on(CHAT)[0].failed_at is not None,
        WAIT_S), "expected the engine's half-sent request closed"
    async with aiohttp.ClientSession() as s, s.get(
            f"http://127.0.0.1:{servers.proxy_port}/health") as r:
        assert r.status == 200
    assert engine.record.aborts == [], (
        f"the engine never had the whole request: no abort expected, got {engine.record.aborts}")
    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "request_body")})
    assert values.get(("cancel_sidecar_deadline_exceeded_total", labels)) == 1.0, values


async def test_deadline_while_a_json_body_is_relayed_cuts_it_short(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.access")
    servers: Servers = await start_sidecar(sidecar_settings(engine.url, routes=route(0.5)))
    body = chat_body(stream=False)
    # The head (with Content-Length) and the first of 20 pieces at once, then one every 0.1 s:
    # the 0.5 s deadline passes with the body about a quarter sent.
    query = "tokens=200&interval=0&body_pieces=20&body_interval=0.1"
    started = time.monotonic()
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"{CHAT}?{query}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body))
        head = await rawhttp.read_head(reader)
        response = await rawhttp.read_body(reader, head, "POST")
        rest = await reader.read()
    took = time.monotonic() - started
    length = head.get("Content-Length")
    assert head.status == 200 and length is not None and not head.chunked, (
        f"expected a 200 with a Content-Length (the head went out before the deadline), got "
        f"{head}")
    assert response.ending == "eof" and 0 < len(response.body) < int(length), (
        f"expected the body cut short ({length} announced) and the connection closed, got "
        f"{len(response.body)} bytes ending {response.ending}")
    assert rest == b"", f"expected nothing after the cut, got {rest!r}"
    with pytest.raises(ValueError):
        json.loads(response.body)  # the client can tell: the JSON is incomplete
    assert 0.5 <= took < 4.5, f"expected the cut at ~0.5 s (guard +4 s), took {took:.3f} s"
    request_id = head.get("X-Request-Id")
    assert request_id, head.headers
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)
    assert not engine.record.generations[0].finished, "the engine must not have finished"

    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "awaiting_response")})
    assert values.get(("cancel_sidecar_deadline_exceeded_total", labels)) == 1.0, values
    cancelled = frozenset({("route", "/"), ("status_class", "cancelled")})
    assert values.get(("cancel_sidecar_requests_total", cancelled)) == 1.0, values
    # A JSON answer whose head came: generated whole already, nothing to confirm (accepted).
    expected = {"status": 200, "client_disconnected": False, "phase": "awaiting_response",
                "cancel_reason": "deadline exceeded", "abort": "accepted",
                "bytes_sent": len(response.body)}
    line = access_line(caplog, request_id)
    got = {k: line[k] for k in expected}
    assert got == expected, f"expected the access line {expected}, got {got}"
