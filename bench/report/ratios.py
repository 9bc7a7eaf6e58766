"""Ratio rows of ``results.json``: every comparison a run makes, oriented so that
``value > 1`` means the mode is better than its baseline.

* generic rows (:func:`ratio_specs`, :func:`compute_ratios`): every non-baseline mode
  against every baseline of the run (``throughput_tok_s``; against ``standard-sd`` also
  ``uplink_bytes_per_token``), and each peer engine's *speculative gain* (its speculative
  mode / its own target-only mode); ``wisv`` (semantic acceptance) against
  ``specrelay`` (exact) on ``mean_accepted_length`` and ``tpot_s``;
* against the fastest peer engine, :func:`peer_ratios`: ``throughput_tok_s`` of each of
  our speculative modes vs ``best-peer``, per profile label and workload the highest
  throughput among the peer modes that ran (llama.cpp, transformers; chosen after the
  fact), so a run with ``--peer-cpus`` on every core answers "faster than the best
  peer on the whole box?";
* adaptive drafting (RAPID; UCB-SpecStop), :func:`adaptive_ratios`:

  - ``throughput_tok_s`` of ``caac`` (and ``rapid``, and the SDK's default
    ``sr-paced``) vs ``best-fixed``: per profile
    label and workload the best throughput among the fixed-depth stop-and-wait modes
    that ran (``fixed-N``, ``stop-and-wait``), chosen *after the fact* (an oracle no
    fixed setting could know in advance); value = mode / best;
  - ``wasted_draft_tokens`` of ``ipdg`` (and ``ipdg-skip``: IPDG that skips the branch
    of a block predicted to miss) vs ``npdg``: value = npdg / ipdg (2.0 = IPDG
    wastes half). This counts every discarded draft token, the in-flight block's
    rejected drafts included (the same for both at the same depth);
    ``proactive_wasted_tokens`` (same orientation) counts only the proactive branches'
    discarded tokens, where the two differ;
  - ``tpot_s`` of ``ipdg`` (and ``rapid``, ``fsd``, ``fsd+ipdg``) vs ``stop-and-wait``:
    value = stop-and-wait / ipdg (1.11 = IPDG's TPOT 10 % lower); ``fsd`` and
    ``fsd+ipdg`` vs ``ipdg`` the same way (FSD's gain over IPDG alone);

* the confirmed-prefix pipeline (AsymSpec §IV-C and §V), :func:`pipeline_ratios`:
  ``pipeline`` against the strongest concurrent baseline, and the strong→weak
  throughput change of every concurrent mode.

Workloads combine by geometric mean; pairs with a missing value or a zero denominator
are skipped.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from bench.report.labels import point_label, split_point
from bench.report.schema import is_num

__all__ = [
    "ratio_row", "run_index", "compute_ratios", "ratio_specs", "BEST_FIXED", "FIXED_MODES",
    "mode_flag", "best_fixed", "adaptive_ratios", "CONCURRENT_BASELINES", "STRONGEST",
    "strongest_baselines", "pipeline_ratios", "BEST_PEER", "best_peer", "peer_ratios",
]

BEST_FIXED = "best-fixed"
"""Baseline label of the per-cell best fixed depth."""

BEST_PEER = "best-peer"
"""Baseline label of the per-cell fastest peer engine mode."""

FIXED_MODES = tuple(f"fixed-{n}" for n in range(1, 9)) + ("stop-and-wait",)
"""Modes whose throughput competes for ``best-fixed`` (stop-and-wait at fixed depths)."""

CONCURRENT_BASELINES = ("no-pipeline", "runahead", "standard-sd-concurrent")
"""The baselines ``pipeline`` is compared against at the same profile and concurrency."""

STRONGEST = "strongest-baseline"
"""Baseline name of the ratio rows against the best of :data:`CONCURRENT_BASELINES`."""


# --------------------------------------------------------------------------- generic


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
        if not is_num(mv) or not is_num(bv):
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


def ratio_specs(modes: Sequence[str]) -> list[tuple[str, str, str, bool]]:
    """``compute_ratios`` specs: every non-baseline mode against every baseline mode of
    the run, for ``throughput_tok_s`` (higher is better) and, against ``standard-sd``,
    ``uplink_bytes_per_token`` (lower is better). Peer engines (``peer = True``,
    :mod:`bench.modes.peers`) are not paired with our modes: each peer's speculative
    mode gets one row against its own engine's target-only mode (``gain_baseline``), its
    *speculative gain* (e.g. ``llamacpp-spec`` / ``llamacpp-ar``, beside ``specrelay`` /
    ``cloud-ar``). ``wisv`` also gets ``mean_accepted_length`` and ``tpot_s`` rows
    against ``specrelay``. Adaptive modes get their rows from :func:`adaptive_ratios`
    only, except the SDK's default (``sdk_default``: ``sr-paced``), which gets these too.
    Raises ValueError for an unknown mode name."""
    from bench.modes import get_mode

    specs = []
    modes = [m for m in modes if _generic(m)]
    peers = [m for m in modes if getattr(get_mode(m), "peer", False)]
    base = [m for m in modes if get_mode(m).baseline and m not in peers]
    for m in modes:
        if get_mode(m).baseline or m in peers:
            continue
        for b in base:
            if b == "standard-sd":
                specs.append(("uplink_bytes_per_token", m, b, False))
        for b in base:
            specs.append(("throughput_tok_s", m, b, True))
    for m in peers:
        gain_base = getattr(get_mode(m), "gain_baseline", None)
        if gain_base in modes:
            specs.append(("throughput_tok_s", m, gain_base, True))
    if "wisv" in modes and "specrelay" in modes:     # semantic vs exact acceptance
        specs += [("mean_accepted_length", "wisv", "specrelay", True),
                  ("tpot_s", "wisv", "specrelay", False)]
    return specs


# --------------------------------------------------------------------------- peers


def mode_flag(mode: str, attr: str) -> bool:
    """The registered mode's class attribute ``attr`` as a bool; False for a mode this
    build does not know."""
    from bench.modes import get_mode

    try:
        return bool(getattr(get_mode(mode), attr, False))
    except ValueError:          # a mode this build does not know (an older results.json)
        return False


def _generic(mode: str) -> bool:
    """Whether ``mode`` gets the generic rows: not an adaptive-drafting mode, or the
    SDK's default one."""
    return not mode_flag(mode, "adaptive") or mode_flag(mode, "sdk_default")


