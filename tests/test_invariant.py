"""Row-invariant target passes: a verify pass's rows are bit for bit the target-alone
decode's, in bfloat16 and float32, for causal blocks, sibling trees and batched sessions.

The model has the real target's down-projection shape (K = 8960), whose one-row matmul
takes another reduction path than a multi-row one on oneDNN, and grouped-query heads."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edge_sdk.invariant import INVARIANT_MAX_ROWS, invariant_rows, make_row_invariant
from edge_sdk.kvmodel import KVModel, batched_forward
from edge_sdk.protocol.tree import layout

CTX = list(range(3, 140))
BLOCK = [7, 8, 9, 10, 11, 12]


def _model(dtype, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=8960,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)
    return Qwen2ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32],
                ids=["bfloat16", "float32"])
def model(request):
    return make_row_invariant(_model(request.param))


def _decode(model, past, new) -> torch.Tensor:
    """Logits of ``new`` fed one token per pass after ``past``: [len(new), V]."""
    kv = KVModel(model)
    kv.forward(past)
    return torch.stack([kv.forward([t])[0] for t in new])


def test_block_rows_equal_the_one_token_decode(model):
    ref = _decode(model, CTX, BLOCK)
    kv = KVModel(model)
    kv.forward(CTX)
    for n in (1, 2, 3, len(BLOCK)):
        kv.crop(len(CTX))
        assert torch.equal(kv.forward(BLOCK[:n]), ref[:n]), n
    kv.crop(len(CTX))
    # logits of the last rows only (a verify pass's ``last``): the same rows
    assert torch.equal(kv.forward(BLOCK, last=2), ref[-2:])
    # the cache continues as if decoded alone
    assert torch.equal(kv.forward([40])[0], _decode(model, CTX, BLOCK + [40])[-1])


def test_sibling_tree_rows_equal_their_paths_decoded_alone(model):
    """A chain last, d1, d2, d3 with siblings at depths 1 and 3: every row's logits are
    those of its own path (past, ancestors, itself) decoded one token at a time, and the
    cache cut to a sibling's branch continues as if that branch were decoded alone."""
    last, drafts, alts = 5, [21, 22, 23], [[31], [], [33, 34]]
    tree = layout(len(drafts), alts)
    rows = [last] + drafts + [31, 33, 34]
    kv = KVModel(model)
    kv.forward(CTX)
    out = kv.forward(rows, tree=tree)
    paths = [[last], [last, 21], [last, 21, 22], [last, 21, 22, 23], [last, 31],
             [last, 21, 22, 33], [last, 21, 22, 34]]
    for r, path in enumerate(paths):
        assert torch.equal(out[r], _decode(model, CTX, path)[-1]), r
    kv.keep(len(CTX) + 3, [len(CTX) + 5])   # last, d1, d2, then sibling 33 (row 5)
    assert torch.equal(kv.forward([50])[0],
                       _decode(model, CTX, [last, 21, 22, 33, 50])[-1])


def test_batched_sessions_equal_their_one_token_decodes(model):
    rows = [(CTX, [7, 8]), (CTX[:40], [9]), (CTX[:90], BLOCK)]
    kvs = []
    for past, _ in rows:
        kv = KVModel(model)
        kv.forward(past)
        kvs.append(kv)
    outs = batched_forward(kvs, [n for _, n in rows])
    for (past, new), out in zip(rows, outs):
        assert torch.equal(out, _decode(model, past, new))


def test_batched_pass_beyond_the_kernels_row_limit(model):
    """4 sessions x 17 tokens = 68 rows, more than the down-projection's kernel keeps
    row-invariant (``row_limit``: 32 for ``F.linear`` [8960 -> 256] here): the linears
    run in pieces and every row is still its one-token decode's."""
    down = model.model.layers[0].mlp.down_proj
    assert 2 <= down.specrelay_rows < 68
    new = [list(range(200 + 20 * b, 217 + 20 * b)) for b in range(4)]
    pasts = [CTX[:30 + 20 * b] for b in range(4)]
    kvs = []
    for past in pasts:
        kv = KVModel(model)
        kv.forward(past)
        kvs.append(kv)
    for past, n, out in zip(pasts, new, batched_forward(kvs, new)):
        assert torch.equal(out, _decode(model, past, n))


