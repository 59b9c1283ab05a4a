"""The real ``python -m sidecar`` as a subprocess, for tests that send it signals.

:func:`cli_process` writes the config, starts the CLI, reads its ready line
(:class:`sidecar.server.ReadyLine`, text or JSON as the config's ``log_format`` says) and
yields a :class:`CliProcess`
whose stderr is read as it comes, so a test can await a log line instead of sleeping.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import yaml

from sidecar.server import ReadyLine

REPO = Path(__file__).resolve().parents[2]
READY_S = 30.0  # how long the CLI may take to print its ready line
EXIT_S = 15.0  # how long a test waits for the CLI to exit after a stop signal


def config_tree(engine_url: str, *, api_key: str = "cli-key", grace_s: float = 5.0,
                **sections: Any) -> dict[str, Any]:
    """A config for one vLLM-kind engine ``local`` at ``engine_url``, free ports."""
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine_url,
                              "abort": {"api_key": api_key, "timeout_s": 2.0,
                                        "resend_window_s": 0}}},  # first call only
        "routes": [{"prefix": "/", "engine": "local"}],
        "lifecycle": {"grace_period_s": grace_s},
        "log_level": "DEBUG",
    }
    tree.update(sections)
    return tree


class CliProcess:
    """A running CLI: its ports, its stderr so far, and its exit."""

    def __init__(self, proc: asyncio.subprocess.Process, config: Path) -> None:
        self.proc = proc
        self.config = config
        self.proxy_port = 0
        self.admin_port = 0
        self.stderr_lines: list[str] = []
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr_lines.append(line.decode(errors="replace"))
            self._changed.set()

    async def wait_log(self, text: str, within_s: float = 10.0, *, after: int = 0) -> int:
        """Wait until a stderr line (from index ``after`` on) contains ``text``; returns the
        index just past that line. Fails after ``within_s`` seconds."""
        deadline = time.monotonic() + within_s
        while True:
            for i in range(after, len(self.stderr_lines)):
                if text in self.stderr_lines[i]:
                    return i + 1
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.returncode is not None:
                raise AssertionError(f"expected a log line containing {text!r} within "
                                     f"{within_s} s, got stderr:\n{self.stderr}")
            with suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def write_config(self, tree: dict[str, Any]) -> None:
        self.config.write_text(yaml.safe_dump(tree))

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, within_s: float = EXIT_S) -> int:
        """The exit status; fails if the process is still running after ``within_s`` s."""
        try:
            code = await asyncio.wait_for(self.proc.wait(), within_s)
        except TimeoutError:
            raise AssertionError(f"expected the CLI to exit within {within_s} s, it did not; "
                                 f"stderr:\n{self.stderr}") from None
        if self._reader is not None:
            await asyncio.wait_for(self._reader, within_s)
        return code


@asynccontextmanager
async def cli_process(tmp_path: Path, tree: dict[str, Any], *args: str
                      ) -> AsyncIterator[CliProcess]:
    """Start ``python -m sidecar --config FILE *args``; kill it at the end if still running."""
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(tree))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "--config", str(config), *args, cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    cli = CliProcess(proc, config)
    cli._reader = asyncio.get_running_loop().create_task(cli._read_stderr(), name="cli stderr")
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), READY_S)).decode()
        ready = ReadyLine.parse(line)
        assert ready is not None and ready.admin_port is not None, (
            f"expected the ready line with a proxy and an admin address, got {line!r}; "
            f"stderr:\n{cli.stderr}")
        cli.proxy_port, cli.admin_port = ready.proxy_port, ready.admin_port
        yield cli
    finally:
        if proc.returncode is None:
            with suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()  # --workers: no orphans if the supervisor is killed
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
        if cli._reader is not None:
            with suppress(TimeoutError):
                await asyncio.wait_for(cli._reader, 5)
        if proc.stdout is not None:
            await proc.stdout.read()
