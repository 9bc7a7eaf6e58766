"""The memory budget and the cost model that choose the resident set, the draft's exit
layer and the draft depth (CATS: "based on the memory budget and parameter offloading
patterns").

Memory (bytes) of a plan with ``R`` resident decoder layers:

    M(R) = W_head + W_norm + R * W_layer + [R < L] * 2 * W_layer  (two streamed buffers)
           + [embed resident] * W_embed + KV(max_ctx) + overhead

``KV(n) = n * 2 * L * n_kv * head_dim * itemsize``; ``overhead`` = the exit translator
(H*H float32) and the float32 logits of a block (V * 4 * (max_depth+1)). R is the
largest value with ``M(R) <= budget``; the embedding table is resident only if it fits
after all layers (otherwise each token's row is read from storage: H*itemsize bytes).

Time (seconds) of one round of self-speculation with exit layer ``E <= R`` and depth
``k`` (memory-bound CPU decoding: a pass costs the same for 1 or k+1 tokens):

    t_full  = max((L - R) * W_layer / storage_bw,                      (streamed reads,
                  (L - R) * W_layer / MEM_BW)                            their compute)
              + R * W_layer / bw_res + W_head / bw_head                 (resident compute)

(the two buffers overlap: the next streamed layer is read while one computes, and the
first one of the next pass while the rest of the round runs, :mod:`.runner`)
    t_draft = E * W_layer / bw_res + W_head_sub / bw_head             (one draft token)

``bw_res`` = :data:`MEM_BW_PACKED` when the resident linears are prepacked for oneDNN
(:mod:`edge_sdk.packed`; the streamed layers stay dense: :data:`MEM_BW`), ``bw_head``
the same for the head (packed for the skip draft and the target alone; the early exit
reads the dense head's rows, so its plans keep the head dense).
    tokens  = (1 - a^(k+1)) / (1 - a)       (Leviathan et al. 2023, §3.1, eq. 1)
    rate    = tokens / (t_full + k * t_draft)

with ``a`` the exit head's top-1 agreement with the final layer at layer ``E``
(:data:`AGREEMENT`, measured on held-out text with the tuned lens). The layer-skipping
draft (:mod:`.skip`: the first ``R1`` and the last ``R2 = R - R1`` layers resident, the
middle streamed and skipped by the draft; Draft & Verify, Zhang et al. 2023, §3.1; or,
where :data:`SKIP_SETS` has one for ``R``, a resident set found by a search over layer
sets, as Draft & Verify's Bayesian search over skipped layers, §3.2)
costs ``t_draft = (R * W_layer + W_head_sub) / mem_bw`` per token and has the
per-token agreement ``a`` of :func:`skip_agreement` (:data:`SKIP_MEASURED`: the chain
agreement inside a block, lower than the first token's because the tail layers attend
to the draft's own keys/values of the block); the verification pass costs the same
``t_full``. The plan maximises ``rate`` over the exit ``E in 1..min(R, L-1)``, the skip
draft at the best measured split for ``R``, and ``k in 1..max_depth``; where no choice beats
the target alone (``1 / t_full``: nothing streamed and a draft token costing E/L of a
pass) the plan says ``depth = 0`` and CATS decodes with the target alone. The cascade's gate
(:mod:`.cats`) stops a block early when the draft's own probability of the whole block
falls below ``t_draft / t_full``: the expected value of one more drafted token (its
acceptance probability times the pass it saves) no longer covers its cost.

The quantized self-draft (:mod:`.quant`: ALL decoder layers resident as 4-bit groups
beside the ``R`` bf16 ones, the target's own head and KV cache; QSpec, Zhao et al.
2024, §3) takes ``Q = L * int4_layer_bytes(W_layer)`` more bytes, so fewer bf16 layers
fit (``R_q``, the largest with ``M(R_q) + Q <= budget``) and the
verification pass streams more; but its draft is the whole target up to rounding:

    t_draft = Q / MEM_BW_INT4 + W_head_sub / bw_head,    a = QUANT_MEASURED's chain
    agreement, k in 1..QUANT_MAX_DEPTH

and it is priced against the others by the same ``rate``. Its plans draft chains
(width 1: it has no tree pass).

Width (greedy): ``WIDTH - 1`` sibling candidates ride in the same full pass
(:mod:`.siblings`: at the chain positions of largest estimated hit probability, the
draft's path confidence) whenever the plan drafts and their one extra resident pass
costs under 10 % of ``t_full`` (streamed bytes dominate, so the wider pass is nearly
free); each hit adds one token to the round. No measured top-w coverage enters the model: the
bench reports the sibling hit rate. On the same condition the plan drafts greedy blocks
as a dynamic tree instead (:mod:`.dyntree`, EAGLE-2): ``BEAM`` nodes expanded per depth,
each with its ``BEAM`` most likely children, the best ``NODES`` verified; each level
costs one resident pass over ``BEAM`` rows, about a one-token pass while the resident
weights' bytes dominate, and the full pass stays one streamed pass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Sizes", "Plan", "AGREEMENT", "SKIP_MEASURED", "SKIP_SETS", "agreement",
           "skip_agreement", "skip_split", "skip_layers", "draft_label", "plan", "parse_bytes", "MEM_BW", "MEM_BW_PACKED", "MAX_DEPTH",
           "WIDTH", "BEAM", "NODES", "TREE_DEPTH", "MEM_BW_INT4", "QUANT_MEASURED",
           "QUANT_MAX_DEPTH", "quant_bytes"]

AGREEMENT = {0: 0.0, 14: 0.30, 18: 0.35, 20: 0.43, 22: 0.50, 24: 0.64, 26: 0.76, 28: 1.0}
"""Exit layer (of 28) -> tuned exit-head top-1 agreement with the final layer on
held-out text (Qwen2.5-Coder-1.5B; cloud_api.exit_fit). Other depths scale by E/L."""

SKIP_MEASURED = {12: (2, 0.707, 1.16), 14: (3, 0.773, 2.09), 21: (4, 0.902, 5.21)}
"""Resident layers R (of 28) -> (best R1, first-token agreement, mean accepted drafts
of a depth-8 block) of the skip draft at its best split (by the block figure),
Qwen2.5-Coder-1.5B bf16, teacher-forced on 4 HumanEval + 4 MT-Bench prompts x 32
greedy tokens (``bench/probes/skip_agreement.py``, docs/figures/cats/skip). The early
exit at the same R: 0.22 / 0.33 (R=12), 0.20 / 0.27 (14), 0.41 / 0.78 (21)."""

SKIP_SETS: dict[int, tuple[tuple[int, ...], float, float]] = {
    12: ((0, 1, 2, 17, 18, 19, 20, 21, 22, 23, 25, 26), 0.727, 1.90),
    14: ((0, 1, 2, 3, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26), 0.746, 2.16),
}
"""Resident-layer count R (of 28) -> (resident layer set, first-token agreement, mean
accepted drafts of a depth-8 block) of a searched resident set that beats the best
contiguous split of :data:`SKIP_MEASURED`, Qwen2.5-Coder-1.5B bf16. Chosen among 10
(R = 12) and 7 (R = 14) candidate sets by the block figure on HumanEval/MT-Bench
prompts 4..7 (``python -m bench.probes.skip_agreement --no-exit --offset 4 --sets
...``); the figures here are on the held-out first 4 (the ones the bench runs, where
the splits measure 1.16 and 2.09), docs/figures/cats/skipset. The layers kept are the
first 3-4 and most of 17..26: the last layer (27) and 24 are worth less to the draft
than 17..23. Used for a target of 28 layers only."""

MEM_BW = 14e9
"""Effective bandwidth (bytes/s) of a dense bf16 weight in a CPU pass (``F.linear``
reorders it for oneDNN per call): one thread, Qwen2.5-Coder-1.5B after a 200-token
context, a 93.6 MB decoder layer 6.5 ms for 1 token (7.6 for 8), the 467 MB head 28.6
ms (``python -m bench.probes.local_pass_cost``, docs/figures/cats/packed/)."""

MEM_BW_PACKED = 22e9
"""The same for a weight prepacked for oneDNN (:mod:`edge_sdk.packed`): a layer 4.4 ms
(5.5 for 8 tokens), the head 17.9 ms, the 32768-row draft sub-head 3.3 ms; the skip
draft's token at R = 12 (2 + 10) 51.5 ms against 102.6 ms dense."""

