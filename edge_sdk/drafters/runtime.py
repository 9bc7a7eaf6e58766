"""Pick the runtime a draft model runs on: torch, torch int8, or a cached ONNX export.

The output of speculative decoding is the target's whatever the draft does, so the
draft may be quantised freely; a worse draft only lowers acceptance. Runtimes:

===============  ==============================================================
``torch``        the HF model in ``dtype`` (bf16 for the Qwen draft) — the reference
``torch-int8``   float32 model, every ``nn.Linear`` dynamically quantised to int8
``onnx-fp32``    onnxruntime, float32 export (numerically the torch model)
``onnx-int8``    onnxruntime, weight-only int8 (MatMulNBits 8 bits, block 32, int8
                 activations)
``onnx-int4``    onnxruntime, weight-only int4 (MatMulNBits, block 32, int8
                 activations): the fastest on one core
===============  ==============================================================

Qwen2.5-Coder-0.5B, one thread, ~100-token context (``python -m exporters.speed``):
torch bf16 81 ms/token; torch int8 22 ms (greedy agreement with the bf16 draft 0.90);
onnx fp32 62 ms (0.994); onnx int8 21 ms (0.992); onnx int4 15 ms (0.945). First use
of an ONNX runtime exports it: ~80-90 s and ~8 GB peak memory, ~0.9 GB on disk (int4).

ONNX runtimes are exported on first use into ``$SPECRELAY_CACHE/onnx/<name>-<variant>``
(written to a temporary folder and renamed into place, so a crash or a concurrent
build never leaves a half-written export); later uses load the folder in ~1 s.

Use::

    from edge_sdk.drafters.runtime import build_drafter
    drafter, tok = build_drafter("qwen2.5-coder-0.5b", runtime="onnx-int4")
    drafter, tok = build_drafter("qwen2.5-coder-0.5b+onnx-int4")   # same, as a suffix
    drafter, tok = build_drafter("/path/to/onnx-export")           # an export folder

``tok`` is None for an export folder (draft and target share the tokenizer).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

RUNTIMES = ("torch", "torch-int8", "onnx-fp32", "onnx-int8", "onnx-int4")
#: Separator of the runtime suffix in a spec (``qwen2.5-coder-0.5b+onnx-int4``).
SUFFIX = "+"
#: Export settings per ONNX variant; part of the cache key (a change rebuilds).
ONNX_VARIANTS = {
    "fp32": {},
    "int8": {"bits": 8, "block_size": 32, "symmetric": True, "accuracy_level": 4},
    "int4": {"bits": 4, "block_size": 32, "symmetric": True, "accuracy_level": 4,
             "lm_head_bits": 4},
}
#: Decode steps the first-use build checks (fp32 parity with torch; int4 agreement).
BUILD_CHECK_STEPS = 16
_CACHE_FORMAT = 1


def split_runtime(spec: str) -> tuple[str, str | None]:
    """``"name+onnx-int4"`` -> ``("name", "onnx-int4")``; no known suffix -> ``(spec,
    None)``."""
    base, sep, tail = spec.rpartition(SUFFIX)
    if sep and base and tail in RUNTIMES:
        return base, tail
    return spec, None


def _source_id(spec: str) -> str:
    """What identifies the weights of ``spec``: the GGUF file's path and size, else the
    folder's config.json and weights' sizes, else the spec itself."""
    from edge_sdk.models import resolve

    ms = resolve(spec)
    parts = [spec]
    if ms.gguf_file:
        f = Path(ms.path) / ms.gguf_file
        parts += [str(f.resolve()), str(f.stat().st_size)]
    elif Path(ms.path).is_dir():
        for f in sorted(Path(ms.path).iterdir()):
            if f.suffix in (".json", ".safetensors", ".bin"):
                parts.append(f"{f.name}:{f.stat().st_size}")
    return "|".join(parts)


def cache_key(spec: str, variant: str) -> str:
    """Hash of everything the cached export depends on (source weights, variant
    settings, library versions, cache format)."""
    import onnxruntime
    import torch
    import transformers

    blob = json.dumps({"source": _source_id(spec), "variant": variant,
                       "settings": ONNX_VARIANTS[variant], "format": _CACHE_FORMAT,
                       "versions": [torch.__version__, transformers.__version__,
                                    onnxruntime.__version__]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def onnx_cache_path(spec: str, variant: str = "int4") -> Path:
    """``$SPECRELAY_CACHE/onnx/<name>-<variant>`` for a model spec (a path spec gets
    its folder name plus a short hash)."""
    from edge_sdk.models import PRESETS, cache_dir

    if spec in PRESETS:
        name = spec
    else:
        name = Path(spec.rstrip("/")).name or "model"
        name += "-" + hashlib.sha256(spec.encode()).hexdigest()[:8]
    name = name.replace("@", "-L").replace("::", "-").replace("/", "_")
    return cache_dir() / "onnx" / f"{name}-{variant}"


def _cached_ok(folder: Path, key: str) -> bool:
    from edge_sdk.drafters.onnx import MANIFEST_NAME, MODEL_NAME

    mf = folder / MANIFEST_NAME
    if not (mf.is_file() and (folder / MODEL_NAME).is_file()):
        return False
    try:
        return json.loads(mf.read_text()).get("cache_key") == key
    except (OSError, ValueError):
        return False


def build_onnx_export(spec: str, out: str | os.PathLike, variant: str = "int4", *,
                      check_steps: int = BUILD_CHECK_STEPS,
                      echo: Callable[[str], None] | None = None) -> dict:
    """Export ``spec`` to ONNX ``variant`` (``fp32``, ``int8`` or ``int4``) in ``out``
    (created; must not exist), memory-lean: the model is loaded in bfloat16 and widened
    to float32 in place (the bf16 draft's exact weights), traced, parity-checked on a
    real prompt (``check_steps`` greedy steps; a failure raises RuntimeError), freed,
    then quantised (:func:`exporters.onnx.quantize_weights` with
    :data:`ONNX_VARIANTS`). For a quantised variant only its graph is kept; its greedy
    agreement with the float32 graph is recorded in the manifest (``agreement_vs_fp32``).

    Returns the written manifest (with ``build_seconds``).
    """
    from edge_sdk.models import encode_prompt, load_model
    from exporters.onnx import (DEFAULT_OPSET, MODEL_NAME, _manifest, check_parity,
                                compare_exports, export_graph, quantize_weights,
                                write_manifest)

    if variant not in ONNX_VARIANTS:
        raise ValueError(f"unknown ONNX variant {variant!r} (one of {sorted(ONNX_VARIANTS)})")
    echo = echo or log.info
    out = Path(out)
    t0 = time.perf_counter()
    model, tok = load_model(spec, dtype="bfloat16")
    model.float()  # in place: no second copy
    vocab = int(model.config.vocab_size)
    try:
        prompts = [encode_prompt(tok, "Write a Python function that reverses a string.",
                                 chat=True)]
        prompts = [[t for t in p if t < vocab] for p in prompts]
    except Exception:  # noqa: BLE001 - no usable tokenizer: fixed ids
        from exporters.onnx import default_prompt

        prompts = [default_prompt(vocab)]
    fp32_dir = out / "fp32" if variant != "fp32" else out
    echo(f"exporting {spec} to ONNX ({variant}) in {out} ...")
    export_graph(model, fp32_dir / MODEL_NAME, opset=DEFAULT_OPSET)
    man = _manifest(model, dtype="float32", kv_dtype="float32", opset=DEFAULT_OPSET,
                    source=spec, external=(fp32_dir / (MODEL_NAME + ".data")).exists())
    write_manifest(fp32_dir, man)
    par = check_parity(fp32_dir, model, steps=check_steps, prompt=prompts[0], threads=1)
    if not par["passed"]:
        raise RuntimeError(f"ONNX parity check failed for {spec}: {par}")
    man["parity"] = par
    del model
    gc.collect()
    if variant == "fp32":
        man["build_seconds"] = round(time.perf_counter() - t0, 1)
        write_manifest(out, man)
        return man
    qinfo = quantize_weights(fp32_dir / MODEL_NAME, out / MODEL_NAME,
                             **ONNX_VARIANTS[variant])
    vm = dict(man, dtype=variant, external_data=(
        MODEL_NAME + ".data") if (out / (MODEL_NAME + ".data")).exists() else None)
    vm.pop("parity")
    vm["fp32_parity"] = par
    vm["quantization"] = qinfo
    write_manifest(out, vm)
    vm["agreement_vs_fp32"] = compare_exports(out, fp32_dir, prompts, check_steps,
                                              threads=1)
    shutil.rmtree(fp32_dir)
    vm["build_seconds"] = round(time.perf_counter() - t0, 1)
    write_manifest(out, vm)
    return vm


def ensure_onnx_export(spec: str, variant: str = "int4", *,
                       echo: Callable[[str], None] | None = None) -> Path:
    """The cached ONNX export of ``spec`` (:func:`onnx_cache_path`), built on first use
    with :func:`build_onnx_export` in a temporary sibling folder and renamed into place
    (atomic; if another process finished first, its folder is used). A cached folder
    whose ``cache_key`` no longer matches (new weights, settings or library versions)
    is rebuilt. Returns the folder."""
    from exporters.onnx import write_manifest

    final = onnx_cache_path(spec, variant)
    key = cache_key(spec, variant)
    if _cached_ok(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        man = build_onnx_export(spec, tmp, variant, echo=echo)
        man["cache_key"] = key
        write_manifest(tmp, man)
        if final.exists():  # stale (key mismatch): move it aside, then replace
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
            if not _cached_ok(final, key):  # not a lost race: a real failure
                raise
        (echo or log.info)(f"ONNX {variant} export of {spec} cached in {final} "
                           f"({man['build_seconds']} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_drafter(spec: str, runtime: str | None = None, *, dtype: str | None = None,
                  threads: int | None = None, providers=None,
                  echo: Callable[[str], None] | None = None):
    """A :class:`~edge_sdk.drafters.base.Drafter` for ``spec`` on ``runtime``.

    Args:
        spec: model spec (:func:`edge_sdk.models.resolve`), optionally with a runtime
            suffix (``qwen2.5-coder-0.5b+onnx-int4``), or an ONNX export folder
            (``specrelay_onnx.json``; runs as is).
        runtime: one of :data:`RUNTIMES` (default: the suffix, else ``torch``); an
            explicit argument wins over the suffix.
        dtype: torch dtype for ``runtime="torch"`` (None = :func:`load_model`'s
            default; ``"bfloat16"`` for the bf16 draft). The other runtimes ignore it
            (torch-int8 and the ONNX exports start from the bf16 weights).
        threads: intra-op threads. ONNX runtimes default to 1 (the edge drafts on one
            core; per session, so nothing else is affected); torch runtimes leave
            torch's global setting alone unless given (it is process-wide).
        providers: onnxruntime execution providers (default CPU for cached exports).
        echo: progress messages (first-use export); default the module logger.
    Returns:
        ``(drafter, tokenizer or None)``.
    Raises:
        ValueError: an unknown runtime.
    """
    from edge_sdk.drafters.onnx import MANIFEST_NAME, OnnxDrafter

    if (Path(spec) / MANIFEST_NAME).is_file():
        return OnnxDrafter(spec, providers=providers, threads=threads or 1), None
    spec, suffix = split_runtime(spec)
    runtime = runtime or suffix or "torch"
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown draft runtime {runtime!r} (one of {', '.join(RUNTIMES)})")
    if runtime.startswith("onnx-"):
        from edge_sdk.models import load_tokenizer

        folder = ensure_onnx_export(spec, runtime.split("-", 1)[1], echo=echo)
        return OnnxDrafter(folder, providers=providers or "cpu", threads=threads or 1), \
            load_tokenizer(spec)
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import load_model

    if runtime == "torch":
        model, tok = load_model(spec, threads=threads, **({"dtype": dtype} if dtype else {}))
        return TorchDrafter(model), tok
    # torch-int8: float32 weights (from the bf16 load: the draft's exact values)
    from edge_sdk.drafters.torch import quantize_dynamic_int8

    model, tok = load_model(spec, dtype="bfloat16", threads=threads)
    return TorchDrafter(quantize_dynamic_int8(model.float())), tok
