"""Sampling processors and the speculative-sampling math, shared by edge and cloud.

One implementation, imported by the drafter (edge), the correction logic (edge) and the
verifier (cloud). All functions are pure and batched over leading dimensions.

Notation (Leviathan et al. 2023 §2.3): a block of depth ``g`` holds draft tokens
``d_1..d_g``; ``q_i`` is the draft distribution at position i and ``p_i`` the target's,
both *after* the processors
(repetition penalty, temperature, top-k, top-p). Probabilities are float64 throughout:
the value ``q_i(d_i)`` sent on the wire is bit-for-bit the value the token was sampled
from (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling").
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

PROB_DTYPE = torch.float64


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings applied identically to draft (q) and target (p).

    temperature: 0 means greedy (argmax, ties -> lowest token id).
    top_k: keep the k largest logits (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    repetition_penalty: CTRL-style penalty on tokens already in the prefix (1 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        """Raises ValueError naming the field and its allowed range."""
        for name in ("temperature", "top_k", "top_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"sampling.{name}: {v!r} is not a number")
        checks = {
            "temperature": (0.0 <= self.temperature <= 100.0
                            and math.isfinite(self.temperature), "0 (greedy) to 100"),
            "top_k": (isinstance(self.top_k, int) and self.top_k >= 0,
                      "an integer >= 0 (0 = off)"),
            "top_p": (0.0 < self.top_p <= 1.0, "in (0, 1] (1 = off)"),
            "repetition_penalty": (0.0 < self.repetition_penalty <= 100.0,
                                   "in (0, 100] (1 = off)"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"sampling.{name}: invalid value {getattr(self, name)!r} "
                                 f"(allowed: {allowed})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def config_id(self) -> int:
        """16-bit identity of the config; both sides check it on every block."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:2], "little")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingConfig":
        """Build from a wire/JSON dict. Raises ValueError naming the bad field."""
        d = dict(d or {})
        unknown = set(d) - {"temperature", "top_k", "top_p", "repetition_penalty"}
        if unknown:
            raise ValueError(f"sampling.{sorted(map(str, unknown))[0]}: unknown field")
        kw = {}
        for name, typ in (("temperature", float), ("top_k", int), ("top_p", float),
                          ("repetition_penalty", float)):
            if name in d:
                v = d[name]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                        typ is int and not isinstance(v, int)):
                    raise ValueError(f"sampling.{name}: expected {typ.__name__}")
                try:
                    kw[name] = typ(v)
                except OverflowError:   # a JSON integer too large for a float
                    raise ValueError(f"sampling.{name}: out of range") from None
        return cls(**kw)


# ----------------------------------------------------------------------------- processors

