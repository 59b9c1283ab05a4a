"""The ``sglang`` engine kind: the adapter's pure logic (exact ids, property tests) and the
production wiring against a fake SGLang server (``tests/fake_sglang.py``, real aiohttp on
127.0.0.1) that reads ``rid`` from the body, aborts by prefix and answers 200 to any abort.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import build_adapters
from engine.sglang import SGLangAdapter
from sidecar.config import EngineSettings, Settings, parse_config
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fake_sglang import FakeSGLang

SID = "0123456789abcdef0123456789abcdef"
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def adapter() -> SGLangAdapter:
    settings = EngineSettings.model_validate({"kind": "sglang", "url": "http://127.0.0.1:1"})
    built = build_adapters({"local": settings})["local"]
    assert isinstance(built, SGLangAdapter), f"registry built {type(built)} for kind sglang"
    return built


ADAPTER = adapter()


def ids(path: str, body: Any, sid: str = SID) -> tuple[str, ...]:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return ADAPTER.engine_request_ids("POST", path, sid, raw)


# -- adapter: exact ids, abort call, forbidden paths ------------------------------------------

@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions", {"messages": [], "stream": True}, (SID,)),
    ("/v1/chat/completions", b"not json", (SID,)),
    ("/generate", {"text": "hi"}, (SID,)),
    ("/generate", {"input_ids": [1, 2, 3]}, (SID,)),
    ("/generate", {"text": ["a", "b", "c"]}, (f"{SID}_0", f"{SID}_1", f"{SID}_2")),
    ("/generate", {"input_ids": [[1], [2]]}, (f"{SID}_0", f"{SID}_1")),
    ("/generate", {"input_embeds": [[0.5, 0.25]]}, (SID,)),
    ("/generate", {"input_embeds": [[[0.5]], [[0.25]]]}, (f"{SID}_0", f"{SID}_1")),
    ("/v1/completions", {"prompt": "hello"}, (SID,)),
    ("/v1/completions", {"prompt": [1, 2]}, (SID,)),
    ("/v1/completions", {"prompt": ["a"]}, (f"{SID}_0",)),  # a list is a batch, even of one
    ("/v1/completions", {"prompt": [[1], [2]]}, (f"{SID}_0", f"{SID}_1")),
    # n > 1: SGLang gives every sample a fresh uuid4 rid: nothing to name.
    ("/v1/chat/completions", {"n": 3}, ()),
    ("/v1/completions", {"prompt": "x", "n": 2}, ()),
    ("/generate", {"text": "x", "sampling_params": {"n": 2}}, ()),
    ("/generate", {"text": "x", "sampling_params": [{"n": 2}]}, ()),
    ("/generate", {"text": "x", "sampling_params": {"n": 1}}, (SID,)),
])
def test_engine_ids(path: str, body: Any, expected: tuple[str, ...]) -> None:
    got = ids(path, body)
    assert got == expected, f"{path} {body!r}: expected {expected}, got {got}"


def test_non_generating_routes_name_nothing() -> None:
    assert ids("/v1/models", None) == ()
    assert ADAPTER.engine_request_ids("GET", "/generate", SID, None) == ()
    assert not ADAPTER.rewrites_body("GET", "/generate")


def test_abort_call_is_one_rid() -> None:
    call = ADAPTER.abort_call((SID,))
    assert (call.path, call.json) == ("/abort_request", {"rid": SID})
    calls = ADAPTER.abort_calls((f"{SID}_0", f"{SID}_1"))
    assert [c.json for c in calls] == [{"rid": f"{SID}_0"}, {"rid": f"{SID}_1"}]
    for bad in [(), ("",), (SID, SID)]:
        with pytest.raises(ValueError):
            ADAPTER.abort_call(bad)


def test_abort_endpoints_are_forbidden() -> None:
    assert {"/abort_request", "/pause_generation", "/update_weight_version"} <= (
        ADAPTER.forbidden_paths())


def test_tag_overwrites_the_override_header() -> None:
    headers = {"X-Override-Rid": "someone-else"}
    ADAPTER.tag("/generate", SID, headers)
    assert headers == {"X-Override-Rid": SID}


# -- adapter: property tests ------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)
BODY_OBJECTS = st.dictionaries(
    st.sampled_from(["rid", "text", "prompt", "input_ids", "input_embeds", "n",
                     "sampling_params", "messages", "stream"]) | st.text(), JSON, max_size=6)


@settings(max_examples=300, deadline=None)
@given(path=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_rewrite_and_ids_never_raise_on_bytes(path: str, raw: bytes) -> None:
    new = ADAPTER.rewrite_body("POST", path, SID, raw)
    assert new is None or json.loads(new)["rid"] == SID
    ADAPTER.engine_request_ids("POST", path, SID, raw if new is None else new)


@settings(max_examples=300, deadline=None)
@given(path=st.sampled_from(ROUTES), body=BODY_OBJECTS)
def test_rewrite_sets_the_minted_rid(path: str, body: dict[str, Any]) -> None:
    new = ADAPTER.rewrite_body("POST", path, SID, json.dumps(body).encode())
    assert new is not None, f"a JSON object must be rewritten: {body!r}"
    sent = json.loads(new)
    assert sent["rid"] == SID, f"rid not the minted id: {sent.get('rid')!r}"
    assert {k: v for k, v in sent.items() if k != "rid"} == {
        k: v for k, v in body.items() if k != "rid"}, "other fields changed"


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.tuples(st.uuids(version=4), st.sampled_from(ROUTES), BODY_OBJECTS),
                         min_size=2, max_size=6, unique_by=lambda r: r[0]))
def test_ids_of_concurrent_requests_never_prefix_each_other(
        requests: list[tuple[uuid.UUID, str, dict[str, Any]]]) -> None:
    """SGLang's scheduler aborts every rid that starts with the named one: an abort for one
    request must never reach another's ids (minted ids are 32 hex characters, fixed length)."""
    named = []
    for sid_uuid, path, body in requests:
        sid = sid_uuid.hex
        new = ADAPTER.rewrite_body("POST", path, sid, json.dumps(body).encode())
        named.append((sid, ids(path, new, sid)))
    for sid_a, ids_a in named:
        for sid_b, ids_b in named:
            if sid_a == sid_b:
                continue
            for a in ids_a:
                assert not any(b.startswith(a) for b in (sid_b, *ids_b)), (
                    f"abort of {a} would reach request {sid_b}'s ids {ids_b}")


