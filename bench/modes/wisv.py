"""WISV's semantic acceptance (WISV §III): the compact protocol at a fixed depth where the
cloud's decision head may accept a draft token that differs from the target's greedy
choice. Lossy and opt-in: the output is not exactly the target's.

* ``wisv`` — ``specrelay`` with ``acceptance="semantic"`` (greedy only: the planner
  skips its sampled cells); the server must load a decision head (``specrelay bench``
  passes ``--wisv-head``, default ``auto``). The edge reports the emulated profile's
  RTT and uplink rate as its channel state, so the cloud's threshold is the one the
  policy documents for that link (weak 0.73, cellular-edge 0.66). Run it beside ``specrelay`` (exact) in the
  same run to compare accepted length, rounds and latency.
"""
from __future__ import annotations

from typing import Sequence

from bench.modes.edge_rounds import EdgeClientMode
from bench.modes.registry import register_mode

__all__ = ["WisvMode"]


@register_mode
class WisvMode(EdgeClientMode):
    """``specrelay`` with semantic acceptance. Run metric ``semantic_accepted_tokens``:
    the draft tokens the cloud accepted although they differ from the target's own."""

    name = "wisv"
    description = "specrelay + WISV semantic acceptance (lossy, greedy only)"
    client_mode = "asym"
    client_kw = {"acceptance": "semantic"}
    greedy_only = True
    wisv = True
    lossy = True           # outside the greedy identity check (bench.report.identity)
    link_from_profile = True

    @classmethod
    def run_metrics(cls, per_request: Sequence[dict]) -> dict:
        sem = sum(int(r.get("semantic_accepted_tokens") or 0) for r in per_request)
        tot = sum(int(r.get("committed_tokens") or 0) for r in per_request)
        return {"semantic_accepted_tokens": sem,
                "semantic_token_fraction": round(sem / tot, 4) if tot else None}
