"""``tools/check_tasks.py``, the lint that keeps the sidecar's background tasks in ``TaskSet``:
it finds every way of starting a task in a bad snippet, and none in the tree (``make lint``
runs it on ``sidecar`` and ``engine``)."""

from __future__ import annotations

from tools import check_tasks
from tools.check_tasks import ALLOWED, ROOT, check_source, task_starts

BAD = '''
import asyncio
from asyncio import create_task as start, ensure_future


async def handler(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.create_task(work())
    asyncio.ensure_future(work())
    start(work())
    ensure_future(work())
    loop.create_task(work())
    asyncio.get_running_loop().create_task(work(), name="named but unreferenced")
'''


def test_every_way_of_starting_a_task_is_found() -> None:
    found = [(f.line, f.call, f.where) for f in check_source(BAD, "sidecar/bad.py")]
    assert found == [
        (7, "asyncio.create_task", "handler"),
        (8, "asyncio.ensure_future", "handler"),
        (9, "start", "handler"),
        (10, "ensure_future", "handler"),
        (11, "loop.create_task", "handler"),
        (12, "asyncio.get_running_loop().create_task", "handler"),
    ], f"expected all six task starts found, got {found}"
    message = str(check_source(BAD, "sidecar/bad.py")[0])
    assert message.startswith("sidecar/bad.py:7: asyncio.create_task() in handler: "), message
    assert "TaskSet.spawn" in message, message


def test_taskset_itself_and_allowed_functions_are_not_findings() -> None:
    assert check_source(BAD, "sidecar/tasks.py") == [], "sidecar/tasks.py is TaskSet's home"
    path, where = next(iter(ALLOWED))
    cls, _, func = where.rpartition(".")
    allowed = (f"import asyncio\nclass {cls}:\n    def {func}(self):\n"
               "        asyncio.ensure_future(x)\n")
    assert check_source(allowed, path) == [], f"expected {path}:{where} allowed"
    assert len(check_source(allowed, "sidecar/other.py")) == 1, "an allowance is per file"


def test_the_tree_is_clean() -> None:
    assert check_tasks.main([]) == 0, "tools/check_tasks.py found a task outside TaskSet"


def test_every_allowance_still_names_a_task_start() -> None:
    """A stale allowance (its function gone or no longer starting a task) would let a new task
    in unseen."""
    for path, where in ALLOWED:
        starts = task_starts((ROOT / path).read_text(), path)
        assert any(f.where == where for f in starts), (
            f"allowance {path}:{where} starts no task any more: remove it")
