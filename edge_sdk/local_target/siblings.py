"""Sibling candidates of a CATS block (greedy): a token tree of one chain ``d_1..d_k``
plus alternatives ``s_{i,*}`` to ``d_{i+1}`` at any chain position ``i`` (the draft's
next-best tokens after ``d_1..d_i``), verified by the SAME full pass (SpecInfer, Miao et
al. 2024, §4: tree attention verifies many candidates in one pass). While streamed
bytes dominate, the pass costs about the same for k+1 or k+1+m rows, and the siblings'
resident layers cost one more memory-bound resident pass; when ``d_{a+1}`` is wrong but
the target's token is a sibling at position ``a``, the round commits ``d_1..d_a``, the
sibling and its bonus token instead of the correction alone.

Which positions get the ``m`` siblings (:func:`tree_siblings`): the ``m`` pairs
``(i, s)`` of largest estimated hit probability ``reach_i * q_i(s)``, with ``reach_i =
prod_{j<=i} q_j(d_j)`` the draft's own probability that the chain gets to position
``i`` (EAGLE-2, Li et al. 2024, §4: the draft's confidence approximates the acceptance
rate, and the tree grows by the path's product of confidences; Sequoia, Chen et al.
2024, §3). A sure first draft spends its siblings deeper in the block.

Cache layout of every layer after the passes (P = confirmed length - 1):
``[prefix 0..P-1][last P][d_1..d_k P+1..P+k][siblings P+k+1..]`` (siblings in the
order of :func:`edge_sdk.protocol.tree.layout`); a sibling at position ``i`` has
position id P+1+i and attends to the prefix, ``last``, ``d_1..d_i`` and itself.
"""

from __future__ import annotations

import torch

from edge_sdk.protocol import sampling as S
from edge_sdk.protocol import tree as TR

__all__ = ["tree_siblings", "resident_mask", "full_inputs", "greedy_tree_verdict"]


def tree_siblings(logits: list[torch.Tensor], drafts: list[int], m: int
                  ) -> list[list[int]]:
    """The ``m`` siblings of a chain by estimated hit probability (module docstring).

    Args: logits: the draft's float32 [V] after ``last, d_1..d_{i}`` for i = 0..g-1
        (``-inf`` outside its vocabulary); drafts: ``d_1..d_g``; m: siblings in all.
    Returns: ``alts`` [g] lists (position i: alternatives to ``d_{i+1}``, best first);
    a token of zero draft probability is never chosen."""
    g = len(drafts)
    cand: list[tuple[float, int, int, int]] = []        # (-score, i, rank, token)
    reach = 1.0
    for i in range(min(g, len(logits))):
        q = torch.softmax(logits[i].float(), -1)
        top = torch.topk(q, min(m + 1, q.numel()))
        rank = 0
        for p, tok in zip(top.values.tolist(), top.indices.tolist()):
            if tok != drafts[i] and p > 0.0:
                cand.append((-reach * p, i, rank, int(tok)))
                rank += 1
        reach *= float(q[drafts[i]])
    alts: list[list[int]] = [[] for _ in range(g)]
    for _, i, _, tok in sorted(sorted(cand)[:m], key=lambda c: (c[1], c[2])):
        alts[i].append(tok)                      # per position in the draft's own order
    return alts


def resident_mask(P: int, k: int, at: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions long [1, m] and mask bool [1, 1, m, P+1+k+m] of the siblings' pass
    through the resident layers (whose caches hold prefix, last and the chain), for
    siblings at chain positions ``at`` [m] (0: alternatives to ``d_1``)."""
    m = len(at)
    mask = torch.zeros(m, P + 1 + k + m, dtype=torch.bool)
    for r, i in enumerate(at):
        mask[r, : P + 1 + i] = True                     # prefix, last, d_1..d_i
    mask[:, P + 1 + k:] = torch.eye(m, dtype=torch.bool)
    pos = torch.tensor([[P + 1 + i for i in at]], dtype=torch.long)
    return pos, mask[None, None]


def full_inputs(P: int, drafts: list[int], alts: list[list[int]]
                ) -> tuple[torch.Tensor, torch.Tensor, TR.TreeLayout]:
    """Positions long [1, T], mask bool [1, 1, T, P+T] and the tree layout of the full
    pass over ``[last, d_1..d_k, siblings]`` (T = k+1+m; the layers' caches hold the
    prefix): the shared sibling tree (:mod:`edge_sdk.protocol.tree`) with ``alts`` [k]
    per chain position."""
    tree = TR.layout(len(drafts), alts)
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
