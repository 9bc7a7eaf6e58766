"""Sibling candidates for the first position of a CATS block (greedy): a token tree of
one chain ``d_1..d_k`` plus ``m`` alternatives ``s_1..s_m`` to ``d_1`` (the exit head's
next-best tokens after the block's last confirmed token), verified by the SAME full
pass (SpecInfer, Miao et al. 2024, §4: tree attention verifies many candidates in one
pass). While streamed bytes dominate, the pass costs the same for k+1 or k+1+m rows,
and the siblings' resident layers cost one more memory-bound resident pass; when
``d_1`` is wrong but the target's token is a sibling, the round commits the sibling
and its bonus token instead of the correction alone.

Cache layout of every layer after the passes (P = confirmed length - 1):
``[prefix 0..P-1][last P][d_1..d_k P+1..P+k][s_1..s_m P+k+1..]``; each sibling has
position id P+1 and attends to the prefix, ``last`` and itself only.
"""

from __future__ import annotations

import torch

from edge_sdk.protocol import sampling as S
from edge_sdk.protocol import tree as TR

__all__ = ["sibling_ids", "resident_mask", "full_inputs", "greedy_tree_verdict"]


def sibling_ids(exit_logits: torch.Tensor, first: int | None, m: int) -> list[int]:
    """The ``m`` best tokens of ``exit_logits`` [V] other than ``first``, best first
    (finite logits only: the exit's restricted vocabulary)."""
    top = torch.topk(exit_logits, m + 1).indices.tolist()
    fin = torch.isfinite(exit_logits)
    return [t for t in top if t != first and bool(fin[t])][:m]


def resident_mask(P: int, k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions long [1, m] and mask bool [1, 1, m, P+1+k+m] of the siblings' pass
    through the resident layers (whose caches hold prefix, last and the chain)."""
    mask = torch.zeros(m, P + 1 + k + m, dtype=torch.bool)
    mask[:, : P + 1] = True
    mask[:, P + 1 + k:] = torch.eye(m, dtype=torch.bool)
    return torch.full((1, m), P + 1, dtype=torch.long), mask[None, None]


def full_inputs(P: int, drafts: list[int], sibs: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, TR.TreeLayout]:
    """Positions long [1, k+1+m], mask bool [1, 1, k+1+m, P+k+1+m] and the tree layout
    of the full pass over ``[last, d_1..d_k, s_1..s_m]`` (the layers' caches hold the
    prefix): the shared sibling tree (:mod:`edge_sdk.protocol.tree`) with the siblings
    at the first draft position."""
    k = len(drafts)
    tree = TR.layout(k, [list(sibs)] + [[] for _ in range(k - 1)])
    mask = torch.ones(tree.rows, P + tree.rows, dtype=torch.bool)
    mask[:, P:] = tree.attn
    return (P + tree.offsets)[None], mask[None, None], tree


def greedy_tree_verdict(logits: torch.Tensor, drafts: list[int], tree: TR.TreeLayout
                        ) -> tuple[list[int], int, int | None]:
    """The greedy verdict over ``logits`` float32 [k+1+m, V] (rows: after last, after
    each chain prefix, after each sibling) by the shared tree rule
    (:func:`edge_sdk.protocol.tree.tree_verdict`). Returns ``(new tokens, accepted
    drafts, index of the accepted sibling or None)``; every new token is the target's
    argmax at its position (ties to the lowest id). A sibling hit accepts no chain
    draft: acceptance statistics count the chain; hits are counted apart (CASES.md 10)."""
    a, sib, nxt = TR.tree_verdict(S.greedy_token(logits), drafts, tree)
    if sib is None:
        return list(drafts[:a]) + [nxt], a, None
    j = TR.sibling_row(tree, a, sib) - (len(drafts) + 1)
    return list(drafts[:a]) + [sib, nxt], a, j
