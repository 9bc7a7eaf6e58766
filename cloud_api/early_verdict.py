"""FSD's provisional verdict: the acceptance rule applied to early-exit logits (the FSD
review, §III: the server streams a verdict predicted at an intermediate layer so the
client can start drafting the next block before the final verdict).

The rule is the final one (``edge_sdk.protocol.sampling``) on other logits: greedy
accepts while the draft token is the early argmax (or, with ``topk > 1``, among the
early top-``topk``: the draft agrees with the target far more often than an early exit
does, so trusting it predicts the final verdict better); sampling uses the *same*
uniforms the final test draws (the generator of the block's position), so the early
and final verdicts differ only where the early and final probabilities do.
Advisory only: nothing is committed from it.
"""

from __future__ import annotations

import torch

from edge_sdk.protocol import rng
from edge_sdk.protocol import sampling as S

__all__ = ["provisional_verdict"]


def _greedy(block: torch.Tensor, x: torch.Tensor, topk: int) -> tuple[int, int]:
    """Greedy provisional verdict on processed early logits ``x`` [g+1, V]."""
    if topk <= 1:
        return S.greedy_verify(block, x)
    g = block.numel()
    own = x[torch.arange(g), block].unsqueeze(1)                    # [g, 1]
    ranks = (x[:g] > own).sum(dim=1)                                # [g]
    a = int(S.accepted_length(ranks < topk))
    return a, int(S.greedy_token(x[a:a + 1])[0])


def provisional_verdict(cfg: S.SamplingConfig, seed: int, context: list[int],
                        block: list[int], q_tok, logits: torch.Tensor,
                        topk: int = 1) -> tuple[int, int | None]:
    """The provisional ``(accepted, next token or None)`` of one block.

    Args:
        cfg, seed: the session's sampling config and seed.
        context: confirmed ids the block extends (its last token is the pass's first
            input). block: the draft ids [g].
        q_tok: float64 [g], the draft probabilities of the block's tokens (sampling;
            ignored for greedy).
        logits: float32 [g+1, V] early logits (-inf outside the exit's vocabulary).
        topk: greedy acceptance rank (1: the greedy rule itself).
    Returns:
        accepted drafts and the next token; None for a sampled rejection (its
        correction token is drawn on the edge from the final distribution).
    """
    g = len(block)
    x = S.process_block(logits, cfg, context, block)
    if cfg.greedy:
        return _greedy(torch.tensor(block, dtype=torch.long), x, topk)
    gen = rng.generator(seed, rng.VERIFY, len(context))              # the final's draws
    a = S.sampled_accepts(torch.softmax(x, dim=-1), block, q_tok, gen)
    if a < g:
        return a, None
    return a, S.sample_next(logits[g], cfg, context + block, gen)[0]
