"""transformers' "heuristic" assistant-token schedule (HF ``AssistedCandidateGenerator``,
``num_assistant_tokens_schedule="heuristic"``): +2 after a fully accepted block, -1
otherwise; clamped to ``1..l_max`` here (a baseline beside RAPID's CAAC)."""

from __future__ import annotations

from edge_sdk.control.base import L_MAX, DepthController, PlanContext, RoundRecord


class HeuristicDepth(DepthController):
    """+``up`` tokens when every draft of the last block was accepted, -``down`` otherwise.

    Args:
        initial: depth of the first block (tokens). transformers starts at 20 with no
            upper bound; 4 is the SDK's default depth and sits mid-range in 1..8.
    """

    name = "heuristic"

    def __init__(self, initial: int = 4, up: int = 2, down: int = 1, l_max: int = L_MAX):
        super().__init__(l_max)
        self.L, self.up, self.down = self.clamp(initial), int(up), int(down)

    def next_depth(self, stats: PlanContext | None = None) -> int:
        return self.L

    def update(self, rnd: RoundRecord) -> None:
        if rnd.depth <= 0:
            return                      # plain target step: says nothing about the draft
        full = rnd.accepted >= rnd.depth
        self.L = self.clamp(self.L + (self.up if full else -self.down))

    def state(self) -> dict:
        return {"L": self.L}
