"""The cancel API with ``--workers 2``: the supervisor's admin listener checks the token and asks
every worker over its control listener (a Unix socket in the supervisor's 0700 run directory);
the worker holding the request cancels it exactly as a single process does
(``tests/test_cancel_api.py``).

Everything runs as production does: the real CLI in a subprocess (:mod:`tests.harness.cli_process`),
:class:`tests.fakes.engine.FakeEngine`, raw-socket clients. Which worker holds a request is read
from the sockets (psutil): each streaming request holds one upstream connection to the engine,
owned by the worker process serving it. ``test_cancel_latency_*`` prints the cancel call's
latency through the supervisor and in one process (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from sidecar.server import ReadyLine
from tests.fakes.engine import FakeEngine, Generation
from tests.harness import rawhttp
from tests.harness.cli_process import REPO, cli_process, config_tree

pytestmark = pytest.mark.timeout(90)

WAIT_S = 10.0
QUIET_S = 0.3  # how long to wait for an abort that must NOT come
TOKEN = "workers-cancel-sekret-8765"
CHAT = "/v1/chat/completions"
STREAM = f"{CHAT}?tokens=100000&interval=0.02"  # far longer than any test
CANCELLED_EVENT = (b'data: {"error": {"message": "request cancelled", "type": "cancelled", '
                   b'"param": null, "code": null}}\n\n')
MIN_STREAMS, MAX_STREAMS = 8, 40  # open streams until both workers hold 2, within these
WORKER_ANSWER_S = 12.0  # sidecar.cancel.WORKER_ANSWER_S: how long a silent worker is waited for
LATENCY_N = 50

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter, str]


def chat_body(stream: bool) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": stream}).encode()


async def cancel(session: aiohttp.ClientSession, admin_port: int, request_id: str,
                 token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(f"http://127.0.0.1:{admin_port}/v1/requests/{request_id}/cancel",
                            headers=headers) as r:
        return r.status, await r.json()


async def open_stream(stack: AsyncExitStack, proxy_port: int) -> Stream:
    """A streaming chat on a connection of its own, read up to its first event."""
    reader, writer = await stack.enter_async_context(rawhttp.connect(proxy_port))
    body = chat_body(stream=True)
    writer.write(rawhttp.request_bytes(
        "POST", STREAM, [("Content-Type", "application/json"),
                         ("Content-Length", str(len(body)))], body))
    head = await rawhttp.read_head(reader)
    request_id = head.get("X-Request-Id")
    assert head.status == 200 and head.chunked and request_id, f"expected a chunked 200: {head}"
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    first = await reader.readexactly(size + 2)
    assert first.startswith(b"data: "), first
    return reader, writer, request_id


async def read_to_end(reader: asyncio.StreamReader) -> rawhttp.RawResponse:
    """The rest of a chunked 200 whose head was already read."""
    head = rawhttp.RawResponse("HTTP/1.1", 200, "OK", [("Transfer-Encoding", "chunked")])
    return await rawhttp.read_body(reader, head, "POST")


def engine_port(engine: FakeEngine) -> int:
    return int(engine.url.rsplit(":", 1)[1].rstrip("/"))


def upstream_connections(workers: list[psutil.Process], engine: FakeEngine) -> dict[int, int]:
    """Established connections to the engine carrying a request now, per worker pid (not the
    workers' warm abort connections: the engine tells which of its connections serve one)."""
    assert engine.runner is not None and engine.runner.server is not None
    busy = {c.transport.get_extra_info("peername")[1] for c in engine.runner.server.connections
            if c._current_request is not None and c.transport is not None}
    port = engine_port(engine)
    return {w.pid: sum(1 for c in w.net_connections("tcp")
                       if c.raddr and c.raddr.port == port and c.laddr.port in busy
                       and c.status == psutil.CONN_ESTABLISHED)
            for w in workers}


async def until(predicate: Callable[[], bool], what: str, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"expected {what} within {within_s} s"
        await asyncio.sleep(0.02)


def all_sent_more(generations: dict[str | None, Generation], before: dict[str, int]) -> bool:
    """Every request in ``before`` got more events from the engine than it had then."""
    return all(generations[rid].events_sent > sent for rid, sent in before.items())


async def test_cancel_through_the_supervisor_reaches_streams_on_every_worker(
        engine: FakeEngine, tmp_path: Path) -> None:
    tree = config_tree(engine.url, admin={"host": "127.0.0.1", "port": 0, "cancel_token": TOKEN})
    async with (cli_process(tmp_path, tree, "--workers", "2") as cli, AsyncExitStack() as stack,
                aiohttp.ClientSession() as admin, asyncio.timeout(60)):
        workers = psutil.Process(cli.proc.pid).children()
        assert len(workers) == 2, f"expected 2 worker processes, got {workers}"
        streams: list[Stream] = []
        held: dict[int, int] = {}
        while len(streams) < MAX_STREAMS:  # the kernel spreads new connections (SO_REUSEPORT)
            streams.append(await open_stream(stack, cli.proxy_port))
            held = upstream_connections(workers, engine)
            if len(streams) >= MIN_STREAMS and min(held.values()) >= 2:
                break
        print(f"[workers-cancel] {len(streams)} streams, per worker pid: {held}")
        assert min(held.values()) >= 2, f"expected both workers to hold 2 streams, got {held}"
        generations = {g.request_id: g for g in engine.record.generations}
        ids = [request_id for _, _, request_id in streams]
        assert set(generations) == set(ids), f"expected the engine to run {ids}"

        for token in (None, "wrong", TOKEN + "x"):  # the supervisor checks the token
            status, answer = await cancel(admin, cli.admin_port, ids[0], token)
            assert (status, answer["error"]["type"]) == (401, "unauthorized"), (token, answer)

        for i, (reader, _, request_id) in enumerate(streams):
            others = {rid: generations[rid].events_sent for rid in ids[i + 1:]}
            status, answer = await cancel(admin, cli.admin_port, request_id, TOKEN)
            assert (status, answer) == (200, {"id": request_id, "cancelled": True,
                                              "phase": "streaming"}), (i, status, answer)
            rest = await read_to_end(reader)
            assert rest.ending == "complete", f"stream {i}: expected a proper end, got {rest}"
            assert rest.body.endswith(CANCELLED_EVENT), (
                f"stream {i}: expected the error event last, got {rest.body[-200:]!r}")
            assert b"[DONE]" not in rest.body, f"stream {i}: a cancelled stream got [DONE]"
            await until(partial(all_sent_more, generations, others),
                        f"the {len(others)} other streams to keep going after cancel {i}")
            still = [r for r in others if generations[r].stopped_at is not None]
            assert still == [], f"cancel {i} stopped other streams: {still}"

        expected = sorted(f"chatcmpl-{rid}" for rid in ids)
        await until(lambda: len(engine.record.aborted_ids()) >= len(ids), f"{len(ids)} aborts")
        await asyncio.sleep(QUIET_S)  # no abort may follow
        assert sorted(engine.record.aborted_ids()) == expected, (
            f"expected each id aborted exactly once, got {engine.record.aborted_ids()}")
        running = [g.request_id for g in engine.record.generations if g.stopped_at is None]
        assert running == [], f"expected every generation stopped (aborted), got {running}"

        second = await cancel(admin, cli.admin_port, ids[0], TOKEN)
        unknown = await cancel(admin, cli.admin_port, "0" * 32, TOKEN)
    assert (second[0], second[1]["error"]["type"]) == (404, "not_found"), second
    assert (unknown[0], unknown[1]["error"]["type"]) == (404, "not_found"), unknown
    assert TOKEN not in cli.stderr, "the cancel token must never be logged"


async def test_cancel_through_the_supervisor_non_streaming_gets_499(
        engine: FakeEngine, tmp_path: Path) -> None:
    url_path = f"{CHAT}?tokens=2000&interval=0.01"  # 20 s before the engine would answer
    count = 4
    async with (cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                aiohttp.ClientSession() as admin, asyncio.timeout(60)):
        calls = [asyncio.ensure_future(s.post(f"http://127.0.0.1:{cli.proxy_port}{url_path}",
                                              data=chat_body(stream=False)))
                 for _ in range(count)]
        await until(lambda: len(engine.record.generations) == count, f"{count} generations")
        ids = [g.request_id for g in engine.record.generations]
        answers = [await cancel(admin, cli.admin_port, str(rid)) for rid in ids]
        responses = {r.headers["X-Request-Id"]: (r.status, (await r.json())["error"]["type"])
                     for r in await asyncio.gather(*calls)}
        await until(lambda: len(engine.record.aborted_ids()) >= count, f"{count} aborts")
        await asyncio.sleep(QUIET_S)
    assert answers == [(200, {"id": rid, "cancelled": True, "phase": "awaiting_response"})
                       for rid in ids], answers
    assert responses == {rid: (499, "cancelled") for rid in ids}, responses
    assert sorted(engine.record.aborted_ids()) == sorted(f"chatcmpl-{rid}" for rid in ids), (
        f"expected each id aborted exactly once, got {engine.record.aborted_ids()}")


def control_path(worker: psutil.Process) -> Path:
    args = worker.cmdline()
    return Path(args[args.index("--worker-control") + 1])


async def test_control_sockets_are_unix_only_in_a_private_directory_removed_at_exit(
        engine: FakeEngine, tmp_path: Path) -> None:
    async with cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli:
        supervisor = psutil.Process(cli.proc.pid)
        workers = supervisor.children()
        paths = [control_path(w) for w in workers]
        run_dir = paths[0].parent
        mode = stat.S_IMODE(run_dir.stat().st_mode)
        owner = run_dir.stat().st_uid
        sockets = {p.name: stat.S_ISSOCK(p.stat().st_mode) for p in paths}
        # A Unix socket's laddr is its path, a str (types-psutil types it as an address tuple).
        unix: dict[int, set[object]] = {
            w.pid: {c.laddr for c in w.net_connections("unix")} for w in workers}
        tcp_listening = {p.pid: {c.laddr.port for c in p.net_connections("inet")
                                 if c.status == psutil.CONN_LISTEN}
                         for p in (supervisor, *workers)}
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(paths[0]))) as s:
            async with s.post("http://w/v1/requests/x/cancel") as r:  # no token asked here
                control_answer = r.status
            async with s.get("http://w/metrics") as r:
                control_metrics = r.status
        cli.signal(signal.SIGTERM)
        code = await cli.wait_exit()
    assert len(set(paths)) == 2 and all(p.parent == run_dir for p in paths), paths
    assert mode == 0o700, f"expected the run directory mode 0700, got {oct(mode)}"
    assert owner == psutil.Process().uids().real, "expected the run directory to be ours"
    assert sockets == {p.name: True for p in paths}, f"expected Unix sockets, got {sockets}"
    for worker, path in zip(workers, paths, strict=True):
        assert str(path) in unix[worker.pid], f"worker {worker.pid} should listen on {path}"
    expected_tcp = {supervisor.pid: {cli.admin_port},
                    **{w.pid: {cli.proxy_port} for w in workers}}
    assert tcp_listening == expected_tcp, (
        f"nothing may listen on TCP beyond the config's two ports: {tcp_listening}")
    assert (control_answer, control_metrics) == (404, 404), (
        "the control listener serves the cancel API only")
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"
    assert not run_dir.exists(), f"expected {run_dir} removed at exit"


