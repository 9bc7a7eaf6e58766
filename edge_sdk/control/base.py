"""Depth-control policy interface (RAPID; UCB-SpecStop), separate from the drafting mechanism.

A :class:`DepthController` chooses the draft depth ``L`` of the next block *before* the
round (:meth:`DepthController.next_depth`) and learns from what the round measured
(:meth:`DepthController.update`). The client (``edge_sdk.client``) and the proactive
drafting loop (``edge_sdk.proactive``) are the only callers; controllers never draft.

Units: seconds for times, tokens for depths and counts.
"""

from __future__ import annotations

from edge_sdk.protocol.limits import CONTROLLER_MAX_DEPTH

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

L_MAX = CONTROLLER_MAX_DEPTH   # RAPID: the draft depth L in [1, L_max]


@dataclass
class PlanContext:
    """What the caller knows before a round (argument of ``next_depth``).

    proactive: the block will be drafted while the previous one is still being verified
        (IPDG/NPDG, RAPID); CAAC then caps L so drafting does not outlast the expected
        response.
    max_depth: hard cap for this round (tokens left before ``max_new_tokens``, the
        server's max block); the caller clamps to it, controllers may use it.
    delay_s: the caller's current estimate of send->response seconds, or None (the
        controller uses its own estimate).
    exposed: the block is drafted while the cloud waits for it (no block in flight:
        after a miss or a target step) and, once sent, the next block is drafted
        proactively behind it. Round 0's block (drafted during the target's prefill),
        proactive blocks and every block without proactive drafting are not exposed.
    """

    proactive: bool = False
    max_depth: int = L_MAX
    delay_s: float | None = None
    exposed: bool = False


@dataclass
class RoundRecord:
    """What one verification round measured (argument of ``update``).

    depth: draft tokens sent in the block (0: a plain target step).
    planned_depth: what the controller asked for (``depth`` may be smaller: length cap,
        n-gram without a match).
    accepted: leading drafts the target accepted (0..depth).
    committed: tokens confirmed by the round (accepted + bonus/correction).
    bonus: every draft was accepted, so the extra token is a bonus from p_{g+1}.
    draft_s_per_token: mean seconds per draft token (per expansion step for proactive
        trees) of this block, None when nothing was drafted.
    resp_s: seconds from sending the block to its verdict (network + cloud queue + target).
    round_s: seconds of the whole round cycle, from the previous verdict to this one
        (drafting + waiting); the denominator of UCB-SpecStop's reward. None on a
        request's first round (no previous verdict: its span from the request start
        holds the session create and both prefills, seconds that are no round cost).
    proactive: the block was drafted proactively (IPDG/NPDG hit).
    wasted: draft tokens discarded in this round (rejected + dropped proactive branches).
    plan_delay_s: the ``PlanContext.delay_s`` the block was planned with (None: the
        controller's own estimate at the time).
    """

    depth: int
    accepted: int
    committed: int
    bonus: bool = False
    planned_depth: int | None = None
    draft_s_per_token: float | None = None
    resp_s: float | None = None
    round_s: float | None = None
    proactive: bool = False
    wasted: int = 0
    plan_delay_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class DepthController(ABC):
    """Chooses the next draft depth L in ``[1, l_max]`` before each round."""

    name = "base"
    #: the constructor takes ``depth`` (tokens), which ``make_controller`` fills from
    #: the caller's draft depth
    uses_depth = False

    def __init__(self, l_max: int = L_MAX):
        if not 1 <= int(l_max) <= 64:
            raise ValueError("l_max must be in 1..64")
        self.l_max = int(l_max)

    @abstractmethod
    def next_depth(self, stats: PlanContext | None = None) -> int:
        """Depth for the next block, an int in ``[1, l_max]``."""

    def update(self, rnd: RoundRecord) -> None:  # noqa: B027 - optional hook
        """Learn from a finished round (default: nothing)."""

    def state(self) -> dict:
        """Internal state for traces/plots (JSON-friendly)."""
        return {}

    def clamp(self, x: float) -> int:
        return int(min(self.l_max, max(1, x)))
