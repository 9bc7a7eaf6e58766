"""Edge side of staged correction (AsymSpec §IV-B; AsymSpec §IV-B).

At the first rejected position the edge holds q (the draft distribution it sampled
from) and receives target information in stages:

1. bounded support S: draw from ``max(0, p - q)`` restricted to S when the residual-TV
   certificate ``eps_K`` fits the remaining request budget (0 when S covers supp(p));
2. proposals Y ~ p: accept Y with probability ``b(Y) = max(0, 1 - q(Y)/p(Y))``; the
   first accepted proposal is an exact residual draw, since
   ``P(Y = v, accepted) = p(v) b(v) = max(0, p(v) - q(v))`` (success probability Z);
3. the full p: an exact residual draw.

``try_bounded`` and ``try_proposals`` are batched over leading dims (tests run them on
50k rows at once); the edge calls them on one row.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import numpy as np
import torch

from edge_sdk.protocol import sampling as S
from edge_sdk.protocol.wire import Correction

MODES = ("auto", "bounded", "proposal", "full")


def try_bounded(ids: torch.Tensor, sp: torch.Tensor, complete, q: torch.Tensor,
                budget: float, gen: torch.Generator | None):
    """Stage 1. ids int [..., K], sp float64 [..., K], q float64 [..., V].

    Returns ``(token [...], eps [...])``; token is -1 where the certificate exceeds the
    budget (nothing is charged there)."""
    eps, z_s, r_s = S.support_certificate(ids, sp, q, complete)
    ok = (z_s > 0) & (eps <= budget)
    safe = torch.where(ok.unsqueeze(-1), r_s, torch.ones_like(r_s))
    tok = ids.gather(-1, S.sample(safe, gen).unsqueeze(-1)).squeeze(-1)
    return torch.where(ok, tok, torch.full_like(tok, -1)), torch.where(ok, eps, 0.0 * eps)


def try_proposals(ids: torch.Tensor, pp: torch.Tensor, q: torch.Tensor,
                  gen: torch.Generator | None) -> torch.Tensor:
    """Stage 2. ids int [..., N] i.i.d. draws from p, pp float64 [..., N] = p(ids),
    q float64 [..., V]. Returns the first accepted proposal per row, -1 if none."""
    if ids.shape[-1] == 0:
        return torch.full(ids.shape[:-1], -1, dtype=torch.long)
    b = (1.0 - q.gather(-1, ids.long()) / pp).clamp(0.0, 1.0)
    u = torch.rand(ids.shape, generator=gen, dtype=S.PROB_DTYPE)
    hit = u < b
    first = hit.to(torch.int64).argmax(-1, keepdim=True)
    tok = ids.long().gather(-1, first).squeeze(-1)
    return torch.where(hit.any(-1), tok, torch.full_like(tok, -1))


def full_residual(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None):
    """Stage 3: exact residual draw from the full p [..., V]. Returns int64 [...]."""
    return S.sample(S.residual(p, q), gen)


def _t(a, dtype) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=dtype)


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
    i64, f64 = torch.int64, torch.float64
    if mode in ("auto", "bounded"):
        tok, eps = try_bounded(_t(corr.support_ids, i64), _t(corr.support_p, f64),
                               corr.complete, q, budget, gen)
        if tok >= 0:
            return int(tok), "bounded", float(eps)
    if mode in ("auto", "proposal"):
        tok = try_proposals(_t(corr.proposal_ids, i64), _t(corr.proposal_p, f64), q, gen)
        if tok >= 0:
            return int(tok), "proposal", 0.0
    if mode in ("auto", "bounded") and budget > 0 and not corr.complete:
        wider = await fetch(min(q.shape[-1], max(1024, 16 * len(corr.support_ids))))  # expand K
        tok, eps = try_bounded(_t(wider.ids, i64), _t(wider.p, f64), wider.complete, q,
                               budget, gen)
        if tok >= 0:
            return int(tok), "bounded", float(eps)
    full = await fetch(None)
    return int(full_residual(_t(full.p, f64), q, gen)), "full", 0.0
