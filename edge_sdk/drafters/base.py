"""The Drafter mechanism: propose a block of draft tokens from a confirmed prefix.

Backends (torch, ONNX, n-gram) implement :meth:`Drafter.sync` / :meth:`Drafter.step`;
the sampling loop here is shared, so every backend samples with the same processors as
the target (CASES.md 3-4) and reports the exact q it sampled from.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from edge_sdk.protocol.sampling import SamplingConfig, sample_next


@dataclass
class DraftBlock:
    """A proposed block of depth g.

    tokens: [g] draft ids. q_tok: float64 [g], ``q_i(d_i)`` (1.0 when greedy).
    q: float64 [g, V] full draft distributions (kept on the edge for corrections and for
    the standard baseline; None when greedy). draft_s: seconds spent drafting.
    """

    tokens: list[int]
    q_tok: torch.Tensor
    q: torch.Tensor | None
    draft_s: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Draft-model mechanism with a KV cache that rolls back to the confirmed prefix."""

    vocab_size: int

    @abstractmethod
    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Make the cache hold ``context[:-1]`` and return logits after ``context[-1]``
        (float32 [V]); anything cached beyond the common prefix is dropped."""

    @abstractmethod
    def step(self, token: int) -> torch.Tensor:
        """Append one token; return the logits after it, float32 [V]."""

    @abstractmethod
    def cache_len(self) -> int:
        """Tokens currently in the draft KV cache."""

    def fork(self) -> "Drafter":
        """A drafter sharing this one's weights with its own KV cache, for one more
        concurrent request. Backends that cannot fork return ``self`` (still correct:
        ``sync`` rolls the shared cache back, at the cost of re-prefilling)."""
        return self

    def propose(self, context: Sequence[int], depth: int, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> DraftBlock:
        """Draft ``depth`` tokens after ``context`` [n] with the target's sampling config.

        Returns a :class:`DraftBlock`. Greedy configs draft the argmax (q one-hot).
        Raises ValueError for depth < 1 or an empty context.
        """
        if depth < 1:
            raise ValueError("depth must be >= 1")
        t0 = time.perf_counter()
        logits = self.sync(context)
        seen = list(context)
        tokens, q_tok, q_rows = [], [], []
        for i in range(depth):
            d, q = sample_next(logits, cfg, seen, generator)
            tokens.append(d)
            q_tok.append(1.0 if q is None else float(q[d]))
            if q is not None:
                q_rows.append(q)
            seen.append(d)
            if i + 1 < depth:
                logits = self.step(d)
        q_full = torch.stack(q_rows) if q_rows else None
        return DraftBlock(tokens, torch.tensor(q_tok, dtype=torch.float64), q_full,
                          time.perf_counter() - t0)
