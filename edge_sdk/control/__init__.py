"""Draft-depth control policies (RAPID; UCB-SpecStop), separate from the drafting mechanism.

``make_controller(name, **kw)`` builds one of:

* ``fixed`` — :class:`FixedDepth` (``depth=4``),
* ``heuristic`` — :class:`HeuristicDepth` (transformers: +2 on full acceptance, -1 else),
* ``caac`` — :class:`CAAC` (RAPID's congestion-aware adaptive controller),
* ``ucb-specstop`` — :class:`UCBSpecStop` (contextual bandit over depths),
* ``paced`` — :class:`PacedDepth` (as many drafts as a verification round trip hides).

Every controller implements :class:`DepthController`: ``next_depth(PlanContext) -> int``
before a round, ``update(RoundRecord)`` after it.
"""

from __future__ import annotations

from edge_sdk.control.base import L_MAX, DepthController, PlanContext, RoundRecord
from edge_sdk.control.caac import CAAC, CAACParams
from edge_sdk.control.fixed import FixedDepth
from edge_sdk.control.heuristic import HeuristicDepth
from edge_sdk.control.paced import PacedDepth
from edge_sdk.control.ucb_specstop import UCBSpecStop

CONTROLLERS = {
    "fixed": FixedDepth,
    "heuristic": HeuristicDepth,
    "caac": CAAC,
    "ucb-specstop": UCBSpecStop,
    "paced": PacedDepth,
}
_ALIASES = {"ucb": "ucb-specstop", "ucb_specstop": "ucb-specstop", "static": "fixed"}


def make_controller(name: str, default_depth: int | None = None, **kw) -> DepthController:
    """Build a controller by registry name (``fixed|heuristic|caac|ucb-specstop|paced``).

    ``kw`` go to the constructor. ``default_depth`` (the caller's draft depth, tokens)
    becomes ``depth`` of a controller that takes one (``uses_depth``: fixed's depth,
    paced's deepest block) unless ``kw`` names it. Raises ValueError for an unknown
    name."""
    key = _ALIASES.get(name, name)
    if key not in CONTROLLERS:
        raise ValueError(f"unknown controller {name!r}; choose from {sorted(CONTROLLERS)}")
    cls = CONTROLLERS[key]
    if default_depth is not None and cls.uses_depth:
        kw.setdefault("depth", default_depth)
    return cls(**kw)


__all__ = ["CAAC", "CAACParams", "CONTROLLERS", "DepthController", "FixedDepth",
           "HeuristicDepth", "L_MAX", "PacedDepth", "PlanContext", "RoundRecord", "UCBSpecStop",
           "make_controller"]
