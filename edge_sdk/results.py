"""What a generation hands back: :class:`TokenEvent` (streamed), :class:`GenerationResult`
(at the end) and :class:`CloudUnreachable` (raised when the cloud stays lost)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TokenEvent", "GenerationResult", "CloudUnreachable"]


class CloudUnreachable(ConnectionError):
    """The verification API could not be reached within ``offline_timeout_s``."""


@dataclass
class TokenEvent:
    """One committed token: id, the text it adds, and whether the target verified it."""

    token_id: int
    text: str
    verified: bool = True


@dataclass
class GenerationResult:
    """``verified[i]`` is False for a token produced by the draft alone while the cloud
    was unreachable (``on_cloud_loss="draft_only"``); every other token is the target's."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_ids: list[int]
    metrics: dict = field(default_factory=dict)
    verified: list[bool] = field(default_factory=list)

    @property
    def all_verified(self) -> bool:
        return all(self.verified)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "verified": self.verified,
                "metrics": self.metrics}
