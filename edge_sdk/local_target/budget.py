"""The memory budget and the cost model that choose the resident set, the draft's exit
layer and the draft depth (CATS: "based on the memory budget and parameter offloading
patterns").

Memory (bytes) of a plan with ``R`` resident decoder layers:

    M(R) = W_head + W_norm + R * W_layer + [R < L] * W_layer      (one streamed buffer)
           + [embed resident] * W_embed + KV(max_ctx) + overhead

``KV(n) = n * 2 * L * n_kv * head_dim * itemsize``; ``overhead`` = the exit translator
(H*H float32) and the float32 logits of a block (V * 4 * (max_depth+1)). R is the
largest value with ``M(R) <= budget``; the embedding table is resident only if it fits
after all layers (otherwise each token's row is read from storage: H*itemsize bytes).

Time (seconds) of one round of self-speculation with exit layer ``E <= R`` and depth
``k`` (memory-bound CPU decoding: a pass costs the same for 1 or k+1 tokens):

    t_full  = (L - R) * W_layer / storage_bw  +  W_all / mem_bw     (streamed + compute)
    t_draft = (E * W_layer + W_head_sub) / mem_bw                     (one draft token)
    tokens  = (1 - a^(k+1)) / (1 - a)       (Leviathan et al. 2023, §3.1, eq. 1)
    rate    = tokens / (t_full + k * t_draft)

with ``a`` the exit head's top-1 agreement with the final layer at layer ``E``
(:data:`AGREEMENT`, measured on held-out text with the tuned lens). The plan maximises
``rate`` over ``E in 1..min(R, L-1)`` and ``k in 1..max_depth``; where no choice beats
the target alone (``1 / t_full``: nothing streamed and a draft token costing E/L of a
pass) the plan says ``depth = 0`` and CATS decodes with the target alone. The cascade's gate
(:mod:`.cats`) stops a block early when the draft's own probability of the whole block
falls below ``t_draft / t_full``: the expected value of one more drafted token (its
acceptance probability times the pass it saves) no longer covers its cost.

Width (greedy): ``WIDTH - 1`` sibling candidates of the block's first token ride in the
same full pass (:mod:`.siblings`) whenever the plan drafts and their one extra resident
pass costs under 10 % of ``t_full`` (streamed bytes dominate, so the wider pass is free);
each hit adds one token to the round. No measured top-w coverage enters the model: the
bench reports the sibling hit rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Sizes", "Plan", "AGREEMENT", "agreement", "plan", "parse_bytes",
           "MEM_BW", "MAX_DEPTH", "WIDTH"]

AGREEMENT = {0: 0.0, 14: 0.30, 18: 0.35, 20: 0.43, 22: 0.50, 24: 0.64, 26: 0.76, 28: 1.0}
"""Exit layer (of 28) -> tuned exit-head top-1 agreement with the final layer on
held-out text (Qwen2.5-Coder-1.5B; cloud_api.exit_fit). Other depths scale by E/L."""

MEM_BW = 18e9
"""Effective DRAM bandwidth of a CPU pass (bytes/s): a 1-token bf16 pass of the 3.1 GB
target takes ~170 ms on 2 threads."""

MAX_DEPTH = 8
WIDTH = 8


def parse_bytes(text: str | int | float, total: int | None = None) -> int:
    """``1.5GB``, ``800MB``, ``1e9`` or a fraction ``0.5`` (of ``total``) -> bytes.
    Raises ValueError for anything else (or a fraction without ``total``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        t = str(text)
    else:
        t = str(text).strip().upper().replace("IB", "B")
    mult = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}
    for unit, m in mult.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * m)
    try:
        v = float(t)
    except ValueError:
        raise ValueError(f"memory budget {text!r}: expected e.g. 1.5GB, 800MB or a "
                         "fraction like 0.5") from None
    if v <= 1.0:
        if total is None:
            raise ValueError("a fractional memory budget needs the target's size")
        return int(v * total)
    return int(v)