def _best_by_cell(runs: Sequence[dict], metric: str, keep) -> dict[str, dict]:
    """``{"profile|workload": {"mode", "value"}}``: among the modes ``keep(mode)``
    admits, the one with the highest ``metric`` at every (profile label, workload)."""
    out: dict[str, dict] = {}
    for (mode, prof, w), m in run_index(runs)[0].items():
        if not keep(mode) or not is_num(m.get(metric)):
            continue
        key = f"{prof}|{w}"
        if key not in out or m[metric] > out[key]["value"]:
            out[key] = {"mode": mode, "value": float(m[metric])}
    return out


def _value_of(best: dict[str, dict]):
    """``base_value(profile, workload)`` for :func:`ratio_row` from a
    :func:`_best_by_cell` table (None where the cell has no entry)."""
    def value(prof: str, w: str):
        b = best.get(f"{prof}|{w}")
        return None if b is None else b["value"]
    return value


def best_peer(runs: Sequence[dict], metric: str = "throughput_tok_s") -> dict[str, dict]:
    """``{"profile|workload": {"mode", "value"}}``: the peer engine mode
    (:mod:`bench.modes.peers`) with the highest ``metric`` at every (profile label,
    workload) where one ran."""
    return _best_by_cell(runs, metric, lambda mode: mode_flag(mode, "peer"))


def peer_ratios(runs: Sequence[dict]) -> list[dict]:
    """``throughput_tok_s`` of each of our speculative modes (neither a baseline, a peer
    nor an adaptive-drafting mode, as in :func:`ratio_specs`) against ``best-peer`` at
    every profile label where both ran; workloads combine by geometric mean."""
    idx, profiles, workloads = run_index(runs)
    best = best_peer(runs)
    if not best:
        return []
    ours = [m for m in dict.fromkeys(mode for mode, _, _ in idx)
            if _generic(m) and not any(mode_flag(m, a) for a in ("peer", "baseline"))]
    rows = [ratio_row(idx, prof, workloads, "throughput_tok_s", m, BEST_PEER, True,
                      _value_of(best)) for m in ours for prof in profiles]
    return [r for r in rows if r is not None]


# --------------------------------------------------------------------------- adaptive


def best_fixed(runs: Sequence[dict], metric: str = "throughput_tok_s") -> dict[str, dict]:
    """``{"profile|workload": {"mode", "value"}}``: the fixed-depth stop-and-wait mode
    with the highest ``metric`` at every (profile label, workload) where one ran."""
    return _best_by_cell(runs, metric, lambda mode: mode in FIXED_MODES)


