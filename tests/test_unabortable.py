"""``cancel_sidecar_unabortable_requests_total{engine, reason}``: a request that ends early while
its engine runs it under ids the sidecar cannot know is counted once, by reason, its upstream is
closed and no abort call is made for it; a request that completes, an abortable request and a
close-only (``openai``) engine are never counted.

Production wiring (``tests/conftest.py``: ``server.start``, uvloop) against the real fakes on
127.0.0.1: :class:`tests.fakes.kinds.SGLangEngine` (SGLang's ``rid`` and fresh-rid-per-sample
behaviour) and ``tests/fakes/engine.py`` (vLLM). The counter is read from the admin listener's
``/metrics`` with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine import Unabortable, build_adapters
from sidecar.config import EngineSettings, Settings
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.kinds import SGLangEngine, VLLMEngine
from tests.harness.support import no_event

pytestmark = pytest.mark.timeout(60)

METRIC = "cancel_sidecar_unabortable_requests_total"
GUARD_S = 5.0  # any awaited event must arrive within this
QUIET_S = 0.5  # how long an abort call that must NOT come is waited for
SMALL_BUFFER = 1024  # upstream.replay_buffer_bytes for the over-the-buffer tests
# A body field that puts a body over SMALL_BUFFER for certain: the body is relayed unrewritten
# only if it is not complete once SMALL_BUFFER bytes are read, and aiohttp stops reading a socket
# past ~128 KiB buffered (plus one socket read, at most 256 KiB with uvloop), so 768 KiB can
# never be read in one go. (The fakes take bodies up to aiohttp's default 1 MiB.)
PAD = "x" * (768 << 10)
SID = "0123456789abcdef0123456789abcdef"


# -- helpers ------------------------------------------------------------------------------------

def sglang_config(url: str, **overrides: Any) -> Settings:
    # A short grace: a failing test leaves a stream open, and teardown should not wait 30 s.
    return sidecar_settings(url, engines={"local": {"kind": "sglang", "url": url,
                                                    "abort": {"timeout_s": 2.0,
                                                              "resend_window_s": 0}}},
                            lifecycle={"grace_period_s": 1.0}, **overrides)


async def post(port: int, path: str, body: dict[str, Any], query: str = "",
               extra_headers: str = "") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one POST on a raw socket (so the test can reset it) and return the stream pair."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path}{query} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"{extra_headers}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    await writer.drain()
    return reader, writer


async def counted(admin_port: int | None) -> dict[tuple[str, str], float]:
    """The counter's non-zero samples on ``/metrics``: (engine, reason) -> value."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
            assert resp.status == 200, f"GET /metrics: expected 200, got {resp.status}"
            text = await resp.text()
    return {(s.labels["engine"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == METRIC and s.value}


async def quiet(event: asyncio.Event) -> bool:
    """True if ``event`` stays unset for ``QUIET_S``."""
    return await no_event(event, QUIET_S)


async def no_call(fake: SGLangEngine) -> bool:
    """True if no abort call reaches ``fake`` within ``QUIET_S``."""
    return not await fake.watch.until(lambda: bool(fake.calls), QUIET_S)


async def sglang_closed(fake: SGLangEngine) -> None:
    """Wait for the fake SGLang to see its (first) request's connection close."""
    assert await fake.watch.until(lambda: fake.works[0].closed_at is not None, GUARD_S), (
        "expected the upstream connection closed")


async def sglang_stopped(fake: SGLangEngine) -> None:
    """Wait for the fake SGLang to stop its (first) request: aborted (it then ends the response,
    the sidecar's confirmation) or its connection closed."""
    assert await fake.watch.until(lambda: fake.works[0].stopped_at is not None, GUARD_S), (
        "expected the request stopped at the engine")


async def disconnect_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                closed: Callable[[], Awaitable[object]]) -> None:
    """Read the first SSE event, reset the connection, wait for the engine to see its close."""
    async with asyncio.timeout(GUARD_S):
        await reader.readuntil(b"data:")
    writer.transport.abort()
    async with asyncio.timeout(GUARD_S):
        await closed()


# -- adapters: the reason, and no ids for it ------------------------------------------------------

def adapter(kind: str) -> Any:
    settings = EngineSettings.model_validate({"kind": kind, "url": "http://127.0.0.1:1"})
    return build_adapters({"local": settings})["local"]


@pytest.mark.parametrize(("kind", "path", "body", "reason"), [
    ("sglang", "/v1/chat/completions", {"messages": [], "n": 2}, Unabortable.SGLANG_N_SAMPLES),
    ("sglang", "/v1/completions", {"prompt": ["a", "b"], "n": 3}, Unabortable.SGLANG_N_SAMPLES),
    ("sglang", "/generate", {"text": "x", "sampling_params": {"n": 2}},
     Unabortable.SGLANG_N_SAMPLES),
    ("sglang", "/generate", {"text": "x", "sampling_params": {"n": 1}}, None),
    ("sglang", "/v1/chat/completions", {"messages": []}, None),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": True},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/v1/chat/completions", {"messages": [], "use_beam_search": True},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/invocations", {"messages": [], "use_beam_search": True},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": False}, None),
    # Values the engines' pydantic models coerce (lax mode) count as what they become.
    ("sglang", "/v1/chat/completions", {"messages": [], "n": "2"}, Unabortable.SGLANG_N_SAMPLES),
    ("sglang", "/v1/completions", {"prompt": "x", "n": 2.0}, Unabortable.SGLANG_N_SAMPLES),
    ("sglang", "/v1/completions", {"prompt": "x", "n": 2.5}, None),
    ("sglang", "/v1/completions", {"prompt": "x", "n": "two"}, None),
    ("sglang", "/v1/completions", {"prompt": "x", "n": True}, None),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": "true"},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": 1},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": "yes"},
     Unabortable.VLLM_BEAM_SEARCH),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": "false"}, None),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": 0}, None),
    ("vllm", "/v1/completions", {"prompt": "x", "use_beam_search": "maybe"}, None),
    ("vllm", "/v1/responses", {"input": "use_beam_search", "use_beam_search": True}, None),
    ("openai", "/v1/chat/completions", {"messages": [], "n": 2, "use_beam_search": True},
     None),
])
def test_adapter_reason_and_no_ids(kind: str, path: str, body: dict[str, Any],
                                   reason: Unabortable | None) -> None:
    raw = json.dumps(body).encode()
    built = adapter(kind)
    got = built.unabortable("POST", path, raw)
    assert got == reason, f"{kind} {path} {body}: expected reason {reason}, got {got}"
    ids = built.engine_request_ids("POST", path, SID, raw)
    if reason is not None:
        assert ids == (), f"{kind} {path}: an unabortable request must name no ids, got {ids}"


