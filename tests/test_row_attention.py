"""Row attention (the cloud's batched verification pass): sessions packed into one pass,
each attending to its own KV cache, give each session its unbatched logits."""

from __future__ import annotations

import pytest
import torch

from edge_sdk.kvmodel import KVModel, batched_forward
from edge_sdk.row_attention import RowBatch, row_attention, row_attention_pass

ROWS = [([1, 2, 3, 4, 5], [6, 7]), ([8], [9, 10, 11, 12]), ([], [13]),
        (list(range(14, 40)), [41, 42, 43])]


def _single(model, past, new):
    kv = KVModel(model)
    if past:
        kv.forward(past)
    return kv.forward(new)


def _batched(model, rows):
    kvs = []
    for past, _ in rows:
        kv = KVModel(model)
        if past:
            kv.forward(past)
        kvs.append(kv)
    return kvs, batched_forward(kvs, [n for _, n in rows])


def test_packed_rows_match_unbatched_passes(target):
    """Grouped-query heads (4 query / 2 key-value heads), empty and long pasts, rows of
    1..4 tokens: every row's logits are its own unbatched pass's (float32 to rounding:
    the matmuls see another row count), and each cache holds exactly its past + new
    tokens and goes on decoding as if filled unbatched."""
    kvs, outs = _batched(target, ROWS)
    for (past, new), kv, out in zip(ROWS, kvs, outs):
        ref = _single(target, past, new)
        assert out.shape == ref.shape == (len(new), target.config.vocab_size)
        assert torch.allclose(out, ref, atol=1e-5, rtol=0)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        assert kv.ids == past + new and kv.cache_len() == len(past + new)
    for (past, new), kv in zip(ROWS, kvs):
        assert torch.allclose(kv.forward([50]), _single(target, past + new, [50]),
                              atol=1e-5, rtol=0)


def test_sliding_window_layers_are_refused():
    """A sliding-window cache keeps only the window, so it cannot be rolled back to a
    confirmed prefix: a batched pass over such a model fails with a clear error and
    leaves no half-written cache."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, use_sliding_window=True,
                      sliding_window=4, max_window_layers=0)
    m = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    kvs = [KVModel(m), KVModel(m)]
    with pytest.raises(ValueError, match="sliding-window"):
        batched_forward(kvs, [[1, 2], [3]])
    assert all(kv.ids == [] and kv.cache_len() == 0 for kv in kvs)


def test_pass_restores_attention_and_rebuilds_caches_on_failure(target):
    """The model's own attention is back after a pass, also when the pass fails; a
    failed pass leaves no half-written cache (they are rebuilt, refilled lazily)."""
    before = target.config._attn_implementation
    kvs = [KVModel(target), KVModel(target)]
    kvs[0].forward([1, 2, 3])
    with pytest.raises(IndexError):
        batched_forward(kvs, [[4], [target.config.vocab_size + 5]])   # bad token id
    assert target.config._attn_implementation == before
    assert all(kv.ids == [] and kv.cache_len() == 0 for kv in kvs)
    batched_forward(kvs, [[4], [5]])
    assert target.config._attn_implementation == before


def test_bad_batches_are_refused(target):
    kv = KVModel(target)
    with pytest.raises(ValueError, match="two rows"):
        batched_forward([kv, kv], [[1], [2]])
    with pytest.raises(ValueError, match="at least one"):
        batched_forward([KVModel(target), KVModel(target)], [[1], []])
    with pytest.raises(RuntimeError, match="row_attention_pass"):
        row_attention(target.model.layers[0].self_attn, torch.zeros(1, 4, 1, 8),
                      None, None)
    rows = RowBatch([KVModel(target)], [1])
    with row_attention_pass(target, rows):
        pass
    with pytest.raises(RuntimeError):        # the pass's rows are gone afterwards
        row_attention(target.model.layers[0].self_attn, torch.zeros(1, 4, 1, 8),
                      None, None)
