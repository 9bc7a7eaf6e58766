"""Row attention: one target pass over several sessions, each attending to its own KV cache.

A batched verification pass (AsymSpec §IV-C's cloud re-batching) shares the expensive
part of a pass across sessions: every linear layer streams its weights once for all the
rows. Attention is the opposite: row b's queries only ever read row b's keys and values.
Left-padding every past to the longest one, stacking them into one cache and letting
the model's attention repeat the grouped key/value heads for every query head copies
each session's whole cache several times per layer: on one CPU core a bf16
Qwen2.5-Coder-1.5B pass of 8 sessions x 2 tokens after ~230-token pasts cost 538-565 ms
against 298-309 ms for one session. Row attention over packed rows: 333-350 ms against
280-288 ms (4 sessions: 304-311 ms against 361-367 ms padded), and every session's
logits are bit for bit those of its own unbatched pass in that probe (``python -m
bench.probes.pass_cost qwen2.5-coder-1.5b bfloat16 2,3 1,4,8``).

Here the pass packs the sessions' new tokens into one sequence (no padding: the linear
layers see exactly the rows there are), hands the model a :class:`RowBatch` as its
cache and switches the model's attention to :func:`row_attention` for the pass
(:func:`row_attention_pass`; the model builds no mask of its own for an attention it
does not know). Each layer then appends row b's new keys/values to session b's own
cache and runs attention per row, with the grouped-query heads folded into the query
length (query ``[1, Hq, t, D]`` viewed as ``[1, Hkv, Hq/Hkv * t, D]``) so that no key
or value is copied. The arithmetic per row is the same attention as an unbatched pass.

A row-invariant model (:mod:`edge_sdk.invariant`) goes further for rows of at most
``invariant`` new tokens: each new token attends in its own call over exactly the keys
it sees (its past, then its ancestors in the block, in order), with its Hq/Hkv query
heads folded into Hq/Hkv query rows -- the call a 1-token pass at that position makes,
so its output is bit for bit the target-alone decode's.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.nn.functional as F

ROW_ATTENTION = "specrelay_rows"

__all__ = ["ROW_ATTENTION", "RowBatch", "invariant_pass", "row_attention",
           "row_attention_pass"]


class RowBatch:
    """The rows of one batched pass: their KV models and new-token counts.

    Passed to the model as its ``cache`` (:meth:`update`: each row's new keys/values
    go to its own cache); :func:`row_attention` reads its rows and masks.

    Args:
        kvs: B :class:`edge_sdk.kvmodel.KVModel` of the same model; row b has
            ``len(kvs[b].ids)`` = L_b cached tokens before the pass.
        lengths: T_b, the new tokens of row b; the pass's input packs the rows one
            after another, ``[1, sum T_b]`` (no padding).
        trees: per row a :class:`edge_sdk.protocol.tree.TreeLayout` of its T_b rows or
            None (causal), or None for all causal.
        invariant: rows with T_b <= ``invariant`` attend one new token at a time
            (:mod:`edge_sdk.invariant`); 0: none.
    """

    def __init__(self, kvs: Sequence, lengths: Sequence[int], trees=None,
                 invariant: int = 0):
        self.kvs = list(kvs)
        self.lengths = [int(t) for t in lengths]
        self.starts = [sum(self.lengths[:b]) for b in range(len(self.lengths))]
        self.past = [len(k.ids) for k in self.kvs]
        self.trees = list(trees) if trees is not None else [None] * len(self.kvs)
        self.invariant = int(invariant)
        self.all_per_token = all(t <= self.invariant for t in self.lengths)
        self._masks: dict = {}
        self._seen: dict = {}

    # -- the cache protocol the decoder layers use -------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append row b's T_b new keys/values (its span of the packed ``[1, Hkv, sum T,
        D]``) to session b's cache at ``layer_idx``. Returns the inputs (row attention
        reads the caches)."""
        for kv, a, t in zip(self.kvs, self.starts, self.lengths):
            kv.cache.update(key[:, :, a:a + t], value[:, :, a:a + t], layer_idx)
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.past)

    # -- masks --------------------------------------------------------------------------
    def mask(self, b: int, groups: int = 1) -> torch.Tensor:
        """Bool [1, 1, groups * T_b, L_b + T_b] (True: attend) of row b: its whole past,
        and causal (or its tree's mask) over its new tokens; repeated ``groups`` times
        along the queries (the folded query heads). Built once per pass, not per layer."""
        if (b, groups) not in self._masks:
            L, t, tree = self.past[b], self.lengths[b], self.trees[b]
            m = torch.ones(t, L + t, dtype=torch.bool)
            m[:, L:] = (torch.tril(torch.ones(t, t, dtype=torch.bool)) if tree is None
                        else tree.attn)
            self._masks[(b, groups)] = m.repeat(groups, 1)[None, None]
        return self._masks[(b, groups)]

    def per_token(self, b: int) -> bool:
        """Whether row b attends one new token at a time (row-invariant)."""
        return self.lengths[b] <= self.invariant

    def seen(self, b: int, i: int) -> tuple[int, int, torch.Tensor | None]:
        """``(n, pre, extra)``: new token i of row b attends to n cache entries, the
        first ``pre`` of the cache followed by the entries at the indices ``extra``
        (LongTensor, None when ``pre == n``). A causal row reads a prefix; a tree node
        whose ancestors do not precede it contiguously reads the past, its ancestors
        and itself in order, as a 1-token decode of its path does. Built once per
        pass."""
        if (b, i) not in self._seen:
            L, tree = self.past[b], self.trees[b]
            if tree is None:
                v = (L + i + 1, L + i + 1, None)
            else:
                cols = (L + torch.nonzero(torch.as_tensor(tree.attn[i])).flatten()).tolist()
                p = 0
                while p < len(cols) and cols[p] == L + p:
                    p += 1
                v = (L + len(cols), L + p,
                     torch.tensor(cols[p:], dtype=torch.long) if p < len(cols) else None)
            self._seen[(b, i)] = v
        return self._seen[(b, i)]


