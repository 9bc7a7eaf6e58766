"""Grouped-query attention traced without repeating the KV cache.

transformers' ``sdpa`` and ``eager`` attention repeat each KV head over its query group
(``repeat_kv``) before the two matmuls. Traced to ONNX that is, per layer and decode
step, an ``Expand`` of the whole cached K and V to every query head and a ``Transpose``
of the expanded K, growing with the context: on Qwen2.5-0.5B (14 query heads over 2 KV
heads) the int4 draft step on one core takes 49.1 ms with it and 39.5 ms without at 300
cached tokens, 64.3 against 41.9 ms at 800 (``python -m bench.probes.draft_attention``).

:func:`gqa_attention` computes the same attention (Ainslie et al. 2023, "GQA", §2:
query heads share their group's K and V) by folding the query group into the rows of
the score matrix instead: with ``g = H / H_kv`` query heads per KV head,

    Q [B, H, S, D]  ->  Q' [B, H_kv, g * S, D]        (a reshape: heads are KV-major)
    A = softmax(Q' K^T * scale + mask)   [B, H_kv, g * S, N]
    O = A V  [B, H_kv, g * S, D]  ->  [B, S, H, D]

so K and V are read once per KV head, as cached, and never copied (only Q, one row per
new token and head, is). The additive mask
``[B, 1, S, N]`` is broadcast over the group (a ``[B, 1, 1, S, N]`` view).

Export-time only: :func:`use_gqa_attention` switches a model to it for the trace. It
changes the draft's arithmetic order, not its maths (the export's parity check against
the torch model still applies); the target and its verification never use it.
"""

from __future__ import annotations

import contextlib

import torch

NAME = "specrelay_gqa"
#: How an export traces the attention: ``gqa`` (:func:`gqa_attention`) or ``model``
#: (the model's own implementation, K and V repeated per query head).
ATTENTIONS = ("gqa", "model")
#: What every export traces unless told otherwise (the first-use cache included).
DEFAULT_ATTENTION = "gqa"


def gqa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, **_: object) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function (``eager``'s contract).

    Args:
        query: [B, H, S, D]; key, value: [B, H_kv, N, D] (the cache after this step's
            update; ``H`` a multiple of ``H_kv``).
        attention_mask: additive float mask [B, 1, S, >= N] (``eager``'s), or None.
        scaling: score scale (None: ``D ** -0.5``). dropout: ignored (inference).
    Returns:
        (attention output [B, S, H, D] in ``query``'s dtype, None: no weights).
    Raises:
        ValueError: ``H`` not a multiple of ``H_kv``.
    """
    b, h, s, d = query.shape
    kv, n = key.shape[1], key.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} KV heads")
    g = h // kv
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(b, kv, g * s, d)
    scores = torch.matmul(q, key.transpose(2, 3)) * scale          # [B, H_kv, g*S, N]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :n].unsqueeze(2)            # [B, 1, 1, S, N]
        scores = (scores.reshape(b, kv, g, s, n) + mask).reshape(b, kv, g * s, n)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(probs, value)                               # [B, H_kv, g*S, D]
    return out.reshape(b, h, s, d).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`gqa_attention` (with ``eager``'s additive mask) under
    :data:`NAME` in transformers' attention interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, gqa_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def check_attention(attention: str) -> None:
    """Raises ValueError unless ``attention`` is one of :data:`ATTENTIONS`."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")


def traced_attention(model, attention: str):
    """The context an export traces ``model`` in: :func:`use_gqa_attention` for
    ``gqa``, nothing for ``model``. Raises ValueError: an unknown ``attention``."""
    check_attention(attention)
    return use_gqa_attention(model) if attention == "gqa" else contextlib.nullcontext()


@contextlib.contextmanager
def use_gqa_attention(model):
    """Run ``model`` (a HF causal LM) with :func:`gqa_attention` inside the block; its
    attention implementation is restored on exit. A model whose config names no
    attention implementation is left as it is."""
    cfg = getattr(model, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    if before is None:
        yield model
        return
    register()
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
