"""The benchmark report: ``benchmarks.md`` (tables, targets, method) and ``benchmarks.png``.

Input is the results tree :mod:`bench.run` builds (also written as ``benchmarks.json``, so the
report can be regenerated with ``python -m bench.report DIR``). "Added" figures are a path's
percentile minus the direct path's same percentile, same N, same run: events are not paired
across paths, so this is the difference of distributions, not a distribution of differences.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.procs import nginx_version

PATH_LABELS = {"direct": "direct (engine)", "sidecar": "cancel-sidecar", "nginx": "nginx",
               "floor-raw": "floor (raw Protocols)", "floor-aiohttp": "floor (aiohttp server)"}


def machine(args: argparse.Namespace, command: str, started: float, nofile: int
            ) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration_s": round(time.time() - started),
        "command": command, "quick": args.quick, "cores": os.cpu_count(), "cpu": cpu,
        "kernel": platform.release(), "python": sys.version.split()[0],
        "aiohttp": version("aiohttp"), "uvloop": version("uvloop"), "nginx": nginx_version(),
        "nofile": nofile, "interval_ms": args.interval_ms, "tokens": args.tokens,
        "streams": args.streams, "workers": args.workers, "nginx_workers": args.nginx_workers,
        "sweep_streams": args.sweep_streams, "sweep_rates": args.sweep_rates,
        "sweep_s": args.sweep_s, "sweep_refine": args.sweep_refine, "cpu_rate": args.cpu_rate,
        "idle": args.idle,
        "storm": args.storm, "close": args.close, "storm_interval_ms": args.storm_interval_ms,
        "storm_reps": args.storm_reps, "storm_api_servers": args.storm_api_servers,
        "phases": args.phases,
    }


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _get(tree: Any, *keys: Any) -> Any:
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _added(streams: dict[str, Any], path: str, n: str, *keys: str) -> float | None:
    a, b = _get(streams, path, n, *keys), _get(streams, "direct", n, *keys)
    return None if a is None or b is None else a - b


def latency_table(streams: dict[str, Any]) -> list[str]:
    rows = ["| path | N | TTFT p50 | TTFT p99 | added TTFT p50 | added TTFT p99 | ITL p50 | "
            "ITL p99 | added ITL p50 | added ITL p99 | delivery p50 | delivery p99 | added "
            "delivery p99 | events/s | CPU s proxy / engine / client |",
            "|" + "---|" * 15]
    ns = sorted({n for per in streams.values() for n in per}, key=int)
    for n in ns:
        for path, per in streams.items():
            r = per.get(n)
            if r is None:
                continue
            ttft, itl, dl = r["probe"]["ttft_ms"], r["main"]["itl_ms"], r["main"]["delivery_ms"]
            cpu = r["cpu_s"]
            def added(part: str, metric: str, pct: str, n: str = n, path: str = path) -> str:
                if path == "direct":
                    return "-"
                return _f(_added(streams, path, n, part, metric, pct), 3)

            rows.append(
                f"| {path} | {n} | {_f(ttft.get('p50'), 3)} | {_f(ttft.get('p99'), 3)} | "
                f"{added('probe', 'ttft_ms', 'p50')} | {added('probe', 'ttft_ms', 'p99')} | "
                f"{_f(itl.get('p50'), 3)} | {_f(itl.get('p99'), 3)} | "
                f"{added('main', 'itl_ms', 'p50')} | {added('main', 'itl_ms', 'p99')} | "
                f"{_f(dl.get('p50'), 3)} | {_f(dl.get('p99'), 3)} | "
                f"{added('main', 'delivery_ms', 'p99')} | {r['events_per_s']:.0f} | "
                f"{_f(cpu.get('proxy'))} / {_f(cpu['engine'])} / {_f(cpu['client'])} |")
    return rows


def sweep_table(sweep: dict[str, Any]) -> list[str]:
    rows = ["| path | most events/s held | CPU s per 100,000 events (at offered/s) | levels: "
            "offered/s -> delivered/s, p99 ITL ms, held |", "|---|---|---|---|"]
    for path, s in sweep.items():
        levels = "; ".join(
            f"{lv['offered_per_s']:.0f} -> {lv['delivered_per_s']:.0f}, "
            f"{_f(lv['itl_p99_ms'])}, {'yes' if lv['held'] else 'no'}" for lv in s["levels"])
        cpu = ("-" if path == "direct" else
               f"{_f(s['cpu_s_per_100k'])} (at {_f(s['cpu_rate_per_s'], 0)})")
        rows.append(f"| {path} | {s['max_held_per_s']:.0f} | {cpu} | {levels} |")
    return rows


def idle_table(idle: dict[str, Any]) -> list[str]:
    rows = ["| path | proxy processes | idle streams asked | open | RSS before, MiB | RSS open, "
            "MiB | per open stream, KiB |", "|---|---|---|---|---|---|---|"]
    for path, per in idle.items():
        for r in per:
            if r.get("note"):
                rows.append(f"| {path} | - | {r['streams']} | {r['note']} | | | |")
                continue
            per_kib = None if r["per_stream_bytes"] is None else r["per_stream_bytes"] / 1024
            rows.append(f"| {path} | {r['proxy']} | {r['streams']} | {r['open']} | "
                        f"{r['rss_before'] / 2**20:.1f} | {r['rss_open'] / 2**20:.1f} | "
                        f"{_f(per_kib, 1)} |")
    return rows


def _trio(s: dict[str, Any], key: str, digits: int = 2) -> str:
    """p50 / p99 / max (n) of a pooled storm figure, then each storm's p99."""
    d = s.get(key) or {}
    if not d.get("n"):
        return "none"
    each = ", ".join("-" if v is None else f"{v:.{digits}f}"
                     for v in s.get(f"{key}_p99_per_storm", []))
    return (f"{d['p50']:.{digits}f} / {d['p99']:.{digits}f} / {d['max']:.{digits}f} ({d['n']})"
            + (f"; {each}" if each else ""))


