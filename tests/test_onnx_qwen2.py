"""ONNX export of the Qwen2 architecture (the default draft, Qwen2.5-Coder-0.5B):
attention biases, tied / untied heads, GQA, rope theta, sliding-window configs, the
int4 (MatMulNBits) variant with an 8-bit head, and the cached draft runtimes of
``edge_sdk.drafters.runtime``.

Tiny random Qwen2 models (2 layers, hidden 64, vocab 512) keep this fast; one
``real_model`` test exports the real 0.5B draft to int4.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_sdk.drafters.base import Proposal
from edge_sdk.drafters.onnx import PREFILL_CHUNK, OnnxDrafter, OnnxRunner
from edge_sdk.drafters.runtime import ONNX_VARIANTS
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.sampling import SamplingConfig
from exporters.onnx.export import export_onnx
from exporters.onnx.fuse import ROTARY_MARGIN
from exporters.onnx.graph import export_graph
from exporters.onnx.parity import check_parity
from exporters.onnx.quantize import quantize_int4, quantize_int8

VOCAB, LAYERS, HEADS, KV_HEADS, HIDDEN = 512, 2, 4, 2, 64


def tiny_qwen2(seed: int = 0, tie: bool = True, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rope_theta=1e6, tie_word_embeddings=tie, eos_token_id=0,
                      bos_token_id=1, **kw)
    torch.manual_seed(seed)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.mul_(4.0)  # peaky distributions: greedy choices far from ties
            if name.endswith("proj.bias"):
                p.add_(torch.randn_like(p))  # biases that matter
    return m.eval().requires_grad_(False)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "specrelay_onnx.json").read_text())


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2-onnx")
    export_onnx(model, out, fp16=True, int4=True, parity_steps=32, threads=1,
                prompts=[[1, 17, 230, 5, 480, 2, 9, 77]], source="tiny-qwen2")
    return out


def test_qwen2_export_parity_and_manifest(exported):
    man = _manifest(exported)
    assert man["model_type"] == "qwen2" and man["architecture"] == "Qwen2ForCausalLM"
    assert (man["num_layers"], man["num_kv_heads"], man["head_dim"], man["vocab_size"]) == (
        LAYERS, KV_HEADS, HIDDEN // HEADS, VOCAB)
    par = man["parity"]
    assert par["passed"] and par["greedy_identical"], par
    assert par["max_abs_logit_diff"] <= 1e-3
    q = _manifest(exported / "int4")["quantization"]
    # q, k, v, o, gate, up, down per layer + the tied head (a transposed copy)
    assert q["quantized_matmuls"] == 7 * LAYERS + 1 and q["float_matmuls_left"] == 2 * LAYERS
    # export_onnx's int4 is the first-use export's: the head at its own block size
    want = ONNX_VARIANTS["int4"]
    assert (q["block_size"], q["lm_head_block_size"]) == (want["block_size"],
                                                          want["lm_head_block_size"])
    for v in ("fp16", "int4"):
        assert 0.0 <= _manifest(exported / v)["agreement_vs_fp32"]["greedy_agreement"] <= 1.0


def test_an_export_folder_drafts_with_the_variant_its_suffix_names(exported):
    """``specrelay export onnx --int4`` writes OUT (float32) and OUT/int4: ``OUT+onnx-int4``
    drafts with OUT/int4, OUT as is with the float32 graph and one line saying so, and a
    variant the folder lacks is refused in one line naming the ones it has."""
    from edge_sdk.drafters import runtime as rt

    said = []
    d, tok = rt.build_drafter(str(exported), echo=said.append)
    assert tok is None and d.runner.folder == exported
    assert len(said) == 1 and "float32 graph" in said[0] and "fp16, int4" in said[0], said
    assert f"{exported}+onnx-int4" in said[0]
    for spec, kw in ((f"{exported}+onnx-int4", {}), (str(exported), {"runtime": "onnx-int4"})):
        said.clear()
        d4, _ = rt.build_drafter(spec, echo=said.append, **kw)
        assert d4.runner.folder == exported / "int4" and not said
        assert d4.manifest["quantization"]["bits"] == 4
    assert rt.build_drafter(f"{exported}+onnx-fp32")[0].runner.folder == exported
    with pytest.raises(ValueError, match=r"runs as onnx-fp32, onnx-fp16, onnx-int4 "):
        rt.build_drafter(f"{exported}+onnx-int8")
    # a graph folder without variants runs as is, silently, and answers to its own name
    said.clear()
    assert rt.build_drafter(str(exported / "int4"), echo=said.append)[0].runner.folder == (
        exported / "int4") and not said
    assert rt.build_drafter(f"{exported / 'int4'}+onnx-int4")[0].runner.folder == (
        exported / "int4")
    with pytest.raises(ValueError, match=r"runs as onnx-int4 \("):
        rt.build_drafter(f"{exported / 'int4'}+onnx-fp32")


def test_qwen2_attention_biases_are_in_the_graph(model, exported):
    """A model that differs only in one k_proj bias fails the parity check."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.bias.add_(2.0)
        other.model.layers[0].self_attn.q_proj.bias.mul_(-1.0)
    res = check_parity(exported, other, steps=4, prompt=[3, 4, 5, 6, 7], threads=1)
    assert not res["passed"] and res["max_abs_logit_diff"] > 1e-2


