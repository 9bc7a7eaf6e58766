"""Distribution exactness at the sampling-math level (vectorised, >= 50,000 draws).

A two-position "model" given by logit tables: target p1 [V], P2[a] [V] (second position
after first token a) and draft q1, Q2 the same way, all shaped by the shared processors.
Speculative sampling with a depth-2 block (plus a fresh block after an early rejection)
must reproduce P(a, b) = p1(a) P2[a](b) exactly, whichever correction stage draws the
residual. A chi-square test (p > 0.01) cannot tell them apart; the same test rejects
(p < 1e-6) a sampler whose q on the wire is not the q it sampled from (CASES 3-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from edge_sdk import correction as C
from edge_sdk.protocol import sampling as S
from edge_sdk.protocol.sampling import SamplingConfig

V, N = 16, 50_000
PROMPT = torch.tensor([3, 5])
SETTINGS = {
    "t0.7": SamplingConfig(temperature=0.7),
    "t1.0": SamplingConfig(temperature=1.0),
    "topk4": SamplingConfig(temperature=1.0, top_k=4),
    "topp0.8": SamplingConfig(temperature=0.8, top_p=0.8),
    "t1.0-rep1.3": SamplingConfig(temperature=1.0, repetition_penalty=1.3),
}


def raw_logits(seed: int, scale: float = 1.5):
    """Random logits: first position [V] and second position after token a [V, V]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale, torch.randn(V, V, generator=g) * scale


def tables(l1, l2, cfg: SamplingConfig):
    """Processed distributions p1 [V] and P2 [V, V] (row a: after first token a; the
    repetition penalty sees the prompt and a)."""
    seen1 = S.presence_mask(PROMPT, torch.zeros(0, dtype=torch.long), V)[0]
    seen2 = torch.stack([S.presence_mask(PROMPT, torch.tensor([a]), V)[1] for a in range(V)])
    return S.probs_from_logits(l1, cfg, seen1), S.probs_from_logits(l2, cfg, seen2)


def model_pair(cfg, seed=0):
    """Target (p1, P2) and a draft (q1, Q2) whose logits are the target's plus noise,
    both shaped by the same processors."""
    l1, l2 = raw_logits(seed)
    n1, n2 = raw_logits(seed + 100)
    return (*tables(l1, l2, cfg), *tables(0.8 * l1 + 0.6 * n1, 0.8 * l2 + 0.6 * n2, cfg))


def correction(stage: str, p, q, gen, k: int):
    """Vectorised correction through the shared edge functions."""
    if stage == "bounded":
        ids, sp = S.top_support(p, k)
        tok, eps = C.try_bounded(ids, sp, S.support_is_complete(p, k), q, 0.0, gen)
        assert float(eps.max()) == 0.0
    elif stage == "proposal":
        ids = S.sample(p.unsqueeze(1).expand(-1, 4, -1), gen)
        tok = C.try_proposals(ids, p.gather(-1, ids), q, gen)
    else:
        tok = torch.full(p.shape[:-1], -1, dtype=torch.long)
    fallback = C.full_residual(p, q, gen)
    return torch.where(tok >= 0, tok, fallback)


def speculative_pairs(p1, P2, q1, Q2, stage, seed, k=V, q_report=None):
    """Draw N first-2-token outputs by speculative sampling (depth-2 blocks).

    ``q_report`` (optional) replaces the q values sent to the verifier: a broken
    sampler whose wire q differs from the q it sampled from.
    """
    gen = torch.Generator().manual_seed(seed)
    qr1, QR2 = q_report if q_report is not None else (q1, Q2)
    d1 = S.sample(q1.expand(N, V), gen)
    d2 = S.sample(Q2[d1], gen)
    u = torch.rand(N, 3, generator=gen, dtype=torch.float64)
    acc1 = S.accept(p1[d1], qr1[d1], u[:, 0])
    acc2 = S.accept(P2[d1, d2], QR2[d1, d2], u[:, 1])
    c1 = correction(stage, p1.expand(N, V), qr1.expand(N, V), gen, k)
    t1 = torch.where(acc1, d1, c1)
    c2 = correction(stage, P2[d1], QR2[d1], gen, k)
    # after an early rejection the next block starts from [c1]: draft e ~ Q2[c1]
    e = S.sample(Q2[c1], gen)
    acc3 = S.accept(P2[c1, e], QR2[c1, e], u[:, 2])
    c3 = correction(stage, P2[c1], QR2[c1], gen, k)
    t2 = torch.where(acc1, torch.where(acc2, d2, c2), torch.where(acc3, e, c3))
    return t1, t2