# -- production wiring against the fake SGLang ------------------------------------------------

@pytest_asyncio.fixture
async def sglang() -> AsyncIterator[FakeSGLang]:
    fake = FakeSGLang()
    await fake.start()
    yield fake
    await fake.stop()


def sglang_settings(url: str) -> Settings:
    # A short grace: a failing test leaves a stream open, and teardown should not wait 30 s.
    return sidecar_settings(url, engines={"local": {"kind": "sglang", "url": url,
                                                    "abort": {"timeout_s": 2.0}}},
                            lifecycle={"grace_period_s": 1.0})


async def _post(port: int, path: str, body: dict[str, Any], query: str = ""
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path}{query} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"X-Request-Id: chosen-by-client\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
                 + raw)
    await writer.drain()
    return reader, writer


async def _no_abort_within(fake: FakeSGLang, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            await fake.record.abort_event.wait()
    except TimeoutError:
        pass


@pytest.mark.parametrize("path", ROUTES)
async def test_disconnect_mid_stream_aborts_exactly_the_request_rid(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any], path: str) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    body = {"text": "hi", "prompt": "hi", "messages": [], "stream": True, "rid": "client-rid"}
    reader, writer = await _post(sidecar.proxy_port, path, body, "?tokens=100000")
    async with asyncio.timeout(5):
        await reader.readuntil(b"data:")
    (rid,) = sglang.record.rids[0]
    assert len(rid) == 32 and rid != "client-rid", f"engine ran under {rid!r}, not a minted id"
    writer.transport.abort()
    async with asyncio.timeout(5):
        await sglang.record.abort_event.wait()
        await sglang.record.closed_event.wait()
    assert sglang.record.abort_calls == [{"rid": rid}], sglang.record.abort_calls
    assert sglang.record.aborted == [rid], f"expected {rid} aborted, got {sglang.record.aborted}"


