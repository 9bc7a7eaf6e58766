"""The scoring backend: a verifier whose target rows come from a serving engine.

Each session keeps its committed ids only (the engine holds the KV, e.g. SGLang's radix
cache of the shared prefix); every batch asks the :class:`~cloud_api.scoring.interface.
Scorer` for the top-N raw logprobs at the block's g + 1 positions and runs *our*
acceptance rule, residual and certificate code on them
(:meth:`cloud_api.verifier.Verifier._verdict`, Leviathan et al. 2023 §2.3, AsymSpec
§IV-B). Sessions are admitted only with configs those rows verify exactly
(:mod:`cloud_api.scoring.exactness`).
"""

from __future__ import annotations

import time

import torch

from cloud_api.scoring.exactness import check_exact
from cloud_api.sessions import ApiError, Session
from cloud_api.verifier import Verifier
from edge_sdk.protocol import sampling as S
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

__all__ = ["ScoringError", "ScoringVerifier"]


class ScoringError(Exception):
    """The engine could not score (unreachable, refused, or a malformed answer)."""


class ScoringVerifier(Verifier):
    """A :class:`cloud_api.verifier.Verifier` over an engine's scores.

    Args:
        scorer: a :class:`cloud_api.scoring.interface.Scorer` (``top_n`` rows).
        vocab_size: the target's vocabulary (ids), max_context: its context (tokens).
        max_block: most draft tokens per block. dtype: the engine's compute dtype (the
            near-tie gap reported for greedy tokens, ``sampling.NEAR_TIE_GAP``).
    """

    supports_trees = False     # scores come per position, not per tree row

    def __init__(self, scorer, vocab_size: int, max_context: int,
                 max_block: int = MAX_DRAFT_TOKENS, dtype: str = "bfloat16"):
        self.scorer, self.model = scorer, None
        self.vocab_size, self.max_context = int(vocab_size), int(max_context)
        self.max_block = max_block
        self.passes, self.target_seconds = 0, 0.0
        self.near_tie_gap = S.near_tie_gap(dtype)
        self.near_ties = 0
        self.early_head, self.on_early_outcome, self._early = None, None, None
        self.early_frames = self.early_hits = 0
        self._provisional: dict = {}
        self.semantic, self.semantic_accepted = None, 0

    def check_acceptance(self, acceptance: str, cfg) -> None:
        """Semantic acceptance (WISV) reads the target's hidden states, which an
        engine's scores do not carry. Raises ApiError 422 ``semantic_unavailable``."""
        if acceptance == "semantic":
            raise ApiError(422, "semantic_unavailable", "semantic acceptance needs the "
                           "target's hidden states: this server verifies through a "
                           "scoring engine", "acceptance")

    def open(self, s: Session) -> float:
        """Admit a session. Raises ApiError 422 ``not_exact_on_backend``."""
        check_exact(s.cfg, self.scorer.top_n)
        return 0.0

    prefill = open

    def _crop(self, s: Session, length: int) -> None:
        """No cache of ours: the engine keeps (and reuses) the prefix."""

    def _check_cache(self, s: Session) -> None:
        """No cache of ours to check."""

    def dense(self, row: dict[int, float]) -> torch.Tensor:
        """One position's scores as a float64 [V] logit row (``-inf`` where the engine
        returned nothing). Raises ScoringError for ids outside the vocabulary."""
        x = torch.full((self.vocab_size,), float("-inf"), dtype=S.PROB_DTYPE)
        if not row:
            raise ScoringError("the engine returned no scores for a position")
        ids = torch.tensor(list(row.keys()), dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ScoringError("the engine returned a token id outside the vocabulary")
        x[ids] = torch.tensor(list(row.values()), dtype=S.PROB_DTYPE)
        return x

    def verify_batch(self, items: list, sinks=None) -> list:
        """Score the ready blocks of ``items`` in one engine request and decide each.
        Returns one VerifyResponse or ApiError per item (503 ``engine_unavailable``
        for all of them when the engine fails: retried, nothing committed)."""
        results, ready = self.ready_blocks(items)
        if not ready:
            return results
        t0 = time.perf_counter()
        try:
            scored = self.scorer.score([(ctx, blk) for *_, ctx, blk in ready])
            logits = [torch.stack([self.dense(r) for r in rows]) for rows in scored]
            if [len(x) for x in logits] != [len(blk) + 1 for *_, blk in ready]:
                raise ScoringError("the engine scored the wrong number of positions")
        except ScoringError as e:
            err = ApiError(503, "engine_unavailable", f"the scoring engine failed: {e}")
            return [err if r is None else r for r in results]
        share = (time.perf_counter() - t0) / len(ready)
        self.passes += 1
        for (i, s, req, ctx, blk), lg in zip(ready, logits):
            results[i] = self._decide(s, req, ctx, blk, lg, share)
        return results