def chi2_pvalue(t1, t2, p1, P2) -> float:
    counts = np.bincount((t1 * V + t2).numpy(), minlength=V * V).astype(float)
    expected = (p1.unsqueeze(1) * P2).reshape(-1).numpy() * N
    if counts[expected == 0].sum() > 0:
        return 0.0  # drew a pair the target can never produce
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("stage", ["bounded", "proposal", "full"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_matches_target_distribution(name, stage):
    cfg = SETTINGS[name]
    p1, P2, q1, Q2 = model_pair(cfg)
    k = cfg.top_k if (stage == "bounded" and cfg.top_k) else V  # S covers supp(p)
    t1, t2 = speculative_pairs(p1, P2, q1, Q2, stage, seed=1, k=k)
    assert chi2_pvalue(t1, t2, p1, P2) > 0.01


@pytest.mark.parametrize("stage", ["bounded", "proposal", "full"])
def test_a_draft_over_part_of_the_vocabulary_keeps_the_distribution(stage):
    """A draft whose LM head keeps 10 of the 16 tokens (FR-Spec's subset head: -inf
    logits elsewhere, so q = 0 there) still gives the target's distribution: the
    correction draws the tokens the draft cannot propose."""
    cfg = SETTINGS["t1.0"]
    l1, l2 = raw_logits(0)
    n1, n2 = raw_logits(100)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[torch.randperm(V, generator=torch.Generator().manual_seed(5))[:10]] = True
    p1, P2 = tables(l1, l2, cfg)
    q1, Q2 = tables(torch.where(keep, 0.8 * l1 + 0.6 * n1, float("-inf")),
                    torch.where(keep, 0.8 * l2 + 0.6 * n2, float("-inf")), cfg)
    assert float(q1[~keep].sum()) == 0.0 and float(Q2[:, ~keep].sum()) == 0.0
    t1, t2 = speculative_pairs(p1, P2, q1, Q2, stage, seed=1)
    assert chi2_pvalue(t1, t2, p1, P2) > 0.01


@pytest.mark.parametrize("name", ["t0.7", "topk4"])
def test_chi_square_detects_wrong_q(name):
    """Power: a draft that samples at one temperature but reports q at another (the
    CASES 3/4 bug) is caught by the very same test."""
    cfg = SETTINGS[name]
    p1, P2, q1, Q2 = model_pair(cfg)
    hot = SamplingConfig(temperature=cfg.temperature * 1.6, top_k=cfg.top_k)
    wrong = (S.probs_from_logits(torch.log(q1.clamp_min(1e-30)), hot),
             S.probs_from_logits(torch.log(Q2.clamp_min(1e-30)), hot))
    t1, t2 = speculative_pairs(p1, P2, q1, Q2, "full", seed=1, q_report=wrong)
    assert chi2_pvalue(t1, t2, p1, P2) < 1e-6


def test_chi_square_detects_unprocessed_target():
    """Power: verifying against p *without* top-k (CASES 5) drifts detectably."""
    cfg = SETTINGS["topk4"]
    p1, P2, q1, Q2 = model_pair(cfg)
    raw1, rawP2 = tables(*raw_logits(0), SamplingConfig(temperature=1.0))
    t1, t2 = speculative_pairs(raw1, rawP2, q1, Q2, "full", seed=1)
    assert chi2_pvalue(t1, t2, p1, P2) < 1e-6


def test_certificate_bounds_residual_tv():
    """eps_K from the shared certificate bounds TV(restricted residual, exact residual)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = torch.softmax(torch.randn(64, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(64, generator=g, dtype=torch.float64) * 2, -1)
        k = int(torch.randint(1, 64, (1,), generator=g))
        ids, sp = S.top_support(p, k)
        eps, z_s, r_s = S.support_certificate(ids, sp, q, S.support_is_complete(p, k))
        if z_s <= 0:
            assert eps == 1.0
            continue
        exact = S.residual(p, q)
        exact = exact / exact.sum()
        approx = torch.zeros_like(p).index_put_((ids,), r_s / r_s.sum())
        tv = 0.5 * float((exact - approx).abs().sum())
        assert tv <= float(eps) + 1e-12


def test_certificate_is_zero_only_when_support_covers_p():
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    p1, _, q1, _ = model_pair(cfg)
    ids, sp = S.top_support(p1, 4)
    assert float(S.support_certificate(ids, sp, q1, S.support_is_complete(p1, 4))[0]) == 0.0
    ids, sp = S.top_support(p1, 3)
    assert not bool(S.support_is_complete(p1, 3))
    assert float(S.support_certificate(ids, sp, q1, False)[0]) > 0.0


def test_bounded_with_budget_spends_at_most_budget():
    """eps_req > 0: bounded corrections are taken while the certificate fits, the spend
    never exceeds the budget, and the output TV stays within it (analytically)."""
    g = torch.Generator().manual_seed(3)
    budget = 0.05
    spent, used = 0.0, 0
    for _ in range(300):
        p = torch.softmax(torch.randn(64, generator=g, dtype=torch.float64) * 3, -1)
        q = torch.softmax(torch.randn(64, generator=g, dtype=torch.float64) * 3, -1)
        ids, sp = S.top_support(p, 24)
        tok, eps = C.try_bounded(ids, sp, S.support_is_complete(p, 24), q, budget - spent, g)
        if tok >= 0:
            used += 1
            spent += float(eps)
    assert used > 0 and spent <= budget


def test_processors_match_transformers_warpers():
    """Our top-k / top-p / temperature / repetition penalty equal transformers'."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g, dtype=torch.float64) * 3
    prefix = torch.tensor([[1, 7, 7, 9]])
    cfg = SamplingConfig(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(prefix, logits.clone())
    ref = TemperatureLogitsWarper(0.7)(prefix, ref)
    ref = TopKLogitsWarper(10)(prefix, ref)
    ref = TopPLogitsWarper(0.8)(prefix, ref)
    seen = S.presence_mask(prefix[0], torch.zeros(0, dtype=torch.long), 50)[:1]
    ours = S.process_logits(logits, cfg, seen)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    assert torch.allclose(ours[fin], ref[fin])


def test_sample_never_draws_zero_mass_and_is_exact():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75], dtype=torch.float64)
    draws = S.sample(p.expand(40_000, 4), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    assert chisquare(counts[[1, 3]].numpy(), [10_000, 30_000]).pvalue > 0.01


def test_greedy_rule_ties_take_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    assert S.greedy_verify(torch.tensor([1]), logits) == (1, 0)
    assert S.greedy_verify(torch.tensor([2]), logits) == (0, 1)