def test_qwen2_greedy_drafts_identical_to_torch_across_rollbacks(model, exported):
    """GQA + rope at shifted positions: the ONNX drafter reproduces torch's greedy
    drafts through accept / reject / rollback rounds."""
    td, od = TorchDrafter(model), OnnxDrafter(exported, threads=1)
    rng, cfg = random.Random(0), SamplingConfig()
    ctx = [1, 17, 230, 5, 480, 2, 9]
    for rnd in range(8):
        depth = 1 + rnd % 4
        bt, bo = td.propose(ctx, depth, cfg), od.propose(ctx, depth, cfg)
        assert bt.tokens == bo.tokens, f"round {rnd}"
        assert od.cache_len() == td.cache_len() == len(ctx) + depth - 1
        k = rng.randint(0, depth)
        ctx = ctx + bo.tokens[:k] + [rng.randrange(VOCAB)]
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    bt = td.propose(ctx, 4, cfg, torch.Generator().manual_seed(7))
    bo = od.propose(ctx, 4, cfg, torch.Generator().manual_seed(7))
    assert bt.tokens == bo.tokens and torch.allclose(bt.q, bo.q, atol=1e-5, rtol=0)


def test_qwen2_untied_head_int4_with_8bit_head(tmp_path):
    """Untied LM head (as in the dequantised Qwen2.5 GGUF): exported, parity-checked,
    and quantised with the head at 8 bits (``lm_head_bits=8``)."""
    m = tiny_qwen2(seed=3, tie=False)
    export_graph(m, tmp_path / "model.onnx")
    par = check_parity(tmp_path / "model.onnx", m, steps=16, threads=1)
    assert par["passed"], par
    info = quantize_int4(tmp_path / "model.onnx", tmp_path / "q" / "model.onnx",
                         lm_head_bits=8)
    assert info["quantized_matmuls"] == 7 * LAYERS + 1 and info["int8_matmuls"] == 1
    assert info["lm_head_bits"] == 8
    info4 = quantize_int4(tmp_path / "model.onnx", tmp_path / "q4" / "model.onnx",
                          lm_head=False)
    assert info4["quantized_matmuls"] == 7 * LAYERS and info4["lm_head_bits"] is None


