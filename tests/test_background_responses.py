"""Work meant to outlive its connection is never aborted: background responses.

``POST /v1/responses`` with ``"background": true`` asks the engine to generate to the end
whatever the connection does and store the response (``engine/responses.py`` has vLLM's and
SGLang's facts). An abort by id would destroy it: vLLM stores an aborted response as
``completed`` with the tokens made so far. So a client that leaves such a request (streaming or
not), or leaves a reader of a stored one (``GET /v1/responses/{id}``, JSON or a stream resumed
with ``starting_after``), gets its upstream connection closed and nothing else: no abort call
(checked at the fake's abort records), the response still generated to its end and stored
whole; the request is counted in ``cancel_sidecar_kept_requests_total`` and its access line
says ``kept_by_engine``. ``POST /v1/responses/{id}/cancel`` passes through to the engine. A
``/v1/responses`` request that is not background is still aborted when its client leaves.

The engine is :class:`tests.fakes.responses.ResponsesEngine`, written from vLLM's source. The
sidecar runs through :func:`sidecar.server.start` (the ``start_sidecar`` fixture: the CLI's
wiring); clients are raw sockets (RST and FIN), aiohttp and the ``openai`` SDK. The adapters'
decision itself is tested first, one table for vLLM and SGLang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from engine import Kept
from engine.sglang import SGLangAdapter
from engine.vllm import VLLMAdapter
from sidecar.config import EngineKind, EngineSettings
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.kinds import SGLangEngine, Work
from tests.fakes.responses import Background, ResponsesEngine
from tests.harness.support import WAIT_S, Stalls, metrics, raw_client, sample, settle

pytestmark = pytest.mark.timeout(60)

RESPONSES = "/v1/responses"
TOKENS = 40  # max_output_tokens of a background response: 10 ms apart, ~0.4 s to generate
BG = Kept.BACKGROUND_RESPONSE
READ = Kept.RESPONSE_RETRIEVAL


# --- the adapters' decision --------------------------------------------------------------------

def _adapter(cls: type[VLLMAdapter] | type[SGLangAdapter], kind: EngineKind
             ) -> VLLMAdapter | SGLangAdapter:
    return cls("local", EngineSettings.model_validate({"kind": kind, "url": "http://e:1"}))


VLLM = _adapter(VLLMAdapter, EngineKind.VLLM)
SGLANG = _adapter(SGLangAdapter, EngineKind.SGLANG)


def _body(**fields: Any) -> bytes:
    return json.dumps({"input": "hi", **fields}).encode()


# (method, path, body, vLLM's answer, SGLang's answer)
DECISIONS: list[tuple[str, str, bytes | None, Kept | None, Kept | None]] = [
    ("POST", RESPONSES, _body(background=True), BG, BG),
    # SGLang streams a background request on its connection (not detached): aborted there
    ("POST", RESPONSES, _body(background=True, stream=True), BG, None),
    ("POST", RESPONSES, _body(background=True, stream="true"), BG, None),
    ("POST", RESPONSES, _body(background=True, stream=False), BG, BG),
    # pydantic lax bools, as both engines' ResponsesRequest.background reads them
    ("POST", RESPONSES, _body(background="true"), BG, BG),
    ("POST", RESPONSES, _body(background=1), BG, BG),
    ("POST", RESPONSES, _body(background="YES"), BG, BG),
    ("POST", RESPONSES, _body(background="on"), BG, BG),
    ("POST", RESPONSES, _body(background=False), None, None),
    ("POST", RESPONSES, _body(background="false"), None, None),
    ("POST", RESPONSES, _body(background=0), None, None),
    ("POST", RESPONSES, _body(background=None), None, None),
    ("POST", RESPONSES, _body(background="maybe"), None, None),
    ("POST", RESPONSES, _body(), None, None),
    ("POST", RESPONSES, _body(input="background"), None, None),
    # vLLM's validate_background refuses a raw falsy store (400, never runs); "false" passes it.
    # SGLang refuses a store false as pydantic reads it ("false" too): never runs either
    ("POST", RESPONSES, _body(background=True, store=False), None, None),
    ("POST", RESPONSES, _body(background=True, store=None), None, None),
    ("POST", RESPONSES, _body(background=True, store=0), None, None),
    ("POST", RESPONSES, _body(background=True, store="false"), BG, None),
    ("POST", RESPONSES, _body(background=True, store=True), BG, BG),
    # a JSON encoder may escape any character: the same request as background true
    ("POST", RESPONSES, rb'{"input": "hi", "\u0062ackground": true}', BG, BG),
    ("POST", RESPONSES, b'{"background": true', None, None),  # not JSON: the engine refuses
    ("POST", RESPONSES, b'["background", true]', None, None),
    ("POST", RESPONSES, None, None, None),  # no body copy: cannot tell
    ("POST", "/v1/chat/completions", _body(background=True), None, None),
    ("POST", RESPONSES + "/", _body(background=True), None, None),
    ("GET", RESPONSES, None, None, None),
    # readers of a stored response, JSON or stream (the query is not part of the path)
    ("GET", RESPONSES + "/resp_abc", None, READ, READ),
    ("GET", RESPONSES + "/", None, None, None),
    ("GET", RESPONSES + "/resp_abc/input_items", None, None, None),
    ("POST", RESPONSES + "/resp_abc/cancel", None, None, None),
    ("DELETE", RESPONSES + "/resp_abc", None, None, None),
]


@pytest.mark.parametrize(("method", "path", "body", "vllm", "sglang"), DECISIONS)
def test_kept_after_disconnect_reads_the_request_as_the_engine_does(
        method: str, path: str, body: bytes | None, vllm: Kept | None,
        sglang: Kept | None) -> None:
    for adapter, expected in ((VLLM, vllm), (SGLANG, sglang)):
        got = adapter.kept_after_disconnect(method, path, body)
        assert got == expected, (
            f"{adapter.kind} {method} {path} {body!r}: expected {expected}, got {got}")


def test_background_and_retrieval_name_no_ids_where_they_are_not_kept() -> None:
    """GET readers name no engine ids on either kind (nothing to abort even without the keep);
    the body copy of ``/v1/responses`` is kept for the decision on both kinds."""
    for adapter in (VLLM, SGLANG):
        for method, path in (("GET", RESPONSES + "/resp_abc"),
                             ("POST", RESPONSES + "/resp_abc/cancel")):
            got = adapter.engine_request_ids(method, path, "sid", None)
            assert got == (), f"{adapter.kind} {method} {path}: expected no ids, got {got}"
        assert adapter.wants_body("POST", RESPONSES), (
            f"{adapter.kind}: expected the /v1/responses body copy to be kept")
        assert not adapter.wants_body("GET", RESPONSES + "/resp_abc"), (
            f"{adapter.kind}: a GET has no body to keep")


# --- through the sidecar -----------------------------------------------------------------------

@pytest_asyncio.fixture
async def engine() -> AsyncIterator[ResponsesEngine]:
    fake = ResponsesEngine()
    await fake.start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def servers(engine: ResponsesEngine, start_sidecar: Callable[..., Any]) -> Servers:
    started: Servers = await start_sidecar(sidecar_settings(engine.url))
    return started


class AccessLines(logging.Handler):
    """The access lines' fields, by sidecar request id."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[str, dict[str, Any]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "access", {}))
        self.lines[fields.get("request_id", "")] = fields


