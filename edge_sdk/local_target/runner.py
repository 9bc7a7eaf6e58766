"""A memory-budgeted local target: ``R`` decoder layers (and the final norm and LM head)
resident -- the first ``R``, the first ``R1`` and the last ``R2`` (``R1 + R2 = R``), or
any set of ``R`` layers (for the layer-skipping draft of :mod:`.skip`; ``R1`` is then
the first layer not in the set) -- the other layers streamed from storage
into two reusable layer buffers per forward pass (CATS, "parameter offloading patterns": the layers
that do not fit the budget are loaded per pass; the peak footprint stays at resident
weights + two streamed layers + KV cache, never the whole target). Double buffering:
while one buffer's layer computes, the next streamed layer is read into the other on a
background thread (the emulated storage's wait then overlaps the compute, as DMA reads
from flash do), and the pass's last streamed layer reads ahead the first one of the
next pass.

The model is built on the ``meta`` device (no memory), then only the resident tensors
are materialised from the checkpoint; the streamed layers stay on ``meta`` and run
through :attr:`OffloadedTarget.buffers`, decoder layers whose parameters are
overwritten from :class:`~edge_sdk.local_target.storage.Storage` before each use. The
embedding table may stay on storage too (``resident_embed=False``): a lookup reads
only the rows of the new tokens (H*2 bytes each in bf16).

Layers run one by one with explicit position ids and a causal mask over each layer's
own cache length, so a segment ``[a, b)`` can run ahead of the others (the draft's
resident layers) and the skipped layers get their keys/values later at the *same*
positions (CASES.md 11; LayerSkip, Elhoushi et al. 2024, §4.2: the draft's KV of the
shared layers is reused by the verification pass).

Packing (``packed=True``, bf16): the resident layers' linears are prepacked for oneDNN
once at build (:func:`edge_sdk.packed.pack_linears`, one linear at a time so a dense
weight is freed before the next is packed) and the LM head is built as a
:class:`~.head.PackedHead` straight from storage in row chunks (never dense whole),
with the draft's vocabulary as its own chunks. Every resident byte is then a packed
byte: the same count (no padding at these shapes) and no dense copy, so the budget's
``M(R)`` is unchanged; :meth:`OffloadedTarget.resident_bytes` counts the packed
tensors. The streamed layers stay dense in :attr:`OffloadedTarget.buffers`: they get new
weights per pass, and a repack would cost the reorder that ``F.linear`` does anyway.
A tied head (no ``lm_head.weight`` in the file: it is the resident embedding) and
``pack_head=False`` (the early-exit draft reads the dense head's rows) keep the head
dense.
"""

from __future__ import annotations

from typing import Container, Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from edge_sdk.local_target.head import PackedHead, packed_nbytes
from edge_sdk.local_target.storage import Storage
from edge_sdk.packed import PackedLinear, pack_linears, packing_supported
from edge_sdk.protocol import sampling as S

__all__ = ["OffloadedTarget"]


