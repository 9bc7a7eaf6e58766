"""Export a model to an ONNX folder with optional fp16 / int4 / int8 variants, each
checked (``specrelay export onnx``). Layout::

    OUT/model.onnx  [model.onnx.data]  specrelay_onnx.json      # float32
    OUT/fp16/model.onnx  specrelay_onnx.json                     # --fp16
    OUT/int4/model.onnx  specrelay_onnx.json                     # --int4 (MatMulNBits)
    OUT/int8/model.onnx  specrelay_onnx.json                     # --int8 (MatMulNBits, 8 bits)

Every folder loads with ``OnnxDrafter(folder)``.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from edge_sdk.drafters.onnx import MODEL_NAME
from edge_sdk.drafters.runtime import ONNX_VARIANTS
from exporters.onnx import head_vocab
from exporters.onnx.attention import DEFAULT_ATTENTION, check_attention
from exporters.onnx.graph import DEFAULT_OPSET, export_graph
from exporters.onnx.manifest import manifest_for, max_positions, write_manifest
from exporters.onnx.parity import check_parity, compare_exports, default_prompt
from exporters.onnx.quantize import quantize_int4, quantize_int8

_QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8}
_INT4 = ONNX_VARIANTS["int4"]   # the first-use export's settings: this module's defaults
_INT8 = ONNX_VARIANTS["int8"]


def _has_data(folder: Path) -> bool:
    return (folder / (MODEL_NAME + ".data")).exists()


def _fp32_manifest(model, path: Path, out: Path, opset: int, source, seconds: float,
                   parity_prompt, steps: int, threads, attention: str) -> dict:
    """Write the float32 graph's manifest (``export_seconds``), then again with its
    :func:`check_parity` result (``parity``) unless ``parity_prompt`` is None."""
    man = manifest_for(model, dtype="float32", kv_dtype="float32", opset=opset,
                       source=source, external=_has_data(out), attention=attention)
    man["export_seconds"] = round(seconds, 2)
    write_manifest(out, man)
    if parity_prompt is not None:
        man["parity"] = check_parity(path, model, steps=steps, prompt=parity_prompt,
                                     threads=threads)
    write_manifest(out, man)
    return man


def _fp16_variant(model, out: Path, opset: int, source, verbose: bool,
                  attention: str) -> dict:
    """Trace a float16 copy of ``model`` into ``out/fp16``; returns its manifest."""
    t1 = time.perf_counter()
    half = copy.deepcopy(model).half().eval()
    vdir = out / "fp16"
    export_graph(half, vdir / MODEL_NAME, opset=opset, verbose=verbose,
                 attention=attention)
    del half
    vm = manifest_for(model, dtype="float16", kv_dtype="float16", opset=opset,
                      source=source, external=_has_data(vdir), attention=attention)
    vm["export_seconds"] = round(time.perf_counter() - t1, 2)
    return vm


def _quantized_variant(model, path: Path, out: Path, name: str, opset: int, source,
                       qopts: dict, attention: str) -> dict:
    """Quantise the float32 graph ``path`` into ``out/<name>`` (``int4`` / ``int8``,
    with ``qopts[name]``'s settings); returns its manifest (with ``quantization``)."""
    t1 = time.perf_counter()
    vdir = out / name
    ids = qopts[name].get("head_ids")
    qinfo = _QUANTIZERS[name](path, vdir / MODEL_NAME, **qopts[name],
                              max_positions=max_positions(model.config))
    vm = manifest_for(model, dtype=name, kv_dtype="float32", opset=opset, source=source,
                      external=_has_data(vdir), attention=attention)
    vm["quantization"] = qinfo
    if ids is not None:
        head_vocab.record(vdir, vm, ids)
    vm["export_seconds"] = round(time.perf_counter() - t1, 2)
    return vm


def _variants(model, path: Path, out: Path, names: list[str], opset: int, source,
              verbose: bool, qopts: dict, attention: str) -> dict:
    """Variant name (``fp16``, ``int4``, ``int8``, in that order) -> its manifest, each
    written into ``out/<name>``."""
    variants = {}
    for name in names:
        variants[name] = (
            _fp16_variant(model, out, opset, source, verbose, attention) if name == "fp16"
            else _quantized_variant(model, path, out, name, opset, source, qopts,
                                    attention))
    return variants


def _write_variants(out: Path, variants: dict, parity: bool, prompts, steps: int,
                    threads) -> None:
    """Write each variant's manifest, with its greedy agreement with the float32 graph
    when ``parity``."""
    for name, vm in variants.items():
        vdir = out / name
        write_manifest(vdir, vm)  # the runner reads it
        if parity:
            vm["agreement_vs_fp32"] = compare_exports(vdir, out, prompts, steps,
                                                      threads=threads)
            write_manifest(vdir, vm)


def _head(tokenizer, size: int | None, model) -> dict:
    """The int4 quantiser's ``head_ids`` when a subset head applies, else nothing."""
    if not size or tokenizer is None:
        return {}
    ids = head_vocab.head_ids(tokenizer, size, int(model.config.vocab_size))
    return {} if ids is None else {"head_ids": ids}


def export_onnx(model, out_dir: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                fp16: bool = False, int4: bool = False, int8: bool = False,
                parity: bool = True,
                parity_steps: int = 64, prompts: Sequence[Sequence[int]] | None = None,
                source: str | None = None,
                int4_block_size: int | None = None,
                int4_head_block_size: int | None = _INT4["lm_head_block_size"],
                int4_head_vocab: int | None = None,
                fuse_norms: bool = _INT4["fuse_norms"],
                fuse_rotary: bool = _INT4["fuse_rotary"],
                tokenizer=None, threads: int | None = None,
                verbose: bool = False, attention: str = DEFAULT_ATTENTION) -> dict:
    """Export ``model`` (HF causal LM, float32, eval) to ``out_dir`` with optional
    variants, checking each.

    Args:
        out_dir: folder for ``model.onnx`` + ``specrelay_onnx.json`` (``fp16/`` and
            ``int4/`` subfolders for the variants).
        fp16: also export a float16 graph (float16 weights, KV and logits).
        int4: also write a weight-only int4 graph (MatMulNBits, float32 KV/logits).
        int8: also write a weight-only int8 graph (MatMulNBits 8 bits, float32 KV/logits).
        int4_block_size: weights per scale of the int4 and int8 graphs (None: each
            variant's first-use setting, 64 for int4's decoder layers and 32 for int8).
        int4_head_block_size: weights per scale of the int4 graph's LM head (None: as
            the layers; see :func:`~exporters.onnx.quantize.quantize_weights`). Both
            default to the first-use export's settings
            (:data:`edge_sdk.drafters.runtime.ONNX_VARIANTS`).
        int4_head_vocab: rows of the int4 graph's LM head (FR-Spec,
            :mod:`exporters.onnx.head_vocab`: the first ones of ``tokenizer``'s shipped
            frequency ranking, plus the added tokens); None (the default, as the
            first-use export), no ``tokenizer`` or no ranking for it: the whole head.
        fuse_norms: fuse the int4 / int8 graphs' RMSNorms
            (:func:`exporters.onnx.fuse.fuse_norms`; default: as the first-use export).
        fuse_rotary: fuse their rotary embeddings (:func:`exporters.onnx.fuse.fuse_rotary`,
            caches of the config's ``max_position_embeddings``; default: as the
            first-use export).
        tokenizer: the model's tokenizer (for ``int4_head_vocab``).
        parity: run :func:`check_parity` on the float32 export (steps=``parity_steps``)
            and :func:`compare_exports` on each variant; results go in the manifests.
        prompts: token-id prompts for the checks (default one :func:`default_prompt`);
            the first is used for the float32 parity check.
        source: free text recorded in the manifest (model spec).
        attention: ``gqa`` (default: :func:`~exporters.onnx.attention.gqa_attention`,
            K and V never repeated over the query heads) or ``model`` (the model's own
            attention, as exports before cache format 3 had).
    Returns:
        the float32 manifest as written (``parity``; ``variants`` -> path and
        ``agreement_vs_fp32`` per variant) plus ``variant_manifests`` -> each variant's
        full manifest.
    Raises:
        RuntimeError: the float32 export failed its parity check (the files stay on
        disk, the manifest records the failure).
        ValueError: an unknown ``attention``.
    """
    check_attention(attention)
    out = Path(out_dir)
    t0 = time.perf_counter()
    model = model.eval()
    if next(model.parameters()).dtype != torch.float32:
        model = copy.deepcopy(model).float()
    prompts = [list(p) for p in (prompts or [default_prompt(int(model.config.vocab_size))])]
    path = export_graph(model, out / MODEL_NAME, opset=opset, verbose=verbose,
                        attention=attention)
    man = _fp32_manifest(model, path, out, opset, source, time.perf_counter() - t0,
                         prompts[0] if parity else None, parity_steps, threads, attention)
    variants = _variants(model, path, out, [n for n, on in (("fp16", fp16), ("int4", int4),
                                                            ("int8", int8)) if on],
                         opset, source, verbose,
                         {"int4": {"block_size": _INT4["block_size"] if int4_block_size is None
                                   else int4_block_size,
                                   "lm_head_block_size": int4_head_block_size,
                                   "fuse_norms": fuse_norms, "fuse_rotary": fuse_rotary,
                                   **_head(tokenizer, int4_head_vocab, model)},
                          "int8": {"block_size": _INT8["block_size"] if int4_block_size is None
                                   else int4_block_size,
                                   "fuse_norms": fuse_norms, "fuse_rotary": fuse_rotary}},
                         attention)
    _write_variants(out, variants, parity, prompts, parity_steps, threads)
    if variants:
        man["variants"] = {k: {"path": k, "agreement_vs_fp32": v.get("agreement_vs_fp32")}
                           for k, v in variants.items()}
        write_manifest(out, man)
    if parity and not man["parity"]["passed"]:
        raise RuntimeError(f"ONNX parity check failed: {man['parity']}")
    man["variant_manifests"] = variants
    return man