def _visible(t: torch.Tensor, n: int, pre: int, extra: torch.Tensor | None) -> torch.Tensor:
    """The n entries a token reads along the sequence axis of ``t`` [1, H, N, D]: a
    view of the first n, or (a tree node apart from its ancestors) a copy of the first
    ``pre`` followed by the entries at ``extra`` -- the cache itself is not touched."""
    if extra is None:
        return t[:, :, :n]
    return torch.cat((t[:, :, :pre], t.index_select(2, extra)), dim=2)


_active = threading.local()      # .rows: the RowBatch of the pass this thread runs


def invariant_pass() -> bool:
    """True inside a :func:`row_attention_pass` whose every row attends one token at a
    time (a row-invariant pass: :mod:`edge_sdk.invariant`'s linears then keep their
    pieces within the row counts their kernels compute alike)."""
    rows = getattr(_active, "rows", None)
    return rows is not None and rows.all_per_token


def row_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, **kwargs):
    """transformers' attention interface inside :func:`row_attention_pass`: the packed
    ``query`` [1, Hq, sum T_b, D] -> ``([1, sum T_b, Hq, D], None)`` (``key``/``value``/
    ``attention_mask`` are ignored: the pass's :class:`RowBatch` holds the caches and
    masks).

    Row b's T_b queries attend to session b's cache at ``module.layer_idx`` ([1, Hkv,
    L_b + T_b, D], already holding this pass's keys). The Hq/Hkv query heads sharing a
    key/value head are folded into the query length, so SDPA reads each cache once
    without repeating it per head. Raises RuntimeError outside a row attention pass,
    ValueError for a sliding-window layer (its cache keeps only the window, while
    rolling back a rejected draft needs the whole past).

    A row with :meth:`RowBatch.per_token` runs one SDPA call per new token instead:
    query [1, Hkv, Hq/Hkv, D] over its :meth:`RowBatch.seen` keys (a tree node's
    ancestors and itself gathered after its past for the call), no mask."""
    rows = getattr(_active, "rows", None)
    if rows is None:
        raise RuntimeError("row_attention runs inside row_attention_pass only")
    if sliding_window is not None:
        raise ValueError("row attention: sliding-window attention layers are not supported")
    _, Hq, N, D = query.shape
    out = query.new_empty(1, N, Hq, D)
    for b, kv in enumerate(rows.kvs):
        lay = kv.cache.layers[module.layer_idx]
        k, v = lay.keys, lay.values
        a, t = rows.starts[b], rows.lengths[b]
        Hkv = k.shape[1]
        g = Hq // Hkv
        if rows.per_token(b):
            for i in range(t):
                n, pre, extra = rows.seen(b, i)
                q = query[:, :, a + i].reshape(1, Hkv, g, D)
                o = F.scaled_dot_product_attention(q, _visible(k, n, pre, extra),
                                                   _visible(v, n, pre, extra),
                                                   scale=scaling)
                out[0, a + i] = o.reshape(Hq, D)
            continue
        q = query[:, :, a:a + t].reshape(1, Hkv, g * t, D)
        m = rows.mask(b, g)                                   # [1, 1, g*t, n]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scaling)
        out[0, a:a + t] = o.reshape(Hq, t, D).transpose(0, 1)
    return out, None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ROW_ATTENTION, row_attention)
        _registered = True


@contextmanager
def row_attention_pass(model, rows: RowBatch):
    """Within the block, ``model`` (on this thread) runs its attention through
    :func:`row_attention` over ``rows``; the model's own implementation is restored on
    exit, so every other pass is unchanged. One thread drives a model at a time."""
    _register()
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = ROW_ATTENTION
    _active.rows = rows
    try:
        yield
    finally:
        _active.rows = None
        cfg._attn_implementation = before