def test_int4_norms_and_rotary_are_fused_and_draft_as_the_unfused_graph(exported,
                                                                       tmp_path):
    """The int4 graph (the first-use export's settings) has its RMSNorms fused into
    onnxruntime's SimplifiedLayerNormalization (the first norm) and
    SkipSimplifiedLayerNormalization (every other: residual add + norm), and its rotary
    embeddings (query and key of each layer) into RotaryEmbedding; no traced norm or
    rotate-half node is left. Its logits match the same quantisation left unfused up to
    float rounding, with the same greedy tokens, also past a rollback and at positions
    a batch left-pads (draft_batched's position ids)."""
    import onnx

    for v in ("int4", "int8"):
        assert ONNX_VARIANTS[v]["fuse_norms"] and ONNX_VARIANTS[v]["fuse_rotary"]
    fused = exported / "int4"
    rope = 512 + ROTARY_MARGIN             # the config's positions and the margin
    assert _manifest(fused)["quantization"]["fused"] == {
        "rms_norms": 1, "skip_rms_norms": 2 * LAYERS, "rotary": 2 * LAYERS,
        "rotary_positions": rope}
    ops = [n.op_type for n in onnx.load(str(fused / "model.onnx")).graph.node]
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Neg", "Cos", "Sin"} & set(ops)
    plain = tmp_path / "plain"
    info = quantize_int4(exported / "model.onnx", plain / "model.onnx",
                         block_size=ONNX_VARIANTS["int4"]["block_size"],
                         lm_head_block_size=ONNX_VARIANTS["int4"]["lm_head_block_size"])
    assert "fused" not in info
    info8 = quantize_int8(exported / "model.onnx", tmp_path / "q8" / "model.onnx",
                          **{k: v for k, v in ONNX_VARIANTS["int8"].items() if k != "bits"},
                          max_positions=512)
    assert info8["int8_matmuls"] == 7 * LAYERS + 1 and info8["fused"]["rotary"] == 2 * LAYERS
    (plain / "specrelay_onnx.json").write_text(json.dumps(
        dict(_manifest(fused), quantization=info)))
    plain_ops = [n.op_type for n in onnx.load(str(plain / "model.onnx")).graph.node]
    assert {"ReduceMean", "Neg", "Cos"} <= set(plain_ops)
    rf, rp = OnnxRunner(fused, threads=1), OnnxRunner(plain, threads=1)
    prompt = [1, 17, 230, 5, 480, 2, 9, 77]
    lf, lp = rf.forward(prompt), rp.forward(prompt)
    assert torch.allclose(lf, lp, atol=1e-2 * float(lp.abs().max()), rtol=0)
    assert torch.equal(lf.argmax(-1), lp.argmax(-1))
    cfg = SamplingConfig()
    df, dp = OnnxDrafter(fused, threads=1), OnnxDrafter(plain, threads=1)
    ctx = list(prompt)
    for rnd in range(4):
        bf, bp = df.propose(ctx, 6, cfg), dp.propose(ctx, 6, cfg)
        assert bf.tokens == bp.tokens, f"round {rnd}"
        ctx = ctx + bf.tokens[:rnd] + [(7 * rnd + 3) % VOCAB]
    # the rotary caches cover the config's 512 positions and the margin, computed as
    # the traced graph computes them (past the config's 512 too); past them, a clear
    # refusal
    assert (rf.max_positions, rp.max_positions) == (rope, None)
    far = [(5 * i + 1) % VOCAB for i in range(rope - 4)]
    rf.reset(), rp.reset()
    lf, lp = rf.forward(far, last=4), rp.forward(far, last=4)
    assert torch.allclose(lf, lp, atol=1e-2 * float(lp.abs().max()), rtol=0)
    with pytest.raises(ValueError, match=f"covers {rope} positions.*needs {rope + 1}"):
        rf.forward([5] * 5)
    with pytest.raises(ValueError, match=f"covers {rope} positions"):
        OnnxDrafter.propose_many([df.fork(), df.fork()],
                                 [Proposal([5] * 8, 4, cfg), Proposal(far + [5, 5], 4, cfg)])
    forks = [df.fork() for _ in range(2)]
    props = [Proposal(ctx[:n], 3, cfg) for n in (5, len(ctx))]
    got = OnnxDrafter.propose_many(forks, props)
    assert [b.tokens for b in got] == [dp.propose(p.context, 3, cfg).tokens for p in props]


def test_graph_profile_splits_a_decode_step_by_operator(exported):
    """``bench.probes.graph_profile``: per decode step, each operator's kernel time and
    calls from onnxruntime's profiler (the fused int4 graph: 7 MatMulNBits a layer and
    the head, 2 RotaryEmbedding a layer), all kernels, and the whole run."""
    from bench.probes.graph_profile import profile

    p = profile(str(exported / "int4"), context=8, steps=3)
    # a prefill longer than one graph call (PREFILL_CHUNK) is not counted as decode
    long = profile(str(exported / "int4"), context=PREFILL_CHUNK + 8, steps=3)
    assert long["ops"]["MatMulNBits"]["calls"] == 7 * LAYERS + 1
    assert p["ops"]["MatMulNBits"]["calls"] == 7 * LAYERS + 1
    assert p["ops"]["RotaryEmbedding"]["calls"] == 2 * LAYERS
    assert "ReduceMean" not in p["ops"] and p["nodes"] > 0
    assert 0 < p["kernel_ms"] <= p["run_ms"]


def test_draft_quant_agreement_is_the_chains_accepted_length(exported):
    """bench.probes.draft_quant: teacher-forced on a continuation that is the graph's own
    greedy output, every position agrees and acc@D is the accepted length of a depth-D
    chain started there (D, cut by the continuation's end); a wrong token at position k
    is a miss there and caps the chains started before it at k."""
    from bench.probes.draft_quant import _agreement

    r = OnnxRunner(exported, threads=1)
    prompt, cont = [1, 17, 230, 5], []
    logits = r.forward_np(prompt, last=1)
    for _ in range(10):
        cont.append(int(logits[-1].argmax()))
        logits = r.forward_np(cont[-1:], last=1)
    assert _agreement(r, prompt, cont, 4)[:3] == (10, 10, 4 * 7 + 3 + 2 + 1)
    bad = cont[:5] + [(cont[5] + 1) % VOCAB] + cont[6:]
    m, n, acc, _ = _agreement(r, prompt, bad, 4)
    assert n == 10 and m <= 9 and acc >= 4 + 4 + 3 + 2 + 1 and r.cache_len() == 4 + 9


