"""N-gram / prompt-lookup drafter: proposals, one-hot q through the shared sampling path,
exactness of the acceptance rule with one-hot q (vectorised, math level), and the edge
client end to end (greedy identity, in-process distribution)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_api.service import CloudService
from cloud_api.inprocess import InProcessTransport
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.ngram import NgramDrafter, NgramIndex
from edge_sdk.drafters.torch import TorchDrafter
from tests.conftest import tiny_model, tiny_tokenizer
from tests.test_distribution import V, chi2_pvalue, model_pair, speculative_pairs

CFGS = [SamplingConfig(), SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.0, top_k=3),
        SamplingConfig(temperature=0.8, top_p=0.5),
        SamplingConfig(temperature=1.0, repetition_penalty=1.3)]


# ----------------------------------------------------------------------------- lookup

def brute_lookup(ids, n_max, n_min):
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        suffix = ids[-n:]
        for j in range(len(ids) - n - 1, -1, -1):
            if ids[j:j + n] == suffix:
                return ids[j + n]
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1,
                max_size=6), st.integers(1, 4))
def test_index_matches_brute_force_after_rollbacks(contexts, n_max):
    """Incremental index + undo log == brute-force most-recent longest match, whatever
    sequence of (diverging) contexts it is synced to."""
    idx = NgramIndex(n_max=n_max)
    for ctx in contexts:
        idx.sync(ctx)
        assert idx.ids == ctx
        assert idx.lookup() == brute_lookup(ctx, n_max, 1)
        fresh = NgramIndex(n_max=n_max)
        fresh.sync(ctx)
        assert fresh.last == idx.last


def test_proposals_on_repetitive_text():
    d = NgramDrafter(16)
    ctx = [2, 3, 4, 5, 6, 2, 3]
    b = d.propose(ctx, 6, SamplingConfig())
    assert b.tokens == [4, 5, 6, 2, 3, 4]          # copies the loop
    assert b.q is None and b.q_tok.tolist() == [1.0] * 6
    # the most recent, longest match wins: "9 2 3" -> 8, not "2 3" -> 4
    assert d.propose([2, 3, 4, 9, 2, 3, 8, 1, 9, 2, 3], 1, SamplingConfig()).tokens == [8]


def test_no_match_gives_an_empty_block():
    """Depth 0 when nothing matches. (Once a lookup matches, the chain copies the earlier
    occurrence, which then continues into the copy itself, so alone the drafter returns
    either an empty or a full block.)"""
    d = NgramDrafter(16)
    b = d.propose([1, 2, 3], 4, SamplingConfig(temperature=1.0))
    assert len(b) == 0 and b.q.shape == (0, 16) and b.q_tok.shape == (0,)
    assert len(d.propose([1, 2, 3], 4, SamplingConfig())) == 0
    assert d.propose([7, 8, 9, 7], 8, SamplingConfig()).tokens == [8, 9, 7, 8, 9, 7, 8, 9]
    d2 = NgramDrafter(16, n_min=2)
    assert len(d2.propose([7, 8, 1, 8], 5, SamplingConfig())) == 0     # only "8" repeats


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: str(c.to_dict()))
def test_one_hot_q_through_shared_processors(cfg):
    """Every processor keeps a lookup row one-hot: q(d) = 1.0 exactly, float64 [V]."""
    d = NgramDrafter(16)
    b = d.propose([2, 3, 4, 5, 2, 3], 4, cfg, torch.Generator().manual_seed(0))
    assert b.tokens == [4, 5, 2, 3]
    assert b.q_tok.dtype == torch.float64 and b.q_tok.tolist() == [1.0] * 4
    if cfg.greedy:
        assert b.q is None
    else:
        assert b.q.dtype == torch.float64 and b.q.shape == (4, 16)
        assert torch.equal(b.q, torch.nn.functional.one_hot(torch.tensor(b.tokens), 16).double())


def test_mixed_with_model_drafter(target):
    """With a base drafter: lookup tokens where the lookup matches (one-hot rows), the
    model's sampled draft elsewhere; ``model_first`` makes the lookup extend a model
    draft."""
    cfg = SamplingConfig(temperature=1.0)
    base = TorchDrafter(tiny_model(seed=3))
    d = NgramDrafter(base=base)
    ctx = [5, 6, 7, 8, 5, 6]
    b = d.propose(ctx, 4, cfg, torch.Generator().manual_seed(1))
    assert len(b) == 4 and b.tokens[:2] == [7, 8]
    onehot = (b.q == 1.0).any(-1)
    assert onehot[:2].all()
    assert torch.allclose(b.q.sum(-1), torch.ones(4, dtype=torch.float64))
    d2 = NgramDrafter(base=base.fork(), model_first=2)
    b2 = d2.propose(ctx, 4, cfg, torch.Generator().manual_seed(1))
    assert len(b2) == 4 and d2.stats is not None
    assert not (b2.q[:2] == 1.0).any(-1).all()     # model rows first
    f = d.fork()
    assert isinstance(f, NgramDrafter) and f.base is not base and f.index is not d.index


# ----------------------------------------------------------------------------- math level

def one_hot_tables(seed: int):
    """Deterministic lookup-style draft: first token t1, second token D2[a] after a."""
    g = torch.Generator().manual_seed(seed)
    t1 = int(torch.randint(V, (1,), generator=g))
    d2 = torch.randint(V, (V,), generator=g)
    q1 = torch.nn.functional.one_hot(torch.tensor(t1), V).double()
    Q2 = torch.nn.functional.one_hot(d2, V).double()
    return q1, Q2


@pytest.mark.parametrize("stage", ["bounded", "proposal", "full"])
@pytest.mark.parametrize("cfg", CFGS[1:], ids=lambda c: str(c.to_dict()))
def test_one_hot_q_is_exact_vectorised(cfg, stage):
    """Speculative sampling with one-hot q (accept w.p. p(d); residual = p without d)
    reproduces the target's first-2-token distribution (50,000 draws, chi-square)."""
    p1, P2, _, _ = model_pair(cfg)
    q1, Q2 = one_hot_tables(seed=7)
    k = cfg.top_k if (stage == "bounded" and cfg.top_k) else V
    t1, t2 = speculative_pairs(p1, P2, q1, Q2, stage, seed=3, k=k)
    assert chi2_pvalue(t1, t2, p1, P2) > 0.01


