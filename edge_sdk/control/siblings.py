"""Sibling policy: which greedy draft positions get tree siblings, and how many
(Sequoia, Chen et al. 2024, §3: spend a tree's extra rows where the draft is least
sure; SpecInfer, Miao et al. 2024, §4 verifies them in the same target pass).

Policy only: the candidates and the draft's confidence come with the block
(:class:`edge_sdk.drafters.base.DraftBlock` ``cands`` / ``conf``); the tree rows and
the verdict are :mod:`edge_sdk.protocol.tree`.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_sdk.drafters.base import DraftBlock
from edge_sdk.protocol.tree import MAX_SIBLINGS

__all__ = ["SiblingPolicy"]


@dataclass(frozen=True)
class SiblingPolicy:
    """Give ``width`` siblings to each draft position but the last whose draft
    probability of its own token is below ``below``, least sure first, while the pass
    stays within ``max_rows`` rows (1 + g + siblings; the server's ``max_tree_rows``
    also caps it). The last position gets none: a sibling hit there would commit as
    many tokens as a full acceptance, possibly ending in the same bonus token, so a
    block sent ahead on the full-acceptance assumption would be verified by the cloud
    (it checks the confirmed length and last token) while the edge, seeing another
    prefix, drafts that block anew (409 ``block_seq_reused``).

    ``max_rows`` 16: on the bf16 target with oneDNN's AMX kernels a pass costs nearly
    the same for 1 to 16 rows and a step more from 17 (one tile of 16 rows; measured on
    a 2-core AMX Xeon, Qwen2.5-Coder-1.5B after 200 tokens, one thread: 1 row ~340 ms,
    9 ~362, 13 ~368, 16 ~367, 17 ~460, 25 ~466; ``python -m bench.probes.pass_cost
    qwen2.5-coder-1.5b bfloat16 1,9,13,16,17,25``), so a depth-8 block carries up to 7
    sibling rows at no extra pass cost.

    ``free_only``: stay within the rows the server advertises as free (``free_rows``:
    a pass of that many rows costs about what one row does; 0 where the server does
    not know, e.g. float32 or a CPU without AMX, where every row costs): the SDK's
    default (:meth:`auto`), so that a tree never makes a pass dearer.

    Raises ValueError on a width outside 1..MAX_SIBLINGS or a bad threshold."""

    width: int = 2
    below: float = 0.8
    max_rows: int = 16
    free_only: bool = False

    @classmethod
    def auto(cls) -> "SiblingPolicy":
        """The SDK's default tree: width 2 within the server's free rows."""
        return cls(width=2, free_only=True)

    def server_rows(self, max_tree_rows: int, free_rows: int) -> int:
        """The server's side of the row budget :meth:`choose` takes: its limit
        ``max_tree_rows``, or with ``free_only`` the rows it says cost nothing
        (``free_rows``) within it."""
        return min(max_tree_rows, free_rows) if self.free_only else max_tree_rows

    def __post_init__(self):
        if not 1 <= self.width <= MAX_SIBLINGS:
            raise ValueError(f"sibling width must be in 1..{MAX_SIBLINGS}")
        if not 0.0 < self.below <= 1.0:
            raise ValueError("sibling threshold must be in (0, 1]")

    def choose(self, block: DraftBlock | None, server_rows: int) -> list[list[int]] | None:
        """Siblings per draft position of ``block`` ([g] lists, empty where none), or
        None: no siblings (no greedy candidates, nobody below the threshold, or a
        server without trees: ``server_rows`` 0)."""
        if block is None or block.cands is None or not server_rows or not len(block):
            return None
        g, m = len(block), self.width
        budget = min(self.max_rows, server_rows) - (1 + g)
        # never the last position: a hit there ends the round at the length (and maybe
        # the last token) of a full acceptance, which a block sent ahead on that
        # assumption cannot tell apart (the cloud checks base_len + expect_last)
        order = sorted((c, i) for i, c in enumerate(block.conf[: g - 1])
                       if c < self.below and len(block.cands[i]) >= m)
        alts: list[list[int]] = [[] for _ in range(g)]
        for _, i in order:
            if budget < m:
                break
            alts[i] = list(block.cands[i][:m])
            budget -= m
        return alts if any(alts) else None