@pytest.fixture
def access() -> Iterator[AccessLines]:
    logger = logging.getLogger("sidecar.access")
    handler, level = AccessLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def sdk(servers: Servers) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{servers.proxy_port}/v1",
                              api_key="client-key", max_retries=0, timeout=WAIT_S)


def background_body(*, stream: bool, background: Any = True) -> bytes:
    return _body(background=background, stream=stream, max_output_tokens=TOKENS)


def only(engine: ResponsesEngine) -> Background:
    assert len(engine.responses) == 1, (
        f"expected one background response at the engine, got {list(engine.responses)}")
    return next(iter(engine.responses.values()))


async def ran_to_the_end(engine: ResponsesEngine, servers: Servers, background: Background
                         ) -> None:
    """The response was generated whole after its client left, never aborted, and the stored
    response the client fetches later (the openai SDK, through the sidecar) holds every token."""
    work: Work = background.work
    done = await engine.watch.until(lambda: work.finished or work.stopped_at is not None, WAIT_S)
    assert done and work.finished and not work.aborted, (
        f"expected the background response generated to its end, got finished={work.finished} "
        f"aborted={work.aborted} tokens={background.tokens}/{TOKENS}")
    await settle(servers.proxy_port)
    assert engine.calls == [], (
        f"expected no abort call for a background response, got {[c.ids for c in engine.calls]}")
    async with sdk(servers) as client:
        stored = await client.responses.retrieve(background.response_id)
    assert stored.status == "incomplete" and stored.usage is not None and (
        stored.usage.output_tokens == TOKENS), (
        f"expected the stored response whole ({TOKENS} tokens, incomplete: max_output_tokens), "
        f"got status {stored.status!r} usage {stored.usage!r}")


