"""What a server needs to offer semantic acceptance (WISV §III): the decision head, the
channel-aware threshold policy and the per-block cap, and how a ``--wisv-head`` setting
resolves to them.

Policy only: :class:`SemanticAcceptance` says *whether* a mismatching draft token is
accepted (``accepts``); the verifier (:mod:`cloud_api.verifier`) owns the mechanism
(capturing the hidden state, walking the block, committing).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloud_api.wisv.features import mismatch_features
from cloud_api.wisv.head import DecisionHead, load_head
from cloud_api.wisv.threshold import ChannelState, ThresholdPolicy

__all__ = ["ASSETS", "DEFAULT_GUARD", "DEFAULT_MAX_PER_BLOCK", "GUARDS", "OPTION_KEYS",
           "SemanticAcceptance", "guarded_text", "guarded_tokens", "shipped_head_path",
           "semantic_for", "take_options"]

log = logging.getLogger("cloud_api")

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "wisv"
"""Where the shipped heads live: ``<preset>.safetensors`` with its ``.json`` manifest."""

DEFAULT_MAX_PER_BLOCK = 4
"""Most draft tokens of one block accepted semantically (the rest of the block is
verified exactly): bounds how far one block can drift from the target. 4 with
deep blocks (depth 12); 2 held the accepted run to 1.18-1.24x of exact mode."""

GUARDS = ("operators", "off")
"""Token guards: ``operators`` never accepts a draft token semantically when it or the
target's token is an operator, a comparison, a boolean keyword or a number
(:func:`guarded_tokens`); ``off`` leaves every mismatch to the head."""

DEFAULT_GUARD = "off"
"""Off by default: on executed mismatches of the head's training problems the guard
halves the task-harming acceptances, but on the 100 evaluation problems (depth 16, cap
4) it lowered the accepted-length gain from 1.38x / 1.43x to 1.30x / 1.30x on weak /
cellular-edge without a measurable pass@1 change (-4 / -3 points against -3 / -3)."""

_GUARD_TEXT = re.compile(r"(==|!=|<=|>=|<|>|\+|-|\*|\*\*|/|//|%|\+=|-=|\*=|/=|//=|%="
                         r"|=|&|\||\^|~|<<|>>|\d+(\.\d*)?|and|or|not|in|is|True|False|None)")


def guarded_text(text: str) -> bool:
    """Whether a token's text is guarded (:func:`guarded_tokens`)."""
    return _GUARD_TEXT.fullmatch(text.strip()) is not None


def guarded_tokens(tokenizer, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: the ids whose text, stripped of whitespace, is a whole
    operator (arithmetic, comparison, assignment, bitwise), a boolean or membership
    keyword (``and or not in is``), a constant (``True False None``) or a number.
    Swapping one such token for another changes what a program computes while leaving
    its likelihood close (``<=`` for ``<``, ``1`` for ``0``); the decision head, which
    reads the target's hidden state and likelihoods, cannot tell those swaps from
    harmless ones (a different name or spacing). Ids past the tokenizer's vocabulary
    are False. Decodes every id once (~1 s for 151,936 ids)."""
    n = min(int(vocab_size), len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(n)],
                                   clean_up_tokenization_spaces=False)
    out = torch.zeros(int(vocab_size), dtype=torch.bool)
    out[:n] = torch.tensor([guarded_text(t) for t in texts], dtype=torch.bool)
    return out


@dataclass
class SemanticAcceptance:
    """A server's semantic-acceptance setting.

    Args:
        head: the :class:`DecisionHead` (its hidden size is the target's).
        policy: the channel-aware threshold ``tau(channel)``.
        max_per_block: most semantic acceptances in one block (>= 1).
        manifest: the head's manifest (for logs and ``/healthz``), may be empty.
        guard: :data:`GUARDS`; ``operators`` refuses mismatches where the draft or the
            target token is one of :func:`guarded_tokens` (needs :meth:`bind`).
    Attributes:
        calls: head evaluations so far (one per block with a mismatch); tests read it.
        guarded: bool [V] of the guarded ids (set by :meth:`bind`).
    Raises:
        ValueError: ``max_per_block`` < 1 or an unknown ``guard``.
    """

    head: DecisionHead
    policy: ThresholdPolicy = field(default_factory=ThresholdPolicy)
    max_per_block: int = DEFAULT_MAX_PER_BLOCK
    manifest: dict = field(default_factory=dict)
    guard: str = DEFAULT_GUARD
    calls: int = 0
    guarded: torch.Tensor | None = None

    def __post_init__(self):
        if int(self.max_per_block) < 1:
            raise ValueError("max_per_block must be >= 1")
        if self.guard not in GUARDS:
            raise ValueError(f"guard must be one of {', '.join(GUARDS)}")
        self.max_per_block = int(self.max_per_block)

    def bind(self, tokenizer, vocab_size: int) -> None:
        """Read the target tokenizer's guarded ids (for ``guard="operators"``; a no-op
        otherwise or when already bound)."""
        if self.guard == "operators" and self.guarded is None:
            self.guarded = guarded_tokens(tokenizer, vocab_size)

    def allowed(self, draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """bool [N]: which of N mismatches (draft ids, target ids: long [N]) the guard
        leaves to the head. Raises RuntimeError when ``guard="operators"`` was never
        bound."""
        if self.guard == "off":
            return torch.ones(draft.shape, dtype=torch.bool)
        if self.guarded is None:
            raise RuntimeError("SemanticAcceptance(guard='operators') needs "
                               "bind(tokenizer)")
        n = self.guarded.numel()
        hit = lambda t: (t < n) & self.guarded[t.clamp(0, n - 1)]  # noqa: E731
        return ~(hit(draft.long()) | hit(target.long()))

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
                 guard: str | None = None) -> SemanticAcceptance | None:
    """The server's semantic acceptance for a ``--wisv-head`` setting.

    Args:
        setting: ``off``/None (semantic sessions refused, 422 ``semantic_unavailable``);
            ``auto`` (the shipped head of ``preset`` when its file exists, else off, with
            a log line); a path to a head ``.safetensors`` (its ``.json`` manifest beside).
        hidden_size: the target's hidden size (the head must match it).
        strict, relaxed: the threshold on a good / bad link (None: the policy's
            defaults, :class:`ThresholdPolicy`).
        max_per_block: most semantic acceptances per block.
        guard: :data:`GUARDS` (None: :data:`DEFAULT_GUARD`).
    Raises:
        ValueError: one line naming the file or the setting (missing file, bad manifest,
            sha256 or hidden-size mismatch, bad threshold or cap).
    """
    text = "off" if setting is None else str(setting).strip()
    if text.lower() == "off":
        return None
    kw = {k: float(v) for k, v in (("strict", strict), ("relaxed", relaxed)) if v is not None}
    policy = ThresholdPolicy(**kw)             # raises ValueError on a bad setting
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
    return SemanticAcceptance(head, policy, max_per_block, man, guard or DEFAULT_GUARD)


OPTION_KEYS = ("wisv_head", "wisv_strict", "wisv_relaxed", "wisv_max_per_block",
               "wisv_guard")
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
        guard=opts["wisv_guard"])
    return kw


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
