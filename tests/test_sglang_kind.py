"""The ``sglang`` engine kind: the adapter's pure logic (exact ids, property tests) and the
production wiring against the fake SGLang server of ``tests/fakes/kinds.py`` (real aiohttp on
127.0.0.1) that reads ``rid`` from the body, aborts by prefix and answers 200 to any abort.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import build_adapters
from engine.responses import may_name_tools
from engine.sglang import BUILTIN_TOOL_TYPES, SGLangAdapter
from sidecar.config import EngineSettings, Settings, parse_config
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.kinds import SGLangEngine

SID = "0123456789abcdef0123456789abcdef"
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
RESPONSES = "/v1/responses"  # its id is the body's request_id, not rid


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


def test_tag_overwrites_the_override_header_and_sets_the_request_id() -> None:
    headers = {"X-Override-Rid": "someone-else"}
    ADAPTER.tag("/generate", SID, headers)
    assert headers == {"X-Override-Rid": SID, "X-Request-Id": SID}


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


@pytest.mark.parametrize("path", [*ROUTES, RESPONSES])
def test_rewrite_keeps_text_as_utf8(path: str) -> None:
    """Non-ASCII text goes upstream as UTF-8, not as ``\\u`` escapes (a CJK prompt would double
    in size, and a Responses body with escapes is parsed again on the first byte's path); a
    lone surrogate escape, which has no UTF-8, stays an escape."""
    body = json.dumps({"messages": [{"role": "user", "content": "你好, ça va? 🙂"}]}).encode()
    assert b"\\u" in body  # the premise: json.dumps escapes by default
    new = ADAPTER.rewrite_body("POST", path, SID, body)
    assert new is not None and "你好, ça va? 🙂".encode() in new and b"\\u" not in new, new
    assert json.loads(new)["messages"] == json.loads(body)["messages"]
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    kept = ADAPTER.rewrite_body("POST", path, SID, lone)
    assert kept is not None and b"\\ud800" in kept, kept
    assert json.loads(kept)["messages"] == json.loads(lone)["messages"]
    if path == RESPONSES:  # no \\u left: the substring test spares the parse
        assert not may_name_tools(new, BUILTIN_TOOL_TYPES)


TOOLS = st.lists(st.dictionaries(st.sampled_from(["type", "server_label", "name"]),
                                 st.sampled_from(["web_search", "web_search_preview",
                                                  "code_interpreter", "mcp", "function"]) | JSON,
                                 max_size=3), max_size=3) | JSON


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["request_id", "tools", "background", "stream",
                                             "store", "input"]) | st.text(),
                            JSON, max_size=5).flatmap(
           lambda b: st.builds(lambda t: {**b, "tools": t}, TOOLS) if "tools" in b
           else st.just(b)),
       raw=st.none() | st.binary(max_size=120))
def test_responses_rewrite_ids_and_resends_never_raise(body: dict[str, Any],
                                                       raw: bytes | None) -> None:
    """``/v1/responses``: ``request_id`` set to ``resp_{id}``, one id, and no input (a malformed
    ``tools``: ``"type": ["web_search"]``; bytes that are not JSON) makes an adapter call raise."""
    data = json.dumps(body).encode() if raw is None else raw
    new = ADAPTER.rewrite_body("POST", RESPONSES, SID, data)
    if raw is None:
        assert new is not None and json.loads(new)["request_id"] == f"resp_{SID}", new
    sent = data if new is None else new
    got = ADAPTER.engine_request_ids("POST", RESPONSES, SID, sent)
    assert got == (f"resp_{SID}",), got
    ADAPTER.registers_later("POST", RESPONSES, got, sent)
    ADAPTER.kept_after_disconnect("POST", RESPONSES, sent)


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.tuples(st.uuids(version=4), st.sampled_from((*ROUTES, RESPONSES)),
                                   BODY_OBJECTS),
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
# (Disconnects on every route, batch children, shared client rids: tests/test_cancel_every_kind.py;
# n > 1: tests/test_unabortable.py.)

def sglang_settings(url: str) -> Settings:
    return sidecar_settings(url, engines={"local": {"kind": "sglang", "url": url,
                                                    "abort": {"timeout_s": 2.0,
                                                              "resend_window_s": 0}}},
                            lifecycle={"grace_period_s": 1.0})


async def test_abort_endpoint_is_not_proxied(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    async with aiohttp.ClientSession() as session:
        for path in ("/abort_request", "/abort_request/", "/pause_generation"):
            async with session.post(f"http://127.0.0.1:{sidecar.proxy_port}{path}",
                                    json={"rid": "", "abort_all": True}) as resp:
                assert resp.status == 403, f"{path}: expected 403, got {resp.status}"
    assert sglang.calls == [] and sglang.unknown_paths == [], (sglang.calls, sglang.unknown_paths)


async def test_readyz_probes_the_abort_route(
        sglang: SGLangEngine, start_sidecar: Callable[..., Any]) -> None:
    """SGLang answers 200 to any rid: the probe proves the route exists and accepts the call."""
    sidecar: Servers = await start_sidecar(sglang_settings(sglang.url))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{sidecar.admin_port}/readyz") as resp:
            verdict = await resp.json()
    assert resp.status == 200 and verdict["engines"] == {"local": "ok"}, verdict
    (probe,) = sglang.probes
    assert set(probe.body) == {"rid"}, probe.body
    assert probe.body["rid"].startswith("cancel-sidecar-readiness-probe-"), probe.body
    assert sglang.calls == [] and sglang.works == []


def test_example_config_builds_an_sglang_adapter() -> None:
    text = (Path(__file__).parent.parent / "config/examples/sglang.yaml").read_text()
    settings = parse_config(text, "config/examples/sglang.yaml", env={})
    (built,) = build_adapters(settings.engines).values()
    assert isinstance(built, SGLangAdapter) and built.abort_path == "/abort_request"
    assert built.abort_headers() == {}, "an empty key must send no Authorization header"