async def kept_count(servers: Servers, reason: Kept) -> float:
    assert servers.admin_port is not None, "the test config has an admin listener"
    return sample(await metrics(servers.admin_port), "cancel_sidecar_kept_requests_total",
                  engine="local", reason=reason)


def event_lines(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix(b"data: ")) for line in raw.split(b"\n")
            if line.startswith(b"data: ")]


@pytest.mark.parametrize(("how", "background"), [("rst", True), ("fin", "true"), ("rst", 1)])
async def test_background_stream_left_by_its_client_runs_to_the_end(
        how: str, background: Any, engine: ResponsesEngine, servers: Servers, stalls: Stalls,
        access: AccessLines) -> None:
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", RESPONSES + "?interval=0.01",
                    background_body(stream=True, background=background))
        status, headers = await client.head()
        assert status == 200, f"expected a 200 stream, got {status}"
        seen = b""
        while len(event_lines(seen)) < 5:
            seen += await client.read_until(b"\n\n")
        client.disconnect(how)
    await ran_to_the_end(engine, servers, only(engine))
    line = access.lines[headers["X-Request-Id"]]
    assert (line["client_disconnected"], line["phase"], line["abort"],
            line["kept_by_engine"]) == (True, "streaming", None, BG), (
        f"expected a disconnect mid-stream, no abort, kept_by_engine {BG}; got {line}")
    assert await kept_count(servers, BG) == 1, "expected kept_requests_total{background_response} 1"


async def test_background_json_left_before_its_answer_runs_to_the_end(
        engine: ResponsesEngine, servers: Servers, stalls: Stalls, access: AccessLines) -> None:
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", RESPONSES + "?interval=0.01&hold_head=30",
                    background_body(stream=False))
        generating = await engine.watch.until(
            lambda: bool(engine.responses) and only(engine).tokens >= 3, WAIT_S)
        assert generating, "expected the engine to generate the background response"
        client.disconnect("rst")
    background = only(engine)
    await ran_to_the_end(engine, servers, background)
    sidecar_id = background.response_id.removeprefix("resp_")
    line = access.lines[sidecar_id]
    assert (line["status"], line["phase"], line["abort"], line["kept_by_engine"]) == (
        None, "awaiting_response", None, BG), (
        f"expected the client gone before the head, no abort, kept_by_engine {BG}; got {line}")


