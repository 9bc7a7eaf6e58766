"""Benchmark output: metric aggregation, ratios, ``results.json`` schema, summary, plots.

``results.json`` has exactly this shape::

    {"config": {...free-form run configuration...},
     "runs":   [{"mode": str, "profile": str, "workload": str, "metrics": {...}}],
     "ratios": [{"metric": str, "profile": str, "mode": str, "baseline": str, "value": float}]}

``metrics`` (see :func:`aggregate`) holds the shared metric names — ``acceptance_rate``,
``mean_accepted_length``, ``ttft_s``, ``tpot_s``, ``throughput_tok_s``,
``uplink_bytes_per_token``, ``downlink_bytes_per_token``, ``target_passes_per_token``,
``target_seconds_per_token``, ``wasted_draft_tokens``, ``proactive_hit_rate``,
``correction_mode_counts`` ({bounded, proposal, full}), ``tv_budget_spent`` — plus
``breakdown_s`` ({draft, upload, wait, verify, download}), ``accepted_hist`` and a few
totals. A scalar metric is ``null`` when it does not apply (e.g. acceptance of a
target-only run).

Per-request input of :func:`aggregate` — one dict per generation request, raw counts
(times in seconds, sizes in bytes):

================== ======== ==============================================================
field              required meaning
================== ======== ==============================================================
committed_tokens   yes      tokens emitted to the caller
wall_s             yes      request start → last token emitted (s)
ttft_s             yes      request start → first token emitted (s)
decode_s           no       first → last token (s); default from ``token_times_s``, else
                            ``wall_s - ttft_s``
token_times_s      no       emission time of every token, seconds since request start
start_s, end_s     no       absolute start/end on one clock (s); when every request has
                            both, throughput uses the makespan (concurrent requests)
drafted_tokens     no       draft tokens sent for verification
accepted_tokens    no       of those, accepted by the target
rounds             no       verification rounds (round trips to the cloud)
accepted_per_round no       list: accepted draft tokens of each round (histogram); a
                            per-request ``accepted_hist`` list is read the same way
uplink_bytes       no       bytes sent edge → cloud
downlink_bytes     no       bytes received cloud → edge
target_passes      no       target forward passes spent on this request
target_seconds     no       cloud compute time spent on this request (s)
wasted_draft_tokens no      draft tokens computed and thrown away; default
                            ``drafted_tokens - accepted_tokens``
proactive_hits     no       proactive (IPDG/NPDG) drafts that were kept
proactive_attempts no       proactive drafts started
correction_mode_counts no   dict {bounded, proposal, full}: corrections by stage
                            (``correction_modes`` accepted as an alias)
tv_budget_spent    no       total-variation budget charged to the request (sum of eps_K)
breakdown_s        no       dict {draft, upload, wait, verify, download}: seconds summed
                            over the request's rounds. If absent it is derived from
                            ``draft_seconds`` (→ draft), ``target_seconds`` (→ verify) and
                            ``net_seconds`` (→ wait: network + queueing, not split into
                            upload/download)
================== ======== ==============================================================

``edge_sdk.metrics.RequestMetrics.to_dict()`` produces a valid per-request dict.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "SCALAR_METRICS",
    "CORRECTION_MODES",
    "BREAKDOWN_PHASES",
    "aggregate",
    "compute_ratios",
    "validate_results",
    "write_results",
    "load_results",
    "write_summary_md",
    "write_plots",
]

SCALAR_METRICS = (
    "acceptance_rate",
    "mean_accepted_length",
    "ttft_s",
    "tpot_s",
    "throughput_tok_s",
    "uplink_bytes_per_token",
    "downlink_bytes_per_token",
    "target_passes_per_token",
    "target_seconds_per_token",
    "wasted_draft_tokens",
    "proactive_hit_rate",
    "tv_budget_spent",
)
"""Shared metrics that are a number (or ``null`` when not applicable)."""

CORRECTION_MODES = ("bounded", "proposal", "full")
BREAKDOWN_PHASES = ("draft", "upload", "wait", "verify", "download")


def _div(num: float, den: float) -> float | None:
    return num / den if den else None


def _decode_s(r: dict) -> float:
    if "decode_s" in r:
        return float(r["decode_s"])
    times = r.get("token_times_s")
    if times:
        return float(times[-1] - times[0])
    return float(r["wall_s"]) - float(r["ttft_s"])


def _breakdown(r: dict) -> dict:
    if r.get("breakdown_s") is not None:
        return r["breakdown_s"]
    return {"draft": r.get("draft_seconds", 0.0) or 0.0, "verify": r.get("target_seconds", 0.0) or 0.0,
            "wait": r.get("net_seconds", 0.0) or 0.0}


def aggregate(per_request_metrics: Sequence[dict]) -> dict:
    """Aggregate per-request raw counts (fields in the module docstring) into run metrics.

    Ratios are token-weighted (sums over requests, then divided), not means of
    per-request ratios:

    * ``acceptance_rate`` = Σ accepted_tokens / Σ drafted_tokens
    * ``mean_accepted_length`` = Σ committed_tokens / Σ rounds (tokens per round)
    * ``ttft_s`` = mean over requests of ttft_s (s)
    * ``tpot_s`` = Σ decode_s / Σ (committed_tokens - 1) (s per token after the first)
    * ``throughput_tok_s`` = Σ committed_tokens / total time (tokens/s); total time is
      the makespan ``max end_s - min start_s`` if every request has them, else Σ wall_s
    * ``uplink_bytes_per_token``, ``downlink_bytes_per_token`` = Σ bytes / Σ committed
    * ``target_passes_per_token``, ``target_seconds_per_token`` = Σ / Σ committed
    * ``wasted_draft_tokens`` = Σ wasted (count over the run)
    * ``near_tie_tokens`` = Σ greedy tokens the target chose at a near-tie (count)
    * ``proactive_hit_rate`` = Σ proactive_hits / Σ proactive_attempts
    * ``correction_mode_counts`` = per-stage sums
    * ``tv_budget_spent`` = mean per request of the TV budget charged
      (``tv_budget_spent_max`` = the largest)
    * ``breakdown_s`` = per phase, Σ seconds / Σ committed (s per token)
    * ``accepted_hist`` = list, ``[k]`` = rounds that accepted k draft tokens

    Also: ``n_requests``, ``committed_tokens``, ``drafted_tokens``, ``accepted_tokens``,
    ``rounds``. Undefined ratios (zero denominator) are ``None``.
    """
    reqs = list(per_request_metrics)
    if not reqs:
        raise ValueError("aggregate() needs at least one request")
    for i, r in enumerate(reqs):
        for f in ("committed_tokens", "wall_s", "ttft_s"):
            if f not in r:
                raise ValueError(f"request {i}: missing required field {f!r}")

    def tot(field: str) -> float:
        return sum(r.get(field, 0) or 0 for r in reqs)

    committed = tot("committed_tokens")
    drafted = tot("drafted_tokens")
    accepted = tot("accepted_tokens")
    rounds = tot("rounds")
    if all("start_s" in r and "end_s" in r for r in reqs):
        total_s = max(r["end_s"] for r in reqs) - min(r["start_s"] for r in reqs)
    else:
        total_s = tot("wall_s")
    decode_tokens = sum(max(0, r["committed_tokens"] - 1) for r in reqs)
    wasted = sum(r.get("wasted_draft_tokens",
                       (r.get("drafted_tokens", 0) or 0) - (r.get("accepted_tokens", 0) or 0)) for r in reqs)

    corrections = {m: 0 for m in CORRECTION_MODES}
    breakdown = {p: 0.0 for p in BREAKDOWN_PHASES}
    hist: list[int] = []
    for i, r in enumerate(reqs):
        modes = r.get("correction_mode_counts", r.get("correction_modes")) or {}
        for m, c in modes.items():
            if m not in corrections:
                raise ValueError(f"request {i}: unknown correction mode {m!r} (use {CORRECTION_MODES})")
            corrections[m] += int(c)
        for p, s in _breakdown(r).items():
            if p not in breakdown:
                raise ValueError(f"request {i}: unknown breakdown phase {p!r} (use {BREAKDOWN_PHASES})")
            breakdown[p] += float(s)
        for k in r.get("accepted_per_round", r.get("accepted_hist")) or ():
            k = int(k)
            if k >= len(hist):
                hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += 1
    tv = [float(r.get("tv_budget_spent", 0.0) or 0.0) for r in reqs]

    return {
        "acceptance_rate": _div(accepted, drafted),
        "mean_accepted_length": _div(committed, rounds),
        "ttft_s": float(np.mean([r["ttft_s"] for r in reqs])),
        "tpot_s": _div(sum(_decode_s(r) for r in reqs), decode_tokens),
        "throughput_tok_s": _div(committed, total_s),
        "uplink_bytes_per_token": _div(tot("uplink_bytes"), committed),
        "downlink_bytes_per_token": _div(tot("downlink_bytes"), committed),
        "target_passes_per_token": _div(tot("target_passes"), committed),
        "target_seconds_per_token": _div(tot("target_seconds"), committed),
        "wasted_draft_tokens": wasted,
        "near_tie_tokens": int(tot("near_tie_tokens")),
        "proactive_hit_rate": _div(tot("proactive_hits"), tot("proactive_attempts")),
        "correction_mode_counts": corrections,
        "tv_budget_spent": float(np.mean(tv)),
        "tv_budget_spent_max": max(tv),
        "breakdown_s": {p: (s / committed if committed else 0.0) for p, s in breakdown.items()},
        "accepted_hist": hist,
        "n_requests": len(reqs),
        "committed_tokens": committed,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "rounds": rounds,
    }


# --------------------------------------------------------------------------- ratios

def ratio_row(index: dict, profile: str, workloads: Iterable[str], metric: str, mode: str,
              baseline: str, higher: bool, base_value=None) -> dict | None:
    """One ratio row ``{"metric", "profile", "mode", "baseline", "value"}`` for
    ``profile``, or None when no workload has both sides.

    ``index`` maps ``(mode, profile, workload)`` to a run's metrics. The baseline's value
    is its run's ``metric``, or ``base_value(profile, workload)`` when given (a derived
    baseline: the best fixed depth, the strongest baseline). ``value`` is oriented so
    that > 1 means ``mode`` is better (``mode / baseline`` if higher is better, else
    ``baseline / mode``); workloads combine by geometric mean; pairs with a missing
    value or a zero denominator are skipped.
    """
    vals = []
    for w in workloads:
        mv = (index.get((mode, profile, w)) or {}).get(metric)
        bv = (base_value(profile, w) if base_value is not None
              else (index.get((baseline, profile, w)) or {}).get(metric))
        if not _is_num(mv) or not _is_num(bv):
            continue
        num, den = (mv, bv) if higher else (bv, mv)
        if den != 0:
            vals.append(num / den)
    if not vals:
        return None
    value = 0.0 if min(vals) <= 0 else float(np.exp(np.mean(np.log(vals))))
    return {"metric": metric, "profile": profile, "mode": mode, "baseline": baseline,
            "value": value}


def run_index(runs: Iterable[dict]) -> tuple[dict, list[str], list[str]]:
    """``(index, profiles, workloads)`` of ``runs``: metrics by (mode, profile,
    workload), profile labels in run order, workload labels sorted."""
    index: dict[tuple[str, str, str], dict] = {}
    profiles: list[str] = []
    for r in runs:
        index[(r["mode"], r["profile"], r["workload"])] = r["metrics"]
        if r["profile"] not in profiles:
            profiles.append(r["profile"])
    return index, profiles, sorted({w for (_, _, w) in index})


def compute_ratios(runs: Sequence[dict], baselines: Iterable[tuple[str, str, str, bool]]) -> list[dict]:
    """Ratio rows (:func:`ratio_row`), one per baseline spec and profile where both
    modes ran. ``baselines`` items are ``(metric, mode, baseline_mode,
    higher_is_better)``. Rows follow the order of ``baselines``, then of profiles in
    ``runs``."""
    index, profiles, workloads = run_index(runs)
    rows = []
    for metric, mode, base, higher in baselines:
        for prof in profiles:
            row = ratio_row(index, prof, workloads, metric, mode, base, higher)
            if row is not None:
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- schema

def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_counts(v: Any, keys: Sequence[str], where: str, integer: bool) -> None:
    if not isinstance(v, dict):
        raise ValueError(f"{where}: must be an object with keys {list(keys)}")
    if set(v) != set(keys):
        raise ValueError(f"{where}: keys must be exactly {list(keys)}, got {sorted(v)}")
    for k in keys:
        x = v[k]
        ok = (isinstance(x, int) and not isinstance(x, bool)) if integer else _is_num(x)
        if not ok or x < 0:
            raise ValueError(f"{where}.{k}: must be a non-negative {'integer' if integer else 'number'}, got {x!r}")


def validate_results(obj: Any) -> None:
    """Check ``obj`` against the ``results.json`` schema (module docstring).

    Raises:
        ValueError: naming the first bad field, e.g. ``runs[2].metrics.ttft_s``.
    """
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
    seen = set()
    for i, run in enumerate(obj["runs"]):
        where = f"runs[{i}]"
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
        m = run["metrics"]
        if not isinstance(m, dict):
            raise ValueError(f"{where}.metrics: must be an object")
        for name in SCALAR_METRICS:
            if name not in m:
                raise ValueError(f"{where}.metrics.{name}: missing")
            v = m[name]
            if v is not None and (not _is_num(v) or v < 0):
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
    for i, row in enumerate(obj["ratios"]):
        where = f"ratios[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: must be an object")
        if set(row) != {"metric", "profile", "mode", "baseline", "value"}:
            raise ValueError(f"{where}: keys must be exactly ['baseline', 'metric', 'mode', 'profile', 'value'], got {sorted(row)}")
        for k in ("metric", "profile", "mode", "baseline"):
            if not isinstance(row[k], str) or not row[k]:
                raise ValueError(f"{where}.{k}: must be a non-empty string")
        if not _is_num(row["value"]):
            raise ValueError(f"{where}.value: must be a finite number, got {row['value']!r}")


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


# --------------------------------------------------------------------------- summary

_SUMMARY_COLS = [
    ("throughput_tok_s", "throughput (tok/s)", 1.0, "{:.2f}"),
    ("ttft_s", "TTFT (ms)", 1e3, "{:.1f}"),
    ("tpot_s", "TPOT (ms)", 1e3, "{:.1f}"),
    ("acceptance_rate", "acceptance", 1.0, "{:.3f}"),
    ("mean_accepted_length", "tokens/round", 1.0, "{:.2f}"),
    ("uplink_bytes_per_token", "up B/tok", 1.0, "{:.1f}"),
    ("downlink_bytes_per_token", "down B/tok", 1.0, "{:.1f}"),
    ("target_passes_per_token", "target passes/tok", 1.0, "{:.3f}"),
    ("target_seconds_per_token", "target ms/tok", 1e3, "{:.2f}"),
    ("proactive_hit_rate", "proactive hit", 1.0, "{:.3f}"),
]


def _fmt(v: Any, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    return "–" if v is None else fmt.format(v * scale)


def runs_table(runs: Sequence[dict], cols: Sequence[tuple[str, str, float, str]]) -> list[str]:
    """Markdown table lines of ``runs``: mode, profile, workload, then one column per
    ``(metric key, title, scale, format)`` of ``cols`` (missing values: "–")."""
    lines = ["| mode | profile | workload | " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---|" * (3 + len(cols))]
    for run in runs:
        m = run["metrics"]
        lines.append(f"| {run['mode']} | {run['profile']} | {run['workload']} | "
                     + " | ".join(_fmt(m.get(k), sc, f) for k, _, sc, f in cols) + " |")
    return lines


def write_summary_md(results: dict, path: str | Path) -> Path:
    """Write a markdown summary: config, a table of runs, a table of ratios."""
    lines = ["# specrelay benchmark summary", ""]
    cfg = results.get("config", {})
    if cfg:
        lines += [f"- **{k}**: `{json.dumps(v) if not isinstance(v, str) else v}`" for k, v in cfg.items()]
        lines.append("")
    lines += ["## Runs", ""]
    header = ["mode", "profile", "workload"] + [c[1] for c in _SUMMARY_COLS] + ["corrections b/p/f"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for run in results["runs"]:
        m = run["metrics"]
        cells = [run["mode"], run["profile"], run["workload"]]
        cells += [_fmt(m.get(k), s, f) for k, _, s, f in _SUMMARY_COLS]
        cc = m.get("correction_mode_counts") or {}
        cells.append("/".join(str(cc.get(k, 0)) for k in CORRECTION_MODES))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Ratios (value > 1: mode is better than baseline)", ""]
    if results["ratios"]:
        lines.append("| metric | profile | mode | baseline | value |")
        lines.append("|---|---|---|---|---|")
        for r in results["ratios"]:
            lines.append(f"| {r['metric']} | {r['profile']} | {r['mode']} | {r['baseline']} | {r['value']:.3f}× |")
    else:
        lines.append("(none)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- plots

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

    # throughput: grouped bars
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
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=dpi)

    # latency breakdown: stacked bars
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
    paths.append(out / "latency_breakdown.png")
    fig.savefig(paths[-1], dpi=dpi)

    # acceptance histogram
    fig, axes = _figure(max(1, len(profiles)))
    for ax, p in zip(axes, profiles or ["(none)"]):
        hists = {}
        for m in modes:
            h: list[int] = []
            for w in workloads:
                for k, c in enumerate((idx.get((m, p, w)) or {}).get("accepted_hist") or []):
                    h.extend([0] * (k + 1 - len(h)))
                    h[k] += c
            if sum(h):
                hists[m] = np.asarray(h, float) / sum(h)
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
    paths.append(out / "acceptance_hist.png")
    fig.savefig(paths[-1], dpi=dpi)
    return paths
