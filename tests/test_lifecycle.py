"""Lifecycle of the real CLI process: SIGTERM drains (finish within the grace period, cancel and
abort the rest, refuse new connections meanwhile, exit 0) and SIGHUP reloads the config (a good
one applies to new requests while streams in flight continue; a bad one is logged and ignored).

The sidecar is ``python -m sidecar`` (:mod:`tests.harness.cli_process`); the engine is
:mod:`tests.fakes.engine`, in this process. Waits are for events (a stream chunk, a log line, the
engine's record, the process exit), each with a guard timeout. Timings are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.engine import FakeEngine
from tests.harness.cli_process import CliProcess, cli_process, config_tree

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
WAIT_S = 10.0


async def open_stream(session: aiohttp.ClientSession, cli: CliProcess, query: str
                      ) -> tuple[aiohttp.ClientResponse, bytes]:
    """POST a streaming completion; returns the response and its first chunk."""
    resp = await session.post(f"http://127.0.0.1:{cli.proxy_port}{COMPLETIONS}?{query}",
                              json={"prompt": "a", "stream": True})
    assert resp.status == 200, f"expected 200, got {resp.status}: {await resp.text()}"
    first = await asyncio.wait_for(resp.content.readany(), WAIT_S)
    assert first.startswith(b"data:"), f"expected an SSE event, got {first!r}"
    return resp, first


async def read_rest(resp: aiohttp.ClientResponse) -> tuple[bytes, str | None]:
    """The rest of the body, and the error that cut it short (``None`` if it ended cleanly)."""
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(WAIT_S):
            while chunk := await resp.content.readany():
                chunks.append(chunk)
    except aiohttp.ClientPayloadError as exc:
        return b"".join(chunks), type(exc).__name__
    finally:
        resp.release()
    return b"".join(chunks), None


async def connect_refused(port: int) -> str:
    """Try a new TCP connection; returns what happened (``refused`` or ``accepted``)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
    except ConnectionRefusedError:
        return "refused"
    writer.close()
    return "accepted"


async def test_sigterm_lets_a_stream_finish_and_refuses_new_connections(
        engine: FakeEngine, tmp_path: Path) -> None:
    async with cli_process(tmp_path, config_tree(engine.url, grace_s=10.0)) as cli:
        async with aiohttp.ClientSession() as session:
            resp, first = await open_stream(session, cli, "tokens=40&interval=0.03")
            sent = time.monotonic()
            cli.signal(signal.SIGTERM)
            await cli.wait_log("new connections refused")
            during = await connect_refused(cli.proxy_port)
            rest, error = await read_rest(resp)
            code = await cli.wait_exit()
            stopped = time.monotonic() - sent
    body = first + rest
    print(f"[sigterm, stream within grace] exited {stopped * 1000:.0f} ms after SIGTERM")
    assert during == "refused", f"expected new connections refused during the drain, got {during}"
    assert error is None and body.endswith(b"data: [DONE]\n\n"), (
        f"expected the stream complete with [DONE], got error={error}, tail={body[-60:]!r}")
    assert body.count(b"data:") == 41, f"expected 40 events + [DONE], got {body.count(b'data:')}"
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"
    assert engine.record.aborts == [], f"expected no abort, got {engine.record.aborts}"


async def test_sigterm_cancels_a_straggler_after_the_grace_period(
        engine: FakeEngine, tmp_path: Path) -> None:
    grace = 1.0
    async with cli_process(tmp_path, config_tree(engine.url, grace_s=grace)) as cli:
        async with aiohttp.ClientSession() as session:
            resp, _ = await open_stream(session, cli, "tokens=2000&interval=0.01")
            rid = resp.headers["X-Request-Id"]
            sent = time.monotonic()
            cli.signal(signal.SIGTERM)
            rest, error = await read_rest(resp)
            cut_at = time.monotonic()
            code = await cli.wait_exit()
            exited_at = time.monotonic()
    gen = engine.record.generations[0]
    print(f"[sigterm, straggler] grace {grace} s: stream cut {(cut_at - sent) * 1000:.0f} ms, "
          f"exit {(exited_at - sent) * 1000:.0f} ms after SIGTERM")
    assert b"[DONE]" not in rest and error is not None, (
        f"expected the straggler's response cut short (incomplete), got error={error}, "
        f"tail={rest[-60:]!r}")
    assert grace <= cut_at - sent < grace + 3.0, (
        f"expected the stream cut after the {grace} s grace period, got {cut_at - sent:.2f} s")
    assert gen.stopped_at is not None and not gen.finished, (
        f"expected the engine to stop it before the end (aborted, or its upstream closed), got "
        f"finished={gen.finished}, closed_at={gen.closed_at}, aborted_at={gen.aborted_at}")
    ids = [a.ids for a in engine.record.aborts]
    assert ids == [[f"cmpl-{rid}-0"]], f"expected one abort of cmpl-{rid}-0, got {ids}"
    assert engine.record.aborts[0].authorization == "Bearer cli-key"
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"
    assert "cli-key" not in cli.stderr, "the api key appeared in the log"


