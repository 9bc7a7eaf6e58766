"""CATS with a dynamic draft tree (:mod:`edge_sdk.local_target.dyntree`, EAGLE-2's
expansion and reranking): the tree functions by hand; greedy output is the target's
token for token with the exit head and with the layer-skipping draft (contiguous and
searched resident sets), over rounds that accept part of the tree and rounds that
follow a branch off the draft's top-1 chain (CASES.md 1, 11); after every round every
layer's cache holds exactly the keys/values a fresh prefill of the confirmed prefix
minus its last token computes, the streamed layers run once (CASES.md 7; in
``test_cats_skip.py``, beside the chain and the siblings); a sampled
config never takes the tree path (CASES.md 3-5 stay the chain's)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from edge_sdk.exit_head import untrained_head
from edge_sdk.local_target import dyntree as D
from edge_sdk.local_target.cats import CatsDecoder, _prefill, decode_ar
from edge_sdk.local_target.skip import SkipDraft
from edge_sdk.protocol import sampling as S
from test_cats import PROMPT
from test_cats_skip import _target


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=6, seed=3)


def test_rerank_is_ancestor_closed_and_ordered():
    #            0    1    2    3     4     5     6
    parents = [-1, -1, 0, 0, 1, 2, 5]
    scores = [0.6, 0.3, 0.3, 0.2, 0.25, 0.3, 0.3]     # ties: 2 after 0, 5 after 2, 6 after 5
    depths = [1, 1, 2, 2, 2, 3, 4]
    for n in range(1, 8):
        sel = D.rerank(scores, depths, n)
        seen = set()
        for node in sel:
            assert parents[node] < 0 or parents[node] in seen
            seen.add(node)
    assert D.rerank(scores, depths, 5) == [0, 1, 2, 5, 6]
    assert D.ancestors(parents, 6) == [5, 2, 0] and D.ancestors(parents, 1) == []


def test_rows_mask_sees_prefix_root_ancestors_and_itself():
    parents = [-1, -1, 0, 0, 2]
    m = D.rows_mask(parents, [2, 3], [-1, 0, 1], P=2)[0, 0]
    assert m.shape == (2, 2 + 3 + 2)
    assert m[0].tolist() == [True, True, True, True, False, True, False]
    assert m[1].tolist() == [True, True, True, True, False, False, True]
    m = D.rows_mask(parents, [0, 2, 4], [-1], P=1)[0, 0]      # ancestors among the rows
    assert m.tolist() == [[True, True, True, False, False],
                          [True, True, True, True, False],
                          [True, True, True, True, True]]
    with pytest.raises(KeyError):
        D.rows_mask(parents, [4], [-1], P=0)                 # its parent 2 is nowhere


def test_greedy_path_follows_the_targets_argmax():
    tokens = [5, 7, 9, 3, 4]
    parents = [-1, -1, 0, 0, 3]
    rows = [0, 1, 2, 3, 4]                    # pass rows: root, then nodes 0..4 at 1..5
    # root argmax 5 (node 0, row 1); its argmax 3 (node 3, row 4); its argmax 4 (row 5)
    best = torch.tensor([5, 3, 0, 0, 4, 8])
    assert D.greedy_path(best, tokens, parents, rows) == ([1, 4, 5], 8)
    assert D.greedy_path(torch.tensor([7, 0, 0, 0, 0, 0]), tokens, parents, rows) == ([2], 0)
    assert D.greedy_path(torch.tensor([6, 0, 0, 0, 0, 0]), tokens, parents, rows) == ([], 6)
    assert D.top_children(torch.tensor([0.0, 1.0, float("-inf"), 2.0]), 4)[0][0] == 3
    assert all(t != 2 for t, _ in D.top_children(torch.tensor([0.0, 1.0, float("-inf")]), 3))


def test_greedy_identity_with_trees(tmp_path, model):
    """Exit head and skip drafts, beams 2..4, trees of 1..24 nodes, depths 1..8: the
    target's greedy output, every layer at the confirmed prefix minus one, and some
    rounds accept a node off the draft's top-1 chain."""
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                         eos_token_id=None)[0, len(PROMPT):].tolist()
    off = deep = 0
    for R, R2, ls in [(4, 2, None), (0, 0, (0, 2, 3, 5)), (0, 0, (0, 1, 3))]:
        t = _target(tmp_path, model, R, R2, ls)
        assert decode_ar(t, PROMPT, 40, S.SamplingConfig())[0] == ref
        drafts = [SkipDraft(t, None), SkipDraft(t, 40)] + [untrained_head(t.model, 1)]
        for draft in drafts:
            for depth, beam, nodes in ((1, 2, 2), (3, 2, 6), (4, 4, 24), (8, 3, 1),
                                       (8, 4, 16)):
                dec = CatsDecoder(t, draft, depth, beam=beam, nodes=nodes)
                toks, st = dec.generate(PROMPT, 40, S.SamplingConfig())
                assert toks == ref, (R, R2, ls, getattr(draft, "name", ""), depth, beam)
                assert st.committed == 40 and st.rounds <= 40
                assert all(t.cache_len(i) == len(PROMPT) + 40 - 1 for i in range(6))
                off += st.sibling_hits
                deep += sum(a >= 2 for a in st.accepted_per_round)
    assert off > 0 and deep > 0


