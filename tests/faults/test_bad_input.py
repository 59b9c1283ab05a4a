"""Bad input on the proxy listener, over raw sockets against the production wiring.

Requests aiohttp cannot parse (or must not relay: smuggling shapes, other protocols on the plain
port) get an OpenAI-style JSON error with the status :mod:`sidecar.downstream` chooses, the
connection is closed, nothing reaches the engine, no abort is called, the log has one WARNING
line without a traceback or request bytes, and the next connection is served as usual.

Bodies that are merely odd (not JSON, not UTF-8, deeply nested, ...) are none of the sidecar's
business: they reach the engine byte for byte, and a client that leaves while the engine holds
one is still aborted with exactly the default ids (the sidecar's body parsing never fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from sidecar.downstream import DownstreamRunner
from sidecar.logs import ACCESS_LOGGER
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.upstreams import RawRequest, RawUpstream
from tests.harness import rawhttp
from tests.harness.cli_process import cli_process, config_tree

GUARD_S = 10.0
CLIENT_SECRET = "client-secret-b7f3"  # a credential a client sent inside a malformed request
ENGINE_KEY = "sekret-key"  # the abort api_key of tests/conftest.py's config
LIMIT = 65536  # sidecar.upstream.MAX_HEADER_BYTES: max_line_size and max_field_size downstream

AUTH = f"Authorization: Bearer {CLIENT_SECRET}\r\n".encode()
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
TLS_CLIENT_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) + bytes(128)

# (id, request bytes, expected status). Statuses: sidecar/downstream.py's module docstring.
MALFORMED = [
    ("malformed_request_line", b"GARBAGE\r\n\r\n", 400),
    ("invalid_characters_in_method", b"GE(T /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("header_line_without_colon", b"GET /echo HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"NoColonHere\r\n\r\n", 400),
    ("header_name_with_space", b"GET /echo HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"Bad Name: v\r\n\r\n", 400),
    ("request_target_one_byte_over_64KiB",
     b"GET /" + b"a" * LIMIT + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    ("header_value_one_byte_over_64KiB", b"GET /echo HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"X-Big: " + b"v" * (LIMIT + 1) + b"\r\n\r\n", 431),
    ("more_than_128_header_fields", b"GET /echo HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"".join(b"X-H%d: v\r\n" % i for i in range(130)) + b"\r\n", 431),
    ("content_length_with_chunked", POST + b"Content-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("two_different_content_lengths", POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n"
     b"hello!", 400),
    ("content_length_with_plus_sign", POST + b"Content-Length: +5\r\n\r\nhello", 400),
    ("content_length_negative", POST + b"Content-Length: -5\r\n\r\nhello", 400),
    ("content_length_not_digits", POST + b"Content-Length: 5x\r\n\r\nhello", 400),
    ("transfer_encoding_chunked_identity", POST + b"Transfer-Encoding: chunked, identity\r\n"
     b"\r\n5\r\nhello\r\n0\r\n\r\n", 400),
    ("transfer_encoding_gzip", POST + b"Transfer-Encoding: gzip\r\n\r\nhello", 400),
    ("transfer_encoding_gzip_chunked", POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n"
     b"5\r\nhello\r\n0\r\n\r\n", 501),
    ("invalid_chunk_size", POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
     400),
    ("obs_fold_continuation_line", b"GET /echo HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"X-A: one\r\n  two\r\n\r\n", 400),
    ("nul_in_header_value", b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: "
     + CLIENT_SECRET.encode() + b"\x00\r\n\r\n", 400),
    ("cr_in_header_value", b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: "
     + CLIENT_SECRET.encode() + b"\rx\r\n\r\n", 400),
    ("http2_prior_knowledge_preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    ("tls_client_hello", TLS_CLIENT_HELLO, 400),
    # Targets aiohttp's URL type refuses while building the request (a hostile tester's
    # finding: the connection used to hang, unanswered, until the client gave up).
    ("absolute_target_with_invalid_idna_host", b"GET http://xn--/v1/models HTTP/1.1\r\n"
     b"Host: x\r\n\r\n", 400),
    ("absolute_target_with_invalid_idna_label", b"GET http://xn--a.b/v1/models HTTP/1.1\r\n"
     b"Host: x\r\n\r\n", 400),
]


async def _send_and_read(port: int, raw: bytes) -> tuple[rawhttp.RawResponse, bytes, bytes]:
    """Send ``raw`` on a new connection; returns the response, its raw bytes, and what came
    after it before the connection ended (``b""``: closed with nothing more)."""
    async with rawhttp.connect(port) as (reader, writer):
        writer.write(raw)
        with contextlib.suppress(ConnectionError):  # the sidecar may answer before reading all
            await writer.drain()
        head = await rawhttp.read_head(reader)
        response = await rawhttp.read_body(reader, head)
        try:
            after = await reader.read()
        except ConnectionResetError:
            after = b""
        wire = ("\r\n".join(f"{k}: {v}" for k, v in response.headers)).encode() + response.body
        return response, wire, after


def _error_body(response: rawhttp.RawResponse) -> dict[str, Any]:
    body = json.loads(response.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (
        f"expected the OpenAI error shape, got {body}")
    error: dict[str, Any] = body["error"]
    assert error["code"] == response.status and error["param"] is None, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


@pytest.mark.parametrize(("raw", "status"), [pytest.param(raw, status, id=name)
                                             for name, raw, status in MALFORMED])
async def test_malformed_request_gets_a_json_error_and_reaches_nothing(
        raw: bytes, status: int, engine: FakeEngine, sidecar: Servers,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with asyncio.timeout(GUARD_S):
        response, wire, after = await _send_and_read(sidecar.proxy_port, raw)
    assert response.status == status, (
        f"expected {status}, got {response.status} {response.headers} {response.body[:200]!r}")
    assert (response.get("Content-Type") or "").startswith("application/json"), response.headers
    assert (response.get("Connection") or "").lower() == "close", (
        f"expected Connection: close, got {response.headers}")
    assert after == b"", f"expected the connection closed after the error, got {after[:80]!r}"
    error = _error_body(response)
    assert error["type"] == ("not_implemented" if status == 501 else "invalid_request"), error
    for secret in (CLIENT_SECRET, ENGINE_KEY):
        assert secret.encode() not in wire, f"{secret!r} echoed in the response {wire[:300]!r}"
        assert secret not in caplog.text, f"{secret!r} in the log:\n{caplog.text}"
    assert engine.watch.seen == [] and engine.record.aborts == [], (
        f"expected nothing at the engine, saw {[(s.method, s.path) for s in engine.watch.seen]} "
        f"and aborts {engine.record.aborts}")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], (
        f"expected no traceback and no ERROR, got:\n{caplog.text}")
    warnings = [r for r in caplog.records if r.name == "sidecar.downstream"]
    if status == 501:  # refused by the proxy handler: its access line, no parse warning
        assert warnings == [], caplog.text
        assert [a["status"] for a in _access_lines(caplog)] == [501], caplog.text
    else:
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, (
            f"expected one WARNING line from sidecar.downstream, got:\n{caplog.text}")
        assert f"with {status}:" in warnings[0].getMessage(), warnings[0].getMessage()
    if status != 501:  # a parse error: the admin listener answers in JSON too (aiohttp's
        # default 8 KiB header limits there, so a long line is refused earlier)
        async with asyncio.timeout(GUARD_S):
            admin_response, _, admin_after = await _send_and_read(sidecar.admin_port or 0, raw)
        assert 400 <= admin_response.status < 600 and admin_after == b"", (
            f"admin listener: expected an error and a close, got {admin_response.status} "
            f"{admin_response.body[:200]!r}")
        _error_body(admin_response)
    async with asyncio.timeout(GUARD_S):
        good = await rawhttp.exchange(sidecar.proxy_port, rawhttp.request_bytes(
            "GET", "/echo/after", [("Connection", "close")]))
    assert good.status == 200 and json.loads(good.body)["path_qs"] == "/echo/after", (
        f"expected a good request on a new connection to work, got {good.status} {good.body!r}")


@pytest.mark.parametrize("what", ["target", "value"])
async def test_request_target_and_header_value_of_exactly_64KiB_pass(
        what: str, engine: FakeEngine, sidecar: Servers) -> None:
    """The bound is 65536 bytes, not aiohttp's default 8190: one byte more is the 431 above.
    aiohttp 3.14's C parser counts the target alone, and a value alone (the name's size is
    only added for the first field: ``_http_parser.pyx`` resets it in ``_process_header``)."""
    target = "/echo/" + "a" * (LIMIT - len("/echo/")) if what == "target" else "/echo/f"
    headers = [("Connection", "close")]
    if what == "value":
        headers.append(("X-Big", "v" * LIMIT))
    raw = rawhttp.request_bytes("GET", target, headers)
    # The fake engine is plain aiohttp (8190-byte limits): it may refuse what the sidecar relays.
    async with asyncio.timeout(GUARD_S):
        response = await rawhttp.exchange(sidecar.proxy_port, raw)
    assert response.status != 431 and response.get("X-Request-Id"), (
        f"expected a {what} of exactly {LIMIT} bytes relayed (an engine answer carrying "
        f"X-Request-Id), got {response.status} {response.headers}")
    assert [s.path for s in engine.watch.seen] in ([], [target.split("?")[0]]), engine.watch.seen


async def test_parse_errors_through_the_cli_log_one_line_and_no_traceback(
        engine: FakeEngine, tmp_path: Any) -> None:
    """The CLI's own log configuration (JSON lines on stderr): one WARNING per refused request,
    no ``exc`` field, no request bytes."""
    async with cli_process(tmp_path, config_tree(engine.url)) as cli:
        for name, raw, status in MALFORMED:
            if name in ("header_line_without_colon", "request_target_one_byte_over_64KiB"):
                async with asyncio.timeout(GUARD_S):
                    response, _, _ = await _send_and_read(cli.proxy_port, raw)
                assert response.status == status, (name, response.status, response.body)
        await cli.wait_log("with 431:")
        lines = [json.loads(line) for line in cli.stderr_lines if line.startswith("{")]
    refused = [line for line in lines if line["logger"] == "sidecar.downstream"]
    assert [(r["level"], r["msg"].split(":")[0]) for r in refused] == [
        ("WARNING", "refused a malformed request from 127.0.0.1 with 400"),
        ("WARNING", "refused a malformed request from 127.0.0.1 with 431")], refused
    assert not [line for line in lines if "exc" in line or line["level"] == "ERROR"], lines
    assert "Traceback" not in cli.stderr and CLIENT_SECRET not in cli.stderr, cli.stderr
    assert "aaaaaaaa" not in cli.stderr, "request bytes (the long target) reached the log"


# -- odd bodies pass through untouched ----------------------------------------------------------

_rng = random.Random(20240607)
# Each holds b'"stream"' so the sidecar's stream detection really parses it on a disconnect.
ODD_BODIES = {
    "not_json": b'stream it, "stream" please: not JSON',
    "not_utf8": _rng.randbytes(4096) + b'"stream"' + bytes(range(128, 256)),
    "json_with_utf8_bom": b'\xef\xbb\xbf{"stream": true, "messages": []}',
    "huge_numbers": b'{"stream": true, "n": ' + b"9" * 5000 + b', "t": 1e999999}',
    "deeply_nested": b"[" * 100_000 + b'"stream"',
    "top_level_array": b'[{"stream": true}, {"prompt": ["a", "b"]}]',
    "top_level_string": b'"stream"',
}
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize"]  # the last generates nothing
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def _head_field(request: RawRequest, name: str) -> str | None:
    for line in request.head.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


async def _until(upstream: RawUpstream, predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(GUARD_S):
        while not predicate():
            upstream.received.clear()
            await upstream.received.wait()
    assert predicate(), what


@pytest.mark.parametrize("body", ODD_BODIES.values(), ids=ODD_BODIES.keys())
async def test_odd_bodies_reach_the_engine_byte_identical(
        body: bytes, start_sidecar: Callable[..., Any]) -> None:
    upstream = RawUpstream(lambda _request: OK)
    await upstream.start()
    try:
        servers: Servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        for path in PATHS:
            for framing in ("length", "chunked"):
                headers = [("Content-Type", "application/json"), ("Connection", "close")]
                if framing == "length":
                    headers.append(("Content-Length", str(len(body))))
                    payload = body
                else:
                    headers.append(("Transfer-Encoding", "chunked"))
                    payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                async with asyncio.timeout(GUARD_S):
                    response = await rawhttp.exchange(
                        servers.proxy_port, rawhttp.request_bytes("POST", path, headers, payload))
                assert (response.status, response.body) == (200, b"{}"), (
                    f"{path} ({framing}): expected the engine's 200, got {response.status} "
                    f"{response.body[:200]!r}")
                got = upstream.requests[-1]
                assert got.head.startswith(f"POST {path} ".encode()), got.head[:80]
                assert got.body == body, (
                    f"{path} ({framing}): expected the {len(body)} body bytes unchanged, the "
                    f"engine got {len(got.body)} starting {got.body[:40]!r}")
    finally:
        await upstream.stop()


async def test_gzip_request_body_is_relayed_compressed(start_sidecar: Callable[..., Any]) -> None:
    """aiohttp's server inflates ``Content-Encoding: gzip`` request bodies unless told not to;
    the engine must get the client's compressed bytes under the client's label."""
    body = gzip.compress(b'{"messages": [], "stream": true}' * 50, mtime=0)
    upstream = RawUpstream(lambda _request: OK)
    await upstream.start()
    try:
        servers: Servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with asyncio.timeout(GUARD_S):
            response = await rawhttp.exchange(servers.proxy_port, rawhttp.request_bytes(
                "POST", "/v1/chat/completions",
                [("Content-Encoding", "gzip"), ("Content-Length", str(len(body))),
                 ("Connection", "close")], body))
    finally:
        await upstream.stop()
    assert response.status == 200, response
    got = upstream.requests[-1]
    assert got.body == body and _head_field(got, "Content-Encoding") == "gzip", (
        f"expected {len(body)} gzip bytes labelled gzip, got {len(got.body)} bytes "
        f"{got.body[:16]!r} with Content-Encoding {_head_field(got, 'Content-Encoding')!r}")


# Where each was when the client left: only a JSON object saying "stream": true (a UTF-8 BOM is
# allowed: json.loads strips it from bytes) is a stream the engine has not started answering.
ODD_BODY_PHASE = {name: "before_first_byte" if name == "json_with_utf8_bom" else "awaiting_response"
                  for name in ODD_BODIES}


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [getattr(r, "access") for r in caplog.records if hasattr(r, "access")]  # noqa: B009


class _AccessLineSeen(logging.Handler):
    """Sets :attr:`seen` when ``sidecar.access`` writes a line (it waits for the abort outcome)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.set()