async def test_sighup_with_a_good_config_routes_new_requests_while_a_stream_continues(
        engine: FakeEngine, tmp_path: Path) -> None:
    second = FakeEngine()
    await second.start()
    try:
        async with cli_process(tmp_path, config_tree(engine.url)) as cli:
            async with aiohttp.ClientSession() as session:
                resp, first = await open_stream(session, cli, "tokens=40&interval=0.03")
                tree = config_tree(engine.url, grace_s=2.0)
                tree["engines"]["second"] = {"kind": "vllm", "url": second.url,
                                             "abort": {"api_key": "second-key"}}
                tree["routes"] = [{"prefix": "/", "engine": "second"}]
                tree["admin"] = {"host": "127.0.0.1", "port": 1}  # needs a restart: ignored
                cli.write_config(tree)
                sent = time.monotonic()
                cli.signal(signal.SIGHUP)
                after = await cli.wait_log("reload of")
                seen = time.monotonic() - sent
                async with session.post(f"http://127.0.0.1:{cli.proxy_port}{COMPLETIONS}",
                                        json={"prompt": "b"}) as new:
                    assert new.status == 200, f"expected 200, got {new.status}"
                    new_id = new.headers["X-Request-Id"]
                rest, error = await read_rest(resp)
            cli.signal(signal.SIGTERM)
            code = await cli.wait_exit()
    finally:
        await second.stop()
    line = cli.stderr_lines[after - 1]
    took = re.search(r"done in ([\d.]+) ms", line)
    print(f"[sighup good] log line seen {seen * 1000:.0f} ms after SIGHUP; "
          f"reload itself {took[1] if took else '?'} ms")
    assert [g.request_id for g in second.record.generations] == [new_id], (
        f"expected the new request at the second engine, got "
        f"{[g.request_id for g in second.record.generations]}")
    assert len(engine.record.generations) == 1, "expected the first engine to see only the stream"
    body = first + rest
    assert error is None and body.endswith(b"data: [DONE]\n\n"), (
        f"expected the in-flight stream complete, got error={error}, tail={body[-60:]!r}")
    assert "engines.second added" in line and "routes:" in line and "grace_period_s" in line, (
        f"expected the applied changes logged, got {line!r}")
    ignored = [x for x in cli.stderr_lines if "admin.port" in x]
    assert ignored and "restart" in ignored[0], (
        f"expected the admin.port change logged as needing a restart, got {ignored}")
    assert "second-key" not in cli.stderr, "the api key appeared in the log"
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"


async def test_sighup_with_a_bad_config_keeps_the_old_one_and_logs_every_problem(
        engine: FakeEngine, tmp_path: Path) -> None:
    async with cli_process(tmp_path, config_tree(engine.url)) as cli:
        bad = config_tree(engine.url, grace_s=-1)
        bad["routes"] = [{"prefix": "/", "engine": "nowhere"}]
        bad["listen"] = {"host": "127.0.0.1", "port": 1}
        cli.write_config(bad)
        cli.signal(signal.SIGHUP)
        after = await cli.wait_log("keeping the running config")
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{cli.proxy_port}{COMPLETIONS}",
                                    json={"prompt": "b"}) as resp:
                status = resp.status
        cli.signal(signal.SIGTERM)
        code = await cli.wait_exit()
    log = "".join(cli.stderr_lines[after - 1:])
    assert status == 200 and len(engine.record.generations) == 1, (
        f"expected the old config to keep serving, got HTTP {status}, "
        f"{len(engine.record.generations)} generation(s) at the engine")
    for located in ("lifecycle.grace_period_s", "routes.0.engine"):
        assert located in log, f"expected the problem at {located} logged, got:\n{log}"
    assert code == 0, f"expected exit 0, got {code}; stderr:\n{cli.stderr}"