def test_the_tree_follows_an_oracle_draft_all_the_way(tmp_path, model):
    """A draft that ranks the target's token a close second after a true context and
    is flat after a false one: the tree of beam 2 keeps the true branch at every depth
    and accepts all of it each round, every accepted node off the draft's top-1 chain,
    while the output stays the target's."""
    ref_ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                             eos_token_id=None)[0].tolist()
    t = _target(tmp_path, model, 4, 2)
    skip = SkipDraft(t, None)
    V = int(t.config.vocab_size)

    def lg(p: int, tok: int) -> torch.Tensor:
        """Draft logits after token ``tok`` at position ``p``."""
        if p + 1 >= len(ref_ids) or tok != ref_ids[p]:
            return torch.zeros(V)                                  # false context: flat
        out = torch.full((V,), -20.0)
        truth = ref_ids[p + 1]
        out[(truth + 1) % V], out[truth] = 2.0, 1.99               # the truth ranks second
        return out

    class Oracle:
        split, name = skip.split, "oracle"

        def step(self, tok):
            h, _ = skip.step(tok)
            return h, lg(t.cache_len(0) - 1, tok)

        def step_rows(self, toks, pos, mask):
            h, _ = skip.step_rows(toks, pos, mask)
            return h, torch.stack([lg(int(p), x) for p, x in zip(pos[0], toks)])

        def release(self, n):
            skip.release(n)

    dec = CatsDecoder(t, Oracle(), 4, beam=2, nodes=24)
    ids = list(PROMPT)
    _prefill(t, ids)
    rounds = 0
    while len(ids) < len(PROMPT) + 30:
        new, g, a = dec.round(ids, 4, S.SamplingConfig(), 0)
        assert new == ref_ids[len(ids):len(ids) + len(new)]
        assert (g, a) == (4, 4)
        ids += new
        t.crop(len(ids) - 1)
        rounds += 1
    assert dec.sibling_hits == 4 * rounds
    chain = CatsDecoder(t, Oracle(), 4)                 # the same draft as a chain
    _prefill(t, ids)
    assert chain.round(ids, 4, S.SamplingConfig(), 0)[2] == 0


def test_a_sampled_config_takes_the_chain(tmp_path, model):
    """The tree is greedy-only: with sampling the decoder drafts a chain, so the
    sampled output is the chain decoder's (same seeds), draw for draw."""
    t = _target(tmp_path, model, 4, 2)
    cfg = S.SamplingConfig(temperature=0.9, top_k=20)
    chain = CatsDecoder(t, SkipDraft(t, None), 4).generate(PROMPT, 24, cfg, seed=7)[0]
    tree = CatsDecoder(t, SkipDraft(t, None), 4, beam=4).generate(PROMPT, 24, cfg, seed=7)[0]
    assert tree == chain


def test_the_plan_drafts_trees_where_drafting_is_cheap():
    """The 1.5B target's sizes at a 50 % budget on nvme: the skip draft costs far
    under 10 % of the streamed pass, so the plan drafts ``BEAM`` x ``NODES`` trees of at
    most ``TREE_DEPTH`` levels; with everything resident nothing is streamed, no
    draft pays, and there is no tree."""
    from edge_sdk.local_target import budget as B

    s = B.Sizes(93_603_840, 466_747_392, 466_747_392, 3072, 28, 1536, 151936, 28 * 1024)
    half = B.plan(s, s.weights // 2, 2e9, packed=True)
    assert half.width > 1 and (half.beam, half.nodes) == (B.BEAM, B.NODES)
    assert 1 <= half.depth <= B.TREE_DEPTH
    assert half.memory == B._memory(s, half.resident_layers, False, 2048, B.NODES)
    assert B._memory(s, 12, False, 2048, 64) - B._memory(s, 12, False, 2048, 8) \
        == (65 - 9 * 2) * s.vocab * 2            # the tree's bf16 logits over the chain's
    full = B.plan(s, 2 * s.weights, 2e9, packed=True)
    assert full.depth == 0 and (full.beam, full.nodes) == (1, 0)


def test_greedy_of_the_head_is_the_argmax_of_its_float_logits(tmp_path, model):
    """The tree verification's argmax on the head's own dtype (no float32 copy of the
    [1 + nodes, V] logits) picks the ids the float32 logits pick, in bf16 too."""
    t = _target(tmp_path, model, 4, 2)
    for dtype in (torch.float32, torch.bfloat16):
        t.model.to(dtype)
        h = torch.randn(1, 9, t.config.hidden_size, dtype=dtype)
        assert t.greedy(h).tolist() == S.greedy_token(t.logits(h)).tolist()
