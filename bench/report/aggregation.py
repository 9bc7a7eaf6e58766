"""A cell's run metrics from its requests: :func:`aggregate`.

The shared metric names (``results.json`` ``runs[].metrics``) are ``acceptance_rate``,
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

Run metrics (:func:`aggregate`). Ratios are token-weighted (sums over requests, then divided), not means of
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
* ``early_verdict_hit_rate`` = Σ early_hits / Σ early_verdicts (FSD: early verdicts
  that predicted the final one; None without early verdicts)
* ``correction_mode_counts`` = per-stage sums
* ``tv_budget_spent`` = mean per request of the TV budget charged
  (``tv_budget_spent_max`` = the largest)
* ``breakdown_s`` = per phase, Σ seconds / Σ committed (s per token)
* ``accepted_hist`` = list, ``[k]`` = rounds that accepted k draft tokens

Also: ``n_requests``, ``committed_tokens``, ``drafted_tokens``, ``accepted_tokens``,
``rounds``. Undefined ratios (zero denominator) are ``None``.

``edge_sdk.metrics.RequestMetrics.to_dict()`` produces a valid per-request dict.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["SCALAR_METRICS", "CORRECTION_MODES", "BREAKDOWN_PHASES", "aggregate"]

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
    "early_verdict_hit_rate",
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


def _check_required(reqs: Sequence[dict]) -> None:
    """Raises ValueError when there is no request or one lacks a required field."""
    if not reqs:
        raise ValueError("aggregate() needs at least one request")
    for i, r in enumerate(reqs):
        for f in ("committed_tokens", "wall_s", "ttft_s"):
            if f not in r:
                raise ValueError(f"request {i}: missing required field {f!r}")


def _total_s(reqs: Sequence[dict], tot) -> float:
    """The makespan when every request has ``start_s``/``end_s``, else Σ wall_s (s)."""
    if all("start_s" in r and "end_s" in r for r in reqs):
        return max(r["end_s"] for r in reqs) - min(r["start_s"] for r in reqs)
    return tot("wall_s")


def _wasted(reqs: Sequence[dict]) -> int:
    return sum(r.get("wasted_draft_tokens",
                     (r.get("drafted_tokens", 0) or 0) - (r.get("accepted_tokens", 0) or 0)) for r in reqs)


def _add_counts(i: int, r: dict, corrections: dict, phases: dict, hist: list[int]) -> None:
    """Add request ``i``'s correction counts, phase seconds and accepted-per-round
    histogram to the running sums (in place). Raises ValueError for an unknown
    correction mode or latency phase."""
    modes = r.get("correction_mode_counts", r.get("correction_modes")) or {}
    for m, c in modes.items():
        if m not in corrections:
            raise ValueError(f"request {i}: unknown correction mode {m!r} (use {CORRECTION_MODES})")
        corrections[m] += int(c)
    for p, s in _breakdown(r).items():
        if p not in phases:
            raise ValueError(f"request {i}: unknown breakdown phase {p!r} (use {BREAKDOWN_PHASES})")
        phases[p] += float(s)
    for k in r.get("accepted_per_round", r.get("accepted_hist")) or ():
        k = int(k)
        if k >= len(hist):
            hist.extend([0] * (k + 1 - len(hist)))
        hist[k] += 1


def _sums(reqs: Sequence[dict]) -> tuple[dict, dict, list[int]]:
    """``(correction_mode_counts, seconds per latency phase, accepted_hist)`` summed over
    the requests (``correction_modes`` and ``accepted_hist`` read as aliases)."""
    corrections = {m: 0 for m in CORRECTION_MODES}
    phases = {p: 0.0 for p in BREAKDOWN_PHASES}
    hist: list[int] = []
    for i, r in enumerate(reqs):
        _add_counts(i, r, corrections, phases, hist)
    return corrections, phases, hist


def aggregate(per_request_metrics: Sequence[dict]) -> dict:
    """Aggregate per-request raw counts (fields in the module docstring) into run
    metrics, token-weighted (formulas in the module docstring). Undefined ratios (zero
    denominator) are ``None``.

    Raises:
        ValueError: no request, a missing required field, an unknown correction mode
            or latency phase.
    """
    reqs = list(per_request_metrics)
    _check_required(reqs)

    def tot(field: str) -> float:
        return sum(r.get(field, 0) or 0 for r in reqs)

    committed, drafted, accepted = (tot("committed_tokens"), tot("drafted_tokens"),
                                    tot("accepted_tokens"))
    decode_tokens = sum(max(0, r["committed_tokens"] - 1) for r in reqs)
    corrections, phases, hist = _sums(reqs)
    tv = [float(r.get("tv_budget_spent", 0.0) or 0.0) for r in reqs]
    return {
        "acceptance_rate": _div(accepted, drafted),
        "mean_accepted_length": _div(committed, tot("rounds")),
        "ttft_s": float(np.mean([r["ttft_s"] for r in reqs])),
        "tpot_s": _div(sum(_decode_s(r) for r in reqs), decode_tokens),
        "throughput_tok_s": _div(committed, _total_s(reqs, tot)),
        "uplink_bytes_per_token": _div(tot("uplink_bytes"), committed),
        "downlink_bytes_per_token": _div(tot("downlink_bytes"), committed),
        "target_passes_per_token": _div(tot("target_passes"), committed),
        "target_seconds_per_token": _div(tot("target_seconds"), committed),
        "wasted_draft_tokens": _wasted(reqs),
        "near_tie_tokens": int(tot("near_tie_tokens")),
        "proactive_hit_rate": _div(tot("proactive_hits"), tot("proactive_attempts")),
        "early_verdict_hit_rate": _div(tot("early_hits"), tot("early_verdicts")),
        "correction_mode_counts": corrections,
        "tv_budget_spent": float(np.mean(tv)),
        "tv_budget_spent_max": max(tv),
        "breakdown_s": {p: (s / committed if committed else 0.0) for p, s in phases.items()},
        "accepted_hist": hist,
        "n_requests": len(reqs),
        "committed_tokens": committed,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "rounds": tot("rounds"),
        "sibling_hits": int(tot("sibling_hits")),
        "sibling_rows": int(tot("sibling_rows")),
    }
