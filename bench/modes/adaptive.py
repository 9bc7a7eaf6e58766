"""Adaptive drafting: depth controllers (CAAC from RAPID, UCB-SpecStop, transformers'
heuristic), proactive drafting (RAPID's IPDG; NPDG as the non-interruptible baseline;
FSD's pre-drafting from the cloud's early verdict),
fixed depths (the candidates for ``best-fixed``) and prompt-lookup n-gram drafts. All
use the compact protocol through :class:`~bench.modes.edge_rounds.EdgeClientMode`.
"""
from __future__ import annotations

from typing import ClassVar

from bench.modes.edge_rounds import EdgeClientMode
from bench.modes.registry import register_mode

__all__ = ["ADAPTIVE_MODES"]


class _AdaptiveMode(EdgeClientMode):
    """The compact protocol with a depth controller (RAPID; UCB-SpecStop) and/or proactive
    drafting (RAPID); compared by :func:`bench.report.ratios.adaptive_ratios` only (no generic
    ratio rows), except the SDK's default (``sdk_default``), which also gets the generic
    rows of a speculative mode (against every baseline and the best peer)."""

    adaptive: ClassVar[bool] = True
    sdk_default: ClassVar[bool] = False


def _adaptive_mode(name: str, description: str, baseline: bool = False, **attrs) -> type:
    """Register an :class:`_AdaptiveMode` subclass (``attrs``: ``client_kw``,
    ``fixed_depth``, ``ngram``)."""
    cls_name = "".join(p.capitalize() for p in name.replace("-", " ").replace("+", " ")
                       .split()) + "Mode"
    return register_mode(type(cls_name, (_AdaptiveMode,), {
        "name": name, "description": description, "baseline": baseline,
        "__doc__": description, **attrs}))


_PACED = {"controller": "paced", "proactive": "ipdg", "send_ahead": True,
          "siblings": "auto"}
"""Client options of the SDK's default policy (``edge_sdk.defaults``), spelled out so that
a change of the defaults does not silently change what ``sr-paced`` measured."""

ADAPTIVE_MODES = [
    _adaptive_mode("sr-heuristic", "specrelay, transformers' heuristic depth (+2 full "
                   "accept, -1 else)", client_kw={"controller": "heuristic"}),
    _adaptive_mode("caac", "specrelay, CAAC depth controller (RAPID), stop-and-wait",
                   client_kw={"controller": "caac"}),
    _adaptive_mode("sr-ucb", "specrelay, UCB-SpecStop depth bandit (delay-bucket context)",
                   client_kw={"controller": "ucb-specstop"}),
    _adaptive_mode("rapid", "specrelay, CAAC + IPDG (interruptible proactive drafting)",
                   client_kw={"controller": "caac", "proactive": "ipdg"}),
    _adaptive_mode("rapid-npdg", "specrelay, CAAC + NPDG (non-interruptible proactive "
                   "baseline)", client_kw={"controller": "caac", "proactive": "npdg"}),
    _adaptive_mode("sr-paced", "specrelay, verdict-paced depth (round trip / draft time, "
                   "at most --depth) + IPDG + blocks sent ahead (the SDK's default)",
                   client_kw=_PACED, sdk_default=True),
    _adaptive_mode("sr-paced-long", "sr-paced whose block after a miss is as deep as any "
                   "other (the ablation of the paced controller's short exposed block)",
                   client_kw={**_PACED, "controller_kw": {"fresh": None}}),
    _adaptive_mode("sr-paced-chain", "sr-paced drafting chains only (the ablation of "
                   "the default's sibling trees within the server's free rows)",
                   client_kw={**_PACED, "siblings": 0}),
    _adaptive_mode("sr-paced-tree", "sr-paced with greedy sibling trees of width 2 up to "
                   "16 rows whatever the server's free rows",
                   client_kw={**_PACED, "siblings": 2}),
    _adaptive_mode("ipdg", "specrelay, fixed depth --depth + IPDG (interruptible "
                   "proactive drafting)", client_kw={"proactive": "ipdg"}),
    _adaptive_mode("sr-paced-skip", "sr-paced whose IPDG skips the branch of a block "
                   "predicted to miss (proactive_min_hit 0.3: less edge work, fewer hits)",
                   client_kw={**_PACED, "proactive_min_hit": 0.3}),
    _adaptive_mode("ipdg-skip", "specrelay, fixed depth --depth + IPDG that skips the "
                   "branch of a block predicted to miss (proactive_min_hit 0.3)",
                   client_kw={"proactive": "ipdg", "proactive_min_hit": 0.3}),
    _adaptive_mode("fsd", "specrelay, fixed depth --depth + FSD (pre-drafting from the "
                   "cloud's streamed early-exit verdict)", client_kw={"proactive": "fsd"},
                   early_exit=True),
    _adaptive_mode("fsd+ipdg", "specrelay, fixed depth --depth + IPDG whose guesses the "
                   "cloud's early-exit verdict prunes or redirects (FSD)",
                   client_kw={"proactive": "fsd+ipdg"}, early_exit=True),
    _adaptive_mode("npdg", "baseline: fixed depth --depth + NPDG (proactive drafting that "
                   "runs to its planned depth whatever the verdict)", baseline=True,
                   client_kw={"proactive": "npdg"}),
    _adaptive_mode("stop-and-wait", "baseline: fixed depth --depth, no proactive drafting "
                   "(the edge idles while a block is verified)", baseline=True),
    *[_adaptive_mode(f"fixed-{n}", f"baseline: stop-and-wait at depth {n} (candidates for "
                     "best-fixed)", baseline=True, fixed_depth=n) for n in range(1, 9)],
    _adaptive_mode("sr-ngram", "specrelay, prompt-lookup n-gram drafts, model where no "
                   "match", ngram=True),
]
"""The adaptive modes: controllers, proactive drafting, fixed depths, n-gram."""
