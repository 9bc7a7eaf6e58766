"""What a server needs to offer semantic acceptance (WISV §III): the decision head, the
channel-aware threshold policy and the per-block cap, and how a ``--wisv-head`` setting
resolves to them.

Policy only: :class:`SemanticAcceptance` says *whether* a mismatching draft token is
accepted (``accepts``); the verifier (:mod:`cloud_api.verifier`) owns the mechanism
(capturing the hidden state, walking the block, committing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloud_api.wisv.features import mismatch_features
from cloud_api.wisv.head import DecisionHead, load_head
from cloud_api.wisv.threshold import ChannelState, ThresholdPolicy

__all__ = ["ASSETS", "DEFAULT_MAX_PER_BLOCK", "DEFAULT_OPENING", "OPENINGS",
           "OPENING_MAX_TOKENS", "OPTION_KEYS", "LineTokens", "SemanticAcceptance",
           "opening_length", "shipped_head_path", "semantic_for", "take_options"]

log = logging.getLogger("cloud_api")

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "wisv"
"""Where the shipped heads live: ``<preset>.safetensors`` with its ``.json`` manifest."""

DEFAULT_MAX_PER_BLOCK = 4
"""Most draft tokens of one block accepted semantically (the rest of the block is
verified exactly): bounds how far one block can drift from the target. 4 with
deep blocks (depth 12); 2 held the accepted run to 1.18-1.24x of exact mode."""

OPENINGS = ("line", "off")
"""Where semantic acceptance starts in an answer: ``line`` after the answer's first
line (its opening: the first statement of a code answer, the first sentence or line of
a chat one; at most :data:`OPENING_MAX_TOKENS` tokens), ``off`` anywhere."""

DEFAULT_OPENING = "line"

OPENING_MAX_TOKENS = 32
"""The longest opening (tokens): an answer whose first line runs longer (a chat
paragraph) gets semantic acceptance from its 33rd token."""


@dataclass(frozen=True)
class LineTokens:
    """Where a tokenizer's tokens put line breaks, per token id (bool [V] each):
    ``newline`` the token's text holds a newline; ``lead`` it holds a non-whitespace
    character before its first newline; ``content`` it holds a non-whitespace character
    anywhere. Ids past the tokenizer's vocabulary are all False."""

    newline: torch.Tensor
    lead: torch.Tensor
    content: torch.Tensor

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> "LineTokens":
        """Decode every id once (~1 s for 151,936 ids)."""
        n = min(int(vocab_size), len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(n)],
                                       clean_up_tokenization_spaces=False)
        flags = torch.zeros(3, int(vocab_size), dtype=torch.bool)
        for i, t in enumerate(texts):
            if "\n" in t:
                flags[0, i] = True
                flags[1, i] = bool(t.split("\n", 1)[0].strip())
            flags[2, i] = bool(t.strip())
        return cls(flags[0], flags[1], flags[2])


def opening_length(ids, lines: LineTokens, max_tokens: int = OPENING_MAX_TOKENS) -> int:
    """Tokens in the opening of an answer that starts with ``ids`` (the answer's tokens
    so far, e.g. its committed tokens then a draft block): the opening ends with the
    first token that breaks a line after some content (a newline after a non-whitespace
    character); capped at ``max_tokens``. When ``ids`` hold no such token the opening
    runs past them: ``min(len(ids) + 1, max_tokens)``. A token at answer position
    ``j`` (0-based) lies past the opening iff ``j >= opening_length(ids)`` for any
    ``ids`` of length >= j."""
    n = len(ids)
    if n == 0:
        return min(1, max_tokens)
    t = torch.as_tensor(list(ids), dtype=torch.long).clamp(0, lines.newline.numel() - 1)
    seen = torch.cumsum(lines.content[t].long(), 0) - lines.content[t].long()  # before i
    ends = lines.newline[t] & (lines.lead[t] | (seen > 0))
    hit = torch.nonzero(ends).flatten()
    first = int(hit[0]) + 1 if hit.numel() else n + 1
    return min(first, int(max_tokens))


