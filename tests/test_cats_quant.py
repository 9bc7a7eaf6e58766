"""CATS with the quantized self-draft (every decoder layer as 4-bit groups, the target's
own head; :mod:`edge_sdk.local_target.quant`): the 4-bit linear computes the dequantised
weights' product; greedy output is the target's token for token over rounds with
partial acceptance, chains, siblings and trees, any resident count (CASES.md 1); after
every round every layer's cache is a fresh prefill's, the draft's rows gone (CASES.md
7); a block without drafts
samples what the target alone does; sampled output follows the target's distribution
(CASES.md 3-5); the plan prices it against the layer-skipping draft."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from edge_sdk.local_target.budget import Sizes, plan, quant_bytes, _memory
from edge_sdk.local_target.cats import CatsDecoder, _prefill, decode_ar
from edge_sdk.local_target.quant import (GROUP, Int4Linear, QuantDraft, int4_layer_bytes,
                                         int4_supported)
from edge_sdk.protocol import sampling as S
from test_cats import (PROMPT, SAMPLINGS, _target, assert_cache_is_a_fresh_prefill,
                       assert_pairs_follow_the_target, assert_zero_draft_rounds_match_ar)

pytestmark = pytest.mark.skipif(not int4_supported(), reason="no CPU int4 kernels")


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=6, seed=3)


def _dequantised(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Round to nearest on the group's [min, max] in 15 steps, by hand."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    return (((g - lo) / step).round().clamp(0, 15) * step + lo).reshape(N, K)


def test_the_4bit_linear_is_the_dequantised_product():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = Int4Linear(w, b)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), _dequantised(w), b)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 96)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    # weights on a 4-bit grid per group (a dequantised Q4 checkpoint) are recovered
    grid = _dequantised(w)
    torch.testing.assert_close(lin(x.float()), torch.nn.functional.linear(x.float(), grid, b),
                               rtol=2e-2, atol=5e-2)
    assert lin(x.float()).dtype == torch.float32            # the input's dtype back
    assert lin.nbytes() == 96 * 64 // 2 + (96 * 64 // GROUP) * 4 + 96 * 2
    with pytest.raises(ValueError, match="multiple of the group"):
        Int4Linear(torch.randn(8, 48), None)


def test_the_draft_holds_every_layer_in_4_bits(tmp_path, model):
    t = _target(tmp_path, model, 2)
    d = QuantDraft(t, None)
    assert d.split == 0 and len(d.layers) == 6 and d.name == "int4-g32-vfull"
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    norms = 2 * 32 * 2                                     # two bf16 norm vectors
    lin = sum(m.nbytes() for m in d.layers[0].modules() if isinstance(m, Int4Linear))
    assert lin + norms == d.nbytes() // 6
    assert abs(int4_layer_bytes(layer, 4) - d.nbytes() // 6) <= 0.05 * d.nbytes() / 6
    # a draft token is the 4-bit layers over the target's prefix cache: close to the
    # target's own logits; its rows are dropped by release()
    _prefill(t, PROMPT)
    x, lg = d.step(PROMPT[-1])
    torch.testing.assert_close(x, t.embed([PROMPT[-1]]))
    assert [t.cache_len(i) for i in range(6)] == [len(PROMPT)] * 6
    d.release(len(PROMPT) - 1)
    assert [t.cache_len(i) for i in range(6)] == [len(PROMPT) - 1] * 6
    # on an empty prefix, the draft is the model with every linear weight dequantised
    import copy

    deq = copy.deepcopy(model)
    for lay in deq.model.layers:
        for m in lay.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(_dequantised(m.weight))
    t.reset()
    _, lg = d.step(PROMPT[0])
    want = deq(torch.tensor([PROMPT[:1]])).logits[0, -1]
    torch.testing.assert_close(lg, want, rtol=5e-2, atol=0.3)      # bf16 activations
    assert int(lg.argmax()) == int(want.argmax())


def test_greedy_identity_with_partial_acceptance(tmp_path, model):
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                         eos_token_id=None)[0, len(PROMPT):].tolist()
    partial = hits = 0
    for R in (0, 2, 5):
        t = _target(tmp_path, model, R)
        assert decode_ar(t, PROMPT, 40, S.SamplingConfig())[0] == ref
        for vocab in (None, 40):
            d = QuantDraft(t, vocab)
            for depth, kw in ((1, {}), (3, {}), (8, {}), (12, {}), (3, {"width": 4}),
                              (4, {"beam": 3, "nodes": 10})):
                toks, st = CatsDecoder(t, d, depth, **kw).generate(
                    PROMPT, 40, S.SamplingConfig())
                assert toks == ref, (R, vocab, depth, kw)
                assert st.committed == 40
                partial += sum(0 < a < depth for a in st.accepted_per_round)
                hits += st.sibling_hits
                assert all(t.cache_len(i) == len(PROMPT) + 40 - 1 for i in range(6))
    assert partial > 0 and hits > 0


@pytest.mark.parametrize("kw", [{"width": 1}, {"width": 4}, {"beam": 3, "nodes": 12}],
                         ids=["chain", "siblings", "tree"])
def test_every_round_leaves_the_targets_own_cache(tmp_path, model, kw):
    """Round by round (chain, siblings, a dynamic tree): every layer holds the confirmed
    prefix minus its last token, with the keys/values a fresh full prefill of it
    computes (the draft's rows are dropped and the verification pass writes the true
    ones); the streamed layers run once per round; rejections happen."""
    t = _target(tmp_path, model, 3)
    ref = _target(tmp_path, model, 6)
    dec = CatsDecoder(t, QuantDraft(t, None), 4, **kw)
    ids = list(PROMPT)
    _prefill(t, ids)
    rejected = 0
    for _ in range(8):
        n0 = t.streamed_passes
        new, g, a = dec.round(ids, 4, S.SamplingConfig(), 0)
        assert t.streamed_passes - n0 == 1
        rejected += a < g
        ids += new
        t.crop(len(ids) - 1)
        assert all(t.cache_len(i) == len(ids) - 1 for i in range(6))
        assert_cache_is_a_fresh_prefill(t, ref, ids)
    assert rejected > 0


def test_a_block_without_drafts_samples_what_the_target_alone_does(tmp_path, model):
    t = _target(tmp_path, model, 2)
    cfg = S.SamplingConfig(temperature=0.9, top_k=20)
    assert_zero_draft_rounds_match_ar(t, CatsDecoder(t, QuantDraft(t, None), 1), cfg,
                                      prompt=PROMPT)


@pytest.mark.parametrize("cfg", SAMPLINGS, ids=["plain", "processors"])
def test_sampled_pairs_follow_the_target_distribution(tmp_path, cfg):
    V = 8
    model = tiny_model(vocab=V, layers=3, seed=5)
    t = _target(tmp_path, model, 1)
    dec = CatsDecoder(t, QuantDraft(t, 6), 2)                 # draft vocabulary: 6 of 8
    assert_pairs_follow_the_target(dec, model, cfg, V)


QWEN15 = Sizes(layer=93595648, head=466747392, embed=466747392, norm=3072, layers=28,
               hidden=1536, vocab=151936, kv_per_token=28672)
"""Qwen2.5-Coder-1.5B bf16's parts (``sizes_of`` on its checkpoint)."""