MEM_BW_INT4 = 17e9
"""Effective bandwidth (bytes/s) of the quantized self-draft's 4-bit layers in a draft
token (:class:`~.quant.Int4Linear` weights, scales and zeros, with the layers'
attention and norms): 28 layers of Qwen2.5-Coder-1.5B (819 MB) in ~47 ms of a 50.4 ms
token (the rest: the packed 32768-row sub-head) after a 200-token context, one thread
(``python -m bench.probes.quant_agreement``, docs/figures/cats/quant/)."""

QUANT_MEASURED = (6.16, 0.961)
"""The quantized self-draft's (mean accepted drafts of a depth-8 block, first-token
agreement), Qwen2.5-Coder-1.5B bf16 with 4-bit groups of 32 drafting on the target's
cache of the true prefix, teacher-forced on HumanEval/MT-Bench prompts 4..7 x 32 greedy
tokens (6.30 / 6.02 per workload; ``python -m bench.probes.quant_agreement --offset
4``, docs/figures/cats/quant/agreement.json). The skip draft at R = 12: 1.90
(:data:`SKIP_SETS`)."""

QUANT_MAX_DEPTH = 16
"""The deepest block the quantized self-draft's plans consider (its chain agreement
makes blocks past 8 pay on slow storage)."""

STREAM_BUFFERS = 2
"""Streamed-layer buffers of :class:`~.runner.OffloadedTarget` (``prefetch``: one
computes while the next layer is read into the other)."""

