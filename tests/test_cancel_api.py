"""The cancel API: ``POST /v1/requests/{id}/cancel`` on the admin listener ends a request in
flight: the engine is aborted once with exactly its ids, the upstream closed, and the client's
response ended (a JSON 499 before the head; mid-SSE a final ``error`` event the openai SDK raises
as ``APIError``, then the end of the stream).

Production wiring throughout: :func:`sidecar.server.start` (the ``start_sidecar`` fixture);
``--workers 2`` (the supervisor asking its workers) is ``tests/test_cancel_workers.py``.
Clients are raw sockets (to see the chunk framing and how the body ended), aiohttp and the
openai SDK; the engine is :mod:`tests.fakes.engine`.
Waits are event-driven with a generous limit (``WAIT_S``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from sidecar.config import load_config, parse_config
from sidecar.errors import ConfigError
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness import rawhttp
from tests.harness.support import metrics, no_event, settle

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
QUIET_S = 0.3  # how long to wait for something that must NOT happen (then a settle request)
TOKEN = "admin-cancel-sekret-4321"
CHAT = "/v1/chat/completions"
CANCELLED_EVENT = (b'data: {"error": {"message": "request cancelled", "type": "cancelled", '
                   b'"param": null, "code": null}}\n\n')
REPO = Path(__file__).resolve().parent.parent


def chat_body(stream: bool) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": stream}).encode()


async def cancel(admin_port: int, request_id: str, token: str | None = None
                 ) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{admin_port}/v1/requests/{request_id}/cancel",
            headers=headers) as r:
        return r.status, await r.json()


async def started_request_id(engine: FakeEngine) -> str:
    """The sidecar id of the request the engine started (the first), once it has."""
    await asyncio.wait_for(engine.record.started_event.wait(), WAIT_S)
    request_id = engine.record.generations[0].request_id
    assert request_id is not None, "the engine got no X-Request-Id"
    return request_id


def access_line(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, Any]:
    """The one access line logged for ``request_id`` (fails if there is not exactly one)."""
    lines = [r.__dict__["access"] for r in caplog.records if r.name == "sidecar.access"
             and r.__dict__["access"]["request_id"] == request_id]
    assert len(lines) == 1, f"expected one access line for {request_id}, got {lines}"
    return dict(lines[0])


async def aborted_once(engine: FakeEngine, expected: list[str], proxy_port: int) -> None:
    """Exactly one abort call, naming exactly ``expected``; the generation stopped (aborted: it
    ended at once, the sidecar's confirmation; or its connection closed).
    "No second abort": none arrives within ``QUIET_S``, nor before a full request through the
    sidecar (the admin answer came after the handler unwound, so any abort had started)."""
    await asyncio.wait_for(engine.record.abort_event.wait(), WAIT_S)
    await asyncio.wait_for(engine.record.stopped_event.wait(), WAIT_S)
    engine.record.abort_event.clear()
    await no_event(engine.record.abort_event, QUIET_S)
    await settle(proxy_port)
    assert [a.ids for a in engine.record.aborts] == [expected], (
        f"expected one abort call with {expected}, got {[a.ids for a in engine.record.aborts]}")
    stopped = [g.stopped_at is not None and not g.finished for g in engine.record.generations]
    assert stopped == [True], f"expected the one generation stopped, got {stopped}"


async def test_cancel_mid_stream_ends_sse_with_an_error_event(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.access")
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    body = chat_body(stream=True)
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"{CHAT}?tokens=1000&interval=0.01",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body))
        head = await rawhttp.read_head(reader)
        assert head.status == 200 and head.chunked, f"expected a chunked 200, got {head}"
        request_id = head.get("X-Request-Id")
        assert request_id, f"expected X-Request-Id on the response, got {head.headers}"
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        first = (await reader.readexactly(size + 2))[:-2]
        assert first.startswith(b"data: ") and first.endswith(b"\n\n"), first
        status, answer = await cancel(servers.admin_port or 0, request_id)
        rest = await rawhttp.read_body(reader, head, "POST")
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "streaming"}), (status, answer)
    assert rest.ending == "complete", f"expected the stream properly ended, got {rest.ending}"
    assert rest.body.endswith(CANCELLED_EVENT), (
        f"expected the error event last, got {rest.body[-200:]!r}")
    assert b"[DONE]" not in rest.body, "a cancelled stream must not claim success with [DONE]"
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)

    values = await metrics(servers.admin_port or 0)
    route_phase = frozenset({("route", "/"), ("phase", "streaming")})
    assert values.get(("cancel_sidecar_cancelled_requests_total", route_phase)) == 1.0, values
    disconnects = [v for (n, _), v in values.items()
                   if n == "cancel_sidecar_client_disconnects_total" and v]
    assert disconnects == [], f"a cancel is not a client disconnect, got {disconnects}"
    cancelled = frozenset({("route", "/"), ("status_class", "cancelled")})
    assert values.get(("cancel_sidecar_requests_total", cancelled)) == 1.0, values

    expected = {"status": 200, "client_disconnected": False, "phase": "streaming",
                "cancel_reason": "cancelled via API", "abort": "confirmed"}
    line = access_line(caplog, request_id)
    got = {k: line[k] for k in expected}
    assert got == expected, f"expected the access line {expected}, got {got}"


async def test_openai_sdk_raises_api_error_on_a_cancelled_stream(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    texts: list[str] = []
    answer: tuple[int, dict[str, Any]] | None = None
    async with asyncio.timeout(WAIT_S), openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{servers.proxy_port}/v1", api_key="client-key",
            max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_query={"tokens": 1000, "interval": 0.01})
        request_id = raw.headers["x-request-id"]
        stream = raw.parse()
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                texts.append(str(chunk))
                if answer is None:
                    answer = await cancel(servers.admin_port or 0, request_id)
    assert answer == (200, {"id": request_id, "cancelled": True, "phase": "streaming"}), answer
    assert caught.value.message == "request cancelled", f"got {caught.value!r}"
    assert caught.value.body == {"message": "request cancelled", "type": "cancelled",
                                 "param": None, "code": None}, caught.value.body
    assert texts, "expected at least one chunk before the cancel"
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)


async def test_cancel_while_queued_answers_499_json(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    url = f"http://127.0.0.1:{servers.proxy_port}{CHAT}?first_byte_delay=30"
    async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as session:
        client = asyncio.ensure_future(session.post(url, data=chat_body(stream=True)))
        request_id = await started_request_id(engine)
        status, answer = await cancel(servers.admin_port or 0, request_id)
        response = await client
        body = await response.json()
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "before_first_byte"}), (status, answer)
    assert response.status == 499, f"expected 499, got {response.status}: {body}"
    assert response.headers.get("X-Request-Id") == request_id, response.headers
    assert body["error"]["type"] == "cancelled", body
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)


async def test_cancel_non_streaming_openai_sdk_gets_499_without_retrying(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    async with asyncio.timeout(WAIT_S), openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{servers.proxy_port}/v1", api_key="client-key",
            max_retries=2) as client:  # the SDK's default retries
        call = asyncio.ensure_future(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}],
            extra_query={"tokens": 1000, "interval": 0.01}))
        request_id = await started_request_id(engine)
        status, answer = await cancel(servers.admin_port or 0, request_id)
        with pytest.raises(openai.APIStatusError) as caught:
            await call
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "awaiting_response"}), (status, answer)
    assert caught.value.status_code == 499, f"got {caught.value!r}"
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)
    assert len(engine.record.generations) == 1, "expected no retry of a cancelled request"


async def test_unknown_and_second_cancel_are_404(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    status, answer = await cancel(servers.admin_port or 0, "0" * 32)
    assert status == 404 and answer["error"]["type"] == "not_found", (status, answer)

    url = f"http://127.0.0.1:{servers.proxy_port}{CHAT}?first_byte_delay=30"
    async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as session:
        client = asyncio.ensure_future(session.post(url, data=chat_body(stream=True)))
        request_id = await started_request_id(engine)
        first = await cancel(servers.admin_port or 0, request_id)
        second = await cancel(servers.admin_port or 0, request_id)
        (await client).release()
    assert first[0] == 200, first
    assert second[0] == 404 and second[1]["error"]["type"] == "not_found", second
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)


async def test_cancel_token_is_required_when_configured(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, admin={"cancel_token": TOKEN}))
    unknown = "0" * 32
    for token in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
        status, answer = await cancel(servers.admin_port or 0, unknown, token)
        assert status == 401 and answer["error"]["type"] == "unauthorized", (token, answer)
    status, answer = await cancel(servers.admin_port or 0, unknown, TOKEN)
    assert status == 404, f"the right token must pass to the lookup, got {status} {answer}"
    assert TOKEN not in caplog.text, "the cancel token must never be logged"


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
async def test_the_auth_scheme_is_case_insensitive(
        engine: FakeEngine, start_sidecar: Callable[..., Any], scheme: str) -> None:
    """RFC 9110 section 11.1: the scheme token is case-insensitive; the token itself is not."""
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, admin={"cancel_token": TOKEN}))
    for token, expected in ((TOKEN, 404), (TOKEN.upper(), 401)):
        raw = (b"POST /v1/requests/" + b"0" * 32 + b"/cancel HTTP/1.1\r\nHost: admin\r\n"
               b"Authorization: " + f"{scheme} {token}".encode() + b"\r\nContent-Length: 0\r\n\r\n")
        response = await rawhttp.exchange(servers.admin_port or 0, raw, "POST")
        assert response.status == expected, (
            f"{scheme} with the {'right' if expected == 404 else 'upper-cased'} token: expected "
            f"{expected}, got {response.status} {response.body!r}")


@pytest.mark.parametrize("value", [b"Bearer \xe9", b"\xff\xfe",
                                   b"Bearer " + TOKEN.encode() + b"\x80"])
async def test_a_token_that_is_not_utf8_is_401_not_500(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture, value: bytes) -> None:
    """Header bytes that are not UTF-8 (aiohttp keeps them as surrogates) are a wrong token:
    401, no traceback. Before, encoding them back raised: a 500 for anyone reaching the port."""
    caplog.set_level(logging.DEBUG)
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, admin={"cancel_token": TOKEN}))
    raw = (b"POST /v1/requests/" + b"0" * 32 + b"/cancel HTTP/1.1\r\nHost: admin\r\n"
           b"Authorization: " + value + b"\r\nContent-Length: 0\r\n\r\n")
    response = await rawhttp.exchange(servers.admin_port or 0, raw, "POST")
    assert response.status == 401, f"expected 401, got {response.status} {response.body!r}"
    assert "Traceback" not in caplog.text and not any(
        r.levelno >= logging.ERROR for r in caplog.records), caplog.text


async def test_the_proxy_listener_proxies_the_cancel_path_to_the_engine(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    path = "/v1/requests/abc/cancel"
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{servers.proxy_port}{path}") as r:
        await r.read()
    assert [seen.method for seen in engine.watch.on(path)] == ["POST"], (
        f"expected the engine to get the request, saw {[s.path for s in engine.watch.seen]}")


def test_cancel_api_example_loads_and_masks_the_token() -> None:
    path = REPO / "config/examples/cancel-api.yaml"
    settings = load_config(path, env={"CANCEL_SIDECAR_CANCEL_TOKEN": TOKEN})
    assert settings.admin is not None and settings.admin.cancel_token is not None
    assert settings.admin.cancel_token.get_secret_value() == TOKEN
    with pytest.raises(ConfigError) as caught:
        parse_config(path.read_text(), "<test>", env={
            "CANCEL_SIDECAR_CANCEL_TOKEN": TOKEN + "\x01"})
    assert "admin.cancel_token" in str(caught.value), str(caught.value)
    assert TOKEN not in str(caught.value), f"the token leaked: {caught.value}"


async def test_cancel_while_the_client_sends_its_body_answers_499_without_abort(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    body = chat_body(stream=True)
    half = len(body) // 2
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", CHAT, [("Content-Type", "application/json"),
                           ("Content-Length", str(len(body)))], body[:half]))
        await writer.drain()
        assert await engine.watch.until(lambda: bool(engine.watch.on(CHAT)), WAIT_S), (
            "expected the engine to see the request start while its body streams")
        request_id = engine.watch.on(CHAT)[0].request_id
        assert request_id is not None
        status, answer = await cancel(servers.admin_port or 0, request_id)
        head = await rawhttp.read_head(reader)
        response = await rawhttp.read_body(reader, head, "POST")
        rest = await reader.read()  # the sidecar closes the connection: the body is never read
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "request_body"}), (status, answer)
    assert head.status == 499, f"expected 499, got {head.status} {response.body!r}"
    assert json.loads(response.body)["error"]["type"] == "cancelled", response.body
    assert rest == b"", f"expected the connection closed after the 499, got {rest!r}"
    assert await engine.watch.until(lambda: engine.watch.on(CHAT)[0].failed_at is not None,
                                    WAIT_S), "expected the engine's half-sent request closed"
    async with aiohttp.ClientSession() as s, s.get(
            f"http://127.0.0.1:{servers.proxy_port}/health") as r:
        assert r.status == 200
    assert engine.record.aborts == [], (
        f"the engine never had the whole request: no abort expected, got {engine.record.aborts}")


async def test_cancel_while_a_json_body_is_relayed_cuts_it_short(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    body = chat_body(stream=False)
    # The head (with Content-Length) and the first of 20 pieces at once, then one every 0.1 s.
    query = "tokens=200&interval=0&body_pieces=20&body_interval=0.1"
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"{CHAT}?{query}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body))
        head = await rawhttp.read_head(reader)
        length = head.get("Content-Length")
        assert head.status == 200 and length is not None, f"expected a 200 with a length: {head}"
        first = await reader.read(int(length))
        request_id = head.get("X-Request-Id")
        assert request_id, head.headers
        status, answer = await cancel(servers.admin_port or 0, request_id)
        rest = await reader.read()  # to the end: the sidecar closes the connection
    assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                      "phase": "awaiting_response"}), (status, answer)
    got = first + rest
    assert 0 < len(got) < int(length), (
        f"expected the body cut short of its {length} bytes, got {len(got)}: {got!r}")
    await aborted_once(engine, [f"chatcmpl-{request_id}"], servers.proxy_port)
    values = await metrics(servers.admin_port or 0)
    labels = frozenset({("route", "/"), ("phase", "awaiting_response")})
    assert values.get(("cancel_sidecar_cancelled_requests_total", labels)) == 1.0, values


@pytest.mark.parametrize("ending", ["cancel_api", "deadline"])
async def test_after_done_a_cancel_or_deadline_adds_nothing_to_the_stream(
        engine: FakeEngine, start_sidecar: Callable[..., Any], ending: str) -> None:
    """The stream relayed ``data: [DONE]`` but the engine holds its connection open a while
    longer: the client has its whole answer, so a cancel is 404 and a deadline does nothing;
    no error event ever follows ``[DONE]``, nothing is aborted, the stream ends with the
    engine's final chunk. Before, both wrote an error event after ``[DONE]``."""
    servers: Servers = await start_sidecar(sidecar_settings(engine.url))
    body = chat_body(stream=True)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if ending == "deadline":
        headers.append(("X-Sidecar-Deadline-S", "0.5"))
    async with asyncio.timeout(WAIT_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"{CHAT}?tokens=3&interval=0.01&hang_after_done=1.5", headers, body))
        head = await rawhttp.read_head(reader)
        request_id = head.get("X-Request-Id")
        assert head.status == 200 and request_id, head
        seen = await reader.readuntil(b"data: [DONE]\n\n\r\n")  # its chunk ends there
        if ending == "cancel_api":
            status, answer = await cancel(servers.admin_port or 0, request_id)
            assert status == 404, f"a finished stream cannot be cancelled: {status} {answer}"
        rest = await rawhttp.read_body(reader, head, "POST")
    assert rest.ending == "complete", f"expected the stream properly ended, got {rest.ending}"
    assert b"error" not in rest.body and seen.count(b"data:") == 4, (seen, rest.body)
    await asyncio.sleep(0.3)
    assert engine.record.aborts == [], engine.record.aborted_ids()
    values = await metrics(servers.admin_port or 0)
    early = [(n, v) for (n, _), v in values.items() if v and n in (
        "cancel_sidecar_cancelled_requests_total", "cancel_sidecar_deadline_exceeded_total",
        "cancel_sidecar_client_disconnects_total")]
    assert early == [], f"a completed stream counts as no early end: {early}"
