"""Cloud re-batching (SPEC §3): blocks of different sessions, prefix lengths and depths
in one packed target pass give each session exactly its unbatched verdict."""

from __future__ import annotations

import numpy as np
import torch

from cloud_api.sessions import Session
from cloud_api.verifier import Verifier
from edge_sdk.kvmodel import KVModel, batched_forward
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.protocol.wire import VerifyRequest

PROMPTS = [[2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]


def _session(model, i, prompt):
    s = Session(i + 1, None, SamplingConfig(), 0, "asym", 8, 4, 64, KVModel(model),
                list(prompt), len(prompt))
    return s


def _blocks(target, draft_noise_model):
    """Greedy drafts of different depths from a perturbed model: rows accept different
    numbers of tokens."""
    out = []
    for d, p in zip((1, 3, 5, 8), PROMPTS):
        kv = KVModel(draft_noise_model)
        toks, ctx = [], list(p)
        for _ in range(d):
            t = int(kv.sync(ctx + toks)[-1].argmax())
            toks.append(t)
        out.append(toks)
    return out


def test_batched_equals_unbatched(target):
    from tests.conftest import tiny_model

    blocks = _blocks(target, tiny_model(seed=1, like=target, noise=0.003))
    v = Verifier(target)
    single = []
    for i, (p, b) in enumerate(zip(PROMPTS, blocks)):
        s = _session(target, i, p)
        v.prefill(s)
        req = VerifyRequest(s.id, 0, len(p), s.cfg.config_id, None, np.array(b), None, None)
        r = v.verify(s, req)
        single.append((r.accepted, r.next_token, list(s.tokens), list(s.kv.ids)))
    sessions = [_session(target, i, p) for i, p in enumerate(PROMPTS)]
    for s in sessions:
        v.prefill(s)
    passes = v.passes
    items = [(s, VerifyRequest(s.id, 0, len(p), s.cfg.config_id, None, np.array(b), None, None))
             for s, p, b in zip(sessions, PROMPTS, blocks)]
    batched = v.verify_batch(items)
    assert v.passes == passes + 1                          # one pass for the batch
    got = [(r.accepted, r.next_token, list(s.tokens), list(s.kv.ids))
           for r, s in zip(batched, sessions)]
    assert got == single
    assert len({a for a, *_ in got}) > 1, "rows should accept different counts"
    for s in sessions:
        s.check_kv()


def test_batched_forward_matches_single_rows(target):
    kvs, refs = [], []
    rows = [([1, 2, 3, 4, 5], [6, 7]), ([8], [9, 10, 11, 12]), ([], [13])]
    for past, new in rows:
        kv = KVModel(target)
        if past:
            kv.forward(past)
        kvs.append(kv)
        ref = KVModel(target)
        refs.append(ref.forward(past + new)[len(past):])
    outs = batched_forward(kvs, [n for _, n in rows])
    for o, r, kv, (past, new) in zip(outs, refs, kvs, rows):
        assert torch.allclose(o, r, atol=1e-4)
        assert torch.equal(o.argmax(-1), r.argmax(-1))
        assert kv.ids == past + new and kv.cache_len() == len(past + new)
