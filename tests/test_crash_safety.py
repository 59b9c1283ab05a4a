"""Crash safety: a killed sidecar process leaves no generation running (:mod:`sidecar.inflight`).

Through the CLI (``python -m sidecar``), in front of the vLLM fake of :mod:`tests.fakes.kinds`,
which generates blind to its connections (as vLLM behind a disconnect-hiding middleware): only
an abort stops a request. Mixed load runs all the time: streaming chats, JSON chats and 4-prompt
streaming completions, a third of them registered by the engine 300 ms after their body (inside
the registration window when the kill lands). "Stopped" is read at the engine (``Work``).

- ``test_a_killed_worker_s_work_stops_and_the_others_serve_on``: ``--workers 2``, SIGKILL to a
  random worker at a random instant, 20 trials (4 kills per sidecar, under the crash-loop
  limit): within 1 s of the kill, nothing runs at the engine but requests whose clients are
  still being served; the other worker's streams reach their end byte-identical; new requests
  are answered throughout (a connection the kernel had queued for the dead worker's listening
  socket is reset before any answer, as with any SO_REUSEPORT server, and tried again: counted,
  at most a quarter of the trials); a replacement serves within a few seconds; no id of a
  request whose client had its whole answer before the kill is ever named.
- ``test_a_killed_sidecar_s_work_stops_after_its_restart`` (one process, and ``--workers 2``
  with its whole process group killed): SIGKILL at a random instant, 20 trials each, then the
  same config started again: 2 s after it listens nothing runs at the engine; what completed
  before the kill is never named.
- ``test_a_worker_started_after_a_reload_writes_its_record_where_the_supervisor_reads``: a
  SIGHUP moves ``lifecycle.record_dir`` (restart-only), both workers are replaced, then one of
  the replacements is killed under load: its requests stop within 1 s (they ran on without
  ``--worker-pinned``: the replacement wrote its record in the new directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.kinds import VLLMEngine, stream_bytes
from tests.harness.cli_process import cli_process, config_tree
from tests.harness.rawhttp import dechunk

pytestmark = pytest.mark.timeout(600)

API_KEY = "crash-key"
TOKENS = 60  # at 20 ms: 1.2 s of generation once registered
INTERVAL = 0.02
LATE_REGISTER_S = 0.3  # a third of the requests: still registering when the kill lands
ROUTES: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, False),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, True),
]
TRIALS = 20
STOPPED_WITHIN_S = 1.0  # after a worker's death
QUIET_AFTER_RESTART_S = 2.0


@dataclass
class Client:
    """One load client: its tag, whether it got its whole answer (and when) or was cut."""

    tag: str
    stream: bool
    body: bytes = b""
    whole_at: float | None = None  # time.monotonic() when its whole answer was in
    cut: bool = False  # its connection ended before the whole answer
    engine_ids: list[str] = field(default_factory=list)


async def one_client(port: int, n: int, rng: random.Random, clients: list[Client]) -> None:
    path, body, stream = ROUTES[n % len(ROUTES)]
    tag = f"c{n}"
    late = n % 3 == 0
    query = f"tokens={TOKENS}&interval={INTERVAL}" + (
        f"&register_delay={LATE_REGISTER_S}" if late else "")
    payload = json.dumps({**body, "stream": stream, "tag": tag}).encode()
    client = Client(tag, stream)
    clients.append(client)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        client.cut = True
        return
    try:
        writer.write(b"POST %s?%s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), query.encode(), len(payload), payload))
        data = await reader.read()  # Connection: close: the end of the answer is the close
    except OSError:
        data = b""
    finally:
        writer.close()
    client.body = data
    whole = (b"data: [DONE]" in data if stream else
             data.startswith(b"HTTP/1.1 200") and data.rstrip().endswith(b"}"))
    if whole:
        client.whole_at = time.monotonic()
    else:
        client.cut = True


class Load:
    """Clients started one after another, ``gap_s`` apart, until stopped."""

    def __init__(self, port: int, seed: int, gap_s: float = 0.03) -> None:
        self.port = port
        self.rng = random.Random(seed)
        self.gap_s = gap_s
        self.clients: list[Client] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.n = 0
        self._runner: asyncio.Task[None] | None = None

    def start(self, first: int) -> None:
        self.n = first
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="load")

    async def _run(self) -> None:
        while True:
            task = asyncio.get_running_loop().create_task(
                one_client(self.port, self.n, self.rng, self.clients), name=f"load client {self.n}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.n += 1
            await asyncio.sleep(self.gap_s)

    async def stop(self) -> None:
        assert self._runner is not None
        self._runner.cancel()
        await asyncio.gather(self._runner, return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 30)


def tag_of(work: Any) -> str:
    body = work.body
    return str(body.get("tag", "")) if isinstance(body, dict) else ""


def named_ids(fake: VLLMEngine) -> set[str]:
    return {i for call in fake.calls for i in call.ids}


def completed_ids(fake: VLLMEngine, clients: list[Client], before: float) -> set[str]:
    """The engine ids of the requests whose client had its whole answer before ``before``."""
    whole = {c.tag for c in clients if c.whole_at is not None and c.whole_at < before}
    return {i for w in fake.works if tag_of(w) in whole for i in w.engine_ids}


def workers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children()
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


async def metric(admin_port: int, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(
            f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def tree(fake: VLLMEngine) -> dict[str, Any]:
    t = config_tree(fake.url, api_key=API_KEY, log_level="INFO")
    t["engines"]["local"]["abort"]["resend_window_s"] = 2.0  # the default; the helper's is 0
    return t


@pytest.fixture
async def fake() -> Any:
    engine = VLLMEngine(API_KEY, seed=7)
    await engine.start()
    yield engine
    await engine.stop()


async def test_a_killed_worker_s_work_stops_and_the_others_serve_on(
        fake: VLLMEngine, tmp_path: Path) -> None:
    rng = random.Random(25)
    trials = 0
    stop_times: list[float] = []
    replaced_in: list[float] = []
    served: list[int] = []
    resets: list[int] = []  # trials in which a new request's connection was reset unanswered
    n = 0
    while trials < TRIALS:
        run = tmp_path / f"run{trials}"
        run.mkdir()
        async with cli_process(run, tree(fake), "--workers", "2") as cli:
            load = Load(cli.proxy_port, seed=trials)
            load.start(n)
            logged = 0  # stderr lines read: each kill waits for its own replacement's line
            for _ in range(min(4, TRIALS - trials)):  # 5 deaths within 60 s: a crash loop
                await asyncio.sleep(rng.uniform(0.4, 1.0))
                victim = rng.choice(workers_of(cli.proc.pid))
                victim.kill()
                killed = time.monotonic()
                # New requests meanwhile: answered (a new connection each). One the kernel had
                # queued for the dead worker's listening socket is reset before any answer
                # (SO_REUSEPORT: an accept queue per worker), as with nginx's reuseport: nothing
                # was read from it, so it is tried again, and counted.
                statuses = []
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(force_close=True)) as session:
                    while time.monotonic() - killed < STOPPED_WITHIN_S:
                        try:
                            async with session.get(
                                    f"http://127.0.0.1:{cli.proxy_port}/v1/models") as r:
                                statuses.append(r.status)
                        except aiohttp.ClientConnectionError:
                            resets.append(trials)
                            continue
                        await asyncio.sleep(0.05)
                assert set(statuses) == {200}, f"trial {trials}: new requests got {statuses}"
                served.append(len(statuses))
                # Within 1 s of the kill nothing runs but what live clients are being served.
                live = {c.tag for c in load.clients if c.whole_at is None and not c.cut}
                running = {tag_of(w) for w in fake.works if w.running}
                orphaned = running - live
                assert not orphaned, (
                    f"trial {trials}: {len(orphaned)} request(s) of the dead worker still "
                    f"running {STOPPED_WITHIN_S} s after the kill: {sorted(orphaned)[:5]}")
                stopped = [w.stopped_at - killed for w in fake.works
                           if w.stopped_at is not None and w.stopped_at > killed]
                stop_times.extend(stopped)
                started = time.monotonic()
                while len(workers_of(cli.proc.pid)) < 2 or victim.pid in {
                        p.pid for p in workers_of(cli.proc.pid)}:
                    assert time.monotonic() - started < 10, "no replacement within 10 s"
                    await asyncio.sleep(0.05)
                logged = await cli.wait_log(f"replaces worker {victim.pid}", 10, after=logged)
                replaced_in.append(time.monotonic() - killed)
                named = named_ids(fake)
                done_before = completed_ids(fake, load.clients, killed)
                assert not named & done_before, (
                    f"trial {trials}: ids of requests completed before the kill were named: "
                    f"{sorted(named & done_before)[:5]}")
                trials += 1
            await load.stop()
            n = load.n
            # Every stream that reached its end (the other worker's too, across the kills):
            # byte-identical to what the engine sent.
            works = {tag_of(w): w for w in fake.works}
            chats = [c for c in load.clients if c.whole_at is not None and c.stream
                     and works[c.tag].path == "/v1/chat/completions"]
            assert chats, "expected streaming chats that reached their end"
            for c in chats:
                work = works[c.tag]
                assert dechunk(c.body) == stream_bytes(str(work.tag), TOKENS), (
                    f"{c.tag}: its stream was changed")
            recovered = await metric(cli.admin_port, "cancel_sidecar_recovered_requests_total",
                                     reason="worker_died")
            replaced = await metric(cli.admin_port, "cancel_sidecar_workers_replaced_total")
            assert replaced >= 1 and recovered >= 1, (replaced, recovered)
    stop_times.sort()
    print(f"{trials} worker kills: dead worker's requests stopped at the engine "
          f"p50 {stop_times[len(stop_times) // 2] * 1000:.0f} ms, max "
          f"{stop_times[-1] * 1000:.0f} ms after the kill ({len(stop_times)} requests); "
          f"replacement logged within {max(replaced_in):.2f} s (checked after the 1 s of "
          f"new requests); "
          f"{sum(served)} new requests meanwhile, all 200; {len(resets)} connection(s) reset "
          f"unanswered (queued for the dead worker), tried again")
    assert len(resets) <= TRIALS // 4, f"too many new connections reset: trials {resets}"


@pytest.mark.parametrize("how", ["one process", "process group of 2 workers"])
async def test_a_killed_sidecar_s_work_stops_after_its_restart(
        fake: VLLMEngine, tmp_path: Path, how: str) -> None:
    rng = random.Random(how)
    args = ("--workers", "2") if how.endswith("workers") else ()
    n = 0
    quiet_after: list[float] = []
    for trial in range(TRIALS):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        async with cli_process(run, tree(fake), *args) as cli:
            load = Load(cli.proxy_port, seed=trial)
            load.start(n)
            await asyncio.sleep(rng.uniform(0.3, 0.9))
            if args:  # a container's OOM kill on cgroup v2: every process at once
                pids = [cli.proc.pid, *(p.pid for p in workers_of(cli.proc.pid))]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            else:
                cli.proc.kill()
            killed = time.monotonic()
            await cli.proc.wait()
            await load.stop()
            n = load.n
        clients = load.clients
        (run / "again").mkdir()
        async with cli_process(run / "again", tree(fake), *args) as cli:
            listening = time.monotonic()
            await asyncio.sleep(QUIET_AFTER_RESTART_S)
            running = [tag_of(w) for w in fake.works if w.running]
            assert not running, (
                f"trial {trial}: {len(running)} request(s) of the killed sidecar still running "
                f"{QUIET_AFTER_RESTART_S} s after the restart listened: {running[:5]}")
            quiet_after.append(max((w.stopped_at for w in fake.works
                                    if w.stopped_at is not None and w.stopped_at > killed),
                                   default=listening) - listening)
            named = named_ids(fake)
            done_before = completed_ids(fake, clients, killed)
            assert not named & done_before, (
                f"trial {trial}: ids of requests completed before the kill were named: "
                f"{sorted(named & done_before)[:5]}")
            recovered = await metric(cli.admin_port, "cancel_sidecar_recovered_requests_total",
                                     reason="found_at_start")
            left = {tag_of(w) for w in fake.works if w.stopped_at is not None
                    and w.stopped_at > killed}
            assert recovered >= 1 or not left, (trial, recovered, left)
    quiet_after.sort()
    print(f"{how}: {TRIALS} kills and restarts; the last request stopped by an abort, from the "
          f"restart's listening (negative: before it): median {quiet_after[TRIALS // 2] * 1000:.0f}"
          f" ms, max {quiet_after[-1] * 1000:.0f} ms")


async def test_a_worker_started_after_a_reload_writes_its_record_where_the_supervisor_reads(
        fake: VLLMEngine, tmp_path: Path) -> None:
    """``lifecycle.record_dir`` needs a restart: after a SIGHUP that changes it, the workers that
    replace dead ones keep the directory the supervisor started with (``--worker-pinned``), so
    when such a worker dies in turn, the supervisor finds its record and its requests stop at
    the engine within 1 s, as any dead worker's do."""
    started_with, changed_to = tmp_path / "records", tmp_path / "records-after-reload"
    config = tree(fake)
    config["lifecycle"]["record_dir"] = str(started_with)
    async with cli_process(tmp_path, config, "--workers", "2") as cli:
        config["lifecycle"]["record_dir"] = str(changed_to)
        cli.write_config(config)
        cli.signal(signal.SIGHUP)
        logged = await cli.wait_log("lifecycle.record_dir", 10)  # "... ignored: ... restart"
        for victim in workers_of(cli.proc.pid):  # both workers replaced after the reload
            victim.kill()
            logged = await cli.wait_log(f"replaces worker {victim.pid}", 10, after=logged)
        load = Load(cli.proxy_port, seed=3)
        load.start(0)
        await asyncio.sleep(0.8)
        assert any(w.running for w in fake.works), "expected requests running at the engine"
        victim = workers_of(cli.proc.pid)[0]
        victim.kill()
        killed = time.monotonic()
        await asyncio.sleep(STOPPED_WITHIN_S)
        live = {c.tag for c in load.clients if c.whole_at is None and not c.cut}
        orphaned = {tag_of(w) for w in fake.works if w.running} - live
        assert not orphaned, (
            f"{len(orphaned)} request(s) of the dead replacement still running "
            f"{STOPPED_WITHIN_S} s after the kill: {sorted(orphaned)[:5]}")
        stopped = [w for w in fake.works if w.stopped_at is not None and w.stopped_at > killed]
        recovered = await metric(cli.admin_port, "cancel_sidecar_recovered_requests_total",
                                 reason="worker_died")
        assert stopped and recovered >= 1, (len(stopped), recovered)
        await load.stop()
        assert not changed_to.exists(), sorted(changed_to.iterdir())
