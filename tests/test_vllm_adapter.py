"""The vLLM adapter's pure logic: which engine request ids a request produced, and the abort call.

Exact ids for known bodies follow vLLM 0.32 (``engine/vllm.py`` names the source files); the
property tests check that no body, however malformed, makes id derivation raise or yield an
empty, duplicated or mis-prefixed id list for a generating route: an empty list sent to a
dev-mode vLLM aborts every request.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.vllm import ROUTES, VLLMAdapter, count_prompts
from sidecar.config import EngineSettings

SID = "0123456789abcdef0123456789abcdef"

GENERATING = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/completions": "cmpl-",
    "/inference/v1/generate": "generate-tokens-",
}


def adapter(**abort: Any) -> VLLMAdapter:
    settings = EngineSettings.model_validate(
        {"kind": "vllm", "url": "http://127.0.0.1:8000", "abort": abort})
    return VLLMAdapter("local", settings)


ADAPTER = adapter(api_key="k")


def ids(path: str, body: Any, sid: str = SID, method: str = "POST") -> tuple[str, ...]:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return ADAPTER.engine_request_ids(method, path, sid, raw)


# -- exact ids for known bodies ---------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     (f"chatcmpl-{SID}",)),
    ("/v1/chat/completions", {"stream": True, "n": 4}, (f"chatcmpl-{SID}",)),
    ("/v1/chat/completions", None, (f"chatcmpl-{SID}",)),
    ("/generative_scoring", {"query": "q", "items": ["a", "b", "c"], "label_token_ids": [1]},
     tuple(f"generative-scoring-{SID}-{i}" for i in range(3))),  # one read per item
    ("/generative_scoring", {"query": "q", "items": [[1, 2], [3]]},
     (f"generative-scoring-{SID}-0", f"generative-scoring-{SID}-1")),
    ("/generative_scoring", {"query": "q"}, (f"generative-scoring-{SID}-0",)),  # malformed
    ("/cohere/v2/chat", {"messages": [{"role": "user", "content": "hi"}]},
     (f"chatcmpl-{SID}",)),  # turned into a chat request (cohere/serving.py)
    ("/inference/v1/generate", {"token_ids": [1, 2, 3]}, (f"generate-tokens-{SID}",)),
    ("/invocations", {"messages": []}, (f"chatcmpl-{SID}",)),
    ("/invocations", {"prompt": ["a", "b"]}, (f"cmpl-{SID}-0", f"cmpl-{SID}-1")),
    ("/invocations", {"input": "x"}, ()),  # neither: vLLM refuses it
    # no body copy (over upstream.replay_buffer_bytes) or not JSON: either shape's first id
    ("/invocations", None, (f"chatcmpl-{SID}", f"cmpl-{SID}-0")),
    ("/inference/v1/generate", b"not json", (f"generate-tokens-{SID}",)),
    # A single prompt is still "-0" (vLLM numbers every engine input).
    ("/v1/completions", {"prompt": "hello"}, (f"cmpl-{SID}-0",)),
    ("/v1/completions", {"prompt": [1, 2, 3]}, (f"cmpl-{SID}-0",)),
    ("/v1/completions", {"prompt": ["a", "b", "c"]},
     (f"cmpl-{SID}-0", f"cmpl-{SID}-1", f"cmpl-{SID}-2")),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, (f"cmpl-{SID}-0", f"cmpl-{SID}-1")),
    ("/v1/completions", {"prompt": "a", "prompt_embeds": ["e1", "e2"]},
     (f"cmpl-{SID}-0", f"cmpl-{SID}-1", f"cmpl-{SID}-2")),
    ("/v1/completions", {"prompt_embeds": "e"}, (f"cmpl-{SID}-0",)),
    ("/v1/completions", {"prompt": "x", "n": 3}, (f"cmpl-{SID}-0",)),
    # Malformed or missing bodies: best effort, never empty.
    ("/v1/completions", {"prompt": []}, (f"cmpl-{SID}-0",)),
    ("/v1/completions", {}, (f"cmpl-{SID}-0",)),
    ("/v1/completions", [1, 2], (f"cmpl-{SID}-0",)),
    ("/v1/completions", None, (f"cmpl-{SID}-0",)),
    ("/v1/completions", b"\xff\xfe{", (f"cmpl-{SID}-0",)),
    ("/v1/completions", b"[" * 100_000, (f"cmpl-{SID}-0",)),
])
def test_exact_ids(path: str, body: Any, expected: tuple[str, ...]) -> None:
    got = ids(path, body)
    assert got == expected, f"{path} with body {body!r:.80}: expected {expected}, got {got}"


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/models"), ("POST", "/echo"), ("GET", "/health"), ("POST", "/tokenize"),
    ("GET", "/v1/chat/completions"), ("POST", "/v1/chat/completions/"),
    ("POST", "/v1/completionsX"), ("POST", "/inference/v1/abort_requests"),
])
def test_non_generating_routes_have_no_ids(method: str, path: str) -> None:
    got = ids(path, {"prompt": ["a", "b"]}, method=method)
    assert got == (), f"{method} {path} generates nothing: expected (), got {got}"


def test_wants_body_only_where_the_count_depends_on_it() -> None:
    assert ADAPTER.wants_body("POST", "/v1/completions"), "completions ids depend on the body"
    for method, path in [("POST", "/v1/chat/completions"), ("POST", "/inference/v1/generate"),
                         ("GET", "/v1/completions"), ("POST", "/echo")]:
        assert not ADAPTER.wants_body(method, path), f"{method} {path} needs no body copy"


def test_tag_overwrites_the_request_id_header() -> None:
    headers = {"X-Request-Id": "client-chosen"}
    ADAPTER.tag("/v1/chat/completions", SID, headers)
    assert headers == {"X-Request-Id": SID}, f"expected the sidecar id only, got {headers}"


def test_abort_call_shape_and_bearer() -> None:
    calls = ADAPTER.abort_calls((f"cmpl-{SID}-0", f"cmpl-{SID}-1"))
    assert len(calls) == 1, f"expected one call, got {calls}"
    assert calls[0].path == "/inference/v1/abort_requests", calls[0]
    assert calls[0].json == {"request_ids": [f"cmpl-{SID}-0", f"cmpl-{SID}-1"]}, calls[0]
    assert ADAPTER.abort_headers() == {"Authorization": "Bearer k"}, ADAPTER.abort_headers()
    assert adapter().abort_headers() == {}, "no api_key: expected no Authorization header"
    assert adapter(api_key="").abort_headers() == {}, "empty api_key means no key"
    custom = adapter(path="/custom/abort").abort_calls(("x",))
    assert custom[0].path == "/custom/abort", f"configured abort.path ignored: {custom}"


def test_abort_call_refuses_an_empty_id_list() -> None:
    with pytest.raises(ValueError, match="empty"):
        ADAPTER.abort_calls(())
    with pytest.raises(ValueError, match="empty"):
        ADAPTER.abort_call(())


def test_abort_calls_chunk_a_long_id_list() -> None:
    ids = tuple(f"chatcmpl-{i}" for i in range(2 * ADAPTER.max_ids_per_call + 3))
    calls = ADAPTER.abort_calls(ids)
    sizes = [len(c.json["request_ids"]) for c in calls]
    limit = ADAPTER.max_ids_per_call
    assert sizes == [limit, limit, 3], f"expected chunks of {limit}, {limit}, 3; got {sizes}"
    named = [i for c in calls for i in c.json["request_ids"]]
    assert named == list(ids), "expected every id named once, in order"
    with pytest.raises(ValueError, match="at most"):
        ADAPTER.abort_call(ids[:limit + 1])


def test_api_key_not_in_repr() -> None:
    text = repr(ADAPTER.settings) + str(ADAPTER.settings)
    assert "Bearer" not in text and "'k'" not in text, f"api_key leaked in {text}"


# -- properties ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=10), children, max_size=6),
    max_leaves=40,
)
# Bodies shaped like completions requests, so the prompt-counting branches are exercised.
prompt_values = (st.text(max_size=10) | st.lists(st.integers(), max_size=8)
                 | st.lists(st.text(max_size=5), max_size=8)
                 | st.lists(st.lists(st.integers(), max_size=4), max_size=8)
                 | st.lists(json_values, max_size=8) | json_values)
completion_bodies = st.fixed_dictionaries(
    {}, optional={"prompt": prompt_values, "prompt_embeds": prompt_values,
                  "stream": st.booleans(), "n": st.integers()})
bodies = (st.none() | st.binary(max_size=200)
          | json_values.map(lambda v: json.dumps(v).encode())
          | completion_bodies.map(lambda v: json.dumps(v).encode()))
sidecar_ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)


def _check_ids(path: str, sid: str, body: bytes | None) -> tuple[str, ...]:
    got = ADAPTER.engine_request_ids("POST", path, sid, body)
    prefix = GENERATING[path] + sid
    assert isinstance(got, tuple) and got, f"{path}: expected a non-empty tuple, got {got!r}"
    assert len(set(got)) == len(got), f"{path}: duplicate ids in {got}"
    assert all(i.startswith(prefix) for i in got), f"{path}: an id lacks {prefix!r}: {got}"
    assert ADAPTER.abort_calls(got)[0].json == {"request_ids": list(got)}
    return got


@settings(max_examples=300)
@given(path=st.sampled_from(sorted(GENERATING)), sid=sidecar_ids, body=bodies)
def test_ids_never_raise_never_empty_unique_prefixed(path: str, sid: str,
                                                     body: bytes | None) -> None:
    got = _check_ids(path, sid, body)
    if path != "/v1/completions":
        assert got == (prefix := GENERATING[path] + sid,), f"expected ({prefix!r},), got {got}"
    else:
        expected = tuple(f"cmpl-{sid}-{i}" for i in range(len(got)))
        assert got == expected, f"completions ids must be numbered from 0: {got}"


@given(prompts=st.lists(st.text(max_size=8), min_size=1, max_size=40), sid=sidecar_ids)
def test_one_completion_id_per_prompt(prompts: list[str], sid: str) -> None:
    got = _check_ids("/v1/completions", sid, json.dumps({"prompt": prompts}).encode())
    assert got == tuple(f"cmpl-{sid}-{i}" for i in range(len(prompts))), (
        f"{len(prompts)} prompts: expected {len(prompts)} ids, got {got}")


@given(body=json_values)
def test_count_prompts_is_at_least_one(body: Any) -> None:
    assert count_prompts(body) >= 1, f"count_prompts({body!r}) < 1"


@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(sorted(GENERATING)), body=bodies)
def test_non_post_generates_nothing(method: str, path: str, body: bytes | None) -> None:
    got = ADAPTER.engine_request_ids(method, path, SID, body)
    assert got == (), f"{method} {path}: expected (), got {got}"


# -- every route, any bytes ---------------------------------------------------------------------

# Bodies a client may send that json.loads meets badly: a UTF-8 BOM, nesting past the recursion
# limit, integers past Python's 4300-digit conversion limit, invalid UTF-8.
hostile_bodies = (
    json_values.map(lambda v: b"\xef\xbb\xbf" + json.dumps(v).encode())
    | st.integers(1, 200_000).map(lambda n: b"[" * n)
    | st.integers(1, 200_000).map(lambda n: b'{"prompt": ' + b"[" * n)
    | st.integers(4301, 20_000).map(lambda n: b'{"prompt": "a", "n": ' + b"9" * n + b"}")
    | st.binary(min_size=1, max_size=64).map(lambda b: b'{"prompt": "' + b + b'"}')
)


def _expected_shape(path: str, sid: str, got: tuple[str, ...]) -> tuple[str, ...]:
    """The ids ``path`` must give for ``got``'s length (engine/vllm.py's table)."""
    numbered = {"/v1/chat/completions/batch": f"chatcmpl-{sid}_{{}}",
                "/v1/completions": f"cmpl-{sid}-{{}}",
                "/generative_scoring": f"generative-scoring-{sid}-{{}}"}
    single = {"/v1/chat/completions": f"chatcmpl-{sid}", "/v1/messages": f"chatcmpl-{sid}",
              "/cohere/v2/chat": f"chatcmpl-{sid}",
              "/v1/responses": f"resp_{sid}_0", "/inference/v1/generate": f"generate-tokens-{sid}"}
    if path in single:
        return (single[path],)
    if path.startswith("/v1/audio/"):  # the base, language detection, the first 64 chunks
        base = f"{'transcribe' if path.endswith('transcriptions') else 'translate'}-{sid}"
        return (base, f"{base}-lang_detect", *(f"{base}-{i}" for i in range(64)))
    if path == "/invocations":  # as chat, as completions, nothing when the body says neither,
        # or either shape's first id when there is no JSON body to read (None, not JSON)
        if got in ((f"chatcmpl-{sid}",), (f"chatcmpl-{sid}", f"cmpl-{sid}-0"), ()):
            return got
        return tuple(f"cmpl-{sid}-{i}" for i in range(len(got)))
    return tuple(numbered[path].format(i) for i in range(max(len(got), 1)))


@settings(max_examples=400)
@given(path=st.sampled_from(sorted(ROUTES)), sid=sidecar_ids,
       body=bodies | hostile_bodies)
def test_every_route_derives_ids_from_any_body_without_raising(
        path: str, sid: str, body: bytes | None) -> None:
    got = ADAPTER.engine_request_ids("POST", path, sid, body)
    assert isinstance(got, tuple) and len(set(got)) == len(got), f"{path}: {got!r}"
    assert got or path == "/invocations", f"{path}: expected at least one id, got none"
    assert got == _expected_shape(path, sid, got), (
        f"{path} with body {body!r:.80}: ids {got} do not follow the route's format")
    if got:
        assert ADAPTER.abort_calls(got)[0].json == {"request_ids": list(got)}