@dataclass
class SemanticAcceptance:
    """A server's semantic-acceptance setting.

    Args:
        head: the :class:`DecisionHead` (its hidden size is the target's).
        policy: the channel-aware threshold ``tau(channel)``.
        max_per_block: most semantic acceptances in one block (>= 1).
        manifest: the head's manifest (for logs and ``/healthz``), may be empty.
        opening: :data:`OPENINGS`; ``line`` keeps the answer's opening exact: a code
            answer's first statement chooses its approach (a different but likely first
            line, e.g. a placeholder comment, often changes the whole program), which a
            likelihood label over the next few tokens cannot see. Needs :meth:`bind`.
    Attributes:
        calls: head evaluations so far (one per block with a mismatch); tests read it.
        lines: the tokenizer's :class:`LineTokens` (set by :meth:`bind`).
    Raises:
        ValueError: ``max_per_block`` < 1 or an unknown ``opening``.
    """

    head: DecisionHead
    policy: ThresholdPolicy = field(default_factory=ThresholdPolicy)
    max_per_block: int = DEFAULT_MAX_PER_BLOCK
    manifest: dict = field(default_factory=dict)
    opening: str = DEFAULT_OPENING
    calls: int = 0
    lines: LineTokens | None = None

    def __post_init__(self):
        if int(self.max_per_block) < 1:
            raise ValueError("max_per_block must be >= 1")
        if self.opening not in OPENINGS:
            raise ValueError(f"opening must be one of {', '.join(OPENINGS)}")
        self.max_per_block = int(self.max_per_block)

    def bind(self, tokenizer, vocab_size: int) -> None:
        """Read the target tokenizer's line breaks (for ``opening="line"``; a no-op
        otherwise or when already bound)."""
        if self.opening == "line" and self.lines is None:
            self.lines = LineTokens.from_tokenizer(tokenizer, vocab_size)

    def first_allowed(self, answer, block) -> int:
        """The first offset in ``block`` (draft ids) where a semantic acceptance may
        happen after ``answer`` (the answer's committed ids): 0 with ``opening="off"``,
        else the opening's end relative to the block (may be > len(block)).
        Raises RuntimeError when ``opening="line"`` was never bound."""
        if self.opening == "off":
            return 0
        if self.lines is None:
            raise RuntimeError("SemanticAcceptance(opening='line') needs bind(tokenizer)")
        answer = list(answer)
        return max(0, opening_length(answer + list(block), self.lines) - len(answer))

    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size

    def threshold(self, channel: tuple | None) -> float:
        """tau for a request's ``channel`` element ``(rtt_s, uplink_bps, round_s)``
        (None: no report, the strict threshold)."""
        return self.policy(None if channel is None else ChannelState(*channel))

    @torch.no_grad()
    def probs(self, hidden: torch.Tensor, logits: torch.Tensor,
              draft: torch.Tensor) -> torch.Tensor:
        """P(accept) float32 [N] of N mismatching positions: ``hidden`` [N, H] (the
        LM head's input at the row that predicts each position), ``logits`` [N, V] (the
        processed rows the acceptance rule reads), ``draft`` long [N]. One head call."""
        self.calls += 1
        return self.head.prob(mismatch_features(hidden, logits, draft))


def shipped_head_path(preset: str | None) -> Path | None:
    """The shipped head file of a target preset, or None when there is none."""
    if not preset:
        return None
    p = ASSETS / f"{preset}.safetensors"
    return p if p.is_file() and p.with_suffix(".json").is_file() else None


def semantic_for(setting: str | None, hidden_size: int, preset: str | None = None, *,
                 strict: float | None = None, relaxed: float | None = None,
                 max_per_block: int = DEFAULT_MAX_PER_BLOCK,
                 opening: str | None = None) -> SemanticAcceptance | None:
    """The server's semantic acceptance for a ``--wisv-head`` setting.

    Args:
        setting: ``off``/None (semantic sessions refused, 422 ``semantic_unavailable``);
            ``auto`` (the shipped head of ``preset`` when its file exists, else off, with
            a log line); a path to a head ``.safetensors`` (its ``.json`` manifest beside).
        hidden_size: the target's hidden size (the head must match it).
        strict, relaxed: the threshold on a good / bad link (None: the policy's
            defaults, :class:`ThresholdPolicy`).
        max_per_block: most semantic acceptances per block.
        opening: :data:`OPENINGS` (None: :data:`DEFAULT_OPENING`); the server binds
            the tokenizer (:meth:`SemanticAcceptance.bind`).
    Raises:
        ValueError: one line naming the file or the setting (missing file, bad manifest,
            sha256 or hidden-size mismatch, bad threshold, cap or opening).
    """
    text = "off" if setting is None else str(setting).strip()
    if text.lower() == "off":
        return None
    kw = {k: float(v) for k, v in (("strict", strict), ("relaxed", relaxed)) if v is not None}
    policy = ThresholdPolicy(**kw)             # raises ValueError on a bad setting
    opening = DEFAULT_OPENING if opening is None else str(opening)
    if opening not in OPENINGS:
        raise ValueError(f"WISV opening {opening!r}: one of {', '.join(OPENINGS)}")
    if text.lower() == "auto":
        path = shipped_head_path(preset)
        if path is None:
            log.info("semantic acceptance off: no shipped WISV head for %s (pass "
                     "--wisv-head PATH, or train one with specrelay wisv train)", preset)
            return None
    else:
        path = Path(text)
    try:
        head, man = load_head(path, hidden_size)
    except ValueError as e:
        if str(e).startswith("WISV head"):
            raise
        raise ValueError(f"WISV head {path}: {_line(e)}") from None
    except (RuntimeError, OSError, KeyError, TypeError) as e:   # weights of another shape,
        raise ValueError(f"WISV head {path}: {_line(e)}") from None   # unreadable file
    return SemanticAcceptance(head, policy, max_per_block, man, opening)


OPTION_KEYS = ("wisv_head", "wisv_strict", "wisv_relaxed", "wisv_max_per_block",
               "wisv_opening")
"""The ``serve --wisv-*`` options as keyword arguments of the in-process servers
(:func:`cloud_api.local.local_server`, the benchmark's cloud process)."""


def take_options(kw: dict, model, preset: str | None = None) -> dict:
    """``kw`` (app/service options) with the :data:`OPTION_KEYS` it holds replaced by
    ``semantic`` (a :class:`SemanticAcceptance`, or None when the head is off / auto
    finds none) for the loaded target ``model``. Unchanged when none is present.
    Raises ValueError as :func:`semantic_for`."""
    if not any(k in kw for k in OPTION_KEYS):
        return kw
    kw = dict(kw)
    opts = {k: kw.pop(k, None) for k in OPTION_KEYS}
    kw["semantic"] = semantic_for(
        opts["wisv_head"], int(model.config.hidden_size), preset,
        strict=opts["wisv_strict"], relaxed=opts["wisv_relaxed"],
        max_per_block=opts["wisv_max_per_block"] or DEFAULT_MAX_PER_BLOCK,
        opening=opts["wisv_opening"])
    return kw


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
