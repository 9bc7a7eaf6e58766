"""Applying a verdict to a draft block: pure functions, no I/O.

A block of draft depth g is answered with ``accepted`` = a (the leading drafts the
target accepted) and either the next token (the bonus token when a == g, the greedy or
cloud-drawn correction when a < g, the target's own token when g == 0) or a correction
payload from which the edge draws the correction token itself (AsymSpec §IV-B; the
acceptance rule is Leviathan et al. 2023 §2.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_sdk.control import RoundRecord
from edge_sdk.drafters.base import DraftBlock
from edge_sdk.metrics import RequestMetrics
from edge_sdk.protocol.wire import VerifyResponse

#: What the token after the accepted drafts is (``SIBLING``: an accepted tree sibling
#: at the first mismatch, then the bonus token after it).
TARGET_STEP, BONUS, CORRECTION, EDGE_CORRECTION, SIBLING = (
    "target_step", "bonus", "correction", "edge_correction", "sibling")


@dataclass(frozen=True)
class Outcome:
    """One verdict applied to its block.

    depth: g, drafts sent; accepted: a; tokens: the accepted drafts (plus an accepted
    sibling) plus the cloud's next token when it sent one (not the edge-drawn
    correction); kind: what the next token is (``TARGET_STEP``, ``BONUS``,
    ``CORRECTION``, ``SIBLING``: the bonus after an accepted sibling, or
    ``EDGE_CORRECTION``: the edge must draw it from the correction payload).
    """

    depth: int
    accepted: int
    tokens: list[int]
    kind: str

    @property
    def all_accepted(self) -> bool:
        """Every draft accepted and the next token given (a proactive hit's condition)."""
        return self.kind in (TARGET_STEP, BONUS)


def apply_verdict(block: DraftBlock | None, resp: VerifyResponse) -> Outcome:
    """The outcome of ``resp`` for ``block`` (None: a depth-0 target step)."""
    g = len(block) if block else 0
    a = resp.accepted
    new = list(block.tokens[:a]) if block else []
    if resp.next_token is None:
        return Outcome(g, a, new, EDGE_CORRECTION)
    if resp.sibling is not None:
        return Outcome(g, a, new + [resp.sibling, resp.next_token], SIBLING)
    kind = TARGET_STEP if g == 0 else BONUS if a == g else CORRECTION
    return Outcome(g, a, new + [resp.next_token], kind)


def check_confirmed_length(resp: VerifyResponse, tokens: list[int], new: list[int]) -> None:
    """Raises RuntimeError unless the cloud's confirmed length equals the edge's
    (``tokens`` before the round plus the ``new`` ones, a pending correction included)."""
    if resp.base_len != len(tokens) + len(new):
        raise RuntimeError("edge and cloud disagree on the confirmed length")


def count_verdict(m: RequestMetrics, out: Outcome, resp: VerifyResponse,
                  block: DraftBlock | None, generated: int) -> None:
    """Add one verdict to the request's counters (``generated``: tokens generated
    before this round; near-tie offsets become positions in the output)."""
    if out.kind == TARGET_STEP:
        m.target_step_tokens += 1          # no draft: a plain target decode step
    elif out.kind == BONUS:
        m.bonus_tokens += 1
    elif out.kind == CORRECTION:
        m.correction_tokens += 1           # an edge-drawn one: count_correction
    elif out.kind == SIBLING:
        m.sibling_hits += 1
    m.near_tie_positions.extend(generated + i for i in resp.near_ties)
    m.rounds += 1
    m.drafted_tokens += out.depth
    m.accepted_tokens += out.accepted
    m.accepted_hist.append(out.accepted)
    m.target_seconds += resp.target_s
    m.draft_seconds += block.draft_s if block else 0.0


def count_correction(m: RequestMetrics, stage: str, eps: float) -> None:
    """An edge-drawn correction token: its stage and the TV budget it spent."""
    m.tv_budget_spent += eps
    m.correction_mode_counts[stage] += 1
    m.correction_tokens += 1


@dataclass(frozen=True)
class RoundTimes:
    """perf_counter seconds of one round: previous verdict (or request start), block
    sent, verdict received, round done. ``cycle``: ``prev`` is a previous verdict; False
    on a request's first round, whose span from the request start holds the session
    create (the target's prefill) and the draft's prefill, not a round cycle."""

    prev: float
    sent: float
    response: float
    end: float
    cycle: bool = True


def round_record(out: Outcome, committed: int, planned: int, block: DraftBlock | None,
                 times: RoundTimes, proactive: bool, wasted: int) -> RoundRecord:
    """The depth controller's view of one round."""
    g = out.depth
    return RoundRecord(depth=g, accepted=out.accepted, committed=committed,
                       bonus=out.all_accepted, planned_depth=planned,
                       draft_s_per_token=block.draft_s / g if g else None,
                       resp_s=times.response - times.sent,
                       round_s=times.end - times.prev if times.cycle else None,
                       proactive=proactive, wasted=wasted)


def trace_record(index: int, out: Outcome, planned: int, proactive: bool,
                 times: RoundTimes, t_start: float, pro, hit: bool) -> dict:
    """The ``on_round`` record of one round (times in seconds since ``t_start``;
    ``pro``: the round's ProactiveResult or None)."""
    return {
        "round": index, "depth": out.depth, "planned": planned, "accepted": out.accepted,
        "proactive_block": proactive, "t_send": times.sent - t_start,
        "t_response": times.response - t_start,
        "t_ready": None if pro is None else pro.t_ready - t_start,
        "t_early": None if pro is None or pro.t_early is None else pro.t_early - t_start,
        "early_redirect": None if pro is None else pro.redirected,
        "proactive_steps": None if pro is None else pro.steps,
        "proactive_plan": None if pro is None else pro.plan,
        "hit": None if pro is None else hit}
