"""A causal LM plus its KV cache, trimmed to a confirmed prefix.

The one cache-trimming implementation: the edge's torch drafter and the cloud's target
sessions both use :class:`KVModel`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class KVModel:
    """Runs a HF causal LM incrementally over one sequence (batch 1).

    Invariant: ``len(self.ids) == self.cache_len()``; ``self.ids`` are the tokens whose
    keys/values sit in the cache.
    """

    def __init__(self, model):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []

    def cache_len(self) -> int:
        """Tokens held in the KV cache."""
        return int(self.cache.get_seq_length())

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (n <= cached). Raises ValueError otherwise."""
        have = len(self.ids)
        if not 0 <= n <= have:
            raise ValueError(f"crop({n}) outside 0..{have}")
        if n < have:
            self.cache.crop(n - have)
            del self.ids[n:]
        self.check()

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int], tree=None, last: int | None = None
                ) -> torch.Tensor:
        """Append ``new_ids`` [k] and return their logits, float32 [k, V].

        ``tree``: a :class:`edge_sdk.protocol.tree.TreeLayout` of k rows (position
        offsets from the first new token and the rows' tree mask; the cached past is
        visible to every row); None: causal. A tree leaves every row in the cache
        (:meth:`keep` cuts it to the accepted branch).

        ``last``: compute only the last ``last`` rows' logits (float32 [last, V]; 1 <=
        last <= k): the LM head is skipped for the other rows, whose logits a prefill
        never reads (on a 1.5B model with a 152k vocabulary the head is ~15 % of a
        prompt's FLOPs). The cache is the same either way. Raises ValueError for a
        ``last`` outside 1..k."""
        if not new_ids:
            raise ValueError("forward() needs at least one token")
        if last is not None and not 1 <= last <= len(new_ids):
            raise ValueError(f"last={last} outside 1..{len(new_ids)}")
        x = torch.tensor([list(new_ids)], dtype=torch.long)
        kw = {}
        if tree is not None:
            if tree.rows != len(new_ids):
                raise ValueError(f"tree of {tree.rows} rows for {len(new_ids)} tokens")
            P = len(self.ids)
            mask = torch.ones(1, 1, tree.rows, P + tree.rows, dtype=torch.bool)
            mask[0, 0, :, P:] = tree.attn
            kw = {"attention_mask": mask, "position_ids": (P + tree.offsets)[None]}
        if last is not None and last < len(new_ids):
            kw["logits_to_keep"] = last
        try:
            out = self.model(input_ids=x, cache=self.cache, use_cache=True, **kw)
        except BaseException:
            self.rebuild()  # a half-updated cache cannot be trimmed reliably
            raise
        self.ids.extend(int(t) for t in new_ids)
        self.check()
        return out.logits[0].float()

    def keep(self, n: int, extra: Sequence[int] = ()) -> None:
        """Keep the first ``n`` cached tokens plus the entries at indices ``extra``
        (each >= n, in order): a tree pass cut to its accepted branch. Raises
        ValueError for indices outside the cache."""
        have = len(self.ids)
        extra = [int(i) for i in extra]
        if not 0 <= n <= have or any(not n <= i < have for i in extra):
            raise ValueError(f"keep({n}, {extra}) outside 0..{have}")
        if not extra:
            return self.crop(n)
        idx = torch.tensor(list(range(n)) + extra, dtype=torch.long)
        for lay in self.cache.layers:
            lay.keys = lay.keys.index_select(-2, idx)
            lay.values = lay.values.index_select(-2, idx)
        self.ids = self.ids[:n] + [self.ids[i] for i in extra]
        self.check()

    def sync(self, context: Sequence[int], block: Sequence[int] = ()) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` (rolling back whatever diverges, reusing
        the common prefix), then run ``context[-1]`` and ``block`` [g].

        Returns float32 [g+1, V]: row i holds the logits after ``context + block[:i]``.
        Afterwards the cache holds ``context + block``; the caller crops it.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        common = common_prefix(self.ids, context)
        self.crop(min(common, len(context) - 1))
        new = list(context[len(self.ids):]) + list(block)
        return self.forward(new, last=len(block) + 1)

    def align(self, prefix: Sequence[int]) -> None:
        """Make the cache hold exactly ``prefix``: roll back to the longest common
        prefix, then run whatever is missing (after a rebuild, say)."""
        common = common_prefix(self.ids, prefix)
        self.crop(common)
        if len(prefix) > common:
            self.forward(prefix[common:], last=1)

    def rebuild(self) -> None:
        """Drop the cache entirely (it will be refilled by ``align``/``sync``)."""
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []

    def reset(self) -> None:
        self.crop(0)

    def check(self) -> None:
        """Assert the cache-length invariant (CASES.md 7)."""
        n = self.cache_len()
        if n != len(self.ids):
            raise AssertionError(f"KV cache holds {n} tokens, expected {len(self.ids)}")


def _padded_pasts(kvs: Sequence[KVModel], L: list[int], Lm: int) -> DynamicCache:
    """One cache holding every row's past, left-padded with zeros to ``Lm`` entries."""
    cache = DynamicCache(config=kvs[0].model.config)
    if not Lm:
        return cache
    ref = next(k for k in kvs if k.ids).cache.layers
    for layer in range(len(ref)):
        ks, vs = [], []
        for kv, lb in zip(kvs, L):
            if lb:
                k, v = kv.cache.layers[layer].keys, kv.cache.layers[layer].values
            else:
                k = v = ref[layer].keys[:1, :, :0]
            pad = (0, 0, Lm - lb, 0)
            ks.append(torch.nn.functional.pad(k, pad))
            vs.append(torch.nn.functional.pad(v, pad))
        cache.update(torch.cat(ks), torch.cat(vs), layer)
    return cache


def _padded_inputs(news: Sequence[Sequence[int]], L: list[int], Lm: int, trees=None):
    """Right-padded input ids [B, Tm], position ids [B, Tm] continuing each row's past,
    and the bool attention mask [B, 1, Tm, Lm + Tm] (own past, causal over own new, or
    row b's tree mask and position offsets when ``trees[b]`` is a TreeLayout)."""
    B, T = len(news), [len(n) for n in news]
    Tm = max(T)
    ids = torch.zeros(B, Tm, dtype=torch.long)
    pos = torch.arange(Tm).unsqueeze(0) + torch.tensor(L).unsqueeze(1)
    mask = torch.zeros(B, 1, Tm, Lm + Tm, dtype=torch.bool)
    causal = torch.tril(torch.ones(Tm, Tm, dtype=torch.bool))
    for b in range(B):
        ids[b, :T[b]] = torch.tensor(list(news[b]))
        mask[b, 0, :, Lm - L[b]:Lm] = True
        tree = None if trees is None else trees[b]
        if tree is None:
            mask[b, 0, :, Lm:Lm + T[b]] = causal[:, :T[b]]
        else:
            mask[b, 0, :T[b], Lm:Lm + T[b]] = tree.attn
            mask[b, 0, T[b]:, Lm:Lm + T[b]] = causal[T[b]:, :T[b]]   # padding rows
            pos[b, :T[b]] = L[b] + tree.offsets
    return ids, pos, mask


@torch.inference_mode()
def batched_forward(kvs: Sequence[KVModel], news: Sequence[Sequence[int]],
                    trees: Sequence | None = None) -> list[torch.Tensor]:
    """One forward over several sequences with their own KV caches (same model).

    Row b continues ``kvs[b]`` (past length L_b) with ``news[b]`` (T_b tokens). Pasts
    are left-padded to max L and new tokens right-padded to max T; an explicit 4-D mask
    hides the padding and keeps attention causal; position ids continue each row's own
    past. Afterwards each cache is extended by exactly its own T_b new entries.

    ``trees``: per row a :class:`edge_sdk.protocol.tree.TreeLayout` of its T_b new
    tokens (a sibling tree) or None (causal).

    Returns float32 logits per row, [T_b, V]. A batch of one runs unpadded (bit-identical
    to :meth:`KVModel.forward`). Raises ValueError for an empty row.
    """
    if len(kvs) == 1:
        return [kvs[0].forward(news[0], None if trees is None else trees[0])]
    if any(not n for n in news):
        raise ValueError("every row needs at least one new token")
    L = [len(k.ids) for k in kvs]
    Lm = max(L)
    cache = _padded_pasts(kvs, L, Lm)
    if trees is not None and any(t is not None and t.rows != len(n)
                                 for t, n in zip(trees, news)):
        raise ValueError("a tree's rows differ from its row's new tokens")
    ids, pos, mask = _padded_inputs(news, L, Lm, trees)
    try:
        logits = kvs[0].model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              cache=cache, use_cache=True).logits.float()
    except BaseException:
        for kv in kvs:   # their caches were not touched, but be safe: refill lazily
            kv.rebuild()
        raise
    out = []
    for b, kv in enumerate(kvs):
        T = len(news[b])
        for layer, lay in enumerate(cache.layers):
            kv.cache.update(lay.keys[b:b + 1, :, Lm:Lm + T].clone(),
                            lay.values[b:b + 1, :, Lm:Lm + T].clone(), layer)
        kv.ids.extend(int(t) for t in news[b])
        kv.check()
        out.append(logits[b, :T])
    return out