def test_one_hot_then_model_q_is_exact():
    """A block mixing a lookup position (one-hot) and a model position (soft q)."""
    cfg = SamplingConfig(temperature=1.0)
    p1, P2, _, Q2 = model_pair(cfg)
    q1, _ = one_hot_tables(seed=11)
    t1, t2 = speculative_pairs(p1, P2, q1, Q2, "full", seed=5)
    assert chi2_pvalue(t1, t2, p1, P2) > 0.01


def test_one_hot_acceptance_rate_is_p_of_d():
    """Power check of the rule itself: with one-hot q the first draft is accepted with
    probability p(d) (not min(1, p/q) with some other q)."""
    cfg = SamplingConfig(temperature=1.0)
    p1, P2, _, _ = model_pair(cfg)
    q1, Q2 = one_hot_tables(seed=7)
    t1, _ = speculative_pairs(p1, P2, q1, Q2, "full", seed=9)
    d = int(q1.argmax())
    rate = float((t1 == d).double().mean())
    assert abs(rate - float(p1[d])) < 4 * (float(p1[d]) * (1 - float(p1[d])) / len(t1)) ** .5 + 1e-9


# ----------------------------------------------------------------------------- end to end

REPETITIVE = [5, 9, 11, 5, 9, 11, 5, 9]


def _client(svc, drafter, tok, **kw):
    return EdgeClient("inproc://", drafter, tok, chat=False, transport=InProcessTransport(svc),
                      **kw)


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("with_base", [False, True])
def test_ngram_greedy_identity(target, tok, draft, depth, with_base):
    svc = CloudService(target, tok)
    drafter = NgramDrafter(base=TorchDrafter(draft)) if with_base else NgramDrafter(64)

    async def main():
        async with _client(svc, None, tok) as c:
            ref = await c.generate(prompt_ids=REPETITIVE, max_new_tokens=40)
        async with _client(svc, drafter, tok, depth=depth) as c:
            out = await c.generate(prompt_ids=REPETITIVE, max_new_tokens=40)
        return ref, out

    ref, out = asyncio.run(main())
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert out.metrics["drafted_tokens"] > 0


def test_ngram_plain_target_steps_when_nothing_matches(target, tok):
    """No match anywhere: every round is a depth-0 target step, output unchanged."""
    svc = CloudService(target, tok)

    async def main():
        async with _client(svc, None, tok) as c:
            ref = await c.generate(prompt_ids=[2, 3, 4], max_new_tokens=3)
        async with _client(svc, NgramDrafter(64, n_min=3), tok, depth=4) as c:
            out = await c.generate(prompt_ids=[2, 3, 4], max_new_tokens=3)
        return ref, out

    ref, out = asyncio.run(main())
    assert out.token_ids == ref.token_ids
    assert out.metrics["drafted_tokens"] == 0 and out.metrics["rounds"] == 3


def exact_pairs(model, prompt, cfg):
    from edge_sdk.protocol import sampling as S
    Vm = model.config.vocab_size
    with torch.inference_mode():
        l1 = model(torch.tensor([prompt])).logits[0, -1]
        l2 = model(torch.tensor([prompt + [a] for a in range(Vm)])).logits[:, -1]
    p1 = S.probs_from_logits(l1, cfg)
    return (p1.unsqueeze(1) * S.probs_from_logits(l2, cfg)).reshape(-1).numpy()


def test_ngram_distribution_in_process():
    """800 two-token generations with the lookup drafter (one-hot q on the wire,
    depth 2; rejections drawn by the edge's staged correction): first-2-token
    distribution == the target's (chi-square p > 0.01). Small on purpose: the
    vectorised one-hot tests above carry the statistical weight."""
    from tests.test_e2e_distribution import pvalue

    Vs, prompt, n = 16, [3, 5, 3, 5, 3], 800
    cfg = SamplingConfig(temperature=1.0)
    tk = tiny_tokenizer(Vs)
    tgt = tiny_model(vocab=Vs, seed=0)
    tgt.generation_config.eos_token_id = None
    svc = CloudService(tgt, tk)
    svc.eos = []
    exact = exact_pairs(tgt, prompt, cfg)

    async def main():
        counts = np.zeros(Vs * Vs)
        async with _client(svc, NgramDrafter(Vs), tk, depth=2, support_k=8) as c:
            drafted = 0
            for seed in range(n):
                r = await c.generate(prompt_ids=prompt, sampling=cfg, seed=seed,
                                     max_new_tokens=2)
                counts[r.token_ids[0] * Vs + r.token_ids[1]] += 1
                drafted += r.metrics["drafted_tokens"]
        return counts, drafted

    counts, drafted = asyncio.run(main())
    assert drafted >= n                       # the lookup proposed in every first round
    assert pvalue(counts, exact) > 0.01
