"""``python -m bench.ab A B``: two cancel-sidecar checkouts side by side, for a change too small to
see between two runs of ``python -m bench``.

Why: on the bench machine the same code's time to first token moves by ~10% from one run to the
next, while a cut of one step on the request path is worth 10-30 us of ~900 (1-3%). Here the two
sidecars run at the same time, so the machine's state is the same for both:

- one fake engine (:mod:`bench.engine`), and each checkout's sidecar in front of it (its
  ``python -m sidecar``, ``--workers 1``, with bench's config: :func:`bench.procs.start_sidecar`);
- one client sends one-token streaming requests (the bench prober's) on one keep-alive connection
  per sidecar, ``--pause-ms`` after each answer on each, one connection starting half of that
  after the other (A first in even rounds, B in odd ones); with ``--tokens N`` each request
  streams N events, ``--interval-us`` apart, so the CPU per request carries N relayed events
  (a change to the byte path: ~0.5 us per event is 25 us per request at 50 tokens);
- per round and sidecar: time to first token p50/p90 at the client (request written -> first
  event read) and the sidecar's CPU per request (psutil); then B - A per round, and its median
  over the rounds. A negative B - A: B is faster.

A and B are checkout directories (``git worktree add /tmp/a <commit>`` makes one); the ``.venv``
of this checkout runs both, so a change to the dependencies is not compared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import uvloop

from bench.client import Samples, StreamConnection, connect, percentiles, request
from bench.procs import Proc, start_engine, start_sidecar


async def _round(proxies: list[Proc], count: int, pause_s: float, tokens: int = 1,
                 interval_us: int = 20000) -> list[Samples]:
    """``count`` requests of ``tokens`` events (``interval_us`` apart) through each proxy,
    ``pause_s`` apart on each connection, the connections offset by ``pause_s / len(proxies)``.
    """
    samples = [Samples() for _ in proxies]
    connections = []
    for i, proxy in enumerate(proxies):
        if i:
            await asyncio.sleep(pause_s / len(proxies))
        connection = StreamConnection(samples[i], lambda: request("stream", tokens, interval_us),
                                      count=count, pause_s=pause_s)
        connections.append(await connect(proxy.port, connection))
    await asyncio.wait_for(asyncio.gather(*(c.finished for c in connections)),
                           count * (pause_s + (tokens - 1) * interval_us / 1e6) + 60)
    for connection in connections:
        if connection.transport is not None:
            connection.transport.close()
    return samples


async def compare(checkouts: list[Path], requests: int, pause_ms: float, rounds: int,
                  warmup: int, tokens: int = 1,
                  interval_us: int = 20000) -> list[list[dict[str, float]]]:
    """Per round, per checkout: ``{"n", "ttft_p50_us", "ttft_p90_us", "cpu_us"}``."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    engine = await start_engine(log_dir)
    proxies: list[Proc] = []
    try:
        for i, checkout in enumerate(checkouts):
            proxies.append(await start_sidecar(log_dir, engine.port, 1, name=f"sidecar-{'AB'[i]}",
                                               repo=checkout))
        await _round(proxies, warmup, pause_ms / 1e3, tokens, interval_us)
        results = []
        for r in range(rounds):
            cpu = [p.cpu_s() for p in proxies]
            # Which sidecar's requests lead alternates by round: a position effect cancels.
            order = proxies if r % 2 == 0 else proxies[::-1]
            samples = await _round(order, requests, pause_ms / 1e3, tokens, interval_us)
            if r % 2:
                samples.reverse()
            row = []
            for proxy, before, got in zip(proxies, cpu, samples, strict=True):
                ttft = percentiles(got.ttft)
                row.append({"n": ttft["n"], "errors": got.errors,
                            "ttft_p50_us": ttft.get("p50", 0.0) * 1e3,
                            "ttft_p90_us": ttft.get("p90", 0.0) * 1e3,
                            "cpu_us": (proxy.cpu_s() - before) / max(1, ttft["n"]) * 1e6})
            results.append(row)
        return results
    finally:
        for proc in [*proxies, engine]:
            await proc.stop()


def render(checkouts: list[Path], results: list[list[dict[str, float]]]) -> str:
    lines = ["| round | checkout | requests | TTFT p50 us | TTFT p90 us | CPU us per request |",
             "|---|---|---|---|---|---|"]
    for r, row in enumerate(results):
        for name, path, got in zip("AB", checkouts, row, strict=True):
            lines.append(f"| {r} | {name} ({path}) | {got['n']:.0f} ({got['errors']:.0f} errors)"
                         f" | {got['ttft_p50_us']:.1f} | {got['ttft_p90_us']:.1f} | "
                         f"{got['cpu_us']:.1f} |")
    for key in ("ttft_p50_us", "ttft_p90_us", "cpu_us"):
        deltas = [row[1][key] - row[0][key] for row in results]
        lines.append(f"B - A {key}: " + ", ".join(f"{d:+.1f}" for d in deltas)
                     + f" (median {statistics.median(deltas):+.1f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="checkout A (the base)")
    p.add_argument("b", type=Path, help="checkout B (the change)")
    p.add_argument("--requests", type=int, default=3000, help="per sidecar and round")
    p.add_argument("--pause-ms", type=float, default=20.0,
                   help="between two requests to one sidecar (default 20: 10 ms between the "
                        "two sidecars' requests, as bench's prober)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=200, help="requests per sidecar first, unmeasured")
    p.add_argument("--tokens", type=int, default=1,
                   help="events per request (default 1: the request path; more: the byte path)")
    p.add_argument("--interval-us", type=int, default=20000,
                   help="between two events of a request (default 20000, the bench's)")
    args = p.parse_args(argv)
    checkouts = [args.a.resolve(), args.b.resolve()]
    for checkout in checkouts:
        if not (checkout / "sidecar" / "__main__.py").is_file():
            p.error(f"{checkout}: not a cancel-sidecar checkout (no sidecar/__main__.py)")
    results = uvloop.run(compare(checkouts, args.requests, args.pause_ms, args.rounds,
                                 args.warmup, args.tokens, args.interval_us))
    print(render(checkouts, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
