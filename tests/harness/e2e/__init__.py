"""The real vLLM harness: see :mod:`tests.harness`."""
