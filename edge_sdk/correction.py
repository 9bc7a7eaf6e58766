"""Edge side of staged correction (AsymSpec §IV-B; SPEC §2).

At the first rejected position the edge holds q (the draft distribution it sampled
from) and receives target information in stages:

1. bounded support S: draw from ``max(0, p - q)`` restricted to S when the residual-TV
   certificate ``eps_K`` fits the remaining request budget (0 when S covers supp(p));
2. proposals Y ~ p: accept Y with probability ``max(0, 1 - q(Y)/p(Y))``; the first
   accepted proposal is an exact residual draw (success probability Z = TV(p, q));
3. the full p: an exact residual draw.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import numpy as np
import torch

from edge_sdk.protocol import sampling as S
from edge_sdk.protocol.wire import Correction

MODES = ("auto", "bounded", "proposal", "full")


def try_bounded(ids: np.ndarray, p: np.ndarray, complete: bool, q: torch.Tensor,
                budget: float, gen: torch.Generator):
    """Stage 1. Returns ``(token, eps_spent)`` or None when the certificate exceeds the
    budget (or S carries no residual mass)."""
    ids_t = torch.tensor(np.asarray(ids, dtype=np.int64))
    eps, z_s, r_s = S.support_certificate(ids_t, torch.tensor(np.asarray(p), dtype=torch.float64), q, complete)
    if z_s <= 0.0 or eps > budget:
        return None
    return int(ids_t[S.sample(r_s, gen)]), eps


def try_proposals(ids: np.ndarray, p: np.ndarray, q: torch.Tensor,
                  gen: torch.Generator) -> int | None:
    """Stage 2: accept proposal Y with probability ``max(0, 1 - q(Y)/p(Y))``."""
    if len(ids) == 0:
        return None
    qy = q[torch.tensor(np.asarray(ids, dtype=np.int64))].numpy()
    b = np.clip(1.0 - qy / np.asarray(p), 0.0, 1.0)
    u = torch.rand(len(ids), generator=gen, dtype=S.PROB_DTYPE).numpy()
    hit = np.nonzero(u < b)[0]
    return int(ids[hit[0]]) if hit.size else None


async def resolve(corr: Correction, q: torch.Tensor, budget: float, gen: torch.Generator,
                  fetch: Callable[[int | None], Awaitable], mode: str = "auto"):
    """Draw the correction token for the rejected position.

    Args:
        corr: the cloud's correction payload. q: float64 [V] draft distribution there.
        budget: remaining TV budget of the request (``eps_req`` minus what was spent).
        fetch: ``await fetch(k)`` returns a CorrectionResponse with a top-k support
            (``k`` int) or the full p (``k`` None).
        mode: ``auto`` (stages in order), or force ``bounded`` / ``proposal`` / ``full``
            (a forced stage that cannot decide falls through to ``full``).
    Returns:
        ``(token, stage, eps_spent)`` with stage in {"bounded", "proposal", "full"}.
    """
    if mode in ("auto", "bounded"):
        got = try_bounded(corr.support_ids, corr.support_p, corr.complete, q, budget, gen)
        if got is not None:
            return got[0], "bounded", got[1]
    if mode in ("auto", "proposal"):
        y = try_proposals(corr.proposal_ids, corr.proposal_p, q, gen)
        if y is not None:
            return y, "proposal", 0.0
    if mode in ("auto", "bounded") and budget > 0 and not corr.complete:
        wider = await fetch(max(1024, 16 * len(corr.support_ids)))   # expand K once
        got = try_bounded(wider.ids, wider.p, wider.complete, q, budget, gen)
        if got is not None:
            return got[0], "bounded", got[1]
    full = await fetch(None)
    p = torch.tensor(np.asarray(full.p), dtype=torch.float64)
    return int(S.sample(S.residual(p, q), gen)), "full", 0.0
