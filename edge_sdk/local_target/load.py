"""Opening a budgeted local target from a preset, and its drafting exit head.

The checkpoint is the dequantised safetensors file the model loader caches
(``$SPECRELAY_CACHE/gguf/<name>-<key>-<dtype>/model.safetensors``); it is the emulated
*storage* the streamed layers are read from. The exit head at the plan's layer is the
tuned lens (Belrose et al. 2023, §3): loaded from the shared head cache
(:mod:`edge_sdk.exit_store`, the same files the cloud's FSD heads use) or fitted once on
the local target itself (one teacher-forced pass per calibration sequence; only the
exit layer's and the last layer's residual streams are kept).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path
from typing import Sequence

import torch

from edge_sdk.exit_head import ExitHead, fit_translator, restricted_vocab
from edge_sdk.exit_store import load_exit_head, save_exit_head
from edge_sdk.local_target.budget import Plan, Sizes, parse_bytes, plan
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.storage import Storage, parse_profile
from edge_sdk.packed import packed_default, packing_supported

__all__ = ["LocalTarget", "sizes_of", "checkpoint_dir", "open_local_target",
           "fit_local_head", "local_head", "DRAFT_VOCAB"]

log = logging.getLogger(__name__)

DRAFT_VOCAB = 32768
"""The drafts' vocabulary: the first 32768 ids + the special ones (FR-Spec subset)."""


@dataclass
class LocalTarget:
    """An opened local target: the runner, its plan, its drafting head (an exit head,
    a :class:`~.skip.SkipDraft` for a ``skip`` plan, a :class:`~.quant.QuantDraft` for
    a ``quant`` plan; None before one is attached) and the tokenizer."""

    target: OffloadedTarget
    plan: Plan
    tokenizer: object
    head: ExitHead | None = None


def sizes_of(storage: Storage, config) -> Sizes:
    """Byte sizes of the checkpoint's parts (layer 0 stands for every layer)."""
    L = int(config.num_hidden_layers)
    layer = sum(storage.nbytes(k) for k in storage.entries if k.startswith("model.layers.0."))
    embed = storage.nbytes("model.embed_tokens.weight")
    head = storage.nbytes("lm_head.weight") if "lm_head.weight" in storage.entries else 0
    item = storage.nbytes("model.norm.weight") // int(config.hidden_size)
    n_kv = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
    hd = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return Sizes(layer, head, embed, storage.nbytes("model.norm.weight"), L,
                 int(config.hidden_size), int(config.vocab_size), 2 * L * n_kv * hd * item)


def checkpoint_dir(name: str, dtype: str = "bfloat16") -> Path:
    """The cached safetensors folder of preset/model ``name`` in ``dtype``, created by
    one ordinary load when missing. Raises FileNotFoundError for a model that is not
    a GGUF preset (no single checkpoint file to stream from)."""
    from edge_sdk.models import _gguf_cache_path, load_model, resolve

    spec = resolve(name)
    if not spec.gguf_file:
        path = Path(spec.path)
        if (path / "model.safetensors").exists():
            return path
        raise FileNotFoundError(f"{name}: no single model.safetensors to stream from")
    path = _gguf_cache_path(spec, dtype)
    if not (path / "model.safetensors").exists():
        load_model(spec, dtype=dtype)          # dequantises and caches once
    return path


def open_local_target(name: str, budget: str | int | float, storage: str = "nvme",
                      dtype: str = "bfloat16", max_ctx: int = 2048,
                      quant: bool = True) -> LocalTarget:
    """Open ``name`` under ``budget`` (bytes, ``1.5GB`` or a fraction of the weights)
    on emulated ``storage`` (``nvme``, ``emmc``, ``ram``, ``<rate>MB/s``). ``quant``:
    the plan may choose the quantized self-draft (bf16 and torch's CPU int4 kernels
    only); False for the target alone, which spends the whole budget on bf16 layers.

    Raises ValueError (budget too small or unparsable), FileNotFoundError."""
    from transformers import AutoConfig, GenerationConfig

    from edge_sdk.models import DTYPES, load_tokenizer

    folder = checkpoint_dir(name, dtype)
    store = Storage(folder / "model.safetensors", parse_profile(storage))
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    s = sizes_of(store, config)
    packed = (packed_default() and dtype == "bfloat16"
              and packing_supported(torch.bfloat16))
    from edge_sdk.local_target.quant import int4_supported

    drafts = ("exit", "skip") + (("quant",) if quant and dtype == "bfloat16"
                                 and int4_supported() else ())
    p = plan(s, parse_bytes(budget, s.weights), store.profile.bytes_per_s, max_ctx,
             drafts=drafts, packed=packed)
    try:
        gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
    except OSError:
        gen = None                               # the config's own eos ids then
    # packed (SPECRELAY_PACKED, default on): the resident linears, and the head unless
    # the early exit's head reads its dense rows; the skip draft's vocabulary is a set
    # of the packed head's chunks (the ids SkipDraft(t, DRAFT_VOCAB) will ask for)
    pack_head = not (p.draft == "exit" and p.depth)
    ids = restricted_vocab(SimpleNamespace(config=config, generation_config=gen), DRAFT_VOCAB)
    t = OffloadedTarget(store, config, p.resident_layers, DTYPES[dtype], p.resident_embed,
                        p.tail_layers, packed=packed, pack_head=pack_head,
                        draft_ids=ids, layer_set=p.layer_set or None)
    if gen is not None:
        t.model.generation_config = gen
    return LocalTarget(t, p, load_tokenizer(name))


@torch.inference_mode()
def fit_local_head(t: OffloadedTarget, seqs: Sequence[Sequence[int]], layer: int,
                   vocab: int | None, ridge: float = 1e-2) -> ExitHead:
    """The tuned-lens translator at ``layer`` fitted on teacher-forced ``seqs`` run
    through the local target (:func:`edge_sdk.exit_head.fit_translator`).
    Raises ValueError for no tokens or a layer outside 1..L-1."""
    xs, ys = [], []
    for s in seqs:
        if len(s) < 2:
            continue
        t.reset()
        h = t.run_layers(t.embed(list(s)), 0, layer)
        xs.append(h[0].float())
        ys.append(t.run_layers(h, layer, t.num_layers)[0].float())
    t.reset()
    if not xs:
        raise ValueError("fit_local_head: no sequence of 2+ tokens")
    w, b = fit_translator(torch.cat(xs), torch.cat(ys), ridge)
    return ExitHead(t.model, layer, weight=w, bias=b, vocab_ids=restricted_vocab(t.model, vocab),
                    name=f"tuned-L{layer}-v{vocab or 'full'}")


def local_head(t: OffloadedTarget, layer: int, vocab: int | None = 32768,
               seqs: Sequence[Sequence[int]] | None = None) -> ExitHead:
    """The cached tuned head at ``layer``, else one fitted on ``seqs`` and cached.
    Raises LookupError when none is cached and no ``seqs`` are given."""
    head = load_exit_head(t.model, layer, vocab)
    if head is not None:
        return head
    if not seqs:
        raise LookupError(f"no cached exit head at layer {layer}: pass calibration "
                          "sequences to fit one")
    log.info("fitting the CATS exit head at layer %d on %d sequences (once)", layer, len(seqs))
    head = fit_local_head(t, seqs, layer, vocab)
    save_exit_head(head, vocab, {"fitted_by": "edge_sdk.local_target", "sequences": len(seqs)})
    return head
