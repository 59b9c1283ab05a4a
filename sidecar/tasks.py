"""The one way the sidecar starts background work.

Every task is named and strongly referenced until it finishes, so the event loop cannot
garbage-collect it mid-flight (asyncio keeps only weak references), and shutdown can wait for
what is still running. Modelled on mitmproxy's ``asyncio_utils.create_task``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class TaskSet:
    """Owns background tasks: ``spawn`` names and keeps them; ``drain`` awaits the rest."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Start ``coro`` as a task called ``name``; an exception it raises is logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for running tasks, and for those they start
        meanwhile (the abort queue starts its next call when one ends), then cancel what is
        left until nothing is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        while self._tasks:
            pending = set(self._tasks)
            for task in pending:
                task.cancel("sidecar shutting down")
            await asyncio.wait(pending)