MAX_DEPTH = 8
WIDTH = 8
BEAM = 4
NODES = 16
TREE_DEPTH = 4
"""The dynamic tree of a plan that drafts cheaply (``width`` > 1): ``BEAM`` nodes
expanded per level, ``NODES`` verified, at most ``TREE_DEPTH`` levels. Chosen with
``python -m bench.probes.cats_tree --offset 4`` (HumanEval/MT-Bench prompts 4..7, 32
greedy tokens, 50 % budget, nvme) among 4x16 at depths 4 and 5, 4x12, 3x12 and the
chain of depth 5 with 7 siblings: 4 levels x 4 x 16 nodes 2.50 / 2.34 tok/s against the
chain's 2.30 / 2.12 (3.37 / 3.12 tokens per pass against 3.12 / 2.98, the same 1.35 s
per round); docs/figures/cats/tree. On emmc too (a 3.9 s streamed pass, where a dearer
tree costs less in proportion) the shape stays: 8 levels x 8 x 64 nodes, best of seven
shapes on prompts 4..7 (3.76 / 4.92 tokens per pass against 3.05 / 3.37), on the
held-out first 4 gains 10 % tokens per pass (3.05 / 3.37 against 2.78 / 3.05) and loses
8 % tok/s (0.58 / 0.63 against 0.63 / 0.68): each more verified node costs ~8 ms here,
not the ~5 ms of its weight compute alone; docs/figures/cats/treeshape."""


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
    draft: str = "exit"
    tail_layers: int = 0
    layer_set: tuple = ()
    beam: int = 1
    nodes: int = 0
    """``draft``: ``exit`` (layers 0..E-1 + the exit head at ``exit_layer``), ``skip``
    (layers 0..R1-1 and the last ``tail_layers`` resident, ``exit_layer`` = 0; or the
    resident decoder layers ``layer_set`` when it is not empty, ``tail_layers`` = 0) or
    ``quant`` (every layer as 4-bit groups beside the first ``resident_layers`` bf16
    ones; ``memory`` counts them).
    ``beam`` > 1: greedy blocks are dynamic trees of ``depth`` levels, ``beam`` nodes
    expanded per level, ``nodes`` verified (1: chains with ``width - 1`` siblings)."""

    def to_dict(self) -> dict:
        return asdict(self)


