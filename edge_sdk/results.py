"""What a generation hands back: :class:`TokenEvent` (streamed), :class:`GenerationResult`
(at the end) and :class:`CloudUnreachable` (raised when the cloud stays lost)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TokenEvent", "GenerationResult", "CloudUnreachable"]


class CloudUnreachable(ConnectionError):
    """The verification API could not be reached within ``offline_timeout_s``."""


@dataclass
class TokenEvent:
    """One committed token: id, the text it adds, whether the target verified it, and
    whether it was accepted *semantically* (WISV, ``acceptance="semantic"`` only: a
    draft token the target would not have chosen, accepted by the cloud's decision
    head)."""

    token_id: int
    text: str
    verified: bool = True
    semantic: bool = False


@dataclass
class GenerationResult:
    """``verified[i]`` is False for a token produced by the draft alone while the cloud
    was unreachable (``on_cloud_loss="draft_only"``); every other token is verified.

    ``acceptance``: the request's ``exact`` or ``semantic`` (WISV, lossy);
    ``semantic_accepted_tokens``: committed tokens accepted semantically (``semantic[i]``
    marks them). ``exact_target_output`` is False when the output is not exactly the
    target's (greedy: token for token; sampling: in distribution): some token was
    accepted semantically or produced by the draft alone."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_ids: list[int]
    metrics: dict = field(default_factory=dict)
    verified: list[bool] = field(default_factory=list)
    acceptance: str = "exact"
    semantic: list[bool] = field(default_factory=list)
    seed: int | None = None     # the request's seed (a fresh one when none was given)

    @property
    def all_verified(self) -> bool:
        return all(self.verified)

    @property
    def semantic_accepted_tokens(self) -> int:
        return sum(self.semantic)

    @property
    def exact_target_output(self) -> bool:
        return self.semantic_accepted_tokens == 0 and self.all_verified

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "verified": self.verified,
                "acceptance": self.acceptance,
                "semantic_accepted_tokens": self.semantic_accepted_tokens,
                "exact_target_output": self.exact_target_output, "seed": self.seed,
                "metrics": self.metrics}