async def test_resumed_stream_left_early_keeps_the_response_running(
        engine: ResponsesEngine, servers: Servers, access: AccessLines) -> None:
    base = f"http://127.0.0.1:{servers.proxy_port}"
    async with aiohttp.ClientSession() as session:
        async with session.post(base + RESPONSES + "?interval=0.02",
                                data=background_body(stream=True)) as resp:
            assert resp.status == 200, f"expected a 200 stream, got {resp.status}"
            first = []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    first.append(json.loads(line.removeprefix(b"data: ")))
                if len(first) == 5:
                    break
            resp.close()  # the client leaves the original stream
        response_id = first[0]["response"]["id"]
        resume = f"{base}{RESPONSES}/{response_id}?stream=true&starting_after=4"
        async with session.get(resume) as resp:
            assert resp.status == 200, f"expected the resumed stream, got {resp.status}"
            resumed = []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    resumed.append(json.loads(line.removeprefix(b"data: "))["sequence_number"])
                if len(resumed) == 3:
                    break
            read_id = resp.headers["X-Request-Id"]
            resp.close()  # and leaves the resumed one
    assert resumed == [5, 6, 7], f"expected the stream resumed after event 4, got {resumed}"
    reader = engine.reads[-1]
    closed = await engine.watch.until(lambda: reader.closed_at is not None, WAIT_S)
    assert closed, "expected the sidecar to close the resumed stream's upstream connection"
    await ran_to_the_end(engine, servers, only(engine))
    fields = access.lines[read_id]
    assert (fields["client_disconnected"], fields["abort"], fields["kept_by_engine"]) == (
        True, None, READ), f"expected a disconnect, no abort, kept_by_engine {READ}; got {fields}"
    assert await kept_count(servers, READ) == 1, "expected kept_requests_total{response_retrieval}"


async def test_background_json_answered_at_once_and_read_back_runs_to_the_end(
        engine: ResponsesEngine, servers: Servers) -> None:
    async with sdk(servers) as client:
        created = await client.responses.create(model="fake", input="hi", background=True,
                                                max_output_tokens=TOKENS)
        assert created.status == "queued", f"expected a queued response, got {created.status!r}"
        again = await client.responses.retrieve(created.id)
        assert again.id == created.id, f"expected {created.id}, got {again.id}"
    await ran_to_the_end(engine, servers, only(engine))


@pytest.mark.parametrize("background", [False, "false", None])
async def test_response_that_is_not_background_is_still_aborted(
        background: Any, engine: ResponsesEngine, servers: Servers, stalls: Stalls,
        access: AccessLines) -> None:
    """The regression guard: an ordinary ``/v1/responses`` stream left by its client is aborted
    by its id, ``resp_{sidecar id}_0`` (vLLM takes ``request_id`` from the body)."""
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", RESPONSES + "?tokens=100000&interval=0.01",
                    _body(background=background, stream=True))
        status, headers = await client.head()
        assert status == 200, f"expected a 200 stream, got {status}"
        await client.read_until(b"data:")
        client.disconnect("rst")
    sidecar_id = headers["X-Request-Id"]
    aborted = await engine.watch.until(lambda: bool(engine.calls), WAIT_S)
    assert aborted, "expected an abort call for a request that is not background"
    assert [c.ids for c in engine.calls] == [[f"resp_{sidecar_id}_0"]], (
        f"expected one abort naming resp_{sidecar_id}_0, got {[c.ids for c in engine.calls]}")
    work = engine.works[-1]
    stopped = await engine.watch.until(lambda: work.stopped_at is not None, WAIT_S)
    assert stopped, f"expected the engine to stop the request, got {work}"
    await settle(servers.proxy_port)
    line = access.lines[sidecar_id]
    assert (line["abort"], line["kept_by_engine"]) == ("confirmed", None), (
        f"expected abort confirmed and no kept_by_engine, got {line}")


async def test_cancel_passes_through_to_the_engine(
        engine: ResponsesEngine, servers: Servers) -> None:
    async with sdk(servers) as client:
        created = await client.responses.create(model="fake", input="hi", background=True,
                                                max_output_tokens=100000,
                                                extra_query={"interval": "0.01"})
        cancelled = await client.responses.cancel(created.id)
        assert cancelled.status == "cancelled", (
            f"expected the engine's cancelled response, got {cancelled.status!r}")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.cancel(created.id)  # vLLM: not queued/in_progress any more
        assert refused.value.status_code == 400, f"expected 400, got {refused.value}"
        stored = await client.responses.retrieve(created.id)
    assert engine.cancels == [created.id, created.id], (
        f"expected both cancels to reach the engine, got {engine.cancels}")
    work = only(engine).work
    assert work.stopped_at is not None and stored.status == "cancelled", (
        f"expected the engine to stop the response and keep it cancelled, got {work} "
        f"{stored.status!r}")
    await asyncio.sleep(0)
    assert engine.calls == [], f"expected no abort call, got {[c.ids for c in engine.calls]}"


