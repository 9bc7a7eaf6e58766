"""The Drafter mechanism: propose a block of draft tokens from a confirmed prefix.

Backends (torch, ONNX, n-gram) implement :meth:`Drafter.sync` / :meth:`Drafter.step`;
the sampling loop here is shared, so every backend samples with the same processors as
the target (CASES.md 3-4) and reports the exact q it sampled from.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from edge_sdk.protocol.sampling import SamplingConfig, sample_next
from edge_sdk.protocol.tree import MAX_SIBLINGS

CANDIDATES = MAX_SIBLINGS
"""Next-best draft tokens recorded per greedy position (possible tree siblings)."""


def candidates(logits: torch.Tensor, chosen: int) -> tuple[list[int], float]:
    """The :data:`CANDIDATES` best ids of ``logits`` [V] other than ``chosen`` (best
    first, finite only) and the softmax probability of ``chosen``."""
    top = torch.topk(logits, CANDIDATES + 1)
    ids = [int(t) for t, v in zip(top.indices, top.values)
           if int(t) != chosen and bool(torch.isfinite(v))][:CANDIDATES]
    conf = float(torch.exp(logits[chosen].float() - torch.logsumexp(logits.float(), -1)))
    return ids, conf


_BLOCK = 64
"""Width of the vocabulary slices whose maxima :func:`greedy_pick` ranks."""


def greedy_pick(logits: torch.Tensor) -> tuple[int, list[int], float] | None:
    """The greedy draft token of ``logits`` (float [V], contiguous) with its candidates,
    from one pass over the vocabulary: ``(argmax with ties to the lowest id,
    candidates(logits, argmax))``, the same answer as :func:`sample_next` (greedy, no
    repetition penalty) followed by :func:`candidates`.

    The pass takes the maxima of ``V / 64`` slices; the ``CANDIDATES + 1`` best values
    lie in the ``CANDIDATES + 1`` slices with the largest maxima (a slice holding one of
    them has a maximum at least that value), so a top-k over those 320 values replaces
    an argmax and a top-k over all V (on the 151,936-id Qwen vocabulary, in situ: a
    1.38 ms pick against 2.91 ms, medians, one thread; ``bench.probes.draft_step``).
    Candidates of equal value may come in another order than :func:`torch.topk`'s
    (which leaves that order unspecified).

    Returns None (use the general path) when V is not a multiple of 64, holds fewer
    than ``CANDIDATES + 1`` slices, or the best value is NaN or -inf.
    """
    v = logits.shape[-1]
    if logits.dim() != 1 or v % _BLOCK or v < _BLOCK * (CANDIDATES + 1) \
            or not logits.is_contiguous():
        return None
    x = logits.view(-1, _BLOCK)
    m = x.amax(dim=1)                                   # [V / 64] slice maxima
    top_m, top_b = torch.topk(m, CANDIDATES + 1)
    best = float(top_m[0])
    if math.isnan(best) or best == -math.inf:
        return None
    blk = int(torch.nonzero(m == top_m[0])[0])          # ties: the lowest id
    d = blk * _BLOCK + int(torch.nonzero(x[blk] == top_m[0])[0])
    vals, i = torch.topk(x[top_b].reshape(-1), CANDIDATES + 1)
    ids = (top_b[i // _BLOCK] * _BLOCK + i % _BLOCK).tolist()
    cands = [t for t, val in zip(ids, vals.tolist())
             if t != d and math.isfinite(val)][:CANDIDATES]
    conf = float(torch.exp(logits[d].float() - torch.logsumexp(logits.float(), -1)))
    return d, cands, conf


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
    #: greedy only: per position the draft's next-best ids after ``tokens[i]`` (best
    #: first, :data:`CANDIDATES` of them) and the draft's probability of ``tokens[i]``;
    #: a sibling policy picks tree siblings from them (:mod:`edge_sdk.control.siblings`)
    cands: list[list[int]] | None = None
    conf: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> "DraftBlock":
        """The block's first ``n`` positions (itself when it has no more). Draws and
        candidates of the kept positions are unchanged, so a trimmed block verifies
        exactly as if only ``n`` tokens had been drafted with the same generator."""
        if n >= len(self.tokens):
            return self
        return DraftBlock(self.tokens[:n], self.q_tok[:n],
                          None if self.q is None else self.q[:n], self.draft_s,
                          None if self.cands is None else self.cands[:n],
                          None if self.conf is None else self.conf[:n])


class Proposal:
    """The sampling side of drafting one block: :meth:`take` samples the next draft
    token from the draft's logits after the tokens so far, exactly as
    :meth:`Drafter.propose` does (shared processors, recorded q and greedy candidates),
    so a backend that runs the forwards of several blocks at once (batched drafting)
    samples each block as if it had been drafted alone.

    Args: context [n] (the confirmed prefix), depth (>= 1), cfg, generator.
    """

    def __init__(self, context: Sequence[int], depth: int, cfg: SamplingConfig,
                 generator: torch.Generator | None = None):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if not context:
            raise ValueError("context must hold at least one token")
        self.context, self.depth, self.cfg, self.generator = list(context), depth, cfg, generator
        self.seen = list(context)
        self.tokens: list[int] = []
        self._q_tok: list[float] = []
        self._q_rows: list[torch.Tensor] = []
        self._cands: list[list[int]] = []
        self._conf: list[float] = []
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.depth

    def take(self, logits: torch.Tensor) -> int:
        """Sample the next draft token from ``logits`` (float32 [V], after
        ``self.seen``) and record it; returns its id."""
        picked = (greedy_pick(logits) if self.cfg.greedy
                  and self.cfg.repetition_penalty == 1.0 else None)
        if picked is not None:                  # one pass: the same token and candidates
            d, q = picked[0], None
        else:
            d, q = sample_next(logits, self.cfg, self.seen, self.generator)
        self.tokens.append(d)
        self._q_tok.append(1.0 if q is None else float(q[d]))
        if q is not None:
            self._q_rows.append(q)
        elif self.cfg.greedy:
            ids, c = picked[1:] if picked is not None else candidates(logits, d)
            self._cands.append(ids)
            self._conf.append(c)
        self.seen.append(d)
        return d

    def block(self) -> DraftBlock:
        """The drafted block (its ``draft_s`` from this proposal's start)."""
        q_full = torch.stack(self._q_rows) if self._q_rows else None
        greedy = self.cfg.greedy and len(self._cands) == len(self.tokens)
        return DraftBlock(list(self.tokens), torch.tensor(self._q_tok, dtype=torch.float64),
                          q_full, time.perf_counter() - self.t0,
                          self._cands if greedy else None, self._conf if greedy else None)


class PrefillStopped(RuntimeError):
    """A long prefill stopped at a chunk border on request (:meth:`Drafter.stop_prefill`):
    the request that wanted it ended first."""


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

    def stop_prefill(self, on: bool) -> None:
        """Ask a long ``sync`` running on another thread to stop at its next chunk
        border (``on`` True; it raises :class:`PrefillStopped`, the cache holding the
        chunks done, which a later ``sync`` reuses), or clear the request (False).
        Backends that prefill in one piece ignore it (the prefill then runs to its
        end)."""

    def fork(self) -> "Drafter":
        """A drafter sharing this one's weights with its own KV cache, for one more
        concurrent request. Backends that cannot fork return ``self`` (still correct:
        ``sync`` rolls the shared cache back, at the cost of re-prefilling)."""
        return self

    def batch_group(self):
        """Drafters returning the same non-None key can draft several blocks in one
        forward per step (:meth:`propose_many`); None: this one drafts alone."""
        return None

    @staticmethod
    def propose_many(drafters: Sequence["Drafter"], proposals: Sequence[Proposal]
                     ) -> list[DraftBlock]:
        """Draft ``proposals[i]`` with ``drafters[i]`` (one drafter per proposal, all
        of one :meth:`batch_group`). Here one after another; a backend that batches
        overrides it. Returns the blocks in order."""
        return [d._run(p) for d, p in zip(drafters, proposals)]

    def _run(self, p: Proposal) -> DraftBlock:
        logits = self.sync(p.context)
        while True:
            d = p.take(logits)
            if p.done:
                return p.block()
            logits = self.step(d)

    def propose(self, context: Sequence[int], depth: int, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> DraftBlock:
        """Draft ``depth`` tokens after ``context`` [n] with the target's sampling config.

        Returns a :class:`DraftBlock`. Greedy configs draft the argmax (q one-hot).
        Raises ValueError for depth < 1 or an empty context.
        """
        return self._run(Proposal(context, depth, cfg, generator))
