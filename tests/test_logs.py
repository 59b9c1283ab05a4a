"""Logs, as the real CLI writes them: ``python -m sidecar`` as a subprocess, its stderr read
after it stopped.

By default every record is one JSON object per line, and every request gets exactly one access
line (``msg: "request"``), written once the request and its abort call are both done
(:mod:`sidecar.logs`). ``--log-format text`` / ``log_format: text`` gives readable lines with
the same facts. Every line on stdout is in the log format too: the one ready line
(:class:`sidecar.server.ReadyLine`), a JSON object like the log lines by default. No run ever
logs a secret: not the abort key, not a client's ``Authorization`` header, not a query string.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from sidecar.config import parse_config
from sidecar.errors import ConfigError
from sidecar.server import ReadyLine, Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.fakes.upstreams import refused_port
from tests.harness.support import WAIT_S, Stalls, raw_client, request_body, wait_metric

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
CLI_GUARD_S = 30.0  # a subprocess starting (imports) or stopping on a loaded machine
ABORT_KEY = "abort-sekret-key-5678"
CLIENT_AUTH = "Bearer client-sekret-token-9012"
QUERY_SECRET = "query-sekret-3456"
SECRETS = (ABORT_KEY, CLIENT_AUTH, "client-sekret-token", QUERY_SECRET, "Bearer")
ACCESS_FIELDS = {"ts", "level", "logger", "msg", "request_id", "client_request_id", "route",
                 "engine", "method", "path", "status", "duration_s", "bytes_sent",
                 "client_disconnected", "phase", "cancel_reason", "abort",
                 "abort_latency_s", "kept_by_engine"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"




@dataclass
class Cli:
    port: int
    admin: int
    stdout: str = ""
    stderr: str = ""


@asynccontextmanager
async def cli(tmp_path: Path, engine: FakeEngine, *args: str,
              **config: Any) -> AsyncIterator[Cli]:
    """``python -m sidecar --config FILE *args`` with free ports, engines ``local`` (the fake
    engine, abort key :data:`ABORT_KEY`) on ``/`` and ``down`` (nothing listens) on ``/down``;
    ``config`` adds top-level keys. On exit: SIGTERM, exit 0 checked, ``stdout``/``stderr``
    filled in."""
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {
            "local": {"kind": "vllm", "url": engine.url,
                      "abort": {"api_key": ABORT_KEY, "timeout_s": 2.0, "resend_window_s": 0}},
            "down": {"kind": "vllm", "url": f"http://127.0.0.1:{refused_port()}"}},
        "routes": [{"prefix": "/down", "engine": "down"}, {"prefix": "/", "engine": "local"}],
        **config,
    }))
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--config", str(path), *args, cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        assert proc.stdout is not None
        first = ""
        try:
            first = (await asyncio.wait_for(proc.stdout.readline(), CLI_GUARD_S)).decode()
            ready = ReadyLine.parse(first)
            assert ready is not None and ready.admin_port is not None, (
                f"expected the ready line, got {first!r}; stderr: {stderr_path.read_text()}")
            run = Cli(ready.proxy_port, ready.admin_port)
            yield run
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rest, _ = await asyncio.wait_for(proc.communicate(), CLI_GUARD_S)
            except TimeoutError:
                proc.kill()
                await proc.communicate()
                raise AssertionError(
                    f"expected the CLI to stop within {CLI_GUARD_S}s of SIGTERM; it did not"
                ) from None
    assert proc.returncode == 0, (f"expected exit 0 after SIGTERM, got {proc.returncode}; "
                                  f"stderr: {stderr_path.read_text()}")
    run.stdout = first + rest.decode()
    run.stderr = stderr_path.read_text()


def assert_no_secrets(run: Cli) -> None:
    for secret in SECRETS:
        for name, text in (("stderr", run.stderr), ("stdout", run.stdout)):
            assert secret not in text, (
                f"expected no {secret!r} in the CLI's {name}; found it in:\n{text}")


async def test_json_lines_one_access_line_per_request_and_no_secrets(
        engine: FakeEngine, tmp_path: Path, stalls: Stalls) -> None:
    headers = {"Authorization": CLIENT_AUTH, "X-Request-Id": "client-7"}
    async with cli(tmp_path, engine, log_level="DEBUG") as run:
        base = f"http://127.0.0.1:{run.port}"
        async with aiohttp.ClientSession() as s:
            # A stream read to its end.
            async with asyncio.timeout(WAIT_S):
                async with s.post(f"{base}{CHAT}?tokens=3&interval=0.001&api_key={QUERY_SECRET}",
                                  json={"messages": [], "stream": True}, headers=headers) as r:
                    done_body = await r.read()
            assert r.status == 200, f"expected 200 for the stream, got {r.status}"
            done_id = r.headers["X-Request-Id"]
            # The engine is down: 502.
            async with asyncio.timeout(WAIT_S):
                async with s.get(f"{base}/down/v1/models?key={QUERY_SECRET}") as r:
                    bad_body = await r.read()
            assert r.status == 502, f"expected 502 from an engine that is down, got {r.status}"
            bad_id = r.headers["X-Request-Id"]
        # A stream the client leaves (RST) after its first event.
        async with raw_client(run.port, stalls) as c:
            c.send("POST", f"{COMPLETIONS}?tokens=1000&token={QUERY_SECRET}",
                   request_body({"prompt": "a"}, True), [("Authorization", CLIENT_AUTH)])
            status, head = await c.head()
            assert status == 200, f"expected a 200 stream, got {status}"
            await c.read_until(b"data:")
            c.disconnect("rst")
        gone_id = head["X-Request-Id"]
        await wait_metric(stalls, run.admin, "cancel_sidecar_abort_calls_total", 1,
                          engine="local", outcome="accepted")

    lines = [line for line in run.stderr.splitlines() if line]
    assert lines, "expected log lines on stderr"
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"expected one JSON object per line, got {line!r}") from None
    for record in records:
        assert {"ts", "level", "logger", "msg"} <= record.keys(), f"missing fields: {record}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["ts"]), record
    assert any("proxy listening" in r["msg"] for r in records), (
        f"expected the startup record through the same formatter, got {records}")

    access = [r for r in records if r["msg"] == "request"]
    ids = sorted(r["request_id"] for r in access)
    assert ids == sorted([done_id, bad_id, gone_id]), (
        f"expected exactly one access line for each of {[done_id, bad_id, gone_id]}, got {ids}")
    by_id = {r["request_id"]: r for r in access}
    for record in access:
        assert record.keys() == ACCESS_FIELDS, (
            f"expected the fields {sorted(ACCESS_FIELDS)}, got {sorted(record)}")
        assert record["level"] == "INFO" and record["logger"] == "sidecar.access", record
        assert isinstance(record["duration_s"], float) and record["duration_s"] >= 0, record

    expected_done = {"client_request_id": "client-7", "route": "/", "engine": "local",
                     "method": "POST", "path": CHAT, "status": 200,
                     "bytes_sent": len(done_body), "client_disconnected": False,
                     "phase": None, "abort": None, "abort_latency_s": None}
    got = {k: by_id[done_id][k] for k in expected_done}
    assert got == expected_done, f"completed stream: expected {expected_done}, got {got}"

    expected_bad = {"client_request_id": None, "route": "/down", "engine": "down",
                    "method": "GET", "path": "/down/v1/models", "status": 502,
                    "bytes_sent": len(bad_body), "client_disconnected": False,
                    "phase": None, "abort": None, "abort_latency_s": None}
    got = {k: by_id[bad_id][k] for k in expected_bad}
    assert got == expected_bad, f"502: expected {expected_bad}, got {got}"

    gone = by_id[gone_id]
    expected_gone = {"client_request_id": None, "route": "/", "engine": "local",
                     "method": "POST", "path": COMPLETIONS, "status": 200,
                     "client_disconnected": True, "phase": "streaming", "abort": "confirmed"}
    got = {k: gone[k] for k in expected_gone}
    assert got == expected_gone, f"disconnected stream: expected {expected_gone}, got {got}"
    assert gone["bytes_sent"] > 0, f"expected the first event counted in bytes_sent: {gone}"
    assert isinstance(gone["abort_latency_s"], float) and gone["abort_latency_s"] >= 0, gone

    assert_no_secrets(run)


@pytest.mark.parametrize("how", ["flag", "config"])
async def test_text_format_is_one_readable_line(engine: FakeEngine, tmp_path: Path,
                                                how: str) -> None:
    args = ("--log-format", "text") if how == "flag" else ()
    config = {"log_format": "json" if how == "flag" else "text"}
    async with cli(tmp_path, engine, *args, **config) as run:
        async with aiohttp.ClientSession() as s, asyncio.timeout(WAIT_S):
            async with s.post(f"http://127.0.0.1:{run.port}{CHAT}?tokens=2&x={QUERY_SECRET}",
                              json={"messages": [], "stream": True},
                              headers={"Authorization": CLIENT_AUTH}) as r:
                body = await r.read()
        assert r.status == 200, f"expected 200, got {r.status}"
        rid = r.headers["X-Request-Id"]
    lines = run.stderr.splitlines()
    for line in lines:
        assert not line.startswith("{"), f"expected text lines, got JSON: {line!r}"
    access = [line for line in lines if f"request_id={rid}" in line]
    assert len(access) == 1, f"expected one access line for {rid}, got {access}"
    for fact in ("INFO sidecar.access request ", f"path={CHAT} ", "method=POST ", "status=200 ",
                 f"bytes_sent={len(body)} ", "client_disconnected=false ", "phase=- ",
                 "abort=- ", "route=/ ", "engine=local "):
        assert fact in access[0], f"expected {fact!r} in the access line, got {access[0]!r}"
    assert any("INFO sidecar.server proxy listening" in line for line in lines), (
        f"expected the startup line in the same text format, got {lines}")
    assert_no_secrets(run)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_stdout_is_the_ready_line_in_the_log_format(
        engine: FakeEngine, tmp_path: Path, fmt: str, workers: str) -> None:
    """One pod stream carries stdout and stderr together: with JSON logs every line of both is a
    JSON object (the ready line too, ``event: ready`` with both addresses, and its ``msg`` the
    text form); with text logs the ready line is the text form. Under ``--workers`` the
    supervisor prints it once (the workers' own lines are read by the supervisor)."""
    async with cli(tmp_path, engine, "--workers", workers, log_format=fmt) as run:
        pass
    lines = run.stdout.splitlines()
    text = (f"cancel-sidecar: proxy on 127.0.0.1:{run.port}, "
            f"admin on 127.0.0.1:{run.admin}")
    if fmt == "text":
        assert lines == [text], f"expected the text ready line alone on stdout, got {lines}"
        return
    assert len(lines) == 1, f"expected the ready line alone on stdout, got {lines}"
    record = json.loads(lines[0])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record.pop("ts")), record
    assert record == {"level": "INFO", "logger": "sidecar", "msg": text, "event": "ready",
                      "proxy": f"127.0.0.1:{run.port}", "admin": f"127.0.0.1:{run.admin}"}, (
        record)
    for line in run.stderr.splitlines():
        try:
            json.loads(line)
        except ValueError:
            raise AssertionError(f"expected only JSON lines on stderr, got {line!r}") from None


