"""Prefill an ONNX draft's KV cache with the same draft model in torch on the CPU's
matrix units (AMX / AVX-512-BF16), then decode with the ONNX graph.

Decoding one token is memory-bound: the int4 ONNX graph reads a quarter of the bf16
weights and wins (Qwen2.5-Coder-0.5B on one core: ~40-47 ms a token against ~120 ms in
bf16). A prompt's prefill is compute-bound, and there onnxruntime's int4 kernel with
int8 activations lost to the bf16 model on oneDNN's AMX kernels: on the 32 prompts of a
16 + 16 bench run, one core, a mean 1,020 ms per prompt through the graph against 468
ms through torch (``python -m bench.probes.draft_quant DIR --torch-prefill``). Where the
edge prefills slower than the cloud (a busy edge core, a GPU target) that prefill, not
the target's, decides when the first draft block can leave; where the cloud's is the
longer one (the bench's one-core target) finishing it sooner gains nothing.
The split is the usual one of LLM serving (prefill and decode on what suits each;
Patel et al. 2024, *Splitwise*, on the compute-bound prompt phase and the memory-bound
token phase), here within one core.

The keys/values a torch prefill leaves are the bf16 model's (widened to the graph's KV
dtype), not the int4 graph's: the draft conditions on slightly different, more precise
keys/values. That changes draft tokens only, never the output: verification decides
every committed token, and in sampling mode the q each draft token reports is the
distribution it was drawn from (the ONNX logits after this cache), which is all the
acceptance rule needs (Leviathan et al. 2023, §2.3).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

#: A catch-up shorter than this runs through the ONNX graph (a few tokens after a
#: rejected block: the graph is as fast there and keeps its own keys/values).
MIN_TOKENS = 32


class TorchPrefill:
    """Appends long runs of tokens to an :class:`~edge_sdk.drafters.onnx.OnnxRunner`'s
    cache with a torch model of the same architecture and weights.

    Args:
        model: the draft as a HF causal LM (bf16, prepacked linears for AMX; eval mode),
            shared by every runner that uses this prefill (forward is re-entrant).
        min_tokens: shortest run that goes through torch (:data:`MIN_TOKENS`).
    Raises:
        ValueError: the model's geometry differs from a runner's (:meth:`extend`).
    """

    def __init__(self, model, min_tokens: int = MIN_TOKENS):
        self.model = model
        self.min_tokens = int(min_tokens)
        cfg = model.config
        heads = cfg.num_attention_heads
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.dtype = next(model.parameters()).dtype

    def wants(self, n: int) -> bool:
        """Whether a run of ``n`` tokens goes through torch."""
        return n >= self.min_tokens

    @torch.inference_mode()
    def extend(self, runner, tokens: Sequence[int]) -> None:
        """Append ``tokens`` [k] to ``runner``'s cache (no logits: the caller's next
        graph call reads them). The cached past [1, H_kv, P, D] is kept as it is; the
        k new keys/values [1, H_kv, k, D] come from one torch forward at positions
        P..P+k-1 over that past and are widened to the runner's KV dtype.

        A run longer than the graph's ``PREFILL_CHUNK`` goes in chunks of that many
        (bounded attention memory, as the graph does).

        Raises ValueError for an empty run or a runner of another geometry."""
        if not tokens:
            raise ValueError("extend() needs at least one token")
        from edge_sdk.drafters.onnx import PREFILL_CHUNK

        if len(tokens) > PREFILL_CHUNK:
            for s in runner.chunk_starts(len(tokens)):
                self.extend(runner, tokens[s:s + PREFILL_CHUNK])
            return
        if (runner.num_layers, runner.num_kv_heads, runner.head_dim) != (
                self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError("the torch prefill model and the ONNX draft differ in shape")
        from transformers import DynamicCache

        p, k = runner.cache_len(), len(tokens)
        cache = DynamicCache(config=self.model.config)
        if p:
            for i in range(self.num_layers):
                cache.update(torch.from_numpy(np.ascontiguousarray(runner.past[2 * i]))
                             .to(self.dtype),
                             torch.from_numpy(np.ascontiguousarray(runner.past[2 * i + 1]))
                             .to(self.dtype), i)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        self.model(input_ids=ids, position_ids=torch.arange(p, p + k)[None],
                   attention_mask=torch.ones(1, p + k, dtype=torch.long),
                   cache=cache, use_cache=True, logits_to_keep=1)
        new = []
        for i in range(self.num_layers):
            layer = cache.layers[i]
            for t, old in ((layer.keys, runner.past[2 * i]),
                           (layer.values, runner.past[2 * i + 1])):
                fresh = t[:, :, p:].to(torch.float32).numpy().astype(runner.kv_dtype,
                                                                      copy=False)
                new.append(np.concatenate([old, fresh], axis=2) if p else
                           np.ascontiguousarray(fresh))
        runner.past = new
        runner.ids.extend(int(t) for t in tokens)
        runner.check()


def load_prefill(spec: str, threads: int | None = None,
                 min_tokens: int = MIN_TOKENS) -> TorchPrefill:
    """A :class:`TorchPrefill` of model ``spec`` (:func:`edge_sdk.models.resolve`) in
    bfloat16 with prepacked linears (oneDNN; AMX where the CPU has it; unless
    ``SPECRELAY_PACKED=0``). ``threads`` sets
    torch's (process-wide) thread count when given. For the 0.5B draft the process
    grew by ~1.9 GB resident (packed weights, mapped weights file); it loads in
    seconds from the bf16 cache of its GGUF. Raises what
    :func:`edge_sdk.models.load_model` raises."""
    from edge_sdk.models import load_model
    from edge_sdk.packed import packed_default

    model, _ = load_model(spec, dtype="bfloat16", threads=threads, packed=packed_default())
    return TorchPrefill(model, min_tokens)
