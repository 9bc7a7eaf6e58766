"""CATS decoding on the budgeted local target: greedy output is the target's token for
token over rounds with partial acceptance (CASES.md 1, 7, 11), a block without drafts
samples exactly what the target alone does seed by seed, and sampled output follows
the target's distribution (CASES.md 3-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_model
from edge_sdk.exit_head import untrained_head
from edge_sdk.local_target.cats import CatsDecoder, _prefill, decode_ar
from edge_sdk.local_target.load import fit_local_head
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.storage import Storage
from edge_sdk.protocol import sampling as S
from test_e2e_distribution import pvalue

PROMPT = [3, 5, 7, 9]
SAMPLINGS = [S.SamplingConfig(temperature=1.0),
             S.SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.3)]
"""The distribution tests' samplings: plain, and with every processor."""
P8 = [3, 5, 1, 2]


def _target(tmp_path, model, R):
    path = tmp_path / "m.safetensors"
    if not path.exists():
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return OffloadedTarget(Storage(path), model.config, R)


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=4, seed=3)


def _tuned(t, layer, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(2, 64, (24,), generator=g).tolist() for _ in range(n)]
    return fit_local_head(t, seqs, layer, None)


def test_greedy_identity_with_partial_acceptance(tmp_path, model):
    t = _target(tmp_path, model, R=2)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                         eos_token_id=None)[0, len(PROMPT):].tolist()
    ar, _ = decode_ar(t, PROMPT, 40, S.SamplingConfig())
    assert ar == ref
    heads = [untrained_head(t.model, 1), _tuned(t, 2)]
    partial = hits = 0
    for head in heads:
        for depth, width in ((1, 1), (3, 1), (8, 1), (1, 8), (3, 4)):
            dec = CatsDecoder(t, head, depth, width=width)
            toks, st = dec.generate(PROMPT, 40, S.SamplingConfig())
            assert toks == ref, (head.name, depth, width)
            hits += st.sibling_hits
            assert st.committed == 40 and st.rounds < 40 + 1
            partial += sum(0 < a < depth for a in st.accepted_per_round)
            assert all(t.cache_len(i) == len(PROMPT) + 40 - 1 for i in range(4))
    assert partial > 0          # some rounds accepted part of their block
    assert hits > 0             # and some took a sibling of the first draft token


def test_resident_kv_is_reused_not_recomputed(tmp_path, model):
    """The draft writes layers 0..E-1; the verification pass runs layers E.. only, on
    the draft's stored residual streams (same positions): every layer ends at the
    confirmed length minus one, the streamed layers once per round."""
    t = _target(tmp_path, model, R=2)
    dec = CatsDecoder(t, _tuned(t, 2), 4)
    n0 = t.streamed_passes
    _, st = dec.generate(PROMPT, 24, S.SamplingConfig())
    assert t.streamed_passes - n0 == st.rounds + 1          # + the prefill
    with pytest.raises(ValueError, match="not resident"):
        CatsDecoder(t, untrained_head(t.model, 3), 4)


def test_a_block_without_drafts_samples_what_the_target_alone_does(tmp_path, model):
    t = _target(tmp_path, model, R=2)
    cfg = S.SamplingConfig(temperature=0.9, top_k=20)
    assert_zero_draft_rounds_match_ar(t, CatsDecoder(t, untrained_head(t.model, 2), 1), cfg)


def assert_zero_draft_rounds_match_ar(t, dec, cfg, prompt=PROMPT, n=6, seeds=range(5)):
    """Rounds of zero drafts draw exactly what target-alone sampling draws (shared by the
    exit-head and layer-skip draft tests)."""
    for seed in seeds:
        ar, _ = decode_ar(t, prompt, n, cfg, seed=seed)
        ids = list(prompt)
        _prefill(t, ids)
        for _ in range(n):
            new, g, a = dec.round(ids, 0, cfg, seed)
            ids += new
            t.crop(len(ids) - 1)
        assert ids[len(prompt):] == ar


def _exact_pairs(model, cfg, V):
    """The target's exact distribution of the first two tokens after P8 [V*V]."""
    with torch.inference_mode():
        l1 = model(torch.tensor([P8])).logits[0, -1]
        l2 = model(torch.tensor([P8 + [a] for a in range(V)])).logits[:, -1]
    seen1 = torch.zeros(V, dtype=torch.bool)
    seen1[P8] = True
    seen2 = seen1.expand(V, V).clone()
    seen2[torch.arange(V), torch.arange(V)] = True
    p1, p2 = S.probs_from_logits(l1, cfg, seen1), S.probs_from_logits(l2, cfg, seen2)
    return (p1[:, None] * p2).reshape(-1).numpy()


@pytest.mark.parametrize("cfg", SAMPLINGS, ids=["plain", "processors"])
def test_sampled_pairs_follow_the_target_distribution(tmp_path, cfg):
    V = 8
    model = tiny_model(vocab=V, layers=3, seed=5)
    t = _target(tmp_path, model, R=2)
    dec = CatsDecoder(t, untrained_head(t.model, 1), 2)     # a weak draft: rejections
    assert_pairs_follow_the_target(dec, model, cfg, V)


def assert_cache_is_a_fresh_prefill(t, ref, ids, rtol=1e-4, atol=1e-4):
    """Every layer of ``t``'s cache holds the keys/values a fresh full prefill of
    ``ids[:-1]`` on ``ref`` (the same model, all layers resident) computes (shared by the
    layer-skip and quantized draft tests)."""
    _prefill(ref, ids)
    for a, b in zip(t.cache.layers, ref.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=rtol, atol=atol)
        torch.testing.assert_close(a.values, b.values, rtol=rtol, atol=atol)


def assert_pairs_follow_the_target(dec, model, cfg, V, n=1500):
    """The first two tokens after P8 over ``n`` seeds follow the target's exact pair
    distribution (chi-square), with rejections along the way (shared by the exit-head
    and layer-skip draft tests)."""
    counts, drafted, accepted = np.zeros(V * V), 0, 0
    for seed in range(n):
        toks, st = dec.generate(P8, 2, cfg, seed=seed)
        counts[toks[0] * V + toks[1]] += 1
        drafted, accepted = drafted + st.drafted, accepted + st.accepted
    assert 0 < accepted < drafted
    assert pvalue(counts, _exact_pairs(model, cfg, V)) > 1e-3
