"""The layer-skipping self-speculative draft of CATS: the first ``R1`` decoder layers
and a *tail* of ``R2`` more are resident (``R1 + R2 = R``; the last ``R2``, or any
set above ``R1`` -- :data:`.budget.SKIP_SETS`, found by a search on held-out text), the
others streamed; a draft token runs the resident layers only, in order, then the
model's own final norm + LM head (Draft & Verify, Zhang et al. 2023, §3.1: the draft is the target
with intermediate layers skipped; LayerSkip, Elhoushi et al. 2024, §4; SWIFT, Xia et
al. 2024). No exit head to fit: the last layers already map into the head's space, so
the draft agrees with the target far more often than an early exit from the same
resident bytes (``bench/probes/skip_agreement.py``; :data:`.budget.SKIP_AGREEMENT`).

Caches (CASES.md 7, 11). Layers ``0..R1-1`` see the target's own inputs, so the keys
and values the draft writes there are the target's and are kept. The tail layers see
a different input on the draft path (a residual stream that skipped layers): the
draft's entries there are draft-only. The draft attends to the
TRUE entries of the confirmed prefix in those layers (the full pass wrote them) plus
its own entries for the block, and :meth:`SkipDraft.release` crops those layers back
to the prefix before the verification pass, which runs layers ``R1..L-1`` on the stored
residual streams at ``R1`` (same position ids) and writes the true keys/values of
every layer it runs. No second cache: the draft-only entries live in the tail layers'
cache slots between drafting and verification only.
"""

from __future__ import annotations

import torch

from edge_sdk.local_target.head import DraftVocabHead
from edge_sdk.local_target.runner import OffloadedTarget

__all__ = ["SkipDraft", "layer_ranges"]


def layer_ranges(layers) -> str:
    """Sorted layer ids as compact ranges: ``(0, 1, 2, 17, 18, 26)`` -> ``"0-2,17-18,26"``."""
    out, run = [], []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def _ranges(tail: tuple, L: int) -> str:
    """The name's tail: ``R2`` when it is the last ``R2`` of ``L`` layers, else its
    ranges."""
    return str(len(tail)) if tail == tuple(range(L - len(tail), L)) else layer_ranges(tail)


class SkipDraft:
    """Drafting by skipping the streamed middle layers of ``target``.

    Args:
        target: an :class:`OffloadedTarget` with ``R2 = target.R2 >= 1`` tail layers
            resident (:attr:`OffloadedTarget.tail`) and ``R1 = target.R1 >= 1`` leading
            ones.
        vocab: the draft's vocabulary: the first ``vocab`` ids plus the special ones
            (:func:`edge_sdk.exit_head.restricted_vocab`; None: all), so the draft's head
            costs a fraction of the full one (FR-Spec's frequency-ranked subset).
    Attributes:
        split: ``R1``, the first layer the verification pass runs.
    Raises:
        ValueError: no tail or no leading resident layer, or nothing skipped.
    """

    def __init__(self, target: OffloadedTarget, vocab: int | None = 32768):
        if target.R2 < 1 or target.R1 < 1 or target.R >= target.num_layers:
            raise ValueError(f"a skip draft needs R1, R2 >= 1 and a streamed middle "
                             f"(R1={target.R1}, R2={target.R2}, L={target.num_layers})")
        self.t, self.split, self.tail = target, target.R1, target.tail
        self._head = DraftVocabHead(target, vocab)
        self.vocab_ids = self._head.vocab_ids
        self.name = f"skip-{target.R1}+{_ranges(self.tail, target.num_layers)}-v{vocab or 'full'}"

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """:meth:`DraftVocabHead.logits` of the last layer's output [T, H]."""
        return self._head.logits(h)

    def step(self, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft token's pass over ``tok`` at the next position: layers
        ``0..R1-1`` (target KV, kept) then the tail in order (draft-only KV). Returns
        the residual stream at ``R1`` [1, 1, H] (the verification pass's input) and the
        draft logits float32 [V]."""
        h = self.t.run_layers(self.t.embed([tok]), 0, self.split)
        g = self.t.run_list(h, self.tail)
        return h, self.logits(g[0])[0]

    def step_rows(self, toks: list[int], pos: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree rows ``toks`` [q] at positions ``pos`` long [1, q] under ``mask`` bool
        [1, 1, q, cached + q] (the same over the leading layers and the tail: both
        hold the prefix and the rows drafted so far): residual streams at ``R1``
        [1, q, H] and draft logits float32 [q, V]."""
        h = self.t.run_layers(self.t.embed(toks), 0, self.split, pos, mask)
        g = self.t.run_list(h, self.tail, pos, mask)
        return h, self.logits(g[0])

    def release(self, n: int) -> None:
        """Drop the draft-only entries: the tail layers' caches back to ``n`` tokens
        (the confirmed prefix minus its last token), before the verification pass."""
        self.t.crop(n, self.tail)
