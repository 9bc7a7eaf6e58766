"""Dynamic draft trees of a greedy CATS block: several levels of candidates, grown from
the draft's own confidence, verified by ONE full pass (EAGLE-2, Li et al. 2024, §4:
expand the ``beam`` nodes of largest path confidence at each depth, each with its
``beam`` most likely children, then rerank every node by path confidence and verify the
best ``nodes``; SpecInfer, Miao et al. 2024, §4: token tree verification under a tree
attention mask).

A tree is a list of nodes: ``tokens[n]``, ``parents[n]`` (-1: a child of the root, the
context's last token), ``depths[n]`` (1-based: the root is depth 0) and ``scores[n]``
(the draft's path confidence ``prod q`` over the node and its ancestors). The rows of
the verification pass are ``[root, nodes...]``, row ``r`` = node ``r - 1``; a row
attends to the cached prefix, its ancestors and itself, at position ``P + depth``.

Why it beats a chain with siblings when storage dominates the pass: a chain's accepted
length is cut at the first draft that is not the target's argmax, a sibling tree keeps
one alternative level; a dynamic tree follows the target down a second- or third-ranked
branch as deep as the draft's confidence justifies, and each extra level costs one
resident pass over ``beam`` rows (memory-bound: about a one-token pass) while the full
pass costs the same for 13 or 30 rows.

Greedy verdict (:func:`greedy_path`): from the root, repeatedly take the child whose
token equals the target's argmax at the current row; the argmax at the last row reached
is the bonus token (or the correction). Every committed token is the target's argmax
after its prefix, so the output is the target's greedy output, whatever tree was drafted.
"""

from __future__ import annotations

import torch

__all__ = ["top_children", "rerank", "ancestors", "rows_mask", "greedy_path"]


def top_children(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely draft tokens and their probabilities from ``logits``
    float32 [V] (``-inf`` outside the draft's vocabulary; a zero-probability token is
    never returned), best first."""
    q = torch.softmax(logits.float(), -1)
    top = torch.topk(q, min(k, q.numel()))
    return [(int(t), float(p)) for p, t in zip(top.values.tolist(), top.indices.tolist())
            if p > 0.0]


def rerank(scores: list[float], depths: list[int], n: int) -> list[int]:
    """The ``n`` nodes of largest path confidence, in an order where every node comes
    after its parent (ties by depth, then by id). A child's score is its parent's times
    a probability <= 1 and its depth is larger, so every prefix of this order is closed
    under ancestors: the selection is a tree."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))
    return order[:n]


def ancestors(parents: list[int], n: int) -> list[int]:
    """Node ``n``'s ancestors (nearest first), the root (-1) excluded."""
    out, p = [], parents[n]
    while p >= 0:
        out.append(p)
        p = parents[p]
    return out


def rows_mask(parents: list[int], rows: list[int], cached: list[int], P: int
              ) -> torch.Tensor:
    """The attention mask bool [1, 1, q, P + len(cached) + q] of new rows ``rows`` (node
    ids, q of them) over a cache that holds the prefix (P entries) and then the rows
    ``cached`` (node ids, -1 = the root): each new row sees the prefix, the root, its
    ancestors (cached or among ``rows``) and itself. Raises KeyError when an ancestor
    is in neither."""
    c, q = len(cached), len(rows)
    col = {node: P + j for j, node in enumerate(cached)}
    col.update({node: P + c + r for r, node in enumerate(rows)})
    mask = torch.zeros(q, P + c + q, dtype=torch.bool)
    mask[:, :P] = True
    for r, n in enumerate(rows):
        for a in [n, -1] + ancestors(parents, n):
            mask[r, col[a]] = True
    return mask[None, None]


def greedy_path(best: torch.Tensor, tokens: list[int], parents: list[int],
                rows: list[int]) -> tuple[list[int], int]:
    """The greedy verdict of a tree whose pass rows are ``[root] + rows`` (node ids)
    from ``best`` long [1 + len(rows)] (the target's argmax at each row, ties to the
    lowest id). Returns ``(accepted row indexes, next token)``: the rows (1-based) of
    the accepted nodes from the root down, and the target's argmax after the last of
    them (the bonus token, or the correction when none was accepted)."""
    row_of = {n: r + 1 for r, n in enumerate(rows)}
    children: dict[int, dict[int, int]] = {}
    for n in rows:
        children.setdefault(parents[n], {})[tokens[n]] = n
    path, cur = [], -1
    while True:
        t = int(best[0 if cur < 0 else row_of[cur]])
        nxt = children.get(cur, {}).get(t)
        if nxt is None:
            return path, t
        path.append(row_of[nxt])
        cur = nxt