@dataclass(frozen=True)
class Sizes:
    """Byte sizes of the target's parts and its shape (from the checkpoint)."""

    layer: int
    head: int
    embed: int
    norm: int
    layers: int
    hidden: int
    vocab: int
    kv_per_token: int

    @property
    def weights(self) -> int:
        """All weights of the target (bytes): the 100 % budget."""
        return self.layers * self.layer + self.head + self.embed + self.norm


@dataclass(frozen=True)
class Plan:
    """A chosen configuration and its predicted costs (bytes, seconds, tokens/s)."""

    budget: int
    resident_layers: int
    resident_embed: bool
    exit_layer: int
    depth: int
    memory: int
    t_full: float
    t_draft: float
    agreement: float
    rate: float
    ar_rate: float
    gate: float
    width: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(E: int, L: int) -> float:
    """Interpolated exit agreement at layer ``E`` of ``L`` (:data:`AGREEMENT`)."""
    x = 28.0 * E / L
    keys = sorted(AGREEMENT)
    for lo, hi in zip(keys, keys[1:]):
        if lo <= x <= hi:
            return AGREEMENT[lo] + (AGREEMENT[hi] - AGREEMENT[lo]) * (x - lo) / (hi - lo)
    return 1.0


def _memory(s: Sizes, R: int, embed: bool, max_ctx: int) -> int:
    over = s.hidden * s.hidden * 4 + s.vocab * 4 * (MAX_DEPTH + 1)
    return (s.head + s.norm + R * s.layer + (s.layer if R < s.layers else 0)
            + (s.embed if embed else 0) + s.kv_per_token * max_ctx + over)


def _rate(s: Sizes, R: int, E: int, k: int, bw: float, sub_head: int):
    """(tokens/s, t_full, t_draft, agreement) of exit ``E``, depth ``k``."""
    stream = (s.layers - R) * s.layer / bw if bw > 0 else 0.0
    t_full = stream + (s.layers * s.layer + s.head) / MEM_BW
    t_draft = (E * s.layer + sub_head) / MEM_BW
    a = min(agreement(E, s.layers), 0.999)
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (t_full + k * t_draft), t_full, t_draft, a


def plan(s: Sizes, budget: int, bandwidth: float, max_ctx: int = 2048,
         head_vocab: int = 32768) -> Plan:
    """The plan for ``budget`` bytes and ``bandwidth`` bytes/s (0: unthrottled).

    Raises ValueError when not even the head + one streamed layer + KV fit."""
    if _memory(s, 0, False, max_ctx) > budget:
        raise ValueError(f"memory budget {budget / 1e9:.2f} GB is below the minimum "
                         f"{_memory(s, 0, False, max_ctx) / 1e9:.2f} GB (head + one "
                         "streamed layer + KV cache)")
    R = max(r for r in range(s.layers + 1) if _memory(s, r, False, max_ctx) <= budget)
    embed = R == s.layers and _memory(s, R, True, max_ctx) <= budget
    sub = s.head * min(1.0, head_vocab / s.vocab)
    best = None
    for E in range(1, min(R, s.layers - 1) + 1):
        for k in range(1, MAX_DEPTH + 1):
            r = _rate(s, R, E, k, bandwidth, sub)
            if best is None or r[0] > best[0][0]:
                best = (r, E, k)
    t_ar = _rate(s, R, 0, 0, bandwidth, 0)[1]
    if best is None or best[0][0] <= 1.0 / t_ar:   # no draft pays: the target alone
        best = ((1.0 / t_ar, t_ar, 0.0, 0.0), 0, 0)
    (rate, t_full, t_draft, a), E, k = best
    width = WIDTH if k and t_draft < 0.1 * t_full else 1
    return Plan(budget, R, embed, E, k, _memory(s, R, embed, max_ctx), t_full, t_draft,
                a, rate, 1.0 / t_full if t_full else math.inf,
                t_draft / t_full if t_full else 0.0, width)
