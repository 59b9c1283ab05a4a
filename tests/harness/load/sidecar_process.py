"""The sidecar in a process of its own, for load tests that measure it alone.

``python -m tests.harness.load.sidecar_process CONFIG`` starts :func:`sidecar.server.start` (the
production wiring the CLI runs, on uvloop) and prints ``ready PROXY_PORT ADMIN_PORT``. Each
``stats`` line on stdin is answered with one JSON line ``{"tasks": N}``: the asyncio tasks alive
in the sidecar's loop (only the process itself can count those; file descriptors, sockets and
memory the test reads from outside with psutil). End of stdin stops the sidecar.

:func:`sidecar_process` is the test side: it starts the process, waits for the ready line
(bounded) and kills the process on exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import uvloop
import yaml

from sidecar import server
from sidecar.config import parse_config

REPO = Path(__file__).resolve().parents[3]
READY_S = 30.0  # how long the process may take to start listening
ANSWER_S = 10.0  # how long a stats answer may take


async def _serve(config: Path, text: str) -> None:
    settings = parse_config(text, str(config), env={})
    servers = await server.start(settings)
    print(f"ready {servers.proxy_port} {servers.admin_port}", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        if line.strip() == b"stats":
            print(json.dumps({"tasks": len(asyncio.all_tasks())}), flush=True)
    await servers.stop(0.0)


class SidecarProcess:
    """A running sidecar process: its pid, ports and a way to ask for its task count."""

    def __init__(self, proc: asyncio.subprocess.Process, proxy_port: int,
                 admin_port: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.proxy_port = proxy_port
        self.admin_port = admin_port

    async def tasks(self) -> int:
        """The number of asyncio tasks alive in the sidecar's event loop, counting the
        process's own main task (which answers the query)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), ANSWER_S)
        return int(json.loads(line)["tasks"])


@asynccontextmanager
async def sidecar_process(tmp_path: Path, tree: dict[str, Any]) -> AsyncIterator[SidecarProcess]:
    """Start the sidecar with config ``tree`` in its own process; killed at the end."""
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(tree))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.harness.load.sidecar_process", str(config), cwd=REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), READY_S)).decode().split()
        assert len(line) == 3 and line[0] == "ready", (
            f"expected 'ready PROXY ADMIN' from the sidecar process, got {line!r}")
        yield SidecarProcess(proc, int(line[1]), int(line[2]))
    finally:
        if proc.returncode is None:
            with suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        path = Path(sys.argv[1])
        runner.run(_serve(path, path.read_text()))
