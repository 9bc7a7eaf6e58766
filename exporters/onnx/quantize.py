"""Weight-only quantisation of an ONNX export: every constant-weight MatMul becomes an
onnxruntime ``MatMulNBits`` (4 or 8 bits, round-to-nearest per block of weights, one
scale per block; GPTQ-free RTN as in onnxruntime's MatMulNBits quantiser). Activations,
KV cache and logits stay float32."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from exporters.onnx import fuse
from exporters.onnx.graph import EXTERNAL_DATA_BYTES, quiet


def _materialize_transposed_weights(m) -> int:
    """Replace ``MatMul(x, Transpose(W))`` with ``MatMul(x, W_T)`` for initializers ``W``
    (a tied LM head reads the embedding that way) so the quantizer sees a constant
    weight. Returns how many MatMuls were rewired."""
    from onnx import numpy_helper

    inits = {i.name: i for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    done = 0
    for node in m.graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        tr = producer.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        perm = [list(a.ints) for a in tr.attribute if a.name == "perm"]
        w = numpy_helper.to_array(inits[tr.input[0]])
        if w.ndim != 2 or (perm and perm[0] != [1, 0]):
            continue
        name = tr.input[0] + ".T"
        if name not in inits:
            t = numpy_helper.from_array(np.ascontiguousarray(w.T), name)
            m.graph.initializer.append(t)
            inits[name] = t
        node.input[1] = name
        done += 1
    return done


def _import_quantizer() -> None:
    """Import onnxruntime's MatMulNBits quantiser without its side effect on the
    process: the module calls ``logging.basicConfig(level=INFO)`` on import, which
    gave the root logger a stderr handler at INFO, so every access log of a server in
    the same process (the demo's first run, which exports the draft) went to the
    terminal. The root logger's handlers and level are put back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer  # noqa: F401
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _lm_head_matmul(m) -> str | None:
    """Name of the MatMul that produces the ``logits`` output from a constant weight
    (None when the head is not such a MatMul, e.g. a masked draft head)."""
    inits = {i.name for i in m.graph.initializer}
    for node in m.graph.node:
        if "logits" in node.output and node.op_type == "MatMul" and node.input[1] in inits:
            return node.name
    return None


def _nbits(m, *, bits: int, block_size: int, symmetric: bool, accuracy_level: int,
           exclude: list[str]):
    """One MatMulNBits pass over ModelProto ``m`` (the ``exclude`` nodes kept); returns
    the quantised ModelProto."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(m, bits=bits, block_size=block_size, is_symmetric=symmetric,
                             accuracy_level=accuracy_level, nodes_to_exclude=exclude)
    with quiet(False):
        q.process()
    return q.model.model


def _save(out, dst: str | os.PathLike) -> None:
    """Write ModelProto ``out`` to ``dst`` (external data beside it above 1 GiB)."""
    import onnx

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    big = out.ByteSize() > EXTERNAL_DATA_BYTES
    onnx.save_model(out, str(dst), save_as_external_data=big,
                    location=dst.name + ".data" if big else None)


def _counts(out) -> dict:
    """How many MatMuls the quantised ModelProto ``out`` converted (``int8_matmuls`` of
    them at 8 bits) and how many float MatMuls are left."""
    nodes = list(out.graph.node)
    nbits = [next((a.i for a in n.attribute if a.name == "bits"), 4) for n in nodes
             if n.op_type == "MatMulNBits"]
    return {"quantized_matmuls": len(nbits), "int8_matmuls": nbits.count(8),
            "float_matmuls_left": sum(n.op_type == "MatMul" for n in nodes)}


def quantize_weights(src: str | os.PathLike, dst: str | os.PathLike, *, bits: int = 4,
                     block_size: int = 32, symmetric: bool = True, accuracy_level: int = 4,
                     lm_head: bool = True, lm_head_bits: int | None = None,
                     lm_head_block_size: int | None = None,
                     head_ids: Sequence[int] | None = None,
                     fuse_norms: bool = False, fuse_rotary: bool = False,
                     max_positions: int | None = None) -> dict:
    """Weight-only quantisation of every constant-weight MatMul to ``bits`` (4 or 8;
    onnxruntime ``MatMulNBits``, round-to-nearest per block). Activations, KV cache and
    logits stay float32; the embedding Gather keeps float32.

    Args:
        src / dst: ``.onnx`` files. bits: 4 or 8.
        block_size: weights per scale (power of 2, >= 16). On Qwen2.5-Coder-0.5B (one
            core, int8 activations, head at 128) the decoder layers at 64 decode 1.11-1.17x
            as fast as at 32 with the same agreement with the target; at 128 they lose
            agreement (acc@8 on MT-Bench 4.01 -> 3.65; ``python -m
            bench.probes.draft_quant``).
        symmetric: symmetric blocks (no zero points); False stores a zero point per
            block.
        accuracy_level: MatMulNBits compute type on CPU (4 = int8 activations, fastest;
            0/1 = float32).
        lm_head: also quantise the LM head (a tied head reads the embedding through a
            Transpose; a transposed copy is quantised).
        lm_head_bits: bits for the LM head (4 or 8; None = ``bits``). The head decides
            the argmax directly; 8 bits cost more memory traffic per token.
        lm_head_block_size: weights per scale in the LM head (None = ``block_size``).
            On Qwen2.5-Coder-0.5B (one core, int8 activations) a head at 128 with the
            decoder layers at 32 decodes 1.11x as fast as 32 throughout and agrees
            with the target as often (``python -m bench.probes.draft_quant``). The head
            holds a quarter of the weights; that the kernel spends part of its time per
            block (a scale, an int8 block of activations) is our reading of the
            timings, not of its source.
        head_ids: keep only these rows of the LM head (token ids, sorted, unique; FR-Spec,
            :mod:`exporters.onnx.head_vocab`): the graph's ``logits`` then has
            ``len(head_ids)`` columns, logit column j being token ``head_ids[j]``; the
            caller records the ids beside the graph (``OnnxRunner.head_ids``). None:
            the whole head.
        fuse_norms: also fuse the RMSNorms (:func:`exporters.onnx.fuse.fuse_norms`).
        fuse_rotary: also fuse the rotary embeddings
            (:func:`exporters.onnx.fuse.fuse_rotary`, caches of ``max_positions`` +
            :data:`~exporters.onnx.fuse.ROTARY_MARGIN` positions); skipped when
            ``max_positions`` is None. Both together: on
            Qwen2.5-Coder-0.5B int4, one core, a decode step 1.05-1.11x as fast with the
            same agreement with the target (``python -m bench.probes.draft_quant``).
        max_positions: the model's ``max_position_embeddings``.
    Returns:
        the quantisation settings and how many MatMuls were converted
        (``quantized_matmuls``; ``int8_matmuls`` of them at 8 bits); ``head_rows``
        with ``head_ids``; ``fused`` (the fused norms and rotary embeddings) with
        ``fuse_norms`` / ``fuse_rotary``.
    Raises:
        ValueError: bad bits or block sizes; ``head_ids`` for a graph whose head is not
            a MatMul on a constant weight, or ids outside it.
    """
    import onnx
    _import_quantizer()

    lm_head_bits = bits if lm_head_bits is None else lm_head_bits
    head_block = block_size if lm_head_block_size is None else int(lm_head_block_size)
    if bits not in (4, 8) or lm_head_bits not in (4, 8):
        raise ValueError(f"bits / lm_head_bits must be 4 or 8, not {bits} / {lm_head_bits}")
    for name, b in (("block_size", block_size), ("lm_head_block_size", head_block)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of 2 >= 16, not {b}")
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
        logging.WARNING)
    m = onnx.load(str(src))
    if lm_head:
        _materialize_transposed_weights(m)
    head = _lm_head_matmul(m)
    if head_ids is not None:
        _slice_head(m, head, head_ids)
    own_head = lm_head and (lm_head_bits != bits or head_block != block_size)
    exclude = [head] if head and (not lm_head or own_head) else []
    opts = {"symmetric": symmetric, "accuracy_level": accuracy_level}
    out = _nbits(m, bits=bits, block_size=block_size, exclude=exclude, **opts)
    if head and own_head:
        others = [n.name for n in out.graph.node if n.op_type == "MatMul" and n.name != head]
        out = _nbits(out, bits=lm_head_bits, block_size=head_block, exclude=others, **opts)
    fused = fuse.fuse_norms(out) if fuse_norms else None
    if fuse_rotary and max_positions:
        n = int(max_positions) + fuse.ROTARY_MARGIN
        fused = dict(fused or {}, rotary=fuse.fuse_rotary(out, n), rotary_positions=n)
    _save(out, dst)
    with_head = bool(lm_head and head)
    return {"method": "MatMulNBits", "bits": bits, "block_size": block_size, **opts,
            "lm_head": lm_head, "lm_head_bits": lm_head_bits if with_head else None,
            "lm_head_block_size": head_block if with_head else None, **_counts(out),
            **({"head_rows": len(head_ids)} if head_ids is not None else {}),
            **({"fused": fused} if fused is not None else {})}


def _slice_head(m, head: str | None, ids: Sequence[int]) -> None:
    """Keep the LM head MatMul's weight columns ``ids`` [K] (ModelProto ``m``, in place;
    the weight [hidden, V] becomes a new initializer [hidden, K]) and declare the
    ``logits`` output with K columns. Raises ValueError (see :func:`quantize_weights`)."""
    from onnx import numpy_helper

    if head is None:
        raise ValueError("head_ids needs an LM head that is a MatMul on a constant weight")
    node = next(n for n in m.graph.node if n.name == head)
    w = numpy_helper.to_array(next(i for i in m.graph.initializer
                                   if i.name == node.input[1]))
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= w.shape[1] or (
            np.diff(ids) <= 0).any():
        raise ValueError(f"head_ids must be sorted unique ids in 0..{w.shape[1] - 1}")
    old, name = node.input[1], node.input[1] + ".rows"
    m.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w[:, ids]),
                                                       name))
    node.input[1] = name
    if not any(old in n.input for n in m.graph.node):     # a tied head's transposed copy
        kept = [i for i in m.graph.initializer if i.name != old]
        del m.graph.initializer[:]
        m.graph.initializer.extend(kept)
    for o in m.graph.output:
        if o.name == "logits":
            o.type.tensor_type.shape.dim[-1].dim_value = len(ids)


def quantize_int4(src: str | os.PathLike, dst: str | os.PathLike, *, block_size: int = 32,
                  symmetric: bool = True, accuracy_level: int = 4, lm_head: bool = True,
                  lm_head_bits: int = 4, lm_head_block_size: int | None = None,
                  head_ids: Sequence[int] | None = None, fuse_norms: bool = False,
                  fuse_rotary: bool = False, max_positions: int | None = None) -> dict:
    """:func:`quantize_weights` at 4 bits (``lm_head_bits=8`` keeps the head at 8)."""
    return quantize_weights(src, dst, bits=4, block_size=block_size, symmetric=symmetric,
                            accuracy_level=accuracy_level, lm_head=lm_head,
                            lm_head_bits=lm_head_bits,
                            lm_head_block_size=lm_head_block_size, head_ids=head_ids,
                            fuse_norms=fuse_norms, fuse_rotary=fuse_rotary,
                            max_positions=max_positions)


def quantize_int8(src: str | os.PathLike, dst: str | os.PathLike, *, block_size: int = 32,
                  symmetric: bool = True, accuracy_level: int = 4,
                  lm_head: bool = True, fuse_norms: bool = False,
                  fuse_rotary: bool = False, max_positions: int | None = None) -> dict:
    """:func:`quantize_weights` at 8 bits (MatMulNBits, int8 weights per block)."""
    return quantize_weights(src, dst, bits=8, block_size=block_size, symmetric=symmetric,
                            accuracy_level=accuracy_level, lm_head=lm_head,
                            fuse_norms=fuse_norms, fuse_rotary=fuse_rotary,
                            max_positions=max_positions)


