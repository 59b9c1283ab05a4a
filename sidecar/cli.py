"""``cancel-sidecar`` / ``python -m sidecar``: validate a config, or run the sidecar.

Exit status: 0 after a clean stop (SIGTERM/SIGINT) or a valid ``--check-config``; 1 for a bad
config (every problem printed to stderr with its location); 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import uvloop

from sidecar import server
from sidecar.config import Settings, load_config
from sidecar.errors import ConfigError

log = logging.getLogger("sidecar")

DEFAULT_CONFIG = Path("config/sidecar.yaml")


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
    return p


async def _serve(settings: Settings) -> None:
    servers = await server.start(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"cancel-sidecar: proxy on {settings.listen.host}:{servers.proxy_port}"
          + (f", admin on {settings.admin.host}:{servers.admin_port}" if settings.admin else ""),
          flush=True)
    await stop.wait()
    log.info("stopping: letting in-flight requests finish")
    await servers.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.check_config:
        print(f"{args.config}: OK ({len(settings.engines)} engine(s), "
              f"{len(settings.routes)} route(s))")
        return 0
    level = (args.log_level or settings.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        print(f"--log-level: unknown level {level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
