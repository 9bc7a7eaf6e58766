"""Run-level metrics of one cell (mode x profile x workload) beyond
:func:`bench.report.aggregation.aggregate`: link-level bytes, proactive-drafting timing
(RAPID), planned depths, and the concurrent cells' utilisation and server counters
(AsymSpec §IV-C).

Run-level metrics added for concurrent runs (all in the run's ``metrics`` dict; the
``results.json`` schema allows extra keys):

==================== =====================================================================
``concurrency``      C, requests in flight
``network_profile``  the link profile's name (the run's ``profile`` is ``name@cC``)
``makespan_s``       first request start → last request end (s); throughput uses it
``target_passes_per_token`` server passes (batched pass counted once) / committed tokens
``verify_rounds_per_token`` verification rounds (blocks) / committed tokens
``server_target_passes``, ``server_target_seconds``, ``server_batches`` deltas of the
                     cloud's counters over the run
``mean_batch_size``  blocks per target pass (server histogram sum / count)
``edge_busy_s``      seconds the edge draft worker was busy (proactive steps included)
``edge_utilisation`` edge_busy_s / makespan_s
``cloud_utilisation`` server target seconds / makespan_s (verification passes only; prompt
                     prefills are not in ``specrelay_target_seconds_total``)
``edge_cpu_utilisation`` CPU seconds of the whole edge (bench) process — draft worker,
                     event loop/HTTP client and the link emulator thread — / makespan_s
``cloud_cpu_utilisation`` CPU seconds of the whole cloud process (target passes, prefills,
                     HTTP server, msgpack) / makespan_s (Linux ``/proc``; else absent)
``runahead_wasted_tokens`` draft tokens drafted ahead of an unresolved block and thrown
                     away (NPDG misses); 0 for modes that never run ahead
``server_max_batch`` the cloud's max batch during the run
==================== =====================================================================
"""
from __future__ import annotations

import statistics
from typing import Sequence

from bench.report.aggregation import aggregate

__all__ = ["request_totals", "proactive_timing", "early_timing", "depth_summary",
           "proactive_totals",
           "concurrent_metrics"]


def request_totals(per_request: Sequence[dict]) -> dict:
    """:func:`aggregate` of one cell's per-request metrics plus the link emulator's bytes
    per committed token (``link_uplink_bytes_per_token``, ``link_downlink_...``; None
    without tokens), ``wall_s_total`` (s) and ``prompt_tokens_mean``."""
    per = list(per_request)
    m = aggregate(per)
    n = m["committed_tokens"]
    for k in ("link_uplink_bytes", "link_downlink_bytes"):
        tot = sum(r.get(k, 0) or 0 for r in per)
        m[k + "_per_token"] = tot / n if n else None
    m["wall_s_total"] = sum(r["wall_s"] for r in per)
    m["prompt_tokens_mean"] = sum(r.get("prompt_tokens", 0) for r in per) / len(per)
    return m


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


def proactive_totals(per_request: Sequence[dict]) -> dict:
    """Sums over the requests of ``proactive_late_steps``, ``proactive_wasted_tokens``,
    ``proactive_drafted_tokens``, ``proactive_skipped`` (branches IPDG skipped) and the
    early-verdict counts (0 where a request has none)."""
    return {k: sum(p.get(k, 0) or 0 for p in per_request)
            for k in ("proactive_late_steps", "proactive_wasted_tokens", "proactive_skipped",
                      "proactive_drafted_tokens", "early_verdicts", "early_hits",
                      "early_redirects", "early_redirect_hits")}


def early_timing(per_request: Sequence[dict]) -> dict:
    """FSD timing of one run from its requests' ``round_trace`` (seconds; rounds whose
    early verdict arrived before the final one): ``early_rounds``,
    ``early_lead_s`` (median of ``t_response - t_early``: how far ahead of the final
    verdict the edge could start drafting) and ``early_ready_minus_response_s``
    (median of ``t_ready - t_response`` over those rounds). Empty without any."""
    lead, ready = [], []
    for m in per_request:
        for r in m.get("round_trace") or ():
            if r.get("t_early") is not None and r.get("t_response") is not None:
                lead.append(r["t_response"] - r["t_early"])
                if r.get("t_ready") is not None:
                    ready.append(r["t_ready"] - r["t_response"])
    if not lead:
        return {}
    return {"early_rounds": len(lead), "early_lead_s": statistics.median(lead),
            "early_ready_minus_response_s": statistics.median(ready) if ready else None}


def concurrent_metrics(m: dict, per_request: Sequence[dict], *, concurrency: int,
                       profile: str, edge_busy_s: float | None,
                       server_before: dict | None, server_after: dict | None,
                       link_delta: tuple[int, int] | None, server_max_batch: int | None,
                       edge_cpu_s: float | None = None,
                       cloud_cpu_s: float | None = None) -> dict:
    """Complete the ``report.aggregate`` metrics ``m`` of a concurrent cell (in place;
    also returned) with the fields of the module docstring."""
    n = m["committed_tokens"]
    starts = [r.get("start_s") for r in per_request]
    ends = [r.get("end_s") for r in per_request]
    span = (max(ends) - min(starts)) if per_request and None not in starts + ends else \
        sum(r["wall_s"] for r in per_request)
    m.update(concurrency=int(concurrency), network_profile=profile, makespan_s=span,
             server_max_batch=server_max_batch,
             verify_rounds_per_token=(m["rounds"] / n) if n else None,
             runahead_wasted_tokens=sum(int(r.get("proactive_wasted_tokens", 0) or 0)
                                        for r in per_request))
    for key, cpu in (("edge", edge_cpu_s), ("cloud", cloud_cpu_s)):
        if cpu is not None:
            m[f"{key}_cpu_s"] = cpu
            m[f"{key}_cpu_utilisation"] = cpu / span if span > 0 else None
    if edge_busy_s is not None:
        m["edge_busy_s"] = edge_busy_s
        m["edge_utilisation"] = edge_busy_s / span if span > 0 else None
    if server_before is not None and server_after is not None:
        d = {k: server_after[k] - server_before.get(k, 0.0) for k in server_after}
        m.update(server_target_passes=int(round(d["passes"])),
                 server_target_seconds=d["target_s"], server_batches=int(round(d["batches"])),
                 mean_batch_size=(d["batch_blocks"] / d["batches"]) if d["batches"] else None,
                 cloud_utilisation=d["target_s"] / span if span > 0 else None)
        # the server's count: one batched pass serves several requests
        m["target_passes_per_token"] = d["passes"] / n if n else None
        m["target_seconds_per_token"] = d["target_s"] / n if n else None
    if link_delta is not None:
        up, down = link_delta
        m["link_uplink_bytes_per_token"] = up / n if n else None
        m["link_downlink_bytes_per_token"] = down / n if n else None
    return m