async def test_a_stopped_worker_neither_hides_nor_delays_a_request_found_on_another(
        engine: FakeEngine, tmp_path: Path) -> None:
    """SIGSTOP one worker (its control socket accepts, never answers): a request on the other
    is found at once; an id found nowhere is 502 after ``WORKER_ANSWER_S``, not 404, as the
    stopped worker may hold it."""
    async with (cli_process(tmp_path, config_tree(engine.url), "--workers", "2") as cli,
                AsyncExitStack() as stack, aiohttp.ClientSession() as admin,
                asyncio.timeout(60)):
        workers = psutil.Process(cli.proc.pid).children()
        reader, _, request_id = await open_stream(stack, cli.proxy_port)
        held = upstream_connections(workers, engine)
        holder = next(pid for pid, n in held.items() if n)
        stopped = next(w for w in workers if w.pid != holder)
        stopped.suspend()
        try:
            started = time.monotonic()
            found = await cancel(admin, cli.admin_port, request_id)
            found_s = time.monotonic() - started
            rest = await read_to_end(reader)
            started = time.monotonic()
            unknown = await cancel(admin, cli.admin_port, "0" * 32)
            unknown_s = time.monotonic() - started
        finally:
            stopped.resume()
        after = await cancel(admin, cli.admin_port, "0" * 32)
    assert found == (200, {"id": request_id, "cancelled": True, "phase": "streaming"}), found
    assert found_s < 2.0, f"expected the found answer without waiting, took {found_s:.2f} s"
    assert rest.body.endswith(CANCELLED_EVENT), rest.body[-200:]
    assert (unknown[0], unknown[1]["error"]["type"]) == (502, "worker_unreachable"), unknown
    assert f"worker {stopped.pid}" in unknown[1]["error"]["message"], unknown
    assert WORKER_ANSWER_S - 1 < unknown_s < WORKER_ANSWER_S + 3, (
        f"expected the stopped worker waited for ~{WORKER_ANSWER_S} s, took {unknown_s:.2f} s")
    assert after[0] == 404, f"expected 404 once the worker runs again, got {after}"


