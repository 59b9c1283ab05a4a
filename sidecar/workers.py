"""``--workers N``: N proxy processes on one port, supervised by the process that started them.

Shape::

    supervisor (this module)     admin listener: /healthz, /readyz, /metrics summed over workers,
      │                          the cancel API (asks every worker, sidecar.cancel)
      ├── worker 1: python -m sidecar --config FILE --worker-port P --worker-control SOCKET
      │             proxy listener (SO_REUSEPORT); control listener on the Unix socket
      │             RUN_DIR/worker-1.sock (the cancel API for this worker's requests, nothing else)
      └── worker N: ...

Run directory: a fresh temporary directory per run, mode 0700 (only this user can enter it, so
only this user can connect to the sockets in it), removed at exit with everything in it. It
holds the workers' control sockets and ``metrics/``. Control listeners are Unix sockets only,
never TCP: nothing listens beyond what the config says. The cancel token is checked by the
supervisor's admin listener; the control listeners have none.

The supervisor binds the proxy address itself first (SO_REUSEPORT, not listening) so that a
configured port 0 becomes one real port every worker shares, and holds it until every worker
listens; the kernel then spreads new connections across the workers. Each worker prints its
ready line (``cancel-sidecar worker: proxy on HOST:PORT``, or its JSON form: the log format,
:class:`~sidecar.server.ReadyLine`) on its stdout when it listens; the supervisor then prints the
same ready line as a single process.

Signals: SIGTERM/SIGINT and SIGHUP are forwarded to every worker (each drains, or reloads the
file, on its own); SIGHUP also reloads the supervisor's engines for ``/readyz``. A worker keeps
the restart-only values of the config the supervisor started with (``--worker-pinned``:
:func:`sidecar.runtime.with_pinned`), so a replacement started after a SIGHUP writes its record
of in-flight work where the supervisor reads it, as the others do. The startup check
(:mod:`sidecar.readiness`) runs here, once, not in the workers.

A worker that dies unasked (SIGKILL, the OOM killer, a crash) is replaced at once: a new worker
on the same port (SO_REUSEPORT), with a control socket of its own, while the others serve on
untouched (as nginx's master, gunicorn's arbiter and uvicorn's supervisor do). Its requests are
lost with it (their clients' connections were reset), and what it left running at the engines
is aborted here first, from its record of in-flight work (:mod:`sidecar.inflight`; at the
start too, for what a dead sidecar left). ``MAX_DEATHS`` deaths within
``DEATH_WINDOW_S`` are a crash loop: the others are stopped and the sidecar exits 1, as does a
replacement that does not start. Exit status: 0 when every worker exited 0 after a stop; 1 after
a crash loop or a worker that failed to start.

Metrics: prometheus-client's multiprocess mode. ``PROMETHEUS_MULTIPROC_DIR`` is ``metrics/`` in
the run directory; workers write their samples there, the admin
side sums them with ``MultiProcessCollector``; a worker's live gauges are dropped when it exits
(``mark_process_dead``).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar import inflight
from sidecar.abort import Aborter
from sidecar.app import ABORT_DRAIN_S, make_admin_app
from sidecar.cancel import WorkerCanceller
from sidecar.config import Settings, warn_open_cancel_api
from sidecar.downstream import DownstreamRunner
from sidecar.logs import LogFormat
from sidecar.metrics import Metrics
from sidecar.readiness import startup_check
from sidecar.runtime import Runtime, Runtimes, describe_changes, pinned_for_workers
from sidecar.server import ReadyLine
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

READY_S = 30.0  # how long a worker may take to start listening
MAX_DEATHS = 5  # unasked worker deaths within DEATH_WINDOW_S: a crash loop, the sidecar stops
DEATH_WINDOW_S = 60.0
# How long after a worker's death an id no live worker has may have been one of its requests:
# the cancel API answers 502 worker_unreachable for it meanwhile, then 404.
DEAD_WORKER_S = 60.0
SUPERVISOR_PID_ENV = "CANCEL_SIDECAR_SUPERVISOR_PID"  # set for workers: who must outlive them
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_supervisor() -> None:
    """In a worker: have the kernel send this process SIGTERM when its supervisor dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), and send it now if the supervisor is already gone.

    Without it a supervisor killed by SIGKILL (``kill -9``, the OOM killer, systemd
    ``KillMode=process``) left its workers serving on the port; a restarted sidecar then shared
    the port with them (SO_REUSEPORT) and its cancel API could not reach their requests (a
    hostile tester's finding). SIGTERM is the usual drain: in-flight requests get
    ``lifecycle.grace_period_s``, then are aborted. Logs a warning where prctl is missing."""
    expected = int(os.environ.get(SUPERVISOR_PID_ENV, "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as exc:
        log.warning("worker %d: cannot ask to be stopped with the supervisor (%s); if the "
                    "supervisor is killed, stop this worker yourself", os.getpid(), exc)
    if expected and os.getppid() != expected:  # it died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
UNIX_PATH_MAX = 107  # bytes in a Unix socket path (Linux sun_path: 108 with the final NUL)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``host:port`` with SO_REUSEPORT; port 0 picks a free
    one. Workers bind the same address with SO_REUSEPORT. Raises ``OSError``."""
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class Supervisor:
    """Starts, signals and reaps the workers; serves the admin listener."""

    def __init__(self, settings: Settings, config: Path, workers: int,
                 worker_args: list[str], reload: Callable[[], Settings | None], *,
                 log_format: LogFormat) -> None:
        self.settings = settings
        self.log_format = log_format  # of the ready line (the workers' own come in either)
        self.config = config
        self.count = workers
        self.worker_args = worker_args
        self.reload_config = reload
        self.procs: list[asyncio.subprocess.Process] = []
        self.controls: dict[int, Path] = {}  # worker pid -> its control socket
        self.port = 0  # the proxy port every worker listens on
        self.spawned = 0  # workers started so far (names their control sockets)
        self.deaths: deque[float] = deque()  # time.monotonic() of unasked deaths, in the window
        self.died_at: dict[int, float] = {}  # dead worker pid -> time.monotonic() of its death
        self.replaced = 0  # workers replaced after an unasked death
        # Requests dead processes left running, aborted here: (engine, reason) -> count.
        self.recovered: Counter[tuple[str, str]] = Counter()
        # Dead workers whose record was read (their requests are known: the cancel API answers
        # for them, sidecar.cancel), and the sidecar ids of those requests -> time.monotonic()
        # of the death, kept DEAD_WORKER_S.
        self.read_records: set[int] = set()
        self.ready_pids: set[int] = set()  # workers that printed their ready line
        self.orphans: dict[str, float] = {}
        self.aborter: Aborter | None = None
        self.runtimes: Runtimes | None = None
        self.tasks = TaskSet()
        self.stopping = False
        self.failed = False
        self.run_dir = Path(tempfile.mkdtemp(prefix="cancel-sidecar-"))  # 0700 (mkdtemp)
        self.run_dir.chmod(0o700)  # said twice: the control sockets' only access control
        self.metrics_dir = self.run_dir / "metrics"
        self.metrics_dir.mkdir(mode=0o700)

    async def run(self) -> int:
        """Run until the workers exit; returns the exit status."""
        try:
            return await self._run()
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _control_path(self, n: int) -> Path:
        return self.run_dir / f"worker-{n}.sock"

    async def _run(self) -> int:
        longest = self._control_path(10 ** 6)  # room for a million replacements
        if self.settings.admin is not None and len(os.fsencode(longest)) > UNIX_PATH_MAX:
            log.error("the workers' control socket path %s is over the %d bytes a Unix socket "
                      "path may have: set TMPDIR to a shorter directory", longest, UNIX_PATH_MAX)
            return 1
        try:
            reserved = reserve_port(self.settings.listen.host, self.settings.listen.port)
        except OSError as exc:
            log.error("cannot bind the proxy address %s:%d: %s", self.settings.listen.host,
                      self.settings.listen.port, exc)
            return 1
        runtimes = self.runtimes = Runtimes(Runtime.open(self.settings), self.tasks)
        # The abort machinery for what dead workers (or a dead sidecar) left running: its own
        # warm abort connections, its metrics private (what it did is counted by _Replacements).
        self.aborter = Aborter(self.tasks, Metrics(CollectorRegistry()))
        self.aborter.warm(list(runtimes.current.adapters.values()))
        self._recover(runtimes, "found_at_start")
        with reserved:
            port = self.port = int(reserved.getsockname()[1])
            if not await self._spawn_all(port):
                await self._stop_workers()
                await self._close_aborter(runtimes)
                return 1
        try:
            admin, admin_port = await self._start_admin(runtimes)
        except OSError as exc:  # bind/resolve errors name the address
            assert self.settings.admin is not None
            log.error("cannot bind the admin address %s:%d: %s", self.settings.admin.host,
                      self.settings.admin.port, exc)
            await self._stop_workers()
            await self._close_aborter(runtimes)
            return 1
        warn_open_cancel_api(self.settings, port=admin_port)
        check = self.tasks.spawn(startup_check(admin, runtimes), name="engine startup check")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        loop.add_signal_handler(signal.SIGHUP, self._hup, runtimes)
        where = self.settings.admin
        print(ReadyLine(f"{self.settings.listen.host}:{port}",
                        f"{where.host}:{admin_port}" if where is not None else None
                        ).render(self.log_format), flush=True)
        log.info("%d workers (pids %s) serving %s:%d", self.count,
                 ", ".join(str(p.pid) for p in self.procs), self.settings.listen.host, port)
        try:
            await self._reap()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            check.cancel("sidecar stopping")
            await asyncio.wait({check})
            if admin is not None:
                await admin.cleanup()
            await self._close_aborter(runtimes)
        return 1 if self.failed else 0

    async def _close_aborter(self, runtimes: Runtimes) -> None:
        await self.tasks.drain(ABORT_DRAIN_S)  # the aborts of what dead workers left
        assert self.aborter is not None
        await asyncio.gather(runtimes.close(), self.aborter.close())

    def _recover(self, runtimes: Runtimes, reason: str, dead: int | None = None) -> None:
        """Abort what dead processes left in ``lifecycle.record_dir`` (:mod:`sidecar.inflight`):
        at the start (a dead sidecar's), and when worker ``dead`` died (its own, at once)."""
        directory = self.settings.lifecycle.record_dir
        if directory is None or self.aborter is None:
            return
        try:
            found = inflight.recover(directory, runtimes.current.adapters, self.aborter,
                                     reason.replace("_", " "))
        except OSError as exc:
            log.error("lifecycle.record_dir %s cannot be read (%s): what dead sidecar processes "
                      "left running is not aborted", directory, exc)
            return
        for engine, count in found.aborted.items():
            self.recovered[engine, reason] += count
        if dead is not None:
            now = time.monotonic()
            self.read_records.add(dead)  # its record was read now, or it had none yet
            for sidecar_id in found.sidecar_ids:
                self.orphans[sidecar_id] = now
            for sidecar_id in [i for i, at in self.orphans.items() if now - at > DEAD_WORKER_S]:
                del self.orphans[sidecar_id]

    def _orphaned(self, request_id: str) -> bool:
        """True if ``request_id`` was a request of a worker that died in the last
        ``DEAD_WORKER_S``, aborted on its behalf (the cancel API's 200 for it)."""
        at = self.orphans.get(request_id)
        return at is not None and time.monotonic() - at <= DEAD_WORKER_S

    def _worker_env(self) -> dict[str, str]:
        return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
                SUPERVISOR_PID_ENV: str(os.getpid())}

    async def _spawn_all(self, port: int) -> bool:
        """Start every worker and wait until each listens on ``port``; False if one failed."""
        for _ in range(self.count):
            await self._spawn(port)
        for proc in list(self.procs):
            if not await self._ready(proc):
                return False
        return True

    async def _spawn(self, port: int) -> asyncio.subprocess.Process:
        """Start one worker on ``port`` (not waiting for it to listen), with a control socket
        of its own."""
        self.spawned += 1
        control = self._control_path(self.spawned)
        # A control listener only for the admin listener's cancel API: none without one.
        control_args = [] if self.settings.admin is None else ["--worker-control", str(control)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--config", str(self.config),
            "--worker-port", str(port), *control_args,
            "--worker-pinned", pinned_for_workers(self.settings), *self.worker_args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            env=self._worker_env())
        self.procs.append(proc)
        self.controls[proc.pid] = control
        return proc

    async def _ready(self, proc: asyncio.subprocess.Process) -> bool:
        """Wait until ``proc`` prints its ready line (then relay its stdout); False if it did
        not within ``READY_S``."""
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), READY_S)).decode()
        except TimeoutError:
            line = ""
        ready = ReadyLine.parse(line)
        if ready is None or not ready.worker:
            log.error("worker %d did not start (printed %r, exit status %s)", proc.pid,
                      line, proc.returncode)
            return False
        self.ready_pids.add(proc.pid)
        self.tasks.spawn(self._relay_stdout(proc), name=f"stdout of worker {proc.pid}")
        return True

    @staticmethod
    async def _relay_stdout(proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()

    async def _start_admin(self, runtimes: Runtimes) -> tuple[web.AppRunner | None, int | None]:
        if self.settings.admin is None:
            return None, None
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
            registry, path=str(self.metrics_dir))
        registry.register(_Replacements(self))
        canceller = WorkerCanceller(self._live_controls, self._orphaned,
                                    lambda pid: pid not in self.ready_pids)
        app = make_admin_app(runtimes, registry, canceller)

        async def close_canceller(_: web.Application) -> None:
            await canceller.close()

        app.on_cleanup.append(close_canceller)
        runner = DownstreamRunner(app, access_log=None,
                                  shutdown_timeout=1.0,
                                  keepalive_timeout=self.settings.downstream.idle_timeout_s)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.settings.admin.host, self.settings.admin.port).start()
        except OSError:
            await runner.cleanup()
            raise
        return runner, int(runner.addresses[0][1])

    def _live_controls(self) -> list[tuple[int, Path]]:
        """(pid, control socket) of every worker the cancel API must ask: those still running,
        and those that died (non-zero status, e.g. SIGKILL by the OOM killer) in the last
        ``DEAD_WORKER_S`` whose record was not read (no ``lifecycle.record_dir``): such a worker
        cannot answer, so an id found nowhere is 502, not 404 (it may have been one of the dead
        worker's requests). A dead worker whose record was read is not asked: its requests
        are known (:meth:`_orphaned`). A worker that exited 0 (drained after a stop), or died
        longer ago (its clients' connections were reset then), is skipped."""
        now = time.monotonic()
        return [(p.pid, self.controls[p.pid]) for p in self.procs
                if p.returncode is None or (p.returncode != 0 and p.pid not in self.read_records
                                            and now - self.died_at.get(p.pid, now)
                                            < DEAD_WORKER_S)]

    def _mark_dead(self, pid: int) -> None:
        """Drop an exited worker's live gauges (its counters still count)."""
        multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]

    def _signal_workers(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.send_signal(sig)

    def _stop(self) -> None:
        if not self.stopping:
            log.info("stopping: SIGTERM forwarded to %d worker(s)",
                     sum(p.returncode is None for p in self.procs))
        self.stopping = True
        self._signal_workers(signal.SIGTERM)

    def _hup(self, runtimes: Runtimes) -> None:
        self._signal_workers(signal.SIGHUP)
        settings = self.reload_config()
        if settings is not None:
            warn_open_cancel_api(settings, runtimes.current.settings)
            applied, _ = describe_changes(runtimes.current.settings, settings)
            if applied:
                runtimes.swap(settings)

    async def _stop_workers(self) -> None:
        self.stopping = True
        self._signal_workers(signal.SIGTERM)
        await asyncio.gather(*(p.wait() for p in self.procs))
        for proc in self.procs:
            self._mark_dead(proc.pid)

    async def _reap(self) -> None:
        """Wait for every worker to exit; one that exits unasked is replaced, unless it is the
        ``MAX_DEATHS``-th within ``DEATH_WINDOW_S`` (a crash loop) or its replacement does not
        start: then the others are stopped."""
        waits = {asyncio.ensure_future(p.wait()): p for p in self.procs}
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                proc = waits.pop(future)
                self._mark_dead(proc.pid)
                if self.stopping:
                    if proc.returncode != 0:
                        log.error("worker %d exited with status %s", proc.pid, proc.returncode)
                        self.failed = True
                    continue
                replacement = await self._replace(proc)
                if replacement is not None:
                    waits[asyncio.ensure_future(replacement.wait())] = replacement

    async def _replace(self, dead: asyncio.subprocess.Process
                       ) -> asyncio.subprocess.Process | None:
        """``dead`` exited unasked: start a replacement and wait until it listens; ``None``
        (the others stopped, exit 1) in a crash loop or if the replacement did not start."""
        now = time.monotonic()
        self.died_at[dead.pid] = now
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > DEATH_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) >= MAX_DEATHS:
            log.error("worker %d exited unexpectedly (status %s), the %d-th worker death within "
                      "%.0f s: a crash loop; stopping the others", dead.pid, dead.returncode,
                      len(self.deaths), DEATH_WINDOW_S)
            self.failed = True
            self._stop()
            return None
        log.error("worker %d exited unexpectedly (status %s); its in-flight requests are lost "
                  "(their clients' connections were reset) and aborted at their engines; "
                  "starting a replacement", dead.pid, dead.returncode)
        if self.runtimes is not None:
            self._recover(self.runtimes, "worker_died", dead.pid)
        proc = await self._spawn(self.port)
        if self.stopping:  # a stop came meanwhile: _stop signalled it (it is in self.procs)
            return proc
        if not await self._ready(proc):
            self.failed = True
            self._stop()
            return proc
        self.replaced += 1
        log.warning("worker %d replaces worker %d on %s:%d (%d replaced since the start)",
                    proc.pid, dead.pid, self.settings.listen.host, self.port, self.replaced)
        return proc


class _Replacements(Collector):
    """``cancel_sidecar_workers_replaced_total`` and ``cancel_sidecar_recovered_requests_total``:
    the supervisor's own counters (the workers' metrics come from their multiprocess files; a
    worker recovers nothing, so the second is never in them)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "cancel_sidecar_workers_replaced", "Workers started to replace one that exited "
            "unasked (SIGKILL, the OOM killer, a crash); --workers N only.",
            value=self.supervisor.replaced)
        recovered = CounterMetricFamily(
            "cancel_sidecar_recovered_requests", "Requests a dead sidecar process left running "
            "at an engine, aborted on its behalf (sidecar.inflight): reason worker_died (by the "
            "supervisor, --workers) or found_at_start (by the next start, before it listens).",
            labels=["engine", "reason"])
        runtimes = self.supervisor.runtimes
        adapters = runtimes.current.adapters if runtimes is not None else {}
        counts = {(name, reason): 0 for name, engine in adapters.items() if engine.aborts
                  for reason in ("worker_died", "found_at_start")}  # exported from 0
        counts.update(self.supervisor.recovered)
        for (name, reason), count in sorted(counts.items()):
            recovered.add_metric([name, reason], count)
        yield recovered
