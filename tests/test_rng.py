"""The one seeding scheme (``edge_sdk.protocol.rng``): replay, independence of streams
and indices, and identical re-draws of a retried block on both sides."""

from __future__ import annotations

import numpy as np
import torch

from cloud_api.sessions import Session
from cloud_api.verifier import Verifier
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.kvmodel import KVModel
from edge_sdk.protocol import rng
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.protocol.wire import VerifyRequest

STREAMS = (rng.DRAFT, rng.DRAFT_OFFLINE, rng.CORRECTION, rng.VERIFY, rng.STREAM_DECODE)


def _draws(seed, stream, index, n=4):
    return torch.rand(n, generator=rng.generator(seed, stream, index), dtype=torch.float64)


def test_same_arguments_replay():
    for stream in STREAMS:
        assert torch.equal(_draws(7, stream, 3), _draws(7, stream, 3))
    assert rng.mix(7, rng.DRAFT, 3) == rng.mix(7, rng.DRAFT, 3)


def test_stream_index_and_seed_each_change_the_draws():
    base = _draws(7, rng.DRAFT, 2)
    others = [_draws(7, rng.DRAFT, 3), _draws(8, rng.DRAFT, 2)]
    others += [_draws(7, s, 2) for s in STREAMS if s != rng.DRAFT]
    assert all(not torch.equal(base, o) for o in others)
    seeds = {rng.mix(seed, stream, index) for seed in range(4) for stream in STREAMS
             for index in range(16)}
    assert len(seeds) == 4 * len(STREAMS) * 16          # no collisions among them
    assert all(0 <= s < 2**63 for s in seeds)


def test_negative_and_huge_seeds_are_accepted():
    assert torch.equal(_draws(-1, rng.VERIFY, 0), _draws(2**64 - 1, rng.VERIFY, 0))
    _draws(10**30, rng.CORRECTION, 10**12)


def test_a_retried_draft_round_redraws_the_same_block(draft):
    """The edge drafts round i from ``(seed, DRAFT, i)``: a round retried after a lost
    connection proposes exactly the same tokens and q."""
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    d = TorchDrafter(draft)
    a = d.propose([4, 5, 6], 4, cfg, rng.generator(11, rng.DRAFT, 2))
    d.propose([9, 9, 9, 9], 3, cfg, rng.generator(11, rng.DRAFT, 5))   # cache moves on
    b = d.propose([4, 5, 6], 4, cfg, rng.generator(11, rng.DRAFT, 2))
    assert a.tokens == b.tokens
    assert torch.equal(a.q_tok, b.q_tok) and torch.equal(a.q, b.q)


def _session(target, cfg, seed):
    s = Session(1, None, cfg, seed, "asym", 8, 4, 32, KVModel(target), [4, 5, 6, 7], 4)
    Verifier(target).prefill(s)
    return s


def test_a_retried_verify_redraws_the_same_verdict(target):
    """The cloud draws a block's uniforms, bonus and proposals from ``(seed, VERIFY,
    block_seq)``: the same block verified again on the same confirmed prefix (a replay
    after the session was rebuilt) gets the same verdict, payload included."""
    cfg = SamplingConfig(temperature=1.0)
    block = np.array([8, 9, 10], dtype=np.int64)
    q = np.full(3, 0.5)

    def verdict(seed):
        s = _session(target, cfg, seed)
        v = Verifier(target)
        req = VerifyRequest(1, 0, 4, cfg.config_id, None, block, q, None, 7)
        return v.verify(s, req)

    runs = [verdict(3) for _ in range(2)]
    assert runs[0].accepted == runs[1].accepted
    assert runs[0].next_token == runs[1].next_token
    c0, c1 = runs[0].correction, runs[1].correction
    assert (c0 is None) == (c1 is None)
    if c0 is not None:
        assert np.array_equal(c0.proposal_ids, c1.proposal_ids)
        assert np.array_equal(c0.support_ids, c1.support_ids)
    outcomes = {(r.accepted, r.next_token,
                 None if r.correction is None else tuple(r.correction.proposal_ids))
                for r in (verdict(seed) for seed in range(12))}
    assert len(outcomes) > 1                 # the seed does reach the draws
