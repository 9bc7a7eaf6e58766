"""Adaptive-drafting bench support: depth control and proactive drafting under edge
contention (RAPID; UCB-SpecStop).

The modes themselves (``caac``, ``fixed-1`` … ``fixed-8``, ``stop-and-wait``, ``ipdg``,
``npdg``, ``rapid``, …) live in :mod:`bench.modes`; this module holds what the
runner needs around them and imports nothing from the bench modes:

* **contention variants** of a profile: ``medium+slow`` is the ``medium`` link with an
  edge slowdown (every draft forward ``F`` times as long from ``T`` seconds after the
  start of each run; ``--edge-slowdown F --slowdown-at T``); the plain label stays
  stationary. Ratios then compare modes under the same link *and* the same contention.
* :func:`adaptive_ratios` — the issue's three comparisons, rows in the
  ``report.compute_ratios`` shape (``value > 1``: the mode is better):

  - ``throughput_tok_s`` of ``caac`` (and ``rapid``) vs ``best-fixed``: per profile
    label and workload the best throughput among the fixed-depth stop-and-wait modes
    that ran (``fixed-N``, ``stop-and-wait``), chosen *after the fact* (an oracle no
    fixed setting could know in advance); value = mode / best;
  - ``wasted_draft_tokens`` of ``ipdg`` vs ``npdg``: value = npdg / ipdg (2.0 = IPDG
    wastes half; the issue's goal "<= 0.5x" is ``value >= 2``). This counts every
    discarded draft token, the in-flight block's rejected drafts included (the same for
    both at the same depth); ``proactive_wasted_tokens`` (same orientation) counts only
    the proactive branches' discarded tokens, where the two differ;
  - ``tpot_s`` of ``ipdg`` (and ``rapid``) vs ``stop-and-wait``: value = stop-and-wait /
    ipdg (1.11 = IPDG's TPOT 10 % lower).

* :func:`proactive_timing` — per run: proactive hit rate and, per round, when the
  proactive draft was ready (``t_ready``) against when the verdict arrived
  (``t_response``), from the requests' ``round_trace``.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from bench import report

__all__ = [
    "SLOW_SUFFIX", "DEFAULT_SLOWDOWN", "BEST_FIXED", "FIXED_MODES", "split_contention",
    "best_fixed", "adaptive_ratios", "proactive_timing", "depth_summary", "summary_md",
]

SLOW_SUFFIX = "+slow"
"""Profile-label suffix of a contention variant (``medium+slow``)."""

DEFAULT_SLOWDOWN = 3.0
"""Draft-forward slowdown factor of a ``+slow`` variant when ``--edge-slowdown`` is 1."""

BEST_FIXED = "best-fixed"
"""Baseline label of the per-cell best fixed depth."""

FIXED_MODES = tuple(f"fixed-{n}" for n in range(1, 9)) + ("stop-and-wait",)
"""Modes whose throughput competes for ``best-fixed`` (stop-and-wait at fixed depths)."""


def split_contention(label: str) -> tuple[str, bool]:
    """``medium+slow`` → ("medium", True); ``medium`` → ("medium", False)."""
    if label.endswith(SLOW_SUFFIX):
        return label[: -len(SLOW_SUFFIX)], True
    return label, False


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def best_fixed(runs: Sequence[dict], metric: str = "throughput_tok_s") -> dict[str, dict]:
    """``{"profile|workload": {"mode", "value"}}``: the fixed-depth stop-and-wait mode
    with the highest ``metric`` at every (profile label, workload) where one ran."""
    out: dict[str, dict] = {}
    for (mode, prof, w), m in report.run_index(runs)[0].items():
        if mode not in FIXED_MODES or not _num(m.get(metric)):
            continue
        key = f"{prof}|{w}"
        if key not in out or m[metric] > out[key]["value"]:
            out[key] = {"mode": mode, "value": float(m[metric])}
    return out


def adaptive_ratios(runs: Sequence[dict]) -> list[dict]:
    """The adaptive ratio rows for every profile label where both sides ran (see the
    module docstring for the orientation). Workloads combine by geometric mean; pairs
    with a zero denominator (e.g. IPDG wasting nothing) are skipped."""
    idx, profiles, workloads = report.run_index(runs)
    best = best_fixed(runs)

    def best_of(prof: str, w: str):
        b = best.get(f"{prof}|{w}")
        return None if b is None else b["value"]

    specs = ([("throughput_tok_s", m, BEST_FIXED, True, best_of) for m in ("caac", "rapid")]
             + [(k, "ipdg", "npdg", False, None)
                for k in ("wasted_draft_tokens", "proactive_wasted_tokens")]
             + [("tpot_s", m, "stop-and-wait", False, None) for m in ("ipdg", "rapid")])
    rows = [report.ratio_row(idx, prof, workloads, metric, mode, base, higher, fn)
            for metric, mode, base, higher, fn in specs for prof in profiles]
    return [r for r in rows if r is not None]


def proactive_timing(per_request: Sequence[dict]) -> dict:
    """Proactive-drafting timing of one run from its requests' ``round_trace``.

    Returns (seconds; rounds with a proactive phase only): ``proactive_phases``,
    ``proactive_ready_before_response`` (fraction of phases whose expansion stopped at
    or before the verdict arrived), ``proactive_ready_minus_response_s`` (median of
    ``t_ready - t_response``: < 0 the draft was ready first, > 0 the edge was still
    drafting when the verdict came), ``proactive_ready_minus_response_p90_s``.
    Empty dict when no round drafted proactively."""
    gaps = []
    for m in per_request:
        for r in m.get("round_trace") or ():
            if r.get("t_ready") is not None and r.get("t_response") is not None:
                gaps.append(r["t_ready"] - r["t_response"])
    if not gaps:
        return {}
    gaps.sort()
    return {"proactive_phases": len(gaps),
            "proactive_ready_before_response": sum(g <= 0 for g in gaps) / len(gaps),
            "proactive_ready_minus_response_s": statistics.median(gaps),
            "proactive_ready_minus_response_p90_s": gaps[min(len(gaps) - 1,
                                                             int(0.9 * len(gaps)))]}


def depth_summary(per_request: Sequence[dict]) -> dict:
    """Planned depths of one run: ``depth_counts`` ({depth: rounds}) and ``depth_mean``
    over the rounds that drafted (depth 0 = a round with one token left to commit,
    which the cloud answers without a draft)."""
    depths = [int(d) for m in per_request for d in (m.get("depth_hist") or ())]
    drafted = [d for d in depths if d > 0]
    if not drafted:
        return {}
    counts: dict[str, int] = {}
    for d in depths:
        counts[str(d)] = counts.get(str(d), 0) + 1
    return {"depth_mean": sum(drafted) / len(drafted),
            "depth_counts": dict(sorted(counts.items(), key=lambda kv: int(kv[0])))}


_SUMMARY_COLS = [
    ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"), ("tpot_s", "TPOT ms", 1e3, "{:.1f}"),
    ("acceptance_rate", "accept", 1.0, "{:.3f}"), ("depth_mean", "mean depth", 1.0, "{:.2f}"),
    ("wasted_draft_tokens", "wasted", 1.0, "{:.0f}"),
    ("proactive_wasted_tokens", "proactive wasted", 1.0, "{:.0f}"),
    ("proactive_hit_rate", "proactive hit", 1.0, "{:.3f}"),
    ("proactive_ready_before_response", "ready before resp", 1.0, "{:.2f}"),
    ("proactive_ready_minus_response_s", "ready−resp ms", 1e3, "{:.0f}"),
    ("proactive_late_steps", "late steps", 1.0, "{:.0f}"),
]

_ADAPTIVE = ("caac", "rapid", "rapid-npdg", "ipdg", "npdg", "stop-and-wait", "sr-heuristic",
             "sr-ucb", "sr-ngram") + FIXED_MODES


def summary_md(results: dict) -> str:
    """Markdown for summary.md: the adaptive modes' depth, waste and proactive timing,
    and the best fixed depth per cell."""
    runs = [r for r in results["runs"] if r["mode"] in _ADAPTIVE]
    if not runs:
        return ""

    lines = ["", "## Adaptive drafting (depth control, proactive drafting)", "",
             "profile `X+slow` = link X with the edge slowdown of the run config "
             "(`edge_slowdown` from `slowdown_at_s` into each run). ready−resp = median "
             "of (proactive draft ready − verdict arrived), ms; < 0: ready first.", ""]
    lines += report.runs_table(runs, _SUMMARY_COLS)
    bf = results.get("config", {}).get("best_fixed") or {}
    if bf:
        lines += ["", "Best fixed depth per cell (chosen after the fact): "
                  + ", ".join(f"{k} → {v['mode']} ({v['value']:.2f} tok/s)"
                              for k, v in bf.items()), ""]
    return "\n".join(lines) + "\n"
