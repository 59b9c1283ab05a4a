"""A Responses request with built-in tools stops at any turn its client leaves in.

vLLM runs ``POST /v1/responses`` with built-in tools (web search, code interpreter, container,
allowlisted MCP) as a loop of generation turns, ``{request_id}_{k}`` each, the next one
registered only after the tool the previous turn called has answered
(``openai/responses/serving.py``, ``_generate_with_builtin_tools``). Naming ``_0`` alone left
every later turn running for nobody behind a middleware that hides the disconnect. The sidecar
names ``_0`` .. ``_15`` and re-sends them for the engine's ``resend_window_s`` from the
disconnect, since a turn may be registered long after the body arrived.

SGLang runs the same loop (``serving_responses.py``, ``_generate_with_builtin_tools``) with every
turn under one rid, the body's ``request_id``, which the sidecar sets to ``resp_{id}``: one id,
named again by re-sends for the window from the disconnect, catches the turn registered after
the tool.

The engine is :class:`tests.fakes.responses.ResponsesEngine` (its ``tool_turns`` model, written
from vLLM's source) or :class:`~tests.fakes.responses.SGLangResponsesEngine`; the sidecar runs
through :func:`sidecar.server.start`; the client is a raw
socket that resets or closes at three instants: during the first turn, during a later turn, and
while a tool runs (turn 0 done, turn 1 not registered yet). The window (0.5 s) is shorter than
a turn (0.6 s), so the last two instants come after a window counted from the body would have
closed. Checked at the engine: no turn runs to its end after the client left, the loop stops.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from engine.sglang import SGLangAdapter
from engine.vllm import BUILTIN_TOOL_TURNS, VLLMAdapter
from sidecar.config import EngineKind, EngineSettings
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.responses import ResponsesEngine, SGLangResponsesEngine, ToolTurns
from tests.harness.support import WAIT_S, Stalls, raw_client

pytestmark = pytest.mark.timeout(60)

RESPONSES = "/v1/responses"
TURNS, TOKENS, INTERVAL_S, TOOL_S = 4, 30, 0.02, 0.3  # a turn: 0.6 s of tokens, a tool: 0.3 s
WINDOW_S = 0.5
QUERY = f"?tool_turns={TURNS}&tokens={TOKENS}&interval={INTERVAL_S}&tool_s={TOOL_S}"
VLLM = VLLMAdapter("local", EngineSettings.model_validate({"kind": EngineKind.VLLM,
                                                           "url": "http://e:1"}))
SGLANG = SGLangAdapter("local", EngineSettings.model_validate({"kind": EngineKind.SGLANG,
                                                              "url": "http://e:1"}))


def _body(tools: list[dict[str, Any]] | None, stream: bool = True) -> bytes:
    fields: dict[str, Any] = {"input": "search, then answer", "stream": stream}
    if tools is not None:
        fields["tools"] = tools
    return json.dumps(fields).encode()


@pytest.mark.parametrize(("tools", "turns"), [
    (None, 1),
    ([{"type": "function", "name": "f", "parameters": {}}], 1),
    ([{"type": "web_search_preview"}], BUILTIN_TOOL_TURNS),
    ([{"type": "code_interpreter", "container": {"type": "auto"}}], BUILTIN_TOOL_TURNS),
    ([{"type": "function", "name": "f"}, {"type": "container"}], BUILTIN_TOOL_TURNS),
    ([{"type": "mcp", "server_label": "web_search_preview"}], BUILTIN_TOOL_TURNS),
    ([{"type": "mcp", "server_label": "my-crm", "server_url": "http://crm"}], 1),
    ("not a list", 1),
])
def test_ids_name_every_turn_only_with_builtin_tools(tools: Any, turns: int) -> None:
    body = json.dumps({"input": "hi", "tools": tools}).encode()
    ids = VLLM.engine_request_ids("POST", RESPONSES, "sid", body)
    assert ids == tuple(f"resp_sid_{k}" for k in range(turns)), f"got {ids}"
    assert VLLM.registers_later("POST", RESPONSES, ids, body) is (turns > 1)


@pytest.mark.parametrize(("tools", "later"), [
    (None, False),
    ([{"type": "function", "name": "f", "parameters": {}}], False),
    ([{"type": "web_search"}], True),
    ([{"type": "web_search_preview"}], True),
    ([{"type": "function", "name": "f"}, {"type": "code_interpreter"}], True),
    ([{"type": "container"}], False),  # vLLM's, not SGLang's
    ([{"type": "mcp", "server_label": "web_search_preview"}], False),  # no MCP labels in SGLang
    ("not a list", False),
])
def test_sglang_names_one_rid_and_resends_it_only_with_builtin_tools(tools: Any,
                                                                    later: bool) -> None:
    """SGLang runs every turn under the body's ``request_id``: the sidecar writes
    ``resp_{id}`` there and names it alone; with built-in tools, later turns register it again."""
    body = json.dumps({"input": "hi", "request_id": "client-chosen", "tools": tools}).encode()
    rewritten = SGLANG.rewrite_body("POST", RESPONSES, "sid", body)
    assert rewritten is not None and json.loads(rewritten)["request_id"] == "resp_sid", (
        f"expected the client's request_id replaced, got {rewritten!r}")
    ids = SGLANG.engine_request_ids("POST", RESPONSES, "sid", rewritten)
    assert ids == ("resp_sid",), f"got {ids}"
    assert SGLANG.registers_later("POST", RESPONSES, ids, rewritten) is later
    escaped = rewritten.replace(b'"tools"', b'"\\u0074ools"')
    assert SGLANG.registers_later("POST", RESPONSES, ids, escaped) is later, (
        "a key spelt with JSON escapes must count the same")


@pytest.mark.parametrize("tools", [
    [{"type": ["code_interpreter"]}], [{"type": {"web_search": 1}}],
    [{"type": "mcp", "server_label": ["web_search_preview"]}],
])
def test_malformed_tool_types_never_raise(tools: list[dict[str, Any]]) -> None:
    """A ``type`` that is not a string (the engine answers 400) counts as no built-in tool; it
    never makes the abort plan raise (which would leave the request unaborted)."""
    body = json.dumps({"input": "hi", "tools": tools}).encode()
    for adapter, single in ((VLLM, ("resp_sid_0",)), (SGLANG, ("resp_sid",))):
        ids = adapter.engine_request_ids("POST", RESPONSES, "sid", body)
        assert ids == single, f"{adapter.kind}: got {ids}"
        assert adapter.registers_later("POST", RESPONSES, ids, body) is False


def test_ids_name_every_turn_of_a_body_spelt_with_escapes() -> None:
    """A JSON encoder may escape any character (the substring test before the parse must not
    be fooled): the same request as ``tools: [{"type": "web_search_preview"}]``."""
    body = rb'{"input": "hi", "\u0074ools": [{"type": "web\u005fsearch\u005fpreview"}]}'
    assert json.loads(body)["tools"] == [{"type": "web_search_preview"}]  # the premise
    ids = VLLM.engine_request_ids("POST", RESPONSES, "sid", body)
    assert len(ids) == BUILTIN_TOOL_TURNS, f"got {ids}"
    assert VLLM.registers_later("POST", RESPONSES, ids, body)


@pytest_asyncio.fixture(params=["vllm", "sglang"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[ResponsesEngine]:
    fake = (ResponsesEngine if request.param == "vllm" else SGLangResponsesEngine)(
        api_key="sekret-key")
    await fake.start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def servers(engine: ResponsesEngine, start_sidecar: Callable[..., Any]) -> Servers:
    abort = {"api_key": "sekret-key", "timeout_s": 2.0, "resend_window_s": WINDOW_S}
    started: Servers = await start_sidecar(sidecar_settings(
        engine.url, engines={"local": {"kind": engine.kind, "url": engine.url,
                                       "abort": abort}}))
    return started


def _left_in(run: ToolTurns, instant: str) -> bool:
    works = run.works
    if instant == "first_turn":
        return bool(works) and works[0].events >= 3
    if instant == "later_turn":
        return len(works) >= 2 and works[1].events >= 3
    return len(works) == 1 and works[0].finished  # "tool_call": turn 0 done, the tool runs


@pytest.mark.parametrize(("how", "stream"), [("rst", True), ("fin", True), ("rst", False)])
@pytest.mark.parametrize("instant", ["first_turn", "later_turn", "tool_call"])
async def test_no_turn_runs_on_after_the_client_leaves(
        instant: str, how: str, stream: bool, engine: ResponsesEngine, servers: Servers,
        stalls: Stalls) -> None:
    """A stream (its head relayed: the abort plan derived ahead) and a JSON request (no head
    before the whole answer: derived at the disconnect)."""
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", RESPONSES + QUERY, _body([{"type": "web_search_preview"}], stream))
        if stream:
            status, _ = await client.head()
            assert status == 200, f"expected a 200 stream, got {status}"
        started = await engine.watch.until(lambda: bool(engine.tool_turns), WAIT_S)
        assert started, "the request never reached the engine"
        run = engine.tool_turns[-1]
        reached = await engine.watch.until(lambda: _left_in(run, instant), WAIT_S)
        assert reached, f"the turns never reached {instant}: {run.works}"
        left = client.disconnect(how)
    ended = await engine.watch.until(lambda: run.ended, WAIT_S)
    assert ended, f"expected the engine's turn loop to end, turns: {run.works}"
    sidecar_id = run.response_id.removeprefix("resp_")  # the body's request_id the sidecar set
    ran_on = [(w.engine_ids, at - left) for w in run.works for at in w.ran_to_end.values()
              if at > left]
    assert not ran_on, f"turns ran to their end after the client left (id, s after): {ran_on}"
    last = run.works[-1]
    assert last.stopped_at is not None, f"expected the last turn aborted, got {last}"
    assert len(run.works) < TURNS, f"expected the loop cut short, ran {len(run.works)} turns"
    named = {i for call in engine.calls for i in call.ids}
    if engine.kind == "vllm":
        expected = {f"resp_{sidecar_id}_{k}" for k in range(BUILTIN_TOOL_TURNS)}
    else:  # SGLang: one rid for every turn
        expected = {run.response_id}
    assert named == expected, f"expected the calls to name {sorted(expected)}, got {sorted(named)}"
    if instant == "tool_call" and engine.kind == "vllm":
        # turn 1 was registered after the first call: a re-send got it
        turn1 = f"resp_{sidecar_id}_1"
        assert len(run.works) == 2 and turn1 in last.ignored and turn1 in last.aborted, (
            f"expected turn 1 named before it existed (ignored), then aborted: {last}")
    elif instant == "tool_call":  # SGLang: a call while no turn had the rid, then a re-send
        rid = run.response_id
        first_done, registered = run.works[0].ran_to_end[rid], last.registered[rid]
        idle_calls = [c.at for c in engine.calls if first_done < c.at < registered]
        assert len(run.works) == 2 and idle_calls and rid in last.aborted, (
            f"expected a call while the tool ran (a no-op), then turn 1 aborted: {last}, "
            f"calls at {[c.at for c in engine.calls]}")
    if instant != "first_turn":  # the premise: a window counted from the body had closed
        since_body = left - run.works[0].started
        assert since_body > WINDOW_S, f"the client left {since_body:.2f} s after the body"
