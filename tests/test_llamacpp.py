"""The ``openai`` kind in front of a real llama.cpp server (``llama-cpp-python[server]``).

The server runs a tiny random Llama written locally as GGUF
(:mod:`tests.harness.llamacpp_model`), one model, one request at a time (llama-cpp-python serialises
requests on one lock). Between the sidecar and the server sits a recording TCP tap
(:class:`tests.harness.llamacpp_support.Tap`, shared with ``tests/test_llamacpp_native.py``): it
keeps every byte the server sent and notes when the sidecar closed its side, so the tests can say
that the client got the server's body byte for byte and that a disconnect closed the upstream at
once.

What the server does after the close is measured from its side: its process's CPU seconds after
the disconnect (a server still generating burns about one core) and the time it then takes to
answer the next request (llama-cpp-python serves one request at a time, so a server still
busy with the abandoned one makes the next one wait). Measured with llama-cpp-python 0.3.36:
it does not stop, for a stream either (its handler's ``request.is_disconnected()`` check never
fired here; no "Disconnected" line in its log).

Runs under the interpreter named by ``CANCEL_SIDECAR_LLAMA_PYTHON`` (the server and the model
writer run under it), else this one. ``make test-llamacpp`` (and so ``.ci/run``) builds
llama-cpp-python from source into ``.venv-llama`` and names its interpreter; one so named that
cannot import ``llama_cpp.server`` and ``gguf`` fails every test here, it is never a skip.
Without the variable the module is skipped unless this interpreter has them (``make test``).
Marker ``llamacpp``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import pytest_asyncio

from tests.harness.llamacpp_support import (
    LLAMA_PY,
    LLAMA_REQUIRED,
    WATCH_S,
    ServerProcess,
    Tap,
    check_relayed_byte_for_byte,
    cpu_over,
    free_port,
    interpreter_problem,
    leave_long_request,
    next_request_s,
    serving,
    sidecar_in_front,
    tapping,
    write_model,
)

LONG_JSON = 1500  # max_tokens of a generation the client leaves (~20 s here)
LONG_STREAM = 250  # the same as a stream (~20 s here: ~80 ms an event)

LLAMA_PROBLEM = interpreter_problem("llama_cpp.server, gguf, numpy")

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(LLAMA_PROBLEM is not None and not LLAMA_REQUIRED, reason=(
        f"{LLAMA_PY} cannot import llama_cpp.server and gguf (make test-llamacpp builds one; "
        "or set CANCEL_SIDECAR_LLAMA_PYTHON to an interpreter that can)")),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if LLAMA_PROBLEM is not None:  # only reached when CANCEL_SIDECAR_LLAMA_PYTHON names it
        pytest.fail(f"CANCEL_SIDECAR_LLAMA_PYTHON names an unusable interpreter: {LLAMA_PROBLEM}")
    home = tmp_path_factory.mktemp("llamacpp")
    model = write_model(home)
    port = free_port()
    with serving([LLAMA_PY, "-m", "llama_cpp.server", "--model", str(model), "--host",
                  "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "1",
                  "--model_alias", "tiny"], port, home / "server.log", cwd=home) as running:
        yield running


@pytest_asyncio.fixture
async def tap(llama: ServerProcess) -> AsyncIterator[Tap]:
    async with tapping(llama) as relay:
        yield relay


@pytest_asyncio.fixture
async def proxy(tap: Tap) -> AsyncIterator[str]:
    """The sidecar in front of the llama.cpp server (through the tap); its base URL."""
    async with sidecar_in_front(tap) as url:
        yield url


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_llamacpp_answers_relay_byte_for_byte(proxy: str, tap: Tap, stream: bool) -> None:
    await check_relayed_byte_for_byte(proxy, tap, stream)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_llamacpp_disconnect_closes_upstream_at_once_and_the_server_runs_on(
        llama: ServerProcess, proxy: str, tap: Tap, stream: bool) -> None:
    """Measured (llama-cpp-python 0.3.36): after the sidecar closes the upstream connection the
    server goes on generating to ``max_tokens``, streaming or not: it keeps burning a core and
    the next request waits for the abandoned one (it serves one request at a time)."""
    long = LONG_STREAM if stream else LONG_JSON
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        left = await leave_long_request(llama, proxy, tap, session, long, stream)
        used = await cpu_over(llama, WATCH_S)
        next_s = await next_request_s(proxy, session)

    rate, per_token_s, close_s = left.rate, left.per_token_s, left.close_s
    generation_s = long * per_token_s
    print(f"llama.cpp {'stream' if stream else 'JSON'}: generating costs {rate:.2f} CPU s/s, "
          f"{per_token_s * 1000:.1f} ms/token; upstream closed {close_s * 1000:.1f} ms after "
          f"the disconnect; server CPU in the {WATCH_S:g} s after: {used:.2f} s; next request "
          f"answered {next_s:.1f} s later ({long} tokens take ~{generation_s:.1f} s)",
          file=sys.stderr)
    assert close_s < 0.5, f"expected the upstream closed at once (< 0.5 s), got {close_s:.3f} s"
    assert used > 0.5 * rate * WATCH_S, (
        f"expected the server to keep generating (> 50% of {rate * WATCH_S:.2f} CPU s in "
        f"{WATCH_S:g} s), got {used:.2f} CPU s")
    assert next_s > 0.5 * (generation_s - WATCH_S - 1.0), (
        f"expected the next request to wait for the abandoned one (~{generation_s:.1f} s in "
        f"all), got {next_s:.2f} s")
