"""What the real llama.cpp server tests share (``tests/test_llamacpp.py``: llama-cpp-python's
server, ``tests/test_llamacpp_native.py``: llama.cpp's own C++ server through ``xllamacpp``).

Both servers run under the interpreter named by ``CANCEL_SIDECAR_LLAMA_PYTHON`` (else this one),
serve the tiny random Llama of :mod:`tests.harness.llamacpp_model`, and sit behind the sidecar (kind
``openai``, production wiring) with a recording TCP tap in between (:class:`Tap`): it keeps every
byte the server sent and notes when the sidecar closed its side, so a test can say that the
client got the server's body byte for byte and that a disconnect closed the upstream at once.
:func:`leave_long_request` is the disconnect both modules measure; what the server does after it
is read from the server's side (its process's CPU seconds, how long the next request waits, and
for llama.cpp's own server its ``/metrics``, ``/slots`` and log).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml
from prometheus_client import CollectorRegistry

from sidecar import server
from sidecar.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PY = os.environ.get("CANCEL_SIDECAR_LLAMA_PYTHON") or sys.executable
# Named explicitly (make test-llamacpp, .ci/run): a broken build must fail, not skip.
LLAMA_REQUIRED = bool(os.environ.get("CANCEL_SIDECAR_LLAMA_PYTHON"))
START_S = 120.0  # guard: model written and server answering /v1/models
BASELINE = 50  # tokens of the request that measures the server's pace
WATCH_S = 3.0  # how long the server is watched after a disconnect


def interpreter_problem(modules: str) -> str | None:
    """Why ``LLAMA_PY`` cannot import ``modules`` (``"a, b"``), or None if it can."""
    try:
        result = subprocess.run([LLAMA_PY, "-c", f"import {modules}"],
                                capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{LLAMA_PY}: {exc!r}"
    if result.returncode != 0:
        return (f"{LLAMA_PY} cannot import {modules}:\n"
                f"{result.stderr.decode(errors='replace')[-2000:]}")
    return None


def free_port() -> int:
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
                for body in response_bodies(bytes(conn.from_server))]


@asynccontextmanager
async def tapping(server: ServerProcess) -> AsyncIterator[Tap]:
    """A :class:`Tap` in front of ``server``, stopped at the end."""
    relay = Tap(server.port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.stop()


def response_bodies(data: bytes) -> list[bytes]:
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
class ServerProcess:
    """A llama.cpp server running as a child process, its output in ``log``."""

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


def write_model(home: Path) -> Path:
    """The tiny GGUF model, written by ``LLAMA_PY`` into ``home``."""
    model = home / "tiny-llama.gguf"
    subprocess.run([LLAMA_PY, "-m", "tests.harness.llamacpp_model", str(model)], cwd=ROOT,
                   check=True, capture_output=True, timeout=START_S)
    return model


@contextmanager
def serving(argv: Sequence[str], port: int, log: Path, cwd: Path) -> Iterator[ServerProcess]:
    """Run ``argv`` (a server listening on 127.0.0.1:``port``) until it answers
    ``GET /v1/models`` with 200 (within ``START_S``, else the test fails with its output); stop
    it (SIGTERM, then SIGKILL after 15 s) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    running = ServerProcess(proc, port, log)
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


@asynccontextmanager
async def sidecar_in_front(tap: Tap) -> AsyncIterator[str]:
    """The sidecar (production wiring) with one ``openai`` engine: the server through the tap.
    Yields its base URL."""
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


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello engine"}],
            "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}


async def until(predicate: Callable[[], bool], event: asyncio.Event, within_s: float) -> bool:
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


