"""UCB-SpecStop — draft depth as a contextual bandit (UCB-SpecStop).

Arms are depths ``1..L_max``; the context is a *delay bucket* (log-spaced bins of the
expected send->response time); the reward of a round is its committed tokens per second
of round time (drafting + waiting). Each bucket runs UCB1 (Auer et al. 2002) on rewards
normalised by the largest reward seen in that bucket:

    index(L) = mean(L) / r_max + c * sqrt(2 ln t / n(L)),

untried arms first. The analytic model behind it (critical delay below which L=1 is
optimal, optimal L growing ~log(delay)) lives in :mod:`edge_sdk.control.analytic`;
:meth:`UCBSpecStop.prior_depth` exposes it for a given alpha.

Note: the paper's algorithm learns per-position acceptance and solves the stopping
problem optimistically; this is the arm-level variant the SDK needs (no extra
signals), with the same reward and context.
"""

from __future__ import annotations

import bisect
import math

from edge_sdk.control import analytic
from edge_sdk.control.base import L_MAX, DepthController, PlanContext, RoundRecord

# 5 ms .. 320 ms, doubling: the spread of the benchmark profiles' RTTs plus verification time
DEFAULT_EDGES_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)


class UCBSpecStop(DepthController):
    """Contextual UCB1 over depths.

    Args:
        bucket_edges_s: delay-bucket boundaries in seconds (bucket i holds delays in
            ``[edges[i-1], edges[i])``); ``()`` for a single context.
        c: exploration weight on normalised rewards. 0.5 explores less than UCB1's 1.0
            (depth rewards are strongly correlated across neighbouring arms, and every
            exploratory round costs real latency).
        w_delay: EWMA weight of the send->response estimate used to pick the bucket.
    """

    name = "ucb-specstop"

    def __init__(self, l_max: int = L_MAX, bucket_edges_s=DEFAULT_EDGES_S, c: float = 0.5,
                 w_delay: float = 0.5):
        super().__init__(l_max)
        self.edges = tuple(float(e) for e in bucket_edges_s)
        self.c, self.w_delay = float(c), float(w_delay)
        nb = len(self.edges) + 1
        self.n = [[0] * (self.l_max + 1) for _ in range(nb)]       # pulls per arm
        self.mean = [[0.0] * (self.l_max + 1) for _ in range(nb)]  # mean reward (tok/s)
        self.r_max = [0.0] * nb
        self.delay: float | None = None                            # EWMA of resp_s

    def bucket(self, delay_s: float | None) -> int:
        """Context index for a delay in seconds (None: the first bucket)."""
        return 0 if delay_s is None else bisect.bisect_right(self.edges, float(delay_s))

    def next_depth(self, stats: PlanContext | None = None) -> int:
        stats = stats or PlanContext()
        delay = stats.delay_s if stats.delay_s is not None else self.delay
        k = self.bucket(delay)
        n, mean = self.n[k], self.mean[k]
        arms = range(1, self.l_max + 1)
        untried = [L for L in arms if n[L] == 0]
        if untried:
            L = untried[0]
        else:
            t = sum(n[1:])
            scale = self.r_max[k] or 1.0
            L = max(arms, key=lambda a: (mean[a] / scale
                                         + self.c * math.sqrt(2.0 * math.log(t) / n[a]), -a))
        return L

    def update(self, rnd: RoundRecord) -> None:
        """Credit the round's reward to the depth actually drafted (it may be below the
        plan: length cap, n-gram without a match) in the bucket of the delay estimate the
        round was planned with (the estimate before this round's own delay is folded in;
        proactive planning may call ``next_depth`` again before this update)."""
        k = self.bucket(rnd.plan_delay_s if rnd.plan_delay_s is not None else self.delay)
        if rnd.resp_s is not None:
            self.delay = (rnd.resp_s if self.delay is None
                          else self.delay + self.w_delay * (rnd.resp_s - self.delay))
        if not 1 <= rnd.depth <= self.l_max or not rnd.round_s or rnd.round_s <= 0:
            return
        L = int(rnd.depth)
        r = rnd.committed / rnd.round_s
        self.n[k][L] += 1
        self.mean[k][L] += (r - self.mean[k][L]) / self.n[k][L]
        self.r_max[k] = max(self.r_max[k], r)

    def best_arm(self, delay_s: float | None = None) -> int:
        """The empirically best depth in the bucket of ``delay_s`` (most pulls on ties)."""
        k = self.bucket(delay_s if delay_s is not None else self.delay)
        return max(range(1, self.l_max + 1), key=lambda a: (self.mean[k][a], self.n[k][a]))

    @staticmethod
    def prior_depth(alpha: float, tau_d: float, delay_s: float, l_max: int = L_MAX) -> int:
        """The analytic optimum (UCB-SpecStop): 1 below ``critical_delay(alpha, tau_d)``."""
        return analytic.optimal_depth(alpha, tau_d, delay_s, l_max)

    def state(self) -> dict:
        k = self.bucket(self.delay)
        return {"bucket": k, "delay": self.delay, "pulls": self.n[k][1:],
                "mean": [round(m, 3) for m in self.mean[k][1:]]}
