"""``--workers 2``: two proxy processes share the port, the supervisor's admin listener sums
their metrics, and SIGTERM stops them all with exit 0.

Which worker served a request is read from the sockets: the fake engine records the upstream-side
client port of every ``/peer`` request, and each worker process owns the pooled upstream
connection with that local port (psutil). The ``/metrics`` totals come from prometheus-client's
multiprocess files, summed by the supervisor.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.workers import MAX_DEATHS
from tests.fakes.engine import FakeEngine, _sse
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.rawhttp import dechunk

pytestmark = pytest.mark.timeout(60)

REQUESTS = 40
WAIT_S = 10.0


async def requests_total(admin_port: int) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
            text = await resp.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "cancel_sidecar_requests"
               for sample in family.samples if sample.name == "cancel_sidecar_requests_total")


async def test_two_workers_share_the_port_and_the_metrics_add_up(
        engine: FakeEngine, tmp_path: Path) -> None:
    async with cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli:
        workers = psutil.Process(cli.proc.pid).children()
        assert len(workers) == 2, f"expected 2 worker processes, got {workers}"
        # A new downstream connection per request: the kernel spreads them over the workers.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(REQUESTS):
                async with session.get(f"http://127.0.0.1:{cli.proxy_port}/peer") as resp:
                    assert resp.status == 200, f"expected 200, got {resp.status}"
        served = {w.pid: {c.laddr.port for c in w.net_connections("tcp")} & set(engine.peers)
                  for w in workers}
        # Counters are written by each worker as its handler ends, possibly just after the
        # client read the response: wait (bounded) for the total to arrive.
        deadline = time.monotonic() + WAIT_S
        while (total := await requests_total(cli.admin_port)) < REQUESTS:
            assert time.monotonic() < deadline, (
                f"expected {REQUESTS} requests in /metrics within {WAIT_S} s, got {total}")
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{cli.admin_port}/healthz") as resp:
                health = resp.status
            async with session.get(f"http://127.0.0.1:{cli.admin_port}/readyz") as resp:
                ready = resp.status
        cli.signal(signal.SIGTERM)
        code = await cli.wait_exit()
        still = [w.pid for w in workers if w.is_running() and w.status() != "zombie"]
    print(f"[workers] upstream ports per worker pid: { {p: len(s) for p, s in served.items()} }")
    assert all(served.values()), f"expected both workers to serve requests, got {served}"
    assert total == REQUESTS, f"expected /metrics to total {REQUESTS} requests, got {total}"
    assert (health, ready) == (200, 200), f"expected /healthz and /readyz 200, got {health, ready}"
    assert code == 0, f"expected exit 0 after SIGTERM, got {code}; stderr:\n{cli.stderr}"
    assert still == [], f"expected every worker gone after the supervisor exits, got {still}"


async def test_workers_stop_when_the_supervisor_is_killed(
        engine: FakeEngine, tmp_path: Path) -> None:
    """SIGKILL to the supervisor (the OOM killer, ``kill -9``): the kernel sends each worker
    SIGTERM (PR_SET_PDEATHSIG), so each drains its in-flight stream for the grace period,
    aborts it, and exits; nothing is left serving on the port. Before, the workers served on,
    and a restarted sidecar shared the port with them."""
    tree = config_tree(engine.url, grace_s=1.0)
    async with cli_process(tmp_path, tree, "--workers", "2") as cli:
        workers = psutil.Process(cli.proc.pid).children()
        assert len(workers) == 2, f"expected 2 worker processes, got {workers}"
        reader, writer = await asyncio.open_connection("127.0.0.1", cli.proxy_port)
        body = b'{"messages": [], "stream": true}'
        writer.write(b"POST /v1/chat/completions?tokens=100000 HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await asyncio.wait_for(reader.readuntil(b"data:"), WAIT_S)
        cli.signal(signal.SIGKILL)
        _, alive = await asyncio.to_thread(psutil.wait_procs, workers, timeout=WAIT_S)
        for orphan in alive:  # a regression must fail the test, not leave a server behind
            orphan.kill()  # (nor the CLI's pipes open: the workers inherited them)
        await cli.wait_exit()
        assert alive == [], f"expected the workers to exit after the supervisor's death: {alive}"
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", cli.proxy_port)
    assert b"[DONE]" not in rest, "the drained stream must not claim success"
    await asyncio.wait_for(engine.record.abort_event.wait(), WAIT_S)
    rid = engine.record.generations[0].request_id
    assert engine.record.aborted_ids() == [f"chatcmpl-{rid}"], engine.record.aborted_ids()


def _workers(cli_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(cli_pid).children() if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


async def _replaced(cli_pid: int, dead: set[int], within_s: float) -> tuple[list[int], float]:
    """Wait until the supervisor has 2 live workers again, none of them in ``dead``; returns
    their pids and the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        pids = [p.pid for p in _workers(cli_pid)]
        if len(pids) == 2 and not set(pids) & dead:
            return pids, time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected a replacement worker within {within_s} s, workers "
                         f"{[p.pid for p in _workers(cli_pid)]}")