async def test_cancel_while_stopping_skips_the_worker_that_already_exited(
        engine: FakeEngine, tmp_path: Path) -> None:
    """SIGTERM with one stream in flight: the idle worker exits at once, the other drains (grace
    period 20 s). The exited worker is not asked (an unknown id is 404, not 502), and the stream
    is still cancellable through the supervisor, which then exits 0."""
    tree = config_tree(engine.url, grace_s=20.0)
    async with (cli_process(tmp_path, tree, "--workers", "2") as cli, AsyncExitStack() as stack,
                aiohttp.ClientSession() as admin, asyncio.timeout(60)):
        workers = psutil.Process(cli.proc.pid).children()
        reader, _, request_id = await open_stream(stack, cli.proxy_port)
        held = upstream_connections(workers, engine)
        idle = next(w for w in workers if not held[w.pid])
        cli.signal(signal.SIGTERM)
        await asyncio.to_thread(idle.wait, WAIT_S)
        unknown = await cancel(admin, cli.admin_port, "0" * 32)
        found = await cancel(admin, cli.admin_port, request_id)
        rest = await read_to_end(reader)
        code = await cli.wait_exit()
    assert (unknown[0], unknown[1]["error"]["type"]) == (404, "not_found"), (
        f"expected the exited worker not asked, got {unknown}")
    assert found == (200, {"id": request_id, "cancelled": True, "phase": "streaming"}), found
    assert rest.body.endswith(CANCELLED_EVENT), rest.body[-200:]
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"
    assert engine.record.aborted_ids() == [f"chatcmpl-{request_id}"], engine.record.aborts


