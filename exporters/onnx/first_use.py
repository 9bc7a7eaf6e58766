"""The cached ONNX exports behind the ``onnx-*`` draft runtimes, built on first use.

:func:`edge_sdk.drafters.runtime.build_drafter` only *loads* a cached export (the SDK
must not carry training/compile code); a missing one raises
:class:`~edge_sdk.drafters.runtime.ExportMissing`. :func:`build_drafter` here is the same
call with export on first use: :func:`ensure_onnx_export` builds the missing folder
with :func:`build_onnx_export` (memory-lean: ~80-90 s and ~8 GB peak for the 0.5B
draft, ~0.9 GB on disk in int4) and renames it into
``$SPECRELAY_CACHE/onnx/<name>-<variant>`` atomically. The ``specrelay`` CLI uses it,
so the default draft ``qwen2.5-coder-0.5b+onnx-int4`` is exported the first time a
command needs it.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from edge_sdk.drafters import runtime as sdk_runtime
from edge_sdk.drafters.onnx import MODEL_NAME
from edge_sdk.drafters.runtime import (ONNX_VARIANTS, cache_key, export_is_current,
                                      onnx_cache_path)
from exporters.onnx.attention import DEFAULT_ATTENTION
from exporters.onnx.graph import DEFAULT_OPSET, export_graph
from exporters.onnx.manifest import manifest_for, write_manifest
from exporters.onnx.parity import check_parity, compare_exports, default_prompt
from exporters.onnx.quantize import quantize_weights

log = logging.getLogger(__name__)

#: Decode steps the first-use build checks (fp32 parity with torch; int4 agreement).
BUILD_CHECK_STEPS = 16


def _check_prompts(tok, vocab: int) -> list[list[int]]:
    """The build checks' prompt: a short chat request, else fixed ids (no tokenizer)."""
    from edge_sdk.models import encode_prompt

    try:
        prompts = [encode_prompt(tok, "Write a Python function that reverses a string.",
                                 chat=True)]
        return [[t for t in p if t < vocab] for p in prompts]
    except Exception:  # noqa: BLE001 - no usable tokenizer: fixed ids
        return [default_prompt(vocab)]


def _fp32_export(spec: str, fp32_dir: Path, check_steps: int, echo,
                 announce: str) -> tuple[dict, list]:
    """Load ``spec`` in bfloat16, widen it to float32 in place (the bf16 draft's exact
    weights), trace it into ``fp32_dir`` and parity-check it; the model is freed on
    return. -> (manifest with ``parity``, check prompts). Raises RuntimeError: the
    parity check failed. ``announce`` is echoed once the model is loaded."""
    from edge_sdk.models import load_model

    model, tok = load_model(spec, dtype="bfloat16")
    model.float()  # in place: no second copy
    prompts = _check_prompts(tok, int(model.config.vocab_size))
    echo(announce)
    export_graph(model, fp32_dir / MODEL_NAME, opset=DEFAULT_OPSET,
                 attention=DEFAULT_ATTENTION)
    man = manifest_for(model, dtype="float32", kv_dtype="float32", opset=DEFAULT_OPSET,
                       source=spec, external=(fp32_dir / (MODEL_NAME + ".data")).exists(),
                       attention=DEFAULT_ATTENTION)
    write_manifest(fp32_dir, man)
    par = check_parity(fp32_dir, model, steps=check_steps, prompt=prompts[0], threads=1)
    if not par["passed"]:
        raise RuntimeError(f"ONNX parity check failed for {spec}: {par}")
    man["parity"] = par
    return man, prompts


def _quantized(out: Path, fp32_dir: Path, man: dict, variant: str, prompts,
               check_steps: int) -> dict:
    """Quantise the float32 graph into ``out`` (:data:`ONNX_VARIANTS` settings), record
    its greedy agreement with the float32 graph, then delete the float32 graph.
    Returns the variant's manifest."""
    qinfo = quantize_weights(fp32_dir / MODEL_NAME, out / MODEL_NAME,
                             **ONNX_VARIANTS[variant], max_positions=man.get("max_positions"))
    vm = dict(man, dtype=variant, external_data=(
        MODEL_NAME + ".data") if (out / (MODEL_NAME + ".data")).exists() else None)
    vm["fp32_parity"] = vm.pop("parity")
    vm["quantization"] = qinfo
    write_manifest(out, vm)
    vm["agreement_vs_fp32"] = compare_exports(out, fp32_dir, prompts, check_steps,
                                              threads=1)
    shutil.rmtree(fp32_dir)
    return vm