def _trim() -> None:
    """Return the freed dense weights' heap pages to the OS (glibc ``malloc_trim``;
    ~40 MB of fragments after packing the 1.5B target's resident set); elsewhere a
    no-op."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class OffloadedTarget:
    """The target with decoder layers ``0..R1-1`` and ``L-R2..L-1`` resident
    (``R1 = R - R2``; by default ``R2 = 0``: the first R) and ``R1..L-R2-1`` streamed,
    or with the decoder layers of ``layer_set`` resident and the others streamed.

    Args:
        storage: the checkpoint (keys ``model.layers.{i}.*``, ``model.norm.weight``,
            ``lm_head.weight``, ``model.embed_tokens.weight``).
        config: the model's HF config. resident_layers: R in 0..L.
        dtype: compute dtype (the file's tensors are cast). resident_embed: keep the
            embedding table in memory (else rows are read from storage per token).
        tail_layers: R2 in 0..R, the resident layers taken from the end.
        layer_set: the resident decoder layers (distinct ids in 0..L-1; R = its size,
            ``tail_layers`` must then be 0). ``R1`` = the first layer not in the set,
            :attr:`tail` = the set's layers above it.
        packed: prepack the resident linears for oneDNN (bf16 and a oneDNN build only;
            else ignored). pack_head: with ``packed``, the LM head too (a
            :class:`~.head.PackedHead`; ``model.lm_head`` then has no ``.weight``).
        draft_ids: sorted long [K], the draft's vocabulary the packed head keeps as
            its own chunks (:meth:`~.head.PackedHead.draft`; None: no split).
        prefetch: two streamed-layer buffers (the budget counts both,
            :data:`~.budget.STREAM_BUFFERS`): the next streamed layer is read on a
            background thread while one computes, and a buffer that still holds the
            layer asked for is not read again; False: one buffer, read for every use.
    Attributes:
        packed: True when the resident linears are packed.
        R1: the first streamed layer (L when nothing is streamed): layers ``0..R1-1``
            are resident and see the target's own inputs on every path.
        tail: sorted tuple, the resident layers above ``R1`` (``R2`` of them).
    Raises:
        ValueError: R outside 0..L, R2 outside 0..R, or a bad ``layer_set``.
        KeyError: a tensor missing from the file.
    """

    def __init__(self, storage: Storage, config, resident_layers: int,
                 dtype: torch.dtype = torch.float32, resident_embed: bool = False,
                 tail_layers: int = 0, packed: bool = False, pack_head: bool = True,
                 draft_ids: torch.Tensor | None = None,
                 layer_set: Sequence[int] | None = None, prefetch: bool = True):
        L = int(config.num_hidden_layers)
        if layer_set is not None:
            ids = [int(i) for i in layer_set]
            if len(set(ids)) != len(ids) or any(not 0 <= i < L for i in ids) or tail_layers:
                raise ValueError(f"layer_set={list(layer_set)}: distinct layer ids in "
                                 f"0..{L - 1} expected (and tail_layers=0)")
            resident_layers = len(ids)
        if not 0 <= resident_layers <= L:
            raise ValueError(f"resident_layers={resident_layers} outside 0..{L}")
        if not 0 <= tail_layers <= resident_layers:
            raise ValueError(f"tail_layers={tail_layers} outside 0..{resident_layers}")
        self.storage, self.config, self.dtype = storage, config, dtype
        self.num_layers, self.R = L, int(resident_layers)
        if layer_set is not None:
            self.resident = frozenset(ids)
        else:
            r2 = 0 if self.R == L else int(tail_layers)
            self.resident = frozenset(range(self.R - r2)) | frozenset(range(L - r2, L))
        self.R1 = min((i for i in range(L) if i not in self.resident), default=L)
        self.tail = tuple(sorted(i for i in self.resident if i >= self.R1))
        self.R2 = len(self.tail)
        self.resident_embed = resident_embed or "lm_head.weight" not in storage.entries
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.packed = bool(packed and dtype == torch.bfloat16
                           and packing_supported(torch.bfloat16))
        self._load_resident(self.packed and pack_head, draft_ids)
        if self.packed:
            for i in sorted(self.resident):
                pack_linears(self.model.model.layers[i])
            _trim()
        inner = self.model.model
        inner.rotary_emb = type(inner.rotary_emb)(config=config)      # real inv_freq
        n_buf = 0 if self.R == L else (2 if prefetch else 1)
        self.buffers = [self._make_buffer() for _ in range(n_buf)]
        self._loaded = [None] * n_buf         # layer id each buffer holds (or is reading)
        self._pending = None                  # (buffer index, future) of the read in flight
        self._pool = None
        if n_buf == 2:
            import weakref
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="specrelay-prefetch")
            weakref.finalize(self, self._pool.shutdown, wait=False)   # its idle thread
        self.cache = DynamicCache(config=config)
        self.streamed_passes = 0

    def _resident_keys(self) -> list[str]:
        keys = ["model.norm.weight", "lm_head.weight"]
        if self.resident_embed:
            keys.append("model.embed_tokens.weight")
        pre = tuple(f"model.layers.{i}." for i in sorted(self.resident))
        keys += [k for k in self.storage.entries if k.startswith(pre)]
        return [k for k in keys if k in self.storage.entries]

    def _load_resident(self, pack_head: bool = False,
                       draft_ids: torch.Tensor | None = None) -> None:
        """Materialise the resident tensors (each read once, charged to the storage);
        ``pack_head``: the untied LM head as a :class:`~.head.PackedHead` instead."""
        sd = {}
        keys = self._resident_keys()
        if pack_head and "lm_head.weight" in keys:
            keys.remove("lm_head.weight")
            V, H = self.storage.entries["lm_head.weight"][1]
            rd = lambda a, b: self.storage.read_rows("lm_head.weight", a, b).to(self.dtype)
            gather = lambda ids: torch.cat([rd(i, i + 1) for i in ids.tolist()])
            self.model.lm_head = PackedHead(rd, V, H, draft_ids, gather)
        for k in keys:
            sd[k] = torch.empty(self.storage.entries[k][1], dtype=self.dtype)
            self.storage.read_into(k, sd[k])
        if "lm_head.weight" not in sd and not isinstance(self.model.lm_head, PackedHead):
            # tied head: share the embedding
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.model.load_state_dict(sd, strict=False, assign=True)

    def _make_buffer(self) -> torch.nn.Module:
        """The one reusable decoder layer the streamed layers are loaded into."""
        layer_cls = type(self.model.model.layers[0])
        with torch.device("meta"):
            buf = layer_cls(self.config, layer_idx=self.R1).to(self.dtype)
        # cast on meta, then allocate: never a float32 copy (it would stay in the RSS)
        return buf.to_empty(device="cpu").eval().requires_grad_(False)

    # ------------------------------------------------------------------ accounting

    def layer_bytes(self, i: int) -> int:
        """Bytes of decoder layer ``i`` in the file."""
        pre = f"model.layers.{i}."
        return sum(self.storage.nbytes(k) for k in self.storage.entries if k.startswith(pre))

    def resident_bytes(self) -> int:
        """Bytes of the materialised tensors (resident weights, dense or packed, + the
        streamed-layer buffers)."""
        seen, n = set(), 0
        mods = [self.model] + self.buffers
        for m in mods:
            for t in list(m.parameters()) + list(m.buffers()):
                if t.device.type != "meta" and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    n += t.numel() * t.element_size()
            n += sum(packed_nbytes(x.packed) for x in m.modules()
                     if isinstance(x, PackedLinear))
        return n

    # ------------------------------------------------------------------ forward

    def _read(self, b: int, i: int) -> None:
        """Layer ``i``'s weights from storage into buffer ``b``."""
        for name, p in self.buffers[b].named_parameters():
            self.storage.read_into(f"model.layers.{i}.{name}", p.data)

    def settle(self) -> None:
        """Wait for the read in flight, if any (its buffer then holds its layer)."""
        if self._pending is not None:
            b, fut = self._pending
            self._pending = None
            try:
                fut.result()
            except BaseException:
                self._loaded[b] = None
                raise

    def layer(self, i: int, next_streamed: int | None = None) -> torch.nn.Module:
        """Decoder layer ``i``, ready to run: the resident module, or a buffer loaded
        with layer ``i``'s weights from storage (its attention writes cache slot i).
        With two buffers (``prefetch``), the streamed layer ``next_streamed`` (None:
        the first streamed layer, the next pass's first read) is then read into the
        other buffer on a background thread while layer ``i`` computes: the emulated
        storage's wait overlaps the compute (double buffering, as DMA reads from
        flash would)."""
        if i in self.resident:
            return self.model.model.layers[i]
        self.streamed_passes += i == self.R1
        self.settle()
        if self._pool is not None and i in self._loaded:      # read ahead (or kept)
            b = self._loaded.index(i)
        else:
            b = 0                               # nothing in flight: both are free
            self._loaded[b] = None
            self._read(b, i)
            self._loaded[b] = i
        if self._pool is not None:
            j = self.R1 if next_streamed is None else next_streamed
            o = 1 - b
            if j != i and self._loaded[o] != j:
                self._loaded[o] = j
                self._pending = (o, self._pool.submit(self._read, o, j))
        buf = self.buffers[b]
        buf.self_attn.layer_idx = i
        return buf

    def cache_len(self, i: int) -> int:
        """Tokens in the KV cache of layer ``i``."""
        return int(self.cache.layers[i].get_seq_length())

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """Input embeddings of ``ids`` [q] -> [1, q, H] (compute dtype)."""
        t = torch.tensor(list(ids), dtype=torch.long)
        if self.resident_embed:
            return self.model.model.embed_tokens(t)[None]
        return self.storage.rows("model.embed_tokens.weight", t).to(self.dtype)[None]

    @torch.inference_mode()
    def run_layers(self, h: torch.Tensor, a: int, b: int, pos: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run decoder layers ``a..b-1`` on ``h`` [1, q, H]; by default the positions
        continue the cache of layer ``a`` (all layers of the segment must hold the same
        length P) under a causal mask. A token tree passes its own ``pos`` long [1, q]
        and ``mask`` bool [1, 1, q, P + q] (True: attend).

        Returns the residual stream after layer ``b-1`` [1, q, H]; each layer's cache
        grows by q. Raises AssertionError when the segment's caches disagree."""
        return self.run_list(h, range(a, b), pos, mask)

    @torch.inference_mode()
    def run_list(self, h: torch.Tensor, layers: Sequence[int],
                 pos: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`run_layers` over the decoder layers ``layers`` in that order (e.g. the
        skip draft's resident tail, which need not be contiguous). Returns [1, q, H]
        (``h`` unchanged for no layers). Raises AssertionError when their caches hold
        different lengths."""
        layers = list(layers)
        if not layers:
            return h
        P, q = self.cache_len(layers[0]), h.shape[1]
        if any(self.cache_len(i) != P for i in layers):
            raise AssertionError(f"layers {layers} hold different cache lengths")
        if pos is None:
            pos = torch.arange(P, P + q).unsqueeze(0)
        pe = self.model.model.rotary_emb(h, pos)
        if mask is None and q > 1:
            mask = torch.ones(q, P + q, dtype=torch.bool).tril(P)[None, None]
        streamed = [i for i in layers if i not in self.resident]
        after = dict(zip(streamed, streamed[1:]))      # the next read to overlap
        for i in layers:
            h = self.layer(i, after.get(i))(h, attention_mask=mask, position_ids=pos,
                                            cache=self.cache, use_cache=True,
                                            position_embeddings=pe)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of the last layer's output [1, q, H] -> float32 [q, V]."""
        return self.model.lm_head(self.model.model.norm(h))[0].float()

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of the last layer's output [1, q, H] -> int64 [q]: the argmax
        of :meth:`logits` (the same values, so the same ids and ties) taken on the
        head's own dtype, with no float32 copy of the [q, V] logits (a draft tree's
        verification pass has up to 1 + nodes rows)."""
        return S.greedy_token(self.model.lm_head(self.model.model.norm(h))[0])

    def forward(self, ids: list[int]) -> torch.Tensor:
        """A full pass over new tokens ``ids`` [q] (all layers continue one cache
        length): float32 logits [q, V]."""
        h = self.run_layers(self.embed(ids), 0, self.num_layers)
        return self.logits(h)

    def crop(self, n: int, layers: Container[int] | None = None) -> None:
        """Keep the first ``n`` cached tokens of every layer (longer layers only), or of
        the layers in ``layers``."""
        for i, lay in enumerate(self.cache.layers):
            if layers is not None and i not in layers:
                continue
            have = int(lay.get_seq_length())
            if have > n:
                lay.crop(n - have)

    def keep(self, n: int, extra: list[int], layers: Container[int] | None = None
             ) -> None:
        """Keep the first ``n`` cached tokens of every layer (or of the layers in
        ``layers``) plus the entries at cache indexes ``extra`` (in that order): the
        accepted branch of a token tree."""
        idx = torch.tensor(list(range(n)) + list(extra), dtype=torch.long)
        for i, lay in enumerate(self.cache.layers):
            if layers is not None and i not in layers:
                continue
            if lay.get_seq_length() > n:
                lay.keys = lay.keys.index_select(-2, idx)
                lay.values = lay.values.index_select(-2, idx)

    def reset(self) -> None:
        """Empty the KV cache."""
        self.cache = DynamicCache(config=self.config)