def test_the_plan_prices_the_quantized_draft_against_the_skip_draft():
    half = QWEN15.weights // 2
    skip = plan(QWEN15, half, 2e9, packed=True)
    q = plan(QWEN15, half, 2e9, drafts=("exit", "skip", "quant"), packed=True)
    assert skip.draft == "skip" and skip.resident_layers == 11
    assert q.draft == "quant" and q.width == 1 and q.beam == 1 and 1 <= q.depth <= 16
    assert q.memory == _memory(QWEN15, q.resident_layers, False, 2048) + quant_bytes(QWEN15)
    assert q.memory <= half < _memory(QWEN15, q.resident_layers + 1, False, 2048) \
        + quant_bytes(QWEN15)
    assert q.rate > skip.rate and q.ar_rate == pytest.approx(skip.ar_rate)
    # too small for the 4-bit layers beside the head: the skip draft stays
    small = _memory(QWEN15, 3, False, 2048)
    assert plan(QWEN15, small, 2e9, drafts=("exit", "skip", "quant"), packed=True).draft != "quant"
    # the whole target fits: it streams nothing alone, and stays alone
    full = plan(QWEN15, QWEN15.weights + 10**9, 2e9, drafts=("exit", "skip", "quant"),
                packed=True)
    assert full.resident_layers == 28 and full.depth == 0


@pytest.mark.real_model
def test_the_real_target_drafts_with_its_4bit_copy():
    """Qwen2.5-Coder-1.5B at a 50 % budget (unthrottled storage): the plan takes the
    quantized self-draft, its 4-bit layers fit the budget beside the resident ones, and
    CATS's greedy tokens are the offloaded target's alone on a HumanEval prompt
    (bf16: a difference may only be a near-tie of the target's own logits)."""
    from edge_sdk.local_target.load import checkpoint_dir
    from edge_sdk.local_target.session import build_local
    from edge_sdk.metrics import classify_divergence

    try:
        checkpoint_dir("qwen2.5-coder-1.5b")
    except Exception as e:                                     # pragma: no cover
        pytest.skip(f"the real target is not installed: {e}")
    torch.set_num_threads(2)
    sess = build_local("qwen2.5-coder-1.5b", 0.5, "ram", method="cats")
    d = sess.describe()
    assert sess.plan.draft == "quant" and isinstance(sess.local.head, QuantDraft)
    assert d["resident_bytes"] + d["draft_bytes"] <= sess.plan.budget
    tok = sess.local.tokenizer
    prompt = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    out, st = sess.generate(prompt, 24)
    assert st.accepted > 0 and st.rounds < 24
    sess.method = "ar"
    ref, _ = sess.generate(prompt, 24)
    j, _ = classify_divergence(ref, [], out, [])
    if j is not None:
        assert j < min(len(ref), len(out))
        t = sess.local.target
        t.reset()
        top = t.forward(prompt + ref[:j])[-1].topk(2).values
        ties = [j] if float(top[0] - top[1]) < S.NEAR_TIE_GAP["bfloat16"] else []
        assert classify_divergence(ref, ties, out, [])[1] == "near_tie", (j, ref[j], out[j])