def test_long_runs_go_through_the_graph_in_chunks(model, exported, monkeypatch):
    """Chunked prefill: a run longer than PREFILL_CHUNK is appended in calls of at most
    that many tokens (bounded attention memory for a long prompt) and leaves the cache,
    and the logits of its last rows (across chunk borders too), as one call does; the
    torch prefill chunks the same way."""
    import edge_sdk.drafters.onnx as onnx_mod
    from edge_sdk.drafters.prefill import TorchPrefill

    ctx = torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    whole = OnnxRunner(exported, threads=1)
    want = whole.forward_np(ctx, last=9)
    monkeypatch.setattr(onnx_mod, "PREFILL_CHUNK", 5)
    chunked = OnnxRunner(exported, threads=1)
    sizes = []
    run = chunked._run
    chunked._run = lambda ids, rows: (sizes.append((len(ids), rows)), run(ids, rows))[1]
    got = chunked.forward_np(ctx, last=9)
    assert sizes == [(5, 1), (5, 1), (5, 1), (5, 5), (3, 3)]   # rows 14..22 = the last 9
    assert got.shape == want.shape == (9, VOCAB) and np.allclose(got, want, atol=1e-4)
    assert chunked.ids == ctx and chunked.cache_len() == 23
    for x, y in zip(chunked.past, whole.past):
        assert np.allclose(x, y, atol=1e-4, rtol=0)
    more = ctx[:3] * 4                       # 12 more over a 23-token past: 5 + 5 + 2
    assert np.allclose(chunked.forward_np(more, last=1), whole.forward_np(more, last=1),
                       atol=1e-4)
    pf, calls = TorchPrefill(model, min_tokens=4), []
    extend = TorchPrefill.extend
    monkeypatch.setattr(TorchPrefill, "extend",
                        lambda self, r, t: (calls.append(len(t)), extend(self, r, t))[1])
    viat = OnnxRunner(exported, threads=1)
    pf.extend(viat, ctx[:12])
    assert calls == [12, 5, 5, 2] and viat.ids == ctx[:12]
    for x, y in zip(viat.past, whole.past):
        assert np.allclose(x, y[:, :, :12], atol=1e-4, rtol=0)


def test_a_chunked_prefill_stops_at_a_chunk_border_when_asked(exported, monkeypatch):
    """``stop_prefill(True)`` from another thread: the chunked run raises
    PrefillStopped at its next chunk border with the chunks done cached (consistent), a
    later sync reuses them and returns the one-call logits; a stop asked before a sync
    began does not stop it."""
    import edge_sdk.drafters.onnx as onnx_mod
    from edge_sdk.drafters.base import PrefillStopped

    ctx = torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(6)).tolist()
    want = OnnxDrafter(exported, threads=1).sync(ctx)
    monkeypatch.setattr(onnx_mod, "PREFILL_CHUNK", 5)
    d = OnnxDrafter(exported, threads=1)
    run = d.runner._run

    def run_then_ask(ids, rows):                  # the request ends after chunk 2
        out = run(ids, rows)
        if d.runner.cache_len() == 10:
            d.stop_prefill(True)
        return out
    d.runner._run = run_then_ask
    with pytest.raises(PrefillStopped, match="after 10 of 23"):
        d.sync(ctx)
    assert d.runner.ids == ctx[:10] and d.cache_len() == 10 and not d.runner.stopping
    d.runner._run = run
    assert torch.allclose(d.sync(ctx), want, atol=1e-4) and d.cache_len() == 23
    d.runner.reset()
    d.stop_prefill(True)                          # stale: asked before the sync began
    assert torch.allclose(d.sync(ctx), want, atol=1e-4)


