"""Fixed draft depth: the classic speculative-decoding baseline."""

from __future__ import annotations

from edge_sdk.control.base import DepthController, PlanContext
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS


class FixedDepth(DepthController):
    """Always drafts ``depth`` tokens (clamped to ``1..l_max``; by default the wire's
    largest block, not the adaptive controllers' ``L_max``)."""

    name = "fixed"
    uses_depth = True

    def __init__(self, depth: int = 4, l_max: int = MAX_DRAFT_TOKENS):
        super().__init__(l_max)
        if int(depth) < 1:
            raise ValueError("depth must be >= 1")
        self.depth = self.clamp(int(depth))

    def next_depth(self, stats: PlanContext | None = None) -> int:
        return self.depth

    def state(self) -> dict:
        return {"L": self.depth}
