"""Profile evidence for the report: where the sidecar spends its CPU under stream load.

:func:`record` attaches ``py-spy record --format raw --nonblocking`` to the sidecar process
(``--workers 1``) while the load client runs N streams through it, in a phase of its own so
the sampling never perturbs the measured phases. :func:`summarise` turns py-spy's collapsed
stacks (``frame;frame;... count``, frames ``function (file)``) into the share of samples:

- by package of the innermost Python frame (self time): sidecar, aiohttp, asyncio, ...; a
  sample whose innermost Python frame is the event loop's entry (``Runner.run``) is time in
  uvloop's C code and the kernel (py-spy without ``--native`` sees no deeper);
- by innermost function (top N);
- inclusive, for the sidecar's own functions (the sample's stack passes through them).

py-spy drops samples of an idle thread (without ``--idle``), so shares are of busy time.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_LOOP_FRAMES = frozenset({"Runner.run (asyncio/runners.py)",
                          "run_until_complete (asyncio/base_events.py)"})
_ENTRY_FRAMES = frozenset({"<module> (sidecar/__main__.py)", "main (sidecar/cli.py)",
                           "_run_module_as_main (<frozen runpy>)", "_run_code (<frozen runpy>)"})
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*)\)$")


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def _package(file: str) -> str:
    """py-spy shortens file names to their package part: ``aiohttp/web_protocol.py``."""
    if file.startswith("<"):
        return "interpreter"
    parts = file.split("/")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def summarise(raw: str, top: int = 12) -> dict[str, Any]:
    by_package: Counter[str] = Counter()
    by_leaf: Counter[str] = Counter()
    sidecar_inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaf = frames[-1]
        m = _FRAME.match(leaf)
        file = m["file"] if m else leaf
        if leaf in _LOOP_FRAMES:
            # No Python frame below the loop's entry: uvloop's C code (socket reads and
            # writes, the timer heap, calling into transports) or the kernel under it.
            leaf = "event loop: uvloop C code, syscalls"
            by_package["uvloop (C) and kernel"] += count
        else:
            by_package[_package(file)] += count
        by_leaf[leaf] += count
        seen = set()
        for frame in frames:
            fm = _FRAME.match(frame)
            if fm and fm["file"].split("/")[0] in ("sidecar", "engine") \
                    and frame not in _ENTRY_FRAMES and frame not in seen:
                seen.add(frame)
                sidecar_inclusive[frame] += count

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in counter.most_common(n)] if total else []

    return {"samples": total, "by_package": shares(by_package, 10),
            "by_function": shares(by_leaf, top), "sidecar_inclusive": shares(sidecar_inclusive,
                                                                             top)}


def _written(path: Path) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0


async def record(pid: int, seconds: float, out: Path) -> tuple[bool, str]:
    """Sample ``pid`` for ``seconds`` into ``out`` (raw format); (ok, py-spy's messages)."""
    binary = py_spy()
    if binary is None:
        return False, "py-spy is not installed"
    proc = await asyncio.create_subprocess_exec(
        binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", "250", "--format", "raw", "--nonblocking", "--nolineno", "--output", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    text, _ = await asyncio.wait_for(proc.communicate(), seconds + 30)
    return proc.returncode == 0 and _written(out), text.decode(errors="replace")[-2000:]
