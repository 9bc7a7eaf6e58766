"""The quantized self-draft of CATS: every decoder layer of the target kept resident
as 4-bit weight groups, drafting with the target's own embedding, final norm and LM
head (self-speculation from a low-precision copy of the target itself: QSpec, Zhao et
al. 2024, §3; ML-SpecQD, Georganas et al. 2025, §3, the 4-bit draft of a bf16 target on
CPUs).

Why, under a memory budget: a layer-skipping draft (:mod:`.skip`) spends the budget on
a few layers at full precision and drafts with them alone (on Qwen2.5-Coder-1.5B at a
50 % budget, 12 of 28 layers: ~0.7 per-token agreement). Four bits per weight hold
*all* layers in ~30 % of their bf16 bytes (28 x 29 MB against 28 x 94 MB); the draft
is then the whole target up to rounding, and agrees with it far more often, while the
verification pass streams more of the bf16 layers (the ones no longer resident at full
precision). :mod:`.budget` prices both and picks.

Quantization (round to nearest, asymmetric, per group of ``GROUP`` consecutive input
weights of one output row): ``w ~ (q - 8) * scale + zero`` with ``q in 0..15``,
``scale = (max - min) / 15``, ``zero = min + 8 * scale`` -- the layout of PyTorch's CPU
int4 kernel (``torch.ops.aten._weight_int4pack_mm_for_cpu``, bf16 activations, float
accumulation). The checkpoint the local target streams is the dequantised GGUF Q4_K_M
file, whose weights already sit on 4-bit grids of 32-weight sub-blocks, so groups of 32
recover most of them almost exactly.

Cache: no second one. The draft's layer ``i`` attends to the target's own keys/values
of the confirmed prefix in the target's cache slot ``i`` (what the full passes wrote:
the int4 layers would compute nearly the same, and the draft needs no prefill of the
prompt) plus its own rows of the block, which :meth:`QuantDraft.release` drops before
the verification pass (the layer-skipping draft's tail does the same, :mod:`.skip`).
``split`` is 0: the verification pass runs every layer of the target on the block's
embeddings and writes the true keys/values.
"""

from __future__ import annotations

import torch
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.head import DraftVocabHead

__all__ = ["Int4Linear", "QuantDraft", "GROUP", "int4_supported", "int4_layer_bytes"]

