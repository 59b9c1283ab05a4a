"""Serve a GGUF model with llama.cpp's own C++ HTTP server, as the ``xllamacpp`` wheel bundles it
(``tests/test_llamacpp_native.py``).

``xllamacpp`` (PyPI, a prebuilt CPU wheel) compiles llama.cpp's ``tools/server`` into a Python
extension: ``xllamacpp.Server(params)`` loads the model, starts the server's HTTP and inference
threads (``Server: llama.cpp``; ``/v1/models``, ``/v1/chat/completions``, ``/metrics``,
``/slots``) and returns. The wheel has no command line, so this module is one; the process
serves until SIGTERM ends it (its default action: no Python handler, no clean-up to wait for).
Run with the interpreter that has ``xllamacpp``::

    python -m tests.harness.llamacpp_native_server MODEL.gguf PORT [SLOTS]

``SLOTS`` (default 1) is llama-server's ``--parallel``: with one slot a second request waits
for the first, as with llama-cpp-python's server.
"""

from __future__ import annotations

import signal
import sys

import xllamacpp


def serve(model: str, port: int, slots: int = 1) -> None:
    """Serve ``model`` on 127.0.0.1:``port`` with ``slots`` slots until the process is ended.
    The settings match ``tests/test_llamacpp.py``'s server: a 4096-token context (shared by
    the slots), one thread, the model named ``tiny``."""
    params = xllamacpp.CommonParams()
    params.model.path = model
    params.model_alias = {"tiny"}
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = 4096
    params.n_parallel = slots
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.endpoint_metrics = True  # llamacpp:n_decode_total and friends
    params.endpoint_slots = True  # per slot: is_processing, n_decoded
    server = xllamacpp.Server(params)
    print(f"serving {model} at {server.listening_address} with {slots} slot(s)", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
