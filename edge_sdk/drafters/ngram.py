"""N-gram / prompt-lookup drafter (Saxena 2023, "Prompt Lookup Decoding"; Fu et al. 2024,
"Lookahead decoding" n-gram pool): match the last n tokens of the context against an
earlier occurrence and propose the token that followed it.

**One-hot q.** A lookup proposal is deterministic given the prefix, so its draft
distribution is one-hot: ``q(d) = 1`` for the proposed token d. The speculative rule
(Leviathan et al. 2023 §2.3) stays exact with no change on either side:

* accept d with probability ``min(1, p(d)/q(d)) = p(d)`` (the verifier tests ``u*1 <= p(d)``);
* on rejection the residual ``max(0, p - q)`` is p with d removed (``p(d) - 1 <= 0``),
  renormalised by ``Z = 1 - p(d)``: the correction is an exact draw from p conditioned
  on "not d", so ``P(out = d) = p(d)`` and ``P(out = v) = (1 - p(d)) p(v)/(1 - p(d))``.

The edge keeps the full q row for corrections (bounded support, proposals, full
fallback — ``edge_sdk.correction``): a one-hot float64 row [V] produced by the shared
sampling path (``Drafter.propose`` processes the lookup logits ``0`` at d and ``-inf``
elsewhere, whose softmax is exactly 1.0 at d after every processor).

**No match.** Alone, the drafter proposes only while the lookup matches: ``propose`` may
return a block shorter than requested, or empty (depth 0: the round is a plain target
step). With ``base`` (a model drafter) it mixes per position: n-gram proposals where the
lookup matches, the model's sampled draft elsewhere (and for the first ``model_first``
positions, to *extend a model draft* with lookup tokens). Choosing the source from the
prefix alone keeps every ``q_i`` a function of the prefix, so the rule stays exact.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from edge_sdk.drafters.base import DraftBlock, Drafter
from edge_sdk.protocol.sampling import SamplingConfig


class NgramIndex:
    """Most recent continuation of every n-gram (n in ``n_min..n_max``) of a token list,
    maintained incrementally with an undo log so ``truncate`` is O(tokens removed)."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_max, self.n_min = n_max, n_min
        self.ids: list[int] = []
        self.last: dict[tuple, int] = {}      # n-gram -> index of the token after it
        self._log: list[tuple[int, tuple, int | None]] = []

    def append(self, token: int) -> None:
        i = len(self.ids)
        self.ids.append(int(token))
        for n in range(self.n_min, self.n_max + 1):
            if i - n < 0:
                break
            key = tuple(self.ids[i - n:i])
            self._log.append((i, key, self.last.get(key)))
            self.last[key] = i

    def truncate(self, k: int) -> None:
        while self._log and self._log[-1][0] >= k:
            _, key, prev = self._log.pop()
            if prev is None:
                del self.last[key]
            else:
                self.last[key] = prev
        del self.ids[k:]

    def sync(self, context: Sequence[int]) -> None:
        """Hold exactly ``context``: roll back to the longest common prefix, then extend."""
        common = 0
        for a, b in zip(self.ids, context):
            if a != b:
                break
            common += 1
        self.truncate(common)
        for t in context[common:]:
            self.append(t)

    def lookup(self) -> int | None:
        """Continuation of the longest suffix n-gram seen earlier (most recent), or None."""
        ids = self.ids
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            j = self.last.get(tuple(ids[len(ids) - n:]))
            if j is not None:
                return ids[j]
        return None


class NgramDrafter(Drafter):
    """Prompt-lookup drafter, alone or mixed with a model drafter (see module docstring).

    Args:
        vocab_size: V (needed without ``base``).
        n_max, n_min: n-gram sizes tried, longest first (tokens).
        base: optional model :class:`Drafter` drafting where the lookup has no match.
        model_first: with ``base``: the first ``model_first`` positions of every block
            come from the model, later positions from the lookup when it matches.
    """

    def __init__(self, vocab_size: int | None = None, *, n_max: int = 3, n_min: int = 1,
                 base: Drafter | None = None, model_first: int = 0):
        if base is None and vocab_size is None:
            raise ValueError("vocab_size is required without a base drafter")
        self.vocab_size = int(vocab_size if vocab_size is not None else base.vocab_size)
        if base is not None and base.vocab_size != self.vocab_size:
            raise ValueError("vocab_size differs from the base drafter's")
        self.base, self.model_first = base, int(model_first)
        self.n_max, self.n_min = n_max, n_min
        self.index = NgramIndex(n_max, n_min)
        self._start = 0                  # context length at the last sync (block start)
        self.last_source: str | None = None    # "ngram" | "model" | None (no proposal)
        self.stats = {"ngram": 0, "model": 0}

    def fork(self) -> "NgramDrafter":
        return NgramDrafter(self.vocab_size, n_max=self.n_max, n_min=self.n_min,
                            base=None if self.base is None else self.base.fork(),
                            model_first=self.model_first)

    # ------------------------------------------------------------------ Drafter API

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Index ``context``; logits for the next position (one-hot on a match)."""
        if not context:
            raise ValueError("context must hold at least one token")
        self.index.sync(context)
        self._start = len(context)
        return self._next_logits()

    def step(self, token: int) -> torch.Tensor:
        self.index.append(token)
        return self._next_logits()

    def cache_len(self) -> int:
        """Tokens indexed (the n-gram drafter's "cache")."""
        return len(self.index.ids)

    @property
    def matched(self) -> bool:
        """The logits from the last ``sync``/``step`` hold a real proposal."""
        return self.last_source is not None

    def _next_logits(self) -> torch.Tensor:
        pos = len(self.index.ids) - self._start
        d = None if (self.base is not None and pos < self.model_first) else self.index.lookup()
        if d is not None:
            self.last_source = "ngram"
            x = torch.full((self.vocab_size,), -math.inf, dtype=torch.float32)
            x[d] = 0.0
            return x
        if self.base is not None:
            self.last_source = "model"
            return self.base.sync(self.index.ids)
        self.last_source = None          # no proposal: uniform logits, never drafted
        return torch.zeros(self.vocab_size, dtype=torch.float32)

    def match_length(self, context: Sequence[int], depth: int) -> int:
        """How many lookup tokens can be chained after ``context`` (<= depth)."""
        self.sync(context)
        k = 0
        while k < depth and self.matched:
            k += 1
            if k < depth:
                self.step(self.index.lookup())
        return k

    def propose(self, context: Sequence[int], depth: int, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> DraftBlock:
        """Draft up to ``depth`` tokens (exactly ``depth`` with a base drafter).

        Alone, the block stops at the first position without a match; it may be empty
        (``len(block) == 0``: send a plain target step). Sampling goes through the shared
        :meth:`Drafter.propose` loop, so q rows are one-hot float64 [V] for lookup
        positions and the model's processed distribution elsewhere (None when greedy).
        """
        if depth < 1:
            raise ValueError("depth must be >= 1")
        t0 = time.perf_counter()
        if self.base is None:
            depth = self.match_length(context, depth)
            if depth == 0:
                q = None if cfg.greedy else torch.zeros(0, self.vocab_size, dtype=torch.float64)
                return DraftBlock([], torch.zeros(0, dtype=torch.float64), q,
                                  time.perf_counter() - t0)
        block = super().propose(context, depth, cfg, generator)
        block.draft_s = time.perf_counter() - t0
        return block
