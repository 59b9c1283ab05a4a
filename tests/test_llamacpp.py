"""The ``openai`` kind in front of a real llama.cpp server (``llama-cpp-python[server]``).

The server runs a tiny random Llama written locally as GGUF (:mod:`tests.llamacpp_model`), one
model, one request at a time (llama-cpp-python serialises requests on one lock). Between the
sidecar and the server sits a recording TCP tap (:class:`Tap`): it keeps every byte the server
sent and notes when the sidecar closed its side, so the tests can say that the client got the
server's body byte for byte and that a disconnect closed the upstream at once.

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

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import pytest_asyncio
import yaml
from prometheus_client import CollectorRegistry

from sidecar import server
from sidecar.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PY = os.environ.get("CANCEL_SIDECAR_LLAMA_PYTHON") or sys.executable
START_S = 120.0  # guard: model written and server answering /v1/models
BASELINE = 50  # tokens of the request that measures the server's pace
LONG_JSON = 1500  # max_tokens of a generation the client leaves (~20 s here)
LONG_STREAM = 250  # the same as a stream (~20 s here: ~80 ms an event)
WATCH_S = 3.0  # how long the server is watched after a disconnect


def _llama_problem() -> str | None:
    """Why ``LLAMA_PY`` cannot run the server and the model writer, or None if it can."""
    try:
        result = subprocess.run([LLAMA_PY, "-c", "import llama_cpp.server, gguf, numpy"],
                                capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{LLAMA_PY}: {exc!r}"
    if result.returncode != 0:
        return (f"{LLAMA_PY} cannot import llama_cpp.server, gguf and numpy:\n"
                f"{result.stderr.decode(errors='replace')[-2000:]}")
    return None


LLAMA_PROBLEM = _llama_problem()
# Named explicitly (make test-llamacpp, .ci/run): a broken build must fail, not skip.
LLAMA_REQUIRED = bool(os.environ.get("CANCEL_SIDECAR_LLAMA_PYTHON"))

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(LLAMA_PROBLEM is not None and not LLAMA_REQUIRED, reason=(
        f"{LLAMA_PY} cannot import llama_cpp.server and gguf (make test-llamacpp builds one; "
        "or set CANCEL_SIDECAR_LLAMA_PYTHON to an interpreter that can)")),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class TapConnection:
    """One connection through the tap: the bytes the server sent, and when the sidecar's side
    ended (EOF or reset), in ``time.monotonic()`` seconds."""

    from_server: bytearray = field(default_factory=bytearray)
    client_closed_at: float | None = None
    sent_at: float = 0.0  # the sidecar's last bytes towards the server (a request)


class Tap:
    """A TCP relay 127.0.0.1:port -> the server, recording each connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections: list[TapConnection] = []
        self.changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = TapConnection()
        self.connections.append(conn)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       record: bytearray | None) -> None:
            try:
                while data := await src.read(65536):
                    if record is not None:
                        record.extend(data)
                    else:
                        conn.sent_at = time.monotonic()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                if record is None:  # the sidecar's side ended
                    conn.client_closed_at = time.monotonic()
                    self.changed.set()
                dst.close()

        tasks = [asyncio.ensure_future(pipe(reader, up_writer, None)),
                 asyncio.ensure_future(pipe(up_reader, writer, conn.from_server))]
        self._pipes.update(tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            self._pipes.difference_update(tasks)

    def latest(self) -> TapConnection:
        """The connection that carried the latest request."""
        return max(self.connections, key=lambda c: c.sent_at)

    def bodies(self) -> list[bytes]:
        """Every response body (de-chunked) the server sent, over all connections."""
        return [body for conn in self.connections
                for body in _response_bodies(bytes(conn.from_server))]


def _response_bodies(data: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 responses in ``data``, one after another (Content-Length or
    chunked; a last incomplete one as far as it got)."""
    bodies = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (line.partition(b":") for line in head.split(b"\r\n")[1:])}
        if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = bytearray()
            while True:
                size_line, sep, rest = rest.partition(b"\r\n")
                if not sep:
                    break
                size = int(size_line.split(b";")[0], 16)
                body += rest[:size]
                rest = rest[size + 2:]
                if size == 0:
                    break
            bodies.append(bytes(body))
        else:
            length = int(fields.get(b"content-length", b"0"))
            bodies.append(rest[:length])
            rest = rest[length:]
        data = rest
    return bodies


@dataclass
class LlamaServer:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process has used so far, all threads."""
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if LLAMA_PROBLEM is not None:  # only reached when CANCEL_SIDECAR_LLAMA_PYTHON names it
        pytest.fail(f"CANCEL_SIDECAR_LLAMA_PYTHON names an unusable interpreter: {LLAMA_PROBLEM}")
    home = tmp_path_factory.mktemp("llamacpp")
    model = home / "tiny-llama.gguf"
    subprocess.run([LLAMA_PY, "-m", "tests.llamacpp_model", str(model)], cwd=ROOT, check=True,
                   capture_output=True, timeout=START_S)
    port = _free_port()
    log = home / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [LLAMA_PY, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", "4096", "--n_threads", "1",
             "--model_alias", "tiny"],
            cwd=home, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    running = LlamaServer(proc, port, log)
    deadline = time.monotonic() + START_S
    try:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if sock.recv(12).endswith(b"200"):
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"expected the llama.cpp server on {port} within {START_S} s, got exit "
                f"{proc.poll()}; output:\n{running.output()[-4000:]}")
            time.sleep(0.25)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture
async def tap(llama: LlamaServer) -> AsyncIterator[Tap]:
    relay = Tap(llama.port)
    await relay.start()
    yield relay
    await relay.stop()


@pytest_asyncio.fixture
async def proxy(tap: Tap) -> AsyncIterator[str]:
    """The sidecar (production wiring) with one ``openai`` engine: the llama.cpp server through
    the tap. Its base URL."""
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"llama": {"kind": "openai", "url": f"http://127.0.0.1:{tap.port}"}},
        "routes": [{"prefix": "/", "engine": "llama"}],
    }
    servers = await server.start(parse_config(yaml.safe_dump(tree), "<test>", env={}),
                                 CollectorRegistry())
    try:
        yield f"http://127.0.0.1:{servers.proxy_port}"
    finally:
        await servers.stop()