def test_passes_beyond_max_rows_keep_the_block_kernel():
    """A prefill-sized pass (more new tokens than ``max_rows``) runs the model's own
    attention and unpieced linears: bit for bit what the same model without row
    invariance computes, and the cache is the same length."""
    plain = _model(torch.float32)
    m = make_row_invariant(_model(torch.float32), max_rows=4)
    a, b = KVModel(plain), KVModel(m)
    for kv in (a, b):
        kv.forward(CTX)
    assert torch.equal(b.forward(BLOCK), a.forward(BLOCK))
    assert b.cache_len() == len(CTX) + len(BLOCK)


def test_make_row_invariant_keeps_weights_types_and_is_idempotent():
    m = _model(torch.bfloat16, seed=1)
    keys = list(m.state_dict())
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    before = m.model.layers[0].mlp.up_proj(x)
    assert invariant_rows(m) == 0
    assert make_row_invariant(m) is m and invariant_rows(m) == INVARIANT_MAX_ROWS
    cls = type(m.model.layers[0].mlp.up_proj)
    make_row_invariant(m, max_rows=8)
    lin = m.model.layers[0].mlp.up_proj
    assert type(lin) is cls and isinstance(lin, torch.nn.Linear)   # not wrapped twice
    assert list(m.state_dict()) == keys and invariant_rows(m) == 8
    y = lin(x)
    assert y.shape == (1, 1, 8960) and torch.equal(y, before)
    assert lin(torch.randn(3, 256, dtype=torch.bfloat16)).shape == (3, 8960)
    with pytest.raises(ValueError, match="max_rows"):
        make_row_invariant(m, max_rows=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                         ids=["bfloat16", "float32"])
def test_packed_linears_are_made_row_invariant_too(dtype):
    """A packed target (what serving loads run, float32 included) keeps every row of a
    verify pass and of a longer catch-up pass equal to its one-token decode, with its
    packed layers' row limits measured on their own kernel (float32 and bf16 packed
    layers of one shape are told apart)."""
    from edge_sdk.invariant import _limit_key, _machine_key
    from edge_sdk.packed import PackedLinear, pack_linears, packing_supported

    if not packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    m = _model(dtype, seed=2)
    assert pack_linears(m, require_equal=False, dtypes=(dtype,)) == 2 * 7 + 1
    make_row_invariant(m)
    down = m.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.specrelay_rows >= 2
    assert str(dtype) in _limit_key(down, _machine_key())
    long = BLOCK + list(range(40, 60))
    ref = _decode(m, CTX, long)
    kv = KVModel(m)
    kv.forward(CTX)
    assert torch.equal(kv.forward(BLOCK), ref[:len(BLOCK)])
    kv.crop(len(CTX))
    assert torch.equal(kv.forward(long), ref)