def test_adapter_reason_never_raises_on_bad_bodies() -> None:
    for kind in ("vllm", "sglang", "openai"):
        built = adapter(kind)
        for raw in (None, b"", b"not json", b'"use_beam_search"', b"[1]", b'{"n": 2'):
            assert built.unabortable("POST", "/v1/completions", raw) is None, (kind, raw)
        assert built.unabortable("GET", "/v1/completions", b'{"n": 2}') is None, kind


# -- each reason: counted once on the early end, upstream closed, no abort call -------------------

@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [], "n": 2, "stream": True}),
    ("/v1/completions", {"prompt": "x", "n": 2, "stream": True}),
    ("/generate", {"text": "x", "sampling_params": {"n": 3}, "stream": True}),
])
async def test_sglang_n_samples_disconnect_is_counted_not_aborted(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any], path: str,
        body: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.proxy")
    sidecar: Servers = await start_sidecar(sglang_config(sglang.url))
    reader, writer = await post(sidecar.proxy_port, path, body, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, lambda: sglang_closed(sglang))
    assert await no_call(sglang), f"expected no abort call for n > 1, got {sglang.calls}"
    (work,) = sglang.works
    assert len(work.engine_ids) >= 2 and work.running, (
        f"expected the samples running on under fresh rids, got {work}")
    got = await counted(sidecar.admin_port)
    assert got == {("local", "sglang_n_samples"): 1.0}, f"expected one count, got {got}"
    warned = [r.getMessage() for r in caplog.records
              if r.name == "sidecar.proxy" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and METRIC in warned[0] and "sglang_n_samples" in warned[0], (
        f"expected one WARNING naming the metric and reason, got {warned}")


@pytest.mark.parametrize(("path", "body"), [
    # 768 KiB: more than one read can hold, so the body is still arriving at the limit.
    ("/v1/chat/completions", {"messages": [], "pad": PAD}),
    # 4 KiB in one write: complete in one read, yet over the limit: the limit is exact (before,
    # a body that came in one read was rewritten whatever its size).
    ("/generate", {"text": "x", "pad": "p" * 4096}),
], ids=["arriving-at-the-limit", "whole-in-one-read"])
async def test_sglang_body_over_replay_buffer_disconnect_is_counted_not_aborted(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any], path: str,
        body: dict[str, Any]) -> None:
    """Relayed unrewritten: SGLang runs it under the client's own rid, which the sidecar never
    names (before this counter it sent an abort for its own id, which matched nothing)."""
    sidecar: Servers = await start_sidecar(sglang_config(
        sglang.url, upstream={"replay_buffer_bytes": SMALL_BUFFER}))
    body = {**body, "stream": True, "rid": "client-rid"}
    reader, writer = await post(sidecar.proxy_port, path, body, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, lambda: sglang_closed(sglang))
    assert [w.engine_ids for w in sglang.works] == [("client-rid",)], (
        f"expected the body relayed unrewritten, engine ran {sglang.works}")
    assert await no_call(sglang), f"expected no abort call, got {sglang.calls}"
    got = await counted(sidecar.admin_port)
    assert got == {("local", "body_over_replay_buffer"): 1.0}, f"expected one count, got {got}"


