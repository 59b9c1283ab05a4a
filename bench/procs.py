"""The processes of a benchmark run: fake engine, load client, cancel-sidecar, nginx.

Each runs as its own OS process on 127.0.0.1, started as production starts it (the sidecar
through its CLI, ``python -m sidecar --config FILE``; nginx as ``nginx -c FILE -p DIR -g 'daemon
off;'``), with stdout and stderr in files of the run's temp dir, and is stopped at the end, also
on errors. :class:`Proc` reads a process tree's CPU seconds and resident memory (psutil), so
every phase can say what each process cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
READY_S = 30.0


class Proc:
    """A started process (and its children: sidecar workers, nginx workers)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_dir = log_dir
        self.port = 0

    def tree(self) -> list[psutil.Process]:
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_s(self) -> float:
        """User + system CPU seconds used so far by the process and its live children."""
        total = 0.0
        for p in self.tree():
            with suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_bytes(self) -> int:
        """Resident memory of the process and its children, bytes."""
        total = 0
        for p in self.tree():
            with suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for f in sorted(self.log_dir.glob(f"{self.name}.*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    async def stop(self, sig: signal.Signals = signal.SIGTERM, within_s: float = 10.0) -> None:
        if self.proc.returncode is not None:
            return
        children = self.tree()[1:]
        with suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        try:
            await asyncio.wait_for(self.proc.wait(), within_s)
        except TimeoutError:
            for child in children:
                with suppress(psutil.NoSuchProcess):
                    child.kill()
            with suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


async def _spawn(name: str, argv: list[str], log_dir: Path, *, stdin: bool = False,
                 cwd: Path = REPO) -> Proc:
    # Plain files, not pipes: nothing has to read them for the child to go on writing.
    out = open(log_dir / f"{name}.stdout", "wb")  # noqa: ASYNC230 - local file, at start
    err = open(log_dir / f"{name}.stderr", "wb")  # noqa: ASYNC230
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdout=asyncio.subprocess.PIPE if stdin else out, stderr=err,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL)
    finally:
        out.close()
        err.close()
    return Proc(name, proc, log_dir)


async def _wait_line(proc: Proc, pattern: str) -> re.Match[str]:
    """Wait for a line of the process's stdout file to match ``pattern``."""
    path = proc.log_dir / f"{proc.name}.stdout"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            if m := re.search(pattern, line):
                return m
        if proc.proc.returncode is not None:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not print {pattern!r} within {READY_S} s:\n"
                       f"{proc.log_tail()}")


async def start_engine(log_dir: Path, api_servers: int = 1, name: str = "engine") -> Proc:
    """``python -m bench.engine --api-servers N`` (:mod:`bench.engine`)."""
    proc = await _spawn(name, [sys.executable, "-m", "bench.engine", "--api-servers",
                               str(api_servers)], log_dir)
    proc.port = int((await _wait_line(proc, r"bench-engine: 127\.0\.0\.1:(\d+)"))[1])
    return proc


async def start_sidecar(log_dir: Path, engine_port: int, workers: int,
                        name: str | None = None, repo: Path = REPO) -> Proc:
    """``python -m sidecar --config FILE --workers N`` in front of the engine, WARNING logs;
    the process is named ``name`` (default ``sidecar-wN``) in the run's logs; ``repo``: the
    checkout whose ``sidecar`` package runs (default this one)."""
    name = name or f"sidecar-w{workers}"
    config = log_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": None,
        "engines": {"local": {"kind": "vllm", "url": f"http://127.0.0.1:{engine_port}",
                              "abort": {"timeout_s": 2.0}}},
        "routes": [{"prefix": "/", "engine": "local"}],
        "log_level": "WARNING",
        "log_format": "text",
    }))
    proc = await _spawn(name, [sys.executable, "-m", "sidecar", "--config", str(config),
                               "--workers", str(workers)], log_dir, cwd=repo)
    # The ready line (sidecar.server.ReadyLine): text here (log_format above); its JSON form's
    # msg holds the same text, so the search finds it in either.
    proc.port = int((await _wait_line(proc, r"cancel-sidecar: proxy on 127\.0\.0\.1:(\d+)"))[1])
    return proc


async def start_floor(log_dir: Path, engine_port: int, downstream: str) -> Proc:
    """``python -m bench.floor`` (:mod:`bench.floor`) in front of the engine: ``raw`` or
    ``aiohttp`` downstream."""
    proc = await _spawn(f"floor-{downstream}", [
        sys.executable, "-m", "bench.floor", "--engine-port", str(engine_port),
        "--downstream", downstream], log_dir)
    proc.port = int((await _wait_line(proc, r"bench-floor: 127\.0\.0\.1:(\d+)"))[1])
    return proc


NGINX_CONF = """\
# Generated by bench/procs.py: nginx as a streaming reverse proxy in front of the fake engine.
worker_processes {workers};
worker_rlimit_nofile {nofile};
error_log {dir}/nginx-error.log warn;
pid {dir}/nginx.pid;
events {{
    worker_connections {connections};
}}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096 reuseport;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


async def start_nginx(log_dir: Path, engine_port: int, workers: int, nofile: int) -> Proc:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install -y nginx-light)")
    port = free_port()
    prefix = log_dir / "nginx"
    prefix.mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(
        workers=workers, nofile=nofile, dir=prefix, connections=max(1024, nofile - 100),
        engine_port=engine_port, port=port))
    proc = await _spawn("nginx", [binary, "-c", str(conf), "-p", str(prefix),
                                  "-g", "daemon off;"], log_dir)
    proc.port = port
    deadline = time.monotonic() + READY_S
    while True:
        try:
            status, _ = await http_get(port, "/health")
            if status == 200:
                return proc
        except OSError:
            pass
        if proc.proc.returncode is not None or time.monotonic() > deadline:
            error_log = (prefix / "nginx-error.log")
            raise RuntimeError("nginx did not start:\n" + proc.log_tail() + (
                error_log.read_text() if error_log.exists() else ""))
        await asyncio.sleep(0.05)


def nginx_version() -> str:
    binary = nginx_binary()
    if binary is None:
        return "not installed"
    import subprocess
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: nginx/")


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, Any]:
    """A one-shot HTTP/1.1 request (``Connection: close``) -> (status, parsed JSON or None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
                     "Connection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


class LoadClient:
    """The load client process (:mod:`bench.client`): one JSON command in, one JSON line out."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, log_dir: Path) -> LoadClient:
        proc = await _spawn("client", [sys.executable, "-m", "bench.client"], log_dir,
                            stdin=True)
        client = cls(proc)
        ready = await client._read(READY_S)
        if not ready.get("ready"):
            raise RuntimeError(f"load client did not start: {ready}")
        return client

    async def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError("load client exited:\n" + self.proc.log_tail())
        result: dict[str, Any] = json.loads(line)
        return result

    async def call(self, cmd: str, timeout_s: float = 300.0, **args: Any) -> dict[str, Any]:
        assert self.proc.proc.stdin is not None
        self.proc.proc.stdin.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        await self.proc.proc.stdin.drain()
        return await self._read(timeout_s)