def test_torch_prefill_fills_the_cache_as_the_graph_does(model, exported):
    """A runner whose long catch-ups go through the torch model (TorchPrefill) holds the
    keys/values and returns the logits the float32 graph does: from an empty cache,
    on top of a cached past after a rollback, and in batched drafting (forks share the
    prefill); a catch-up shorter than ``min_tokens`` stays on the graph."""
    from edge_sdk.drafters.prefill import TorchPrefill

    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(2, VOCAB, (40,), generator=g).tolist()
    plain, hybrid = OnnxDrafter(exported, threads=1), OnnxDrafter(exported, threads=1)
    pf = TorchPrefill(model, min_tokens=4)
    calls = []
    extend = pf.extend
    pf.extend = lambda r, t: (calls.append(len(t)), extend(r, t))[1]
    hybrid.runner.prefill = pf

    def same(a, b):
        assert a.runner.ids == b.runner.ids
        for x, y in zip(a.runner.past, b.runner.past):
            assert x.dtype == y.dtype and np.allclose(x, y, atol=1e-4, rtol=0)

    assert torch.allclose(plain.sync(ctx), hybrid.sync(ctx), atol=1e-3, rtol=0)
    assert calls == [39]
    same(plain, hybrid)
    ctx2 = ctx[:30] + torch.randint(2, VOCAB, (12,), generator=g).tolist()
    assert torch.allclose(plain.sync(ctx2), hybrid.sync(ctx2), atol=1e-3, rtol=0)
    assert calls == [39, 11]                       # 11 tokens over a 30-token past
    same(plain, hybrid)
    cfg = SamplingConfig()
    assert plain.propose(ctx2 + [7, 8], 4, cfg).tokens == hybrid.propose(
        ctx2 + [7, 8], 4, cfg).tokens
    assert calls == [39, 11]                       # 2 missing tokens: the graph
    a, b = hybrid.fork(), hybrid.fork()
    assert a.runner.prefill is pf and a.runner.ids == []
    ctxs = [ctx[:20], ctx2[:25]]
    props = [Proposal(c, 3, cfg) for c in ctxs]
    got = OnnxDrafter.propose_many([a, b], props)
    assert calls == [39, 11, 19, 24]               # each catch-up, then one batch
    want = [plain.propose(c, 3, cfg).tokens for c in ctxs]
    assert [blk.tokens for blk in got] == want
    with pytest.raises(ValueError, match="at least one token"):
        pf.extend(a.runner, [])


def test_torch_prefill_refuses_another_geometry_and_build_drafter_wires_it(
        exported, monkeypatch, tmp_path):
    """A prefill model of another shape is refused; ``build_drafter(prefill=...)``
    attaches one (``torch``), none (``off``, and ``auto`` by default: opt-in), follows
    $SPECRELAY_DRAFT_PREFILL under ``auto`` and names the choices for a wrong value."""
    from edge_sdk.drafters import runtime as rt
    from edge_sdk.drafters.prefill import TorchPrefill

    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = TorchPrefill(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS + 1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS)).eval())
    r = OnnxRunner(exported, threads=1)
    with pytest.raises(ValueError, match="differ in shape"):
        other.extend(r, list(range(2, 40)))
    assert r.cache_len() == 0
    m = tiny_qwen2(seed=5)
    src = tmp_path / "draft"
    m.save_pretrained(src)
    _save_tokenizer(src)
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    from exporters.onnx import first_use as fu

    d, _ = fu.build_drafter(str(src) + "+onnx-int4", prefill="torch")
    assert isinstance(d.runner.prefill, TorchPrefill)
    assert d.runner.prefill.model.dtype == torch.bfloat16
    assert rt.build_drafter(str(src) + "+onnx-int4", prefill="off")[0].runner.prefill is None
    monkeypatch.delenv("SPECRELAY_DRAFT_PREFILL", raising=False)
    assert rt.build_drafter(str(src) + "+onnx-int4")[0].runner.prefill is None
    monkeypatch.setenv("SPECRELAY_DRAFT_PREFILL", "torch")
    assert isinstance(rt.build_drafter(str(src) + "+onnx-int4")[0].runner.prefill,
                      TorchPrefill)
    monkeypatch.setenv("SPECRELAY_DRAFT_PREFILL", "gpu")
    with pytest.raises(ValueError, match="expected torch or off"):
        rt.build_drafter(str(src) + "+onnx-int4")
    with pytest.raises(ValueError, match="one of auto, torch, off"):
        rt.build_drafter(str(src) + "+onnx-int4", prefill="amx")


