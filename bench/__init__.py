"""Benchmark harness: link emulator, workloads, result reporting."""