def draft_label(p: "Plan | dict") -> str:
    """``exit layer E``, ``skip draft R1+R2``, ``skip draft 0-2,17-24,26`` (a resident
    set) or ``int4 self-draft`` of a plan or its :meth:`Plan.to_dict`."""
    d = p if isinstance(p, dict) else p.to_dict()
    if d.get("draft") == "quant":
        return "int4 self-draft"
    if d.get("draft", "exit") != "skip":
        return f"exit layer {d['exit_layer']}"
    if d.get("layer_set"):
        from edge_sdk.local_target.skip import layer_ranges
        return f"skip draft {layer_ranges(d['layer_set'])}"
    return f"skip draft {d['resident_layers'] - d['tail_layers']}+{d['tail_layers']}"


def agreement(E: int, L: int) -> float:
    """Interpolated exit agreement at layer ``E`` of ``L`` (:data:`AGREEMENT`)."""
    x = 28.0 * E / L
    keys = sorted(AGREEMENT)
    for lo, hi in zip(keys, keys[1:]):
        if lo <= x <= hi:
            return AGREEMENT[lo] + (AGREEMENT[hi] - AGREEMENT[lo]) * (x - lo) / (hi - lo)
    return 1.0


def _chain_a(acc: float, depth: int = 8) -> float:
    """The per-token agreement ``a`` whose chain of ``depth`` drafts accepts ``acc`` on
    average: ``sum_{j=1..depth} a^j = acc`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(1, depth + 1)) < acc else (lo, mid)
    return lo


def _interp(points: dict, x: float) -> float:
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]] * x / keys[0] if keys[0] else points[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if lo <= x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[keys[-1]]


def _searched(R: int, L: int) -> bool:
    """True when :data:`SKIP_SETS` holds the skip draft's resident set for R of L."""
    return L == 28 and R in SKIP_SETS


def skip_agreement(R: int, L: int) -> float:
    """The skip draft's per-token chain agreement with ``R`` of ``L`` layers resident
    (:func:`skip_layers`): its searched set's block figure (:data:`SKIP_SETS`), else
    the best split's (:data:`SKIP_MEASURED`) through :func:`_chain_a`, linear in
    ``28 R / L`` between the measured points, 0 at R = 0 and 1 at R = L."""
    if _searched(R, L):
        return _chain_a(SKIP_SETS[R][2])
    pts = {0: 0.0, 28: 1.0} | {r: _chain_a(acc) for r, (_, _, acc) in SKIP_MEASURED.items()}
    return min(1.0, max(0.0, _interp(pts, 28.0 * R / L)))


def skip_split(R: int, L: int) -> int:
    """``R1`` of the skip draft with ``R`` of ``L`` layers resident: the measured best
    R1 of the nearest measured R (scaled by L/28), within 1..R-1."""
    x = 28.0 * R / L
    near = min(SKIP_MEASURED, key=lambda r: abs(r - x))
    return max(1, min(R - 1, round(SKIP_MEASURED[near][0] * L / 28)))


def skip_layers(R: int, L: int) -> tuple[int, ...]:
    """The resident decoder layers of the skip draft with ``R`` of ``L`` resident: the
    searched set of :data:`SKIP_SETS` (L = 28), else the first :func:`skip_split` and
    the last ``R - R1``."""
    if _searched(R, L):
        return tuple(SKIP_SETS[R][0])
    r1 = skip_split(R, L)
    return tuple(range(r1)) + tuple(range(L - (R - r1), L))