@pytest.mark.parametrize("record", [True, False], ids=["with a record", "no record"])
async def test_a_killed_worker_s_ids_are_answered_from_its_record(
        engine: FakeEngine, tmp_path: Path, record: bool) -> None:
    """A worker killed by SIGKILL (the OOM killer) takes its requests with it, and the
    supervisor aborts them from the worker's record of in-flight work (:mod:`sidecar.inflight`):
    the cancel API then answers 200 ``worker_died`` for each of them, and 404 for an id no
    worker had, while the surviving worker drains (grace 20 s); an id on the survivor is still
    found (200). Without a record (``lifecycle.record_dir: null``) the supervisor cannot tell
    whether an id was the dead worker's: an id no live worker has is 502
    ``worker_unreachable``, not 404 (before the record, always so)."""
    tree = config_tree(engine.url, grace_s=20.0)
    if not record:
        tree["lifecycle"]["record_dir"] = None
    async with (cli_process(tmp_path, tree, "--workers", "2") as cli, AsyncExitStack() as stack,
                aiohttp.ClientSession() as admin, asyncio.timeout(60)):
        workers = psutil.Process(cli.proc.pid).children()
        streams: list[Any] = []
        while not all(upstream_connections(workers, engine).values()):
            assert len(streams) < 16, "the kernel put every connection on one worker"
            streams.append(await open_stream(stack, cli.proxy_port))
        held = upstream_connections(workers, engine)
        victim = workers[0]
        victim.kill()
        await asyncio.to_thread(victim.wait, WAIT_S)
        unknowns: list[tuple[int, dict[str, Any]]] = []
        if record:
            # Asked again and again while the replacement starts: a worker whose control socket
            # is not bound yet has taken no request, so the answer stays 404.
            after = await cli.wait_log("starting a replacement", WAIT_S)
            while len(unknowns) < 5000:
                unknowns.append(await cancel(admin, cli.admin_port, "0" * 32))
                if any("replaces worker" in line for line in cli.stderr_lines[after:]):
                    break
        unknown = await cancel(admin, cli.admin_port, "0" * 32)
        answers = [await cancel(admin, cli.admin_port, rid) for _, _, rid in streams]
    found = [a for a in answers if a[0] == 200 and not a[1].get("worker_died")]
    assert found, answers
    if record:
        assert unknown[0] == 404, unknown
        assert all(a[0] == 404 for a in unknowns), (
            f"an id no worker has, asked {len(unknowns)} times while the replacement started: "
            f"{[a for a in unknowns if a[0] != 404][:3]}")
        died = [a for a in answers if a[0] == 200 and a[1].get("worker_died")]
        assert len(died) == held[victim.pid] and len(found) + len(died) == len(answers), (
            held, answers)
        return
    assert (unknown[0], unknown[1]["error"]["type"]) == (502, "worker_unreachable"), unknown
    unreachable = [a for a in answers if a[0] == 502]
    assert unreachable and len(found) + len(unreachable) == len(answers), answers
    assert len(unreachable) == held[victim.pid], (held, answers)


