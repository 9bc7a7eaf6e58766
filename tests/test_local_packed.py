"""The budgeted local target with its resident linears and LM head prepacked for oneDNN
(:mod:`edge_sdk.packed`, :class:`edge_sdk.local_target.head.PackedHead`): on a tiny
random bf16 Qwen2 the logits equal the unpacked target's bit for bit, whatever the
resident set; the skip draft's sub-head is the packed head's own chunks and gives the
dense sub-head's logits; the resident bytes are the unpacked ones (no dense copy kept)
up to oneDNN's row padding; CATS greedy output is the target's token for token."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from edge_sdk.exit_head import restricted_vocab
from edge_sdk.local_target.cats import CatsDecoder, decode_ar
from edge_sdk.local_target.head import PackedHead, packed_nbytes
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.skip import SkipDraft
from edge_sdk.local_target.storage import Storage
from edge_sdk.packed import PackedLinear, packing_supported
from edge_sdk.protocol import sampling as S

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                reason="oneDNN packs bf16 only with AVX-512 or AVX-NE-CONVERT")

PROMPT = [5, 17, 99, 3, 42, 8, 150, 77, 21, 64, 12]
V = 300


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=V - 2, bos_token_id=V - 3,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0)                     # sharper distributions than the default init
    return m.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def path(tmp_path_factory, model):
    p = tmp_path_factory.mktemp("packed") / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(p))
    return p


def _target(path, model, R, R2, packed, chunk=None, **kw):
    import edge_sdk.local_target.head as H

    old = H.CHUNK_ROWS
    H.CHUNK_ROWS = chunk or old             # small chunks: several per row range
    try:
        return OffloadedTarget(Storage(path), model.config, R, torch.bfloat16,
                               tail_layers=R2, packed=packed, **kw)
    finally:
        H.CHUNK_ROWS = old


def _passes(t, ids):
    """Logits of a prefill over ``ids[:-1]`` then one token at a time, [n, V] float32."""
    t.reset()
    out = [t.forward(ids[:-4])]
    out += [t.forward([x]) for x in ids[-4:]]
    return torch.cat(out)


@pytest.mark.parametrize("R,R2,chunk", [(4, 2, None), (3, 1, 64), (6, 0, 96), (0, 0, None)])
def test_packed_logits_equal_unpacked_bit_for_bit(path, model, R, R2, chunk):
    ids = restricted_vocab(model, 40)
    ref = _target(path, model, R, R2, False)
    t = _target(path, model, R, R2, True, chunk, draft_ids=ids)
    assert t.packed and isinstance(t.model.lm_head, PackedHead)
    n = sum(isinstance(m, PackedLinear) for m in t.model.modules())
    assert n == 7 * R + len(t.model.lm_head.chunks) + 1        # + the special rows
    assert not any(isinstance(m, PackedLinear) for b in t.buffers for m in b.modules())
    assert torch.equal(_passes(t, PROMPT), _passes(ref, PROMPT))
    # the full head equals F.linear over the dense head; the draft chunks, its rows
    h = torch.randn(1, 5, 64).bfloat16()
    w = model.lm_head.weight
    assert torch.equal(t.model.lm_head(h), torch.nn.functional.linear(h, w))
    assert torch.equal(t.model.lm_head.draft(h), h @ w[ids].T)


def test_resident_bytes_hold_no_dense_copy(path, model):
    """Packed: the unpacked resident bytes plus only oneDNN's row padding (a weight's
    rows rounded up to its block: none at the 1.5B target's shapes, < 1 MB over its
    head's chunks), no dense copy left, so the planner's M(R) stays honest."""
    for R, R2 in ((4, 2), (6, 0), (0, 0)):
        ref = _target(path, model, R, R2, False).resident_bytes()
        t = _target(path, model, R, R2, True, draft_ids=restricted_vocab(model, 40))
        pad = sum(packed_nbytes(m.packed) - m.in_features * m.out_features * 2
                  for m in t.model.modules() if isinstance(m, PackedLinear))
        ids = sum(b.numel() * 8 for b in (t.model.lm_head.draft_ids, t.model.lm_head.extra))
        assert t.resident_bytes() == ref + pad + ids, (R, ref, pad)
        assert not any(p.device.type == "cpu" and p.dim() == 2
                       for lay in t.model.model.layers for p in lay.parameters())


def test_cats_greedy_identity_on_the_packed_target(path, model):
    """Packed CATS commits exactly what unpacked CATS commits (chain and siblings), and
    with a chain exactly what the target alone does. (In bf16 a tree pass under its own
    mask may round differently from the target alone's 1-token pass, packed or not: the
    fp32 identity tests are ``tests/test_cats_skip.py``.)"""
    ref = decode_ar(_target(path, model, 6, 0, False), PROMPT, 30, S.SamplingConfig())[0]
    ids = restricted_vocab(model, 40)
    for R, R2 in ((4, 2), (3, 1)):
        t = _target(path, model, R, R2, True, draft_ids=ids)
        u = _target(path, model, R, R2, False)
        assert decode_ar(t, PROMPT, 30, S.SamplingConfig())[0] == ref
        for vocab in (40, None):
            d = SkipDraft(t, vocab)
            if vocab == 40:                                  # the draft chunks are used
                assert d._head._sub == t.model.lm_head.draft
            for depth, width in ((3, 1), (8, 1), (3, 4), (8, 4)):
                toks = CatsDecoder(t, d, depth, width=width).generate(
                    PROMPT, 30, S.SamplingConfig())[0]
                assert toks == CatsDecoder(u, SkipDraft(u, vocab), depth, width=width
                                           ).generate(PROMPT, 30, S.SamplingConfig())[0]
                if width == 1:
                    assert toks == ref, (R, R2, vocab, depth)


def test_pack_head_off_keeps_the_dense_head(path, model):
    t = _target(path, model, 4, 2, True, pack_head=False)
    assert type(t.model.lm_head) is torch.nn.Linear
    assert sum(isinstance(m, PackedLinear) for m in t.model.modules()) == 7 * 4