def build_onnx_export(spec: str, out: str | os.PathLike, variant: str = "int4", *,
                      check_steps: int = BUILD_CHECK_STEPS,
                      echo: Callable[[str], None] | None = None) -> dict:
    """Export ``spec`` to ONNX ``variant`` (``fp32``, ``int8`` or ``int4``) in ``out``
    (created; must not exist), memory-lean: the model is loaded in bfloat16 and widened
    to float32 in place, traced, parity-checked on a real prompt (``check_steps``
    greedy steps; a failure raises RuntimeError), freed, then quantised
    (:func:`~exporters.onnx.quantize.quantize_weights` with :data:`ONNX_VARIANTS`). For
    a quantised variant only its graph is kept; its greedy agreement with the float32
    graph is recorded in the manifest (``agreement_vs_fp32``).

    Returns the written manifest (with ``build_seconds``). Raises ValueError: an unknown
    variant.
    """
    if variant not in ONNX_VARIANTS:
        raise ValueError(f"unknown ONNX variant {variant!r} (one of {sorted(ONNX_VARIANTS)})")
    echo = echo or log.info
    out = Path(out)
    t0 = time.perf_counter()
    fp32_dir = out / "fp32" if variant != "fp32" else out
    man, prompts = _fp32_export(spec, fp32_dir, check_steps, echo,
                                f"exporting {spec} to ONNX ({variant}) in {out} (once; "
                                f"~2-4 min and ~8 GB of memory on 2 cores) ...")
    gc.collect()
    if variant != "fp32":
        man = _quantized(out, fp32_dir, man, variant, prompts, check_steps)
    man["build_seconds"] = round(time.perf_counter() - t0, 1)
    write_manifest(out, man)
    return man


def _replace(final: Path, tmp: Path, key: str) -> None:
    """Rename the finished ``tmp`` folder to ``final``: a stale ``final`` (key mismatch)
    is moved aside and deleted first; losing the race to another process that finished
    first is fine (its folder is used)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(final, old)
        except OSError:
            pass
        else:
            shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not export_is_current(final, key):  # not a lost race: a real failure
            raise


def ensure_onnx_export(spec: str, variant: str = "int4", *,
                       echo: Callable[[str], None] | None = None) -> Path:
    """The cached ONNX export of ``spec``
    (:func:`~edge_sdk.drafters.runtime.onnx_cache_path`), built on first use with
    :func:`build_onnx_export` in a temporary sibling folder and renamed into place
    (atomic; if another process finished first, its folder is used). A cached folder
    whose ``cache_key`` no longer matches (new weights, settings or library versions)
    is rebuilt. Returns the folder."""
    final = onnx_cache_path(spec, variant)
    key = cache_key(spec, variant)
    if export_is_current(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        man = build_onnx_export(spec, tmp, variant, echo=echo)
        man["cache_key"] = key
        write_manifest(tmp, man)
        _replace(final, tmp, key)
        (echo or log.info)(f"ONNX {variant} export of {spec} cached in {final} "
                           f"({man['build_seconds']} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_drafter(spec: str, runtime: str | None = None, *, dtype: str | None = None,
                  threads: int | None = None, providers=None,
                  echo: Callable[[str], None] | None = None, prefill: str = "auto"):
    """:func:`edge_sdk.drafters.runtime.build_drafter` (same arguments and result) that
    exports a missing ``onnx-*`` runtime on first use (:func:`ensure_onnx_export`)
    instead of raising :class:`~edge_sdk.drafters.runtime.ExportMissing`."""
    return sdk_runtime.build_drafter(spec, runtime, dtype=dtype, threads=threads,
                                     providers=providers, echo=echo,
                                     export=ensure_onnx_export, prefill=prefill)
