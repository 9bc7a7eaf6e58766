"""Closed-form round model for draft-depth selection (Leviathan et al. 2023 §2.3;
RAPID; UCB-SpecStop).

With i.i.d. per-token acceptance ``alpha`` (Leviathan et al. 2023, §3.1), a block of
depth L commits ``E[C_L] = 1 + sum_{j=1..L} alpha^j = (1 - alpha^{L+1}) / (1 - alpha)``
tokens (accepted drafts + bonus/correction). A stop-and-wait round costs
``L * tau_d + D`` seconds (tau_d: seconds per draft token, D: send->response delay), so
the token rate is ``R(L) = E[C_L] / (L * tau_d + D)``.

``E[C_L]`` is concave in L and the denominator affine, so R is quasi-concave: its
super-level sets are intervals and the first L where ``R(L+1) <= R(L)`` is the global
optimum. Comparing L=1 with L=2 gives the **critical delay** of UCB-SpecStop's
ratio-type stopping analysis (UCB-SpecStop):

    R(1) >= R(2)  <=>  D <= D* = tau_d * (1 + alpha - alpha^2) / alpha^2,

below which single-token speculation is optimal. For large D the first-order condition
``alpha^{L+1} ln(1/alpha) (L tau_d + D) ~ tau_d`` gives ``L* ~ log(D / tau_d) / log(1/alpha)``:
the optimal depth grows only logarithmically with the delay.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence


def expected_committed(alpha: float | Sequence[float], L: int) -> float:
    """``E[C_L]`` tokens per block of depth ``L`` (Leviathan et al. 2023 §2.3).

    alpha: a per-token acceptance probability in [0, 1], or per-position probabilities
    ``alpha_1..alpha_L`` (then ``E[C_L] = 1 + sum_j prod_{k<=j} alpha_k``).
    """
    if L < 0:
        raise ValueError("L must be >= 0")
    if isinstance(alpha, (int, float)):
        a = float(alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError("alpha must be in [0, 1]")
        return float(L + 1) if a == 1.0 else (1.0 - a ** (L + 1)) / (1.0 - a)
    total, prod = 1.0, 1.0
    for a in list(alpha)[:L]:
        prod *= float(a)
        total += prod
    return total


def round_rate(alpha: float | Sequence[float], L: int, tau_d: float,
               delay: float | Callable[[int], float]) -> float:
    """Committed tokens per second of a stop-and-wait round: ``E[C_L] / (L tau_d + D(L))``.

    tau_d: seconds per draft token; delay: seconds (or a function of L, e.g. when the
    verification time grows with the block).
    """
    d = delay(L) if callable(delay) else float(delay)
    den = L * tau_d + d
    return expected_committed(alpha, L) / den if den > 0 else math.inf


def optimal_depth(alpha: float, tau_d: float, delay: float | Callable[[int], float],
                  l_max: int | None = None) -> int:
    """argmax_L R(L) over ``1..l_max`` (ties: the smaller L). ``l_max=None`` searches
    without a cap, stopping at the first decrease (valid by quasi-concavity)."""
    best_l, best = 1, round_rate(alpha, 1, tau_d, delay)
    L = 2
    while l_max is None or L <= l_max:
        r = round_rate(alpha, L, tau_d, delay)
        if r > best * (1 + 1e-12):
            best_l, best = L, r
        elif l_max is None:
            break
        L += 1
        if L > 100_000:
            break
    return best_l


def critical_delay(alpha: float, tau_d: float) -> float:
    """Delay D* (seconds) at and below which L=1 is optimal: ``tau_d (1+a-a^2)/a^2``.
    ``inf`` for alpha = 0 (drafting never pays)."""
    if alpha <= 0:
        return math.inf
    return tau_d * (1.0 + alpha - alpha * alpha) / (alpha * alpha)


def near_optimal_band(alpha: float | Sequence[float], tau_d: float,
                      delay: float | Callable[[int], float], l_max: int,
                      tol: float) -> tuple[int, int]:
    """Smallest and largest L in ``1..l_max`` with ``R(L) >= (1 - tol) * max R``
    (an interval, by quasi-concavity, for a scalar alpha; with per-position
    probabilities, the hull of the qualifying depths)."""
    rates = [round_rate(alpha, L, tau_d, delay) for L in range(1, l_max + 1)]
    top = max(rates)
    ok = [i + 1 for i, r in enumerate(rates) if r >= (1.0 - tol) * top]
    return ok[0], ok[-1]