def _calls(s: dict[str, Any]) -> str:
    d = s.get("calls_per_request") or {}
    if not d.get("n"):
        return "-"
    return f"{d['p50']:g} / {d['p99']:g} / {d['max']:g}"


def _stopped_by(s: dict[str, Any]) -> str:
    """Closed streams stopped by an abort / by their upstream connection's close / not."""
    if "stopped_ms" not in s:
        return "n/a"
    return f"{s['abort_stopped']} / {s['closed'] - s['abort_stopped'] - s['unstopped']} / " \
           f"{s['unstopped']}"


def _api_path(s: dict[str, Any]) -> bool:
    """A storm through the engine that simulates several API-server processes."""
    return bool(s.get("api_servers", 1) > 1)


def storm_table(storm: dict[str, Any]) -> list[str]:
    rows = ["| ms/token | path | storms | streams open / closed at once, per storm | closes "
            "spread over, ms | client close -> abort call at engine p50 / p99 / max, ms (n), and "
            "each storm's p99 | client close -> upstream close at engine p50 / p99 / max, ms (n), "
            "and each storm's p99 | abort calls | CPU s proxy, per storm | client close -> "
            "engine stopped p50 / p99 / max, ms (n), and each storm's p99 | stopped by abort / "
            "by upstream close / not stopped | abort calls naming a closed stream p50 / p99 / "
            "max |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for interval, per in storm.items():
        for path, s in per.items():
            if _api_path(s):
                continue  # in api_servers_table
            ours = path.startswith(("sidecar", "floor-"))  # the paths that abort
            runs = s.get("storms", 1)
            abort = _trio(s, "abort_ms") if ours else "no abort (not its job)"
            rows.append(f"| {interval} | {path} | {runs} | {s['open'] // runs} / "
                        f"{s['closed'] // runs} | {s['close_spread_ms']:.2f} | {abort} | "
                        f"{_trio(s, 'upstream_close_ms')} | {s['abort_calls'] if ours else '-'} | "
                        f"{_f(s['cpu_s'].get('proxy'))} | {_trio(s, 'stopped_ms')} | "
                        f"{_stopped_by(s)} | {_calls(s) if ours else '-'} |")
    return rows


def api_servers_table(storm: dict[str, Any]) -> list[str]:
    """The storm through the sidecar in front of several simulated API-server processes, beside
    the same storm on one process: the sidecar's, nginx's and the floors'."""
    if not any(_api_path(s) for per in storm.values() for s in per.values()):
        return ["Not run in this run (no sidecar path, or `--storm-api-servers 1`)."]
    rows = ["| ms/token | path | API-server processes | client close -> engine stopped p50 / p99 / "
            "max, ms (n), and each storm's p99 | stopped by abort / by upstream close / not "
            "stopped | client close -> the abort call that stopped it p50 / p99 / max, ms (n) | "
            "abort calls naming a closed stream p50 / p99 / max | ids named on their owner / "
            "on another process (all abort calls) | abort calls taken by each API-server "
            "process | connections that carried them, per process, per storm | CPU s proxy, per "
            "storm |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = ("sidecar", "nginx", "floor-raw", "floor-aiohttp")
    for interval, per in storm.items():
        paths = [p for p in per if _api_path(per[p])] + [p for p in order if p in per]
        for path in paths:
            s = per[path]
            ours = path.startswith(("sidecar", "floor-"))
            rows.append(f"| {interval} | {path} | {s.get('api_servers', 1)} | "
                        f"{_trio(s, 'stopped_ms')} | {_stopped_by(s)} | "
                        f"{_trio(s, 'hit_ms') if ours else 'no abort (not its job)'} | "
                        f"{_calls(s) if ours else '-'} | "
                        f"{s.get('abort_hits', 0)} / {s.get('abort_misses', 0)} | "
                        f"{' / '.join(map(str, s.get('calls_by_process', []))) or '-'} | "
                        f"{_connections(s) if ours else '-'} | "
                        f"{_f(s['cpu_s'].get('proxy'))} |")
    return rows


def _connections(s: dict[str, Any]) -> str:
    """The distinct connections each API-server process took abort calls on, per storm
    (``4/4/4/4; 3/5/4/4``)."""
    storms = [c for c in s.get("connections_by_process", []) if c]
    return "; ".join("/".join(map(str, c)) for c in storms) or "-"


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured value, met) for each target of issue 6, then issue 12's
    (:func:`relay_targets`); ``None``: not measured."""
    phases = results["phases"]
    streams = phases.get("streams", {})
    ns = sorted({int(n) for per in streams.values() for n in per})
    n = "256" if 256 in ns else (str(ns[-1]) if ns else "")
    at = f" at {n} streams"
    out: list[tuple[str, str, bool | None]] = []

    def add(name: str, value: float | None, limit: float, unit: str) -> None:
        out.append((name, "not measured" if value is None else f"{value:.3f} {unit}",
                    None if value is None else value <= limit))

    add(f"added TTFT p50 <= 0.5 ms{at}", _added(streams, "sidecar", n, "probe", "ttft_ms", "p50"),
        0.5, "ms")
    add(f"added TTFT p99 <= 2 ms{at}", _added(streams, "sidecar", n, "probe", "ttft_ms", "p99"),
        2.0, "ms")
    add(f"added ITL p99 <= 1 ms{at}", _added(streams, "sidecar", n, "main", "itl_ms", "p99"),
        1.0, "ms")
    sweep = phases.get("sweep", {})
    best_sidecar = max((s["max_held_per_s"] for p, s in sweep.items()
                        if p.startswith("sidecar")), default=None)
    nginx = _get(sweep, "nginx", "max_held_per_s")
    if best_sidecar is None or not nginx:
        out.append(("sustained events/s >= 50% of nginx's", "not measured", None))
    else:
        which = max((p for p in sweep if p.startswith("sidecar")),
                    key=lambda p: sweep[p]["max_held_per_s"])
        ratio = best_sidecar / nginx
        out.append(("sustained events/s >= 50% of nginx's",
                    f"{best_sidecar:.0f} ({which}) vs {nginx:.0f}: {ratio:.0%}", ratio >= 0.5))
    idle = [r for r in _get(phases, "idle", "sidecar") or []
            if r["per_stream_bytes"] is not None]
    add("memory per idle open stream <= 32 KiB" + (
        f" ({idle[-1]['streams']} streams, {idle[-1]['proxy']})" if idle else ""),
        idle[-1]["per_stream_bytes"] / 1024 if idle else None, 32.0, "KiB")
    for interval, per in (phases.get("storm") or {}).items():
        nginx = _get(per, "nginx", "upstream_close_ms", "p99")
        for path in (p for p in per if p.startswith("sidecar") and not _api_path(per[p])):
            p99 = _get(per, path, "abort_ms", "p99")
            add(f"abort call p99 <= 10 ms after client close (storm, {interval} ms/token, "
                f"{path})", p99, 10.0, "ms")
            if nginx is not None:
                add(f"abort call p99 <= nginx's upstream close p99 {nginx:.2f} ms (storm, "
                    f"{interval} ms/token, {path})", p99, nginx, "ms")
        for path in (p for p in per if p.startswith("sidecar") and "unstopped" in per[p]):
            s = per[path]
            what = (f"{s['api_servers']} API-server processes" if _api_path(s)
                    else "1 API-server process")
            out.append((f"every closed stream stopped by the engine (storm, {interval} ms/token, "
                        f"{path}, {what})",
                        f"{s['unstopped']} of {s['closed']} not stopped, "
                        f"{s['closed'] - s['abort_stopped'] - s['unstopped']} by the upstream "
                        "close (unconfirmed)", s["unstopped"] == 0))
    out.extend(relay_targets(results))
    vllm = results.get("vllm", {})
    if vllm.get("measured") and vllm.get("sidecar"):
        add("tokens generated after a disconnect on real vLLM <= 5 (max over runs)",
            float(max(vllm["sidecar"])), 5.0, "tokens")
    else:
        out.append(("tokens generated after a disconnect on real vLLM <= 5",
                    "not measured in this run", None))
    return out


def floor_table(results: dict[str, Any]) -> list[str]:
    """The sidecar beside bench.floor's proxies on the figures whose targets are absolute:
    added TTFT at 256 streams and the storm's abort call p99, per token interval."""
    phases = results["phases"]
    streams, storm = phases.get("streams", {}), phases.get("storm") or {}
    paths = [p for p in ("sidecar", "floor-aiohttp", "floor-raw", "nginx")
             if p in streams or any(p in per for per in storm.values())]
    if not any(p.startswith("floor-") for p in paths):
        return ["No floor path in this run (`--paths`)."]
    ns = sorted({int(k) for per in streams.values() for k in per if int(k) <= 256})
    n = str(ns[-1]) if ns else None  # 256 in a full run
    head = ["figure", *(PATH_LABELS.get(p, p) for p in paths)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if n is not None:
        for pct in ("p50", "p99"):
            cells = [_f(_added(streams, p, n, "probe", "ttft_ms", pct), 3) for p in paths]
            rows.append(f"| added TTFT {pct} at {n} streams, ms | " + " | ".join(cells) + " |")
    for interval, per in storm.items():
        cells = [("-" if p == "nginx" else _f(_get(per, p, "abort_ms", "p99")))
                 for p in paths]
        rows.append(f"| storm {interval} ms/token: client close -> abort call p99, ms | "
                    + " | ".join(cells) + " |")
        cells = [_f(_get(per, p, "upstream_close_ms", "p99")) for p in paths]
        rows.append(f"| storm {interval} ms/token: client close -> upstream close p99, ms | "
                    + " | ".join(cells) + " |")
    return rows


def relay_targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured value, met) for the done-when lines of issue 12 (the relay at nginx's
    cost) that this run measures; ``None``: not measured."""
    phases = results["phases"]
    streams, sweep = phases.get("streams", {}), phases.get("sweep", {})
    out: list[tuple[str, str, bool | None]] = []

    def ratio(name: str, ours: float | None, theirs: float | None, limit: float,
              unit: str = "") -> None:
        if ours is None or not theirs:
            out.append((name, "not measured", None))
        else:
            out.append((name, f"{ours:.3g}{unit} vs {theirs:.3g}{unit}: {ours / theirs:.2f}x",
                        ours / theirs <= limit))

    ratio("proxy CPU s per 100,000 events <= 1.2x nginx's (1 worker)",
          _get(sweep, "sidecar", "cpu_s_per_100k"), _get(sweep, "nginx", "cpu_s_per_100k"), 1.2)
    for pct, limit in (("p50", 0.3), ("p99", 1.0)):
        value = _added(streams, "sidecar", "256", "probe", "ttft_ms", pct)
        out.append((f"added TTFT {pct} <= {limit:g} ms at 256 streams (issue 12)",
                    "not measured" if value is None else f"{value:.3f} ms",
                    None if value is None else value <= limit))
    value = _added(streams, "sidecar", "256", "main", "itl_ms", "p99")
    out.append(("added ITL p99 <= 0.3 ms at 256 streams (issue 12)",
                "not measured" if value is None else f"{value:.3f} ms",
                None if value is None else value <= 0.3))
    offered = _get(streams, "direct", "1000", "events_per_s")
    delivered = _get(streams, "sidecar", "1000", "events_per_s")
    if offered and delivered is not None:
        out.append(("1,000 streams, 1 worker: >= 95% of the events direct delivers",
                    f"{delivered:.0f}/s vs {offered:.0f}/s: {delivered / offered:.1%}",
                    delivered / offered >= 0.95))
    else:
        out.append(("1,000 streams, 1 worker: >= 95% of the events direct delivers",
                    "not measured", None))
    ratio("1,000 streams, 1 worker: ITL p99 <= 2x direct's",
          _get(streams, "sidecar", "1000", "main", "itl_ms", "p99"),
          _get(streams, "direct", "1000", "main", "itl_ms", "p99"), 2.0, " ms")
    w2 = _get(sweep, "sidecar-w2", "max_held_per_s")
    nginx = _get(sweep, "nginx", "max_held_per_s")
    out.append(("most events/s held with --workers 2 >= nginx's",
                "not measured" if w2 is None or not nginx else f"{w2:.0f} vs {nginx:.0f}",
                None if w2 is None or not nginx else w2 >= nginx))
    ours = [r for r in _get(phases, "idle", "sidecar") or [] if r["per_stream_bytes"]]
    theirs = [r for r in _get(phases, "idle", "nginx") or [] if r["per_stream_bytes"]]
    pairs = [(a, b) for a in ours for b in theirs if a["streams"] == b["streams"]]
    if pairs:
        a, b = pairs[0]
        ratio(f"memory per idle open stream <= 1.3x nginx's ({a['streams']} streams)",
              a["per_stream_bytes"] / 1024, b["per_stream_bytes"] / 1024, 1.3, " KiB")
    else:
        out.append(("memory per idle open stream <= 1.3x nginx's", "not measured", None))
    p99 = _get(phases, "storm", "20", "sidecar", "abort_ms", "p99")
    out.append(("abort call p99 <= 25 ms after client close (storm, 20 ms/token; issue 12)",
                "not measured" if p99 is None else f"{p99:.3f} ms",
                None if p99 is None else p99 <= 25.0))
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    """Latency against concurrency, one line per path, log-x: TTFT and ITL/delivery p50/p99."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = results["phases"].get("streams", {})
    panels = [("probe", "ttft_ms", "p50", "time to first token p50"),
              ("probe", "ttft_ms", "p99", "time to first token p99"),
              ("main", "delivery_ms", "p50", "event delivery latency p50"),
              ("main", "delivery_ms", "p99", "event delivery latency p99"),
              ("main", "itl_ms", "p50", "inter-token latency p50"),
              ("main", "itl_ms", "p99", "inter-token latency p99")]
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    for ax, (part, metric, pct, title) in zip(axes.flat, panels, strict=True):
        for name, per in streams.items():
            ns = sorted(per, key=int)
            xs = [int(n) for n in ns if _get(per, n, part, metric, pct) is not None]
            ys = [per[str(n)][part][metric][pct] for n in xs]
            ax.plot(xs, ys, marker="o", label=PATH_LABELS.get(name, name))
        ax.set_xscale("log")
        if metric != "itl_ms":  # ITL sits near the token interval: a linear axis reads better
            ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = results.get("meta", {})
    fig.suptitle(f"cancel-sidecar vs nginx vs direct: {meta.get('interval_ms')} ms/token, "
                 f"{meta.get('cores')} cores, {meta.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    phases = results["phases"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/` (`python -m bench`); do not edit by hand: rerun the command.",
        "",
        f"- Date: {meta['date']}; run time {meta['duration_s']} s"
        + (" (**--quick: tiny sizes, numbers not meaningful**)" if meta["quick"] else ""),
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['cores']} cores, {meta['cpu']}, Linux {meta['kernel']}; Python "
        f"{meta['python']}, aiohttp {meta['aiohttp']}, uvloop {meta['uvloop']}, nginx "
        f"{meta['nginx']}; RLIMIT_NOFILE {meta['nofile']}",
        f"- Paths: the fake engine directly; cancel-sidecar (`python -m sidecar --config ... "
        f"--workers {meta['workers'][0]}`, log level WARNING, and `--workers` "
        f"{', '.join(map(str, meta['workers'][1:])) or 'none'} for the sweep); nginx "
        f"(`worker_processes {meta['nginx_workers']}`, `proxy_buffering off`, "
        f"`proxy_http_version 1.1`, upstream `keepalive 1024`).",
        f"- Streams: {meta['tokens']} tokens every {meta['interval_ms']} ms, OpenAI chat chunk "
        f"events of ~220 bytes.",
        "",
        "## Targets",
        "",
        "| target (cancel-sidecar) | measured | met |",
        "|---|---|---|",
    ]
    for name, value, met in targets(results):
        lines.append(f"| {name} | {value} | "
                     f"{'n/a' if met is None else ('**met**' if met else '**not met**')} |")
    lines += [
        "",
        "## The floor",
        "",
        "`bench.floor` is the least a Python proxy on uvloop does: no limits, timeouts, "
        "header rewriting or bookkeeping; upstream responses parsed by httptools and written "
        "to the client in the same callback; on a client's loss its engine id queued, one "
        "abort call per loop turn on a warm connection, the upstream closed. `floor-raw` "
        "parses requests with httptools in an asyncio Protocol; `floor-aiohttp` terminates "
        "them with aiohttp's low-level `web.Server` (handler cancellation on), as the sidecar "
        "does. Same run, same phases (the tables below have their rows): what of a figure "
        "this machine, Python and aiohttp cost anyway, and what the sidecar adds.",
        "",
        *floor_table(results),
        "",
        "## Time to first token and inter-token latency",
        "",
        "Milliseconds. N streams open at once; TTFT from a prober that sends one-token "
        "requests one at a time (10 ms apart) while the N streams run; ITL and delivery "
        "latency (client read time - engine send time) over every event of the N streams. "
        "Added = path - direct, same N, same run. CPU s = seconds each process used in the "
        "phase (psutil).",
        "",
        *latency_table(phases.get("streams", {})),
        "",
        "![latency against concurrency](benchmarks.png)",
        "",
        "## Most SSE events per second held",
        "",
        f"{meta['sweep_streams']} streams, the offered rate raised by shortening the interval "
        f"({meta['sweep_s']} s per level) until a level fails, then "
        f"{meta.get('sweep_refine', 0)} more levels bisecting the gap between the last level "
        "held and the first failed (the top rates are ~20% apart). A level holds when at least "
        "90% of the offered events arrive and p99 inter-token latency, as a multiple of the "
        "interval, is at most twice that multiple at the lowest rate (the issue's \"p99 "
        "inter-token latency doubles\"; normalised because the interval shrinks as the rate "
        "rises). The direct path's figure is the ceiling of the engine and client themselves "
        "on this machine: a proxy cannot be shown above it. CPU s per 100,000 events: the "
        "proxy processes' CPU seconds at the fixed rate shown.",
        "",
        *sweep_table(phases.get("sweep", {})),
        "",
        "## Memory per idle open stream",
        "",
        "Resident memory of the proxy's processes (nginx: master and workers; the sidecar: its "
        "process, or supervisor and workers) with K idle streams open (response head and "
        "first event received, then nothing) minus before, divided by the streams open. "
        "Each stream holds two "
        f"connections in the proxy; RLIMIT_NOFILE is {meta['nofile']} here (the hard limit: "
        "the container cannot raise it), so a K a single process cannot hold runs on the "
        "sidecar with more workers (SO_REUSEPORT spreads the connections), as the table says; "
        "nginx listens with `reuseport` for the same reason.",
        "",
        *idle_table(phases.get("idle", {})),
        "",
        "## Disconnect storm",
        "",
        f"{meta['storm']} streams, then half of them closed by the client in one loop "
        f"({meta['close'].upper()}), {meta.get('storm_reps', 1)} storm(s) per path and token "
        "interval, the paths in turn; the figures pool every storm's closed streams (one "
        "storm's p99 is about its 5th slowest close and moves 2x from storm to storm on this "
        "box), and each storm's own p99 follows them. Token intervals "
        f"({meta['storm_interval_ms']} ms: "
        f"{meta['storm']} streams at {meta['interval_ms']} ms/token offer "
        f"{meta['storm'] * 1000 / meta['interval_ms']:.0f} events/s, compare the sweep). "
        "The client's close time is taken in uvloop's `connection_lost`, right before it "
        "closes the socket. Per closed stream, from the client's close to the engine "
        "reading the head of the abort call that names its engine id "
        "(`chatcmpl-{X-Request-Id}`), and to the engine seeing that stream's upstream "
        "connection close (while the stream ran, or after an abort ended it), and to the engine "
        "stopping the stream: the "
        "fake engine, as vLLM, ends a stream at once when an abort call reaches it (a last "
        "chunk with `\"finish_reason\":\"abort\"`, then `data: [DONE]`), so stopped is the "
        "earlier of that abort and the upstream close. The sidecar confirms an abort (it keeps "
        "the upstream connection open and reads that last chunk, re-sending the abort until "
        "then, for at most `confirm_timeout_s`, 2 s, before it closes the connection), so its "
        "upstream close column counts the streams it could not confirm and the connections it "
        "closed after a confirmed end instead of pooling them. Abort calls "
        "naming a closed stream: every call whose body names its engine id, the re-sends "
        "too. Both clocks are `CLOCK_MONOTONIC` of one host"
        + (" (checked at start)." if _get(results, "clock", "shared_monotonic_clock") else "."),
        "",
        *storm_table(phases.get("storm", {})),
        "",
        "## Disconnect storm on several API-server processes",
        "",
        f"The same storms through a second sidecar (same config) in front of a second fake "
        f"engine that simulates {meta.get('storm_api_servers', 4)} vLLM API-server processes "
        "behind one port (`vllm serve --api-server-count N`): each connection belongs to the "
        "process that accepted it, the one with the fewest open connections at accept (vLLM "
        "0.32's launcher, `entrypoints/launchers/launcher.py`; ties at random, seeded), "
        "and an abort call stops only the streams of its own connection's process; it answers "
        "200 for the others and changes nothing (a miss). Beside it, the storms on the "
        "one-process engine: the sidecar's, and nginx's and the floors' as the comparison "
        "(nginx only closes the upstream connection; a floor aborts once and closes it: "
        "neither depends on which process owns the stream, since a closed connection stops "
        "its stream in any process). Stopped by abort: an abort call reached the stream's "
        "process (for the sidecar, what it confirms); by upstream close: for the sidecar, a "
        "stream it did not confirm within its bound; not stopped: still running at the engine "
        "when the records were read, 2.7 s after the closes (the sidecar's 2 s bound had "
        "passed), or earlier once every closed stream had stopped. The abort "
        "calls each process took show whether the sidecar's abort connections reach every "
        "process: a stream whose process none of them reaches can be stopped only by closing "
        "its upstream connection.",
        "",
        *api_servers_table(phases.get("storm", {})),
        "",
        "## Real vLLM: tokens generated after a disconnect",
        "",
    ]
    vllm = results.get("vllm", {})
    if vllm.get("measured"):
        lines += [
            "| path | tokens generated after the disconnect, per run | tokens/s |",
            "|---|---|---|",
            f"| direct | {vllm.get('direct')} | {_f(vllm.get('tokens_per_s'), 1)} |",
            f"| cancel-sidecar | {vllm.get('sidecar')} | {_f(vllm.get('tokens_per_s'), 1)} |",
            "",
            *([f"Client close -> vLLM stops running the request, through the sidecar, ms: "
               f"{vllm['stop_ms_sidecar']}.", ""] if vllm.get("stop_ms_sidecar") else []),
            str(vllm.get("notes", "")),
        ]
    else:
        lines += ["| path | tokens generated after the disconnect |", "|---|---|",
                  "| direct | not measured in this run |",
                  "| cancel-sidecar | not measured in this run |", "",
                  str(vllm.get("notes", ""))]
    prof = results.get("profile")
    lines += ["", "## Where the sidecar spends its CPU (py-spy)", ""]
    if not prof:
        lines.append("Not profiled in this run (`--quick` or `--no-profile`).")
    elif not prof.get("ok"):
        lines.append(f"py-spy failed: {prof.get('error')}")
    else:
        lines += [
            f"`py-spy record --nonblocking --rate 250` on the sidecar (`--workers 1`) for "
            f"{prof['seconds']:.0f} s while {prof['streams']} streams "
            f"({prof['interval_ms']} ms/token) ran through it, in a phase of its own; "
            f"{prof['samples']} samples of busy time. Share of samples:",
            "",
            "| by package (innermost frame) | % | by function (innermost frame) | % | sidecar "
            "function on the stack (inclusive) | % |",
            "|---|---|---|---|---|---|",
        ]
        rows = max(len(prof["by_package"]), len(prof["by_function"]),
                   len(prof["sidecar_inclusive"]))
        for i in range(rows):
            cells = []
            for key in ("by_package", "by_function", "sidecar_inclusive"):
                items = prof[key]
                cells += ([f"`{items[i][0]}`", str(items[i][1])] if i < len(items)
                          else ["", ""])
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Method and limits",
        "",
        f"- Everything runs on the same {meta['cores']} cores: the fake engine (raw uvloop "
        "Protocols), the load client (raw uvloop Protocols, one process) and the proxy compete "
        "for CPU, so a figure near saturation is partly the client's or the engine's; the CPU "
        "seconds per process are in each table for that reason. Phases run one after "
        "another, the paths in turn within each phase.",
        "- The engine stamps each event with `time.monotonic_ns()`; the client subtracts it "
        "from its read time. uvloop timers tick in whole milliseconds, so ITL shows 1 ms "
        "steps; the added figures subtract that out.",
        "- The sidecar logs at WARNING so logging does not dominate the hot path.",
        "- The memory phase runs first, on proxies that have served only a warm-up, and "
        "measures against the RSS just before the streams open.",
        "- Numbers move with the other load on the machine; compare paths within one run.",
    ]
    if meta["nofile"] < 2 * max(meta["idle"]) + 100:
        lines.append(f"- RLIMIT_NOFILE is {meta['nofile']}: too low for "
                     f"{max(meta['idle'])} idle streams through one proxy process.")
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path) -> str:
    text = render(results)
    (out / "benchmarks.md").write_text(text)
    plot(results, out / "benchmarks.png")
    return text


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="regenerate benchmarks.md/.png from benchmarks.json")
    p.add_argument("dir", type=Path)
    args = p.parse_args()
    write(json.loads((args.dir / "benchmarks.json").read_text()), args.dir)


if __name__ == "__main__":
    main()