async def test_disconnect_while_queued_aborts_the_queued_request(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    _, writer = await _post(sidecar.proxy_port, "/generate", {"text": "hi"}, "?queue=30")
    async with asyncio.timeout(5):
        await sglang.record.received.wait()
    writer.transport.abort()
    async with asyncio.timeout(5):
        await sglang.record.abort_event.wait()
    (rid,) = sglang.record.rids[0]
    assert sglang.record.abort_calls == [{"rid": rid}], sglang.record.abort_calls
    assert sglang.record.aborted == [rid]


async def test_batch_children_are_each_aborted(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    reader, writer = await _post(sidecar.proxy_port, "/generate",
                                 {"text": ["a", "b", "c"], "stream": True}, "?tokens=100000")
    async with asyncio.timeout(5):
        await reader.readuntil(b"data:")
    children = sglang.record.rids[0]
    writer.transport.abort()
    async with asyncio.timeout(5):
        while len(sglang.record.aborted) < 3:
            sglang.record.abort_event.clear()
            await sglang.record.abort_event.wait()
    assert sorted(sglang.record.aborted) == sorted(children), (
        f"expected all of {children} aborted, got {sglang.record.aborted}")
    # One call per child (SGLang takes one rid per call); the calls run concurrently, each on a
    # connection of its own, so they may reach the engine in any order.
    assert sorted(c["rid"] for c in sglang.record.abort_calls) == sorted(children), (
        f"expected one abort call per child {children}, got {sglang.record.abort_calls}")


async def test_n_samples_get_no_abort_only_the_upstream_close(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    """SGLang runs n > 1 samples under fresh random rids: the sidecar cannot name them."""
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    reader, writer = await _post(sidecar.proxy_port, "/v1/chat/completions",
                                 {"messages": [], "n": 2, "stream": True}, "?tokens=100000")
    async with asyncio.timeout(5):
        await reader.readuntil(b"data:")
    writer.transport.abort()
    async with asyncio.timeout(5):
        await sglang.record.closed_event.wait()
    await _no_abort_within(sglang, 0.5)
    assert sglang.record.abort_calls == [], sglang.record.abort_calls


async def test_same_client_rid_cannot_abort_another_client(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    body = {"messages": [], "stream": True, "rid": "shared"}
    url = f"http://127.0.0.1:{sidecar.proxy_port}/v1/chat/completions?tokens=30&interval=0.02"
    async with aiohttp.ClientSession() as session:
        survivor = asyncio.ensure_future(session.post(url, json=body))
        reader, writer = await _post(sidecar.proxy_port, "/v1/chat/completions", body,
                                     "?tokens=100000")
        async with asyncio.timeout(5):
            await reader.readuntil(b"data:")
        writer.transport.abort()
        async with asyncio.timeout(10):
            await sglang.record.abort_event.wait()
            resp = await survivor
            text = await resp.text()
    assert resp.status == 200 and '"finish_reason":"stop"' in text, (
        f"the other client's request must complete, got {resp.status} {text[-200:]!r}")
    assert len(sglang.record.rids) == 2 and sglang.record.rids[0] != sglang.record.rids[1]
    assert len(sglang.record.aborted) == 1 and sglang.record.aborted[0] in sglang.record.closed
    assert [c["rid"] for c in sglang.record.abort_calls] == sglang.record.aborted


async def test_completed_request_is_never_aborted(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    url = f"http://127.0.0.1:{sidecar.proxy_port}/v1/completions?tokens=5"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"prompt": "x", "stream": True}) as resp:
            text = await resp.text()
    assert "[DONE]" in text
    await _no_abort_within(sglang, 0.5)
    assert sglang.record.abort_calls == [] and sglang.record.completed == sglang.record.rids[0]


async def test_abort_endpoint_is_not_proxied(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    async with aiohttp.ClientSession() as session:
        for path in ("/abort_request", "/abort_request/", "/pause_generation"):
            async with session.post(f"http://127.0.0.1:{sidecar.proxy_port}{path}",
                                    json={"rid": "", "abort_all": True}) as resp:
                assert resp.status == 403, f"{path}: expected 403, got {resp.status}"
    assert sglang.record.abort_calls == []


async def test_readyz_probes_the_abort_route(
        sglang: FakeSGLang, start_sidecar: Callable[..., Any]) -> None:
    """SGLang answers 200 to any rid: the probe proves the route exists and accepts the call."""
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{sidecar.admin_port}/readyz") as resp:
            verdict = await resp.json()
    assert resp.status == 200 and verdict["engines"] == {"local": "ok"}, verdict
    (call,) = sglang.record.abort_calls
    assert set(call) == {"rid"} and call["rid"].startswith("cancel-sidecar-readiness-probe-")
    assert sglang.record.aborted == []


def test_example_config_builds_an_sglang_adapter() -> None:
    text = (Path(__file__).parent.parent / "config/examples/sglang.yaml").read_text()
    settings = parse_config(text, "config/examples/sglang.yaml", env={})
    (built,) = build_adapters(settings.engines).values()
    assert isinstance(built, SGLangAdapter) and built.abort_path == "/abort_request"
    assert built.abort_headers() == {}, "an empty key must send no Authorization header"
