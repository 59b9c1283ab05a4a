"""The benchmark's own logic, fast: chunked framing, the sweep's hold rule, the storm's matching
of abort calls to closed streams, the report (tables and plot) from a results tree, and the floor
proxies (bench.floor) against the bench's engine: their figures mean something only if they relay
and abort as the sidecar does.

The whole command runs end to end, at tiny sizes, in ``.ci/run`` (``python -m bench --quick``).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.procs import http_get, start_engine, start_floor
from bench.run import held, pool_storms, storm_figures
from bench.wire import ChunkedDecoder


def test_chunked_decoder_any_split() -> None:
    rng = random.Random(6)
    pieces = [bytes([65 + i % 26]) * rng.randint(1, 300) for i in range(40)]
    wire = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\nNEXT"
    for _ in range(100):
        decoder, body, pos = ChunkedDecoder(), b"", 0
        while not decoder.done:
            assert pos < len(wire), "expected the last chunk to end the body"
            step = rng.randint(1, 40)
            body += decoder.feed(wire[pos:pos + step])
            pos += step
        assert body == b"".join(pieces)
        assert decoder.rest + wire[pos:] == b"NEXT", "expected the bytes after the body kept"


def _level(offered: float, delivered: float, interval_us: int, itl_p99_ms: float
           ) -> dict[str, Any]:
    return {"offered_per_s": offered, "delivered_per_s": delivered, "interval_us": interval_us,
            "itl_p99_ms": itl_p99_ms, "errors": 0, "timed_out": False}


def test_sweep_level_holds_until_p99_itl_doubles_relative_to_interval() -> None:
    first = _level(5000, 5000, 40000, 44.0)  # p99 ITL 1.1 x interval
    assert held(_level(10000, 9900, 20000, 40.0), first)  # 2.0 x <= 2.2 x
    assert not held(_level(10000, 9900, 20000, 45.0), first)  # 2.25 x
    assert not held(_level(10000, 8000, 20000, 21.0), first), "under 90% delivered must fail"


def test_storm_matches_abort_ids_and_upstream_closes_to_closed_streams() -> None:
    result = {"closed": {"c1": 1_000_000, "c3": 2_000_000}, "open": 4, "errors": 0,
              "close_spread_ms": 1.0, "cpu_s": {"proxy": 0.1}}
    records = {"request_ids": {"c1": "a", "c2": "b", "c3": "c"},
               "aborts": [[3_000_000, ["chatcmpl-a", "chatcmpl-c"]], [9_000_000, ["chatcmpl-b"]]],
               "closes": [["c1", 1_500_000], ["c3", 2_500_000], ["c2", 8_000_000]]}
    figures = storm_figures(result, records)
    assert figures["abort_ms"] == {"n": 2, "p50": 1.0, "p99": 2.0, "max": 2.0}
    assert figures["upstream_close_ms"] == {"n": 2, "p50": 0.5, "p99": 0.5, "max": 0.5}


def test_storms_are_pooled_over_every_closed_stream() -> None:
    """Two storms: the pooled p99 is over all their closes (not a mean of p99s), counts add up,
    and each storm's own p99 is kept, in order."""
    def storm(abort: list[float], calls: int) -> dict[str, Any]:
        closed = {f"c{i}": 0 for i in range(len(abort))}
        aborts = [[round(ms * 1e6), [f"chatcmpl-{tag}"]]
                  for tag, ms in zip(closed, abort, strict=True)]
        records = {"request_ids": {tag: tag for tag in closed},
                   "aborts": aborts + [[0, []]] * (calls - len(abort)),
                   "closes": [[tag, 1_000_000] for tag in closed]}
        return storm_figures({"closed": closed, "open": 2 * len(abort), "errors": 0,
                              "close_spread_ms": float(calls), "cpu_s": {"proxy": 0.1 * calls}},
                             records)
    first, second = storm([1.0] * 90 + [2.0] * 10, 100), storm([0.5] * 99 + [9.0], 102)
    pooled = pool_storms([first, second])
    # pooled, sorted: 99 x 0.5, 90 x 1.0, 10 x 2.0, 9.0; p99 is the 198th of 200
    assert pooled["abort_ms"] == {"n": 200, "p50": 1.0, "p99": 2.0, "max": 9.0}, pooled
    assert pooled["abort_ms_p99_per_storm"] == [2.0, 0.5], pooled
    assert pooled["upstream_close_ms_p99_per_storm"] == [1.0, 1.0], pooled
    assert (pooled["storms"], pooled["closed"], pooled["aborted"]) == (2, 200, 200), pooled
    assert pooled["abort_calls"] == 202 and "samples" not in pooled, pooled


def _streams(ttft: float, itl: float) -> dict[str, Any]:
    def pct(v: float) -> dict[str, float]:
        return {"n": 10, "p50": v, "p90": v, "p99": 2 * v, "p100": 3 * v}
    return {"probe": {"ttft_ms": pct(ttft)},
            "main": {"itl_ms": pct(itl), "delivery_ms": pct(0.1), "errors": 0},
            "events_per_s": 100.0, "cpu_s": {"engine": 0.1, "client": 0.1, "proxy": 0.1}}


