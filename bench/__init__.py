"""Benchmark of cancel-sidecar against the engine directly and against nginx.

``python -m bench`` (:mod:`bench.run`) starts a fake engine (:mod:`bench.engine`), a load
client (:mod:`bench.client`) and the proxies (:mod:`bench.procs`), measures time to first
token, inter-token latency, event delivery latency, the most SSE events per second held, memory
per idle stream and the client-close -> abort time in a disconnect storm, and writes the report
(:mod:`bench.report`): ``docs/benchmarks.md`` and ``docs/benchmarks.png``.
"""
