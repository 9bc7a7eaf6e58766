"""``specrelay_onnx.json``: what an export folder holds (geometry, dtypes, I/O names,
exporter versions, checks), read by :class:`edge_sdk.drafters.onnx.OnnxRunner`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from edge_sdk.drafters.onnx import MANIFEST_NAME, MODEL_NAME
from exporters.onnx.graph import io_names, kv_geometry


def _versions() -> dict:
    import onnx
    import onnxruntime
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def max_positions(config) -> int | None:
    """The positions a model's rotary embedding covers (``max_position_embeddings``),
    or None when its config does not say."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def manifest_for(model, *, dtype: str, kv_dtype: str, opset: int, source: str | None,
                 external: bool, attention: str) -> dict:
    """The manifest of ``model`` exported with weights in ``dtype`` (``float32``,
    ``float16``, ``int4``, ``int8``) and KV cache / logits in ``kv_dtype``; ``external``:
    the weights are in ``model.onnx.data``; ``source``: the model spec, free text;
    ``attention``: how the attention was traced (``gqa``:
    :func:`~exporters.onnx.attention.gqa_attention`; ``model``: the model's own)."""
    ins, outs = io_names(kv_geometry(model.config)["num_layers"])
    return {
        "format": "specrelay-onnx", "version": 1, "model_file": MODEL_NAME,
        "external_data": (MODEL_NAME + ".data") if external else None,
        "source": source, "architecture": (model.config.architectures or [None])[0]
        or type(model).__name__, "model_type": model.config.model_type,
        **kv_geometry(model.config), "max_positions": max_positions(model.config),
        "dtype": dtype, "kv_dtype": kv_dtype, "opset": opset,
        "attention": attention,
        "inputs": ins, "outputs": outs,
        "dynamic_axes": {"batch_size": "dim 0 of every input/output",
                         "sequence_length": "new tokens per call",
                         "past_sequence_length": "cached tokens (0 allowed)",
                         "logits_length": "positions in logits_to_keep (rows of logits)"},
        "exporter": {"method": "torch.onnx.export(dynamo=True)", **_versions()},
    }


def write_manifest(folder: str | os.PathLike, manifest: dict) -> Path:
    """Write ``specrelay_onnx.json`` into ``folder``."""
    p = Path(folder) / MANIFEST_NAME
    p.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return p


