"""``sample_next``: the one "presence mask -> processors -> argmax or draw" step shared by
the drafter, the verifier's bonus draw, target-only streaming and proactive roots."""

from __future__ import annotations

import pytest
import torch

from edge_sdk.protocol import sampling as S

V = 50
CONFIGS = [S.SamplingConfig(),                                    # greedy
           S.SamplingConfig(repetition_penalty=1.3),              # greedy + penalty
           S.SamplingConfig(temperature=0.8, top_k=10),
           S.SamplingConfig(temperature=1.2, top_p=0.9, repetition_penalty=1.2)]


def _logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 4


def _by_hand(logits, cfg, seen, gen):
    """The step as each caller used to write it (batched processors, row 0)."""
    mask = None
    if cfg.repetition_penalty != 1.0:
        mask = S.presence_mask(torch.tensor(seen), torch.zeros(0, dtype=torch.long), V)
    x = S.process_logits(logits[None], cfg, mask)[0]
    if cfg.greedy:
        return int(S.greedy_token(x)), None
    q = torch.softmax(x, dim=-1)
    return int(S.sample(q, gen)), q


@pytest.mark.parametrize("cfg", CONFIGS)
def test_sample_next_is_bit_identical_to_the_hand_assembled_step(cfg):
    seen = [3, 7, 7, 12]
    for seed in range(20):
        lg = _logits(seed)
        tok, q = S.sample_next(lg, cfg, seen, torch.Generator().manual_seed(seed))
        ref_tok, ref_q = _by_hand(lg, cfg, seen, torch.Generator().manual_seed(seed))
        assert tok == ref_tok
        assert (q is None) == (ref_q is None)
        if q is not None:
            assert q.dtype == torch.float64 and q.shape == (V,)
            assert torch.equal(q, ref_q) and q[tok] > 0


def test_greedy_is_the_processed_argmax_and_ignores_the_generator():
    lg = _logits(1)
    tok, q = S.sample_next(lg, S.SamplingConfig(), [1, 2])
    assert q is None and tok == int(torch.argmax(lg))
    pen = S.SamplingConfig(repetition_penalty=100.0)
    top = int(torch.argmax(lg))
    assert S.sample_next(lg, pen, [top])[0] != top        # the penalty reaches it
    assert S.sample_next(lg, pen, None)[0] == top         # no history: no penalty


def test_seeded_draws_replay_and_follow_the_generator():
    cfg = S.SamplingConfig(temperature=1.0)
    lg = torch.zeros(V)                                     # uniform: draws vary
    draw = lambda s: S.sample_next(lg, cfg, (), torch.Generator().manual_seed(s))[0]  # noqa: E731
    assert [draw(5) for _ in range(3)] == [draw(5)] * 3
    assert len({draw(s) for s in range(30)}) > 5


def test_seen_may_be_a_tensor_of_ids():
    cfg = S.SamplingConfig(temperature=0.7, repetition_penalty=1.5)
    lg = _logits(2)
    a = S.process_next(lg, cfg, [4, 9])
    assert torch.equal(a, S.process_next(lg, cfg, torch.tensor([4, 9])))
    assert not torch.equal(a, S.process_next(lg, cfg, None))


def _reference_pick(logits):
    from edge_sdk.drafters.base import candidates

    d, _ = S.sample_next(logits, S.SamplingConfig(), None, None)
    return (d, *candidates(logits, d))


@pytest.mark.parametrize("vocab", [151936, 49152, 448])
def test_greedy_pick_is_the_argmax_and_candidates_of_the_general_path(vocab):
    """The draft's one-pass greedy pick (slice maxima) gives the general path's token
    (argmax, ties to the lowest id), the same probability of it, bit for bit, and the
    same candidates (as a set where values tie): on random logits, on a subset head
    (most ids -inf), with the best value tied across slices and inside one, with fewer
    finite values than candidates, and in bfloat16."""
    from edge_sdk.drafters.base import greedy_pick

    g = torch.Generator().manual_seed(vocab)
    cases = []
    for _ in range(20):
        cases.append(torch.randn(vocab, generator=g) * 4)
    sub = torch.full((vocab,), float("-inf"))
    keep = torch.randperm(vocab, generator=g)[: vocab // 5]
    sub[keep] = torch.randn(len(keep), generator=g)
    cases.append(sub)
    tied = torch.randn(vocab, generator=g)
    tied[[vocab - 1, 70, 3, vocab // 2]] = 9.0          # the max in four slices
    cases.append(tied)
    inside = torch.randn(vocab, generator=g)
    inside[[130, 129, 140]] = 7.5                        # three in one slice
    cases.append(inside)
    few = torch.full((vocab,), float("-inf"))
    few[[5, vocab - 3]] = torch.tensor([1.0, 2.0])       # two finite ids
    cases.append(few)
    cases.append((torch.randn(vocab, generator=g) * 3).to(torch.bfloat16).float())
    for x in cases:
        got, want = greedy_pick(x), _reference_pick(x)
        assert got[0] == want[0] and got[2] == want[2]
        vals = lambda ids: sorted(float(x[i]) for i in ids)      # noqa: E731
        assert vals(got[1]) == vals(want[1]) and len(got[1]) == len(want[1])
        if len(set(vals(want[1]))) == len(want[1]):
            assert got[1] == want[1]
    assert _reference_pick(tied)[0] == 3 and greedy_pick(inside)[0] == 129


def test_greedy_pick_leaves_odd_vocabularies_and_nans_to_the_general_path():
    from edge_sdk.drafters.base import Proposal, greedy_pick

    assert greedy_pick(torch.randn(1000)) is None                # not a multiple of 64
    assert greedy_pick(torch.randn(128)) is None                 # fewer slices than 5
    nan = torch.randn(640)
    nan[17] = float("nan")
    assert greedy_pick(nan) is None
    assert greedy_pick(torch.full((640,), float("-inf"))) is None
    assert greedy_pick(torch.randn(2, 640)) is None
    x = torch.randn(640)
    for cfg in (S.SamplingConfig(), S.SamplingConfig(repetition_penalty=1.3)):
        p = Proposal([1, 2, 3], 1, cfg)
        p.take(x)                       # the penalised config takes the general path
        want = S.sample_next(x, cfg, [1, 2, 3], None)[0]
        assert p.tokens == [want] and len(p.block().cands[0]) == 4
