"""Row-invariant target passes: a token's logits do not depend on the pass that computes it.

Greedy speculative decoding promises the target's own output: the token committed at
position p must be the argmax of the same logits whether p is the single token of a
decode pass (the target alone) or row k of a (k+1)-token verify pass. In float arithmetic
that holds only if every kernel computes a row the same way whatever else the pass
holds -- "batch invariance" (H. He and Thinking Machines Lab, *Defeating Nondeterminism in
LLM Inference*, 2025, "batch-invariant kernels"). On this project's CPU target (bf16,
oneDNN) three kernels are not:

- **linear layers with one row**: a one-row matmul may take a matrix-vector path whose
  reduction order differs from the matrix-matrix kernel's (seen on Qwen2.5-Coder-1.5B's
  ``down_proj``, K = 8960, bf16 on oneDNN); from two rows on, every row of the output is
  bit for bit the same whatever the row count. Fix: a one-row input runs as two copies
  of the row -- unless the layer's one-row kernel is measured to agree with its two-row
  one (:func:`one_row_agrees`, once per layer shape and machine: oneDNN's packed float32
  kernel on an AVX2-only CPU does, for every layer of that model), which then skips the
  second row's cost.
- **attention over a block**: scaled-dot-product attention over k new queries with a
  causal mask reduces each query's keys in another order than the same query alone
  over its visible keys. Fix: each new token attends in its own call, over exactly its
  visible keys (past, then its ancestors in the block), with its grouped query heads
  folded into the query rows -- the very call a 1-token pass makes
  (:mod:`edge_sdk.row_attention`).
- **linear layers beyond a row limit**: oneDNN changes its blocking with the row count
  (the packed down-projection keeps rows alike up to 27 rows, then not for 28-39, then
  again for 40-64). Fix: each layer's limit is measured once per machine
  (:func:`row_limit`) and, in a row-invariant pass, a layer given more rows runs in
  pieces within it.

With all three, a bf16 verify pass's logits equal the target-alone decode's bit for bit
(``python -m bench.shape_invariance qwen2.5-coder-1.5b --attn sdpa,invariant``), so
greedy speculative output is the target's token for token, near-ties included.

Cost: attention reads a token's keys once per new token instead of once per block.
Passes longer than :data:`INVARIANT_MAX_ROWS` new tokens (prefills) keep the block
kernel: a prompt is prefilled the same way by the target alone and by speculation, so
its cache rows agree; a pass that long in the middle of a generation (a long catch-up
after offline drafting) falls back to the near-tie policy
(``edge_sdk.protocol.sampling.NEAR_TIE_GAP``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform

import torch

from edge_sdk.row_attention import invariant_pass

__all__ = ["INVARIANT_MAX_ROWS", "make_row_invariant", "invariant_rows", "one_row_agrees",
           "row_limit"]

INVARIANT_MAX_ROWS = 64
"""New tokens of a pass (per session in a batched pass) up to which each row is computed
row-invariantly: every verify block, sibling tree and short catch-up; longer passes are
prefills."""

_ATTR = "specrelay_invariant_rows"


CALIBRATE_ROWS = 64
"""Row counts up to which :func:`row_limit` checks a linear layer's kernels."""


