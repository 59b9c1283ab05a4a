"""What the tests run and drive besides the fakes: the sidecar as production runs it, clients
that see the wire, waits and metric reads, and the real third-party servers.

- :mod:`tests.harness.support`: raw-socket clients with exact disconnect timing, event-driven
  waits that exclude time this process did not run (``Stalls``), ``/metrics`` readers.
- :mod:`tests.harness.rawhttp`: raw-socket HTTP/1.x (exact request bytes, unnormalised answers).
- :mod:`tests.harness.cli_process`: ``python -m sidecar`` as a subprocess, for signal tests.
- :mod:`tests.harness.prometheus_server`: a real Prometheus that scrapes the sidecar.
- ``tests.harness.llamacpp_*``: the real llama.cpp servers and their tiny GGUF model.
- :mod:`tests.harness.e2e`: the real vLLM (server, tiny model, middlewares, stop measurements)
  and the sidecar CLI subprocess, for ``tests/e2e``, ``demo`` and ``bench``.
- :mod:`tests.harness.load`: the fake engine and the sidecar each in a process of its own, for
  ``tests/load``.

Nothing here is collected by pytest; the suites (``tests/``, ``tests/faults``, ``tests/e2e``,
``tests/load``) hold the tests and the probes and measurements run by hand.
"""
