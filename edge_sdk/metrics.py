"""Per-request metrics, under the names bench JSON and Prometheus share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from edge_sdk.kvmodel import common_prefix


def first_divergence(ref: Sequence[int], out: Sequence[int]) -> int | None:
    """Index of the first token where ``out`` differs from ``ref`` (a length difference
    counts at the end of the shorter one); None when they are equal."""
    n = common_prefix(ref, out)
    return None if n == len(ref) == len(out) else n


def classify_divergence(ref: Sequence[int], ref_ties: Iterable[int], out: Sequence[int],
                        out_ties: Iterable[int]) -> tuple[int | None, str]:
    """Greedy identity policy: ``(index, kind)`` with kind ``"identical"``, ``"near_tie"``
    (the first differing index is a near-tie of either run: ``near_tie_positions``, top-2
    logit gap below ``sampling.NEAR_TIE_GAP`` of the target dtype — allowed) or
    ``"hard"`` (a bug)."""
    i = first_divergence(ref, out)
    if i is None:
        return None, "identical"
    return i, "near_tie" if i in set(ref_ties) | set(out_ties) else "hard"


@dataclass
class RequestMetrics:
    """Raw counters of one generation request; :meth:`to_dict` derives the shared metrics.

    Times are seconds (``time.perf_counter``), sizes bytes, counts tokens.
    """

    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_end: float | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0        # drafted tokens the target accepted
    committed_tokens: int = 0       # tokens handed to the user (bonus/correction included)
    bonus_tokens: int = 0
    target_step_tokens: int = 0     # tokens of depth-0 rounds (target decode, no draft)
    correction_tokens: int = 0
    sibling_hits: int = 0           # rounds that committed a tree sibling (+ its bonus)
    sibling_rows: int = 0           # tree siblings sent for verification
    rounds: int = 0                 # verification rounds (target passes for this request)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    net_seconds: float = 0.0        # send->response time minus target compute
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    wasted_draft_tokens: int = 0
    correction_mode_counts: dict = field(
        default_factory=lambda: {"bounded": 0, "proposal": 0, "full": 0})
    tv_budget_spent: float = 0.0
    accepted_hist: list = field(default_factory=list)   # accepted drafts per round
    unverified_tokens: int = 0      # draft-only tokens while the cloud was unreachable
    local_tokens: int = 0           # exact local-target tokens while the cloud was lost
    semantic_accepted_tokens: int = 0   # committed drafts accepted semantically (WISV,
    # lossy; counted in accepted_tokens and committed_tokens too)
    # proactive drafting (IPDG/NPDG, RAPID) and depth control (RAPID)
    proactive_rounds: int = 0       # rounds that started a proactive branch
    proactive_hits: int = 0         # ... whose branch matched the verdict and was kept
    proactive_drafted_tokens: int = 0   # tokens drafted proactively (all branches)
    proactive_wasted_tokens: int = 0    # ... discarded (misses, pruned tree branches)
    proactive_late_steps: int = 0   # expansion steps started after the verdict (NPDG)
    proactive_skipped: int = 0      # rounds whose branch IPDG skipped (hit_chance < min_hit)
    # pipelined verification (send_ahead): proactive blocks sent before the verdict
    ahead_blocks: int = 0           # blocks sent ahead
    ahead_hits: int = 0             # ... verified by the cloud and used
    ahead_dropped: int = 0          # ... refused as stale (a miss) or left unused
    # FSD: early verdicts streamed by the cloud before the final one
    early_verdicts: int = 0         # rounds whose early verdict arrived before the final
    early_hits: int = 0             # ... and predicted it (accepted count and next token)
    early_redirects: int = 0        # ... that started a branch of their own
    early_redirect_hits: int = 0    # ... whose branch was kept
    early_lead_s: float = 0.0       # sum over early verdicts of (final - early) arrival
    depth_hist: list = field(default_factory=list)      # controller's planned depth per round
    near_tie_positions: list = field(default_factory=list)  # generated-token indices whose
    # greedy target choice was a near-tie (top-2 gap < sampling.NEAR_TIE_GAP[dtype])

    def first_token(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def finish(self) -> None:
        self.t_end = time.perf_counter()

    def to_dict(self) -> dict:
        n = max(self.committed_tokens, 1)
        end = self.t_end or time.perf_counter()
        wall = end - self.t_start
        first = self.t_first or end
        # a round may commit past a stop string / the length cap: keep the handed-out ones
        ties = [p for p in self.near_tie_positions if p < self.committed_tokens]
        return {
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens
            if self.drafted_tokens else 0.0,
            "mean_accepted_length": self.committed_tokens / self.rounds if self.rounds else 0.0,
            "ttft_s": first - self.t_start,
            "tpot_s": (end - first) / (self.committed_tokens - 1)
            if self.committed_tokens > 1 else 0.0,
            "throughput_tok_s": self.committed_tokens / wall if wall > 0 else 0.0,
            "uplink_bytes_per_token": self.uplink_bytes / n,
            "downlink_bytes_per_token": self.downlink_bytes / n,
            "target_passes_per_token": self.rounds / n,
            "target_seconds_per_token": self.target_seconds / n,
            "wasted_draft_tokens": self.wasted_draft_tokens,
            "proactive_hit_rate": self.proactive_hits / self.proactive_rounds
            if self.proactive_rounds else 0.0,
            "early_verdict_hit_rate": self.early_hits / self.early_verdicts
            if self.early_verdicts else 0.0,
            "correction_mode_counts": dict(self.correction_mode_counts),
            "tv_budget_spent": self.tv_budget_spent,
            "near_tie_tokens": len(ties),
            "near_tie_positions": ties,
            # raw counts, for aggregation
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "committed_tokens": self.committed_tokens, "bonus_tokens": self.bonus_tokens,
            "target_step_tokens": self.target_step_tokens,
            "correction_tokens": self.correction_tokens, "rounds": self.rounds,
            "sibling_hits": self.sibling_hits, "sibling_rows": self.sibling_rows,
            "target_passes": self.rounds, "target_seconds": self.target_seconds,
            "draft_seconds": self.draft_seconds, "net_seconds": self.net_seconds,
            "uplink_bytes": self.uplink_bytes, "downlink_bytes": self.downlink_bytes,
            "wall_s": wall, "accepted_hist": list(self.accepted_hist),
            "unverified_tokens": self.unverified_tokens,
            "local_tokens": self.local_tokens,
            "semantic_accepted_tokens": self.semantic_accepted_tokens,
            "proactive_rounds": self.proactive_rounds, "proactive_hits": self.proactive_hits,
            "proactive_attempts": self.proactive_rounds,     # bench report's raw-count name
            "proactive_drafted_tokens": self.proactive_drafted_tokens,
            "proactive_wasted_tokens": self.proactive_wasted_tokens,
            "proactive_late_steps": self.proactive_late_steps,
            "proactive_skipped": self.proactive_skipped,
            "ahead_blocks": self.ahead_blocks, "ahead_hits": self.ahead_hits,
            "ahead_dropped": self.ahead_dropped,
            "early_verdicts": self.early_verdicts, "early_hits": self.early_hits,
            "early_redirects": self.early_redirects,
            "early_redirect_hits": self.early_redirect_hits,
            "early_lead_s": self.early_lead_s,
            "depth_hist": list(self.depth_hist),
        }
