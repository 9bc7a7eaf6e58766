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

__all__ = ["ASSETS", "DEFAULT_MAX_PER_BLOCK", "OPTION_KEYS", "SemanticAcceptance",
           "shipped_head_path", "semantic_for", "take_options"]

log = logging.getLogger("cloud_api")

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "wisv"
"""Where the shipped heads live: ``<preset>.safetensors`` with its ``.json`` manifest."""

DEFAULT_MAX_PER_BLOCK = 4
"""Most draft tokens of one block accepted semantically (the rest of the block is
verified exactly): bounds how far one block can drift from the target. 4 with
deep blocks (depth 12); 2 held the accepted run to 1.18-1.24x of exact mode."""


@dataclass
class SemanticAcceptance:
    """A server's semantic-acceptance setting.

    Args:
        head: the :class:`DecisionHead` (its hidden size is the target's).
        policy: the channel-aware threshold ``tau(channel)``.
        max_per_block: most semantic acceptances in one block (>= 1).
        manifest: the head's manifest (for logs and ``/healthz``), may be empty.
    Attributes:
        calls: head evaluations so far (one per block with a mismatch); tests read it.
    Raises:
        ValueError: ``max_per_block`` < 1.
    """

    head: DecisionHead
    policy: ThresholdPolicy = field(default_factory=ThresholdPolicy)
    max_per_block: int = DEFAULT_MAX_PER_BLOCK
    manifest: dict = field(default_factory=dict)
    calls: int = 0

    def __post_init__(self):
        if int(self.max_per_block) < 1:
            raise ValueError("max_per_block must be >= 1")
        self.max_per_block = int(self.max_per_block)

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
                 max_per_block: int = DEFAULT_MAX_PER_BLOCK) -> SemanticAcceptance | None:
    """The server's semantic acceptance for a ``--wisv-head`` setting.

    Args:
        setting: ``off``/None (semantic sessions refused, 422 ``semantic_unavailable``);
            ``auto`` (the shipped head of ``preset`` when its file exists, else off, with
            a log line); a path to a head ``.safetensors`` (its ``.json`` manifest beside).
        hidden_size: the target's hidden size (the head must match it).
        strict, relaxed: the threshold on a good / bad link (None: the policy's
            defaults, :class:`ThresholdPolicy`).
        max_per_block: most semantic acceptances per block.
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
    return SemanticAcceptance(head, policy, max_per_block, man)


OPTION_KEYS = ("wisv_head", "wisv_strict", "wisv_relaxed", "wisv_max_per_block")
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
        max_per_block=opts["wisv_max_per_block"] or DEFAULT_MAX_PER_BLOCK)
    return kw


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