class _KernelRows(TorchDispatchMode):
    """Records the most rows of an ``[..., rows, in_features]`` input that any operator
    (the matmul, the packed oneDNN kernel, the cat that doubles a row) is handed."""

    def __init__(self, in_features: int):
        super().__init__()
        self.in_features, self.rows = in_features, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[-1] == self.in_features:
                rows = a.numel() // self.in_features
                if rows < 16:                                  # not the weight
                    self.rows = max(self.rows, rows)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                         ids=["bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_a_one_row_input_runs_alone_only_where_its_kernel_agrees(dtype, packed):
    """Each layer's one-row decision is what its kernel does on this machine: where a
    one-row input agrees bit for bit with the same row in a two-row input it runs alone
    (no second row's cost), elsewhere as two copies of the row; either way a one-row
    output is the two-row reference's row, and the decision is cached with the row
    limits."""
    from edge_sdk.invariant import (_base_forward, _limit_key, _load_limits, _machine_key,
                                    one_row_agrees)
    from edge_sdk.packed import pack_linears, packing_supported

    if packed and not packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    m = _model(dtype, seed=3)
    if packed:
        pack_linears(m, require_equal=False, dtypes=(dtype,))
    make_row_invariant(m)
    known = _load_limits()
    g = torch.Generator().manual_seed(5)
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
        lin = m.model.layers[0].get_submodule(name)
        def base(t, lin=lin):                       # the layer's own kernel
            return _base_forward(lin, t)
        assert lin.specrelay_one_row == one_row_agrees(lin), name
        assert known[_limit_key(lin, _machine_key()) + "|one-row"] == lin.specrelay_one_row
        x = torch.randn(1, 2, lin.in_features, generator=g).to(dtype)
        row = x[:, :1]
        with _KernelRows(lin.in_features) as seen:
            one = lin(row)
        assert torch.equal(one, lin(x)[:, :1]), name           # row-invariant either way
        assert seen.rows == (1 if lin.specrelay_one_row else 2), name
        if not lin.specrelay_one_row:                          # the kernel really differs
            assert not torch.equal(base(x[:, :1]), base(x)[:, :1]), name


def test_the_verifier_makes_its_target_row_invariant_unless_asked_not_to(monkeypatch):
    from cloud_api.verifier import Verifier

    a, b = _model(torch.float32, seed=3), _model(torch.float32, seed=4)
    Verifier(a)
    Verifier(b, row_invariant="off")
    assert invariant_rows(a) == INVARIANT_MAX_ROWS and invariant_rows(b) == 0
    assert a.model.layers[0].mlp.down_proj.specrelay_pieces
    c = _model(torch.float32, seed=5)
    Verifier(c, row_invariant="fast")
    assert invariant_rows(c) and not c.model.layers[0].mlp.down_proj.specrelay_pieces
    with pytest.raises(ValueError, match="row_invariant"):
        Verifier(_model(torch.float32, seed=6), row_invariant=True)
    monkeypatch.setenv("SPECRELAY_ROW_INVARIANT", "off")     # the operator's default
    d = _model(torch.float32, seed=8)
    assert Verifier(d).row_invariant == "off" and invariant_rows(d) == 0
    monkeypatch.setenv("SPECRELAY_ROW_INVARIANT", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        Verifier(_model(torch.float32, seed=9))


def test_sliding_window_models_are_left_alone():
    """Row attention cannot serve sliding-window layers (their cache cannot roll back):
    such a target keeps its own kernels and the near-tie policy, and still serves."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, use_sliding_window=True,
                      sliding_window=4, max_window_layers=0)
    m = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    assert make_row_invariant(m) is m and invariant_rows(m) == 0
    kv = KVModel(m)
    kv.forward([1, 2, 3])
    assert kv.forward([4, 5]).shape == (2, 64)


def test_a_deep_tree_node_reads_its_ancestors_in_order(model):
    """A general tree (not a sibling tree): row 3's ancestors are rows 0 and 2, row 4's
    rows 0, 2 and 3 (entries out of place, gathered after the past in order); each row
    is its path decoded alone, and the cache is left as the pass wrote it."""
    from edge_sdk.protocol.tree import TreeLayout

    attn = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                         [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    tree = TreeLayout(torch.tensor([0, 1, 1, 2, 3]), attn, ())
    rows = [5, 21, 31, 32, 33]
    kv = KVModel(model)
    kv.forward(CTX)
    out = kv.forward(rows, tree=tree)
    paths = [[5], [5, 21], [5, 31], [5, 31, 32], [5, 31, 32, 33]]
    for r, path in enumerate(paths):
        assert torch.equal(out[r], _decode(model, CTX, path)[-1]), r
    kv.keep(len(CTX) + 1, [len(CTX) + 2, len(CTX) + 3, len(CTX) + 4])
    assert torch.equal(kv.forward([50])[0], _decode(model, CTX, [5, 31, 32, 33, 50])[-1])


def test_the_service_hands_its_mode_to_the_verifier(tok):
    from cloud_api.service import CloudService
    from tests.conftest import tiny_model

    m = tiny_model(seed=7)
    CloudService(m, tok, row_invariant="fast")
    lins = [x for x in m.modules() if hasattr(x, "in_features")]
    assert invariant_rows(m) and lins and not any(x.specrelay_pieces for x in lins)
