"""``python -m bench``: direct vs cancel-sidecar vs nginx, one run, one report.

Starts on 127.0.0.1 the fake engine (:mod:`bench.engine`), the load client
(:mod:`bench.client`), cancel-sidecar through its CLI (``--workers 1``, and ``--workers 2`` for
the throughput sweep), nginx (``worker_processes 2``, ``proxy_buffering off``, keep-alive
upstream) and the two floor proxies of :mod:`bench.floor` (streams, sweep and storm only), then
runs the phases below one after another (never two at once), each path in
turn within a phase so the three see the same machine state. Every phase records the CPU
seconds of the engine, the client and the proxy (psutil).

1. idle: resident memory per idle open stream at ``--idle`` (1000, 10000) open streams, first,
   while the proxies' heaps hold nothing from earlier phases;
2. streams: N concurrent streams (``--streams``, default 1, 64, 256, 1000) of ``--tokens``
   events every ``--interval-ms``, plus a prober that samples time to first token;
3. sweep: ``--sweep-streams`` streams at rising offered event rates (``--sweep-rates``) until
   the path stops holding (p99 inter-token latency over twice its ratio to the interval at the
   lowest rate, or under 90% of the offered events delivered); CPU per 100,000 events at
   ``--cpu-rate``;
4. storm: ``--storm`` streams, half of them closed at once: client close -> abort call at the
   engine, client close -> upstream connection closed at the engine, and client close -> the
   engine stopped the stream (an abort that reached its owner, or its connection closed), with
   the abort calls that named it; then the same storm through a second sidecar in front of a
   second engine that simulates ``--storm-api-servers`` (4) vLLM API-server processes, where an
   abort reaches a stream only from its owner's process (:mod:`bench.engine`);
5. profile: py-spy on the sidecar under up to 256 streams (:mod:`bench.profile`; not in
   ``--quick``, not with ``--no-profile``), in a phase of its own;
6. the real vLLM figure from ``bench/vllm_waste.py`` (not in ``--quick``, not with
   ``--no-vllm``).

``--phases`` runs only some of them (e.g. ``--phases storm``). Then :mod:`bench.report` writes
``benchmarks.md``, ``benchmarks.png`` and ``benchmarks.json`` to ``docs/`` (a full run of every
phase) or to ``--out`` (``--quick`` and ``--phases`` never write ``docs/``: default a temp dir).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from bench import profile, report
from bench.engine import raise_fd_limit
from bench.procs import (
    REPO,
    LoadClient,
    Proc,
    http_get,
    start_engine,
    start_floor,
    start_nginx,
    start_sidecar,
)

FD_WANT = 65536
PHASES = ("idle", "streams", "sweep", "storm", "profile", "vllm")
STOP_WAIT_S = 1.0  # after a storm, longest wait for the engine to stop every closed stream


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _phases(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in PHASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(PHASES)}")
    return [x for x in PHASES if x in names]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, short phases, no 10,000 idle streams, no vLLM; writes to "
                        "--out or a temp dir, never to docs/")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write benchmarks.md/.png/.json (default: docs/, or a temp "
                        "dir with --quick)")
    p.add_argument("--streams", type=_ints, default=None,
                   help="concurrent streams per latency phase (default 1,64,256,1000)")
    p.add_argument("--interval-ms", type=float, default=20.0,
                   help="engine time between tokens, ms (default %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--workers", type=_ints, default=[1, 2],
                   help="sidecar --workers values for the sweep (default 1,2); the other "
                        "phases use the first")
    p.add_argument("--nginx-workers", type=int, default=2,
                   help="nginx worker_processes (default %(default)s)")
    p.add_argument("--sweep-streams", type=int, default=None,
                   help="streams in the throughput sweep (default 200)")
    p.add_argument("--sweep-rates", type=_ints, default=None,
                   help="offered SSE events/s (default 5000,10000,20000,30000,40000,50000,60000,"
                        "80000)")
    p.add_argument("--sweep-s", type=float, default=None,
                   help="seconds per sweep level (default 3)")
    p.add_argument("--sweep-refine", type=int, default=None,
                   help="levels bisected between the last rate held and the first failed "
                        "(default 2; 0 with --quick)")
    p.add_argument("--cpu-rate", type=int, default=None,
                   help="offered events/s at which CPU per 100,000 events is read (default "
                        "the second sweep rate)")
    p.add_argument("--idle", type=_ints, default=None,
                   help="idle open streams for the memory figure (default 1000,10000)")
    p.add_argument("--storm", type=int, default=None,
                   help="streams in the disconnect storm; half close at once (default 1000)")
    p.add_argument("--storm-interval-ms", type=lambda t: [float(x) for x in t.split(",")],
                   default=None, help="ms per token in the storm, one storm each (default: "
                                      "--interval-ms and 100)")
    p.add_argument("--storm-reps", type=int, default=None,
                   help="storms per path and token interval, interleaved; their closes are "
                        "pooled (default 3; 1 with --quick)")
    p.add_argument("--storm-api-servers", type=int, default=4,
                   help="the storm again through a sidecar in front of an engine simulating "
                        "this many vLLM API-server processes (default %(default)s; 1: not run)")
    p.add_argument("--close", choices=["rst", "fin"], default="rst",
                   help="how storm clients close: RST (SO_LINGER 0) or FIN (default rst)")
    p.add_argument("--paths", default="direct,sidecar,nginx,floor-raw,floor-aiohttp",
                   help="paths to measure (default %(default)s); floor-raw and floor-aiohttp "
                        "are bench.floor's least-work proxies (streams, sweep and storm)")
    p.add_argument("--phases", type=_phases, default=list(PHASES),
                   help=f"phases to run, in their order (default {','.join(PHASES)}); a "
                        "partial run writes to --out or a temp dir, never to docs/")
    p.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM figure")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the py-spy profile of the sidecar (skipped in --quick)")
    return p


def defaults(args: argparse.Namespace) -> None:
    """Fill in the sizes ``--quick`` shrinks."""
    q = args.quick
    args.streams = args.streams or ([1, 8] if q else [1, 64, 256, 1000])
    args.sweep_streams = args.sweep_streams or (20 if q else 200)
    args.sweep_rates = args.sweep_rates or ([1000, 2000] if q else
                                            [5000, 10000, 20000, 30000, 40000, 50000, 60000,
                                             80000])
    args.sweep_s = args.sweep_s or (1.0 if q else 3.0)
    if args.sweep_refine is None:
        args.sweep_refine = 0 if q else 2
    args.cpu_rate = args.cpu_rate or args.sweep_rates[min(1, len(args.sweep_rates) - 1)]
    args.idle = args.idle or ([50] if q else [1000, 10000])
    args.storm = args.storm or (20 if q else 1000)
    args.storm_interval_ms = args.storm_interval_ms or sorted({args.interval_ms, 100.0})
    args.storm_reps = args.storm_reps or (1 if q else 3)
    if q:
        args.tokens = min(args.tokens, 25)
        args.no_vllm = True
        args.no_profile = True
    if "vllm" not in args.phases:
        args.no_vllm = True
    if "profile" not in args.phases:
        args.no_profile = True


class Bench:
    """One run: the processes, the paths under test and the results."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.engine: Proc | None = None
        self.client: LoadClient | None = None
        self.paths: dict[str, Proc | None] = {}  # name -> proxy process (None: direct)
        # The storm's paths to an engine of their own (name -> its proxy and its engine): the
        # sidecar in front of several simulated API-server processes.
        self.api_paths: dict[str, tuple[Proc, Proc]] = {}
        self.results: dict[str, Any] = {"phases": {}}

    # -- processes --------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine = await start_engine(self.log_dir)
        self.procs.append(self.engine)
        self.client = await LoadClient.start(self.log_dir)
        self.procs.append(self.client.proc)
        self.results["clock"] = await self.check_clock()
        wanted = self.args.paths.split(",")
        if "direct" in wanted:
            self.paths["direct"] = None
        if "sidecar" in wanted:
            for w in self.args.workers:
                proc = await start_sidecar(self.log_dir, self.engine.port, w)
                self.procs.append(proc)
                self.paths["sidecar" if w == self.args.workers[0] else proc.name] = proc
        if "nginx" in wanted:
            nofile = self.results["nofile"]
            proc = await start_nginx(self.log_dir, self.engine.port, self.args.nginx_workers,
                                     nofile)
            self.procs.append(proc)
            self.paths["nginx"] = proc
        for downstream in ("raw", "aiohttp"):
            if f"floor-{downstream}" in wanted:
                proc = await start_floor(self.log_dir, self.engine.port, downstream)
                self.procs.append(proc)
                self.paths[proc.name] = proc

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()

    async def check_clock(self) -> dict[str, Any]:
        """The engine's and the client's ``monotonic_ns`` read between two of ours: one clock."""
        assert self.engine is not None and self.client is not None
        before = time.monotonic_ns()
        _, engine = await http_get(self.engine.port, "/bench/records")
        client = await self.client.call("now")
        after = time.monotonic_ns()
        ok = before <= engine["now"] <= after and before <= client["now"] <= after
        if not ok:
            raise RuntimeError("time.monotonic_ns() differs between processes: per-event "
                               "latency cannot be computed on this host")
        return {"shared_monotonic_clock": ok, "window_ms": (after - before) / 1e6}

    def port(self, path: str) -> int:
        proc = self.api_paths[path][0] if path in self.api_paths else self.paths[path]
        assert self.engine is not None
        return self.engine.port if proc is None else proc.port

    def engine_of(self, path: str) -> Proc:
        """The engine behind ``path``."""
        assert self.engine is not None
        return self.api_paths[path][1] if path in self.api_paths else self.engine

    async def start_api_paths(self) -> None:
        """For the storm: a second engine simulating ``--storm-api-servers`` API-server
        processes and a sidecar (first ``--workers`` value) in front of it, warmed up."""
        assert self.client is not None
        n = self.args.storm_api_servers
        if n <= 1 or "sidecar" not in self.paths or self.api_paths:
            return
        engine = await start_engine(self.log_dir, n, name=f"engine-api{n}")
        self.procs.append(engine)
        proxy = await start_sidecar(self.log_dir, engine.port, self.args.workers[0],
                                    name=f"sidecar-api{n}")
        self.procs.append(proxy)
        self.api_paths[proxy.name] = (proxy, engine)
        await self.streams(proxy.name, 8, 10, 5000)

    async def measured(self, path: str, work: Callable[[], Awaitable[dict[str, Any]]]
                       ) -> dict[str, Any]:
        """Run ``work`` and add the CPU seconds each process used meanwhile."""
        assert self.client is not None
        proxy = self.api_paths[path][0] if path in self.api_paths else self.paths[path]
        watched = {"engine": self.engine_of(path), "client": self.client.proc}
        if proxy is not None:
            watched["proxy"] = proxy
        before = {k: p.cpu_s() for k, p in watched.items()}
        started = time.monotonic()
        result = await work()
        result["cpu_s"] = {k: round(p.cpu_s() - before[k], 3) for k, p in watched.items()}
        result["phase_s"] = round(time.monotonic() - started, 3)
        return result

    async def reset_engine(self, path: str = "direct") -> None:
        await http_get(self.engine_of(path).port, "/bench/reset", "POST")

    async def storm_records(self, path: str, result: dict[str, Any]) -> dict[str, Any]:
        """The engine's records after a storm through ``path``, once it stopped every closed
        stream or :data:`STOP_WAIT_S` later (a sidecar closes an unconfirmed stream's upstream
        connection at its confirmation bound, 2 s after the disconnect)."""
        deadline = time.monotonic() + STOP_WAIT_S
        port = self.engine_of(path).port
        while True:
            _, records = await http_get(port, "/bench/records")
            assert isinstance(records, dict)
            figures = storm_figures(result, records)
            if not figures["unstopped"] or time.monotonic() > deadline:
                return figures
            await asyncio.sleep(0.1)

    # -- phases -----------------------------------------------------------------------------

    async def streams(self, path: str, n: int, tokens: int, interval_us: int,
                      probe: bool = True) -> dict[str, Any]:
        assert self.client is not None
        client = self.client
        expected_s = tokens * interval_us / 1e6
        return await self.measured(path, lambda: client.call(
            "streams", port=self.port(path), n=n, tokens=tokens, interval_us=interval_us,
            probe=probe, timeout_s=max(30.0, 4 * expected_s)))

    async def warm_up(self) -> None:
        """A few short streams per path: connection pools, lazy imports, first allocations."""
        for path in self.paths:
            await self.streams(path, 8, 10, 5000)

    async def phase_streams(self) -> None:
        interval_us = round(self.args.interval_ms * 1000)
        out: dict[str, dict[str, Any]] = {p: {} for p in self.main_paths + self.floor_paths}
        for n in self.args.streams:
            for path in out:
                r = await self.streams(path, n, self.args.tokens, interval_us)
                out[path][str(n)] = r
                log(f"streams  {path:<10} N={n:<5} ttft p50 {r['probe']['ttft_ms'].get('p50')}"
                    f" ms, itl p99 {r['main']['itl_ms'].get('p99')} ms, cpu {r['cpu_s']}")
        self.results["phases"]["streams"] = out

    async def phase_sweep(self) -> None:
        args = self.args
        out: dict[str, Any] = {}
        for path in self.paths:
            levels: list[dict[str, Any]] = []
            for rate in args.sweep_rates:
                if not (await self.sweep_level(path, rate, levels))["held"]:
                    break
            # The rates step ~20% at the top: a level that fails by a hair would set the most
            # held a whole step lower. Bisect between the last held and the first failed.
            failed = levels[-1]
            if not failed["held"] and len(levels) > 1:
                low, high = levels[-2]["offered_per_s"], failed["offered_per_s"]
                for _ in range(args.sweep_refine):
                    middle = (low + high) / 2
                    if (await self.sweep_level(path, middle, levels))["held"]:
                        low = middle
                    else:
                        high = middle
                levels.sort(key=lambda lv: lv["offered_per_s"])
            ok = [lv for lv in levels if lv["held"]]
            cpu_level = next((lv for lv in levels if lv["offered_per_s"] >= args.cpu_rate * 0.99),
                             None)
            proc_cpu = cpu_level["cpu_s"].get("proxy") if cpu_level else None
            out[path] = {
                "levels": levels,
                "max_held_per_s": max((lv["delivered_per_s"] for lv in ok), default=0.0),
                "cpu_rate_per_s": cpu_level["offered_per_s"] if cpu_level else None,
                "cpu_s_per_100k": (proc_cpu / cpu_level["events"] * 1e5
                                   if cpu_level and proc_cpu is not None and cpu_level["events"]
                                   else None),
            }
        self.results["phases"]["sweep"] = out

    async def sweep_level(self, path: str, rate: float,
                          levels: list[dict[str, Any]]) -> dict[str, Any]:
        """One sweep level: ``sweep_streams`` streams offering ``rate`` events/s for
        ``sweep_s`` seconds through ``path``; appended to ``levels`` (the first: the base of
        :func:`held`) and returned."""
        args = self.args
        interval_us = max(1000, round(args.sweep_streams * 1e6 / rate))
        tokens = max(10, round(args.sweep_s * 1e6 / interval_us))
        r = await self.streams(path, args.sweep_streams, tokens, interval_us, probe=False)
        offered = args.sweep_streams * 1e6 / interval_us
        level = {"offered_per_s": offered, "interval_us": interval_us,
                 "delivered_per_s": r["events_per_s"], "events": r["main"]["events"],
                 "itl_p99_ms": r["main"]["itl_ms"].get("p99"),
                 "delivery_p99_ms": r["main"]["delivery_ms"].get("p99"),
                 "errors": r["main"]["errors"], "timed_out": r["timed_out"],
                 "cpu_s": r["cpu_s"]}
        level["held"] = held(level, levels[0] if levels else level)
        levels.append(level)
        log(f"sweep    {path:<10} offered {offered:>8.0f}/s delivered "
            f"{level['delivered_per_s']:>8.0f}/s itl p99 {level['itl_p99_ms']} ms "
            f"held {level['held']} cpu {r['cpu_s']}")
        return level

    def idle_proxy(self, path: str, k: int) -> tuple[str, Proc] | None:
        """The proxy process tree to hold ``k`` idle streams for ``path``: the sidecar with the
        fewest workers whose processes each stay under RLIMIT_NOFILE (two fds per stream, 20%
        for an uneven spread across workers); ``None`` if none fits."""
        nofile = self.results["nofile"]
        if path == "nginx":
            workers = [("nginx", self.args.nginx_workers)]
        else:
            workers = [("sidecar" if w == self.args.workers[0] else f"sidecar-w{w}", w)
                       for w in self.args.workers]
        for name, w in workers:
            proc = self.paths.get(name)
            need = 2 * k * (1.2 if w > 1 else 1.0) / w + 200
            if proc is not None and need <= nofile:
                return name, proc
        return None

    async def phase_idle(self) -> None:
        assert self.client is not None
        out: dict[str, Any] = {}
        for path in self.main_paths:
            if path == "direct":
                continue
            rows = []
            for k in self.args.idle:
                chosen = self.idle_proxy(path, k)
                if chosen is None:
                    rows.append({"streams": k, "proxy": path, "open": 0, "errors": 0,
                                 "rss_before": 0, "rss_open": 0, "per_stream_bytes": None,
                                 "note": f"not reached: RLIMIT_NOFILE {self.results['nofile']}"
                                         " is too low for the proxy processes"})
                    log(f"idle     {path:<10} K={k}: not reached (RLIMIT_NOFILE)")
                    continue
                name, proc = chosen
                await asyncio.sleep(0.5)
                base = proc.rss_bytes()
                opened = await self.client.call("idle_open", port=proc.port, n=k)
                await asyncio.sleep(1.0)
                rss = proc.rss_bytes()
                await self.client.call("idle_close")
                per = (rss - base) / opened["open"] if opened["open"] else None
                rows.append({"streams": k, "proxy": name, "open": opened["open"],
                             "errors": opened["errors"], "rss_before": base, "rss_open": rss,
                             "per_stream_bytes": per})
                log(f"idle     {name:<10} K={k:<6} open {opened['open']} rss "
                    f"{base / 2**20:.1f} -> {rss / 2**20:.1f} MiB, "
                    f"{(per or 0) / 1024:.1f} KiB/stream")
            out[path] = rows
        self.results["phases"]["idle"] = out

    async def phase_storm(self) -> None:
        """The storm ``--storm-reps`` times per ``--storm-interval-ms`` and path, the paths in
        turn within each repetition: at the streams' interval (1,000 streams at 20 ms offer
        50,000 events/s, more than a Python proxy holds on 2 cores, so it measures a disconnect
        behind a backlog) and at a rate every path holds. One storm's p99 is nearly its 5th
        slowest close and moves 2x between storms on this shared box: the figures pool every
        storm's closes (:func:`pool_storms`), and each storm's p99 is kept."""
        assert self.client is not None
        await self.start_api_paths()
        n = self.args.storm
        paths = self.storm_paths + list(self.api_paths)
        out: dict[str, Any] = {}
        for interval_ms in self.args.storm_interval_ms:
            storms: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
            for rep in range(self.args.storm_reps):
                for path in paths:
                    await self.reset_engine(path)
                    r = await self.measured(path, functools.partial(
                        self.client.call, "storm", port=self.port(path), n=n, close=n // 2,
                        interval_us=round(interval_ms * 1000), how=self.args.close,
                        settle_s=1.5))
                    storms[path].append(await self.storm_records(path, r))
                    log(f"storm    {path:<10} {interval_ms} ms/token #{rep + 1} "
                        f"{storms[path][-1]['summary']}")
            out[f"{interval_ms:g}"] = {path: pool_storms(figures)
                                      for path, figures in storms.items()}
        self.results["phases"]["storm"] = out

    async def phase_profile(self) -> None:
        """py-spy on the sidecar (``--workers 1``) while N streams run through it."""
        assert self.client is not None
        proxy = self.paths.get("sidecar")
        if proxy is None or self.args.no_profile:
            return
        n = max((x for x in self.args.streams if x <= 256), default=self.args.streams[0])
        interval_us = round(self.args.interval_ms * 1000)
        seconds = 4.0
        tokens = round(seconds * 1e6 / interval_us) + 25
        out = self.log_dir / "sidecar.pyspy.txt"
        task = asyncio.create_task(profile.record(proxy.proc.pid, seconds, out),
                                   name="py-spy")
        await asyncio.sleep(0.5)
        await self.client.call("streams", port=proxy.port, n=n, tokens=tokens,
                               interval_us=interval_us, probe=True, timeout_s=60.0)
        ok, messages = await task
        summary: dict[str, Any] = {"streams": n, "interval_ms": self.args.interval_ms,
                                   "seconds": seconds, "ok": ok}
        if ok:
            summary |= profile.summarise(out.read_text())
            log(f"profile  sidecar    {summary['samples']} samples, by package "
                f"{summary['by_package'][:5]}")
        else:
            summary["error"] = messages.strip().splitlines()[-1:] or ["py-spy failed"]
            log(f"profile  sidecar    py-spy failed: {messages.strip()[-300:]}")
        self.results["profile"] = summary

    @property
    def storm_paths(self) -> list[str]:
        """The main paths, and the sidecar with as many workers as nginx has, if the sweep
        runs it: the storm is where one process's per-disconnect cost shows most."""
        same = f"sidecar-w{self.args.nginx_workers}"
        return self.main_paths + ([same] if same in self.paths else []) + self.floor_paths

    @property
    def main_paths(self) -> list[str]:
        """The paths of the latency, memory and storm phases (not the extra sidecar workers)."""
        return [p for p in self.paths if p in ("direct", "sidecar", "nginx")]

    @property
    def floor_paths(self) -> list[str]:
        """bench.floor's proxies: what a Python proxy costs at least, beside the sidecar."""
        return [p for p in self.paths if p.startswith("floor-")]


