"""vLLM's speech to text routes stop when their client leaves.

``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (a multipart form with the
audio) run as ``{task_type}-{X-Request-Id}``, or, for audio longer than the model's
``max_audio_clip_s``, one engine request per chunk, ``{task_type}-{id}-{i}``, all generating at
once (vLLM 0.32 ``entrypoints/speech_to_text/base/serving.py``). The sidecar cannot count the
chunks without decoding the audio, so it names the base id, the language detection run and the
first 64 chunks (``engine/vllm.py`` ``AUDIO_CHUNKS``); vLLM ignores the ids it does not have.

The engine is :class:`tests.fakes.kinds.VLLMEngine` (the fake keeps generating for a closed
request until every id is aborted); the sidecar runs through :func:`sidecar.server.start`; the
client is a raw socket that resets or closes mid-answer. Checked at the engine: every chunk is
aborted and none runs to its end after the client left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from engine.vllm import AUDIO_CHUNKS, VLLMAdapter
from sidecar.config import EngineKind, EngineSettings
from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.kinds import VLLMEngine
from tests.harness.support import WAIT_S, Stalls, raw_client

pytestmark = pytest.mark.timeout(60)

BOUNDARY = "sidecar-test-boundary"
GEN = "?tokens=200&interval=0.02"  # 4 s: a chunk not aborted shows as one that ran to its end
VLLM = VLLMAdapter("local", EngineSettings.model_validate({"kind": EngineKind.VLLM,
                                                           "url": "http://e:1"}))


def form(fields: dict[str, str], audio: bytes = b"RIFF\x00\x00\x00\x00WAVEfmt ") -> bytes:
    """A multipart/form-data body with an audio ``file`` part and text ``fields``."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             f"Content-Type: audio/wav\r\n\r\n".encode() + audio + b"\r\n"]
    parts += [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
              f"{value}\r\n".encode() for name, value in fields.items()]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize(("path", "task_type"), [
    ("/v1/audio/transcriptions", "transcribe"), ("/v1/audio/translations", "translate")])
def test_ids_name_the_base_the_language_detection_and_the_first_chunks(path: str,
                                                                       task_type: str) -> None:
    ids = VLLM.engine_request_ids("POST", path, "sid", None)
    assert ids == (f"{task_type}-sid", f"{task_type}-sid-lang_detect",
                   *(f"{task_type}-sid-{i}" for i in range(AUDIO_CHUNKS))), f"got {ids[:4]}..."
    assert not VLLM.wants_body("POST", path), "the audio must never be copied"


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[VLLMEngine]:
    fake = VLLMEngine(api_key="sekret-key")
    await fake.start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def servers(engine: VLLMEngine, start_sidecar: Callable[..., Any]) -> Servers:
    abort = {"api_key": "sekret-key", "timeout_s": 2.0}
    started: Servers = await start_sidecar(sidecar_settings(
        engine.url, engines={"local": {"kind": "vllm", "url": engine.url, "abort": abort}}))
    return started


@pytest.mark.parametrize(("path", "chunks", "stream", "how"), [
    ("/v1/audio/transcriptions", 1, True, "rst"),
    ("/v1/audio/transcriptions", 3, True, "fin"),
    ("/v1/audio/transcriptions", 3, False, "rst"),
    ("/v1/audio/translations", 2, False, "fin"),
])
async def test_every_chunk_stops_when_the_client_leaves(
        path: str, chunks: int, stream: bool, how: str, engine: VLLMEngine, servers: Servers,
        stalls: Stalls) -> None:
    body = form({"model": "whisper", "stream": "true" if stream else "false",
                 "fake_chunks": str(chunks)})
    async with raw_client(servers.proxy_port, stalls) as client:
        client.send("POST", path + GEN, body,
                    [("Content-Type", f"multipart/form-data; boundary={BOUNDARY}")])
        if stream:
            status, _ = await client.head()
            assert status == 200, f"expected a 200 stream, got {status}"
        arrived = await engine.watch.until(lambda: bool(engine.works), WAIT_S)
        assert arrived, "the request never reached the engine"
        work = engine.works[-1]
        running = await engine.watch.until(
            lambda: work.registered_at is not None and (work.events > 0 or not stream), WAIT_S)
        assert running, f"the request never ran: {work}"
        left = client.disconnect(how)
    stopped = await engine.watch.until(lambda: work.stopped_at is not None, WAIT_S)
    assert stopped, f"expected every chunk aborted, got aborted={sorted(work.aborted)} of " \
                    f"{work.engine_ids}"
    assert len(work.engine_ids) == chunks and set(work.aborted) == set(work.engine_ids), work
    ran_on = {i: at - left for i, at in work.ran_to_end.items() if at > left}
    assert not ran_on, f"chunks ran to their end after the client left: {ran_on}"
    named = {i for call in engine.calls for i in call.ids}
    sidecar_id = work.request_id_header
    assert sidecar_id and set(VLLM.engine_request_ids("POST", path, sidecar_id, None)) == named, (
        f"expected the calls to name exactly the derived ids, got {sorted(named)[:5]}...")