async def test_without_an_admin_listener_workers_get_no_control_socket(
        engine: FakeEngine, tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(config_tree(engine.url, admin=None)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "--config", str(config), "--workers", "2", cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
        workers = psutil.Process(proc.pid).children()
        args = [w.cmdline() for w in workers]
        unix = [c.laddr for w in workers for c in w.net_connections("unix") if c.laddr]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), WAIT_S)
    ready = ReadyLine.parse(line.decode())
    assert ready is not None and not ready.worker and ready.admin is None, line
    assert len(args) == 2 and not any("--worker-control" in a for a in args), args
    assert unix == [], f"expected no Unix listener without an admin listener, got {unix}"
    assert code == 0, f"expected exit 0, got {code}"


async def test_a_run_directory_too_long_for_a_unix_socket_path_fails_the_start(
        engine: FakeEngine, tmp_path: Path) -> None:
    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(config_tree(engine.url)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "--config", str(config), "--workers", "2", cwd=REPO,
        env={**os.environ, "TMPDIR": str(long_tmp)}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 1, f"expected exit 1, got {proc.returncode}: {stderr.decode()}"
    assert b"set TMPDIR to a shorter directory" in stderr, stderr.decode()
    assert stdout == b"", f"expected no ready line, got {stdout!r}"
    assert list(long_tmp.iterdir()) == [], "expected the run directory removed"


def summary(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98]
    return f"median {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms (n={len(ms)})"


async def cancel_latency(engine: FakeEngine, tmp_path: Path, *args: str
                         ) -> tuple[list[float], list[float]]:
    """Seconds per cancel call: ``LATENCY_N`` streams in flight, then as many unknown ids."""
    found: list[float] = []
    unknown: list[float] = []
    async with (cli_process(tmp_path, config_tree(engine.url), *args) as cli,
                AsyncExitStack() as stack, aiohttp.ClientSession() as admin):
        streams = [await open_stream(stack, cli.proxy_port) for _ in range(LATENCY_N)]
        await cancel(admin, cli.admin_port, "f" * 32)  # warm: the admin keep-alive connection
        for reader, _, request_id in streams:
            started = time.perf_counter()
            status, _ = await cancel(admin, cli.admin_port, request_id)
            found.append(time.perf_counter() - started)
            assert status == 200, f"expected 200 for {request_id}, got {status}"
            await read_to_end(reader)
        for _ in range(LATENCY_N):
            started = time.perf_counter()
            status, _ = await cancel(admin, cli.admin_port, "0" * 32)
            unknown.append(time.perf_counter() - started)
            assert status == 404, f"expected 404, got {status}"
        cli.signal(signal.SIGTERM)
        await cli.wait_exit()
    return found, unknown


async def test_cancel_latency_through_the_supervisor_vs_one_process(
        engine: FakeEngine, tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    async with asyncio.timeout(80):
        one = await cancel_latency(engine, tmp_path / "one")
        two = await cancel_latency(engine, tmp_path / "two", "--workers", "2")
    for name, (found, unknown) in (("one process", one), ("--workers 2", two)):
        print(f"[cancel latency] {name:12} found (200): {summary(found)}; "
              f"unknown (404): {summary(unknown)}")
    slowest = max(max(two[0]), max(two[1]))
    assert slowest < 2.0, f"expected every cancel through the supervisor < 2 s, max {slowest:.2f}"
