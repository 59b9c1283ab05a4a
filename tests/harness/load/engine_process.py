"""The fake engine in a process of its own, for load tests whose clients would otherwise share
its event loop (and so delay the very abort calls being timed).

``python -m tests.harness.load.engine_process`` starts :class:`tests.fakes.engine.FakeEngine` on
uvloop and prints ``ready PORT``. Queries on stdin, one per line, each answered with one JSON line:

- ``aborts K``: the abort calls from the K-th on (arrival order), as ``[[at, [ids...]], ...]``;
  ``at`` is ``time.monotonic()`` in the engine process when the call arrived (the clock is the
  system's monotonic clock, the same in every process);
- ``closed``: the ``X-Request-Id`` of every generation the engine stopped early: its connection
  went away, or an abort named it (the fake then ends it at once, as vLLM does; the sidecar
  reads that end as its confirmation and closes nothing).

End of stdin stops it. :func:`engine_process` is the test side: it starts the process, waits for
the ready line (bounded) and kills the process on exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import uvloop

from tests.fakes.engine import FakeEngine
from tests.harness.load.sidecar_process import ANSWER_S, READY_S, REPO

POLL_S = 0.005  # between queries while waiting for a condition


async def _serve() -> None:
    engine = FakeEngine()
    await engine.start()
    print(f"ready {engine.port}", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    record = engine.record
    while line := await stdin.readline():
        words = line.split()
        answer: Any = None
        if words[:1] == [b"aborts"]:
            answer = [[a.at, a.ids] for a in record.aborts[int(words[1]):]]
        elif words == [b"closed"]:
            answer = [g.request_id for g in record.generations if g.stopped_at is not None]
        print(json.dumps(answer), flush=True)
    await engine.stop()


class EngineProcess:
    """A running fake engine process: its url and what it recorded, fetched on demand."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.aborts: list[tuple[float, list[str]]] = []  # (arrival, ids), as fetched so far
        self._lock = asyncio.Lock()

    async def _ask(self, query: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self._lock:
            self.proc.stdin.write(query.encode() + b"\n")
            await self.proc.stdin.drain()
            return json.loads(await asyncio.wait_for(self.proc.stdout.readline(), ANSWER_S))

    async def fetch_aborts(self) -> list[tuple[float, list[str]]]:
        """Every abort call so far, in arrival order (fetching only the new ones)."""
        self.aborts += [(at, ids) for at, ids in await self._ask(f"aborts {len(self.aborts)}")]
        return self.aborts

    def aborted_ids(self) -> list[str]:
        return [i for _, ids in self.aborts for i in ids]

    async def closed(self) -> set[str | None]:
        """Request ids of the generations whose connection went away before their end."""
        return set(await self._ask("closed"))

    async def until(self, fetch: Callable[[], Any], predicate: Callable[[], bool],
                    within_s: float) -> bool:
        """Poll (``await fetch()``, then ``predicate()``) every ``POLL_S`` until it holds;
        ``False`` if it still does not after ``within_s`` seconds."""
        deadline = time.monotonic() + within_s
        while True:
            await fetch()
            if predicate():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)


@asynccontextmanager
async def engine_process() -> AsyncIterator[EngineProcess]:
    """Start the fake engine in its own process; killed at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.harness.load.engine_process", cwd=REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), READY_S)).decode().split()
        assert len(line) == 2 and line[0] == "ready", (
            f"expected 'ready PORT' from the engine process, got {line!r}")
        yield EngineProcess(proc, int(line[1]))
    finally:
        if proc.returncode is None:
            with suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve())
