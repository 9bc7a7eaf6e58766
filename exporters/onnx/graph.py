"""Trace a HF causal LM to an ONNX graph with KV-cache inputs and outputs.

The graph's names and shapes are listed in :mod:`exporters.onnx`. Tracing uses
``torch.onnx.export(..., dynamo=True)`` on a flat-tensor wrapper (:class:`_KVWrapper`)
around a ``DynamicCache``; the dynamic axes then get optimum's names.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

import torch

from edge_sdk.drafters.onnx import KEEP_INPUT, past_name, present_name
from exporters.onnx.attention import DEFAULT_ATTENTION, check_attention, traced_attention

DEFAULT_OPSET = 18
#: Models whose weights exceed this many bytes are written with external data.
EXTERNAL_DATA_BYTES = 1 << 30


def kv_geometry(config) -> dict:
    """KV-cache geometry of a HF config: num_layers, num_kv_heads, head_dim, vocab_size,
    hidden_size."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"num_layers": int(config.num_hidden_layers), "num_kv_heads": kv,
            "head_dim": int(head_dim), "vocab_size": int(config.vocab_size),
            "hidden_size": int(config.hidden_size)}


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph ``(input names, output names)``: optimum's order, then ``logits_to_keep``."""
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [past_name(i, "key"), past_name(i, "value")]
        outs += [present_name(i, "key"), present_name(i, "value")]
    return ins + [KEEP_INPUT], outs


class _KVWrapper(torch.nn.Module):
    """Flat-tensor façade over a HF causal LM: past tensors in, logits + present out.

    ``logits_to_keep`` (int64 [n], optional): the positions, among this call's
    ``sequence_length`` new tokens, whose logits are computed (transformers' tensor form
    of ``logits_to_keep``); None computes all. A prompt's prefill needs only the last
    row: the LM head's rows for the others are ~23 % of a prompt's prefill of the int4
    Qwen2.5-0.5B (151,936 x 896 head; ``python -m bench.probes.draft_prefill``) and, at
    250 tokens, 152 MB of float32 logits nobody reads.
    """

    def __init__(self, model, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, past, logits_to_keep=None):
        from transformers import DynamicCache

        # Full-length layers for every layer, sliding-window ones included (no config):
        # present = past + new everywhere, so a rollback stays a slice, and the window
        # is applied by the sliding-window mask transformers builds from the config.
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True, **keep)
        present = []
        for i in range(self.num_layers):
            present += [cache.layers[i].keys, cache.layers[i].values]
        return (out.logits, *present)


def _param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def quiet(verbose: bool):
    """Silence the exporter's and quantiser's progress prints and warnings unless
    verbose."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
        warnings.simplefilter("ignore")
        prev = [logging.getLogger(n).level for n in ("torch", "torch.onnx", "onnxscript")]
        for n in ("torch", "torch.onnx", "onnxscript"):
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, lv in zip(("torch", "torch.onnx", "onnxscript"), prev):
                logging.getLogger(n).setLevel(lv)


def _rename_dims(path: Path, num_layers: int) -> None:
    """Give every dynamic axis optimum's name (the mask's total length included)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    total = "past_sequence_length + sequence_length"
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.name == "attention_mask":
            dims[1].dim_param = total
        elif vi.name.startswith("present.") and dims[2].dim_param:
            dims[2].dim_param = total
        elif vi.name == KEEP_INPUT:
            dims[0].dim_param = "logits_length"
        elif vi.name == "logits" and dims[1].dim_param:
            dims[1].dim_param = "logits_length"
    onnx.save(m, str(path))


def export_graph(model, path: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                 external_data: bool | None = None, verbose: bool = False,
                 logits_to_keep: bool = True, attention: str = DEFAULT_ATTENTION) -> Path:
    """Trace ``model`` (a HF causal LM in eval mode, any float dtype) to an ONNX file with
    KV-cache inputs/outputs (see the module docstring for names and shapes).

    Args:
        path: the ``.onnx`` file to write (its folder is created).
        opset: ONNX opset (>= 18).
        external_data: store weights in ``<file>.data``; None decides by size (> 1 GiB).
        logits_to_keep: give the graph the ``logits_to_keep`` input (False: logits for
            every new token, as exports before 2026-12-05 had).
        attention: ``gqa`` traces the attention with
            :func:`~exporters.onnx.attention.gqa_attention` (K and V never repeated over
            the query heads); ``model``: the model's own attention, as exports before
            cache format 3 had.
    Returns:
        the written path.
    Raises:
        ValueError: an unknown ``attention`` (before anything is written).
    """
    check_attention(attention)
    geo = kv_geometry(model.config)
    n, h, d = geo["num_layers"], geo["num_kv_heads"], geo["head_dim"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = _param_bytes(model) > EXTERNAL_DATA_BYTES
    dtype = next(model.parameters()).dtype
    # Example sizes: distinct and > 1 so that torch.export keeps every axis symbolic.
    b, s, p = 2, 5, 7
    ids = torch.randint(0, geo["vocab_size"], (b, s))
    mask = torch.ones(b, p + s, dtype=torch.long)
    pos = torch.arange(p, p + s).expand(b, s).contiguous()
    past = tuple(torch.randn(b, h, p, d, dtype=dtype) for _ in range(2 * n))
    keep = torch.tensor([1, 2, 4])
    Dim = torch.export.Dim
    batch, seq = Dim("batch_size"), Dim("sequence_length")
    past_len = Dim("past_sequence_length", min=0)
    shapes = ({0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC}, {0: batch, 1: seq},
              tuple({0: batch, 2: past_len} for _ in range(2 * n)), {0: Dim("logits_length")})
    ins, outs = io_names(n)
    args = (ids, mask, pos, past, keep)
    if not logits_to_keep:
        args, shapes, ins = args[:-1], shapes[:-1], ins[:-1]
    wrapper = _KVWrapper(model, n).eval()
    with (quiet(verbose), traced_attention(model, attention), torch.inference_mode(False),
          torch.no_grad()):
        torch.onnx.export(wrapper, args, str(path), input_names=ins,
                          output_names=outs, dynamic_shapes=shapes, dynamo=True,
                          opset_version=opset, external_data=external_data,
                          verbose=verbose)
    _rename_dims(path, n)
    return path


