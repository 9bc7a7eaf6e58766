"""The verifier interface every backend implements (what
:class:`cloud_api.service.CloudService` and its batching queue call).

A backend decides blocks with the acceptance rule of Leviathan et al. 2023 §2.3 and the
correction stages of AsymSpec §IV-B; it differs only in where the target's rows come
from (its own model pass, or an engine's scores)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cloud_api.sessions import Session
from edge_sdk.protocol.wire import CorrectionRequest, CorrectionResponse, VerifyRequest

__all__ = ["VerifierBackend", "Scorer"]


@runtime_checkable
class VerifierBackend(Protocol):
    """``vocab_size`` (ids), ``max_context`` (tokens), ``max_block`` (draft tokens),
    ``passes`` and ``target_seconds`` (counters), ``early_head`` (FSD exit or None)."""

    vocab_size: int
    max_context: int
    max_block: int
    passes: int
    target_seconds: float

    def open(self, s: Session) -> float:
        """A new session (prefill or admission). Returns seconds. Raises ApiError
        (e.g. 422: a sampling config this backend cannot verify exactly)."""

    def check_acceptance(self, acceptance: str, cfg) -> None:
        """May a session be created with ``acceptance`` (``exact``/``semantic``) and
        sampling config ``cfg``? Raises ApiError 422 (field ``acceptance``)."""

    def check(self, s: Session, req: VerifyRequest) -> None:
        """State checks before any charge or mutation. Raises ApiError (409/422)."""

    def verify_batch(self, items: list, sinks=None) -> list:
        """One VerifyResponse or ApiError per ``(session, request)`` item, in order."""

    def correction(self, s: Session, req: CorrectionRequest) -> CorrectionResponse:
        """More correction information for the block awaiting its correction token."""

    def close(self, s: Session) -> None:
        """The session ended (deleted, evicted or expired)."""


class Scorer(Protocol):
    """An engine that scores token sequences: for each ``(context, block)`` the raw
    (temperature-1) log-probabilities of the ``top_n`` most likely next tokens at each
    of the ``len(block) + 1`` positions after ``context + block[:i]``."""

    top_n: int

    def score(self, rows: list[tuple[list[int], list[int]]]) -> list[list[dict[int, float]]]:
        """Per row, per position: token id -> logprob (at least ``top_n`` entries or the
        whole vocabulary). Raises ScoringError (engine unreachable or malformed)."""
