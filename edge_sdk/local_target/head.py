"""The local target's LM head, prepacked for oneDNN in row chunks read straight from
storage (:mod:`edge_sdk.packed`), with the draft's vocabulary as its own chunks.

The head ``W`` [V, H] is the largest resident tensor (Qwen2.5-Coder-1.5B: 151936 x 1536
bf16 = 467 MB, a quarter of a 50 % budget), so two things matter under CATS's memory
budget:

* no second copy: the chunks are read row range by row range from the checkpoint
  (:meth:`~.storage.Storage.read_rows`) and packed one at a time, so the dense head is
  never materialised whole (transient: one chunk, ``CHUNK_ROWS`` x H), and the packed
  chunks together are the head's bytes (oneDNN pads a chunk's rows to its block; the
  chunks are multiples of 64 rows, the last and the special rows excepted);
* the draft's sub-head (the first ``k`` ids + the special ones, FR-Spec's
  frequency-ranked subset; :func:`edge_sdk.exit_head.restricted_vocab`) is a set of
  those chunks, so :meth:`PackedHead.draft` runs only them and the full head is the
  draft chunks plus the rest: the sub-head costs no extra byte.

Each output column of a GEMM is its own dot product over ``H`` (oneDNN blocks the
reduction the same way whatever the number of rows), so the full logits equal
``F.linear`` over the whole head bit for bit (checked per chunk on a probe input at
build, where a chunk that differs stays dense; and end to end in
``tests/test_local_packed.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from edge_sdk.exit_head import _head_rows, full_vocab, leading_run, restricted_vocab
from edge_sdk.packed import PackedLinear, try_pack

__all__ = ["PackedHead", "DraftVocabHead", "CHUNK_ROWS", "packed_nbytes"]

CHUNK_ROWS = 8192
"""Rows per packed chunk (bf16, H=1536: 25 MB, the build's transient; a multiple of
oneDNN's row block)."""


def packed_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a oneDNN (``torch._mkldnn``) tensor's own allocation,
    padding included, else ``numel * itemsize``."""
    if t.is_mkldnn and hasattr(torch.ops.mkldnn, "_nbytes"):
        return int(torch.ops.mkldnn._nbytes(t))
    return t.numel() * t.element_size()


class _Dense(torch.nn.Module):
    """A chunk oneDNN would not pack bit-identically: ``x W^T`` with W [n, H] dense."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", w, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _pack(w: torch.Tensor) -> torch.nn.Module:
    """Rows ``w`` [n, H] -> a :class:`PackedLinear` (:func:`edge_sdk.packed.try_pack`),
    or :class:`_Dense` where it is not packed."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    return try_pack(lin) or _Dense(w)


class PackedHead(torch.nn.Module):
    """``logits = h W^T`` with ``W`` [V, H] held as packed row chunks.

    Args:
        rows: ``(a, b) -> W[a:b]`` [b-a, H] (a fresh tensor in the compute dtype; e.g.
            :meth:`~.storage.Storage.read_rows` of ``lm_head.weight``).
        vocab: V. hidden: H.
        draft_ids: sorted long [K] of the draft's vocabulary (None: no draft split);
            :meth:`draft` returns its columns in this order.
        gather: ``ids [m] -> W[ids]`` [m, H] for the draft's rows outside its leading
            run ``0..n0-1`` (the special ids), gathered into one chunk.
        chunk_rows: rows per chunk (None: :data:`CHUNK_ROWS`).
    """

    def __init__(self, rows: Callable[[int, int], torch.Tensor], vocab: int, hidden: int,
                 draft_ids: torch.Tensor | None = None,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.vocab, self.hidden = int(vocab), int(hidden)
        chunk_rows = int(chunk_rows or CHUNK_ROWS)
        if draft_ids is None:
            n0, extra = 0, torch.empty(0, dtype=torch.long)
        else:
            ids = draft_ids.long()
            n0 = leading_run(ids)
            extra = ids[n0:]
        self.register_buffer("draft_ids", None if draft_ids is None else
                             draft_ids.long().clone(), persistent=False)
        # contiguous row ranges: the draft's leading run, then the rest between extras
        cuts, spans, a = sorted(int(e) for e in extra), [], n0
        for e in cuts + [self.vocab]:
            if e > a:
                spans.append((a, e))
            a = e + 1
        ranges = ([(0, n0)] if n0 else []) + spans
        self.ranges: list[tuple[int, int, bool]] = []       # (a, b, is a draft chunk)
        self.chunks = torch.nn.ModuleList()
        for a, b in ranges:
            for c in range(a, b, chunk_rows):
                d = min(b, c + chunk_rows)
                self.ranges.append((c, d, d <= n0))
                self.chunks.append(_pack(rows(c, d)))
        self.register_buffer("extra", extra, persistent=False)
        self.extra_chunk = _pack(gather(extra)) if extra.numel() else None

    def nbytes(self) -> int:
        """Bytes the chunks hold (packed, padding included)."""
        mods = list(self.chunks) + ([self.extra_chunk] if self.extra_chunk is not None else [])
        return sum(packed_nbytes(m.packed if isinstance(m, PackedLinear) else m.weight)
                   for m in mods)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The full head: ``h`` [..., H] -> logits [..., V] (h's dtype)."""
        out = h.new_empty(h.shape[:-1] + (self.vocab,))
        for (a, b, _), m in zip(self.ranges, self.chunks):
            out[..., a:b] = m(h)
        if self.extra_chunk is not None:
            out[..., self.extra] = self.extra_chunk(h)
        return out

    def draft(self, h: torch.Tensor) -> torch.Tensor:
        """The draft's sub-head: ``h`` [..., H] -> logits [..., K] of ``draft_ids``, in
        their order (the draft chunks only). Raises ValueError without a draft split."""
        if self.draft_ids is None:
            raise ValueError("this head has no draft vocabulary")
        parts = [m(h) for (_, _, d), m in zip(self.ranges, self.chunks) if d]
        if self.extra_chunk is not None:
            parts.append(self.extra_chunk(h))
        return torch.cat(parts, -1)


class DraftVocabHead:
    """The final norm + LM head of ``target`` (an
    :class:`~.runner.OffloadedTarget`) over a draft vocabulary (the first ``vocab``
    ids plus the special ones, :func:`edge_sdk.exit_head.restricted_vocab`; None: all),
    so a draft's head costs a fraction of the full one (FR-Spec's frequency-ranked
    subset). With the target's :class:`~.head.PackedHead` built for this vocabulary,
    only its draft chunks run (no extra byte)."""

    def __init__(self, target, vocab: int | None = 32768):
        self.t = target
        self.vocab_ids = restricted_vocab(target.model, vocab)
        head = target.model.lm_head
        if isinstance(head, PackedHead):        # packed: its draft chunks, or the full head
            same = (head.draft_ids is not None and self.vocab_ids is not None
                    and torch.equal(head.draft_ids, self.vocab_ids))
            self._sub = head.draft if same else (
                head if self.vocab_ids is None else lambda h: head(h)[..., self.vocab_ids])
        else:
            rows = _head_rows(head.weight, self.vocab_ids)
            self._sub = lambda h: torch.cat([h @ r.T for r in rows], -1)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + the restricted head of a last layer's output [T, H] -> float32
        [T, V] (ids outside the draft vocabulary: ``-inf``)."""
        small = self._sub(self.t.model.model.norm(h)).float()
        return full_vocab(small, self.vocab_ids, int(self.t.config.vocab_size))
