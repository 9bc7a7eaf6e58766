"""A causal LM plus its KV cache, trimmed to a confirmed prefix.

The one cache-trimming implementation: the edge's torch drafter and the cloud's target
sessions both use :class:`KVModel`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache


class KVModel:
    """Runs a HF causal LM incrementally over one sequence (batch 1).

    Invariant: ``len(self.ids) == self.cache_len()``; ``self.ids`` are the tokens whose
    keys/values sit in the cache.
    """

    def __init__(self, model):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []

    def cache_len(self) -> int:
        """Tokens held in the KV cache."""
        return int(self.cache.get_seq_length())

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (n <= cached). Raises ValueError otherwise."""
        have = len(self.ids)
        if not 0 <= n <= have:
            raise ValueError(f"crop({n}) outside 0..{have}")
        if n < have:
            self.cache.crop(n - have)
            del self.ids[n:]
        self.check()

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int]) -> torch.Tensor:
        """Append ``new_ids`` [k] and return their logits, float32 [k, V]."""
        if not new_ids:
            raise ValueError("forward() needs at least one token")
        x = torch.tensor([list(new_ids)], dtype=torch.long)
        try:
            out = self.model(input_ids=x, cache=self.cache, use_cache=True)
        except BaseException:
            # a half-updated cache cannot be trimmed reliably: rebuild it from scratch
            self.cache = DynamicCache(config=self.model.config)
            self.ids = []
            raise
        self.ids.extend(int(t) for t in new_ids)
        self.check()
        return out.logits[0].float()

    def sync(self, context: Sequence[int], block: Sequence[int] = ()) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` (rolling back whatever diverges, reusing
        the common prefix), then run ``context[-1]`` and ``block`` [g].

        Returns float32 [g+1, V]: row i holds the logits after ``context + block[:i]``.
        Afterwards the cache holds ``context + block``; the caller crops it.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        common = 0
        for a, b in zip(self.ids, context):
            if a != b:
                break
            common += 1
        self.crop(min(common, len(context) - 1))
        new = list(context[len(self.ids):]) + list(block)
        return self.forward(new)[-(len(block) + 1):]

    def reset(self) -> None:
        self.crop(0)

    def check(self) -> None:
        """Assert the cache-length invariant (CASES.md 7)."""
        n = self.cache_len()
        if n != len(self.ids):
            raise AssertionError(f"KV cache holds {n} tokens, expected {len(self.ids)}")