def held(level: dict[str, Any], first: dict[str, Any]) -> bool:
    """A sweep level holds if 90% of the offered events arrived, nothing failed, and p99
    inter-token latency, as a multiple of the interval, is at most twice that at the lowest
    rate (the interval shrinks as the rate rises, so raw p99 ITL would fall)."""
    if level["errors"] or level["timed_out"] or level["itl_p99_ms"] is None:
        return False
    if level["delivered_per_s"] < 0.9 * level["offered_per_s"]:
        return False
    ratio = level["itl_p99_ms"] / (level["interval_us"] / 1000)
    base = first["itl_p99_ms"] / (first["interval_us"] / 1000)
    return bool(ratio <= 2 * base)


def storm_figures(result: dict[str, Any], records: dict[str, Any]) -> dict[str, Any]:
    """Per closed stream, at the engine, ms after the client's close: the first abort call
    naming its engine id (``abort_ms``); its upstream connection closed, while it ran or after
    an abort ended it (``upstream_close_ms``); the abort call that ended it (``hit_ms``: one
    that reached its API-server process); the engine stopped it: that call, or the close if it
    ran then (``stopped_ms``); and the abort calls that named it (``calls_per_request``,
    proxies that tag requests only). ``unstopped``: closed streams the engine had not stopped
    when the records were read."""
    closed: dict[str, int] = result["closed"]
    ids = records["request_ids"]  # tag -> X-Request-Id (only behind an id-tagging proxy)
    first_abort: dict[str, int] = {}
    naming: dict[str, int] = {}
    for at, request_ids in records["aborts"]:
        for rid in request_ids:
            first_abort.setdefault(rid, at)
            naming[rid] = naming.get(rid, 0) + 1
    upstream_close = {tag: at for tag, at in records["closes"]}
    stopped: dict[str, list[int]] = records.get("stopped", {})
    abort_ms, close_ms, hit_ms, stopped_ms, calls = [], [], [], [], []
    unstopped = 0
    for tag, at in closed.items():
        rid = ids.get(tag)
        engine_id = f"chatcmpl-{rid}" if rid is not None else None
        if engine_id is not None and engine_id in first_abort:
            abort_ms.append((first_abort[engine_id] - at) / 1e6)
        if engine_id is not None:
            calls.append(float(naming.get(engine_id, 0)))
        ends = []
        if tag in upstream_close:
            close_ms.append((upstream_close[tag] - at) / 1e6)
            ends.append(close_ms[-1])
        if tag in stopped:
            hit_ms.append((stopped[tag][0] - at) / 1e6)
            ends.append(hit_ms[-1])
        if ends:
            stopped_ms.append(min(ends))
        else:
            unstopped += 1
    by_process = [0] * records.get("api_servers", 1)
    for process in records.get("abort_processes", []):
        by_process[process] += 1
    connections: list[set[int]] = [set() for _ in by_process]  # distinct, per process
    for process, number in zip(records.get("abort_processes", []),
                               records.get("abort_connections", []), strict=False):
        connections[process].add(number)
    after = [len(r) for at, r in records["aborts"]
             if any(at >= c for c in closed.values())]
    return {"closed": len(closed), "open": result["open"], "errors": result["errors"],
            "close_spread_ms": result["close_spread_ms"], "cpu_s": result["cpu_s"],
            "close_lag_ms": result.get("close_lag_ms"),
            "abort_ms": spread(abort_ms), "upstream_close_ms": spread(close_ms),
            "hit_ms": spread(hit_ms), "stopped_ms": spread(stopped_ms),
            "calls_per_request": spread(calls),
            "aborted": len(abort_ms), "upstream_closed": len(close_ms),
            "abort_stopped": len(hit_ms), "unstopped": unstopped,
            "abort_calls": len(records["aborts"]), "ids_per_call": after,
            "abort_hits": records.get("abort_hits", 0),
            "abort_misses": records.get("abort_misses", 0),
            "api_servers": records.get("api_servers", 1), "calls_by_process": by_process,
            "connections_by_process": [len(c) for c in connections],
            "samples": {"abort_ms": abort_ms, "upstream_close_ms": close_ms, "hit_ms": hit_ms,
                        "stopped_ms": stopped_ms, "calls_per_request": calls},
            "summary": f"abort {spread(abort_ms)} upstream close {spread(close_ms)} stopped "
                       f"{spread(stopped_ms)} ({len(hit_ms)} by abort, {unstopped} not) calls "
                       f"per request {spread(calls)}"}


