"""Linear layers with weights prepacked for oneDNN, for CPU inference.

``torch.nn.functional.linear`` on a plain bfloat16 weight lets oneDNN reorder the weight
into its blocked (AMX / AVX-512-BF16) layout on every call; a decode or verify pass of a
memory-bound model then reads every weight twice. Packing each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's Inductor uses when it
freezes a CPU graph) and calling ``torch.ops.mkldnn._linear_pointwise`` on the packed
tensor removes that: measured on this project's 2-core AMX Xeon, one thread,
Qwen2.5-Coder-1.5B bf16 after a 200-token context, a 1-token pass 322 -> 110 ms and a
7-token verify pass 296 -> 166 ms (``python -m bench.probes.pass_cost``), with logits
bit-identical to the unpacked model (the same oneDNN kernels, minus the reorder).

Serving loads also pack float32 weights (:data:`SERVING_DTYPES`), for the row-invariant
verifier (:mod:`edge_sdk.invariant`): on a CPU without AVX-512 (a 2-core AMD EPYC with
AVX2 only) MKL's float32 ``F.linear`` keeps each row's result the same only for inputs
of up to 3 rows, so a 9-token verify pass ran as three weight streams and a 64-token one
as 22; oneDNN's packed float32 kernel keeps rows alike up to 64, and its one-row input
agrees with its two-row one, so a one-token pass runs one row
(:func:`edge_sdk.invariant.one_row_agrees`). Qwen2.5-Coder-1.5B float32
after a 200-token context, one thread, row-invariant: a 1-token pass 734 -> 444 ms, 9
tokens 2,937 -> 739 ms, 64 tokens 18.9 -> 3.0 s; without row invariance 398 -> 393,
1,213 -> 758 and 3,210 -> 3,116 ms (``SPECRELAY_PACKED=0|1 python -m
bench.probes.pass_cost qwen2.5-coder-1.5b float32 1,9,64 1 1``, last argument 0:
without). float16, or a build without oneDNN, is left as it is. :func:`pack_linears`
checks one input per layer against ``F.linear``
and keeps a layer unpacked where they differ, unless ``require_equal=False`` -- what
the serving load (:func:`edge_sdk.models.load_model` with ``packed=True``) asks for:
there the target alone and every verify pass run the same packed model, and its
row-invariant passes (:mod:`edge_sdk.invariant`) need the packed kernel's row limit.

Packing is for serving only: a packed module has no autograd and its packed weight is
an opaque oneDNN tensor (no ``state_dict`` entry, not traceable by the ONNX exporter).
The dense weight is dropped except for the output embedding (kept as ``.weight``:
exit-head fingerprints and subset heads read it). Tied to the input embedding it costs
nothing; untied (the Qwen2.5-Coder GGUFs carry their own output matrix) it stays in the
checkpoint's file map, resident only while read (:mod:`edge_sdk.mapped_pages`).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["PackedLinear", "pack_linears", "packing_supported", "packed_default",
           "try_pack", "SERVING_DTYPES"]

log = logging.getLogger(__name__)

SERVING_DTYPES = (torch.bfloat16, torch.float32)
"""Weight dtypes a serving load (``load_model(packed=True)``) packs."""


def packed_default() -> bool:
    """Whether serving loads (the cloud's target, the bench's cloud process, a torch
    draft) pack their linears: ``$SPECRELAY_PACKED`` (``0`` turns it off), default on.

    Raises:
        ValueError: ``$SPECRELAY_PACKED`` is neither 0 nor 1.
    """
    v = os.environ.get("SPECRELAY_PACKED", "1")
    if v not in ("0", "1"):
        raise ValueError(f"SPECRELAY_PACKED={v!r}: expected 0 or 1")
    return v == "1"


def packing_supported(dtype: torch.dtype | None = None) -> bool:
    """True when this torch build has oneDNN and its linear packing ops, and (``dtype``
    bfloat16) oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, so a CPU with AVX2 only packs float32 alone."""
    ok = bool(torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
              and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if ok and dtype == torch.bfloat16:
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        ok = bool(probe()) if probe is not None else True
    return ok


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` [out, in] prepacked for oneDNN.

    Args:
        linear: the ``nn.Linear`` to replace (CPU, bfloat16 or float32).
        keep_dense: keep the dense weight as ``.weight`` (the output embedding).
    Input [..., in] -> output [..., out], the input's dtype.
    """

    def __init__(self, linear: torch.nn.Linear, keep_dense: bool = False):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the batch-size hint picks oneDNN's kernel: 1 for bf16 (decode-shaped), none for
        # float32, whose 1-row kernel costs twice as much at 2 rows (every verify pass
        # has 2 or more)
        hint = 1 if w.dtype == torch.bfloat16 else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        self.weight_dtype = w.dtype
        self.bias = None if linear.bias is None else linear.bias
        self.weight = linear.weight if keep_dense else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=oneDNN")


