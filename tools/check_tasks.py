"""Lint: every background task of the sidecar starts through ``sidecar.tasks.TaskSet``.

``python -m tools.check_tasks [PATH ...]`` (default: ``sidecar engine``) walks each file's AST
and reports every call that starts a task or future outside ``TaskSet.spawn``:
``asyncio.create_task``/``asyncio.ensure_future`` however imported, and any ``X.create_task(``
or ``X.ensure_future(`` attribute call (``loop.create_task``, ``self._loop.create_task``), which
ruff's banned-api rule (TID251) cannot match by name. Exit 1 with one ``path:line: message``
per finding, 0 when clean.

An exception is allowed per function, not per line number (so edits around it do not move it),
in :data:`ALLOWED` below, with the reason it is not background work or cannot be a ``TaskSet``
task. ``sidecar/tasks.py`` itself is the one place that calls ``create_task``.

Scope: ``sidecar/`` and ``engine/``, the code that runs in production, where an unnamed,
unreferenced task can be collected mid-flight or escape the shutdown drain. Not ``tests/``,
``bench/`` or ``demo/``: their tasks are clients, probes and fakes, each created, awaited and
cancelled inside the test or run that owns it; routing them through the sidecar's ``TaskSet``
would tie the harness to the code under test.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("sidecar", "engine")
HOME = "sidecar/tasks.py"
STARTERS = frozenset({"create_task", "ensure_future"})

# (path relative to the repo root, qualified name of the enclosing function) -> why it is allowed
ALLOWED: dict[tuple[str, str], str] = {
    ("sidecar/workers.py", "Supervisor._reap"):
        "futures of the worker processes' wait(), held in the method's own dict and awaited by "
        "its loop until every worker has exited; they end with the processes, not background work",
    ("sidecar/abort_wire.py", "AbortPool._keep_warm"):
        "the keeper lives as long as the pool (an unreachable engine is retried forever) and must "
        "not hold the shutdown drain; strongly held in self._keeper, named, close() cancels it",
    ("sidecar/cancel.py", "WorkerCanceller.__call__"):
        "one ask per worker, named, held in the handler's own set, awaited there and cancelled in "
        "its finally: scoped to the request, not background work",
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    call: str
    where: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.call}() in {self.where or '<module>'}: start "
                f"background work with sidecar.tasks.TaskSet.spawn (named, strongly held, "
                f"drained at shutdown), or allow it in tools/check_tasks.py with a reason")


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.asyncio_names: set[str] = set()  # names bound by `from asyncio import create_task`
        self.findings: list[Finding] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "asyncio":
            for alias in node.names:
                if alias.name in STARTERS:
                    self.asyncio_names.add(alias.asname or alias.name)

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _scoped
    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = None
        if isinstance(func, ast.Attribute) and func.attr in STARTERS:
            name = ast.unparse(func)
        elif isinstance(func, ast.Name) and func.id in self.asyncio_names:
            name = func.id
        if name is not None:
            self.findings.append(Finding(self.path, node.lineno, name, ".".join(self.scope)))
        self.generic_visit(node)


def task_starts(source: str, path: str) -> list[Finding]:
    """Every call in ``source`` (the text of ``path``) that starts a task, allowed or not."""
    visitor = _Visitor(path)
    visitor.visit(ast.parse(source, filename=path))
    return visitor.findings


def check_source(source: str, path: str) -> list[Finding]:
    """The findings in ``source`` (the text of ``path``, relative to the repo root), allowances
    applied."""
    if path == HOME:
        return []
    return [f for f in task_starts(source, path) if (f.path, f.where) not in ALLOWED]


def python_files(paths: list[str]) -> Iterator[Path]:
    for name in paths:
        path = ROOT / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def main(argv: list[str]) -> int:
    findings: list[Finding] = []
    for file in python_files(argv or list(DEFAULT_PATHS)):
        rel = file.resolve().relative_to(ROOT).as_posix()
        findings += check_source(file.read_text(), rel)
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
