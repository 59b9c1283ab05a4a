"""Production wiring: the runners, sites and settings the CLI uses, importable by tests.

The one setting that matters most: ``handler_cancellation=True``. aiohttp's production default
is ``False`` (its test server turns it on), and without it a lost client connection never
reaches the handler, so the sidecar would never notice a disconnect.

Silent clients: ``downstream.idle_timeout_s`` is aiohttp's ``keepalive_timeout`` on both
listeners (aiohttp's default: 3630 s). aiohttp 3.14 arms that timer when a connection is
accepted and again after each response (``RequestHandler.connection_made`` and ``start`` in
``aiohttp/web_protocol.py``) and, when it fires, closes the connection if no request is in
progress: a client that connects and sends nothing, or sends a request head that never
completes (however slowly it trickles in), or idles between requests, is closed after that many
seconds. A request being handled (a long stream included) is never cut by it.

The proxy listener answers what aiohttp itself refuses (unparseable requests, handler errors)
with JSON errors: :mod:`sidecar.downstream`.

Stopping (:meth:`Servers.stop`) does aiohttp's ``AppRunner.cleanup()`` in steps of its own,
because aiohttp 3.14's ``RequestHandler.shutdown(timeout)`` waits for a busy handler twice (for
it to finish, then again after failing its request body), so a streaming straggler would hold
the process for twice the grace period. Here: listening sockets close first (new connections are
refused), idle keep-alive connections are closed, running requests get ``grace_period_s`` to
finish, then the rest are cancelled, which closes their upstreams and starts their engine aborts;
``cleanup()`` then finds nothing running and the app teardown waits for the abort calls.

Garbage collection (:func:`tune_gc`, once the listeners are up): what exists after startup
(modules, config, apps) is frozen out of the collector's traversal, and a young collection runs
every ``GC_YOUNG_THRESHOLD`` net allocations instead of 700. Measured with 1,000 streams of 301
events (``tests/load/relay_cost.py``): the longest collection pause fell from 70-86 ms to
21-38 ms, and the collector's total time from ~340 ms to ~50 ms per 301,000 events relayed.
Nothing else changes: cycles are still collected, only less often, and not while clients are
leaving (a storm: :class:`sidecar.read_pacer.CollectorPause`, at most 1 s).

The ready line (:class:`ReadyLine`): once it listens, the sidecar writes one line on stdout with
its bound addresses, in its log format: ``cancel-sidecar: proxy on HOST:PORT, admin on
HOST:PORT`` (text), or a JSON object shaped like its log lines whose ``msg`` is that text
(json). Scripts, the ``--workers`` supervisor (a worker's own line: ``cancel-sidecar worker:
proxy on HOST:PORT``) and the test harnesses read it with :meth:`ReadyLine.parse`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app import make_admin_app, make_app, make_control_app, proxy_handler
from sidecar.cancel import CONTROL_IDLE_S, local_canceller
from sidecar.config import Settings
from sidecar.downstream import DownstreamRunner, DownstreamServer
from sidecar.keys import RUNTIME
from sidecar.logs import LogFormat
from sidecar.proxy import EXCHANGES

log = logging.getLogger(__name__)

# What aiohttp's own shutdown may still wait for once the drain left no request running.
SHUTDOWN_TIMEOUT_S = 1.0
# A stop first takes in what already arrived (take_in_arrivals): loop turns until this many in a
# row accepted no connection and read no request, for at most STOP_SETTLE_S (counted in the
# grace period). Accept -> read -> handler takes 3 turns; 2 to spare.
STOP_QUIET_TURNS = 5
STOP_SETTLE_S = 0.5
GC_YOUNG_THRESHOLD = 10_000  # net allocations between young collections (CPython's default: 700)


_READY_TEXT = re.compile(r"cancel-sidecar(?P<worker> worker)?: proxy on (?P<proxy>\S+?)"
                         r"(?:, admin on (?P<admin>\S+))?")
_READY_EVENTS = {"ready": False, "worker_ready": True}  # JSON event -> worker


def _port(address: str) -> int | None:
    """The port of ``HOST:PORT`` (an IPv6 host unbracketed, as the line prints it), or None."""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() and ":" in address else None


@dataclass(frozen=True)
class ReadyLine:
    """What the ready line says: ``proxy`` and ``admin`` as ``HOST:PORT`` (``admin`` None
    without an admin listener, and for a worker), ``worker``: a ``--workers`` worker's line,
    read by its supervisor.

    Text: ``cancel-sidecar: proxy on 127.0.0.1:8080, admin on 127.0.0.1:9090``; JSON: the
    log lines' ``ts``, ``level``, ``logger`` and ``msg`` (the text form, so a reader that
    searches for it finds it in either format), then ``event`` (``ready``, ``worker_ready``),
    ``proxy`` and ``admin``::

        {"ts": "2026-12-04T12:00:00.000Z", "level": "INFO", "logger": "sidecar",
         "msg": "cancel-sidecar: proxy on 127.0.0.1:8080, admin on 127.0.0.1:9090",
         "event": "ready", "proxy": "127.0.0.1:8080", "admin": "127.0.0.1:9090"}
    """

    proxy: str
    admin: str | None = None
    worker: bool = False

    @property
    def proxy_port(self) -> int:
        port = _port(self.proxy)
        assert port is not None, self.proxy  # parse() and the listeners give a port
        return port

    @property
    def admin_port(self) -> int | None:
        return None if self.admin is None else _port(self.admin)

    def text(self) -> str:
        who = "cancel-sidecar worker" if self.worker else "cancel-sidecar"
        return f"{who}: proxy on {self.proxy}" + (
            f", admin on {self.admin}" if self.admin is not None else "")

    def render(self, fmt: LogFormat) -> str:
        """The line in log format ``fmt``, without its newline."""
        if fmt == "text":
            return self.text()
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds").removesuffix("+00:00")
        return json.dumps({"ts": stamp + "Z", "level": "INFO", "logger": "sidecar",
                           "msg": self.text(),
                           "event": "worker_ready" if self.worker else "ready",
                           "proxy": self.proxy, "admin": self.admin}, ensure_ascii=False)

    @classmethod
    def parse(cls, line: str) -> ReadyLine | None:
        """The ready line ``line`` says, in either format; None if it is none."""
        line = line.strip()
        if line.startswith("{"):
            try:
                fields = json.loads(line)
            except ValueError:
                return None
            if not isinstance(fields, dict) or fields.get("event") not in _READY_EVENTS:
                return None
            proxy, admin = fields.get("proxy"), fields.get("admin")
            worker = _READY_EVENTS[fields["event"]]
        elif match := _READY_TEXT.fullmatch(line):
            proxy, admin, worker = match["proxy"], match["admin"], bool(match["worker"])
        else:
            return None
        if not isinstance(proxy, str) or _port(proxy) is None or not (
                admin is None or (isinstance(admin, str) and _port(admin) is not None)):
            return None
        return cls(proxy, admin, worker)


@dataclass
class Servers:
    """The running proxy and (optional) admin listeners; ``*_port`` are the bound ports (config
    port 0 -> a free one)."""

    proxy: web.AppRunner
    admin: web.AppRunner | None
    proxy_port: int
    admin_port: int | None
    control: web.AppRunner | None = None  # a --workers worker's control listener
    control_path: Path | None = None  # ... and its Unix socket, removed at stop

    @property
    def app(self) -> web.Application:
        """The proxy application (its state: :mod:`sidecar.keys`)."""
        return self.proxy.app

    async def stop(self, grace_s: float | None = None) -> None:
        """Take in what already arrived (:func:`take_in_arrivals`), refuse new connections, let
        in-flight requests finish for up to ``grace_s`` seconds
        (default: the current config's ``lifecycle.grace_period_s``), cancel the rest (their
        upstreams are closed and their engines aborted), wait for the abort calls (bounded by
        the app teardown), close everything."""
        runtimes = self.app[RUNTIME]
        grace = runtimes.current.settings.lifecycle.grace_period_s if grace_s is None else grace_s
        started = time.monotonic()
        if isinstance(self.proxy.server, DownstreamServer):
            await take_in_arrivals(self.proxy.server)
        wait_s = max(0.0, grace - (time.monotonic() - started))
        for site in list(self.proxy.sites):
            await site.stop()
        if self.proxy.server is not None:
            self.proxy.server.pre_shutdown()  # idle keep-alive connections close now
        running = runtimes.in_flight
        if running:
            log.info("stopping: new connections refused; waiting up to %.1f s for %d in-flight "
                     "request(s)", wait_s, running)
        finished, cancelled = await runtimes.drain(wait_s)
        if cancelled:
            log.warning("stopping: %d request(s) still running after the %.1f s grace period "
                        "cancelled (upstream closed, engine aborted); %d finished", cancelled,
                        grace, finished)
        await self.proxy.cleanup()
        if self.admin is not None:
            await self.admin.cleanup()
        if self.control is not None:
            await self.control.cleanup()
        if self.control_path is not None:
            with suppress(FileNotFoundError):
                self.control_path.unlink()
        log.info("stopped in %.2f s (%d request(s) finished during the drain, %d cancelled)",
                 time.monotonic() - started, finished, cancelled)


async def take_in_arrivals(server: DownstreamServer) -> None:
    """Turn the event loop until :data:`STOP_QUIET_TURNS` turns in a row accepted no
    connection and read no request (at most :data:`STOP_SETTLE_S` seconds, taken from the
    grace period). Under steady traffic it runs the whole
    :data:`STOP_SETTLE_S`, and connections arriving meanwhile are still accepted and served.

    What the kernel held when a stop began becomes requests in progress, which the drain waits
    for: connections in the accept queue (accepted in one turn), requests already sent on them
    or on kept-alive connections (read in the next; their handler starts in the one after).
    Closing the listeners resets connections still in the accept queue, and aiohttp's
    ``pre_shutdown()`` closes every connection with no request in progress, unread bytes and
    all: on a busy loop (a disconnect storm, the in-process tests' shared loop) requests sent
    ~100 ms before the stop were reset (``tests/test_storm_mixed.py``, ``stop`` variant).
    """
    deadline = time.monotonic() + STOP_SETTLE_S
    seen = (server.accepted, server.requests_count)
    quiet = 0
    while quiet < STOP_QUIET_TURNS and time.monotonic() < deadline:
        await asyncio.sleep(0)
        now = (server.accepted, server.requests_count)
        quiet = quiet + 1 if now == seen else 0
        seen = now


def tune_gc() -> None:
    """Freeze what startup allocated out of the collector's way and collect the young
    generation less often (see the module docstring). Idempotent enough to call per start."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def _bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])


async def start(settings: Settings, registry: CollectorRegistry | None = None, *,
                port: int | None = None, reuse_port: bool = False,
                admin: bool = True, control: Path | None = None,
                recover: bool = True) -> Servers:
    """Start the proxy and admin listeners exactly as production runs them.

    ``port`` overrides ``settings.listen.port`` and ``reuse_port`` sets SO_REUSEPORT (a worker
    of :mod:`sidecar.workers`, sharing the port its supervisor chose); ``admin=False`` leaves
    the admin listener to the supervisor. ``control`` (a worker) also serves this process's
    cancel API without a token on a Unix socket at that path, for the supervisor
    (:mod:`sidecar.cancel`); never on TCP. ``recover``: abort what dead sidecar processes left
    in ``lifecycle.record_dir`` before listening (False in a worker: its supervisor does).
    Raises ``OSError`` if an address cannot be bound.
    """
    registry = registry or CollectorRegistry()
    app = make_app(settings, registry, recover=recover)
    idle_s = settings.downstream.idle_timeout_s
    proxy = DownstreamRunner(app, handler=proxy_handler(app), handler_cancellation=True,
                             access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                             keepalive_timeout=idle_s)
    await proxy.setup()
    # A worker listens on its control socket before its proxy listener opens: while the control
    # socket does not listen yet the worker has taken no request (the supervisor's cancel API
    # counts on it: sidecar.cancel.WorkerCanceller).
    control_runner = None
    if control is not None:
        control_runner = DownstreamRunner(make_control_app(app[EXCHANGES]), access_log=None,
                                          shutdown_timeout=1.0, keepalive_timeout=CONTROL_IDLE_S)
        await control_runner.setup()
        await web.UnixSite(control_runner, control).start()
    await web.TCPSite(proxy, settings.listen.host,
                      settings.listen.port if port is None else port,
                      backlog=4096, reuse_port=reuse_port or None).start()
    proxy_port = _bound_port(proxy)
    admin_runner = None
    admin_port = None
    if admin and settings.admin is not None:
        admin_runner = DownstreamRunner(
            make_admin_app(app[RUNTIME], registry, local_canceller(app[EXCHANGES])),
            access_log=None, shutdown_timeout=1.0, keepalive_timeout=idle_s)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, settings.admin.host, settings.admin.port).start()
        admin_port = _bound_port(admin_runner)
    tune_gc()
    log.info("proxy listening on %s:%d, admin on %s", settings.listen.host, proxy_port,
             f"{settings.admin.host}:{admin_port}" if admin_runner and settings.admin
             else "(disabled)")
    return Servers(proxy, admin_runner, proxy_port, admin_port, control_runner, control)