async def test_vllm_responses_body_over_replay_buffer_disconnect_is_counted_not_aborted(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    """vLLM ``/v1/responses`` takes its id from the body: unrewritten, vLLM picks it."""
    sidecar: Servers = await start_sidecar(sidecar_settings(
        engine.url, upstream={"replay_buffer_bytes": SMALL_BUFFER}))
    body = {"input": "hi", "stream": True, "request_id": "client-chosen", "pad": PAD}
    reader, writer = await post(sidecar.proxy_port, "/v1/responses", body, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, engine.record.closed_event.wait)
    (gen,) = engine.record.generations
    assert gen.body["request_id"] == "client-chosen", "expected the body relayed unrewritten"
    assert gen.closed_at is not None, "expected the upstream connection closed"
    assert await quiet(engine.record.abort_event), (
        f"expected no abort call, got {engine.record.aborted_ids()}")
    got = await counted(sidecar.admin_port)
    assert got == {("local", "body_over_replay_buffer"): 1.0}, f"expected one count, got {got}"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [], "use_beam_search": True}),  # non-streaming
])
async def test_vllm_beam_search_disconnect_is_counted_not_aborted(
        engine: FakeEngine, start_sidecar: Callable[..., Any], path: str,
        body: dict[str, Any]) -> None:
    sidecar: Servers = await start_sidecar(sidecar_settings(engine.url))
    reader, writer = await post(sidecar.proxy_port, path, body, "?tokens=100000")
    if body.get("stream"):
        await disconnect_mid_stream(reader, writer, engine.record.closed_event.wait)
    else:  # awaiting the response: vLLM sends the head only with the whole of it
        async with asyncio.timeout(GUARD_S):
            await engine.record.started_event.wait()
        writer.transport.abort()
        async with asyncio.timeout(GUARD_S):
            await engine.record.closed_event.wait()
    assert await quiet(engine.record.abort_event), (
        f"expected no abort call for beam search, got {engine.record.aborted_ids()}")
    got = await counted(sidecar.admin_port)
    assert got == {("local", "vllm_beam_search"): 1.0}, f"expected one count, got {got}"


