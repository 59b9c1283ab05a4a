"""The sidecar in a process of its own, for load tests that measure it alone.

``python -m tests.harness.load.sidecar_process CONFIG`` starts :func:`sidecar.server.start` (the
production wiring the CLI runs, on uvloop) and prints ``ready PROXY_PORT ADMIN_PORT``. Each
``stats`` line on stdin is answered with one JSON line ``{"tasks": N, "cyclic": {TYPE: N}}``:
the asyncio tasks alive in the sidecar's loop, and the sidecar's own objects (classes of
``sidecar`` and ``engine``) that only the cyclic garbage collector could free, counted since
the sidecar started listening (only the process itself can count those; file descriptors,
sockets and memory the test reads from outside with psutil). End of stdin stops the sidecar.

``cyclic`` (with ``--count-cycles``; else always empty): from the start on, the collector keeps
what it finds (``gc.DEBUG_SAVEALL``) instead of freeing it, and each ``stats`` runs a full
collection and counts and drops what was kept. An object of the sidecar's that is freed by
reference counting is never seen there. Off by default: kept garbage is memory a measurement
of it (``tests/load/idle_memory.py``) must not see.

:func:`sidecar_process` is the test side: it starts the process, waits for the ready line
(bounded) and kills the process on exit.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from collections import Counter
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


async def _serve(config: Path, text: str, count_cycles: bool) -> None:
    settings = parse_config(text, str(config), env={})
    servers = await server.start(settings)
    if count_cycles:
        gc.set_debug(gc.DEBUG_SAVEALL)
    cyclic: Counter[str] = Counter()
    print(f"ready {servers.proxy_port} {servers.admin_port}", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        if line.strip() != b"stats":
            continue
        if count_cycles:
            gc.collect()
            cyclic.update(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                          if type(o).__module__.split(".")[0] in ("sidecar", "engine"))
            gc.garbage.clear()
        print(json.dumps({"tasks": len(asyncio.all_tasks()), "cyclic": cyclic}), flush=True)
    await servers.stop(0.0)


class SidecarProcess:
    """A running sidecar process: its pid, ports and a way to ask for its task count."""

    def __init__(self, proc: asyncio.subprocess.Process, proxy_port: int,
                 admin_port: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.proxy_port = proxy_port
        self.admin_port = admin_port

    async def stats(self) -> tuple[int, dict[str, int]]:
        """The number of asyncio tasks alive in the sidecar's event loop, counting the
        process's own main task (which answers the query), and the sidecar's objects the cyclic
        collector found since the start, by type (module docstring)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), ANSWER_S)
        answer = json.loads(line)
        return int(answer["tasks"]), dict(answer["cyclic"])


@asynccontextmanager
async def sidecar_process(tmp_path: Path, tree: dict[str, Any], *, count_cycles: bool = False
                          ) -> AsyncIterator[SidecarProcess]:
    """Start the sidecar with config ``tree`` in its own process (``count_cycles``: see the
    module docstring); killed at the end."""
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(tree))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.harness.load.sidecar_process", str(config),
        *(["--count-cycles"] if count_cycles else []), cwd=REPO,
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
        runner.run(_serve(path, path.read_text(), "--count-cycles" in sys.argv[2:]))
