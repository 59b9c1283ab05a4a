"""Slow clients: a client that stops reading, or reads slowly, is not a disconnect.

It is never aborted or counted as a disconnect, and it costs bounded memory: the sidecar's
writes wait once ``downstream.write_buffer_bytes`` are unsent, its relay reads the engine only
after a write, and the upstream session buffers at most ``READ_BUFFER_BYTES`` (twice that before
it stops reading the socket), so the engine's own writes wait. The figures (engine bytes written
while the client was stalled, the sidecar's RSS) are printed: run with ``-s``.

Streams have no total timeout: a stream much longer than every configured timeout completes.

The stalled-client test runs the real CLI as a subprocess (:mod:`tests.harness.cli_process`) to
read the sidecar's own RSS; the fake engine (in this process) floods as fast as the connection takes
it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine, Flood, flood_sha256
from tests.harness import rawhttp
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.support import disconnect_counts, metrics, no_event, settle

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
FLOOD_BYTES = 256 * MIB  # what the engine would stream if nothing held it back
STALL_S = 2.0  # how long the client stops reading
ENGINE_AHEAD_BOUND = 32 * MIB  # generous: loopback socket buffers hold several MiB per side
RSS_GROWTH_BOUND = 64 * MIB  # generous: unbounded buffering would hold ~FLOOD_BYTES
GUARD_S = 60.0  # bound on relaying FLOOD_BYTES on a loaded 2-CPU machine

StartSidecar = Callable[..., Any]


async def read_chunked(reader: asyncio.StreamReader, digest: Any) -> tuple[int, str]:
    """De-chunk the rest of a chunked body from ``reader`` into ``digest`` (a hashlib object).
    Returns (body bytes, ending: ``complete`` | ``eof`` | ``reset``)."""
    size_total = 0
    try:
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            data = await reader.readexactly(size + 2)
            digest.update(memoryview(data)[:-2])
            size_total += size
        await reader.readuntil(b"\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return size_total, "eof"
    except ConnectionResetError:
        return size_total, "reset"
    return size_total, "complete"


def flood_request(size: int) -> bytes:
    return rawhttp.request_bytes("GET", f"/flood?size={size}")


async def assert_no_abort_no_disconnect(engine: FakeEngine, proxy_port: int,
                                        admin_port: int) -> None:
    assert await no_event(engine.record.abort_event), (
        f"a slow reader is not a disconnect; got an abort of {engine.record.aborted_ids()}")
    await settle(proxy_port)
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborted_ids()}"
    counts = disconnect_counts(await metrics(admin_port))
    assert counts == {}, f"a slow reader is not a disconnect, got {counts}"


async def test_stalled_reader_holds_the_engine_back_then_gets_every_byte(
        engine: FakeEngine, tmp_path: Path) -> None:
    tree = config_tree(engine.url, log_level="INFO")
    async with cli_process(tmp_path, tree) as cli:
        sidecar = psutil.Process(cli.proc.pid)
        # Warm up (imports, buffers, the pool) so the baseline is the sidecar at work.
        async with asyncio.timeout(GUARD_S), rawhttp.connect(cli.proxy_port) as (reader, writer):
            writer.write(flood_request(4 * MIB))
            await rawhttp.read_head(reader)
            await read_chunked(reader, hashlib.sha256())
        engine.flood = Flood()  # the next /flood request reports here
        rss_before = sidecar.memory_info().rss

        digest = hashlib.sha256()
        async with asyncio.timeout(GUARD_S), rawhttp.connect(cli.proxy_port) as (reader, writer):
            writer.write(flood_request(FLOOD_BYTES))
            head = await rawhttp.read_head(reader)
            assert head.status == 200 and head.chunked, f"expected a chunked 200, got {head}"
            # Stop reading. The engine writes as fast as it can until everything in between
            # (the sidecar's buffers, four loopback socket buffers) is full.
            trace: list[tuple[float, int, int]] = []  # (s since stall, engine bytes, RSS)
            stalled_at = time.monotonic()
            while (now := time.monotonic()) - stalled_at < STALL_S:
                trace.append((now - stalled_at, engine.flood.written, sidecar.memory_info().rss))
                await asyncio.sleep(0.1)  # sampling pace, not synchronisation
            ahead, rss_stalled = engine.flood.written, sidecar.memory_info().rss
            rss_peak = max([rss_stalled, *(r for _, _, r in trace)])
            assert not engine.flood.finished and not engine.flood.closed, (
                "the engine should still be streaming, held back by the stalled client")
            # Resume: every byte arrives, identical, through the terminator.
            size, ending = await read_chunked(reader, digest)
        rss_after = sidecar.memory_info().rss
        at_1s = next((w for t, w, _ in trace if t >= 1.0), ahead)
        print(f"\n[stalled reader] engine wrote {ahead / MIB:.1f} MiB of {FLOOD_BYTES / MIB:.0f}"
              f" MiB while the client read nothing for {STALL_S:.0f} s ({at_1s / MIB:.1f} MiB"
              f" after 1 s); sidecar RSS {rss_before / MIB:.1f} MiB before, peak"
              f" {rss_peak / MIB:.1f} MiB while stalled (+{(rss_peak - rss_before) / MIB:.1f}"
              f" MiB), {rss_after / MIB:.1f} MiB after")
        length, sha = flood_sha256(FLOOD_BYTES)
        assert (size, ending) == (length, "complete"), (
            f"expected {length} bytes ending with the terminating chunk, got {size} ({ending})")
        assert digest.hexdigest() == sha, "the client got different bytes from the engine's"
        assert engine.flood.finished, "the engine should have finished its stream"
        assert ahead < ENGINE_AHEAD_BOUND, (
            f"the engine wrote {ahead / MIB:.1f} MiB while the client read nothing; expected "
            f"< {ENGINE_AHEAD_BOUND / MIB:.0f} MiB (backpressure should stop its writes)")
        assert rss_peak - rss_before < RSS_GROWTH_BOUND, (
            f"sidecar RSS grew {(rss_peak - rss_before) / MIB:.1f} MiB while a client stalled; "
            f"expected < {RSS_GROWTH_BOUND / MIB:.0f} MiB")
        await assert_no_abort_no_disconnect(engine, cli.proxy_port, cli.admin_port)


async def test_slow_reader_is_never_cut(engine: FakeEngine, start_sidecar: StartSidecar) -> None:
    """About 300 KB/s for a few seconds, through a small write buffer."""
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, downstream={"write_buffer_bytes": 65536}))
    size, raw = 1 * MIB, b""
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(flood_request(size))
        head = await rawhttp.read_head(reader)
        while not raw.endswith(b"\r\n0\r\n\r\n") and (data := await reader.read(32768)):
            raw += data
            await asyncio.sleep(0.1)  # the reading pace under test, not synchronisation
    took = time.monotonic() - started
    body = asyncio.StreamReader()
    body.feed_data(raw)
    body.feed_eof()
    digest = hashlib.sha256()
    got, ending = await read_chunked(body, digest)
    length, sha = flood_sha256(size)
    print(f"\n[slow reader] {got} bytes in {took:.1f} s ({got / took / 1000:.0f} KB/s), {ending}")
    assert head.status == 200 and (got, ending) == (length, "complete"), (
        f"expected {length} bytes and the terminating chunk, got {head.status} {got} {ending}")
    assert digest.hexdigest() == sha, "the slow reader got different bytes from the engine's"
    assert took > 2.0, f"the client should have read slowly for seconds, took {took:.1f} s"
    await assert_no_abort_no_disconnect(engine, servers.proxy_port, servers.admin_port or 0)


async def test_long_stream_is_never_cut_by_short_timeouts(engine: FakeEngine,
                                                          start_sidecar: StartSidecar) -> None:
    """Every timeout at 0.5-1 s: a request whose body trickles in, a first byte after 0.5 s and
    a stream of 3 s complete byte for byte (no total timeout anywhere)."""
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url,
        downstream={"body_timeout_s": 0.5, "idle_timeout_s": 0.5},
        upstream={"first_byte_timeout_s": 1.0, "read_timeout_s": 0.5}))
    tokens, interval = 30, 0.1
    body = json.dumps({"messages": [], "stream": True}).encode()
    started = time.monotonic()
    async with asyncio.timeout(GUARD_S), rawhttp.connect(servers.proxy_port) as (reader, writer):
        writer.write(rawhttp.request_bytes(
            "POST", f"/v1/chat/completions?tokens={tokens}&interval={interval}"
            "&first_byte_delay=0.5", [("Content-Length", str(len(body)))]))
        for part in (body[:10], body[10:]):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.25)  # the upload pace under test, not synchronisation
        resp = await rawhttp.read_body(reader, await rawhttp.read_head(reader))
    took = time.monotonic() - started
    rid = resp.get("X-Request-Id")
    expected = b"".join(b'data: {"id":"%s","choices":[{"text":"t%d"}]}\n\n' % (rid.encode(), i)
                        for i in range(tokens)) + b"data: [DONE]\n\n" if rid else b""
    assert resp.status == 200 and resp.ending == "complete", (
        f"expected a complete 200 stream, got {resp.status} ending {resp.ending}")
    assert resp.body == expected, (
        f"expected the engine's {tokens} events and [DONE] byte for byte, got {resp.body!r}")
    assert took > tokens * interval, f"the stream should take > {tokens * interval}s: {took:.2f}s"
    await assert_no_abort_no_disconnect(engine, servers.proxy_port, servers.admin_port or 0)