GROUP = 32
"""Input weights per quantization group (Q4_K's sub-block: the grid of the weights the
checkpoint was dequantised from)."""

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def int4_supported() -> bool:
    """True when this torch build has the CPU int4 weight kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(
        ops, "_weight_int4pack_mm_for_cpu")


def int4_layer_bytes(layer_bytes: int, itemsize: int = 2, group: int = GROUP) -> int:
    """Bytes of one decoder layer as :class:`Int4Linear` weights, from its bytes in the
    checkpoint's dtype (``itemsize`` bytes per weight): half a byte per weight plus a
    bf16 scale and zero per ``group`` weights."""
    n = layer_bytes // itemsize
    return n // 2 + (n // group) * 4


class Int4Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` [N, K] as 4-bit groups (module docstring).

    Args:
        weight: [N, K] (any float dtype; K a multiple of ``group``). bias: [N] or None.
        group: input weights per group.
    Input [..., K] -> output [..., N], the input's dtype (computed on bf16 activations).
    Raises:
        ValueError: K is not a multiple of ``group``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = GROUP):
        super().__init__()
        N, K = weight.shape
        if K % group:
            raise ValueError(f"in_features {K} is not a multiple of the group {group}")
        w = weight.detach().float().reshape(N, K // group, group)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((w - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(N, K).to(torch.int32), 1)
        zero = lo + 8 * scale
        self.scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(
            torch.bfloat16)                                               # [K/g, N, 2]
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        self.in_features, self.out_features, self.group = K, N, group

    def nbytes(self) -> int:
        """Bytes held (packed weights, scales and zeros, bias)."""
        b = 0 if self.bias is None else self.bias.numel() * 2
        return self.packed.numel() + self.scale_zero.numel() * 2 + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.packed, self.group,
            self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _quantize_layer(t: OffloadedTarget, i: int, config, group: int) -> torch.nn.Module:
    """Decoder layer ``i`` of ``t`` built with ``config``, its linears as 4-bit groups:
    its tensors read from storage unthrottled (a one-off build, not a pass), its norms
    in bf16."""
    with torch.device("meta"):
        lay = type(t.model.model.layers[0])(config, layer_idx=i)
    store, pre = t.storage, f"model.layers.{i}."

    def read(name):
        key = pre + name
        if key not in store.entries:
            return None
        out = torch.empty(store.entries[key][1], dtype=torch.bfloat16)
        store.read_into(key, out)
        return out

    with store.unthrottled():
        for name in _LINEARS:
            parent, attr = name.split(".")
            setattr(getattr(lay, parent), attr,
                    Int4Linear(read(name + ".weight"), read(name + ".bias"), group))
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(lay, name).weight = torch.nn.Parameter(read(name + ".weight"),
                                                           requires_grad=False)
    return lay.eval().requires_grad_(False)


def grouped_attention(module, query, key, value, attention_mask, scaling: float,
                      dropout: float = 0.0, **kwargs):
    """Attention for grouped-query heads without repeating keys/values: ``query`` [B,
    Hq, q, D], ``key``/``value`` [B, Hkv, n, D], ``attention_mask`` bool [B|1, 1, q, n]
    (True: attend) or None -> ``([B, q, Hq, D], None)`` (transformers' attention
    interface). The ``Hq / Hkv`` query heads of a group share one matmul per key/value
    head, in float32 (a bf16 batched matmul builds a new oneDNN kernel for every new
    key length, ~0.7 ms a call while the cache grows by a token a step). A draft-only
    kernel -- any draft keeps the output exact, so the draft need not match the
    target's attention bit for bit: the draft token of Qwen2.5-Coder-1.5B after a
    200-token context, one thread, takes 52.6 ms with it against 87.8 ms with
    transformers' SDPA (``python -m bench.probes.quant_agreement --prompts 0
    [--attention sdpa]``, docs/figures/cats/quant/draft_ms_*.json)."""
    B, Hq, q, D = query.shape
    Hkv, n = key.shape[1], key.shape[2]
    g = Hq // Hkv
    s = query.reshape(B, Hkv, g * q, D).float() @ key.float().transpose(-1, -2) * scaling
    if attention_mask is not None:
        s = s.view(B, Hkv, g, q, n).masked_fill(~attention_mask[:, :, None].bool(),
                                                float("-inf")).view(B, Hkv, g * q, n)
    out = (s.softmax(-1) @ value.float()).to(value.dtype)             # [B, Hkv, g*q, D]
    return out.view(B, Hq, q, D).transpose(1, 2).contiguous(), None


_ATTN = "specrelay_grouped"


def _draft_config(config, attention: str):
    """A copy of ``config`` whose attention is ``attention`` (``grouped``:
    :func:`grouped_attention`; else a transformers implementation, e.g. ``sdpa``)."""
    import copy

    from transformers import AttentionInterface

    if attention == "grouped":
        AttentionInterface.register(_ATTN, grouped_attention)
        attention = _ATTN
    c = copy.deepcopy(config)
    c._attn_implementation = attention
    return c


class QuantDraft:
    """Drafting with a 4-bit copy of all of ``target``'s decoder layers.

    Args:
        target: the budgeted :class:`OffloadedTarget` (its embedding, final norm and LM
            head are the draft's too; a bf16 target computes in bf16 throughout).
        vocab: the draft's vocabulary (the first ``vocab`` ids + the special ones,
            :class:`~.head.DraftVocabHead`; None: all).
        group: input weights per quantization group.
        attention: the draft layers' attention: ``grouped`` (:func:`grouped_attention`)
            or a transformers implementation (``sdpa``, ``eager``; for comparison).
    Attributes:
        split: 0 (the verification pass runs every layer).
    Raises:
        ValueError: this torch has no CPU int4 kernels, or a layer's input width is
            not a multiple of ``group``.
    """

    split = 0

    def __init__(self, target: OffloadedTarget, vocab: int | None = 32768,
                 group: int = GROUP, attention: str = "grouped"):
        if not int4_supported():
            raise ValueError("the quantized self-draft needs torch's CPU int4 kernels")
        self.t, self.head = target, DraftVocabHead(target, vocab)
        config = _draft_config(target.config, attention)
        self.layers = [_quantize_layer(target, i, config, group)
                       for i in range(target.num_layers)]
        self.name = f"int4-g{group}-v{vocab or 'full'}"

    def nbytes(self) -> int:
        """Bytes of the 4-bit layers (weights, scales, zeros, biases, norms)."""
        n = 0
        for lay in self.layers:
            for m in lay.modules():
                if isinstance(m, Int4Linear):
                    n += m.nbytes()
            n += sum(p.numel() * p.element_size() for p in lay.parameters())
        return n

    @torch.inference_mode()
    def _run(self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None
             ) -> torch.Tensor:
        """The 4-bit layers over ``h`` [1, q, H] at ``pos`` long [1, q], each writing
        its rows into the target's cache slot of its layer."""
        pe = self.t.model.model.rotary_emb(h, pos)
        for lay in self.layers:
            h = lay(h, attention_mask=mask, position_ids=pos, cache=self.t.cache,
                    use_cache=True, position_embeddings=pe)
        return h

    def step(self, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``tok`` at the next position through the 4-bit layers, attending to the
        target's keys/values of the prefix and the block's draft rows. Returns its
        embedding [1, 1, H] (the verification pass's input at layer 0) and the draft
        logits float32 [V]."""
        x = self.t.embed([tok])
        P = self.t.cache_len(0)
        h = self._run(x, torch.tensor([[P]]), None)
        return x, self.head.logits(h[0])[0]

    def step_rows(self, toks: list[int], pos: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree rows ``toks`` [q] at positions ``pos`` long [1, q] under ``mask`` bool
        [1, 1, q, cached + q]: their embeddings [1, q, H] and draft logits float32
        [q, V]."""
        x = self.t.embed(toks)
        return x, self.head.logits(self._run(x, pos, mask)[0])

    def release(self, n: int) -> None:
        """Drop the draft-only entries: every layer's cache back to ``n`` tokens (the
        confirmed prefix minus its last token), before the verification pass."""
        self.t.crop(n)
