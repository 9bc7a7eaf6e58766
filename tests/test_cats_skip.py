"""CATS with the layer-skipping draft (first R1 + last R2 layers resident, the middle
streamed, or any resident set: the first R1 + a tail that need not be contiguous nor
end at the last layer; :mod:`edge_sdk.local_target.skip`): greedy output is the target's token for
token over rounds with partial acceptance, chain and siblings (CASES.md 1, 11); after
every round every layer's cache holds exactly the target's keys/values of the
confirmed prefix minus its last token, the tail layers' draft-only entries gone
(CASES.md 7); a block without drafts samples what the target alone does; sampled
output follows the target's distribution (CASES.md 3-5)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_model
from edge_sdk.local_target.cats import CatsDecoder, _prefill, decode_ar
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.skip import SkipDraft
from edge_sdk.local_target.storage import Storage
from edge_sdk.protocol import sampling as S
from test_cats import (PROMPT, SAMPLINGS, assert_cache_is_a_fresh_prefill,
                       assert_pairs_follow_the_target, assert_zero_draft_rounds_match_ar)


def _target(tmp_path, model, R, R2, layer_set=None):
    path = tmp_path / "m.safetensors"
    if not path.exists():
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return OffloadedTarget(Storage(path), model.config, R, tail_layers=R2,
                           layer_set=layer_set)


SETS = [(0, 2, 3, 5), (0, 1, 3), (0, 2, 4), (0, 1, 3, 4)]
"""Resident sets of the 6-layer model: tails with gaps, and tails that stop before the
last layer (streamed layers after them)."""


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=6, seed=3)


def test_the_resident_set_is_the_first_r1_and_the_last_r2(tmp_path, model):
    t = _target(tmp_path, model, 4, 2)
    assert (t.R1, t.R2) == (2, 2) and t.resident == {0, 1, 4, 5}
    meta = [any(p.device.type == "meta" for p in lay.parameters())
            for lay in t.model.model.layers]
    assert meta == [False, False, True, True, False, False]
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    head = sum(p.numel() * 4 for p in (model.lm_head.weight, model.model.norm.weight))
    rope = sum(b.numel() * 4 for b in t.model.model.rotary_emb.buffers())
    assert t.resident_bytes() == head + 6 * layer + rope       # 4 resident + 2 buffers
    with pytest.raises(ValueError, match="tail_layers"):
        _target(tmp_path, model, 2, 3)
    with pytest.raises(ValueError, match="skip draft"):
        SkipDraft(_target(tmp_path, model, 4, 0))


def test_a_resident_layer_set(tmp_path, model):
    """Any set: R1 = the first layer not in it, the tail = the set's layers above R1;
    only they are materialised; a malformed set is refused."""
    t = _target(tmp_path, model, 0, 0, layer_set=(5, 0, 2, 3))
    assert (t.R, t.R1, t.R2, t.tail) == (4, 1, 3, (2, 3, 5))
    assert [all(p.device.type != "meta" for p in lay.parameters())
            for lay in t.model.model.layers] == [True, False, True, True, False, True]
    assert SkipDraft(t, None).name == "skip-1+2-3,5-vfull"
    assert SkipDraft(_target(tmp_path, model, 0, 0, layer_set=(0, 1, 4, 5)), 40).name \
        == "skip-2+2-v40"
    for bad in ((0, 0, 1), (0, 6), (-1, 2)):
        with pytest.raises(ValueError, match="layer_set"):
            _target(tmp_path, model, 0, 0, layer_set=bad)
    with pytest.raises(ValueError, match="layer_set"):
        _target(tmp_path, model, 0, 1, layer_set=(0, 5))
    with pytest.raises(ValueError, match="skip draft"):       # nothing skipped
        SkipDraft(_target(tmp_path, model, 0, 0, layer_set=range(6)))


def test_greedy_identity_with_partial_acceptance(tmp_path, model):
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                         eos_token_id=None)[0, len(PROMPT):].tolist()
    partial = hits = 0
    for R, R2, ls in [(4, 2, None), (3, 1, None), (2, 1, None), (5, 3, None)] + [
            (0, 0, ls) for ls in SETS]:
        t = _target(tmp_path, model, R, R2, ls)
        assert decode_ar(t, PROMPT, 40, S.SamplingConfig())[0] == ref
        for vocab in (None, 40):
            for depth, width in ((1, 1), (3, 1), (8, 1), (3, 4)):
                dec = CatsDecoder(t, SkipDraft(t, vocab), depth, width=width)
                toks, st = dec.generate(PROMPT, 40, S.SamplingConfig())
                assert toks == ref, (R, R2, ls, vocab, depth, width)
                assert st.committed == 40
                partial += sum(0 < a < depth for a in st.accepted_per_round)
                hits += st.sibling_hits
                assert all(t.cache_len(i) == len(PROMPT) + 40 - 1 for i in range(6))
    assert partial > 0 and hits > 0


@pytest.mark.parametrize("layer_set", [None, (0, 2, 3, 5), (0, 1, 3)])
def test_every_round_leaves_the_targets_own_cache(tmp_path, model, layer_set):
    """Round by round (chain, siblings, a dynamic tree): every layer holds the confirmed prefix minus
    its last token, with the keys/values a fresh full prefill of it computes (the tail
    layers' draft-only entries are dropped and rewritten by the verification pass);
    the streamed layers run once per round."""
    t = _target(tmp_path, model, 4, 2) if layer_set is None else \
        _target(tmp_path, model, 0, 0, layer_set)
    ref = _target(tmp_path, model, 6, 0)
    for kw in ({"width": 1}, {"width": 4}, {"beam": 3, "nodes": 12}):   # chain, siblings, tree
        dec = CatsDecoder(t, SkipDraft(t, None), 4, **kw)
        ids = list(PROMPT)
        _prefill(t, ids)
        for _ in range(8):
            n0 = t.streamed_passes
            new, g, a = dec.round(ids, 4, S.SamplingConfig(), 0)
            assert t.streamed_passes - n0 == 1
            ids += new
            t.crop(len(ids) - 1)
            assert all(t.cache_len(i) == len(ids) - 1 for i in range(6))
            assert_cache_is_a_fresh_prefill(t, ref, ids)


def test_the_draft_attends_to_the_true_prefix_in_the_tail(tmp_path, model):
    """A draft token's logits are the skip path's: layers 0..R1-1 then the tail, whose
    attention sees the target's entries of the prefix plus the draft's own."""
    t = _target(tmp_path, model, 4, 2)
    d = SkipDraft(t, None)
    _prefill(t, PROMPT)
    h, lg = d.step(PROMPT[-1])
    ref = _target(tmp_path, model, 6, 0)                      # the whole target
    _prefill(ref, PROMPT)
    x = ref.run_layers(ref.run_layers(ref.embed([PROMPT[-1]]), 0, 2), 4, 6)
    want = ref.logits(x)[0]
    torch.testing.assert_close(lg, want, rtol=1e-4, atol=1e-4)
    d.release(len(PROMPT) - 1)
    assert [t.cache_len(i) for i in range(6)] == [4, 4, 3, 3, 3, 3]
    # a set with a gap in its tail: layers 0, then 2, 3, 5 on the draft path
    t = _target(tmp_path, model, 0, 0, (0, 2, 3, 5))
    d = SkipDraft(t, None)
    _prefill(t, PROMPT)
    h, lg = d.step(PROMPT[-1])
    _prefill(ref, PROMPT)
    x = ref.run_list(ref.embed([PROMPT[-1]]), (0, 2, 3, 5))
    torch.testing.assert_close(lg, ref.logits(x)[0], rtol=1e-4, atol=1e-4)
    d.release(len(PROMPT) - 1)
    assert [t.cache_len(i) for i in range(6)] == [4, 3, 3, 3, 3, 3]


def test_a_block_without_drafts_samples_what_the_target_alone_does(tmp_path, model):
    t = _target(tmp_path, model, 4, 2)
    cfg = S.SamplingConfig(temperature=0.9, top_k=20)
    assert_zero_draft_rounds_match_ar(t, CatsDecoder(t, SkipDraft(t, None), 1), cfg,
                                      prompt=PROMPT)


@pytest.mark.parametrize("layer_set", [None, (0, 2, 4), (0, 1, 3)],
                         ids=["last", "gap", "stops-early"])
@pytest.mark.parametrize("cfg", SAMPLINGS, ids=["plain", "processors"])
def test_sampled_pairs_follow_the_target_distribution(tmp_path, cfg, layer_set):
    V = 8
    if layer_set is None:
        model = tiny_model(vocab=V, layers=4, seed=5)
        t = _target(tmp_path, model, 2, 1)                   # layers 0 and 3 resident
    else:                                                    # of 5: a gap / layer 4 streamed
        model = tiny_model(vocab=V, layers=5, seed=5)
        t = _target(tmp_path, model, 0, 0, layer_set)
    dec = CatsDecoder(t, SkipDraft(t, 6), 2)                  # draft vocabulary: 6 of 8
    assert_pairs_follow_the_target(dec, model, cfg, V)


def test_siblings_go_where_the_chain_is_least_sure_to_reach():
    """``reach_i * q_i(s)``: a sure first draft spends the siblings deeper; a token of
    zero draft probability (outside the draft's vocabulary) is never one."""
    from edge_sdk.local_target.siblings import tree_siblings

    def lg(probs):
        return torch.tensor(probs, dtype=torch.float32).log()
    sure = [lg([0.97, 0.015, 0.01, 0.005, 0.0]), lg([0.4, 0.3, 0.25, 0.05, 0.0]),
            lg([0.5, 0.25, 0.25, 0.0, 0.0])]
    alts = tree_siblings(sure, [0, 0, 0], 3)
    assert alts == [[], [1, 2], [1]]             # .97*.3, .97*.25, .97*.4*.25
    unsure = [lg([0.4, 0.35, 0.25, 0.0, 0.0])] + sure[1:]
    assert tree_siblings(unsure, [0, 0, 0], 2) == [[1, 2], [], []]
    assert tree_siblings(sure, [0, 0, 0], 20) == [[1, 2, 3], [1, 2, 3], [1, 2]]


def test_a_sibling_deeper_in_the_block_commits_the_targets_tokens(tmp_path, model):
    """A policy that puts the target's token at the chain's first mismatch (an oracle):
    every such round commits d_1..d_a, the sibling and its bonus token, the output is
    the target's, and every layer's cache is what a fresh prefill computes."""
    ref_ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                             eos_token_id=None)[0].tolist()
    ids = list(PROMPT)

    def oracle(lgs, drafts, m):
        truth = ref_ids[len(ids):len(ids) + len(drafts)]
        a = next((i for i, (d, r) in enumerate(zip(drafts, truth)) if d != r), None)
        alts = [[] for _ in drafts]
        if a is not None:
            alts[a] = [truth[a]] + [x for x in range(m + 1) if x not in (truth[a], drafts[a])][:m - 1]
        return alts

    t = _target(tmp_path, model, 0, 0, (0, 2, 3, 5))
    full = _target(tmp_path, model, 6, 0)
    dec = CatsDecoder(t, SkipDraft(t, None), 4, width=3, siblings=oracle)
    _prefill(t, ids)
    deep = 0
    while len(ids) < len(PROMPT) + 32:
        new, g, a = dec.round(ids, 4, S.SamplingConfig(), 0)
        deep += a > 0 and len(new) == a + 2
        assert new == ref_ids[len(ids):len(ids) + len(new)]
        ids += new
        t.crop(len(ids) - 1)
        assert_cache_is_a_fresh_prefill(t, full, ids)
    assert deep > 0