def test_report_has_a_row_per_path_and_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = ("direct", "sidecar", "nginx")
    sweep_level = _level(1000, 1000, 20000, 21.0) | {"held": True, "events": 3000,
                                                      "cpu_s": {"proxy": 0.3}}
    results: dict[str, Any] = {
        "clock": {"shared_monotonic_clock": True},
        "phases": {
            "streams": {p: {"1": _streams(0.2 + i, 20.0), "256": _streams(0.3 + i, 20.1)}
                        for i, p in enumerate(paths)},
            "sweep": {p: {"levels": [sweep_level], "max_held_per_s": 1000.0,
                          "cpu_rate_per_s": 1000.0, "cpu_s_per_100k": 10.0} for p in paths},
            "idle": {p: [{"streams": 10, "proxy": p, "open": 10, "errors": 0,
                          "rss_before": 2**20, "rss_open": 2**20 + 10240,
                          "per_stream_bytes": 1024.0}] for p in paths[1:]},
            "storm": {},
        },
        "vllm": {"measured": False, "notes": "not measured in this run"},
        "meta": {"date": "today", "duration_s": 1, "command": "python -m bench --quick",
                 "quick": True, "cores": 2, "cpu": "cpu", "kernel": "k", "python": "3.11",
                 "aiohttp": "3", "uvloop": "0", "nginx": "1", "nofile": 20000,
                 "interval_ms": 20.0, "tokens": 25, "streams": [1, 256], "workers": [1, 2],
                 "nginx_workers": 2, "sweep_streams": 20, "sweep_rates": [1000],
                 "sweep_s": 1.0, "cpu_rate": 1000, "idle": [10], "storm": 20, "close": "rst",
                 "storm_interval_ms": [20.0, 100.0]},
    }
    text = report.write(results, tmp_path)
    assert (tmp_path / "benchmarks.png").stat().st_size > 0, "expected the plot written"
    assert (tmp_path / "benchmarks.md").read_text() == text
    for path in paths:
        assert f"| {path} | 256 |" in text, f"expected a latency row for {path} at N=256"
    assert "| added TTFT p50 <= 0.5 ms at 256 streams | 1.000 ms | **not met** |" in text
    assert "not measured in this run" in text


def _request(query: str) -> bytes:
    body = b'{"model": "m", "stream": true, "messages": []}'
    return (f"POST /v1/chat/completions?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _read_stream(sock: socket.socket) -> bytes:
    """One chunked response off ``sock``: its decoded body."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    decoder = ChunkedDecoder()
    body = decoder.feed(rest)
    while not decoder.done:
        data = sock.recv(65536)
        assert data, "expected the stream's last chunk before the close"
        body += decoder.feed(data)
    return body


@pytest.mark.parametrize("downstream", ["raw", "aiohttp"])
async def test_floor_relays_streams_and_aborts_a_client_that_left(
        tmp_path: Path, downstream: str) -> None:
    engine = await start_engine(tmp_path)
    floor = await start_floor(tmp_path, engine.port, downstream)
    try:
        def streams_then_reset() -> None:
            with socket.create_connection(("127.0.0.1", floor.port), timeout=10) as sock:
                for tag in ("a", "b"):  # the second on the same kept-alive connection
                    sock.sendall(_request(f"mode=stream&tokens=5&interval_us=2000&s={tag}"))
                    body = _read_stream(sock)
                    assert body.count(b"data: {") == 5, body
                    assert body.endswith(b"data: [DONE]\n\n"), body[-40:]
            sock = socket.create_connection(("127.0.0.1", floor.port), timeout=10)
            sock.sendall(_request("mode=idle&s=gone&rec=1"))
            seen = b""
            while b"data: {" not in seen:  # the head and the first event
                data = sock.recv(65536)
                assert data, "expected the idle stream's first event"
                seen += data
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # RST

        await asyncio.to_thread(streams_then_reset)
        for _ in range(100):  # up to 5 s
            _, records = await http_get(engine.port, "/bench/records")
            aborted = {i for _, ids in records["aborts"] for i in ids}
            closed = {tag for tag, _ in records["closes"]}
            if "gone" in closed and aborted:
                break
            await asyncio.sleep(0.05)
        ids = records["request_ids"]
        assert len({ids["a"], ids["b"], ids["gone"]}) == 3, ids
        assert aborted == {f"chatcmpl-{ids['gone']}"}, "expected only the gone stream aborted"
        assert "gone" in closed, "expected its upstream connection closed"
    finally:
        await floor.stop()
        await engine.stop()


@pytest.mark.parametrize("events", [[], ["--tokens", "5", "--interval-us", "500"]],
                         ids=["one-token", "five-events"])
def test_ab_serves_every_probe_of_both_checkouts(events: list[str]) -> None:
    """``python -m bench.ab``: both sidecars answer every request (one token, or five events with
    ``--tokens``), and the table says so for each (here the same checkout twice)."""
    out = subprocess.run([sys.executable, "-m", "bench.ab", ".", ".", "--requests", "40",
                          "--rounds", "2", "--warmup", "5", "--pause-ms", "4", *events],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 0 |")
            or line.startswith("| 1 |")]
    assert len(rows) == 4 and all("| 40 (0 errors) |" in row for row in rows), out
    assert out.count("B - A ") == 3, out