def pool_storms(storms: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's storms (:func:`storm_figures` each) as one figure: p50/p99/max over every
    closed stream of every storm, counts summed, the closes' spread and the proxy's CPU as the
    median storm's, and each storm's own p99 (``*_p99_per_storm``)."""
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    pooled: dict[str, Any] = {"storms": len(storms),
                              "api_servers": storms[0].get("api_servers", 1)}
    for key in ("closed", "open", "errors", "aborted", "upstream_closed", "abort_calls",
                "abort_stopped", "unstopped", "abort_hits", "abort_misses"):
        pooled[key] = sum(s.get(key, 0) for s in storms)
    pooled["calls_by_process"] = [sum(c) for c in zip(*(s.get("calls_by_process", [0])
                                                         for s in storms), strict=True)]
    pooled["connections_by_process"] = [s.get("connections_by_process") for s in storms]
    pooled["close_spread_ms"] = median([s["close_spread_ms"] for s in storms])
    pooled["cpu_s"] = {name: median([s["cpu_s"].get(name) or 0.0 for s in storms])
                       for name in storms[0]["cpu_s"]}
    for key in ("abort_ms", "upstream_close_ms", "hit_ms", "stopped_ms", "calls_per_request"):
        pooled[key] = spread([v for s in storms for v in s["samples"].get(key, [])])
        pooled[f"{key}_p99_per_storm"] = [s[key].get("p99") if key in s else None
                                          for s in storms]
    return pooled


def spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    v = sorted(values)
    last = len(v) - 1
    return {"n": len(v), "p50": round(v[round(0.5 * last)], 3),
            "p99": round(v[round(0.99 * last)], 3), "max": round(v[-1], 3)}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def vllm_figure(args: argparse.Namespace) -> dict[str, Any]:
    """``bench.vllm_waste.run()``; "not measured" when skipped or the module is missing."""
    if args.no_vllm:
        return {"measured": False, "notes": "not measured in this run (--no-vllm or --quick)"}
    try:
        module = importlib.import_module("bench.vllm_waste")
    except ImportError as exc:
        return {"measured": False, "notes": f"not measured in this run (bench/vllm_waste.py "
                                            f"not available: {exc})"}
    log("vllm     running bench.vllm_waste.run() on the real engine")
    kwargs: dict[str, Any] = {"quick": False}
    if "say" in inspect.signature(module.run).parameters:
        kwargs["say"] = lambda message: log(f"vllm     {message}")
    try:
        result: dict[str, Any] = module.run(**kwargs)
    except (RuntimeError, AssertionError, OSError) as exc:  # what run() documents
        # The other figures are already measured: report the failure instead of losing them.
        log(f"vllm     failed: {exc!r}")
        return {"measured": False, "notes": f"not measured: bench.vllm_waste.run() failed: "
                                            f"{exc!r}"}
    return {"measured": True, **result}


async def run_async(args: argparse.Namespace, log_dir: Path, nofile: int) -> dict[str, Any]:
    bench = Bench(args, log_dir)
    bench.results["nofile"] = nofile
    try:
        await bench.start()
        log(f"paths: {', '.join(f'{k} :{bench.port(k)}' for k in bench.paths)}")
        await bench.warm_up()
        phases = {"idle": bench.phase_idle, "streams": bench.phase_streams,
                  "sweep": bench.phase_sweep, "storm": bench.phase_storm,
                  "profile": bench.phase_profile}
        for name in args.phases:  # idle first: on proxies that have not yet grown their heaps
            if name in phases:
                await phases[name]()
    except BaseException:
        for proc in bench.procs:
            log(f"{proc.name} logs:\n{proc.log_tail()}")
        raise
    finally:
        await bench.stop()
    return bench.results


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    defaults(args)
    nofile = raise_fd_limit(FD_WANT)  # inherited by every process we start
    if args.out is None and (args.quick or len(args.phases) < len(PHASES)):
        args.out = Path(tempfile.mkdtemp(prefix="bench-quick-"))
    out = args.out or REPO / "docs"
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        results = uvloop.run(run_async(args, Path(tmp), nofile))
    results["vllm"] = vllm_figure(args)
    results["meta"] = report.machine(args, command.strip(), started, nofile)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    text = report.write(results, out)
    print(text)
    log(f"wrote {out / 'benchmarks.md'}, {out / 'benchmarks.png'} and benchmarks.json in "
        f"{time.time() - started:.0f} s")
    return 0
