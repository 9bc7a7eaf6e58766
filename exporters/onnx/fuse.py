"""RMSNorm and rotary-embedding fusion of an onnxruntime-only graph.

A traced RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", §3:
``y = x / sqrt(mean(x^2) + eps) * g``) is seven ONNX nodes per norm::

    Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) -> Mul(g)

and the residual ``Add`` before it an eighth. On Qwen2.5-0.5B that is 49 norms and
~340 nodes a decode step runs one after another on one core, each with its own kernel
launch and intermediate tensor. :func:`fuse_norms` rewrites them with onnxruntime's own
fusions (``onnxruntime.transformers``) into ``SimplifiedLayerNormalization`` and, where
a residual ``Add`` feeds the norm, ``SkipSimplifiedLayerNormalization`` (com.microsoft;
its second output is the residual sum the next block reads). The maths is the same; the
float rounding differs slightly (a draft's logits never decide the output: the target
verifies every token).

:func:`fuse_rotary` does the same for the rotary embeddings (2 x 7 nodes a layer) with
onnxruntime's ``RotaryEmbedding``.

Only for graphs that run on onnxruntime anyway: the quantised variants (``MatMulNBits``
is itself a com.microsoft op). The float32 / float16 graphs, which TensorRT also
parses, stay as traced.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

#: Positions past ``max_position_embeddings`` the rotary caches also cover. The traced
#: rope computes any position, and a draft may feed a few past the context's end before
#: the cloud refuses the block (422 ``context_full``): a proactive branch drafts up to a
#: block beyond the one in flight (``MAX_DRAFT_TOKENS`` 16 each). With this margin the
#: fused graph computes every position the traced one was asked for, so the cloud's
#: refusal still comes first.
ROTARY_MARGIN = 1024

#: The fused ops, as counted in :func:`fuse_norms`'s result.
FUSED_OPS = {"SimplifiedLayerNormalization": "rms_norms",
             "SkipSimplifiedLayerNormalization": "skip_rms_norms"}


def fuse_norms(model) -> dict:
    """Fuse every traced RMSNorm of ModelProto ``model`` in place.

    Args:
        model: an ``onnx.ModelProto`` (a traced decoder; weights may be MatMulNBits).
    Returns:
        ``{"rms_norms": n, "skip_rms_norms": m}``: the fused nodes now in the graph
        (a decoder of L layers: 1 and 2L, the first norm having no residual before it).
        A graph without the pattern is left as it was (both 0).

    The graph's inputs and outputs are kept as they are, used or not (the runner feeds
    every input it was exported with).
    """
    from onnxruntime.transformers.fusion_simplified_layernorm import (
        FusionSimplifiedLayerNormalization, FusionSkipSimplifiedLayerNormalization)
    from onnxruntime.transformers.onnx_model import OnnxModel

    with _quiet():
        om = OnnxModel(model)
        FusionSimplifiedLayerNormalization(om).apply()
        FusionSkipSimplifiedLayerNormalization(om).apply()
    _prune(model)
    ops = Counter(n.op_type for n in model.graph.node)
    return {key: ops[op] for op, key in FUSED_OPS.items()}


def _const(name: str, inits: dict, prod: dict):
    """The value of ``name`` when it is an initializer or a Constant node's output,
    else None."""
    from onnx import helper, numpy_helper

    if name in inits:
        return numpy_helper.to_array(inits[name])
    n = prod.get(name)
    if n is not None and n.op_type == "Constant":
        return numpy_helper.to_array(helper.get_attribute_value(n.attribute[0]))
    return None


def _ints(name: str, inits: dict, prod: dict) -> list[int] | None:
    v = _const(name, inits, prod)
    return None if v is None else [int(x) for x in v.reshape(-1)]


def _half_slice(node, x: str, first: bool, half: int, inits, prod) -> bool:
    """``node`` is ``Slice(x)`` on the last axis of a 4-D tensor: ``[0, half)`` when
    ``first``, else ``[half, end)``, step 1."""
    if node is None or node.op_type != "Slice" or node.input[0] != x or len(node.input) < 4:
        return False
    starts, ends = _ints(node.input[1], inits, prod), _ints(node.input[2], inits, prod)
    axes = _ints(node.input[3], inits, prod)
    steps = _ints(node.input[4], inits, prod) if len(node.input) > 4 else [1]
    if None in (starts, ends, axes, steps) or axes[0] not in (3, -1) or steps != [1]:
        return False
    return (starts, ends) == ([0], [half]) if first else (starts == [half] and ends[0] >= 2 * half)


def _cos_sin_angles(unsq, want: str, inits, prod):
    """``Unsqueeze(Cos|Sin(e), axes=[1])`` (``want`` = ``Cos`` or ``Sin``) -> the angle
    tensor name ``e``, else None."""
    if unsq is None or unsq.op_type != "Unsqueeze" or _ints(unsq.input[1], inits, prod) != [1]:
        return None
    trig = prod.get(unsq.input[0])
    return trig.input[0] if trig is not None and trig.op_type == want else None


def _inv_freq(angles: str, inits, prod, graph_inputs: set):
    """``e = Concat(f, f)``, ``f = Mul(Cast(Unsqueeze(position_ids, -1)), inv_freq)``
    (transformers' rotary embedding of the graph input ``position_ids``, attention
    scaling 1) -> inv_freq float32 [D/2], else None."""
    import numpy as np

    cat = prod.get(angles)
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or (
            cat.input[0] != cat.input[1]):
        return None
    mul = prod.get(cat.input[0])
    if mul is None or mul.op_type != "Mul":
        return None
    for pos, inv in (mul.input, mul.input[::-1]):
        freq = _const(inv, inits, prod)
        cast = prod.get(pos)
        unsq = prod.get(cast.input[0]) if cast is not None and cast.op_type == "Cast" else None
        if (freq is not None and unsq is not None and unsq.op_type == "Unsqueeze"
                and unsq.input[0] == "position_ids" and "position_ids" in graph_inputs
                and _ints(unsq.input[1], inits, prod) in ([-1], [2])):
            return np.asarray(freq, dtype=np.float32).reshape(-1)
    return None


def _match_rotary(add, inits, prod, graph_inputs):
    """``add`` = ``x * cos + rotate_half(x) * sin`` (Su et al. 2021, "RoFormer", §3.4;
    transformers' ``apply_rotary_pos_emb`` on x [B, H, S, D]) -> (x, inv_freq), else
    None."""
    if add.op_type != "Add" or len(add.input) != 2:
        return None
    muls = [prod.get(i) for i in add.input]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None
    for m_cos, m_sin in (muls, muls[::-1]):
        for x, cu in (m_cos.input, m_cos.input[::-1]):
            e = _cos_sin_angles(prod.get(cu), "Cos", inits, prod)
            if e is None:
                continue
            for rot, su in (m_sin.input, m_sin.input[::-1]):
                cat = prod.get(rot)
                if (_cos_sin_angles(prod.get(su), "Sin", inits, prod) != e or cat is None
                        or cat.op_type != "Concat" or len(cat.input) != 2):
                    continue
                inv = _inv_freq(e, inits, prod, graph_inputs)
                if inv is None:
                    continue
                half = len(inv)
                neg, second = prod.get(cat.input[0]), prod.get(cat.input[1])
                if (neg is not None and neg.op_type == "Neg"
                        and _half_slice(prod.get(neg.input[0]), x, False, half, inits, prod)
                        and _half_slice(second, x, True, half, inits, prod)):
                    return x, inv
    return None


def fuse_rotary(model, max_positions: int) -> int:
    """Replace every traced rotary embedding of ModelProto ``model`` (in place) by
    onnxruntime's ``RotaryEmbedding`` (com.microsoft, non-interleaved, on the 4-D
    [B, H, S, D] query / key) fed by the graph input ``position_ids`` and cos / sin
    caches [max_positions, D/2] float32 computed here from the graph's ``inv_freq``
    exactly as the traced graph computes its angles (``float32(position) *
    inv_freq``). Per layer that is 2 x 7 nodes (Slice, Slice, Neg, Concat, Mul, Mul,
    Add) fewer.

    Args:
        model: an ``onnx.ModelProto`` traced from a transformers decoder with the
            default rope (attention scaling 1; Llama, Qwen2).
        max_positions: positions the caches cover (the model's
            ``max_position_embeddings`` plus :data:`ROTARY_MARGIN`, as
            :func:`~exporters.onnx.quantize.quantize_weights` passes it); onnxruntime
            fails a call with a larger position id, which
            :class:`~edge_sdk.drafters.onnx.OnnxRunner` refuses before the call
            (``OnnxRunner.max_positions``, from the manifest).
    Returns:
        the number of rotary embeddings fused (2 per layer on a decoder; 0 leaves the
        graph as it was).
    Raises:
        ValueError: ``max_positions`` < 1.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, not {max_positions}")
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    inputs = {i.name for i in g.input}
    found = [(i, m) for i, add in enumerate(g.node)
             if (m := _match_rotary(add, inits, prod, inputs))]
    if not found:
        return 0
    caches: dict[bytes, tuple[str, str]] = {}
    for i, (x, inv) in found:
        add = g.node[i]
        key = inv.tobytes()
        if key not in caches:
            angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv[None, :]
            names = (f"specrelay_rope_cos_{len(caches)}", f"specrelay_rope_sin_{len(caches)}")
            g.initializer.extend([numpy_helper.from_array(np.cos(angles), names[0]),
                                  numpy_helper.from_array(np.sin(angles), names[1])])
            caches[key] = names
        cos, sin = caches[key]
        node = helper.make_node("RotaryEmbedding", [x, "position_ids", cos, sin],
                                [add.output[0]], name=f"{add.name}_rope",
                                domain="com.microsoft", interleaved=0)
        g.node[i].CopyFrom(node)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _prune(model)
    return len(found)


def _prune(model) -> None:
    """Drop the nodes no graph output depends on (inputs kept)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    with _quiet():
        OnnxModel(model).prune_graph(allow_remove_graph_inputs=False)


@contextlib.contextmanager
def _quiet():
    """onnxruntime's fusion loggers (an INFO line per fusion and prune) at WARNING
    inside the block; their levels are put back on exit."""
    logs = [logging.getLogger(n) for n in ("onnxruntime.transformers", "fusion_base",
                                           "onnx_model")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