def test_subset_head_export_drafts_only_its_tokens(model, monkeypatch, tmp_path):
    """FR-Spec head: with a shipped ranking for the tokenizer, ``export_onnx(...,
    int4_head_vocab=K)`` keeps the first K ranked rows of the int4 LM head (plus the
    added tokens), records their ids beside the graph, and the runner returns
    full-vocabulary logits: the full int4 graph's on those ids, -inf elsewhere. Greedy
    and sampled drafts stay inside the subset, and the sampled q is 0 outside it."""
    from edge_sdk.models import tokenizer_fingerprint
    from exporters.onnx import head_vocab
    from tests.conftest import tiny_tokenizer

    tok = tiny_tokenizer(VOCAB)
    monkeypatch.setattr(head_vocab, "ASSETS", tmp_path / "assets")
    (tmp_path / "assets").mkdir()
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2)).numpy()
    np.save(head_vocab.asset_path(tokenizer_fingerprint(tok)), order.astype(np.int32))
    prompts = [[1, 17, 230, 5, 480, 2, 9, 77]]
    full, sub = tmp_path / "full", tmp_path / "sub"
    export_onnx(model, full, int4=True, parity_steps=8, threads=1, prompts=prompts,
                int4_head_vocab=None, tokenizer=tok)
    export_onnx(model, sub, int4=True, parity_steps=8, threads=1, prompts=prompts,
                int4_head_vocab=200, tokenizer=tok)
    man = _manifest(sub / "int4")
    ids = np.load(sub / "int4" / man["head_ids"])
    want = sorted(set(order[:200].tolist()) | set(tok.added_tokens_decoder))
    assert ids.tolist() == want and man["head_vocab"] == {"rows": len(want)}
    assert man["quantization"]["head_rows"] == len(want)
    assert "head_ids" not in _manifest(full / "int4")
    agr = man["agreement_vs_fp32"]          # compared on the kept ids: finite differences
    assert agr["head_vocab"] == len(want) and 0.0 <= agr["greedy_agreement"] <= 1.0
    assert 0.0 < agr["max_abs_logit_diff"] < 1e3 and math.isfinite(agr["mean_abs_logit_diff"])
    rf, rs = OnnxRunner(full / "int4", threads=1), OnnxRunner(sub / "int4", threads=1)
    assert rs.vocab_size == VOCAB and rs.session.get_outputs()[0].shape[-1] == len(want)
    lf, ls = rf.forward_np(prompts[0], last=2), rs.forward_np(prompts[0], last=2)
    assert ls.shape == lf.shape == (2, VOCAB)
    out = np.setdiff1d(np.arange(VOCAB), ids)
    assert np.isneginf(ls[:, out]).all() and np.isfinite(ls[:, ids]).all()
    assert np.allclose(ls[:, ids], lf[:, ids], atol=1e-4, rtol=0)
    d = OnnxDrafter(sub / "int4", threads=1)
    blk = d.propose(prompts[0], 6, SamplingConfig())
    assert set(blk.tokens) <= set(want)
    blk = d.propose(prompts[0], 6, SamplingConfig(temperature=1.5),
                    torch.Generator().manual_seed(0))
    assert set(blk.tokens) <= set(want) and float(blk.q[:, out].sum()) == 0.0
    assert torch.allclose(blk.q.sum(-1), torch.ones(6, dtype=blk.q.dtype))
    a, b = d.fork(), d.fork()                      # batched drafting maps ids too
    got = OnnxDrafter.propose_many([a, b], [Proposal(prompts[0], 3, SamplingConfig()),
                                            Proposal(prompts[0][:5], 3, SamplingConfig())])
    assert got[0].tokens == d.propose(prompts[0], 3, SamplingConfig()).tokens
    assert all(set(g.tokens) <= set(want) for g in got)


def test_head_vocab_ranking_and_its_checks(monkeypatch, tmp_path):
    """The ranking puts the BPE merge-order prefix first, then the corpus shares; a
    tokenizer without a shipped ranking keeps its whole head, a ranking that does not
    fit the vocabulary is refused, and the quantiser refuses head ids that are not
    sorted, unique ids of the head."""
    from edge_sdk.models import tokenizer_fingerprint
    from exporters.onnx import head_vocab
    from tests.conftest import tiny_tokenizer

    shares = [np.array([0, 0, 0, 1, 5, 0, 9, 2.0]), np.array([0, 0, 0, 0, 1, 0, 1, 0.0])]
    assert head_vocab.rank_vocab(shares, 8, merge_prefix=2).tolist() == [0, 1, 6, 4, 7,
                                                                          3, 2, 5]
    tok = tiny_tokenizer(VOCAB)
    monkeypatch.setattr(head_vocab, "ASSETS", tmp_path)
    assert head_vocab.head_ids(tok, 100, VOCAB) is None          # no ranking shipped
    np.save(head_vocab.asset_path(tokenizer_fingerprint(tok)), np.arange(VOCAB + 1))
    with pytest.raises(ValueError, match="does not fit"):
        head_vocab.head_ids(tok, 100, VOCAB)
    m = tiny_qwen2(seed=5, tie=False)
    export_graph(m, tmp_path / "model.onnx")
    for bad in ([5, 3, 9], [1, 1, 2], [0, VOCAB]):
        with pytest.raises(ValueError, match="sorted unique ids"):
            quantize_int4(tmp_path / "model.onnx", tmp_path / "q" / "model.onnx",
                          head_ids=bad)