async def _peer(session: aiohttp.ClientSession, port: int) -> int:
    async with session.get(f"http://127.0.0.1:{port}/peer") as resp:
        await resp.read()
        return resp.status


async def test_a_killed_worker_is_replaced_while_the_other_serves_on(
        engine: FakeEngine, tmp_path: Path) -> None:
    """SIGKILL to one of two workers (the OOM killer): the supervisor starts a replacement on the
    same port within a few seconds; the other worker's streams reach their end byte-identical,
    the killed one's never claim success, new requests (a new connection each) are served
    throughout and then by the replacement too, and ``/metrics`` counts the replacement.
    Before, the supervisor stopped serving and exited 1."""
    tokens = 120  # 2.4 s at 20 ms: still running when the replacement is up
    async with cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli:
        workers = _workers(cli.proc.pid)
        assert len(workers) == 2, workers
        streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, int, bytes]] = []
        owners: dict[int, int] = {}
        while len(set(owners.values())) < 2:  # a stream on each worker
            assert len(streams) < 16, "the kernel put every connection on one worker"
            reader, writer = await asyncio.open_connection("127.0.0.1", cli.proxy_port)
            body = b'{"messages": [], "stream": true}'
            writer.write(b"POST /v1/chat/completions?tokens=%d&interval=0.02 HTTP/1.1\r\n"
                         b"Host: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (tokens, len(body), body))
            first = await asyncio.wait_for(reader.readuntil(b"data:"), WAIT_S)
            local = writer.get_extra_info("sockname")[1]
            owner = next(w.pid for w in workers for c in w.net_connections("tcp")
                         if c.raddr and c.raddr.port == local)
            owners[len(streams)] = owner
            streams.append((reader, writer, owner, first))
        victim = next(w for w in workers if w.pid == owners[0])
        victim.kill()
        await asyncio.to_thread(victim.wait, WAIT_S)
        died = time.monotonic()
        connector = aiohttp.TCPConnector(force_close=True)
        statuses: list[int] = []
        async with aiohttp.ClientSession(connector=connector) as session:
            replacing = asyncio.ensure_future(_replaced(cli.proc.pid, {victim.pid}, WAIT_S))
            while not replacing.done():  # served throughout, one new connection each
                statuses.append(await _peer(session, cli.proxy_port))
                await asyncio.sleep(0.02)
            pids, _ = await replacing
            (new,) = set(pids) - {w.pid for w in workers}
            served_by_new = None  # seconds from the death to the replacement's first request
            while served_by_new is None and time.monotonic() - died < WAIT_S:
                statuses.append(await _peer(session, cli.proxy_port))
                ports = {c.laddr.port for c in psutil.Process(new).net_connections("tcp")}
                if ports & set(engine.peers):
                    served_by_new = time.monotonic() - died
        rests = [await asyncio.wait_for(r.read(), WAIT_S) for r, _, _, _ in streams]
        for _, writer, _, _ in streams:
            writer.close()
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{cli.admin_port}/metrics") as resp:
            text = await resp.text()
        assert "starting a replacement" in cli.stderr, cli.stderr
    print(f"the replacement served a request {served_by_new:.2f} s after the worker's death; "
          f"{len(statuses)} requests meanwhile")
    assert statuses and set(statuses) == {200}, f"expected every request served: {statuses}"
    assert served_by_new is not None, f"expected the replacement serving within {WAIT_S} s"
    survivors = 0
    for (_, _, owner, first), rest in zip(streams, rests, strict=True):
        if owner == victim.pid:
            assert b"[DONE]" not in rest, "a killed worker's stream must not claim success"
            continue
        body = dechunk(first + rest)
        engine_id = json.loads(body.split(b"\n\n")[0].removeprefix(b"data: "))["id"]
        events = b"".join(_sse({"id": engine_id, "choices": [{"text": f"t{i}"}]})
                          for i in range(tokens)) + _sse("[DONE]")
        assert body == events, "the surviving worker's stream must reach its end unchanged"
        survivors += 1
    assert survivors, "expected a stream on the surviving worker"
    replaced = [s.value for f in text_string_to_metric_families(text)
                if f.name == "cancel_sidecar_workers_replaced" for s in f.samples
                if s.name == "cancel_sidecar_workers_replaced_total"]
    assert replaced == [1.0], f"expected one replacement counted, got {replaced}"


async def test_a_crash_loop_stops_the_sidecar_with_exit_1(
        engine: FakeEngine, tmp_path: Path) -> None:
    """Workers that keep dying: the first deaths are replaced; the MAX_DEATHS-th within the
    window stops the others and the sidecar exits 1, as a crash loop should."""
    async with cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli:
        dead: set[int] = set()
        for n in range(MAX_DEATHS):
            victim = _workers(cli.proc.pid)[0]
            victim.kill()
            dead.add(victim.pid)
            if n < MAX_DEATHS - 1:
                await _replaced(cli.proc.pid, dead, WAIT_S)
        code = await cli.wait_exit(WAIT_S)
        assert "crash loop" in cli.stderr, cli.stderr
    assert code == 1, f"expected exit 1 after a crash loop, got {code}"

