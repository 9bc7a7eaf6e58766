"""CAAC — congestion-aware adaptive controller (RAPID).

Chooses the next draft depth before each round from two paths:

* **physical** (has the edge slowed down?): per-token draft latency of the last round
  ``tau_cur`` feeds a fast EWMA ``tau_f`` and a slow baseline EWMA ``tau_s`` (both seeded
  by the first measurement); the excess slowdown ratio
  ``ESR = max(0, tau_f/tau_s - 1 - delta)`` gives the gate
  ``eta = 1 / (1 + k_eta * ESR)`` in (0, 1]. The dead band ``delta`` keeps round-to-round
  timing noise (which ``max(0, .)`` would otherwise turn into a systematic depth cut)
  out of the gate.
* **logical** (is a deeper draft useful?): the acceptance EWMA ``A`` (accepted / drafted
  per round) drives a PID on ``e = A - A_target`` that proposes a continuous depth
  ``B_hat`` (more acceptance -> deeper), with anti-windup keeping ``B_hat in [1, L_max]``.

Fusion: ``L = clamp(round(eta * B_hat), 1, L_max)`` (before the model below is warm,
and projected onto the part of its near-optimal band from its optimum deeper after); when drafting proactively (IPDG),
``L <= max(1, floor(T_resp / tau_f))`` so the proactive draft does not outlast the
expected response (``T_resp``: EWMA of send->response seconds).

**Model-based check**: with the per-position acceptance
``h_k = P(draft k accepted | drafts 1..k-1 accepted)`` estimated from the block outcomes
(discounted counts, shrunk by ``pos_prior`` pseudo-trials toward the estimate of the
position before it, position 1 toward the pooled per-token ``alpha``) and the round model of
:mod:`edge_sdk.control.analytic`, the depths whose predicted rate
``E[C_L] / (L tau_f + T_resp(L))`` (``E[C_L] = 1 + sum_j prod_{k<=j} h_k``) is within
``model_tol`` of the best form a band (``T_resp(L)`` plus the edge's own per-round
overhead: request building, signing, commit — ``round_s - resp_s - L tau``, EWMA;
a request's first round, whose span holds the session create and both prefills, reports
no ``round_s``, and a sample longer than the round's own ``resp_s + L tau`` is a one-off
stall (a retry, a re-created session) and is skipped: either would price seconds of
one-off wait into every later round and pin the band at ``L_max`` for the next ~10
rounds — under a 3x draft slowdown depth 8 at acceptance ~0.3).
Per-position rates matter because real acceptance is not
i.i.d. (measured on SmolLM2 with the trained draft at depth 8, MT-Bench / HumanEval: h_1
0.61, h_2 0.77 / 0.48, h_3 0.53 / 0.42, deeper positions 0.5-1.0 on few trials), and a
pooled rate misprices exactly the depths the band is choosing between. The
gated PID proposal is projected onto the upper part of that band, from the model's
rate-optimal depth ``L*`` to the band's deep end (``L = clip(eta * B_hat, L*, hi)``).
It keeps CAAC's choice whenever the model calls it near-optimal and no shallower than
the optimum, and otherwise pulls it there — the PID alone targets an acceptance level
and ignores how expensive a round trip is. The model prices the *current* draft latency
``tau_f``, so under a slowdown ``L*`` and the band themselves move to the depths that
are rate-optimal at the slower speed, and the gate only chooses within them (down to
``L*`` while ``ESR > 0``): a sustained slowdown cannot drive the depth below the
optimum for the ~20-30 rounds the baseline ``tau_s`` needs to catch up (RAPID's gate
applied after a band priced at ``tau_s`` can: with ``eta ~0.2`` after a 3x step it cuts
depth 8 to 2). The band's shallow end is not used: with correlated acceptance (the
Qwen2.5-Coder pair on HumanEval: most blocks fully accepted) the rates of depths 2..8
lie within a few % in the model, so the band is wide, and its shallow end is where the
estimates' errors cost most (a round trip of ~0.2 s paid for 3-4 tokens); gate and PID
pulled the depth there, measured: depth 2-3 at full acceptance for 10+ rounds, CAAC
0.81-0.84x of fixed depth 5 under the 3x slowdown.

RAPID's constants are not public; the defaults below are our starting points.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from edge_sdk.control import analytic
from edge_sdk.control.base import L_MAX, DepthController, PlanContext, RoundRecord


@dataclass
class CAACParams:
    """CAAC constants (EWMA weights are the weight of the *new* sample, per round).

    l_max: 8 tokens (RAPID). l_init: 4 tokens, ``B_hat`` and the PID's bias before any
        feedback (the SDK's default fixed depth).
    w_fast = 0.5: fast latency EWMA, reacts within ~2 rounds. w_slow = 0.05: baseline,
        ~20-round memory, so a step slowdown shows as ESR > 0 for ~tens of rounds and the
        baseline then re-adapts to the new normal.
    esr_deadband = 0.15: slowdowns under 15 % of the baseline are treated as timing noise
        (the per-token draft time of one round varies by ~10-20 % on a shared CPU).
    k_eta = 2: ``eta = 1/(1 + 2 ESR)``; a 2x slowdown step gives ESR ~0.43 after one
        round (eta ~0.54), i.e. about half the depth.
    w_acc = 0.3: acceptance EWMA (a block's accepted/drafted ratio is noisy).
    a_target = 0.6: acceptance set point. With i.i.d. acceptance alpha the per-block
        ratio falls with depth, so the loop settles where ratio(L) = 0.6: L~4 for
        alpha=0.8, L=8 for alpha>=0.9, L=1 for alpha<=0.6.
    kp = 4, ki = 0.5, kd = 1: tokens of depth per unit of acceptance error (P), per
        round-unit of accumulated error (I), per unit of error change (D). Full
        acceptance (e = +0.4) adds 1.6 tokens at once and ~0.2 per round after.
    w_resp = 0.3: EWMA of send->response seconds (``T_resp``), for the proactive cap;
        also the weight of the response level of the round model (``resp_model``).
    w_off = 0.1: weight of a depth's response offset from that level (slower than the
        level, so the level, not the offsets, follows the cloud's speed over time).
    model_check = True, model_tol = 0.05 (keep depths within 5 % of the model's best
        rate), model_warmup = 3 rounds before the model is trusted, pos_prior = 1
        (pseudo-trials of a position's h_k at the estimate of the position before it:
        a position no longer tried drifts back to its predecessor's rate as its
        discounted trials fade, instead of keeping a stale low estimate that keeps the
        depth below it — a hard trial threshold did, for tens of rounds), w_alpha = 0.1
        (discount of the alpha estimate's success/trial counts per round: ~10-round
        memory, ~40 trials at L~4; also of the weights of the response offsets' line).
    """

    l_max: int = L_MAX
    l_init: float = 4.0
    w_fast: float = 0.5
    w_slow: float = 0.05
    k_eta: float = 2.0
    esr_deadband: float = 0.15
    w_acc: float = 0.3
    a_target: float = 0.6
    kp: float = 4.0
    ki: float = 0.5
    kd: float = 1.0
    w_resp: float = 0.3
    w_off: float = 0.1
    model_check: bool = True
    model_tol: float = 0.05
    model_warmup: int = 3
    pos_prior: float = 1.0
    w_alpha: float = 0.1


class CAAC(DepthController):
    """RAPID's congestion-aware adaptive controller (see module docstring).

    Keyword arguments override :class:`CAACParams` fields (e.g. ``CAAC(a_target=0.7)``).
    """

    name = "caac"

    def __init__(self, params: CAACParams | None = None, **kw):
        p = params or CAACParams()
        if kw:
            p = CAACParams(**{**asdict(p), **kw})
        super().__init__(p.l_max)
        self.p = p
        self.tau_f: float | None = None     # fast EWMA of per-token draft latency (s)
        self.tau_s: float | None = None     # slow baseline EWMA (s)
        self.t_resp: float | None = None    # EWMA of send->response time (s)
        self.t_edge: float = 0.0            # EWMA of edge per-round overhead (s)
        self.A = p.a_target                 # acceptance EWMA, neutral start (e = 0)
        self.integral = 0.0
        self.e_prev: float | None = None
        self.B_hat = float(min(max(p.l_init, 1.0), p.l_max))
        self.rounds = 0
        # discounted alpha estimate and the T_resp(L) model (level + per-depth offsets)
        self._succ = self._trials = 0.0
        self._pos_succ = [0.0] * (p.l_max + 1)      # index k: position k (1-based)
        self._pos_trials = [0.0] * (p.l_max + 1)
        self._lvl: float | None = None              # response level (s), see resp_model
        self._off = [0.0] * (p.l_max + 1)           # index L: offset of depth L (s)
        self._off_w = [0.0] * (p.l_max + 1)         # discounted observations of depth L
        self.last: dict = {}

    # ------------------------------------------------------------------ physical path

    @property
    def esr(self) -> float:
        """Excess slowdown ratio ``max(0, tau_f / tau_s - 1 - esr_deadband)``."""
        if not self.tau_f or not self.tau_s:
            return 0.0
        return max(0.0, self.tau_f / self.tau_s - 1.0 - self.p.esr_deadband)

    @property
    def eta(self) -> float:
        """Slowdown gate in (0, 1]."""
        return 1.0 / (1.0 + self.p.k_eta * self.esr)

    # ------------------------------------------------------------------ model check

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance estimate (discounted successes / trials), or None."""
        return None if self._trials <= 0 else min(self._succ / self._trials, 0.999)

    def position_acceptance(self) -> list[float] | None:
        """``[h_1, ..., h_Lmax]``: per-position conditional acceptance estimates (see the
        module docstring), or None before any block was verified."""
        a = self.alpha
        if a is None:
            return None
        out, prev, m = [], a, self.p.pos_prior
        for k in range(1, self.l_max + 1):
            prev = min((self._pos_succ[k] + m * prev) / (self._pos_trials[k] + m), 0.999)
            out.append(prev)
        return out

    def resp_model(self, L: int) -> float:
        """Predicted send->response seconds for a block of depth L: the current level
        plus depth L's learned offset (a CPU target's pass time is not monotone in the
        block length: measured on SmolLM2 fp32, 1 thread, a 4-token pass is faster than
        a 3-token one); a depth never observed gets the offset of a non-negative line
        fitted (weighted) through the observed depths' offsets.

        Level and offsets (``r = level + off[L]``, both moved by each response's
        prediction error, the level at ``w_resp``, the observed depth's offset at the
        slower ``w_off``) keep the cloud's speed drifting over time out of the depth
        comparison. Raw per-depth means and a slope fitted on raw ``(L, resp_s)`` pairs
        did not: a depth last used while the cloud was slower kept looking expensive,
        so the band locked onto the depths used recently (measured: depths 2-3 at full
        acceptance for 10+ rounds where fixed depth 5 was 20 % faster)."""
        if self._lvl is None:
            return self.t_resp or 0.0
        if 0 <= L < len(self._off) and self._off_w[L] > 0:
            return max(0.0, self._lvl + self._off[L])
        seen = [(d, w, self._off[d]) for d, w in enumerate(self._off_w) if w > 0]
        W = sum(w for _, w, _ in seen)
        if W <= 0:
            return max(0.0, self._lvl)
        md = sum(w * d for d, w, _ in seen) / W
        mo = sum(w * o for _, w, o in seen) / W
        var = sum(w * (d - md) ** 2 for d, w, _ in seen) / W
        cov = sum(w * (d - md) * (o - mo) for d, w, o in seen) / W
        slope = max(0.0, cov / var) if var > 0.25 else 0.0
        return max(0.0, self._lvl + mo + slope * (L - md))

    def model_rates(self) -> list[float] | None:
        """Predicted committed tokens per second of depths 1..L_max (the round model at
        the current draft latency ``tau_f``), or None while not warmed up."""
        p = self.p
        if (not p.model_check or self.rounds < p.model_warmup or self.alpha is None
                or not self.tau_s or self.t_resp is None):
            return None
        h = self.position_acceptance()
        return [analytic.round_rate(h, L, self.tau_f, self.resp_model(L) + self.t_edge)
                for L in range(1, self.l_max + 1)]

    def model_band(self) -> tuple[int, int] | None:
        """Near-optimal depth interval of the round model, or None while not warmed up."""
        rates = self.model_rates()
        if rates is None:
            return None
        top = max(rates)
        ok = [i + 1 for i, r in enumerate(rates) if r >= (1.0 - self.p.model_tol) * top]
        return ok[0], ok[-1]

    def model_best(self) -> int | None:
        """The round model's rate-optimal depth (ties: the smaller), or None."""
        rates = self.model_rates()
        return None if rates is None else 1 + max(range(len(rates)), key=rates.__getitem__)

    # ------------------------------------------------------------------ policy

    def next_depth(self, stats: PlanContext | None = None) -> int:
        stats = stats or PlanContext()
        B = self.eta * self.B_hat
        band = self.model_band()
        if band is not None:
            # not below the model's optimum: the shallow end of a flat band is where a
            # round trip is paid for the fewest tokens (see the module docstring)
            B = min(max(B, self.model_best()), band[1])
        L = self.clamp(round(B))
        cap = None
        if stats.proactive and self.tau_f and (stats.delay_s or self.t_resp):
            t_resp = stats.delay_s if stats.delay_s is not None else self.t_resp
            cap = max(1, math.floor(t_resp / self.tau_f))
            L = min(L, cap)
        self.last = {"L": L, "B_hat": self.B_hat, "B": B, "eta": self.eta, "esr": self.esr,
                     "A": self.A, "band": band, "cap": cap}
        return L

    def update(self, rnd: RoundRecord) -> None:
        p = self.p
        if rnd.draft_s_per_token is not None and rnd.draft_s_per_token > 0:
            tau = float(rnd.draft_s_per_token)
            if self.tau_f is None:
                self.tau_f = self.tau_s = tau          # seeded by the first measurement
            else:
                self.tau_f += p.w_fast * (tau - self.tau_f)
                self.tau_s += p.w_slow * (tau - self.tau_s)
        if (rnd.round_s is not None and rnd.resp_s is not None
                and rnd.draft_s_per_token is not None):
            work = rnd.resp_s + rnd.depth * rnd.draft_s_per_token
            over = max(0.0, rnd.round_s - work)
            if over <= work:        # longer than the round's own work: a one-off stall
                self.t_edge += p.w_resp * (over - self.t_edge)
        if rnd.resp_s is not None and rnd.resp_s >= 0:
            r = float(rnd.resp_s)
            self.t_resp = r if self.t_resp is None else self.t_resp + p.w_resp * (r - self.t_resp)
            if 0 <= rnd.depth < len(self._off):
                d = rnd.depth
                if self._lvl is None:
                    self._lvl = r
                else:
                    e = r - self.resp_model(d)
                    if self._off_w[d] <= 0:     # first sighting: start from the fit
                        self._off[d] = self.resp_model(d) - self._lvl
                    self._lvl += p.w_resp * e
                    self._off[d] += p.w_off * e
                lam = 1.0 - p.w_alpha
                self._off_w = [w * lam for w in self._off_w]
                self._off_w[d] += 1.0
        if rnd.depth <= 0:
            return                              # plain target step: no acceptance signal
        self.rounds += 1
        a, g = int(rnd.accepted), int(rnd.depth)
        lam = 1.0 - p.w_alpha
        self._succ = lam * self._succ + a
        self._trials = lam * self._trials + a + (1 if a < g else 0)
        for k in range(1, self.l_max + 1):      # position k was tried iff k <= min(a+1, g)
            self._pos_succ[k] *= lam
            self._pos_trials[k] *= lam
            if k <= min(a + 1, g):
                self._pos_trials[k] += 1
                self._pos_succ[k] += 1 if k <= a else 0
        self.A += p.w_acc * (a / g - self.A)
        self._pid(self.A - p.a_target)

    def _pid(self, e: float) -> None:
        """Positional PID ``B = l_init + kp e + ki I + kd de`` with back-calculation
        anti-windup: when B would leave [1, L_max] the integral is reset so that B sits
        exactly on the bound (no wind-up, immediate recovery when e changes sign)."""
        p = self.p
        de = 0.0 if self.e_prev is None else e - self.e_prev
        self.e_prev = e
        integral = self.integral + e
        u = p.l_init + p.kp * e + p.ki * integral + p.kd * de
        lo, hi = 1.0, float(self.l_max)
        if u > hi or u < lo:
            bound = hi if u > hi else lo
            if p.ki > 0:
                integral = (bound - p.l_init - p.kp * e - p.kd * de) / p.ki
            u = bound
        self.integral = integral
        self.B_hat = u

    def state(self) -> dict:
        return {"L": self.last.get("L"), "B_hat": self.B_hat, "eta": self.eta, "esr": self.esr,
                "A": self.A, "tau_f": self.tau_f, "tau_s": self.tau_s, "t_resp": self.t_resp,
                "alpha": self.alpha, "band": self.model_band()}
