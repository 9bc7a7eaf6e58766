"""The output folder of a bench run: ``results.json``, ``summary.md`` (the generic
tables, then the mode families' sections), the PNG plots and ``requests.jsonl`` (one
line per request: ids, token ids, metrics)."""
from __future__ import annotations

import json
from pathlib import Path

from bench.report.plots import write_plots
from bench.report.schema import write_results
from bench.report.sections import adaptive_md, concurrent_md, peers_md
from bench.report.tables import breakdown_md, write_summary_md

__all__ = ["write_outputs"]


def _has_peer(modes) -> bool:
    """True when a mode this process knows is a peer engine (``BenchMode.peer``)."""
    from bench.modes import get_mode

    def peer(name: str) -> bool:
        try:
            return bool(getattr(get_mode(name), "peer", False))
        except ValueError:
            return False

    return any(peer(m) for m in modes)


def write_outputs(results: dict, records: list[dict], out_dir: str | Path) -> list[Path]:
    """Write results.json, summary.md, the plots and requests.jsonl; returns the paths.
    Raises ValueError when ``results`` does not fit the schema."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_results(results, out / "results.json"),
             write_summary_md(results, out / "summary.md")]
    with open(paths[-1], "a", encoding="utf-8") as f:
        f.write(breakdown_md(results))
        f.write(adaptive_md(results))
        f.write(concurrent_md(results))
        if _has_peer(results["config"].get("modes", ())):
            f.write(peers_md(results))
    paths += write_plots(results, out)
    req = out / "requests.jsonl"
    with open(req, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    paths.append(req)
    return paths