def _base_forward(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return super(_RowInvariantLinear, mod).forward(x)


@torch.inference_mode()
def row_limit(mod: torch.nn.Module, upto: int = CALIBRATE_ROWS) -> int:
    """The largest L <= ``upto`` such that, for every row count M in 2..L, each row of an
    M-row input [1, M, in] comes out bit for bit as it does in a 2-row input (checked on
    a seeded random input through the layer's own forward). oneDNN picks its blocking by
    shape: measured on an AMX Xeon, bf16, the prepacked [8960 -> 1536] down-projection
    of Qwen2.5-Coder-1.5B keeps its rows up to M = 27 (plain ``F.linear`` on the same
    weights only up to 4), beyond which the reduction order changes (and changes back)
    with M; its other layers keep them past 64."""
    g = torch.Generator().manual_seed(0)
    dtype = _weight_dtype(mod)
    x = torch.randn(1, upto + upto % 2, mod.in_features, generator=g).to(dtype)
    ref = torch.cat([_base_forward(mod, x[:, i:i + 2]) for i in range(0, x.shape[1], 2)], 1)
    for m in range(3, upto + 1):
        if not torch.equal(_base_forward(mod, x[:, :m]), ref[:, :m]):
            return m - 1
    return upto


@torch.inference_mode()
def one_row_agrees(mod: torch.nn.Module, rows: int = 4) -> bool:
    """Whether each of ``rows`` seeded random rows, run alone ([1, 1, in]), comes out bit
    for bit as in a 2-row input [1, 2, in] with a second random row (the reference of
    :func:`row_limit`). False where the one-row input takes a matrix-vector path with
    another reduction order (bf16 on oneDNN, seen on an AMX Xeon; MKL's float32
    ``F.linear`` on the test models' shapes on an AVX2-only EPYC). True for all 197
    linear layers of Qwen2.5-Coder-1.5B on oneDNN's packed float32 kernel on that EPYC,
    where running a one-row input alone makes a one-token pass ~5-10 % cheaper
    (``python -m bench.probes.one_row``)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2 * rows, mod.in_features, generator=g).to(_weight_dtype(mod))
    for i in range(0, 2 * rows, 2):
        pair = _base_forward(mod, x[:, i:i + 2])
        if not torch.equal(_base_forward(mod, x[:, i:i + 1]), pair[:, :1]):
            return False
    return True


def _weight_dtype(mod: torch.nn.Module) -> torch.dtype:
    """A linear layer's weight dtype (a packed layer without parameters: its
    ``weight_dtype``)."""
    return next((p.dtype for p in mod.parameters()),
                getattr(mod, "weight_dtype", torch.bfloat16))


class _RowInvariantLinear:
    """Mixin for a linear layer (``specrelay_rows`` = its :func:`row_limit` L;
    ``specrelay_one_row`` = :func:`one_row_agrees`): a one-row input [..., 1, in] runs as
    two copies of the row and returns row 0, unless the layer's one-row kernel agrees;
    inside a row-invariant pass (:func:`edge_sdk.row_attention.invariant_pass`) an input
    of more than L rows runs in balanced pieces of 2..L rows. Other inputs are
    unchanged."""

    specrelay_rows = 2
    specrelay_pieces = True
    specrelay_one_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[:-1].numel()
        if x.dim() >= 2 and m == 1 and not self.specrelay_one_row:
            return super().forward(torch.cat([x, x], dim=-2)).narrow(-2, 0, 1)
        if m <= self.specrelay_rows or not self.specrelay_pieces or not invariant_pass():
            return super().forward(x)
        flat = x.reshape(m, x.shape[-1])
        n = -(-m // self.specrelay_rows)
        sizes = [m // n + (i < m % n) for i in range(n)]
        out = torch.cat([_base_forward(self, p) for p in flat.split(sizes)])
        return out.reshape(*x.shape[:-1], out.shape[-1])


_classes: dict[type, type] = {}


def _invariant_class(cls: type) -> type:
    if issubclass(cls, _RowInvariantLinear):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"RowInvariant{cls.__name__}", (_RowInvariantLinear, cls), {})
    return _classes[cls]


def make_row_invariant(model: torch.nn.Module, max_rows: int = INVARIANT_MAX_ROWS,
                       pieces: bool = True) -> torch.nn.Module:
    """Make ``model``'s passes of at most ``max_rows`` new tokens row-invariant, in place:
    its linear layers (``nn.Linear`` and :class:`edge_sdk.packed.PackedLinear`, found as
    modules with ``in_features``/``out_features``) run one-row inputs as two rows (where
    their one-row kernel does not agree, :func:`one_row_agrees`) and,
    in such passes, more rows than their kernels keep row-invariant (:func:`row_limit`,
    checked once per layer shape and machine: ~5 s for a 1.5B model, mostly its
    152k-row LM head, then read from ``row_limits.json`` in the cache) in pieces;
    :class:`edge_sdk.kvmodel.KVModel` routes such passes through per-token attention.
    Weights, ``state_dict`` and ``isinstance`` checks are unchanged. Returns ``model``.

    ``pieces=False`` skips the pieces: a batched pass of more rows than a layer keeps
    row-invariant (27 on Qwen2.5-Coder-1.5B's down-projection here) then costs what it
    did, and its rows follow the near-tie policy instead. The pieces cost a weight
    stream each: a pass of 8 sessions x 5 tokens 609-638 ms against 505-749 ms without,
    8 x 9 1.02 s against 0.57-0.79 s (``python -m bench.probes.pass_cost
    qwen2.5-coder-1.5b bfloat16 5,9 8 1``, last argument 0: without); passes of up to 27
    rows, every single-session verify pass among them, cost the same either way.

    A model with sliding-window attention layers is left as it is (row attention
    refuses them: their cache keeps only the window, so a rejected draft cannot be
    rolled back out of it); its passes follow the near-tie policy.

    Raises:
        ValueError: ``max_rows`` < 1.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: expected >= 1")
    if _sliding(getattr(model, "config", None)):
        return model
    known = _load_limits()
    found: dict[str, int] = {}
    machine = _machine_key()
    for mod in model.modules():
        if hasattr(mod, "in_features") and hasattr(mod, "out_features"):
            mod.__class__ = _invariant_class(type(mod))
            key = _limit_key(mod, machine)
            one = key + "|one-row"
            if key not in found:             # same shape, same kernels: checked once
                found[key] = known[key] if key in known else row_limit(mod)
            if one not in found:
                found[one] = known[one] if one in known else int(one_row_agrees(mod))
            mod.specrelay_rows = found[key]
            mod.specrelay_one_row = bool(found[one])
            mod.specrelay_pieces = bool(pieces)
    if any(k not in known for k in found):
        _save_limits({**known, **found})
    setattr(model, _ATTR, int(max_rows))
    return model


def _sliding(cfg) -> bool:
    """Whether a model config has sliding-window attention layers."""
    if cfg is None:
        return False
    if any("sliding" in str(t) for t in (getattr(cfg, "layer_types", None) or ())):
        return True
    return bool(getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window",
                                                                      None))