def test_int4_head_with_its_own_block_size(tmp_path):
    """``lm_head_block_size``: the LM head's MatMulNBits has its own weights per scale
    (the first-use int4 export's 128), every decoder-layer MatMul keeps ``block_size``;
    the quantised graph still drafts (finite logits, the cache grows); a block size
    that is not a power of 2 >= 16 is refused before anything is written."""
    import onnx

    m = tiny_qwen2(seed=5, tie=False)
    export_graph(m, tmp_path / "model.onnx")
    info = quantize_int4(tmp_path / "model.onnx", tmp_path / "q" / "model.onnx",
                         block_size=16, lm_head_block_size=32)
    assert info["block_size"] == 16 and info["lm_head_block_size"] == 32
    assert info["quantized_matmuls"] == 7 * LAYERS + 1 and info["int8_matmuls"] == 0
    g = onnx.load(str(tmp_path / "q" / "model.onnx"), load_external_data=False).graph
    blocks = {}
    for n in g.node:
        if n.op_type == "MatMulNBits":
            size = next(a.i for a in n.attribute if a.name == "block_size")
            blocks.setdefault(size, []).append(n)
    assert sorted((k, len(v)) for k, v in blocks.items()) == [(16, 7 * LAYERS), (32, 1)]
    (head,) = blocks[32]
    assert list(head.output) == ["logits"]
    r = OnnxRunner(tmp_path / "q" / "model.onnx", threads=1)
    logits = r.forward_np([3, 4, 5], last=1)
    assert logits.shape == (1, VOCAB) and np.isfinite(logits).all() and r.cache_len() == 3
    with pytest.raises(ValueError, match="lm_head_block_size must be a power of 2"):
        quantize_int4(tmp_path / "model.onnx", tmp_path / "bad" / "model.onnx",
                      lm_head_block_size=48)
    assert not (tmp_path / "bad").exists()


def test_qwen2_sliding_window_config_exports_full_cache(tmp_path):
    """A sliding-window Qwen2 config (window 6, layer 1 sliding): the graph keeps the
    full KV cache (present = past + new, so rollback is a slice) and masks to the
    window, matching torch beyond the window length."""
    m = tiny_qwen2(seed=4, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert "sliding_attention" in m.config.layer_types
    export_graph(m, tmp_path / "model.onnx")
    prompt = list(range(2, 14))  # 12 tokens > window
    par = check_parity(tmp_path / "model.onnx", m, steps=16, prompt=prompt, threads=1)
    assert par["passed"], par
    od = OnnxDrafter(tmp_path, threads=1)
    od.propose(prompt, 3, SamplingConfig())
    assert od.cache_len() == len(prompt) + 2


def test_speed_measure_reports_ms_and_agreement(model, exported):
    """``exporters.speed.measure``: ms/token per backend and greedy agreement with the
    reference (the fp32 ONNX graph agrees exactly with torch fp32)."""
    from exporters.speed import markdown_table, measure

    res = measure(model, ["torch-fp32", "onnx-fp32", "onnx-int4", "torch-int8"],
                  onnx_dir=exported, threads=1, context=16, steps=3, warmup=1, repeats=1,
                  agree_steps=8, reference="torch-fp32", log=lambda *_: None)
    r = res["results"]
    assert list(r) == ["torch-fp32", "onnx-fp32", "onnx-int4", "torch-int8"]
    assert all(v["ms_per_token"] > 0 for v in r.values())
    assert r["torch-fp32"]["greedy_agreement"] == 1.0
    assert r["onnx-fp32"]["greedy_agreement"] == 1.0
    assert r["onnx-int4"]["agreement_tokens"] == 16
    assert "| onnx-int4 |" in markdown_table(res)


# ----------------------------------------------------------------------------- runtimes

def test_runtime_spec_suffix_and_cache_path(monkeypatch, tmp_path):
    from edge_sdk.drafters.runtime import RUNTIMES, onnx_cache_path, split_runtime

    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path))
    assert split_runtime("qwen2.5-coder-0.5b+onnx-int4") == ("qwen2.5-coder-0.5b", "onnx-int4")
    assert split_runtime("qwen2.5-coder-0.5b") == ("qwen2.5-coder-0.5b", None)
    assert split_runtime("dir/c++model") == ("dir/c++model", None)
    assert set(RUNTIMES) >= {"torch", "torch-int8", "onnx-fp32", "onnx-int8", "onnx-int4"}
    assert onnx_cache_path("qwen2.5-coder-0.5b") == tmp_path / "onnx" / "qwen2.5-coder-0.5b-int4"


