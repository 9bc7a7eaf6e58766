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
onnx fp32 62 ms (0.994); onnx int8 21 ms (0.992); onnx int4 15 ms (0.945).

An ``onnx-*`` draft of a model spec may prefill long catch-ups (a prompt) through the
same model in torch bf16 instead (``prefill="torch"`` or ``$SPECRELAY_DRAFT_PREFILL``;
:mod:`edge_sdk.drafters.prefill`): faster on an AMX core, opt-in for its memory.

Why the SDK does not export: ONNX runtimes load a cached export from ``$SPECRELAY_CACHE/onnx/<name>-<variant>``
(~1 s). This module only *loads* exports: the SDK (what an app embeds) carries no
training/compile code, so it never imports :mod:`exporters`. A missing or stale export
is built by whoever passes ``export=`` to :func:`build_drafter` (dependency injection:
the arrow points from exporters to the SDK, never back): the ``specrelay`` CLI calls :func:`exporters.onnx.first_use.build_drafter` (this function with
``export=ensure_onnx_export``), so the default draft is exported on first use (~80-90 s
and ~8 GB peak memory, ~0.9 GB on disk in int4; written to a temporary folder and
renamed into place, so a crash or a concurrent build never leaves a half-written
export). Without ``export=`` a missing export raises :class:`ExportMissing`, whose
one-line message names ``specrelay export onnx`` and the ``[export]`` extra.

Use::

    from edge_sdk.drafters.runtime import build_drafter
    drafter, tok = build_drafter("qwen2.5-coder-0.5b")                # torch
    drafter, tok = build_drafter("qwen2.5-coder-0.5b+onnx-int4")      # cached int4 export
    drafter, tok = build_drafter("/path/to/onnx-export")              # an export folder

    from exporters.onnx.first_use import build_drafter                # exports on first use
    drafter, tok = build_drafter("qwen2.5-coder-0.5b", runtime="onnx-int4")

