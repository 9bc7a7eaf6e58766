"""Verdict-paced draft depth: draft as many tokens as one verification round trip hides.

With proactive drafting (RAPID's IPDG, the SDK's default) the next block is drafted
while the current one is verified. For a block of depth ``L``, a per-token draft time
``tau`` and a send -> verdict time ``T``, a cycle that ends in a proactive hit lasts
``max(L tau, T)`` and commits ``L + 1`` tokens, one that ends in a miss lasts
``L tau + T`` (the cloud idles while the fresh block is drafted) and commits the
accepted prefix plus the correction. Up to ``L = T / tau`` a deeper block is free on a
hit; past it every cycle grows by ``tau`` per token for one more token at the tail, the
position least likely to be accepted, and every miss costs more. So the rate-optimal
depth sits near ``T / tau`` (CAAC caps its proactive drafts there; here the cap is the
whole policy): on the default pair on a quiet device (``tau`` ~28.5 ms, ``T`` ~243 ms,
medians, ``python -m bench.probes.round_pacing``) that is past the default depth 8, under
a 3x draft slowdown (``tau`` ~88.5 ms, ``T`` ~213 ms) about 2, where the model of the cycle above gives ~1.5x the rate of depth 8
at a per-token acceptance of 0.9 (measured in the bench: 1.13-1.16x, README). The rule
ignores acceptance: a block's tail is priced as if it were as likely as its head.

An *exposed* block (drafted after a miss, when nothing is in flight) is the exception:
the cloud idles for all of its ``L tau``, while the block after it is drafted in the
shadow of its verification, so the verifier is better fed early than with a long block.
It is kept short, ``fresh`` tokens (4): the cloud gets work after ``4 tau`` instead of
``L tau``, and with a per-token acceptance ``a`` the next block (drafted meanwhile on
the assumed full acceptance) is usable with probability ~``a^4`` instead of ~``a^L``.
The price is target passes: a short block commits fewer tokens per pass. An event
model of this cycle (``python -m bench.probes.exposed_block``: ``tau`` 38 ms, verify
300 ms, 25 ms each way, ``L`` 8) gives, against an exposed block of 8, 1.07x / 1.11x
the rate (``a`` 0.9 / 0.85) at 0.196 / 0.235 passes per token instead of 0.163 / 0.195
for ``fresh`` 4, and 1.07x / 1.12x at 0.206 / 0.249 for ``fresh`` 3: 4 keeps nearly
all the speed for fewer passes. Measured in the bench (modes ``sr-paced`` and
``sr-paced-long``, AMX Xeon, 8 + 8 prompts x 64 tokens): 1.08x / 1.08x the rate
(HumanEval / MT-Bench) at 1.14x / 1.16x the passes per token (README, "a short block
after a miss").

Without proactive drafting a block's drafting never overlaps its verification, and this
rule is not the right one (use ``fixed`` or ``caac``).
"""

from __future__ import annotations

from edge_sdk.control.base import DepthController, PlanContext, RoundRecord
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS


class PacedDepth(DepthController):
    """``L = clamp(round(T / tau), l_min, depth)``; ``depth`` until both are measured;
    an exposed block (:class:`PlanContext` ``exposed``) ``min(fresh, L)``.

    Args:
        depth: the deepest block (tokens) and the depth before any measurement (the
            SDK's default depth, 8).
        l_min: the shallowest block (tokens).
        fresh: depth of an exposed block (None: ``L`` like any other).
        w: weight of a new sample in the EWMAs of ``T`` (send -> verdict seconds of a
            block not sent ahead: one sent ahead waits behind its predecessor) and
            ``tau`` (draft seconds per token of a block).
    Raises:
        ValueError: ``depth`` or ``l_min`` below 1, ``l_min`` above ``depth``, ``w``
            outside (0, 1], ``fresh`` below 1.
    """

    name = "paced"
    uses_depth = True

    def __init__(self, depth: int = 8, l_min: int = 1, w: float = 0.3,
                 l_max: int = MAX_DRAFT_TOKENS, fresh: int | None = 4):
        super().__init__(l_max)
        if int(depth) < 1 or int(l_min) < 1 or int(l_min) > int(depth):
            raise ValueError("need 1 <= l_min <= depth")
        if fresh is not None and int(fresh) < 1:
            raise ValueError("fresh must be >= 1 (or None)")
        self.fresh = None if fresh is None else int(fresh)
        if not 0.0 < float(w) <= 1.0:
            raise ValueError("w must be in (0, 1]")
        self.depth, self.l_min, self.w = self.clamp(int(depth)), int(l_min), float(w)
        self.t_resp: float | None = None       # EWMA send -> verdict seconds
        self.tau: float | None = None          # EWMA draft seconds per token
        self.L = self.depth

    def next_depth(self, stats: PlanContext | None = None) -> int:
        if self.t_resp is None or not self.tau:
            self.L = self.depth
        else:
            self.L = max(self.l_min, min(self.depth, round(self.t_resp / self.tau)))
        if stats is not None and stats.exposed and self.fresh is not None:
            return max(self.l_min, min(self.fresh, self.L))
        return self.L

    def update(self, rnd: RoundRecord) -> None:
        if rnd.draft_s_per_token is not None and rnd.draft_s_per_token > 0:
            self.tau = self._ewma(self.tau, float(rnd.draft_s_per_token))
        if rnd.depth > 0 and not rnd.proactive and rnd.resp_s is not None:
            self.t_resp = self._ewma(self.t_resp, float(rnd.resp_s))

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.w * (new - old)

    def state(self) -> dict:
        return {"L": self.L, "t_resp": self.t_resp, "tau": self.tau}