async def check_relayed_byte_for_byte(proxy: str, tap: Tap, stream: bool) -> None:
    """A 16-token chat answer through the sidecar is one of the bodies the server sent."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session, \
            session.post(f"{proxy}/v1/chat/completions", json=chat(16, stream)) as resp:
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


@dataclass
class Disconnect:
    """A request the client left, as seen at the tap."""

    sent_at: float  # time.monotonic() when the request was started
    left_at: float  # when the client left
    close_s: float  # client left -> the sidecar closed the upstream connection (seconds)
    conn: TapConnection  # the upstream connection the request took


@dataclass
class Left(Disconnect):
    """A long request the client left, and the server's pace before it."""

    rate: float  # CPU seconds per second the server used generating the baseline request
    per_token_s: float  # wall seconds per token of the baseline request (the fastest tokens)


async def disconnect(proxy: str, tap: Tap, session: aiohttp.ClientSession, max_tokens: int,
                     stream: bool) -> Disconnect:
    """Start a ``max_tokens`` chat request through the sidecar and leave it: a stream after
    reading 5 lines, a JSON request after 1 s (it sends nothing until the end). Fails unless
    the sidecar closes the upstream within 5 s."""
    sent_at = time.monotonic()
    task = asyncio.ensure_future(session.post(f"{proxy}/v1/chat/completions",
                                              json=chat(max_tokens, stream)))
    if stream:
        resp = await asyncio.wait_for(task, 30)
        for _ in range(5):
            line = await asyncio.wait_for(resp.content.readline(), 30)
            assert line.startswith(b"data: ") or line == b"\n", f"expected SSE, got {line!r}"
    else:
        await asyncio.sleep(1.0)  # generating; a JSON answer sends nothing until the end
    conn = tap.latest()
    left_at = time.monotonic()
    if stream:
        resp.close()
    else:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    closed = await until(lambda: conn.client_closed_at is not None, tap.changed, 5)
    assert closed and conn.client_closed_at is not None, (
        "expected the sidecar to close the upstream connection after the disconnect")
    return Disconnect(sent_at, left_at, conn.client_closed_at - left_at, conn)


async def leave_long_request(server_process: ServerProcess, proxy: str, tap: Tap,
                             session: aiohttp.ClientSession, long: int, stream: bool) -> Left:
    """Measure the server's pace on a ``BASELINE``-token request, then :func:`disconnect` from
    a ``long``-token one."""
    # Baseline in the same mode: llama-cpp-python streams ~8x slower than it generates JSON.
    cpu = server_process.cpu_s()
    started = time.monotonic()
    async with session.post(f"{proxy}/v1/chat/completions", json=chat(BASELINE, stream)) as resp:
        body = await resp.read()
    rate = (server_process.cpu_s() - cpu) / (time.monotonic() - started)
    per_token_s = (time.monotonic() - started) / BASELINE
    # Greedy decoding of random weights: never the EOS token here, so every generation runs to
    # max_tokens (logit_bias against EOS made llama-cpp-python ~50x slower).
    # A stream: a role chunk, one per token, a finish chunk, [DONE].
    tokens = body.count(b"data: ") - 3 if stream else json.loads(body)["usage"][
        "completion_tokens"]
    assert tokens == BASELINE, f"expected {BASELINE} tokens, got {tokens}"
    left = await disconnect(proxy, tap, session, long, stream)
    return Left(left.sent_at, left.left_at, left.close_s, left.conn, rate, per_token_s)


async def cpu_over(server_process: ServerProcess, seconds: float) -> float:
    """CPU seconds the server uses in the next ``seconds`` seconds."""
    cpu = server_process.cpu_s()
    await asyncio.sleep(seconds)  # measuring over a fixed window, not waiting for an event
    return server_process.cpu_s() - cpu


async def next_request_s(proxy: str, session: aiohttp.ClientSession) -> float:
    """Seconds until a 1-token chat request through the sidecar is answered (200)."""
    started = time.monotonic()
    async with session.post(f"{proxy}/v1/chat/completions", json=chat(1, False)) as resp:
        await resp.read()
    assert resp.status == 200, f"expected the next request to succeed, got {resp.status}"
    return time.monotonic() - started
