"""PNG plots of a ``results.json``: throughput, latency breakdown, acceptance histogram
(matplotlib's Agg canvas, imported only when plotting)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from bench.report.aggregation import BREAKDOWN_PHASES

__all__ = ["write_plots"]


def _ordered(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _figure(ncols: int, width: float = 6.0, height: float = 4.0):
    from matplotlib.figure import Figure  # Agg canvas, no pyplot / global backend state

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _throughput(idx: dict, modes: list[str], profiles: list[str], workloads: list[str]):
    """Tokens/s per mode (grouped bars) per profile, one panel per workload."""
    fig, axes = _figure(len(workloads))
    x = np.arange(len(profiles))
    width = 0.8 / max(1, len(modes))
    for ax, w in zip(axes, workloads):
        for j, mode in enumerate(modes):
            ys = [(idx.get((mode, p, w)) or {}).get("throughput_tok_s") or 0.0 for p in profiles]
            ax.bar(x - 0.4 + width * (j + 0.5), ys, width, label=mode)
        ax.set_xticks(x, profiles)
        ax.set_ylabel("throughput (tokens/s)")
        ax.set_title(f"throughput — {w}")
        if modes:
            ax.legend(fontsize="small")
    return fig


def _breakdown(idx: dict, modes: list[str], profiles: list[str], workloads: list[str]):
    """Stacked ms per token (draft/upload/wait/verify/download) per mode and profile,
    one panel per workload."""
    fig, axes = _figure(len(workloads), width=max(6.0, 0.6 * len(modes) * len(profiles) + 2))
    for ax, w in zip(axes, workloads):
        combos = [(p, m) for p in profiles for m in modes if (m, p, w) in idx]
        xs = np.arange(len(combos))
        bottom = np.zeros(len(combos))
        for phase in BREAKDOWN_PHASES:
            ys = np.array([idx[(m, p, w)]["breakdown_s"].get(phase, 0.0) * 1e3 for p, m in combos])
            ax.bar(xs, ys, 0.7, bottom=bottom, label=phase)
            bottom += ys
        ax.set_xticks(xs, [f"{m}\n{p}" for p, m in combos], rotation=45, ha="right", fontsize="small")
        ax.set_ylabel("latency per token (ms)")
        ax.set_title(f"latency breakdown — {w}")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _hists(idx: dict, modes: list[str], p: str, workloads: list[str]) -> dict:
    """Per mode, the fraction of rounds accepting k draft tokens on profile ``p``
    (workloads pooled; modes without per-round data left out)."""
    hists = {}
    for m in modes:
        h: list[int] = []
        for w in workloads:
            for k, c in enumerate((idx.get((m, p, w)) or {}).get("accepted_hist") or []):
                h.extend([0] * (k + 1 - len(h)))
                h[k] += c
        if sum(h):
            hists[m] = np.asarray(h, float) / sum(h)
    return hists


def _acceptance(idx: dict, modes: list[str], profiles: list[str], workloads: list[str]):
    """Fraction of rounds accepting k draft tokens, per mode, one panel per profile."""
    fig, axes = _figure(max(1, len(profiles)))
    for ax, p in zip(axes, profiles or ["(none)"]):
        hists = _hists(idx, modes, p, workloads)
        if not hists:
            ax.text(0.5, 0.5, "no per-round acceptance data", ha="center", va="center", transform=ax.transAxes)
        kmax = max((len(h) for h in hists.values()), default=1)
        bw = 0.8 / max(1, len(hists))
        for j, (m, h) in enumerate(hists.items()):
            ax.bar(np.arange(len(h)) - 0.4 + bw * (j + 0.5), h, bw, label=m)
        ax.set_xticks(np.arange(kmax))
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"acceptance — {p}")
        if hists:
            ax.legend(fontsize="small")
    return fig


def write_plots(results: dict, out_dir: str | Path, dpi: int = 100) -> list[Path]:
    """Write PNG plots into ``out_dir`` and return their paths:

    * ``throughput.png`` — tokens/s per mode (grouped bars) per profile, one panel per workload;
    * ``latency_breakdown.png`` — stacked ms per token (draft/upload/wait/verify/download)
      per mode and profile, one panel per workload;
    * ``acceptance_hist.png`` — fraction of rounds accepting k draft tokens, per mode, one
      panel per profile (workloads pooled).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    modes = _ordered(r["mode"] for r in runs)
    profiles = _ordered(r["profile"] for r in runs)
    workloads = _ordered(r["workload"] for r in runs) or ["(none)"]
    idx = {(r["mode"], r["profile"], r["workload"]): r["metrics"] for r in runs}
    paths = []
    for name, plot in (("throughput.png", _throughput),
                       ("latency_breakdown.png", _breakdown),
                       ("acceptance_hist.png", _acceptance)):
        fig = plot(idx, modes, profiles, workloads)
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=dpi)
    return paths
