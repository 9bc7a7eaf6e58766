"""Benchmark output, one room per concern:

* :mod:`~bench.report.aggregation` — a cell's shared metrics from its per-request counts;
* :mod:`~bench.report.cell_metrics` — run-level extras (link bytes, proactive timing,
  depths, concurrent utilisation);
* :mod:`~bench.report.labels` — profile / workload labels (``weak@c8``, ``medium+slow``);
* :mod:`~bench.report.ratios` — every comparison row (``value > 1``: the mode is better);
* :mod:`~bench.report.identity` — greedy identity against the target alone;
* :mod:`~bench.report.schema` — the ``results.json`` schema, write / load;
* :mod:`~bench.report.tables`, :mod:`~bench.report.sections` — ``summary.md``;
* :mod:`~bench.report.plots` — the PNG plots; :mod:`~bench.report.outputs` — the folder.

The names below are the package's API (``from bench import report``).
"""
from bench.report.aggregation import BREAKDOWN_PHASES, CORRECTION_MODES, SCALAR_METRICS, aggregate
from bench.report.plots import write_plots
from bench.report.ratios import compute_ratios, ratio_row, run_index
from bench.report.schema import load_results, validate_results, write_results
from bench.report.tables import runs_table, write_summary_md

__all__ = [
    "SCALAR_METRICS", "CORRECTION_MODES", "BREAKDOWN_PHASES", "aggregate", "compute_ratios",
    "ratio_row", "run_index", "validate_results", "write_results", "load_results",
    "write_summary_md", "runs_table", "write_plots",
]