def adaptive_ratios(runs: Sequence[dict]) -> list[dict]:
    """The adaptive ratio rows for every profile label where both sides ran (see the
    module docstring for the orientation). Workloads combine by geometric mean; pairs
    with a zero denominator (e.g. IPDG wasting nothing) are skipped."""
    idx, profiles, workloads = run_index(runs)
    best_of = _value_of(best_fixed(runs))
    specs = ([("throughput_tok_s", m, BEST_FIXED, True, best_of)
              for m in ("caac", "rapid", "sr-paced")]
             + [(k, m, "npdg", False, None) for m in ("ipdg", "ipdg-skip")
                for k in ("wasted_draft_tokens", "proactive_wasted_tokens")]
             + [("tpot_s", m, "stop-and-wait", False, None)
                for m in ("ipdg", "ipdg-skip", "rapid", "fsd", "fsd+ipdg")]
             + [("tpot_s", m, "ipdg", False, None) for m in ("fsd", "fsd+ipdg")])
    rows = [ratio_row(idx, prof, workloads, metric, mode, base, higher, fn)
            for metric, mode, base, higher, fn in specs for prof in profiles]
    return [r for r in rows if r is not None]


# --------------------------------------------------------------------------- concurrent


def _index(runs: Iterable[dict]) -> dict:
    return {(r["mode"], r["profile"], r["workload"]): r["metrics"] for r in runs}


def strongest_baselines(runs: Sequence[dict], metric: str = "throughput_tok_s",
                        baselines: Sequence[str] = CONCURRENT_BASELINES) -> dict[str, str]:
    """``{"profile|workload": baseline mode}``: the best baseline (highest ``metric``)
    of every concurrent operating point where at least one baseline ran."""
    idx, out = _index(runs), {}
    for (mode, prof, w), m in idx.items():
        if mode != "pipeline":
            continue
        best = None
        for b in baselines:
            v = (idx.get((b, prof, w)) or {}).get(metric)
            if isinstance(v, (int, float)) and (best is None or v > best[1]):
                best = (b, v)
        if best is not None:
            out[f"{prof}|{w}"] = best[0]
    return out


def _strongest(idx: dict, baselines: Sequence[str], metric: str):
    """``value(profile, workload)``: the ``metric`` of the baseline with the best
    throughput at (profile, workload), None where none ran."""
    def value(prof: str, w: str):
        bvs = [((idx.get((b, prof, w)) or {}).get("throughput_tok_s"), b)
               for b in baselines]
        best = max(((bv, b) for bv, b in bvs if isinstance(bv, (int, float))),
                   default=None)
        return None if best is None else idx[(best[1], prof, w)].get(metric)
    return value


def _strong_to_weak(idx: dict, runs: Sequence[dict], profiles: list[str],
                    workloads: list[str], strong: str, weak: str) -> list[dict]:
    """Per concurrent mode and weak operating point ``weak@cC``: throughput on weak /
    throughput on ``strong@cC`` (baseline label ``<mode>@strong@cC``)."""
    rows = []
    modes = list(dict.fromkeys(r["mode"] for r in runs
                               if split_point(r["profile"])[1] is not None))
    for md in modes:
        for prof in profiles:
            p, c = split_point(prof)
            if p != weak:
                continue
            sp = point_label(strong, c)
            row = ratio_row(
                idx, prof, workloads, "throughput_tok_s", md, f"{md}@{sp}", True,
                lambda _p, w, md=md, sp=sp: (idx.get((md, sp, w)) or {}).get("throughput_tok_s"))
            if row is not None:
                rows.append(row)
    return rows


def pipeline_ratios(runs: Sequence[dict], mode: str = "pipeline",
                    baselines: Sequence[str] = CONCURRENT_BASELINES,
                    strong: str = "strong", weak: str = "weak") -> list[dict]:
    """Ratio rows (``compute_ratios`` shape, > 1: ``mode`` is better):

    * ``throughput_tok_s`` of ``mode`` against ``strongest-baseline`` — per workload the
      best throughput among ``baselines`` at the same profile label (profile and
      concurrency), geometric mean over workloads — for every concurrent profile label;
    * ``target_passes_per_token`` of ``mode`` against the strongest baseline (reduction);
    * the strong→weak change for every mode with concurrent runs: metric ``throughput_tok_s``,
      profile ``weak@cC``, baseline ``<mode>@strong@cC``, value = throughput on weak /
      throughput on strong (1.0 = unchanged; 0.95 = 5 % lower on the weak link).
    """
    idx = _index(runs)
    profiles, workloads = [], sorted({w for (_, _, w) in idx})
    for r in runs:
        if r["profile"] not in profiles and split_point(r["profile"])[1] is not None:
            profiles.append(r["profile"])
    rows = []
    for metric, higher in (("throughput_tok_s", True), ("target_passes_per_token", False)):
        for prof in profiles:
            row = ratio_row(idx, prof, workloads, metric, mode, STRONGEST, higher,
                            _strongest(idx, baselines, metric))
            if row is not None:
                rows.append(row)
    return rows + _strong_to_weak(idx, runs, profiles, workloads, strong, weak)
