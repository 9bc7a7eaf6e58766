"""A causal LM plus its KV cache, trimmed to a confirmed prefix.

The one cache-trimming implementation: the edge's torch drafter and the cloud's target
sessions both use :class:`KVModel`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from edge_sdk.invariant import invariant_rows
from edge_sdk.row_attention import RowBatch, row_attention_pass


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _new_cache(config):
    """An empty transformers ``DynamicCache`` (transformers loads here, on first use:
    an app that only drafts with ONNX does not import it)."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


class KVModel:
    """Runs a HF causal LM incrementally over one sequence (batch 1).

    Invariant: ``len(self.ids) == self.cache_len()``; ``self.ids`` are the tokens whose
    keys/values sit in the cache.
    """

    def __init__(self, model):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.cache = _new_cache(model.config)
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
        ``last`` outside 1..k.

        On a row-invariant model (:mod:`edge_sdk.invariant`) a pass of at most its
        ``max_rows`` tokens attends one token at a time: row i's logits are bit for bit
        those of a 1-token pass at its position."""
        if not new_ids:
            raise ValueError("forward() needs at least one token")
        if last is not None and not 1 <= last <= len(new_ids):
            raise ValueError(f"last={last} outside 1..{len(new_ids)}")
        if tree is not None and tree.rows != len(new_ids):
            raise ValueError(f"tree of {tree.rows} rows for {len(new_ids)} tokens")
        if len(new_ids) <= invariant_rows(self.model):
            return self._forward_rows(new_ids, tree, last)
        x = torch.tensor([list(new_ids)], dtype=torch.long)
        kw = {}
        if tree is not None:
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

    def _forward_rows(self, new_ids: Sequence[int], tree, last: int | None
                      ) -> torch.Tensor:
        """:meth:`forward` through :mod:`edge_sdk.row_attention`, one token at a time."""
        return _row_pass([self], [new_ids], [tree], len(new_ids), last)[0]

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
        self.cache = _new_cache(self.model.config)
        self.ids = []

    def reset(self) -> None:
        self.crop(0)

    def check(self) -> None:
        """Assert the cache-length invariant (CASES.md 7)."""
        n = self.cache_len()
        if n != len(self.ids):
            raise AssertionError(f"KV cache holds {n} tokens, expected {len(self.ids)}")


@torch.inference_mode()
def batched_forward(kvs: Sequence[KVModel], news: Sequence[Sequence[int]],
                    trees: Sequence | None = None) -> list[torch.Tensor]:
    """One forward over several sequences with their own KV caches (same model).

    Row b continues ``kvs[b]`` (past length L_b) with ``news[b]`` (T_b tokens): the
    linear layers run once over all rows (packed one after another, [1, sum T_b], no
    padding), attention runs per row over row b's own cache
    (:mod:`edge_sdk.row_attention`: no padded pasts, no repeated key/value heads);
    position ids continue each row's own past.
    Afterwards each cache is extended by exactly its own T_b new entries.

    ``trees``: per row a :class:`edge_sdk.protocol.tree.TreeLayout` of its T_b new
    tokens (a sibling tree) or None (causal).

    On a row-invariant model (:mod:`edge_sdk.invariant`) rows of at most its
    ``max_rows`` tokens attend one token at a time, as in :meth:`KVModel.forward`.

    Returns float32 logits per row, [T_b, V]. A batch of one runs unbatched
    (bit-identical to :meth:`KVModel.forward`). Raises ValueError for an empty row, a
    cache given twice, or a tree whose rows differ from its row's tokens.
    """
    if len(kvs) == 1:
        return [kvs[0].forward(news[0], None if trees is None else trees[0])]
    if any(not n for n in news):
        raise ValueError("every row needs at least one new token")
    if len({id(k) for k in kvs}) != len(kvs):
        raise ValueError("a KV cache appears in two rows of one pass")
    if trees is not None and any(t is not None and t.rows != len(n)
                                 for t, n in zip(trees, news)):
        raise ValueError("a tree's rows differ from its row's new tokens")
    return _row_pass(kvs, news, trees, invariant_rows(kvs[0].model))


def _row_pass(kvs: Sequence[KVModel], news: Sequence[Sequence[int]], trees,
              invariant: int, last: int | None = None) -> list[torch.Tensor]:
    """One pass of ``news[b]`` after ``kvs[b]`` through :mod:`edge_sdk.row_attention`
    (rows packed, [1, sum T_b]; rows of at most ``invariant`` tokens one token at a
    time). ``last``: logits of the last ``last`` packed rows only (a single row's
    prefill). Returns float32 logits per row. On failure every cache is dropped (refilled
    lazily): some layers may hold this pass's entries."""
    T = [len(n) for n in news]
    ids = torch.tensor([[int(t) for n in news for t in n]], dtype=torch.long)
    pos = []
    for b, kv in enumerate(kvs):
        tree = None if trees is None else trees[b]
        off = torch.arange(T[b]) if tree is None else torch.as_tensor(tree.offsets)
        pos.append(len(kv.ids) + off)
    pos = torch.cat(pos)[None]
    model = kvs[0].model
    rows = RowBatch(kvs, T, trees, invariant=invariant)
    kw = {"logits_to_keep": last} if last is not None and last < sum(T) else {}
    try:
        with row_attention_pass(model, rows):
            logits = model(input_ids=ids, position_ids=pos, cache=rows, use_cache=True,
                           **kw).logits
    except BaseException:
        for kv in kvs:
            kv.rebuild()
        raise
    for kv, new in zip(kvs, news):
        kv.ids.extend(int(x) for x in new)
        kv.check()
    if kw:                                     # one row, its last ``last`` rows only
        return [logits[0].float()]
    return [logits[0, a:a + t].float() for a, t in zip(rows.starts, T)]
