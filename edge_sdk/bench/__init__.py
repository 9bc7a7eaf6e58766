"""Benchmark harness: link emulator, workloads, result reporting (issue #4)."""
