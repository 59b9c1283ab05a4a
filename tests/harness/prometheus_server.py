"""A real Prometheus server (Debian's ``prometheus``) on 127.0.0.1, for tests that scrape the
sidecar and read its counters back through the HTTP query API.

:func:`prometheus_server` writes a config scraping ``targets`` every second (and loading
``rule_files``, evaluated every second), starts ``prometheus`` with its own storage directory
and a free port, waits for ``/-/ready`` and yields a :class:`Prometheus`. ``PROMETHEUS`` is the
binary (``None`` when not installed: callers skip).
"""

from __future__ import annotations

import asyncio
import math
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import yaml

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
READY_S = 30.0  # start to /-/ready
SCRAPE_S = 1.0  # scrape and rule evaluation interval
POLL_S = 0.25  # Prometheus is another process: polled, there is no event to await


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """A running Prometheus: instant queries, alerts and rules through its HTTP API."""

    def __init__(self, url: str, session: aiohttp.ClientSession,
                 proc: asyncio.subprocess.Process, log: Path) -> None:
        self.url = url
        self.session = session
        self.proc = proc
        self.log = log

    async def _get(self, path: str, **params: str) -> Any:
        async with self.session.get(self.url + path, params=params) as resp:
            body = await resp.json()
        assert body.get("status") == "success", (
            f"expected a successful answer to {path} {params}, got {body}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now: ``[{"metric": {...}, "value": [t, "v"]}]``."""
        data = await self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"expected a vector for {expr!r}, got {data}"
        result: list[dict[str, Any]] = data["result"]
        return result

    async def values(self, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        """``expr``'s samples keyed by the values of ``labels`` (missing: ``""``)."""
        return {tuple(s["metric"].get(name, "") for name in labels): float(s["value"][1])
                for s in await self.query(expr)}

    async def scalar(self, expr: str) -> float:
        """The single sample of ``expr`` (NaN when there is none)."""
        result = await self.query(expr)
        assert len(result) <= 1, f"expected at most one sample for {expr!r}, got {result}"
        return float(result[0]["value"][1]) if result else math.nan

    async def until(self, expr: str, done: Callable[[float], bool], within_s: float) -> float:
        """Poll ``scalar(expr)`` until ``done(value)``; fails after ``within_s`` seconds."""
        deadline = time.monotonic() + within_s
        value = math.nan
        while time.monotonic() < deadline:
            value = await self.scalar(expr)
            if done(value):
                return value
            await asyncio.sleep(POLL_S)
        raise AssertionError(f"expected {expr!r} to reach the wanted value within {within_s} s, "
                             f"last got {value}; targets: {await self.targets()}")

    async def targets(self) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/targets")
        return [{k: t.get(k) for k in ("scrapeUrl", "health", "lastError")}
                for t in data["activeTargets"]]

    async def alerts(self) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/alerts")
        alerts: list[dict[str, Any]] = data["alerts"]
        return alerts

    async def rules(self) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/rules")
        return [rule for group in data["groups"] for rule in group["rules"]]


@asynccontextmanager
async def prometheus_server(tmp_path: Path, targets: list[str], *,
                            rule_files: tuple[Path, ...] = ()) -> AsyncIterator[Prometheus]:
    """A Prometheus scraping ``targets`` (``host:port``, path ``/metrics``) as job
    ``cancel-sidecar``; stopped (SIGTERM, then SIGKILL) at the end."""
    assert PROMETHEUS is not None, "prometheus is not installed"
    home = tmp_path / "prometheus"
    (home / "data").mkdir(parents=True)
    config = home / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s",
                   "evaluation_interval": f"{SCRAPE_S:g}s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "cancel-sidecar",
                            "static_configs": [{"targets": targets}]}],
    }))
    port = free_port()
    log = home / "prometheus.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            deadline = time.monotonic() + READY_S
            while True:
                with suppress(aiohttp.ClientError):
                    async with session.get(url + "/-/ready") as resp:
                        if resp.status == 200:
                            break
                assert proc.returncode is None and time.monotonic() < deadline, (
                    f"expected Prometheus ready on {url} within {READY_S} s, got exit status "
                    f"{proc.returncode}; log:\n{log.read_text()}")
                await asyncio.sleep(POLL_S)
            yield Prometheus(url, session, proc, log)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
