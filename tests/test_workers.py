"""``--workers 2``: two proxy processes share the port, the supervisor's admin listener sums
their metrics, and SIGTERM stops them all with exit 0.

Which worker served a request is read from the sockets: the fake engine records the upstream-side
client port of every ``/peer`` request, and each worker process owns the pooled upstream
connection with that local port (psutil). The ``/metrics`` totals come from prometheus-client's
multiprocess files, summed by the supervisor.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli_process import cli_process, config_tree
from tests.fake_engine import FakeEngine

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