@torch.inference_mode()
def _agrees(linear: torch.nn.Linear, packed: PackedLinear) -> bool:
    """One random input [1, 3, in] through both; bit-equality."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, linear.in_features, generator=g).to(linear.weight.dtype)
    return torch.equal(torch.nn.functional.linear(x, linear.weight, linear.bias), packed(x))


def try_pack(linear: torch.nn.Linear, keep_dense: bool = False,
             require_equal: bool = True,
             dtypes: tuple = (torch.bfloat16,)) -> PackedLinear | None:
    """``linear`` packed, or None where it stays as it is: not a CPU weight of one of
    ``dtypes``, a build without oneDNN packing, a shape oneDNN refuses, or
    (``require_equal``) a packed output that is not bit-identical to ``F.linear`` on a
    probe input (float32: oneDNN and MKL round differently, so only with
    ``require_equal=False``)."""
    w = linear.weight
    if (w.device.type != "cpu" or w.dtype not in dtypes
            or not packing_supported(w.dtype)):
        return None
    try:
        new = PackedLinear(linear, keep_dense=keep_dense)
        return new if not require_equal or _agrees(linear, new) else None
    except RuntimeError as e:                   # oneDNN refused the shape or dtype
        log.debug("not packing a [%d, %d] linear: %s", *w.shape, e)
        return None


def pack_linears(model: torch.nn.Module, require_equal: bool = True,
                 dtypes: tuple = (torch.bfloat16,)) -> int:
    """Replace the model's CPU ``nn.Linear`` layers whose weights are of ``dtypes``
    (default bfloat16) by :class:`PackedLinear`, in place (:func:`try_pack` per
    layer). ``require_equal=False`` packs every layer
    oneDNN accepts, also those whose packed kernel rounds differently from ``F.linear``
    (18 of Qwen2.5-Coder-1.5B's 28 down-projections): what a serving engine wants, whose
    target alone and verify passes all run the packed model, and whose row-invariant
    passes (:mod:`edge_sdk.invariant`) need every layer on oneDNN's packed kernel
    (plain ``F.linear`` on those down-projections keeps its rows only up to 4-row
    inputs, the packed one up to 27). Returns the number replaced (0: unsupported build
    or dtype)."""
    if not packing_supported():
        return 0
    out_emb = (model.get_output_embeddings() if hasattr(model, "get_output_embeddings")
               else None)
    # names first, modules fetched one at a time: a replaced dense weight is dropped
    # before the next one is packed. In anonymous memory that frees it (the transient
    # peak is one linear); a view of a checkpoint's file map stays resident until
    # load_model gives the map's pages back after the loop (edge_sdk.mapped_pages), so
    # there the peak is the whole checkpoint plus the packed weights
    sites = [(pn, cn) for pn, parent in model.named_modules()
             for cn, child in parent.named_children() if type(child) is torch.nn.Linear]
    n = skipped = 0
    for pn, cn in sites:
        parent = model.get_submodule(pn)
        child = getattr(parent, cn)
        new = try_pack(child, keep_dense=child is out_emb, require_equal=require_equal,
                       dtypes=dtypes)
        if new is None:
            skipped += child.weight.dtype in dtypes
            continue
        setattr(parent, cn, new)
        del child, new
        n += 1
    if skipped:
        log.info("packed %d linear layers; %d left unpacked", n, skipped)
    return n