``tok`` is None for an export folder (draft and target share the tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

RUNTIMES = ("torch", "torch-int8", "onnx-fp32", "onnx-int8", "onnx-int4")
#: Separator of the runtime suffix in a spec (``qwen2.5-coder-0.5b+onnx-int4``).
SUFFIX = "+"
#: Export settings per ONNX variant; part of the cache key (a change rebuilds), and the
#: defaults of ``specrelay export onnx``. The int4 decoder layers have 64 weights per
#: scale and the LM head 128 (:func:`exporters.onnx.quantize.quantize_weights`,
#: ``block_size`` / ``lm_head_block_size``: on Qwen2.5-Coder-0.5B, 64 decodes 1.11-1.17x
#: as fast as 32 with the same agreement with the target; 128 loses agreement). The
#: quantised graphs have their RMSNorms and rotary embeddings fused into onnxruntime's
#: ops (``fuse_norms`` / ``fuse_rotary``, :mod:`exporters.onnx.fuse`).
ONNX_VARIANTS = {
    "fp32": {},
    "int8": {"bits": 8, "block_size": 32, "symmetric": True, "accuracy_level": 4,
             "fuse_norms": True, "fuse_rotary": True},
    "int4": {"bits": 4, "block_size": 64, "symmetric": True, "accuracy_level": 4,
             "lm_head_bits": 4, "lm_head_block_size": 128, "fuse_norms": True,
             "fuse_rotary": True},
}
#: 2: graphs take ``logits_to_keep`` (a prefill runs the LM head on its last row only).
#: 3: grouped-query attention traced without repeating K and V per query head.
#: 4: quantised graphs with fused RMSNorms and rotary embeddings (rope caches with a
#: margin past ``max_position_embeddings``).
_CACHE_FORMAT = 4

#: ``export(spec, variant, echo=...) -> folder``: builds a missing cached export
#: (:func:`exporters.onnx.first_use.ensure_onnx_export`).
Exporter = Callable[..., Path]


class ExportMissing(FileNotFoundError):
    """No current cached ONNX export of a draft, and no ``export=`` to build one."""


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


def export_is_current(folder: Path, key: str) -> bool:
    """True when ``folder`` holds a complete export (manifest and graph) whose manifest
    records ``cache_key == key``."""
    from edge_sdk.drafters.onnx import MANIFEST_NAME, MODEL_NAME

    mf = folder / MANIFEST_NAME
    if not (mf.is_file() and (folder / MODEL_NAME).is_file()):
        return False
    try:
        return json.loads(mf.read_text()).get("cache_key") == key
    except (OSError, ValueError):
        return False


def _missing(spec: str, variant: str, folder: Path) -> ExportMissing:
    flag, sub = ("", "DIR") if variant == "fp32" else (f" --{variant}", f"DIR/{variant}")
    return ExportMissing(
        f"no current ONNX {variant} export of {spec} in {folder}: run `specrelay export "
        f"onnx {spec} --dtype bfloat16{flag} --out DIR` (pip install 'specrelay[export]') "
        f"and load {sub}, or build it on first use with "
        f"exporters.onnx.first_use.build_drafter")


def onnx_export_folder(spec: str, variant: str, export: Exporter | None = None,
                       echo: Callable[[str], None] | None = None) -> Path:
    """The cached ONNX ``variant`` export of ``spec``: built (or rebuilt when stale) by
    ``export`` when given, else the current cached folder.

    Raises:
        ExportMissing: no current cached export and no ``export``.
    """
    if export is not None:
        return Path(export(spec, variant, echo=echo))
    folder = onnx_cache_path(spec, variant)
    if not export_is_current(folder, cache_key(spec, variant)):
        raise _missing(spec, variant, folder)
    return folder


#: ``prefill=`` values of :func:`build_drafter`.
PREFILLS = ("auto", "torch", "off")


def prefill_default() -> str:
    """What ``prefill="auto"`` means: ``$SPECRELAY_DRAFT_PREFILL`` (``torch`` or ``off``)
    if set, else ``off``. Opt-in: on the AMX box a torch prefill runs a prompt ~2.2x
    faster (:mod:`edge_sdk.drafters.prefill`) but costs ~1.9 GB more edge memory, and the
    bench measured no throughput gain from it where the target's own prefill is the
    longer one (README, "Draft prefill on AMX"). Raises ValueError for another value."""
    env = os.environ.get("SPECRELAY_DRAFT_PREFILL")
    if env:
        if env not in PREFILLS[1:]:
            raise ValueError(f"SPECRELAY_DRAFT_PREFILL={env!r}: expected torch or off")
        return env
    return "off"


def build_drafter(spec: str, runtime: str | None = None, *, dtype: str | None = None,
                  threads: int | None = None, providers=None,
                  echo: Callable[[str], None] | None = None,
                  export: Exporter | None = None, prefill: str = "auto"):
    """A :class:`~edge_sdk.drafters.base.Drafter` for ``spec`` on ``runtime``.

    Args:
        spec: model spec (:func:`edge_sdk.models.resolve`), optionally with a runtime
            suffix (``qwen2.5-coder-0.5b+onnx-int4``), or an ONNX export folder
            (``specrelay_onnx.json``; runs as is, and says so in one line when the
            folder also holds variants), optionally with a runtime suffix that picks
            its variant (``OUT+onnx-int4`` -> ``OUT/int4``, :func:`export_variant`).
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
        export: builds a missing or stale ONNX export (:data:`Exporter`; the CLI passes
            :func:`exporters.onnx.first_use.ensure_onnx_export`). None: load only.
        prefill: for the ``onnx-*`` runtimes of a model spec, how long catch-ups (a
            prompt) fill the draft's KV cache: ``torch`` through the same model in
            bf16 (:mod:`edge_sdk.drafters.prefill`; ~1.9 GB more memory), ``off``
            through the graph, ``auto`` :func:`prefill_default`. An export folder
            always prefills through its graph.
    Returns:
        ``(drafter, tokenizer or None)``.
    Raises:
        ValueError: an unknown runtime or prefill; an export folder without the
            variant its suffix names.
        ExportMissing: an ``onnx-*`` runtime whose export is not cached, without
            ``export``.
    """
    from edge_sdk.drafters.onnx import MANIFEST_NAME, OnnxDrafter

    if prefill not in PREFILLS:
        raise ValueError(f"unknown draft prefill {prefill!r} (one of {', '.join(PREFILLS)})")
    # an export folder, as is or with a suffix naming one of its variants
    spec, suffix = ((spec, None) if (Path(spec) / MANIFEST_NAME).is_file()
                    else split_runtime(spec))
    runtime = runtime or suffix
    if (Path(spec) / MANIFEST_NAME).is_file():
        if runtime is None:
            _say_variants(Path(spec), echo)
        folder = export_variant(Path(spec), runtime)
        return OnnxDrafter(folder, providers=providers, threads=threads or 1), None
    runtime = runtime or "torch"
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown draft runtime {runtime!r} (one of {', '.join(RUNTIMES)})")
    if runtime.startswith("onnx-"):
        from edge_sdk.models import load_tokenizer

        folder = onnx_export_folder(spec, runtime.split("-", 1)[1], export, echo)
        drafter = OnnxDrafter(folder, providers=providers or "cpu", threads=threads or 1)
        if (prefill_default() if prefill == "auto" else prefill) == "torch":
            from edge_sdk.drafters.prefill import load_prefill

            drafter.runner.prefill = load_prefill(spec, threads=threads)
        return drafter, load_tokenizer(spec)
    return _torch_drafter(spec, runtime, dtype, threads)


def _variant_dirs(folder: Path) -> list[str]:
    """The quantised / fp16 variants written beside an export's float32 graph (the
    subfolders of ``specrelay export onnx``'s OUT holding their own manifest)."""
    from edge_sdk.drafters.onnx import MANIFEST_NAME

    return sorted(d.name for d in folder.iterdir() if (d / MANIFEST_NAME).is_file())


def _own_variant(folder: Path) -> str:
    """The variant a graph folder holds, from its manifest's ``dtype`` (``float32`` ->
    ``fp32``, ``float16`` -> ``fp16``, ``int4``, ``int8``)."""
    from edge_sdk.drafters.onnx import MANIFEST_NAME

    dtype = json.loads((folder / MANIFEST_NAME).read_text()).get("dtype", "float32")
    return {"float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


def export_variant(folder: Path, runtime: str | None) -> Path:
    """The graph folder of ``runtime`` in an export folder written by ``specrelay export
    onnx``: its own graph (``onnx-fp32`` for OUT, ``onnx-int4`` for OUT/int4) or a
    variant beside it (``onnx-int4`` -> OUT/int4). None: the folder as is.

    Raises:
        ValueError: ``runtime`` is not an ONNX runtime, or the folder has no such
            variant (the message lists the ones it has).
    """
    if runtime is None:
        return folder
    have = {_own_variant(folder): folder, **{v: folder / v for v in _variant_dirs(folder)}}
    name = runtime.split("-", 1)[1] if runtime.startswith("onnx-") else None
    if name not in have:
        runs = ", ".join(f"onnx-{v}" for v in have)
        raise ValueError(f"draft {folder}+{runtime}: this export folder runs as {runs} "
                         f"(`specrelay export onnx --int4 / --int8 / --fp16` writes the "
                         f"others)")
    return have[name]


def _say_variants(folder: Path, echo: Callable[[str], None] | None) -> None:
    """One line when an export folder given as is also holds variants: it drafts with
    its float32 graph, which is rarely what was meant."""
    have = _variant_dirs(folder)
    if have:
        pick = next((v for v in ("int4", "int8") if v in have), have[0])
        (echo or log.info)(f"draft {folder}: its float32 graph (it also holds "
                           f"{', '.join(have)}: {folder}/{pick} or "
                           f"{folder}+onnx-{pick} drafts with that one)")


def _torch_drafter(spec: str, runtime: str, dtype: str | None, threads: int | None):
    """``runtime`` ``torch`` (in ``dtype``) or ``torch-int8`` (float32 weights from the
    bf16 load, the draft's exact values, every Linear dynamically int8)."""
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import load_model

    if runtime == "torch":
        from edge_sdk.packed import packed_default

        model, tok = load_model(spec, threads=threads, packed=packed_default(),
                                **({"dtype": dtype} if dtype else {}))
        return TorchDrafter(model), tok
    from edge_sdk.drafters.torch import quantize_dynamic_int8

    model, tok = load_model(spec, dtype="bfloat16", threads=threads)
    return TorchDrafter(quantize_dynamic_int8(model.float())), tok
