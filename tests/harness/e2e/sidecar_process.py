"""Run the sidecar as production runs it: a subprocess of its CLI, ``python -m sidecar --config F``.

Usage::

    with sidecar_process(engine_url="http://127.0.0.1:8000", workdir=tmp) as sc:
        sc.base_url        # the proxy, e.g. http://127.0.0.1:41234
        sc.admin_url       # /healthz, /readyz, /metrics
        sc.log_text()      # the sidecar's stderr (its log)

The config is written to ``workdir/sidecar.yaml`` with ports 0; the bound ports are read from
the one line the CLI prints on stdout once both listeners are up
(``cancel-sidecar: proxy on HOST:PORT, admin on HOST:PORT``, ``sidecar/cli.py``). stdout and
stderr go to files in ``workdir``: no pipe can fill up and block the sidecar, and none is left
open for pytest's unraisable-warning checks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness.e2e.vllm_server import REPO_ROOT

READY_LINE = re.compile(
    r"cancel-sidecar: proxy on (?P<host>[^\s:]+):(?P<port>\d+), "
    r"admin on (?P<ahost>[^\s:]+):(?P<aport>\d+)"
)


@dataclass
class SidecarProcess:
    """A running ``python -m sidecar`` subprocess and the addresses it bound."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    admin_host: str
    admin_port: int
    config_path: Path
    log_path: Path
    stdout_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the CLI's clean stop), SIGKILL after ``timeout`` s; return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def write_config(path: Path, engine_url: str, log_level: str = "INFO",
                 abort: dict[str, Any] | None = None) -> Path:
    """Write a sidecar YAML: one vLLM engine at ``engine_url`` (``abort``: more of its abort
    settings), every path routed to it, proxy and admin on 127.0.0.1 port 0 (free ports)."""
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine_url,
                              "abort": {"timeout_s": 5.0, **(abort or {})}}},
        "routes": [{"prefix": "/", "engine": "local"}],
        "log_level": log_level,
    }
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def start_sidecar(engine_url: str, workdir: Path, *, startup_timeout: float = 30.0,
                  python: str = sys.executable,
                  abort: dict[str, Any] | None = None) -> SidecarProcess:
    """Start ``python -m sidecar --config workdir/sidecar.yaml`` and wait for its ready line
    (``abort``: more of the engine's abort settings, :func:`write_config`).

    Raises ``RuntimeError`` with the log tail if the process exits or ``startup_timeout``
    seconds pass first (the process is killed then).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir / "sidecar.yaml", engine_url, abort=abort)
    stdout_path, log_path = workdir / "sidecar.stdout", workdir / "sidecar.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(stdout_path, "wb") as out, open(log_path, "wb") as err:
        proc = subprocess.Popen(
            [python, "-m", "sidecar", "--config", str(config)], cwd=str(REPO_ROOT), env=env,
            stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        match = READY_LINE.search(stdout_path.read_text(errors="replace"))
        if match:
            return SidecarProcess(proc, match["host"], int(match["port"]), match["ahost"],
                                  int(match["aport"]), config, log_path, stdout_path)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait(timeout=5)
    raise RuntimeError(
        f"sidecar did not print its ready line within {startup_timeout}s "
        f"(exit status {proc.returncode}); stdout: {stdout_path.read_text(errors='replace')!r}"
        f"\nlog tail:\n{log_path.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def sidecar_process(engine_url: str, workdir: Path, **kwargs: object) -> Iterator[SidecarProcess]:
    """Context manager around :func:`start_sidecar`; always stops the process."""
    sc = start_sidecar(engine_url, workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield sc
    finally:
        sc.stop()