@pytest.mark.parametrize("ending", ["cancel_api", "deadline"])
async def test_sidecar_ending_a_background_stream_does_not_abort_it(
        ending: str, engine: ResponsesEngine, servers: Servers, access: AccessLines) -> None:
    """The sidecar's own endings (the cancel API, a deadline) end the client's stream with their
    error event, and leave the engine's background work alone, as a disconnect does."""
    assert servers.admin_port is not None, "the test config has an admin listener"
    base = f"http://127.0.0.1:{servers.proxy_port}"
    headers = {"X-Sidecar-Deadline-S": "0.3"} if ending == "deadline" else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + RESPONSES + "?interval=0.02", headers=headers,
                                data=background_body(stream=True)) as resp:
            assert resp.status == 200, f"expected a 200 stream, got {resp.status}"
            sidecar_id = resp.headers["X-Request-Id"]
            await resp.content.readuntil(b"\n\n")
            if ending == "cancel_api":
                async with session.post(f"http://127.0.0.1:{servers.admin_port}/v1/requests/"
                                        f"{sidecar_id}/cancel") as answer:
                    assert answer.status == 200, f"expected the cancel accepted: {answer.status}"
            async with asyncio.timeout(WAIT_S):
                rest = await resp.content.read()
    assert b'"error"' in rest.rsplit(b"data: ", 1)[-1], (
        f"expected the stream to end with the sidecar's error event, got {rest[-200:]!r}")
    await ran_to_the_end(engine, servers, only(engine))
    fields = access.lines[sidecar_id]
    assert (fields["abort"], fields["kept_by_engine"]) == (None, BG), (
        f"expected no abort and kept_by_engine {BG}, got {fields}")


@pytest.mark.parametrize(("stream", "aborted"), [(True, True), (False, False)])
async def test_sglang_keeps_a_background_response_only_when_it_does_not_stream(
        stream: bool, aborted: bool, start_sidecar: Callable[..., Any], stalls: Stalls) -> None:
    """SGLang 0.5.23 detaches a background request only when it does not stream
    (``background=request.background and not request.stream``): a streaming one runs on its
    connection like any stream, so its client's departure aborts it (``resp_{id}``, the
    ``request_id`` the sidecar wrote); a JSON one is left to run. Checked at the fake SGLang."""
    fake = SGLangEngine("sekret-key")
    await fake.start()
    try:
        servers = await start_sidecar(sidecar_settings(fake.url, engines={"local": {
            "kind": "sglang", "url": fake.url, "abort": {"api_key": "sekret-key"}}}))
        body = json.dumps({"input": "hi", "background": True, "stream": stream}).encode()
        async with raw_client(servers.proxy_port, stalls) as client:
            client.send("POST", RESPONSES + "?tokens=200&interval=0.02", body)
            running = await fake.watch.until(
                lambda: bool(fake.works) and fake.works[-1].registered_at is not None, WAIT_S)
            assert running, "the request never ran at the engine"
            work = fake.works[-1]
            client.disconnect("rst")
        if aborted:
            stopped = await fake.watch.until(lambda: work.stopped_at is not None, WAIT_S)
            assert stopped and work.tag and work.tag.startswith("resp_"), (
                f"expected the streaming background request aborted by its rid, got {work}")
            assert [i for c in fake.calls for i in c.ids] == [work.tag], fake.calls
        else:
            await fake.watch.until(lambda: bool(fake.calls), 0.5)  # an abort would come now
            await settle(servers.proxy_port)
            assert not fake.calls and work.stopped_at is None, (
                f"expected the background response left running, got calls {fake.calls}")
    finally:
        await fake.stop()