@pytest.mark.parametrize("line", [
    "cancel-sidecar: proxy on 127.0.0.1:8080, admin on 127.0.0.1:9090",
    '{"ts": "2026-12-04T12:00:00.000Z", "level": "INFO", "logger": "sidecar", "msg": '
    '"cancel-sidecar: proxy on 127.0.0.1:8080, admin on 127.0.0.1:9090", "event": "ready", '
    '"proxy": "127.0.0.1:8080", "admin": "127.0.0.1:9090"}',
])
def test_the_ready_line_reads_the_same_in_either_format(line: str) -> None:
    ready = ReadyLine.parse(line + "\n")
    assert ready == ReadyLine("127.0.0.1:8080", "127.0.0.1:9090"), ready
    assert ready is not None and (ready.proxy_port, ready.admin_port) == (8080, 9090), ready
    assert ReadyLine.parse(ready.render("text")) == ready == ReadyLine.parse(
        ready.render("json")), ready


@pytest.mark.parametrize("line", [
    "", "cancel-sidecar: proxy on 127.0.0.1", "cancel-sidecar: proxy on h:1, admin on h",
    '{"event": "ready"}', '{"event": "started", "proxy": "h:1"}', "{not json",
    '{"ts": "x", "level": "INFO", "logger": "sidecar", "msg": "proxy listening"}',
])
def test_other_lines_are_no_ready_line(line: str) -> None:
    assert ReadyLine.parse(line) is None, line