async def test_deadline_end_is_counted_like_a_disconnect(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    """The sidecar's own early end (here the deadline; the cancel API and a shutdown take the
    same path, ``Cancellation.cancel``) counts too: the client stays connected."""
    sidecar: Servers = await start_sidecar(sglang_config(sglang.url))
    url = f"http://127.0.0.1:{sidecar.proxy_port}/v1/chat/completions?tokens=100000"
    async with aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        async with session.post(url, json={"messages": [], "n": 2, "stream": True},
                                headers={"X-Sidecar-Deadline-S": "0.3"}) as resp:
            text = await resp.text()
    assert '"deadline_exceeded"' in text, f"expected the SSE deadline event, got {text[-200:]!r}"
    await sglang_closed(sglang)
    assert await no_call(sglang), sglang.calls
    got = await counted(sidecar.admin_port)
    assert got == {("local", "sglang_n_samples"): 1.0}, f"expected one count, got {got}"


async def test_shutdown_end_is_counted(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    """A stop that cancels a straggler after the grace period counts it too (read from the
    registry: the admin listener is gone by then)."""
    registry = CollectorRegistry()
    sidecar: Servers = await start_sidecar(sglang_config(sglang.url), registry)
    reader, writer = await post(sidecar.proxy_port, "/generate",
                                {"text": "x", "sampling_params": {"n": 2}, "stream": True},
                                "?tokens=100000")
    async with asyncio.timeout(GUARD_S):
        await reader.readuntil(b"data:")
        await sidecar.stop(grace_s=0.1)
    await sglang_closed(sglang)
    writer.close()
    assert await no_call(sglang), sglang.calls
    got = registry.get_sample_value(METRIC, {"engine": "local", "reason": "sglang_n_samples"})
    assert got == 1.0, f"expected one count after the shutdown, got {got}"


# -- never counted --------------------------------------------------------------------------------

async def test_completed_n_samples_request_is_not_counted(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    """Counted on the early end only: a request that completes wasted nothing."""
    sidecar: Servers = await start_sidecar(sglang_config(sglang.url))
    url = f"http://127.0.0.1:{sidecar.proxy_port}/v1/chat/completions?tokens=5"
    async with aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        async with session.post(url, json={"messages": [], "n": 2, "stream": True}) as resp:
            text = await resp.text()
    assert resp.status == 200 and "[DONE]" in text, f"expected a whole stream, got {text!r}"
    (work,) = sglang.works
    assert work.finished and len(work.engine_ids) == 2, f"expected 2 samples run: {work}"
    assert await no_call(sglang), sglang.calls
    got = await counted(sidecar.admin_port)
    assert got == {}, f"a completed request must not be counted, got {got}"


async def test_abortable_sglang_disconnect_is_aborted_not_counted(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_config(sglang.url))
    reader, writer = await post(sidecar.proxy_port, "/v1/chat/completions",
                                {"messages": [], "stream": True}, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, lambda: sglang_stopped(sglang))
    (work,) = sglang.works
    assert await sglang.watch.until(lambda: work.stopped_at is not None, GUARD_S), work
    assert sorted(work.aborted) == sorted(work.engine_ids), work
    got = await counted(sidecar.admin_port)
    assert got == {}, f"an aborted request must not be counted, got {got}"


async def test_abortable_vllm_disconnect_is_aborted_not_counted(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    """A body under the buffer on ``/v1/responses`` is rewritten and aborted by its id."""
    sidecar: Servers = await start_sidecar(sidecar_settings(engine.url))
    reader, writer = await post(sidecar.proxy_port, "/v1/responses",
                                {"input": "hi", "stream": True}, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, engine.record.stopped_event.wait)
    record = await engine.record.wait_abort(GUARD_S)
    assert len(record.ids) == 1 and record.ids[0].startswith("resp_"), record.ids
    got = await counted(sidecar.admin_port)
    assert got == {}, f"an aborted request must not be counted, got {got}"


async def test_openai_kind_disconnect_is_not_counted(
        engine: FakeEngine, start_sidecar: Callable[..., Any]) -> None:
    """Close-only is an ``openai`` engine's configured nature (its kind says so), not a
    per-request surprise: counting every one of its early ends would drown the reasons."""
    sidecar: Servers = await start_sidecar(sidecar_settings(
        engine.url, engines={"local": {"kind": "openai", "url": engine.url}}))
    reader, writer = await post(sidecar.proxy_port, "/v1/chat/completions",
                                {"messages": [], "n": 2, "use_beam_search": True,
                                 "stream": True}, "?tokens=100000")
    await disconnect_mid_stream(reader, writer, engine.record.closed_event.wait)
    assert await quiet(engine.record.abort_event), engine.record.aborted_ids()
    got = await counted(sidecar.admin_port)
    assert got == {}, f"an openai-kind engine must never be counted, got {got}"


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "stream": True}, ("cmpl-{}-0",)),
    ("/v1/chat/completions/batch", {"messages": [[], [], []], "stream": True},
     ("chatcmpl-{}_0",)),
], ids=["completions-3-prompts", "chat-batch-3"])
async def test_vllm_body_over_replay_buffer_on_a_counted_route_aborts_what_it_can_and_counts(
        start_sidecar: Callable[..., Any], path: str, body: dict[str, Any],
        named: tuple[str, ...]) -> None:
    """Ids counted from the body (prompts, conversations) cannot all be named once the body is
    over the buffer: the first is aborted, the request is counted, never silently half-aborted
    (before: the abort named the first id, no count, no WARNING, the rest ran for nobody)."""
    fake = VLLMEngine()
    await fake.start()
    try:
        sidecar: Servers = await start_sidecar(sidecar_settings(
            fake.url, engines={"local": {"kind": "vllm", "url": fake.url,
                                         "abort": {"timeout_s": 2.0, "resend_window_s": 0}}},
            upstream={"replay_buffer_bytes": SMALL_BUFFER}))
        reader, writer = await post(sidecar.proxy_port, path, {**body, "pad": PAD},
                                    "?tokens=100000")
        await disconnect_mid_stream(reader, writer, lambda: fake.watch.until(
            lambda: bool(fake.calls), GUARD_S))
        (work,) = fake.works
        rid = work.request_id_header
        assert len(work.engine_ids) == 3, f"expected 3 engine ids, got {work.engine_ids}"
        assert [tuple(c.ids) for c in fake.calls] == [tuple(n.format(rid) for n in named)], (
            f"expected one call naming {named}, got {fake.calls}")
        got = await counted(sidecar.admin_port)
        assert got == {("local", "body_over_replay_buffer"): 1.0}, f"expected one count, got {got}"
    finally:
        await fake.stop()
