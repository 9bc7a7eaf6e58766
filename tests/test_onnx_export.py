"""ONNX export, parity, the onnxruntime drafter and the TensorRT builder's guard.

A tiny random Llama (hidden 64, 2 layers, vocab 96) is exported once per module through
the CLI (fp32 + fp16 + int4); the real-model test exports ``smollm2-135m@4``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edge_sdk.drafters.onnx import (OnnxDrafter, OnnxRunner, _trt_shape_option,
                                    select_providers)
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.sampling import SamplingConfig, process_logits
from exporters.cli import export
from exporters.onnx.graph import _KVWrapper, io_names
from exporters.onnx.parity import check_parity
from exporters.tensorrt import profile_shapes, unavailable_reason

VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 96, 2, 2, 16
TRT_REASON = unavailable_reason()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0, bos_token_id=1)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0)  # peaky distributions: greedy choices far from ties
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    """Export through the CLI from a draft folder without tokenizer: fp32 + fp16 + int4
    + int8."""
    src = tmp_path_factory.mktemp("draft")
    model.save_pretrained(src)
    out = tmp_path_factory.mktemp("onnx") / "tiny-onnx"
    r = CliRunner().invoke(export, ["onnx", str(src), "--out", str(out), "--fp16", "--int4",
                                    "--int8", "--threads", "1"])
    assert r.exit_code == 0, r.output
    return out


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "specrelay_onnx.json").read_text())


# ----------------------------------------------------------------------------- export

def test_export_writes_graph_and_manifest_with_parity(exported):
    import onnx

    man = _manifest(exported)
    assert (man["num_layers"], man["num_kv_heads"], man["head_dim"], man["vocab_size"]) == (
        LAYERS, KV_HEADS, HEAD_DIM, VOCAB)
    assert man["dtype"] == "float32" and man["opset"] == 18
    par = man["parity"]
    assert par["passed"] and par["greedy_identical"] and par["steps"] == 64
    assert par["max_abs_logit_diff"] <= 1e-3
    g = onnx.load(str(exported / "model.onnx"), load_external_data=False).graph
    ins, outs = io_names(LAYERS)
    assert [i.name for i in g.input] == ins and [o.name for o in g.output] == outs
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(g.input) + list(g.output)}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert dims["past_key_values.1.value"] == ["batch_size", KV_HEADS, "past_sequence_length",
                                               HEAD_DIM]
    assert dims["present.0.key"][2] == "past_sequence_length + sequence_length"
    assert dims["logits"] == ["batch_size", "logits_length", VOCAB]
    assert dims["logits_to_keep"] == ["logits_length"]
    # variants: their own manifests, agreement measured against the fp32 graph
    for v, dtype in (("fp16", "float16"), ("int4", "float32")):
        vm = _manifest(exported / v)
        assert vm["kv_dtype"] == dtype
        agr = vm["agreement_vs_fp32"]
        assert 0.0 <= agr["greedy_agreement"] <= 1.0 and agr["steps"] == 64
    q = _manifest(exported / "int4")["quantization"]
    assert q["quantized_matmuls"] >= 7 * LAYERS
    # the CLI's unset block sizes are each variant's first-use setting (int4's decoder
    # layers and int8 differ)
    from edge_sdk.drafters.runtime import ONNX_VARIANTS
    want = ONNX_VARIANTS["int4"]
    assert (q["block_size"], q["lm_head_block_size"]) == (want["block_size"],
                                                          want["lm_head_block_size"])
    q8 = _manifest(exported / "int8")["quantization"]
    assert q8["block_size"] == ONNX_VARIANTS["int8"]["block_size"] != want["block_size"]
    assert q8["int8_matmuls"] == q8["quantized_matmuls"] >= 7 * LAYERS


def test_parity_check_detects_a_different_model(exported):
    other = tiny_llama(seed=5)
    res = check_parity(exported, other, steps=4, threads=1)
    assert not res["passed"] and res["max_abs_logit_diff"] > 1e-3


def test_empty_past_first_call_and_padded_batch_match_torch(model, exported):
    """Batch 2, past length 0, left padding in row 0; then a second call on the present."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    ins, _ = io_names(LAYERS)
    ids = torch.tensor([[0, 0, 5, 9, 17], [3, 44, 5, 9, 17]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    past = tuple(torch.zeros(2, KV_HEADS, 0, HEAD_DIM) for _ in range(2 * LAYERS))
    wrapper = _KVWrapper(model, LAYERS)
    with torch.no_grad():
        ref = wrapper(ids, mask, pos, past)
    keep = np.arange(5)
    got = sess.run(None, dict(zip(ins, [t.numpy() for t in (ids, mask, pos, *past)] + [keep])))
    valid = mask.bool()
    assert np.abs(got[0][valid.numpy()] - ref[0][valid].numpy()).max() < 1e-4
    # second call: one new token per row on top of the returned present tensors
    ids2 = torch.tensor([[7], [8]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    pos2 = pos[:, -1:] + 1
    with torch.no_grad():
        ref2 = wrapper(ids2, mask2, pos2, tuple(ref[1:]))
    got2 = sess.run(None, dict(zip(ins, [ids2.numpy(), mask2.numpy(), pos2.numpy(),
                                         *got[1:], np.arange(1)])))
    assert np.abs(got2[0] - ref2[0].numpy()).max() < 1e-4
    assert got2[1].shape == (2, KV_HEADS, 6, HEAD_DIM)


# ----------------------------------------------------------------------------- drafter

def _next_context(ctx, block, rng, vocab=VOCAB):
    """What verification could return: k drafts accepted, then a correction that differs
    from draft k (a rollback) or, when all were accepted, any bonus token."""
    k = rng.randint(0, len(block.tokens))
    nxt = list(ctx) + block.tokens[:k]
    if k < len(block.tokens):
        nxt.append((block.tokens[k] + 1 + rng.randrange(vocab - 1)) % vocab)
    else:
        nxt.append(rng.randrange(vocab))
    return nxt


def test_greedy_drafts_identical_to_torch_across_rollbacks(model, exported):
    td, od = TorchDrafter(model), OnnxDrafter(exported, threads=1)
    assert od.vocab_size == VOCAB and od.providers[0] == "CPUExecutionProvider"
    rng, cfg = random.Random(0), SamplingConfig()
    ctx = [1, 17, 23, 5, 60, 2, 9]
    for rnd in range(10):
        depth = 1 + rnd % 5
        bt, bo = td.propose(ctx, depth, cfg), od.propose(ctx, depth, cfg)
        assert bt.tokens == bo.tokens, f"round {rnd}"
        assert td.cache_len() == od.cache_len() == len(ctx) + depth - 1
        assert od.runner.ids == td.kv.ids
        ctx = _next_context(ctx, bo, rng)
        if rnd == 6:  # a context that diverges early: deep rollback
            ctx = ctx[:2] + [(ctx[2] + 1) % VOCAB] + ctx[3:]
    # a fresh, unrelated context rolls back to nothing
    bt, bo = td.propose([40, 41], 3, cfg), od.propose([40, 41], 3, cfg)
    assert bt.tokens == bo.tokens and od.cache_len() == 4
    # a fork shares the session, not the cache
    f = od.fork()
    assert f.runner.session is od.runner.session and f.cache_len() == 0
    assert f.propose([40, 41], 3, cfg).tokens == bo.tokens and od.cache_len() == 4


def test_sampled_drafts_match_torch_with_same_seed(model, exported):
    td, od = TorchDrafter(model), OnnxDrafter(exported, threads=1)
    cfg = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95)
    rng = random.Random(1)
    ctx = [1, 30, 31, 32]
    for rnd in range(6):
        gt = torch.Generator().manual_seed(100 + rnd)
        go = torch.Generator().manual_seed(100 + rnd)
        bt, bo = td.propose(ctx, 5, cfg, gt), od.propose(ctx, 5, cfg, go)
        assert bt.tokens == bo.tokens
        assert torch.allclose(bt.q_tok, bo.q_tok, atol=1e-5, rtol=0)
        assert torch.allclose(bt.q, bo.q, atol=1e-5, rtol=0)
        ctx = _next_context(ctx, bo, rng)


@pytest.mark.parametrize("variant", ["fp16", "int4"])
def test_reduced_precision_q_is_softmax_of_its_own_logits(exported, variant):
    """The q reported for a block is exactly the softmax of the logits the reduced-precision
    graph produced (CASES.md 3: the q on the wire is the q that was sampled from)."""
    od = OnnxDrafter(exported / variant, providers="cpu", threads=1)
    produced = []
    sync, step = od.sync, od.step
    od.sync = lambda c: produced.append(sync(c)) or produced[-1]
    od.step = lambda t: produced.append(step(t)) or produced[-1]
    cfg = SamplingConfig(temperature=0.7, top_k=30, top_p=0.9)
    g = torch.Generator().manual_seed(3)
    ctx = [1, 8, 15]
    for _ in range(3):
        produced.clear()
        block = od.propose(ctx, 4, cfg, g)
        assert len(produced) == 4
        for i, (logits, d) in enumerate(zip(produced, block.tokens)):
            if variant == "fp16":  # the graph's own fp16 values, widened exactly
                assert torch.equal(logits.half().float(), logits)
            q = torch.softmax(process_logits(logits, cfg), dim=-1)
            assert torch.equal(block.q[i], q)
            assert block.q_tok[i].item() == q[d].item() and q[d] > 0
        ctx = ctx + block.tokens[:2] + [(block.tokens[2] + 1) % VOCAB]


class _MaskedHead(torch.nn.Module):
    """Like a distilled draft's reduced head: logits over the full vocabulary, -inf
    outside the kept ids."""

    def __init__(self, weight, kept):
        super().__init__()
        self.vocab_size = int(weight.shape[0])
        self.register_buffer("kept_ids", kept)
        self.register_buffer("sub_weight", weight.detach()[kept].clone())

    def forward(self, h):
        sub = torch.nn.functional.linear(h, self.sub_weight)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy(-1, self.kept_ids, sub)


def test_reduced_head_with_inf_logits_exports_and_drafts(tmp_path):
    """-inf logits (a reduced draft head) survive export, parity and sampling."""
    import copy

    from exporters.onnx.graph import export_graph, kv_geometry
    from exporters.onnx.manifest import write_manifest

    m = copy.deepcopy(tiny_llama(seed=2))
    kept = torch.arange(0, VOCAB, 3)
    m.lm_head = _MaskedHead(m.lm_head.weight, kept)
    export_graph(m, tmp_path / "model.onnx")
    write_manifest(tmp_path, kv_geometry(m.config))
    par = check_parity(tmp_path, m, steps=16, threads=1)
    assert par["passed"], par
    td, od = TorchDrafter(m), OnnxDrafter(tmp_path, threads=1)
    cfg = SamplingConfig(temperature=1.0)
    for seed in range(3):
        bt = td.propose([1, 2, 3], 4, cfg, torch.Generator().manual_seed(seed))
        bo = od.propose([1, 2, 3], 4, cfg, torch.Generator().manual_seed(seed))
        assert bt.tokens == bo.tokens and all(t % 3 == 0 for t in bo.tokens)
        assert torch.equal(bo.q[:, 1::3], torch.zeros_like(bo.q[:, 1::3]))
        assert torch.allclose(bt.q, bo.q, atol=1e-5, rtol=0)


def test_runner_empty_past_and_crop_invariant(exported):
    r = OnnxRunner(exported, providers="cpu", threads=1)
    assert r.cache_len() == 0
    full = r.forward([3, 4, 5, 6]).numpy()  # first call: past length 0
    r.crop(2)
    assert r.cache_len() == 2 and r.ids == [3, 4]
    again = r.forward([5, 6]).numpy()
    assert np.abs(full[2:] - again).max() < 1e-5
    with pytest.raises(ValueError):
        r.crop(9)
    r.reset()
    assert r.cache_len() == 0


def test_runner_logits_to_keep_rows_and_older_exports(model, exported, tmp_path):
    """``last=n`` returns the last n rows of the all-rows call and leaves the same KV
    cache; a prefill through ``sync`` asks the graph for its last row only; an export
    without the ``logits_to_keep`` input (as before it existed) gives the same rows."""
    from exporters.onnx.graph import export_graph

    ids = [3, 4, 5, 6, 7, 8]
    r = OnnxRunner(exported, providers="cpu", threads=1)
    assert r.keeps_logits
    full = r.forward(ids).numpy()
    past_full = [p.copy() for p in r.past]
    for n in (1, 2, 6, 9):
        r.reset()
        rows = r.forward(ids, last=n).numpy()
        assert rows.shape == (min(n, 6), VOCAB)
        assert np.abs(rows - full[-min(n, 6):]).max() < 1e-5
        assert all(np.array_equal(a, b) for a, b in zip(r.past, past_full))
    r.reset()
    asked = []
    run = r.session.run
    r.session = type("S", (), {"run": lambda _, names, feeds: (
        asked.append(feeds["logits_to_keep"].tolist()), run(names, feeds))[1]})()
    got = r.sync(ids + [9]).numpy()
    assert asked == [[6]] and got.shape == (VOCAB,)
    export_graph(model, tmp_path / "model.onnx", logits_to_keep=False)
    (tmp_path / "specrelay_onnx.json").write_text(
        (exported / "specrelay_onnx.json").read_text())
    old = OnnxRunner(tmp_path, providers="cpu", threads=1)
    assert not old.keeps_logits
    assert np.abs(old.forward(ids, last=2).numpy() - full[-2:]).max() < 1e-5
    assert np.abs(old.sync(ids + [9]).numpy() - got).max() < 1e-5


def test_provider_selection():
    assert select_providers()[-1] == "CPUExecutionProvider"
    assert select_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="not installed"):
        select_providers(["NoSuchExecutionProvider"])


# ----------------------------------------------------------------------------- tensorrt

def test_tensorrt_profiles_cover_every_past_input():
    man = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16}
    shapes = profile_shapes(man, max_batch=2, max_seq=64, max_past=512, opt_past=128)
    ins, _ = io_names(3)
    assert set(shapes) == set(ins)
    assert shapes["logits_to_keep"] == {"min": [1], "opt": [1], "max": [64]}
    # an export from before the input: no profile for it
    old = profile_shapes(dict(man, inputs=[n for n in ins if n != "logits_to_keep"]))
    assert "logits_to_keep" not in old and len(old) == len(ins) - 1
    for i in range(3):
        s = shapes[f"past_key_values.{i}.value"]
        assert s["min"] == [1, 2, 0, 16] and s["opt"] == [1, 2, 128, 16]
        assert s["max"] == [2, 2, 512, 16]
    assert shapes["attention_mask"]["max"] == [2, 576]
    # the same profile is handed to onnxruntime's TensorRT EP as option strings
    assert "past_key_values.2.key:1x2x0x16" in _trt_shape_option(shapes, "min")


@pytest.mark.skipif(TRT_REASON is not None, reason=f"TensorRT unavailable: {TRT_REASON}")
def test_tensorrt_engine_build(exported, tmp_path):
    from exporters.tensorrt import build_engine

    man = build_engine(exported, tmp_path, fp16=True, max_past=256, max_seq=32)
    assert (tmp_path / "model.engine").stat().st_size > 0
    assert man["tensorrt_version"] and man["device"]
    assert json.loads((tmp_path / "specrelay_trt.json").read_text())["profiles"]


def test_tensorrt_cli_exits_cleanly_without_gpu(exported):
    if TRT_REASON is None:
        pytest.skip("TensorRT is available here: test_tensorrt_engine_build covers it")
    r = CliRunner().invoke(export, ["tensorrt", str(exported)])
    assert r.exit_code == 3
    assert TRT_REASON in r.output and "Traceback" not in r.output


def test_cli_help_documents_both_commands():
    r = CliRunner().invoke(export, ["--help"])
    assert r.exit_code == 0
    for word in ("onnx", "tensorrt", "Examples", "specrelay export onnx",
                 "specrelay export tensorrt"):
        assert word in r.output
    for cmd, opts in (("onnx", ("--out", "--fp16", "--int4", "--no-parity", "--opset")),
                      ("tensorrt", ("--out", "--fp16", "--int8", "--workspace-gb"))):
        h = CliRunner().invoke(export, [cmd, "--help"]).output
        assert "Examples" in h and all(o in h for o in opts)


# ----------------------------------------------------------------------------- real model

@pytest.mark.real_model
def test_real_draft_export_parity(tmp_path):
    """Export the real draft (or the first 4 layers of SmolLM2-135M) and check parity."""
    from edge_sdk.models import load_model
    from exporters.onnx.export import export_onnx
    from exporters.onnx.parity import PARITY_TEXTS

    asset = Path(__file__).resolve().parents[1] / "edge_sdk/assets/drafts/smollm2-135m-draft"
    spec = str(asset) if any((asset / f).exists() for f in (
        "specrelay_draft.json", "config.json")) else "smollm2-135m@4"
    threads = torch.get_num_threads()
    try:
        m, tok = load_model(spec, threads=2)
    except (ModuleNotFoundError, OSError) as e:
        pytest.skip(f"{spec} not available offline: {e}")
    try:
        man = export_onnx(m, tmp_path, prompts=[tok(PARITY_TEXTS[0])["input_ids"]],
                          parity_steps=64, source=spec, threads=2)
    finally:
        torch.set_num_threads(threads)
    par = man["parity"]
    assert par["passed"], par
    assert par["max_abs_logit_diff"] <= 1e-3 and par["greedy_matches"] == 64
