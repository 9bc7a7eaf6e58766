"""The ``results.json`` schema: validation, writing and reading.

``results.json`` has exactly this shape::

    {"config": {...free-form run configuration...},
     "runs":   [{"mode": str, "profile": str, "workload": str, "metrics": {...}}],
     "ratios": [{"metric": str, "profile": str, "mode": str, "baseline": str, "value": float}]}

``metrics`` holds at least the shared scalar metrics of
:data:`bench.report.aggregation.SCALAR_METRICS` (a number, or ``null`` when it does not
apply), ``correction_mode_counts`` and ``breakdown_s``; extra keys are allowed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from bench.report.aggregation import BREAKDOWN_PHASES, CORRECTION_MODES, SCALAR_METRICS

__all__ = ["is_num", "validate_results", "write_results", "load_results"]


def is_num(v: Any) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_counts(v: Any, keys: Sequence[str], where: str, integer: bool) -> None:
    if not isinstance(v, dict):
        raise ValueError(f"{where}: must be an object with keys {list(keys)}")
    if set(v) != set(keys):
        raise ValueError(f"{where}: keys must be exactly {list(keys)}, got {sorted(v)}")
    for k in keys:
        x = v[k]
        ok = (isinstance(x, int) and not isinstance(x, bool)) if integer else is_num(x)
        if not ok or x < 0:
            raise ValueError(f"{where}.{k}: must be a non-negative {'integer' if integer else 'number'}, got {x!r}")


def _check_top(obj: Any) -> None:
    if not isinstance(obj, dict):
        raise ValueError("results: must be an object")
    if set(obj) != {"config", "runs", "ratios"}:
        raise ValueError(f"results: keys must be exactly ['config', 'ratios', 'runs'], got {sorted(obj)}")
    if not isinstance(obj["config"], dict):
        raise ValueError("config: must be an object")
    if not isinstance(obj["runs"], list):
        raise ValueError("runs: must be a list")
    if not isinstance(obj["ratios"], list):
        raise ValueError("ratios: must be a list")


def _check_metrics(m: Any, where: str) -> None:
    if not isinstance(m, dict):
        raise ValueError(f"{where}.metrics: must be an object")
    for name in SCALAR_METRICS:
        if name not in m:
            raise ValueError(f"{where}.metrics.{name}: missing")
        v = m[name]
        if v is not None and (not is_num(v) or v < 0):
            raise ValueError(f"{where}.metrics.{name}: must be a non-negative number or null, got {v!r}")
    for name in ("correction_mode_counts", "breakdown_s"):
        if name not in m:
            raise ValueError(f"{where}.metrics.{name}: missing")
    _check_counts(m["correction_mode_counts"], CORRECTION_MODES, f"{where}.metrics.correction_mode_counts", True)
    _check_counts(m["breakdown_s"], BREAKDOWN_PHASES, f"{where}.metrics.breakdown_s", False)
    if "accepted_hist" in m:
        h = m["accepted_hist"]
        if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in h):
            raise ValueError(f"{where}.metrics.accepted_hist: must be a list of non-negative integers")


def _check_run(run: Any, where: str, seen: set) -> None:
    if not isinstance(run, dict):
        raise ValueError(f"{where}: must be an object")
    if set(run) != {"mode", "profile", "workload", "metrics"}:
        raise ValueError(f"{where}: keys must be exactly ['metrics', 'mode', 'profile', 'workload'], got {sorted(run)}")
    for k in ("mode", "profile", "workload"):
        if not isinstance(run[k], str) or not run[k]:
            raise ValueError(f"{where}.{k}: must be a non-empty string")
    key = (run["mode"], run["profile"], run["workload"])
    if key in seen:
        raise ValueError(f"{where}: duplicate run for mode/profile/workload {key}")
    seen.add(key)
    _check_metrics(run["metrics"], where)


def _check_ratio(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: must be an object")
    if set(row) != {"metric", "profile", "mode", "baseline", "value"}:
        raise ValueError(f"{where}: keys must be exactly ['baseline', 'metric', 'mode', 'profile', 'value'], got {sorted(row)}")
    for k in ("metric", "profile", "mode", "baseline"):
        if not isinstance(row[k], str) or not row[k]:
            raise ValueError(f"{where}.{k}: must be a non-empty string")
    if not is_num(row["value"]):
        raise ValueError(f"{where}.value: must be a finite number, got {row['value']!r}")


def validate_results(obj: Any) -> None:
    """Check ``obj`` against the ``results.json`` schema (module docstring).

    Raises:
        ValueError: naming the first bad field, e.g. ``runs[2].metrics.ttft_s``.
    """
    _check_top(obj)
    seen: set = set()
    for i, run in enumerate(obj["runs"]):
        _check_run(run, f"runs[{i}]", seen)
    for i, row in enumerate(obj["ratios"]):
        _check_ratio(row, f"ratios[{i}]")


def write_results(results: dict, path: str | Path) -> Path:
    """Validate and write ``results.json``; returns the path."""
    validate_results(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def load_results(path: str | Path) -> dict:
    """Read and validate a ``results.json``."""
    obj = json.loads(Path(path).read_text(encoding="utf-8"))
    validate_results(obj)
    return obj
