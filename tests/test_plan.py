"""The abort plan as pure functions (:mod:`sidecar.plan`): what is known about a request that
ended early in, what to abort and why the rest is not out. No sockets: the engine adapters and
routes are the real ones, built from a config as the sidecar builds them
(:func:`engine.build_adapters`, :class:`sidecar.route.Router`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CollectorRegistry

from engine import EngineAdapter, Kept, Unabortable, build_adapters
from sidecar.config import parse_config
from sidecar.metrics import Metrics
from sidecar.plan import (
    AbortStep,
    Phase,
    Withheld,
    abort_steps,
    prepared_steps,
    response_phase,
    stopped_phase,
)
from sidecar.route import Router, RouteTarget

SID = "0123456789abcdef0123456789abcdef"
PREFILL_HEADER = "x-prefiller-host-port"

CONFIG = {
    "engines": {
        "vllm": {"kind": "vllm", "url": "http://127.0.0.1:8000"},
        "sglang": {"kind": "sglang", "url": "http://127.0.0.1:30000"},
        "plain": {"kind": "openai", "url": "http://127.0.0.1:8081"},
        "decode-a": {"kind": "vllm", "url": "http://127.0.0.1:8001"},
        "decode-b": {"kind": "vllm", "url": "http://127.0.0.1:8002"},
        "prefill": {"kind": "vllm", "url": "http://127.0.0.1:8100"},
    },
    "routes": [
        {"prefix": "/vllm", "engine": "vllm"},
        {"prefix": "/sglang", "engine": "sglang"},
        {"prefix": "/plain", "engine": "plain"},
        {"prefix": "/fanout", "engine": "plain", "abort": ["decode-a", "decode-b"]},
        {"prefix": "/pd", "engine": "plain", "abort": ["decode-a"],
         "abort_from_header": {"header": PREFILL_HEADER, "engine": "prefill",
                               "allow": ["127.0.0.0/8"]}},
    ],
}
SETTINGS = parse_config(yaml.safe_dump(CONFIG), "<test>", env={})
ADAPTERS = build_adapters(SETTINGS.engines)
ROUTER = Router(SETTINGS, ADAPTERS)
VLLM, SGLANG, PLAIN = ADAPTERS["vllm"], ADAPTERS["sglang"], ADAPTERS["plain"]


def target(prefix: str) -> RouteTarget:
    found = ROUTER.match(prefix)
    assert found is not None and found.prefix == prefix, f"expected route {prefix}, got {found}"
    return found


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def plan(engines: tuple[EngineAdapter, ...], path: str, body: bytes | None, *,
         method: str = "POST", unrewritten: bool = False, over_limit: bool = False
         ) -> tuple[list[AbortStep], tuple[Withheld, ...]]:
    return abort_steps(engines, method, path, SID, body, unrewritten=unrewritten,
                       over_limit=over_limit)


# -- vLLM: ids per route, registration flags ----------------------------------------------------

@pytest.mark.parametrize(("path", "body", "ids", "once_streaming"), [
    ("/v1/chat/completions", {"messages": [], "stream": True}, (f"chatcmpl-{SID}",), True),
    ("/v1/chat/completions", {"messages": [], "n": 4}, (f"chatcmpl-{SID}",), True),
    ("/v1/completions", {"prompt": "x"}, (f"cmpl-{SID}-0",), True),
    ("/v1/completions", {"prompt": ["a", "b", "c"]},
     (f"cmpl-{SID}-0", f"cmpl-{SID}-1", f"cmpl-{SID}-2"), True),
    ("/inference/v1/generate", {"token_ids": [1, 2]}, (f"generate-tokens-{SID}",), False),
])
def test_vllm_steps_name_every_prompt(path: str, body: Any, ids: tuple[str, ...],
                                      once_streaming: bool) -> None:
    got = plan((VLLM,), path, raw(body))
    assert got == ([AbortStep(VLLM, ids, once_streaming, False)], ()), (
        f"expected one step naming {ids} (once_streaming={once_streaming}), got {got}")


def test_vllm_responses_with_builtin_tools_registers_later() -> None:
    body = raw({"input": "x", "tools": [{"type": "code_interpreter"}]})
    (step,), withheld = plan((VLLM,), "/v1/responses", body)
    assert withheld == () and step.registers_later and not step.once_streaming, step
    assert step.ids == tuple(f"resp_{SID}_{turn}" for turn in range(16)), step.ids


def test_non_generating_route_names_nothing_and_withholds_nothing() -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("GET",
                                                                          "/v1/completions")):
        got = plan((VLLM,), path, None, method=method)
        assert got == ([], ()), f"expected nothing for {method} {path}, got {got}"


def test_body_over_the_limit_aborts_what_it_can_name_and_says_so() -> None:
    """The copy was dropped (over ``replay_buffer_bytes``): only the ids named without it, and
    the engine withheld with how many were named; the plan cannot be prepared ahead."""
    got = plan((VLLM,), "/v1/completions", None, over_limit=True)
    assert got == ([AbortStep(VLLM, (f"cmpl-{SID}-0",), True, False)],
                   (Withheld(VLLM, Unabortable.BODY_OVER_REPLAY_BUFFER, 1),)), got
    # Chat needs no body to name its id: nothing withheld.
    got = plan((VLLM,), "/v1/chat/completions", None, over_limit=True)
    assert got == ([AbortStep(VLLM, (f"chatcmpl-{SID}",), True, False)], ()), got
    prepared = prepared_steps(target("/vllm"), "POST", "/v1/completions", SID, None,
                              unrewritten=False, over_limit=True)
    assert prepared is None, f"expected no prepared plan, got {prepared}"


# -- SGLang: the rid -----------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "ids"), [
    ("/generate", {"text": "x", "stream": True}, (SID,)),
    ("/generate", {"text": ["a", "b"]}, (f"{SID}_0", f"{SID}_1")),
    ("/v1/chat/completions", {"messages": []}, (SID,)),
    ("/v1/responses", {"input": "x"}, (f"resp_{SID}",)),
])
def test_sglang_steps_name_the_rid(path: str, body: Any, ids: tuple[str, ...]) -> None:
    got = plan((SGLANG,), path, raw(body))
    assert got == ([AbortStep(SGLANG, ids, False, False)], ()), (
        f"expected one step naming {ids}, got {got}")


# -- what cannot be aborted, and why ---------------------------------------------------------

@pytest.mark.parametrize(("engine", "path", "body", "unrewritten", "reason"), [
    (VLLM, "/v1/completions", {"prompt": "x", "use_beam_search": True}, False,
     Unabortable.VLLM_BEAM_SEARCH),
    (VLLM, "/v1/chat/completions", {"messages": [], "use_beam_search": True}, False,
     Unabortable.VLLM_BEAM_SEARCH),
    (SGLANG, "/generate", {"text": "x", "sampling_params": {"n": 3}}, False,
     Unabortable.SGLANG_N_SAMPLES),
    (SGLANG, "/v1/chat/completions", {"messages": [], "n": 2}, False,
     Unabortable.SGLANG_N_SAMPLES),
    # Over replay_buffer_bytes on a route that rewrites the body: relayed unrewritten, so the
    # engine runs it under an id of its own (the body copy is gone too).
    (SGLANG, "/generate", None, True, Unabortable.BODY_OVER_REPLAY_BUFFER),
    (VLLM, "/v1/responses", None, True, Unabortable.BODY_OVER_REPLAY_BUFFER),
])
def test_unabortable_kinds_are_withheld_with_their_reason(
        engine: EngineAdapter, path: str, body: Any, unrewritten: bool,
        reason: Unabortable) -> None:
    got = plan((engine,), path, None if body is None else raw(body), unrewritten=unrewritten)
    assert got == ([], (Withheld(engine, reason, 0),)), (
        f"expected no step and {engine.name} withheld for {reason}, got {got}")


def test_a_close_only_engine_is_neither_aborted_nor_withheld() -> None:
    got = plan((PLAIN,), "/v1/chat/completions", raw({"messages": []}))
    assert got == ([], ()), f"expected nothing for an openai-kind engine, got {got}"


@pytest.mark.parametrize("engine", [VLLM, SGLANG])
@pytest.mark.parametrize(("method", "path", "body", "reason"), [
    ("POST", "/v1/responses", {"input": "x", "background": True}, Kept.BACKGROUND_RESPONSE),
    ("GET", "/v1/responses/resp_abc", None, Kept.RESPONSE_RETRIEVAL),
])
def test_kept_background_responses_are_withheld_not_aborted(
        engine: EngineAdapter, method: str, path: str, body: Any, reason: Kept) -> None:
    got = plan((engine,), path, None if body is None else raw(body), method=method)
    assert got == ([], (Withheld(engine, reason, 0),)), (
        f"expected {engine.name} to keep it ({reason}), got {got}")


def test_a_background_response_that_streams_on_sglang_is_aborted() -> None:
    """SGLang streams a background response on its connection: not kept, aborted by its id."""
    body = raw({"input": "x", "background": True, "stream": True})
    got = plan((SGLANG,), "/v1/responses", body)
    assert got == ([AbortStep(SGLANG, (f"resp_{SID}",), False, False)], ()), got
    got = plan((VLLM,), "/v1/responses", body)
    assert got == ([], (Withheld(VLLM, Kept.BACKGROUND_RESPONSE, 0),)), got


# -- several engines: fan-out and abort_from_header ----------------------------------------------

def test_fan_out_prepares_one_step_per_abort_engine_in_order() -> None:
    fanout = target("/fanout")
    body = raw({"prompt": ["a", "b"]})
    ids = (f"cmpl-{SID}-0", f"cmpl-{SID}-1")
    expected = [AbortStep(ADAPTERS["decode-a"], ids, True, False),
                AbortStep(ADAPTERS["decode-b"], ids, True, False)]
    prepared = prepared_steps(fanout, "POST", "/v1/completions", SID, body,
                              unrewritten=False, over_limit=False)
    assert prepared == expected, f"expected {expected}, got {prepared}"
    got = plan(fanout.aborts, "/v1/completions", body)
    assert got == (expected, ()), f"the plan at the end must match the prepared one: {got}"


def test_nothing_is_prepared_where_something_is_withheld() -> None:
    body = raw({"messages": [], "use_beam_search": True})
    prepared = prepared_steps(target("/vllm"), "POST", "/v1/chat/completions", SID, body,
                              unrewritten=False, over_limit=False)
    assert prepared is None, f"expected the plan left to the end (counted then), got {prepared}"


def _abort_engines(value: str | None) -> tuple[EngineAdapter, ...]:
    headers: CIMultiDict[str] = CIMultiDict()
    if value is not None:
        headers[PREFILL_HEADER] = value
    return target("/pd").abort_engines(CIMultiDictProxy(headers), SID,
                                       Metrics(CollectorRegistry()))


def test_abort_from_header_adds_the_named_engine_with_its_template_s_ids() -> None:
    pd = target("/pd")
    prepared = prepared_steps(pd, "POST", "/v1/completions", SID, raw({"prompt": "x"}),
                              unrewritten=False, over_limit=False)
    assert prepared is None, f"expected the header resolved at the end only, got {prepared}"
    engines = _abort_engines("127.0.0.1:9001")
    steps, withheld = plan(engines, "/v1/completions", raw({"prompt": ["a", "b"]}))
    ids = (f"cmpl-{SID}-0", f"cmpl-{SID}-1")
    assert withheld == () and [(s.engine.base_url, s.ids) for s in steps] == [
        ("http://127.0.0.1:8001", ids), ("http://127.0.0.1:9001", ids)], steps
    assert steps[1].engine.name == "prefill", f"expected the template's name, got {steps[1]}"


@pytest.mark.parametrize("value", [None, "10.0.0.1:9001", "127.0.0.1:9001,127.0.0.1:9002",
                                   "user:secret@127.0.0.1:9001"])
def test_a_refused_or_absent_header_aborts_only_the_route_s_engines(value: str | None) -> None:
    steps, withheld = plan(_abort_engines(value), "/v1/chat/completions", raw({"messages": []}))
    assert withheld == () and [s.engine.name for s in steps] == ["decode-a"], steps


# -- the phase ---------------------------------------------------------------------------------

SSE = CIMultiDictProxy(CIMultiDict({"Content-Type": "Text/Event-Stream; charset=utf-8"}))
JSON = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))


@pytest.mark.parametrize(("complete", "headers", "body", "expected"), [
    # The engine never had all of the body: request_body, whatever else is known.
    (False, None, raw({"stream": True}), Phase.REQUEST_BODY),
    (False, SSE, raw({"stream": True}), Phase.REQUEST_BODY),
    # Whole body, no head yet: what the body asked for.
    (True, None, raw({"messages": [], "stream": True}), Phase.BEFORE_FIRST_BYTE),
    (True, None, raw({"messages": [], "stream": False}), Phase.AWAITING_RESPONSE),
    (True, None, raw({"messages": [], "stream": "true"}), Phase.AWAITING_RESPONSE),
    (True, None, b'{"stream": tru', Phase.AWAITING_RESPONSE),
    (True, None, b'["stream"]', Phase.AWAITING_RESPONSE),
    (True, None, None, Phase.AWAITING_RESPONSE),
    # The head is in: what the response is.
    (True, SSE, raw({"stream": False}), Phase.STREAMING),
    (True, JSON, raw({"stream": True}), Phase.AWAITING_RESPONSE),
])
def test_stopped_phase(complete: bool, headers: CIMultiDictProxy[str] | None,
                       body: bytes | None, expected: Phase) -> None:
    got = stopped_phase(complete, headers, body)
    assert got is expected, f"expected {expected!r}, got {got!r}"


def test_response_phase_reads_only_the_media_type() -> None:
    assert response_phase(SSE) is Phase.STREAMING
    assert response_phase(JSON) is Phase.AWAITING_RESPONSE
    assert response_phase(CIMultiDictProxy(CIMultiDict())) is Phase.AWAITING_RESPONSE


def test_phase_reads_as_its_label_everywhere() -> None:
    """Metric labels, log lines and access lines show the same strings as before the type."""
    values = [p.value for p in Phase]
    assert values == ["request_body", "before_first_byte", "awaiting_response", "streaming"]
    for phase in Phase:
        assert (str(phase), f"{phase}", "%s" % phase, json.dumps(phase)) == (  # noqa: UP031
            phase.value, phase.value, phase.value, f'"{phase.value}"'), phase
