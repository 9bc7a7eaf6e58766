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
