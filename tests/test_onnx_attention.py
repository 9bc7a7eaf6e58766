"""Grouped-query attention traced without repeating K and V (the exporter's default):
the same outputs as transformers' own attention (padded batches, a KV cache, a sliding
window), and a graph that no longer expands the cache per query head."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from click.testing import CliRunner

from exporters.cli import export
from exporters.onnx.attention import ATTENTIONS, gqa_attention, use_gqa_attention
from exporters.onnx.export import export_onnx
from exporters.onnx.parity import check_parity

VOCAB, LAYERS, HEADS, KV_HEADS, HIDDEN = 256, 2, 8, 2, 64     # 4 query heads per KV head


def tiny_qwen2(seed: int = 0, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0, bos_token_id=1, **kw)
    torch.manual_seed(seed)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m.eval().requires_grad_(False)


def _logits_with_cache(m, ids, mask):
    """Prefill ``ids[:, :-3]`` then 3 single-token steps with a DynamicCache; -> logits
    of every step, [B, 3, V], plus the prefill's [B, S-3, V]."""
    from transformers import DynamicCache

    cache = DynamicCache()
    s = ids.shape[1] - 3
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [m(input_ids=ids[:, :s], attention_mask=mask[:, :s], position_ids=pos[:, :s],
             past_key_values=cache, use_cache=True).logits]
    for i in range(s, ids.shape[1]):
        out.append(m(input_ids=ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                     position_ids=pos[:, i:i + 1], past_key_values=cache,
                     use_cache=True).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("kw", [{}, {"use_sliding_window": True, "sliding_window": 5,
                                     "max_window_layers": 1}])
def test_gqa_attention_matches_the_models_own_with_padding_and_cache(kw):
    m = tiny_qwen2(**kw)
    ids = torch.randint(2, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0                                              # left padding in row 0
    with torch.no_grad():
        ref = _logits_with_cache(m, ids, mask)
        impl = m.config._attn_implementation
        with use_gqa_attention(m):
            assert m.config._attn_implementation == "specrelay_gqa"
            got = _logits_with_cache(m, ids, mask)
        assert m.config._attn_implementation == impl               # restored
    valid = mask.bool()
    assert (got - ref)[valid].abs().max() < 1e-4
    assert torch.equal(got[valid].argmax(-1), ref[valid].argmax(-1))


def test_gqa_attention_shapes_and_bad_heads():
    q, k, v = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, w = gqa_attention(None, q, k, v, None)
    assert out.shape == (1, 3, 6, 8) and w is None
    # the same as repeating K and V per query head
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    ref = torch.softmax(q @ kr.transpose(2, 3) * 8 ** -0.5, -1) @ vr
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        gqa_attention(None, torch.randn(1, 5, 3, 8), k, v, None)


def _expands_of_past(path) -> int:
    """Expand nodes fed (through any chain) by a past/present K or V: the repeat_kv
    copies."""
    g = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n for n in g.node for o in n.output}
    memo: dict[str, bool] = {}

    def from_past(name: str, depth: int = 0) -> bool:
        if name.startswith("past_key_values.") or depth > 12:
            return name.startswith("past_key_values.")
        if name not in memo:
            n = producer.get(name)
            memo[name] = n is not None and any(from_past(x, depth + 1) for x in n.input
                                               if n.op_type != "Shape")
        return memo[name]

    return sum(1 for n in g.node if n.op_type == "Expand" and from_past(n.input[0]))


def test_export_traces_gqa_by_default_and_model_attention_on_request(tmp_path):
    m = tiny_qwen2(seed=1)
    prompt = [1, 17, 230, 5, 200, 2, 9, 77]
    gqa = export_onnx(m, tmp_path / "gqa", parity_steps=12, threads=1, prompts=[prompt])
    src = tmp_path / "src"
    m.save_pretrained(src)
    r = CliRunner().invoke(export, ["onnx", str(src), "--out", str(tmp_path / "model"),
                                    "--attention", "model", "--steps", "12",
                                    "--threads", "1", "--int4"])
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "model" / "specrelay_onnx.json").read_text())
    assert gqa["attention"] == "gqa" and man["attention"] == "model"
    assert gqa["parity"]["passed"] and man["parity"]["passed"]
    assert json.loads((tmp_path / "model" / "int4" / "specrelay_onnx.json")
                      .read_text())["attention"] == "model"
    # the model's own attention repeats K and V per layer; the gqa graph never does
    assert _expands_of_past(tmp_path / "model" / "model.onnx") >= 2 * LAYERS
    assert _expands_of_past(tmp_path / "gqa" / "model.onnx") == 0
    # and the gqa graph is still exact against torch on a longer run
    assert check_parity(tmp_path / "gqa", m, steps=24, prompt=prompt, threads=1)["passed"]
    with pytest.raises(ValueError, match="attention"):
        export_onnx(m, tmp_path / "bad", attention="flash", parity=False)
    assert not (tmp_path / "bad").exists()                    # refused before writing
    opt = next(p for p in export.commands["onnx"].params if p.name == "attention")
    assert tuple(opt.type.choices) == ATTENTIONS
