"""The decision head's inputs at one mismatching position (WISV §III-B: the target's
hidden representation plus token-level statistics).

One implementation for training (``specrelay wisv train``) and serving (the verifier).
"""

from __future__ import annotations

import torch

__all__ = ["SCALAR_FEATURES", "n_features", "mismatch_features"]

SCALAR_FEATURES = ("logp_draft", "logp_target", "logp_gap", "entropy",
                   "log_rank_draft", "top2_gap")
"""Scalar features after the hidden state, in order:
``logp_draft`` log p(d), ``logp_target`` log p(t) (t = argmax), ``logp_gap`` their
difference (<= 0), ``entropy`` H(p) in nats, ``log_rank_draft`` log(1 + rank of d)
(rank 1 = second best), ``top2_gap`` the logit gap between the two best tokens."""


def n_features(hidden_size: int) -> int:
    """Feature width F = H + len(SCALAR_FEATURES)."""
    return int(hidden_size) + len(SCALAR_FEATURES)


@torch.no_grad()
def mismatch_features(hidden: torch.Tensor, logits: torch.Tensor,
                      draft: torch.Tensor) -> torch.Tensor:
    """Features of N mismatching positions.

    Args:
        hidden: float [N, H], the target's last hidden state (the final norm's output,
            i.e. the LM head's input) at the row that predicts the mismatching position.
        logits: float [N, V], the target's logits at those rows (the processed rows the
            acceptance rule reads).
        draft: long [N], the draft token at each position.
    Returns:
        float32 [N, H + 6]: ``hidden`` then :data:`SCALAR_FEATURES`.
    Raises:
        ValueError: on mismatched leading dimensions.
    """
    if hidden.dim() != 2 or logits.dim() != 2 or draft.dim() != 1 \
            or not hidden.shape[0] == logits.shape[0] == draft.shape[0]:
        raise ValueError("hidden [N, H], logits [N, V] and draft [N] must share N")
    x = logits.float()
    logp = torch.log_softmax(x, dim=-1)
    draft = draft.long()
    lp_d = logp.gather(1, draft[:, None])[:, 0]
    top2 = torch.topk(x, 2, dim=-1).values
    lp_t = logp.max(dim=-1).values
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    rank = (x > x.gather(1, draft[:, None])).sum(-1).float()
    scal = torch.stack([lp_d, lp_t, lp_d - lp_t, ent, torch.log1p(rank),
                        top2[:, 0] - top2[:, 1]], dim=-1)
    scal = torch.nan_to_num(scal, nan=0.0, neginf=-100.0, posinf=100.0)
    return torch.cat([hidden.float(), scal], dim=-1)
