"""The load tests' processes: see :mod:`tests.harness`."""