def _machine_key() -> str:
    """What the kernels depend on beyond the layer: the torch build, the CPU (its
    feature flags) and the thread count."""
    from edge_sdk.models import cpu_flags

    cpu = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return (f"torch={torch.__version__}|{platform.machine()}:{cpu}|"
            f"threads={torch.get_num_threads()}|upto={CALIBRATE_ROWS}")


def _limit_key(mod: torch.nn.Module, machine: str) -> str:
    """What a layer's kernels depend on: its type, shape, weight layout, bias and dtype,
    and ``machine`` (:func:`_machine_key`)."""
    dtypes = ",".join(str(p.dtype) for p in mod.parameters()) or str(_weight_dtype(mod))
    w = getattr(mod, "weight", None)
    layout = tuple(w.stride()) if isinstance(w, torch.Tensor) else "packed"
    return (f"{type(mod).__name__}|{mod.in_features}x{mod.out_features}|{layout}|"
            f"bias={getattr(mod, 'bias', None) is not None}|{dtypes}|{machine}")


def _limits_path():
    from edge_sdk.cache import cache_dir

    return cache_dir() / "row_limits.json"


def _load_limits() -> dict[str, int]:
    """The row limits measured on this machine before (a cache; {} if none/unreadable)."""
    try:
        with open(_limits_path()) as f:
            return {str(k): int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_limits(limits: dict[str, int]) -> None:
    path = _limits_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(limits, indent=0, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass                                  # a cache: a read-only home still works


def invariant_rows(model: torch.nn.Module) -> int:
    """The ``max_rows`` of :func:`make_row_invariant` for ``model``; 0 when it is not
    row-invariant."""
    return int(getattr(model, _ATTR, 0))