def presence_mask(prefix: torch.Tensor, block: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which tokens each block position has seen (for repetition penalty).

    Args:
        prefix: [n] confirmed token ids. block: [g] draft ids.
    Returns:
        bool [g+1, V]; row i = tokens in ``prefix + block[:i]`` (position i of the block
        sees the drafts before it, Leviathan et al. 2023 §2.3).
    """
    g = block.numel()
    mask = torch.zeros(g + 1, vocab, dtype=torch.bool)
    if prefix.numel():
        mask[:, prefix.long()] = True
    for j in range(g):  # g <= 8: row i has seen block[:i]
        mask[j + 1:, int(block[j])] = True
    return mask


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    """CTRL penalty (Keskar et al. 2019): positive logits / penalty, negative * penalty."""
    if penalty == 1.0:
        return logits
    pen = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, pen, logits)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False, stable=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1.0 - top_p)
    drop_sorted[..., -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def process_logits(logits: torch.Tensor, cfg: SamplingConfig,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """Apply penalty, temperature, top-k, top-p to raw logits.

    Args:
        logits: [..., V] any float dtype (cast to float64 first).
        seen: bool [..., V] presence mask for the repetition penalty (or None).
    Returns:
        float64 [..., V] processed logits (``-inf`` outside the kept support).
        For greedy configs only the penalty is applied (the argmax is unaffected by
        temperature/top-k/top-p).
    """
    x = logits.to(PROB_DTYPE)
    if seen is not None:
        x = apply_repetition_penalty(x, seen, cfg.repetition_penalty)
    if cfg.greedy:
        return x
    x = x / cfg.temperature
    x = _top_k(x, cfg.top_k)
    return _top_p(x, cfg.top_p)


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig,
                      seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed distribution, float64 [..., V]. Greedy configs give a one-hot argmax."""
    x = process_logits(logits, cfg, seen)
    if cfg.greedy:
        return torch.nn.functional.one_hot(greedy_token(x), x.shape[-1]).to(PROB_DTYPE)
    return torch.softmax(x, dim=-1)


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; ties resolve to the lowest token id. Returns [...] int64."""
    return torch.argmax(logits, dim=-1)


# ----------------------------------------------------------------------------- sampling

def sample(probs: torch.Tensor, generator: torch.Generator | None = None,
           u: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF draw from float64 ``probs`` [..., V] (need not sum exactly to 1).

    Draws ``u ~ U[0,1)`` (or uses the given ``u`` [...]) and returns the first index whose
    cumulative mass exceeds ``u * total``; zero-probability tokens are never returned.
    Returns int64 [...].
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[..., -1:]
    if u is None:
        u = torch.rand(probs.shape[:-1], generator=generator, dtype=PROB_DTYPE)
    idx = torch.searchsorted(cdf, (u.unsqueeze(-1) * total).contiguous(), right=True)
    idx = idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    # guard: never return a zero-mass token (can only happen at float edges)
    bad = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if bad.any():
        idx = torch.where(bad, torch.argmax(probs, dim=-1), idx)
    return idx


def process_next(logits: torch.Tensor, cfg: SamplingConfig,
                 seen: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits for the next position of one sequence.

    Args:
        logits: float [V], raw logits after the sequence.
        seen: token ids [n] the sequence holds (for the repetition penalty; ignored
            when the penalty is off), or None.
    Returns:
        float64 [V]: :func:`process_logits` with the presence mask of ``seen``.
    """
    mask = None
    if cfg.repetition_penalty != 1.0 and seen is not None:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        ids = seen if isinstance(seen, torch.Tensor) else torch.tensor(list(seen),
                                                                      dtype=torch.long)
        mask[ids.long()] = True
    return process_logits(logits, cfg, mask)


def sample_next(logits: torch.Tensor, cfg: SamplingConfig,
                seen: Sequence[int] | torch.Tensor | None = None,
                gen: torch.Generator | None = None) -> tuple[int, torch.Tensor | None]:
    """The next token of one sequence: presence mask, processors, then the argmax
    (greedy) or one inverse-CDF draw from ``gen`` (sampling).

    Args:
        logits: float [V], raw logits after the sequence.
        seen: token ids [n] of the sequence (repetition penalty), or None.
        gen: the generator of the draw (ignored when greedy).
    Returns:
        ``(token id, q)``: q is the processed distribution float64 [V] the token was
        drawn from, None when greedy (the argmax, ties to the lowest id).
    """
    x = process_next(logits, cfg, seen)
    if cfg.greedy:
        return int(greedy_token(x)), None
    q = torch.softmax(x, dim=-1)
    return int(sample(q, gen)), q


def accept(p_tok: torch.Tensor, q_tok: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Speculative acceptance test ``u <= min(1, p(d)/q(d))``, computed as ``u*q <= p``.

    Args: p_tok, q_tok, u: float64 [..., g]. Returns bool [..., g] per-position verdicts
    (the caller stops at the first False).
    """
    return u * q_tok <= p_tok


def accepted_length(verdicts: torch.Tensor) -> torch.Tensor:
    """Number of leading True values along the last dim. bool [..., g] -> int64 [...]."""
    return verdicts.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def process_block(logits: torch.Tensor, cfg: "SamplingConfig", context: Sequence[int],
                  block: Sequence[int]) -> torch.Tensor:
    """The processed target rows of one block: raw logits [g+1, V] (row i after
    ``context + block[:i]``) -> float64 [g+1, V] after the presence mask (repetition
    penalty) and the config's processors. The one place verification processes rows
    (cloud verifier, FSD's provisional verdict, the edge's local target)."""
    idx = torch.tensor(list(block), dtype=torch.long)
    seen = (presence_mask(torch.tensor(list(context)), idx, logits.shape[-1])
            if cfg.repetition_penalty != 1.0 else None)
    return process_logits(logits, cfg, seen)


def sampled_accepts(p: torch.Tensor, block: Sequence[int], q_tok: torch.Tensor,
                    gen: torch.Generator | None) -> int:
    """Speculative sampling's acceptance over one block (Leviathan et al. 2023, Alg. 1):
    draws ``g`` uniforms from ``gen`` and accepts while ``u_i < p_i(d_i) / q_i(d_i)``.

    Args: p float64 [g+1, V] processed target probabilities; block [g] draft ids;
    q_tok float64 [g], the draft's probability of each of its tokens.
    Returns the accepted count (0..g); draws nothing for an empty block."""
    g = len(block)
    if not g:
        return 0
    idx = torch.tensor(list(block), dtype=torch.long)
    u = torch.rand(g, generator=gen, dtype=PROB_DTYPE)
    return int(accepted_length(accept(p[torch.arange(g), idx],
                                      torch.as_tensor(q_tok, dtype=PROB_DTYPE), u)))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual ``max(0, p - q)`` [..., V] (its sum is TV(p, q) = Z).

    Where ``p == q`` exactly (Z = 0, rejection impossible) ``p`` is returned so a draw
    is still well defined.
    """
    r = (p - q).clamp_min(0.0)
    z = r.sum(dim=-1, keepdim=True)
    return torch.where(z > 0, r, p)


#: Top-2 logit gap below which a greedy choice is a *near-tie*, per target dtype: two
#: passes of different shapes (a 1-token decode, a 9-token verify block, a batch) may
#: then pick different argmaxes. float32: 1e-4. bfloat16: 0.25 = two ulps for logits of
#: magnitude 16-32 (spaced 0.125 apart); a 1-token and a k-token pass of the same prefix
#: differ by up to 0.16 on Qwen2.5-Coder-1.5B (``python -m bench.shape_invariance``).
#: float16: 0.03, two ulps at 16-32 (spaced 1/64), by the same rule, not measured.
#: The cloud's verifier makes its passes row-invariant (:mod:`edge_sdk.invariant`), so
#: its verify rows equal a 1-token decode bit for bit and no near-tie flips there; the
#: policy covers the passes it leaves to the block kernel and other engines.
NEAR_TIE_GAP = {"float32": 1e-4, "float16": 0.03, "bfloat16": 0.25}


def near_tie_gap(dtype: torch.dtype | str) -> float:
    """:data:`NEAR_TIE_GAP` for a torch dtype or its name (unknown: the float32 value)."""
    name = str(dtype).replace("torch.", "")
    return NEAR_TIE_GAP.get(name, NEAR_TIE_GAP["float32"])


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the largest and second-largest logit of each row.

    logits: [n, V] (any float dtype). Returns float64 [n] (>= 0).
    """
    top = torch.topk(logits.to(PROB_DTYPE), 2, dim=-1).values
    return top[:, 0] - top[:, 1]


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor):
    """Greedy rule. draft: [g] ids; target_logits: [g+1, V] processed logits.

    Returns ``(n_accepted, next_token)``: drafts accepted while ``d_i == argmax p_i``;
    the next token is the argmax at the first mismatch (correction) or after the block
    (bonus).
    """
    best = greedy_token(target_logits)
    n = int(accepted_length(draft == best[: draft.numel()]))
    return n, int(best[n])


# ----------------------------------------------------------------------------- certificate

def support_certificate(support_ids: torch.Tensor, support_p: torch.Tensor,
                        q: torch.Tensor, complete):
    """Residual-TV certificate for a bounded support S (AsymSpec §IV-B). Batched.

    Args:
        support_ids: int [..., K] token ids of S; support_p: float64 [..., K] target p on S;
        q: float64 [..., V] the draft distribution at the rejected position;
        complete: bool (or bool [...]): S holds every token with p > 0, so the residual
            restricted to S is the exact residual.
    Returns:
        ``(eps_K [...], z_s [...], residual_s [..., K])`` with ``delta_p = 1 - sum_S p``
        rounded up, ``Z_S = sum_S max(0, p - q)`` rounded down,
        ``eps_K = delta_p / (Z_S + delta_p)`` (0 when complete), and the unnormalised
        residual restricted to S. ``eps_K`` bounds TV(restricted residual, exact
        residual); it is 1 when ``Z_S = 0`` (S carries no residual mass: unusable).
    """
    r_s = (support_p - q.gather(-1, support_ids.long())).clamp_min(0.0)
    slack = (support_p.shape[-1] + 1) * torch.finfo(PROB_DTYPE).eps  # float-sum error bound
    z_s = (r_s.sum(-1) - slack).clamp_min(0.0)
    delta_p = ((1.0 - support_p.sum(-1)).clamp_min(0.0) + slack).clamp_max(1.0)
    eps = delta_p / (z_s + delta_p)
    eps = torch.where(torch.as_tensor(complete), torch.zeros_like(eps), eps)
    eps = torch.where(z_s > 0, eps, torch.ones_like(eps))
    return eps, z_s, r_s


def top_support(p: torch.Tensor, k: int):
    """Top-K support of float64 ``p`` [..., V]: ids sorted by p desc, ties by lower id.

    Returns ``(ids int64 [..., K], probs float64 [..., K])`` with K = min(k, V); entries
    with zero mass may be included (they are never drawn).
    """
    order = torch.argsort(-p, dim=-1, stable=True)[..., :k]
    return order, p.gather(-1, order)


def support_is_complete(p: torch.Tensor, k: int) -> torch.Tensor:
    """bool [...]: the top-``k`` support holds every token with p > 0."""
    return (p > 0).sum(-1) <= k