@pytest.mark.parametrize("name", ODD_BODIES)
@pytest.mark.parametrize(("path", "prefix", "suffix"), [
    ("/v1/chat/completions", "chatcmpl-", ""), ("/v1/completions", "cmpl-", "-0")])
async def test_disconnect_with_an_odd_body_aborts_exactly_the_default_ids(
        name: str, path: str, prefix: str, suffix: str, start_sidecar: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine has the whole body and is silent (queued); the client leaves: the sidecar's
    body parsing (stream detection, id derivation) must neither fail nor change the ids."""
    caplog.set_level(logging.INFO)
    access_line = _AccessLineSeen()
    logging.getLogger(ACCESS_LOGGER).addHandler(access_line)
    body = ODD_BODIES[name]
    upstream = RawUpstream(lambda request: OK if b"abort_requests" in request.head[:80] else None)
    await upstream.start()
    try:
        servers: Servers = await start_sidecar(sidecar_settings(upstream.url, confirm=False))
        async with rawhttp.connect(servers.proxy_port) as (_reader, writer):
            writer.write(rawhttp.request_bytes("POST", path, [
                ("Content-Length", str(len(body)))], body))
            await writer.drain()
            await _until(upstream, lambda: len(upstream.requests) == 1, "the request upstream")
        await _until(upstream, lambda: len(upstream.requests) == 2, "an abort call")
        await asyncio.wait_for(access_line.seen.wait(), GUARD_S)
    finally:
        logging.getLogger(ACCESS_LOGGER).removeHandler(access_line)
        await upstream.stop()
    generation, abort = upstream.requests[:2]
    assert generation.body == body, "the engine did not get the body unchanged"
    sid = _head_field(generation, "X-Request-Id")
    assert sid and abort.head.startswith(b"POST /inference/v1/abort_requests "), abort.head[:80]
    assert json.loads(abort.body) == {"request_ids": [f"{prefix}{sid}{suffix}"]}, abort.body
    assert len(upstream.requests) == 2, f"expected one abort call, got {upstream.requests[2:]}"
    access = _access_lines(caplog)
    assert [(a["phase"], a["client_disconnected"], a["abort"]) for a in access] == [
        (ODD_BODY_PHASE[name], True, "accepted")], access
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- the sidecar's own failures ----------------------------------------------------------------

@pytest.mark.parametrize(("raised", "status", "error_type"), [
    (RuntimeError(f"boom {CLIENT_SECRET}"), 500, "internal_error"),
    (TimeoutError(), 504, "timeout"),
])
async def test_handler_exception_is_a_json_error_without_traceback(
        raised: Exception, status: int, error_type: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """No client input makes the proxy handler raise (that would be a bug), so this serves an
    app whose handler does through :class:`sidecar.downstream.DownstreamRunner`, as
    ``sidecar.server.start`` serves the proxy: JSON body, no traceback or exception text in it,
    the traceback in the log at ERROR (a bug must be visible), the connection closed."""
    async def failing(request: web.Request) -> web.StreamResponse:
        raise raised

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", failing)
    runner = DownstreamRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = int(runner.addresses[0][1])
        async with asyncio.timeout(GUARD_S):
            response, wire, after = await _send_and_read(
                port, rawhttp.request_bytes("GET", "/x", [("Accept", "text/html")]))
    finally:
        await runner.cleanup()
    assert response.status == status and after == b"", (response.status, response.body, after)
    assert (response.get("Connection") or "").lower() == "close", response.headers
    assert _error_body(response)["type"] == error_type, response.body
    assert b"Traceback" not in wire and CLIENT_SECRET.encode() not in wire, wire
    errors = [r for r in caplog.records if r.name == "sidecar.downstream"]
    assert [r.levelno for r in errors] == [logging.ERROR], caplog.text
    assert (errors[0].exc_info is not None) == (status == 500), "traceback logged for a bug only"