def test_runtime_builds_caches_and_reuses_onnx_int4(monkeypatch, tmp_path):
    """The SDK's ``build_drafter`` only loads: a missing export raises a one-line
    ExportMissing naming the export command. The exporters' ``build_drafter(folder,
    runtime="onnx-int4")`` exports once into the cache (atomically: no temp folder
    left) and reuses it; the SDK then loads that cached folder."""
    from edge_sdk.drafters import runtime as rt
    from exporters.onnx import first_use as fu

    m = tiny_qwen2(seed=5)
    src = tmp_path / "draft"
    m.save_pretrained(src)
    _save_tokenizer(src)
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(rt.ExportMissing, match=r"specrelay export onnx .* --int4 .*"
                       r"specrelay\[export\]") as e:
        rt.build_drafter(str(src) + "+onnx-int4")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists()
    d, tok = fu.build_drafter(str(src) + "+onnx-int4")
    assert isinstance(d, OnnxDrafter) and tok is not None
    folder = rt.onnx_cache_path(str(src), "int4")
    man = _manifest(folder)
    assert man["cache_key"] == rt.cache_key(str(src), "int4")
    assert man["quantization"]["bits"] == 4 and man["fp32_parity"]["passed"]
    # the first-use export fuses with the model's own rope length
    assert man["max_positions"] == 512 and man["quantization"]["fused"] == {
        "rms_norms": 1, "skip_rms_norms": 2 * LAYERS, "rotary": 2 * LAYERS,
        "rotary_positions": 512 + ROTARY_MARGIN}
    assert not (folder / "fp32").exists()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    mtime = (folder / "model.onnx").stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(fu, "build_onnx_export", lambda *a, **k: calls.append(a))
    d2, _ = fu.build_drafter(str(src), runtime="onnx-int4")
    assert not calls and (folder / "model.onnx").stat().st_mtime_ns == mtime
    d3, _ = rt.build_drafter(str(src), runtime="onnx-int4")  # the SDK loads the cache
    assert d3.propose([1, 2, 3], 3, SamplingConfig()).tokens == d.propose(
        [1, 2, 3], 3, SamplingConfig()).tokens
    assert d2.propose([1, 2, 3], 3, SamplingConfig()).tokens == d.propose(
        [1, 2, 3], 3, SamplingConfig()).tokens
    assert d2.runner.session.get_session_options().intra_op_num_threads == 1


def test_runtime_torch_int8_and_unknown(tmp_path):
    from edge_sdk.drafters import runtime as rt

    m = tiny_qwen2(seed=6)
    src = tmp_path / "draft"
    m.save_pretrained(src)
    _save_tokenizer(src)
    d, _ = rt.build_drafter(str(src), runtime="torch-int8")
    assert isinstance(d, TorchDrafter)
    assert any("quantized" in type(x).__module__ for x in d.kv.model.modules())
    assert len(d.propose([1, 2, 3], 3, SamplingConfig()).tokens) == 3
    with pytest.raises(ValueError, match="unknown draft runtime"):
        rt.build_drafter(str(src), runtime="tflite")


def _save_tokenizer(folder: Path) -> None:
    from tests.conftest import tiny_tokenizer

    tiny_tokenizer(VOCAB).save_pretrained(folder)


# ----------------------------------------------------------------------------- real model

@pytest.mark.real_model
def test_real_qwen_0_5b_int4_export_agrees_with_torch(tmp_path):
    """Export Qwen2.5-Coder-0.5B to int4 (the cached runtime's recipe) and check the
    int4 draft agrees with the bf16 torch draft on a short chat prompt."""
    import json

    from exporters.onnx.first_use import ensure_onnx_export
    from edge_sdk.models import encode_prompt, load_model
    from exporters.speed import agreement, greedy_tokens, onnx_backend, torch_backend

    threads = torch.get_num_threads()
    try:
        # the cached export the default draft runtime uses (built here on first use,
        # shared with the other real-pair tests: one ~90 s export per machine)
        folder = ensure_onnx_export("qwen2.5-coder-0.5b", "int4")
        man = json.loads((folder / "specrelay_onnx.json").read_text())
        assert man["fp32_parity"]["passed"] and man["fp32_parity"]["max_abs_logit_diff"] < 1e-3
        model, tok = load_model("qwen2.5-coder-0.5b", dtype="bfloat16", threads=1)
        prompt = encode_prompt(tok, "Write a Python function that adds two numbers.", True)
        ref = greedy_tokens(torch_backend("bf16", model), prompt, 24)
        res = agreement(onnx_backend("int4", folder, 1), [prompt], [ref])
    finally:
        torch.set_num_threads(threads)
    assert res["greedy_agreement"] >= 0.75, res
