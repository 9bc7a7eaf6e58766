"""The compact asymmetric protocol (AsymSpec): per draft position the edge uploads only
``(token, q(token))`` and applies the staged correction itself.

* ``specrelay`` — fixed depth ``--depth``, stop-and-wait;
* ``sr-ahead`` — the same with IPDG (RAPID's interruptible proactive drafting) and blocks
  sent ahead (``send_ahead``): the cloud verifies back to back on proactive hits;
* ``sr-wait`` — ``sr-ahead`` that waits for the draft's prompt prefill instead of taking
  target steps meanwhile (``prefill_steps="off"``; the ablation of those steps);
* ``sr-tree`` — ``sr-ahead`` with greedy sibling trees (``--siblings`` width, 2 by
  default: the draft's next-best tokens beside the positions it is least sure of).
"""
from __future__ import annotations

from bench.modes.edge_rounds import EdgeClientMode
from bench.modes.registry import register_mode

__all__ = ["SpecRelayMode", "SpecRelayAheadMode", "SpecRelayWaitMode", "SpecRelayTreeMode"]


@register_mode
class SpecRelayMode(EdgeClientMode):
    """The compact asymmetric protocol at a fixed depth."""

    name = "specrelay"
    description = "AsymSpec compact protocol, fixed depth"
    client_mode = "asym"


@register_mode
class SpecRelayAheadMode(EdgeClientMode):
    """The compact protocol at a fixed depth with pipelined verification: IPDG drafts
    the next block while one is verified and sends it ahead (``send_ahead``), so the
    cloud verifies back to back on proactive hits."""

    name = "sr-ahead"
    description = "specrelay + IPDG + blocks sent ahead (pipelined verification)"
    client_mode = "asym"
    client_kw = {"proactive": "ipdg", "send_ahead": True}


@register_mode
class SpecRelayWaitMode(EdgeClientMode):
    """``sr-ahead`` whose requests wait for the draft's prompt prefill when the cloud
    session opens first, instead of taking target steps until it is done: the
    ablation of ``EdgeClient(prefill_steps=...)`` (what every mode did before)."""

    name = "sr-wait"
    description = "sr-ahead without target steps during the draft's prefill"
    client_mode = "asym"
    client_kw = {"proactive": "ipdg", "send_ahead": True, "prefill_steps": "off"}


@register_mode
class SpecRelayTreeMode(EdgeClientMode):
    """``sr-ahead`` plus greedy sibling trees (SpecInfer §4 token-tree verification;
    Sequoia §3: extra rows where the draft is least sure): a rejection whose target
    token was one of the draft's next-best commits it and its bonus token. Width from
    ``--siblings`` (2 when unset); sampling runs are chains."""

    name = "sr-tree"
    description = "sr-ahead + greedy sibling trees (draft's next-best tokens)"
    client_mode = "asym"
    client_kw = {"proactive": "ipdg", "send_ahead": True, "siblings": 2}
