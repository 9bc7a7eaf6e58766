"""Sibling trees: a greedy draft chain plus alternatives ("siblings") at some of its
positions, verified in ONE target pass under a tree attention mask (SpecInfer, Miao et
al. 2024, §4: token tree verification; Sequoia, Chen et al. 2024, §3: spend the extra
rows where the draft is least sure).

A block of depth g is the chain ``d_1..d_g``; ``alts[i]`` (draft index i, 0-based) holds
the draft's next-best tokens at position i, each an alternative to ``d_{i+1}`` after the
same prefix ``context + d_1..d_i``. The pass runs the rows

    [last, d_1..d_g, s_{i,1}..s_{i,m} for each i with alternatives]

where ``last`` is the context's last token. Row r's *position offset* (from ``last``)
and ancestors: ``last`` 0; ``d_j`` offset j, ancestors ``last, d_1..d_{j-1}``;
``s_{i,k}`` offset i+1, ancestors ``last, d_1..d_i``. Every row attends to the cached
prefix, its ancestors and itself.

Greedy verdict: the chain is checked as usual (the first ``a`` drafts equal the target's
argmax); at the first mismatch (position a) a sibling equal to the target's argmax is
accepted, and the target's argmax at the sibling's own row is the bonus token. Every
committed token is the target's argmax after its prefix, so the output is the target's
greedy output. Acceptance statistics count chain drafts only; sibling hits are counted
apart (the acceptance rate stays comparable with chain-only runs).

Greedy configs only: the sampled multi-draft rule needs every sibling's draft
probability and a recursive residual (SpecInfer §4.2), which the compact wire does not
carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from edge_sdk.protocol.limits import MAX_SIBLINGS

__all__ = ["MAX_SIBLINGS", "TreeLayout", "layout", "tree_verdict", "sibling_row"]



@dataclass(frozen=True)
class TreeLayout:
    """Rows of one sibling tree's pass.

    offsets: long [T], each row's position minus the position of ``last``.
    attn: bool [T, T], ``attn[r, c]`` True when row r attends to row c (ancestors and
        itself).
    sib_rows: ``(draft index i, token, row)`` of each sibling, in row order.
    """

    offsets: torch.Tensor
    attn: torch.Tensor
    sib_rows: tuple[tuple[int, int, int], ...]

    @property
    def rows(self) -> int:
        return int(self.offsets.numel())


def layout(g: int, alts: Sequence[Sequence[int]] | None) -> TreeLayout:
    """The layout of a chain of depth ``g`` with ``alts`` (length g lists of sibling
    ids; None or all empty: a plain chain, whose mask is causal). Raises ValueError
    when ``alts`` has another length."""
    alts = list(alts or [[] for _ in range(g)])
    if len(alts) != g:
        raise ValueError(f"alts has {len(alts)} positions, the block {g}")
    n_sib = sum(len(a) for a in alts)
    T = 1 + g + n_sib
    offsets = torch.zeros(T, dtype=torch.long)
    offsets[: g + 1] = torch.arange(g + 1)
    attn = torch.zeros(T, T, dtype=torch.bool)
    attn[: g + 1, : g + 1] = torch.ones(g + 1, g + 1, dtype=torch.bool).tril()
    sib_rows = []
    r = g + 1
    for i, ids in enumerate(alts):
        for t in ids:
            offsets[r] = i + 1
            attn[r, : i + 1] = True          # last, d_1..d_i
            attn[r, r] = True
            sib_rows.append((i, int(t), r))
            r += 1
    return TreeLayout(offsets, attn, tuple(sib_rows))


def tree_verdict(best: torch.Tensor, drafts: Sequence[int], tree: TreeLayout
                 ) -> tuple[int, int | None, int]:
    """The greedy verdict of a sibling tree from ``best`` long [T] (the target's argmax
    at each row, ties to the lowest id).

    Returns ``(a, sibling, next)``: ``a`` chain drafts accepted; ``sibling`` the
    accepted sibling's token at position a (None: no sibling accepted); ``next`` the
    bonus token (after the sibling when one was accepted, else after ``d_a``: the
    correction or, when a == g, the bonus)."""
    g = len(drafts)
    a = 0
    while a < g and int(best[a]) == int(drafts[a]):
        a += 1
    t = int(best[a])
    row = sibling_row(tree, a, t) if a < g else None
    return (a, t, int(best[row])) if row is not None else (a, None, t)


def sibling_row(tree: TreeLayout, a: int, token: int) -> int | None:
    """The row of sibling ``token`` at draft index ``a``, or None if it has none."""
    return next((row for i, tok, row in tree.sib_rows if i == a and tok == token), None)