def test_log_format_config_is_validated() -> None:
    text = yaml.safe_dump({"engines": {"e": {"kind": "vllm", "url": "http://127.0.0.1:1"}},
                           "routes": [{"prefix": "/", "engine": "e"}], "log_format": "xml"})
    with pytest.raises(ConfigError) as info:
        parse_config(text, "<test>", env={})
    message = str(info.value)
    assert "log_format" in message and "'json'" in message and "'text'" in message, (
        f"expected log_format's problem naming json and text, got {message}")


class AccessLines(logging.Handler):
    """Collects the access lines' fields; ``enough`` is set once ``want`` lines arrived."""

    def __init__(self, want: int) -> None:
        super().__init__()
        self.want = want
        self.lines: list[dict[str, Any]] = []
        self.enough = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(dict(getattr(record, "access", {})))
        if len(self.lines) >= self.want:
            self.enough.set()


@pytest.fixture(name="access_lines")
def access_lines_handler() -> Iterator[AccessLines]:
    logger = logging.getLogger("sidecar.access")
    handler, level = AccessLines(2), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_access_line_for_a_first_byte_timeout_and_an_unrouted_path(
        engine: FakeEngine, start_sidecar: Callable[..., Any],
        access_lines: AccessLines) -> None:
    """In process (the production wiring): a 504 aborts the engine, and its line waits for the
    abort's outcome; a path no route matches still gets its line."""
    servers: Servers = await start_sidecar(sidecar_settings(
        engine.url, upstream={"first_byte_timeout_s": 0.3},
        routes=[{"prefix": "/v1", "engine": "local"}]))
    base = f"http://127.0.0.1:{servers.proxy_port}"
    async with aiohttp.ClientSession() as s, asyncio.timeout(WAIT_S):
        async with s.post(f"{base}{CHAT}?first_byte_delay=5",
                          json={"messages": [], "stream": True}) as r:
            await r.read()
        assert r.status == 504, f"expected 504 after first_byte_timeout_s, got {r.status}"
        timed_out = r.headers["X-Request-Id"]
        async with s.get(f"{base}/elsewhere?q=1") as r:
            unrouted_body = await r.read()
        assert r.status == 404, f"expected 404 for a path no route matches, got {r.status}"
    try:
        await asyncio.wait_for(access_lines.enough.wait(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"expected two access lines within {WAIT_S}s, got "
                             f"{access_lines.lines}") from None
    got = access_lines.lines
    assert len(got) == 2, f"expected two access lines (504, 404), got {got}"
    by_path = {line["path"]: line for line in got}
    expected_504 = {"request_id": timed_out, "route": "/v1", "engine": "local", "status": 504,
                    "client_disconnected": False, "phase": "before_first_byte", "abort": "accepted"}
    line = by_path.get(CHAT, {})
    assert {k: line.get(k) for k in expected_504} == expected_504, (
        f"504: expected {expected_504}, got {line}")
    expected_404 = {"route": None, "engine": None, "method": "GET", "status": 404,
                    "bytes_sent": len(unrouted_body), "client_disconnected": False,
                    "phase": None, "abort": None}
    line = by_path.get("/elsewhere", {})
    assert {k: line.get(k) for k in expected_404} == expected_404, (
        f"unrouted: expected {expected_404}, got {line}")