def _chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello engine"}],
            "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}


async def _until(predicate: Callable[[], bool], event: asyncio.Event, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        event.clear()
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), left)
        except TimeoutError:
            return predicate()
    return True


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_llamacpp_answers_relay_byte_for_byte(proxy: str, tap: Tap, stream: bool) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session, \
            session.post(f"{proxy}/v1/chat/completions", json=_chat(16, stream)) as resp:
        body = await resp.read()
    assert resp.status == 200, f"expected 200, got {resp.status}: {body[:300]!r}"
    if stream:
        assert body.rstrip().endswith(b"data: [DONE]"), f"expected a whole SSE stream, got " \
                                                        f"{body[-200:]!r}"
    else:
        answer = json.loads(body)
        assert answer["usage"]["completion_tokens"] == 16, f"expected 16 tokens, got {answer}"
    bodies = tap.bodies()
    assert body in bodies, (
        f"expected the client's {len(body)} bytes to be one of the server's bodies, got "
        f"bodies of {[len(b) for b in bodies]} bytes")


async def _watch_after(llama: LlamaServer, proxy: str, session: aiohttp.ClientSession
                       ) -> tuple[float, float]:
    """(CPU seconds the server used in ``WATCH_S`` seconds, then seconds until a 1-token
    request through the sidecar is answered)."""
    cpu = llama.cpu_s()
    await asyncio.sleep(WATCH_S)  # measuring over a fixed window, not waiting for an event
    used = llama.cpu_s() - cpu
    started = time.monotonic()
    async with session.post(f"{proxy}/v1/chat/completions", json=_chat(1, False)) as resp:
        await resp.read()
    assert resp.status == 200, f"expected the next request to succeed, got {resp.status}"
    return used, time.monotonic() - started


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_llamacpp_disconnect_closes_upstream_at_once_and_the_server_runs_on(
        llama: LlamaServer, proxy: str, tap: Tap, stream: bool) -> None:
    """Measured (llama-cpp-python 0.3.36): after the sidecar closes the upstream connection the
    server goes on generating to ``max_tokens``, streaming or not: it keeps burning a core and
    the next request waits for the abandoned one (it serves one request at a time)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        # Baseline: what generating costs the server, per second and per token.
        # In the same mode: llama-cpp-python streams ~8x slower than it generates JSON here.
        long = LONG_STREAM if stream else LONG_JSON
        cpu = llama.cpu_s()
        started = time.monotonic()
        async with session.post(f"{proxy}/v1/chat/completions",
                                json=_chat(BASELINE, stream)) as resp:
            body = await resp.read()
        rate = (llama.cpu_s() - cpu) / (time.monotonic() - started)
        per_token_s = (time.monotonic() - started) / BASELINE
        # Greedy decoding of random weights: never the EOS token here, so every generation
        # runs to max_tokens (logit_bias against EOS made llama-cpp-python ~50x slower).
        # A stream: a role chunk, one per token, a finish chunk, [DONE].
        tokens = body.count(b"data: ") - 3 if stream else json.loads(body)["usage"][
            "completion_tokens"]
        assert tokens == BASELINE, f"expected {BASELINE} tokens, got {tokens}"

        task = asyncio.ensure_future(session.post(f"{proxy}/v1/chat/completions",
                                                  json=_chat(long, stream)))
        if stream:
            resp = await asyncio.wait_for(task, 30)
            for _ in range(5):
                line = await asyncio.wait_for(resp.content.readline(), 30)
                assert line.startswith(b"data: ") or line == b"\n", f"expected SSE, got {line!r}"
        else:
            await asyncio.sleep(1.0)  # generating; a JSON answer sends nothing until the end
        conn = tap.latest()
        left = time.monotonic()
        if stream:
            resp.close()
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        closed = await _until(lambda: conn.client_closed_at is not None, tap.changed, 5)
        assert closed and conn.client_closed_at is not None, (
            "expected the sidecar to close the upstream connection after the disconnect")
        close_s = conn.client_closed_at - left
        used, next_s = await _watch_after(llama, proxy, session)

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
