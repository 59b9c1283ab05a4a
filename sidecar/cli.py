"""``cancel-sidecar`` / ``python -m sidecar``: validate a config, or run the sidecar.

Signals: SIGTERM/SIGINT stop (new connections refused, in-flight requests get
``lifecycle.grace_period_s``, the rest are cancelled and aborted at their engine); SIGHUP
re-reads ``--config`` and applies it to new requests, or keeps the running config and logs every
problem. ``--workers N`` (N > 1) runs N proxy processes on one port under a supervisor
(:mod:`sidecar.workers`).

Startup check: once the listeners are up, every engine is checked in the background as
``/readyz`` checks it, and re-checked until all are ready, logging what to fix
(:mod:`sidecar.readiness`); once per sidecar (the supervisor under ``--workers``, not each
worker). It never delays or fails the start.

Exit status: 0 after a clean stop (SIGTERM/SIGINT) or a valid ``--check-config``; 1 for a bad
config (every problem printed to stderr with its location) or a worker that died; 2 for bad
command-line usage.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from sidecar import app, server, workers
from sidecar.config import Settings, load_config, warn_open_cancel_api
from sidecar.errors import ConfigError, ListenError
from sidecar.keys import RUNTIME, TASKS
from sidecar.logs import LogFormat, configure_logging
from sidecar.readiness import startup_check
from sidecar.runtime import with_pinned

log = logging.getLogger("sidecar")

DEFAULT_CONFIG = Path("config/sidecar.yaml")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cancel-sidecar",
        description="Reverse proxy that aborts LLM engine work when a client disconnects.")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="YAML config file (default: %(default)s)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the config, print every problem, exit 0 or 1")
    p.add_argument("--log-level", default=None,
                   help="DEBUG, INFO, WARNING or ERROR (default: the config's log_level)")
    p.add_argument("--log-format", choices=["json", "text"], default=None,
                   help="one JSON object per line, or readable text (default: the config's "
                        "log_format)")
    p.add_argument("--workers", type=_positive_int, default=1,
                   help="proxy processes sharing the listen port (default: %(default)s)")
    # Internal: how the supervisor starts a worker (proxy only, SO_REUSEPORT on this port).
    p.add_argument("--worker-port", type=int, default=None, help=argparse.SUPPRESS)
    # Internal: the Unix socket where a worker serves its cancel API to the supervisor.
    p.add_argument("--worker-control", type=Path, default=None, help=argparse.SUPPRESS)
    # Internal: the restart-only values of the config the supervisor started with, which a
    # worker keeps whatever the file says now (sidecar.runtime.with_pinned).
    p.add_argument("--worker-pinned", default=None, help=argparse.SUPPRESS)
    return p


def read_new_config(path: Path) -> Settings | None:
    """SIGHUP: re-read and validate ``path``; ``None`` (every problem logged) if it is bad."""
    try:
        return load_config(path)
    except ConfigError as exc:
        log.error("reload: keeping the running config; %s", exc)
        return None


def _reload(path: Path, apply: Callable[[Settings], tuple[list[str], list[str]]],
            running: Callable[[], Settings] | None) -> None:
    """SIGHUP in one process: ``apply`` the new config; ``running`` gives the config in effect
    (None in a supervised worker: its supervisor warns about the admin listener)."""
    started = time.monotonic()
    settings = read_new_config(path)
    if settings is None:
        return
    if running is not None:
        warn_open_cancel_api(settings, running())
    applied, ignored = apply(settings)
    for change in ignored:
        log.warning("reload: %s ignored: takes effect after a restart", change)
    log.info("reload of %s done in %.1f ms: %s", path, (time.monotonic() - started) * 1000,
             "; ".join(applied) if applied else "no change applies to requests")


async def _serve(settings: Settings, config: Path, log_format: LogFormat,
                 worker_port: int | None = None, worker_control: Path | None = None) -> None:
    """One process: the proxy and admin listeners, or (``worker_port``) a supervised worker's
    proxy listener on that port with SO_REUSEPORT, and its control listener on the Unix socket
    ``worker_control`` (the cancel API, for the supervisor). Once they listen, the ready line
    (:class:`~sidecar.server.ReadyLine`) goes to stdout in ``log_format``."""
    worker = worker_port is not None
    try:
        servers = await server.start(settings, port=worker_port, reuse_port=worker,
                                     admin=not worker, control=worker_control,
                                     recover=not worker)
    except OSError as exc:  # bind/resolve errors name the address: "[Errno 98] ... ('h', p)"
        admin = settings.admin
        where = f"listen {settings.listen.host}:{settings.listen.port}, admin " + (
            f"{admin.host}:{admin.port}" if admin else "off") + (
            f", control {worker_control}" if worker_control else "")
        raise ListenError(f"cannot listen ({where}): {exc}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if worker:
        workers.die_with_supervisor()  # its SIGTERM lands in the handler just installed
    loop.add_signal_handler(signal.SIGHUP, _reload, config,
                            lambda new: app.reload(servers.app, new),
                            None if worker else lambda: servers.app[RUNTIME].current.settings)
    if not worker:
        warn_open_cancel_api(settings, port=servers.admin_port)
    check = None if worker else servers.app[TASKS].spawn(
        startup_check(servers.admin, servers.app[RUNTIME]), name="engine startup check")
    admin = settings.admin
    print(server.ReadyLine(
        f"{settings.listen.host}:{servers.proxy_port}",
        f"{admin.host}:{servers.admin_port}" if admin is not None and not worker else None,
        worker).render(log_format), flush=True)
    await stop.wait()
    if check is not None:
        check.cancel("sidecar stopping")
        await asyncio.wait({check})
    await servers.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.worker_pinned is not None:
        settings = with_pinned(settings, args.worker_pinned)
    if args.check_config:
        print(f"{args.config}: OK ({len(settings.engines)} engine(s), "
              f"{len(settings.routes)} route(s))")
        return 0
    level = (args.log_level or settings.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        print(f"--log-level: unknown level {level!r}", file=sys.stderr)
        return 2
    log_format: LogFormat = args.log_format or settings.log_format
    configure_logging(level, log_format)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if args.workers > 1 and args.worker_port is None:
            worker_args: list[str] = []
            if args.log_level:
                worker_args += ["--log-level", args.log_level]
            if args.log_format:
                worker_args += ["--log-format", args.log_format]
            return runner.run(workers.Supervisor(
                settings, args.config, args.workers, worker_args,
                lambda: read_new_config(args.config), log_format=log_format).run())
        try:
            runner.run(_serve(settings, args.config, log_format, args.worker_port,
                              args.worker_control))
        except ListenError as exc:
            log.error("%s", exc)  # in the log format, as the supervisor's bind errors
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