def quant_bytes(s: Sizes) -> int:
    """Bytes the quantized self-draft adds: every decoder layer as 4-bit groups
    (:func:`~.quant.int4_layer_bytes`; it drafts on the target's KV cache, whose
    ``max_ctx`` tokens already count)."""
    from edge_sdk.local_target.quant import int4_layer_bytes

    item = max(1, s.norm // max(1, s.hidden))
    return s.layers * int4_layer_bytes(s.layer, item)


def _memory(s: Sizes, R: int, embed: bool, max_ctx: int, nodes: int = 0) -> int:
    """Bytes of a plan with ``R`` resident layers; ``nodes``: the verified nodes of its
    draft trees (their pass's logits: ``1 + nodes`` rows in the head's dtype, argmax
    only; a chain block's are float32, ``MAX_DEPTH + 1`` rows)."""
    item = max(1, s.head // max(1, s.vocab * s.hidden))
    logits = max(s.vocab * 4 * (MAX_DEPTH + 1), s.vocab * item * (1 + nodes))
    over = s.hidden * s.hidden * 4 + logits
    return (s.head + s.norm + R * s.layer + (STREAM_BUFFERS * s.layer if R < s.layers else 0)
            + (s.embed if embed else 0) + s.kv_per_token * max_ctx + over)


def _bws(packed: bool, head_packed: bool) -> tuple[float, float]:
    """(resident layers', head's) compute bandwidth."""
    res = MEM_BW_PACKED if packed else MEM_BW
    return res, res if head_packed else MEM_BW


def _t_full(s: Sizes, R: int, bw: float, packed: bool, head_packed: bool) -> float:
    """One full pass: the streamed reads overlapped with their dense compute (two
    buffers), + the resident compute."""
    res, head = _bws(packed, head_packed)
    stream = (s.layers - R) * s.layer / bw if bw > 0 else 0.0
    return max(stream, (s.layers - R) * s.layer / MEM_BW) + R * s.layer / res + s.head / head


def _chain_rate(s: Sizes, R: int, draft_layers: int, a: float, k: int, bw: float,
                sub_head: int, packed: bool, head_packed: bool):
    """(tokens/s, t_full, t_draft, agreement) of a draft running ``draft_layers``
    resident layers + the sub-head, per-token agreement ``a``, depth ``k``."""
    t_full = _t_full(s, R, bw, packed, head_packed)
    res, head = _bws(packed, head_packed)
    t_draft = draft_layers * s.layer / res + sub_head / head
    a = min(a, 0.999)
    return _block_rate(a, k, t_full, t_draft), t_full, t_draft, a


def _block_rate(a: float, k: int, t_full: float, t_draft: float) -> float:
    """Tokens/s of rounds of ``k`` drafts at per-token agreement ``a < 1``: ``(1 -
    a^(k+1)) / (1 - a)`` tokens (Leviathan et al. 2023, §3.1, eq. 1) per ``t_full + k
    t_draft`` seconds."""
    return (1 - a ** (k + 1)) / (1 - a) / (t_full + k * t_draft)


def _rate(s: Sizes, R: int, E: int, k: int, bw: float, sub_head: int,
          packed: bool = False):
    """:func:`_chain_rate` of exit ``E`` (the head stays dense: the exit head reads its
    rows)."""
    return _chain_rate(s, R, E, agreement(E, s.layers), k, bw, sub_head, packed, False)


def _skip_rate(s: Sizes, R: int, k: int, bw: float, sub_head: int, packed: bool = False):
    """:func:`_chain_rate` of the skip draft with R resident (the head packed with the
    layers: the draft's sub-head is its own chunks)."""
    return _chain_rate(s, R, R, skip_agreement(R, s.layers), k, bw, sub_head, packed,
                       packed)


def _quant_plan(s: Sizes, budget: int, bandwidth: float, max_ctx: int, sub: float,
                packed: bool):
    """The best quantized self-draft choice ``((rate, t_full, t_draft, a), R_q, k)``,
    or None when the 4-bit layers do not fit beside the head + the streamed-layer
    buffers + KV cache."""
    extra = quant_bytes(s)
    fits = [r for r in range(s.layers + 1) if _memory(s, r, False, max_ctx) + extra <= budget]
    if not fits:
        return None
    R = max(fits)
    acc, _ = QUANT_MEASURED
    a = _chain_a(acc)
    t_full = _t_full(s, R, bandwidth, packed, packed)
    _, head = _bws(packed, packed)
    t_draft = extra / MEM_BW_INT4 + sub / head
    k = max(range(1, QUANT_MAX_DEPTH + 1), key=lambda k: _block_rate(a, k, t_full, t_draft))
    return (_block_rate(a, k, t_full, t_draft), t_full, t_draft, a), R, k


def plan(s: Sizes, budget: int, bandwidth: float, max_ctx: int = 2048,
         head_vocab: int = 32768, drafts: tuple = ("exit", "skip"),
         packed: bool = False) -> Plan:
    """The plan for ``budget`` bytes and ``bandwidth`` bytes/s (0: unthrottled), with
    the drafts allowed in ``drafts`` (``exit``, ``skip``, ``quant``; the skip draft
    needs a streamed middle: 2 <= R < L; ``quant`` needs the CPU int4 kernels, see
    :func:`~.quant.int4_supported`); ``packed``: the resident linears prepacked (the
    memory is the same: a packed weight replaces its dense one).

    Raises ValueError when not even the head + the streamed-layer buffers + KV fit."""
    if _memory(s, 0, False, max_ctx) > budget:
        raise ValueError(f"memory budget {budget / 1e9:.2f} GB is below the minimum "
                         f"{_memory(s, 0, False, max_ctx) / 1e9:.2f} GB (head + streamed-layer "
                         "buffers + KV cache)")
    R = max(r for r in range(s.layers + 1) if _memory(s, r, False, max_ctx) <= budget)
    embed = R == s.layers and _memory(s, R, True, max_ctx) <= budget
    sub = s.head * min(1.0, head_vocab / s.vocab)
    best = None
    for E in range(1, min(R, s.layers - 1) + 1) if "exit" in drafts else ():
        for k in range(1, MAX_DEPTH + 1):
            r = _rate(s, R, E, k, bandwidth, sub, packed)
            if best is None or r[0] > best[0][0]:
                best = (r, E, k, "exit")
    if "skip" in drafts and 2 <= R < s.layers:
        for k in range(1, MAX_DEPTH + 1):
            r = _skip_rate(s, R, k, bandwidth, sub, packed)
            if best is None or r[0] > best[0][0]:
                best = (r, 0, k, "skip")
    t_ar = _t_full(s, R, bandwidth, packed, packed)        # the target alone: head packed
    if best is None or best[0][0] <= 1.0 / t_ar:   # no draft pays: the target alone
        best = ((1.0 / t_ar, t_ar, 0.0, 0.0), 0, 0, "exit")
    # the 4-bit copy is paid for with streamed layers: where the whole target fits, the
    # target alone streams nothing and keeps it (the model's geometric chain overrates
    # long blocks: 10.4 tokens per pass at depth 16 against 7.3-8.0 measured at 50 %)
    q = (_quant_plan(s, budget, bandwidth, max_ctx, sub, packed)
         if "quant" in drafts and R < s.layers else None)
    if q is not None and q[0][0] > best[0][0]:
        (rate, t_full, t_draft, a), Rq, k = q
        return Plan(budget, Rq, False, 0, k,
                    _memory(s, Rq, False, max_ctx) + quant_bytes(s), t_full,
                    t_draft, a, rate, 1.0 / t_ar, t_draft / t_full, 1, "quant")
    (rate, t_full, t_draft, a), E, k, draft = best
    searched = draft == "skip" and _searched(R, s.layers)
    tail = R - skip_split(R, s.layers) if draft == "skip" and not searched else 0
    layer_set = skip_layers(R, s.layers) if searched else ()
    width = WIDTH if k and t_draft < 0.1 * t_full else 1
    beam, nodes = (BEAM, NODES) if width > 1 and BEAM > 1 else (1, 0)
    if beam > 1:
        k = min(k, TREE_DEPTH)
    return Plan(budget, R, embed, E, k, _memory(s, R, embed, max_ctx, nodes), t_full, t_draft,
                a, rate, 1.0 / t_full if t_full else math.inf,
                t_draft / t_full if t_full else 0.0, width, draft, tail, layer_set,
                beam, nodes)
