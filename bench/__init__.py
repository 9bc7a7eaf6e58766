"""Benchmark harness (``specrelay bench``), one room per concern:

* :mod:`bench.cli` — the click command (options → :class:`bench.config.BenchConfig`);
  :mod:`bench.console` — the summary it prints;
* :mod:`bench.harness` — :func:`~bench.harness.run_bench`: process layout and run loop;
  :mod:`bench.cells` — the cells of a run and their order; :mod:`bench.cell_run` —
  measuring them; :mod:`bench.cloud_process` — the target server process;
  :mod:`bench.contention` — emulated edge contention;
* :mod:`bench.linkem` — the user-space link emulator (network profiles, shaping proxy);
* :mod:`bench.modes` — how the edge produces a completion, one mode family per file;
* :mod:`bench.report` — metrics, ratios, identity, ``results.json``, summary, plots;
* :mod:`specrelay_data.workloads` — the prompts; :mod:`bench.loadtest`,
  :mod:`bench.shape_invariance` — standalone probes.
"""
