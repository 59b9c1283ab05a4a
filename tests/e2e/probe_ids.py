"""Probe a real vLLM server: which engine request id does each route use, and does
``POST /inference/v1/abort_requests`` with that id stop generation?

Run against a server started WITH the hide-disconnect middleware (so closing the client
never aborts by itself)::

    PYTHONPATH=/work/main python -m tests.e2e.probe_ids --url http://127.0.0.1:PORT

Without ``--url`` it builds the tiny model and starts its own server. Prints one JSON line
per probe and a summary; exit code 1 if any expectation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import ge
from pathlib import Path
from typing import Any

import httpx

from tests.harness.e2e.vllm_server import parse_metrics

LONG = {"ignore_eos": True}
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)
MAX_TOKENS = 3000


@dataclass
class Probe:
    name: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True
    expect_running: int = 1
    wrong_ids: list[str] = field(default_factory=list)
    # successive abort calls: (ids, expected running after)
    aborts: list[tuple[list[str], int]] = field(default_factory=list)
    # if set: derive ids from first stream chunk: fn(first_json) -> list[str]
    derive: Any = None


async def metrics(c: httpx.AsyncClient, base: str, headers: dict[str, str]) -> dict[str, float]:
    r = await c.get(f"{base}/metrics", headers=headers)
    return parse_metrics(r.text)


async def wait_running(c: httpx.AsyncClient, base: str, hdrs: dict[str, str],
                       pred: Callable[[float], bool], guard_s: float = 10.0,
                       interval: float = 0.01) -> tuple[bool, float, dict[str, float]]:
    t0 = time.monotonic()
    while True:
        m = await metrics(c, base, hdrs)
        if pred(m["running"]):
            return True, time.monotonic() - t0, m
        if time.monotonic() - t0 > guard_s:
            return False, time.monotonic() - t0, m
        await asyncio.sleep(interval)


async def abort(c: httpx.AsyncClient, base: str, ids: list[str], hdrs: dict[str, str]
                ) -> tuple[int, float]:
    t0 = time.monotonic()
    r = await c.post(f"{base}/inference/v1/abort_requests", json={"request_ids": ids}, headers=hdrs)
    return r.status_code, time.monotonic() - t0


async def run_probe(base: str, p: Probe, auth: dict[str, str] | None = None) -> dict[str, Any]:
    auth = auth or {}
    out: dict[str, Any] = {"name": p.name, "ok": True, "notes": []}
    timeout = httpx.Timeout(60.0)
    async with httpx.AsyncClient(timeout=timeout, limits=NO_KEEPALIVE) as mc:
        ok, _, _ = await wait_running(mc, base, auth, lambda r: r == 0, guard_s=60)
        if not ok:
            out["notes"].append("engine not idle before probe")
        first: dict[str, Any] = {}
        first_evt = asyncio.Event()
        resp_headers: dict[str, str] = {}

        async def do_request() -> None:
            async with httpx.AsyncClient(timeout=timeout) as rc:
                hdrs = {**auth, **p.headers}
                if p.stream:
                    async with rc.stream("POST", base + p.path, json=p.body, headers=hdrs) as r:
                        resp_headers.update(r.headers)
                        out["status"] = r.status_code
                        async for line in r.aiter_lines():
                            if line.startswith("data:") and not first:
                                data = line[5:].strip()
                                try:
                                    first.update(json.loads(data))
                                except ValueError:
                                    pass
                                first_evt.set()
                            elif not p.stream:
                                pass
                        first_evt.set()
                else:
                    r = await rc.post(base + p.path, json=p.body, headers=hdrs)
                    resp_headers.update(r.headers)
                    out["status"] = r.status_code
                    try:
                        first.update(r.json())
                    except ValueError:
                        first["raw"] = r.text[:300]
                    first_evt.set()

        task = asyncio.create_task(do_request())
        try:
            ok, _, m = await wait_running(mc, base, auth, lambda r: r >= p.expect_running,
                                          guard_s=15)
            out["running_at_start"] = m["running"]
            if not ok:
                out["ok"] = False
                out["notes"].append(f"never reached running={p.expect_running}")
                await asyncio.wait_for(first_evt.wait(), 20)
                out["first"] = str(first)[:400]
                return out
            if p.stream:
                await asyncio.wait_for(first_evt.wait(), 10)
            out["first_id"] = (first.get("id") or first.get("response", {}).get("id")
                               or first.get("message", {}).get("id"))
            aborts = p.aborts
            if p.derive is not None:
                aborts = [(p.derive(first), 0)]
                out["derived_ids"] = aborts[0][0]
            # wrong ids must not stop anything
            for wid in p.wrong_ids:
                m0 = await metrics(mc, base, auth)
                st, _ = await abort(mc, base, [wid], auth)
                await asyncio.sleep(0.4)
                m1 = await metrics(mc, base, auth)
                still = (m1["running"] == p.expect_running
                         and m1["generation_tokens"] > m0["generation_tokens"])
                out.setdefault("wrong", []).append(
                    {"id": wid, "status": st, "still_running": still})
                if not still:
                    out["ok"] = False
            for ids, expect_after in aborts:
                st, rtt = await abort(mc, base, ids, auth)
                # until running <= expect_after
                ok, lat, m = await wait_running(mc, base, auth, partial(ge, expect_after),
                                                guard_s=5, interval=0.005)
                out.setdefault("right", []).append(
                    {"ids": ids, "status": st, "post_rtt_ms": round(rtt * 1000, 1),
                     "dropped": ok, "latency_ms": round(lat * 1000, 1),
                     "running_after": m["running"]})
                if not ok:
                    out["ok"] = False
            m0 = await metrics(mc, base, auth)
            await asyncio.sleep(0.5)
            m1 = await metrics(mc, base, auth)
            out["tokens_after_abort_0.5s"] = m1["generation_tokens"] - m0["generation_tokens"]
            if m1["generation_tokens"] != m0["generation_tokens"] and m1["running"] == 0:
                out["ok"] = False
        finally:
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 3)
                except (TimeoutError, httpx.HTTPError):
                    # Still streaming after 3 s, or the request itself failed.
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                        await task
        out["x_request_id_echoed"] = resp_headers.get("x-request-id")
        if "status" in out and out["status"] != 200:
            out["notes"].append(f"http {out['status']}")
        if not p.stream:
            out["final"] = ({k: first.get(k) for k in ("id", "object")} if "id" in first
                            else str(first)[:300])
    return out


def chat_body(**kw: Any) -> dict[str, Any]:
    b = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
         "max_tokens": MAX_TOKENS, "stream": True, **LONG}
    b.update(kw)
    return b


def cmpl_body(prompt: Any = "hello world", **kw: Any) -> dict[str, Any]:
    b = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, **LONG}
    b.update(kw)
    return b


MODEL = "/tmp/tiny-llama"


def probes() -> list[Probe]:
    H = {"X-Request-Id": "hdr1"}
    return [
        Probe("chat: header", "/v1/chat/completions", chat_body(), H,
              wrong_ids=["hdr1", "chatcmpl-hdr1-0", "chatcmpl-hdr1_0"],
              aborts=[(["chatcmpl-hdr1"], 0)]),
        Probe("chat: body request_id", "/v1/chat/completions", chat_body(request_id="body1"),
              wrong_ids=["body1"], aborts=[(["chatcmpl-body1"], 0)]),
        Probe("chat: header+body (precedence)", "/v1/chat/completions",
              chat_body(request_id="body2"), {"X-Request-Id": "hdr2"},
              wrong_ids=["chatcmpl-body2"], aborts=[(["chatcmpl-hdr2"], 0)]),
        Probe("chat: no id (derive from first chunk id)", "/v1/chat/completions", chat_body(),
              derive=lambda f: [f["id"]]),
        Probe("chat: n=2 header", "/v1/chat/completions", chat_body(n=2), {"X-Request-Id": "hdrn"},
              expect_running=2, aborts=[(["chatcmpl-hdrn"], 0)]),
        Probe("chat: non-stream header", "/v1/chat/completions", chat_body(stream=False),
              {"X-Request-Id": "hdrns"}, stream=False, aborts=[(["chatcmpl-hdrns"], 0)]),
        Probe("chat batch: 2 convs header", "/v1/chat/completions/batch",
              {"model": MODEL,
               "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
               "max_tokens": MAX_TOKENS, **LONG},
              {"X-Request-Id": "hdrb"}, stream=False, expect_running=2,
              wrong_ids=["chatcmpl-hdrb"],
              aborts=[(["chatcmpl-hdrb_0"], 1), (["chatcmpl-hdrb_1"], 0)]),
        Probe("chat batch: 1 conv header", "/v1/chat/completions/batch",
              {"model": MODEL, "messages": [[{"role": "user", "content": "a"}]],
               "max_tokens": MAX_TOKENS, **LONG}, {"X-Request-Id": "hdrb1"}, stream=False,
              wrong_ids=["chatcmpl-hdrb1"], aborts=[(["chatcmpl-hdrb1_0"], 0)]),
        Probe("chat batch: body request_id", "/v1/chat/completions/batch",
              {"model": MODEL, "messages": [[{"role": "user", "content": "a"}]],
               "request_id": "bb1", "max_tokens": MAX_TOKENS, **LONG}, stream=False,
              aborts=[(["chatcmpl-bb1_0"], 0)]),
        Probe("completions: single prompt header", "/v1/completions", cmpl_body(),
              {"X-Request-Id": "c1"}, wrong_ids=["cmpl-c1", "c1"], aborts=[(["cmpl-c1-0"], 0)]),
        Probe("completions: body request_id", "/v1/completions", cmpl_body(request_id="cb1"),
              wrong_ids=["cmpl-cb1"], aborts=[(["cmpl-cb1-0"], 0)]),
        Probe("completions: header+body", "/v1/completions", cmpl_body(request_id="cb2"),
              {"X-Request-Id": "ch2"}, wrong_ids=["cmpl-cb2-0"], aborts=[(["cmpl-ch2-0"], 0)]),
        Probe("completions: list of 2 prompts", "/v1/completions", cmpl_body(["hello", "world"]),
              {"X-Request-Id": "c2"}, expect_running=2, wrong_ids=["cmpl-c2"],
              aborts=[(["cmpl-c2-0"], 1), (["cmpl-c2-1"], 0)]),
        Probe("completions: list of 1 prompt", "/v1/completions", cmpl_body(["hello"]),
              {"X-Request-Id": "c1l"}, aborts=[(["cmpl-c1l-0"], 0)]),
        Probe("completions: token-id lists", "/v1/completions", cmpl_body([[5, 6, 7], [8, 9]]),
              {"X-Request-Id": "c3"}, expect_running=2, aborts=[(["cmpl-c3-0", "cmpl-c3-1"], 0)]),
        Probe("completions: single token-id list", "/v1/completions", cmpl_body([5, 6, 7]),
              {"X-Request-Id": "c3s"}, aborts=[(["cmpl-c3s-0"], 0)]),
        Probe("completions: n=2", "/v1/completions", cmpl_body(n=2), {"X-Request-Id": "c4"},
              expect_running=2, aborts=[(["cmpl-c4-0"], 0)]),
        Probe("completions: no id (derive cmpl-<x> from chunk id + '-0')", "/v1/completions",
              cmpl_body(), derive=lambda f: [f["id"] + "-0"]),
        Probe("responses: header + body", "/v1/responses",
              {"model": MODEL, "input": "hello", "max_output_tokens": MAX_TOKENS, "stream": True,
               "request_id": "resp_body1", **LONG}, {"X-Request-Id": "rh1"},
              wrong_ids=["rh1", "resp_body1", "chatcmpl-rh1", "resp-rh1"],
              aborts=[(["resp_body1_0"], 0)]),
        Probe("responses: no id (derive from response.id + '_0')", "/v1/responses",
              {"model": MODEL, "input": "hello", "max_output_tokens": MAX_TOKENS, "stream": True,
               **LONG},
              derive=lambda f: [f["response"]["id"] + "_0"]),
        Probe("messages: header", "/v1/messages",
              {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": MAX_TOKENS, "stream": True, **LONG}, {"X-Request-Id": "m1"},
              wrong_ids=["m1", "msg_m1"], aborts=[(["chatcmpl-m1"], 0)]),
        Probe("messages: body request_id (ignored?) no header", "/v1/messages",
              {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
               "request_id": "mb1", "max_tokens": MAX_TOKENS, "stream": True, **LONG},
              wrong_ids=["chatcmpl-mb1"], derive=None, aborts=[]),
        Probe("generate: header", "/inference/v1/generate",
              {"model": MODEL, "token_ids": [5, 6, 7], "stream": True,
               "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True}},
              {"X-Request-Id": "g1"}, wrong_ids=["g1", "generate-tokens-g1-0"],
              aborts=[(["generate-tokens-g1"], 0)]),
        Probe("generate: body request_id", "/inference/v1/generate",
              {"model": MODEL, "token_ids": [5, 6, 7], "stream": True, "request_id": "gb1",
               "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True}},
              aborts=[(["generate-tokens-gb1"], 0)]),
        Probe("invocations (sagemaker) chat body + header", "/invocations", chat_body(),
              {"X-Request-Id": "inv1"}, wrong_ids=["inv1"], aborts=[(["chatcmpl-inv1"], 0)]),
        Probe("duplicate X-Request-Id: 2 live chats, one abort", "/v1/chat/completions",
              chat_body(), {"X-Request-Id": "dup"}, aborts=[(["chatcmpl-dup"], 0)]),
    ]


async def main_async(base: str, only: str | None) -> int:
    results = []
    for p in probes():
        if only and only not in p.name:
            continue
        if p.name.startswith("duplicate"):
            res = await run_duplicate(base)
        elif p.name.startswith("messages: body"):
            res = await run_messages_body(base, p)
        else:
            res = await run_probe(base, p)
        print(json.dumps(res), flush=True)
        results.append(res)
    bad = [r["name"] for r in results if not r["ok"]]
    print(f"SUMMARY {len(results) - len(bad)} ok, {len(bad)} failed: {bad}")
    return 1 if bad else 0


async def run_messages_body(base: str, p: Probe) -> dict[str, Any]:
    """/v1/messages with a body request_id and no header: abort chatcmpl-mb1 must NOT stop it."""
    p.aborts = []
    res = await run_probe(base, p)
    # stop it via dev-less means: nothing knows its id; wait until it ends by itself
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as c:
        await wait_running(c, base, {}, lambda r: r == 0, guard_s=60)
    return res


async def run_duplicate(base: str) -> dict[str, Any]:
    """Two concurrent streaming chats with the same X-Request-Id; one abort call."""
    out: dict[str, Any] = {"name": "duplicate X-Request-Id", "ok": True}
    async with httpx.AsyncClient(timeout=60, limits=NO_KEEPALIVE) as mc:
        statuses = []

        async def one() -> None:
            async with httpx.AsyncClient(timeout=60) as rc:
                async with rc.stream("POST", base + "/v1/chat/completions", json=chat_body(),
                                     headers={"X-Request-Id": "dup"}) as r:
                    statuses.append(r.status_code)
                    async for _ in r.aiter_lines():
                        pass

        t1 = asyncio.create_task(one())
        t2 = asyncio.create_task(one())
        ok, _, _ = await wait_running(mc, base, {}, lambda r: r >= 2, guard_s=15)
        out["both_running"] = ok
        _, _ = await abort(mc, base, ["chatcmpl-dup"], {})
        ok2, lat, _ = await wait_running(mc, base, {}, lambda r: r == 0, guard_s=5,
                                         interval=0.005)
        out.update(statuses=statuses, one_abort_stopped_both=ok2, latency_ms=round(lat * 1000, 1))
        out["ok"] = ok and ok2
        for t in (t1, t2):
            try:
                await asyncio.wait_for(t, 5)
            except (TimeoutError, httpx.HTTPError):
                t.cancel()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--only")
    ap.add_argument("--model", default="/tmp/slow-llama-8k")
    a = ap.parse_args()
    global MODEL
    MODEL = a.model
    if a.url:
        return asyncio.run(main_async(a.url, a.only))
    from tests.harness.e2e.tiny_model import SLOW_MODEL_KWARGS, build_tiny_model
    from tests.harness.e2e.vllm_server import HIDE_DISCONNECT_MIDDLEWARE, vllm_server

    model = build_tiny_model(Path(a.model), **SLOW_MODEL_KWARGS)
    with vllm_server(model, max_model_len=8192, middleware=[HIDE_DISCONNECT_MIDDLEWARE]) as srv:
        return asyncio.run(main_async(srv.base_url, a.only))


if __name__ == "__main__":
    sys.exit(main())
