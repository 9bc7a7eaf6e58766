"""The memory-budgeted local target (CATS, edge_sdk.local_target): streamed layers give
the resident model's logits bit for bit, the streamed weights really come from the
memory-mapped file, the emulated bandwidth is paid, the budget picks R."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_model
from edge_sdk.kvmodel import KVModel
from edge_sdk.local_target.budget import Sizes, parse_bytes, plan, _memory
from edge_sdk.local_target.load import sizes_of
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.storage import Storage, StorageProfile, parse_profile

IDS = [3, 5, 7, 9, 11, 2, 40, 41]


def _file(tmp_path, model, dtype=torch.float32):
    path = tmp_path / f"m-{str(dtype)[6:]}.safetensors"
    save_file({k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=4)


def _passes(t: OffloadedTarget) -> torch.Tensor:
    """Logits of a prefill, a 1-token step and a 3-token block [8, V]."""
    return torch.cat([t.forward(IDS[:4]), t.forward(IDS[4:5]), t.forward(IDS[5:])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_logits_equal_resident_bit_for_bit(tmp_path, model, dtype):
    store = Storage(_file(tmp_path, model, dtype))
    outs = [_passes(OffloadedTarget(store, model.config, R, dtype, embed))
            for R, embed in ((4, True), (4, False), (2, False), (0, False))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    if dtype == torch.float32:        # and the HF forward of the whole model
        kv = KVModel(model)
        ref = torch.cat([kv.forward(IDS[:4]), kv.forward(IDS[4:5]), kv.forward(IDS[5:])])
        assert torch.allclose(outs[0], ref, atol=1e-5, rtol=0)


def test_streamed_layers_are_read_from_the_mapped_file(tmp_path, model):
    path = _file(tmp_path, model)
    store = Storage(path)
    t = OffloadedTarget(store, model.config, 1)
    layers = t.model.model.layers
    assert all(p.device.type == "meta" for i in (1, 2, 3) for p in layers[i].parameters())
    assert all(p.device.type == "cpu" for p in layers[0].parameters())
    assert t.resident_bytes() < sum(store.nbytes(k) for k in store.entries)
    before = store.stats.bytes_read
    t.forward([3])
    streamed = sum(t.layer_bytes(i) for i in (1, 2, 3))
    row = store.nbytes("model.embed_tokens.weight") // model.config.vocab_size
    t.settle()       # the next pass's first streamed layer, read ahead while this one ended
    assert store.stats.bytes_read - before == streamed + row + t.layer_bytes(1)
    assert t.streamed_passes == 1
    # the bytes come from the file: change layer 3 on disk, the next pass changes
    ref = t.forward([5])
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.layers.3.mlp.down_proj.weight"].mul_(-1.0)
    t.crop(1)
    t.settle()
    store.close()
    path.unlink()
    save_file(sd, str(path))
    t.storage = Storage(path)
    assert not torch.equal(t.forward([5]), ref)


def test_emulated_bandwidth_is_paid(tmp_path, model):
    store = Storage(_file(tmp_path, model), StorageProfile("slow", 2e6))
    key = "model.layers.1.mlp.up_proj.weight"
    out = torch.empty(store.entries[key][1])
    t0 = time.perf_counter()
    n = store.read_into(key, out)
    assert time.perf_counter() - t0 >= n / 2e6 * 0.95
    assert store.stats.slept_s > 0 and store.stats.bytes_read == n
    assert parse_profile("emmc").bytes_per_s == 4e8
    assert parse_profile("250MB/s").bytes_per_s == 2.5e8
    with pytest.raises(ValueError):
        parse_profile("floppy")


def test_budget_picks_the_resident_layers(tmp_path, model):
    store = Storage(_file(tmp_path, model))
    s = sizes_of(store, model.config)
    assert s.weights == sum(store.nbytes(k) for k in store.entries)
    for R in range(2):
        exact = _memory(s, R, False, 2048)
        assert plan(s, exact, 2e9).resident_layers == R
        if R:
            assert plan(s, exact - 1, 2e9).resident_layers == R - 1
    # 2 resident + the streamed layers' two buffers cost what 4 resident layers do
    assert _memory(s, 2, False, 2048) == _memory(s, 4, False, 2048)
    assert plan(s, _memory(s, 2, False, 2048), 2e9).resident_layers == 4
    with pytest.raises(ValueError, match="below the minimum"):
        plan(s, _memory(s, 0, False, 2048) - 1, 2e9)
    full = plan(s, 10 * s.weights, 2e9)
    assert full.resident_layers == 4 and full.resident_embed
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(0.5, 100) == 50


def test_cost_model_on_the_real_shape():
    """Qwen2.5-Coder-1.5B in bf16: 93.6 MB layers, 467 MB head and embedding."""
    s = Sizes(93_603_840, 466_747_392, 466_747_392, 3072, 28, 1536, 151936, 28 * 1024)
    half = plan(s, s.weights // 2, 2e9, drafts=("exit",))
    assert 10 <= half.resident_layers <= 14 and half.memory <= s.weights // 2
    assert half.exit_layer == half.resident_layers and half.rate > half.ar_rate
    assert half.draft == "exit" and half.tail_layers == 0
    emmc = plan(s, s.weights // 2, 4e8, drafts=("exit",))
    assert emmc.t_full > half.t_full and emmc.depth >= half.depth
    assert plan(s, s.weights, 2e9).resident_layers == 28


def test_the_planner_picks_the_skip_draft_by_predicted_rate():
    """At 50 % and 75 % the measured skip agreement (SKIP_MEASURED) beats the exit
    head's at the same resident layers: the plan keeps the first R1 + last R2 layers,
    or the searched resident set where SKIP_SETS has one for R; at 100 % nothing is
    streamed and the skip draft is not offered."""
    from edge_sdk.local_target.budget import (SKIP_MEASURED, SKIP_SETS, skip_agreement,
                                              skip_layers, skip_split)

    s = Sizes(93_603_840, 466_747_392, 466_747_392, 3072, 28, 1536, 151936, 28 * 1024)
    for frac, bw in ((0.5, 2e9), (0.5, 4e8), (0.75, 2e9)):
        p = plan(s, int(s.weights * frac), bw)
        e = plan(s, int(s.weights * frac), bw, drafts=("exit",))
        assert p.draft == "skip" and p.exit_layer == 0 and p.depth >= 1
        assert p.resident_layers == e.resident_layers and p.memory == e.memory
        assert p.rate > e.rate > p.ar_rate
        if p.resident_layers in SKIP_SETS:     # the searched set, which beats the split
            assert p.layer_set == SKIP_SETS[p.resident_layers][0] and p.tail_layers == 0
            assert len(p.layer_set) == p.resident_layers
            assert SKIP_SETS[p.resident_layers][2] > SKIP_MEASURED[p.resident_layers][2]
        else:
            R1 = p.resident_layers - p.tail_layers
            assert R1 == skip_split(p.resident_layers, 28) and 1 <= R1 < p.resident_layers
            assert p.layer_set == ()
        ls = skip_layers(p.resident_layers, 28)
        assert len(set(ls)) == p.resident_layers and 0 in ls and max(ls) < 28
    assert plan(s, s.weights, 2e9).draft == "exit"
    assert skip_split(12, 28) == SKIP_MEASURED[12][0]
    assert skip_layers(4, 6) == (0, 3, 4, 5)              # another depth: the split
    assert skip_agreement(12, 28) > skip_agreement(12, 27)          # the set's figure
    assert 0 < skip_agreement(12, 28) < skip_agreement(14, 28) < skip_agreement(21, 28) < 1
    assert plan(s, s.weights // 2, 2e9, drafts=()).depth == 0       # the target alone
