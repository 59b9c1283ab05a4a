"""The bench's fake engine ends an aborted stream as vLLM does, and with ``--api-servers N`` only
from the owner's process; the storm's figures made from its records. Real engine processes on
127.0.0.1 (``bench.procs.start_engine``), raw sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from bench.engine import Engine
from bench.procs import Proc, http_get, start_engine
from bench.run import storm_figures
from bench.wire import ChunkedDecoder

pytestmark = pytest.mark.timeout(60)

ABORT_PATH = "/inference/v1/abort_requests"


def _stream_request(tag: str, request_id: str) -> bytes:
    body = b'{"model": "m", "stream": true, "messages": []}'
    return (f"POST /v1/chat/completions?mode=stream&tokens=100000&interval_us=20000&s={tag}"
            f"&rec=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _abort_request(ids: list[str]) -> bytes:
    body = json.dumps({"request_ids": ids}).encode()
    return (f"POST {ABORT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class StreamReader:
    """A stream's connection: its decoded body, read as it comes."""

    def __init__(self, port: int, tag: str, request_id: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(_stream_request(tag, request_id))
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = self.sock.recv(65536)
            assert data, "expected the stream's head"
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        self.decoder = ChunkedDecoder()
        self.body = self.decoder.feed(rest)

    def read_to_end(self) -> bytes:
        while not self.decoder.done:
            data = self.sock.recv(65536)
            assert data, "expected the stream's last chunk before a close"
            self.body += self.decoder.feed(data)
        return self.body

    def close(self) -> None:
        self.sock.close()


def _call(port: int, ids: list[str], hold: bool = False) -> socket.socket:
    """One abort call on a new connection; its answer read (200 whatever the process). The
    connection is closed, or returned open with ``hold``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(_abort_request(ids))
    answer = b""
    while not answer.endswith(b"{}"):
        data = sock.recv(4096)
        assert data, f"expected the abort call's answer, got {answer!r}"
        answer += data
    assert answer.startswith(b"HTTP/1.1 200"), answer
    if not hold:
        sock.close()
    return sock


async def _records(engine: Proc) -> dict[str, Any]:
    _, records = await http_get(engine.port, "/bench/records")
    assert isinstance(records, dict)
    return records


async def test_an_abort_ends_the_stream_at_once_as_vllm_does(tmp_path: Path) -> None:
    engine = await start_engine(tmp_path)
    try:
        stream = await asyncio.to_thread(StreamReader, engine.port, "s1", "r1")
        await asyncio.to_thread(_call, engine.port, ["chatcmpl-r1", "chatcmpl-unknown"])
        body = await asyncio.wait_for(asyncio.to_thread(stream.read_to_end), 5)
        stream.close()
        events = [e for e in body.split(b"\n\n") if e]
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert last["id"] == "chatcmpl-r1" and "t" in last, last
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert b'"finish_reason":"abort"' in events[-2], "expected vLLM's compact JSON"
        records = await _records(engine)
        assert records["stopped"]["s1"][1] == 0, records["stopped"]
        assert records["abort_processes"] == [0], records
        assert (records["abort_hits"], records["abort_misses"]) == (1, 0), records
        assert records["stopped"]["s1"][0] >= records["aborts"][0][0], records
    finally:
        await engine.stop()


async def test_an_abort_reaches_only_the_streams_of_its_own_api_server(tmp_path: Path) -> None:
    """Four simulated processes: calls on connections of other processes than the stream's are
    misses and change nothing; the first call on a connection of the owner ends it. Each call's
    connection is held open, as the sidecar's warm abort connections are: vLLM 0.32 gives a new
    connection to the process with the fewest open ones, so a fresh connection per call would
    never reach the stream's (its own connection makes it the busiest)."""
    engine = await start_engine(tmp_path, api_servers=4)
    held: list[socket.socket] = []
    try:
        stream = await asyncio.to_thread(StreamReader, engine.port, "s1", "r1")
        owner = (await _records(engine))["owners"]["s1"]
        for _ in range(8):
            held.append(await asyncio.to_thread(_call, engine.port, ["chatcmpl-r1"], True))
            records = await _records(engine)
            if "s1" in records["stopped"]:
                break
        else:
            raise AssertionError(f"no abort call of 8 reached process {owner}: {records}")
        body = await asyncio.wait_for(asyncio.to_thread(stream.read_to_end), 5)
        stream.close()
        assert body.endswith(b"data: [DONE]\n\n"), body[-80:]
        processes = records["abort_processes"]
        hit = records["stopped"]["s1"][1]
        assert hit == len(processes) - 1 and processes[hit] == owner, (hit, processes, owner)
        assert all(p != owner for p in processes[:hit]), (processes, owner)
        assert (records["abort_hits"], records["abort_misses"]) == (1, hit), records
        assert records["api_servers"] == 4 and sum(records["accepted"]) >= hit + 2, records
        assert hit >= 3, f"expected the held connections to fill the other processes first: {hit}"
    finally:
        for sock in held:
            sock.close()
        await engine.stop()


def test_a_new_connection_goes_to_the_api_server_with_fewest_connections() -> None:
    """The accept model itself (vLLM 0.32's launcher): held connections spread evenly; a process
    holding 20 more takes none of the next 60, and a closed connection frees its place."""
    engine = Engine(4, seed=1)
    first = [engine.accept().index for _ in range(8)]
    assert sorted(first) == [0, 0, 1, 1, 2, 2, 3, 3], first
    busy = engine.servers[0]
    busy.connections += 20
    later = [engine.accept() for _ in range(60)]
    assert all(s is not busy for s in later), [s.index for s in later]
    assert [s.connections for s in engine.servers] == [22, 22, 22, 22]
    Engine.closed(later[0])
    assert engine.accept() is later[0], "the freed place is taken first"


def test_storm_figures_count_stopped_streams_and_the_calls_naming_them() -> None:
    closed = {"c1": 1_000_000, "c2": 2_000_000, "c3": 3_000_000}
    result = {"closed": closed, "open": 6, "errors": 0, "close_spread_ms": 2.0,
              "cpu_s": {"proxy": 0.1}}
    records = {"request_ids": {"c1": "a", "c2": "b", "c3": "c"},
               "aborts": [[4_000_000, ["chatcmpl-a", "chatcmpl-b"]], [5_000_000, ["chatcmpl-a"]],
                          [6_000_000, ["chatcmpl-a", "chatcmpl-c"]]],
               "abort_processes": [0, 1, 2],
               # a: stopped by the third call; b: its connection closed while it ran; c: never
               "stopped": {"c1": [6_500_000, 2]}, "closes": [["c2", 9_000_000]],
               "abort_hits": 1, "abort_misses": 3, "api_servers": 4}
    figures = storm_figures(result, records)
    assert figures["hit_ms"] == {"n": 1, "p50": 5.5, "p99": 5.5, "max": 5.5}, figures
    assert figures["stopped_ms"] == {"n": 2, "p50": 5.5, "p99": 7.0, "max": 7.0}, figures
    assert figures["calls_per_request"] == {"n": 3, "p50": 1.0, "p99": 3.0, "max": 3.0}, figures
    assert (figures["abort_stopped"], figures["unstopped"]) == (1, 1), figures
    assert figures["abort_ms"]["n"] == 3 and figures["api_servers"] == 4, figures
