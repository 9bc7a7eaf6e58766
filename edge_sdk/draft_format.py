"""The stored draft format: a small draft that shares its target's embedding and head.

A draft folder holds ``config.json``, ``model.safetensors`` with ONLY the draft's own
decoder layers and final norm, optionally ``draft_vocab.safetensors`` (the kept ids of a
reduced output head) and the manifest ``specrelay_draft.json`` naming the target. The
token embedding and LM head are the target's own tensors, shared and frozen, so a draft
of a few layers costs a few layers of storage (drafts made of the target's own early
layers, as in LayerSkip's self-speculation, Elhoushi et al. 2024). Built by the
distiller (``exporters.distill``), loaded by ``edge_sdk.models.load_model``; this module
imports neither.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ReducedHead", "build_draft", "save_draft", "load_draft", "is_draft_folder",
           "trained_state", "trainable_parameters", "embed_fingerprint", "MANIFEST_NAME",
           "WEIGHTS_NAME", "VOCAB_NAME", "EVAL_NAME", "FORMAT", "FORMAT_VERSION"]

MANIFEST_NAME = "specrelay_draft.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_NAME = "draft_vocab.safetensors"
EVAL_NAME = "eval.json"
FORMAT = "specrelay-draft"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- model parts

class ReducedHead(torch.nn.Module):
    """LM head restricted to ``kept_ids``; returns logits over the FULL vocabulary.

    Args:
        weight: float [V, H], the full (shared, frozen) output embedding.
        kept_ids: long [V'] token ids the draft may propose (sorted ascending here, so
            argmax ties still resolve to the lowest full-vocabulary id).

    ``forward(h)``: h float [..., H] -> logits [..., V], ``-inf`` outside ``kept_ids``;
    softmax of the result is therefore a distribution over all V ids that is exactly 0
    outside the kept set. ``sub_logits(h)`` -> [..., V'] (training: no -inf padding).
    Only the [V', H] sub-matrix is held (a non-persistent buffer): nothing of it is saved.
    """

    def __init__(self, weight: torch.Tensor, kept_ids: torch.Tensor):
        super().__init__()
        kept = torch.unique(kept_ids.long())  # sorted, no duplicates
        V = int(weight.shape[0])
        if kept.numel() == 0 or int(kept[0]) < 0 or int(kept[-1]) >= V:
            raise ValueError(f"kept_ids must be non-empty ids in 0..{V - 1}")
        self.vocab_size = V
        self.register_buffer("kept_ids", kept, persistent=False)
        self.register_buffer("sub_weight", weight.detach()[kept].clone(), persistent=False)

    def sub_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits over the kept ids only, [..., V']."""
        return F.linear(h, self.sub_weight.to(h.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.sub_logits(h)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy(-1, self.kept_ids, sub)


def _decoder(model):
    """(layers ModuleList, final norm) of a Llama-family causal LM."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ValueError(f"{type(model).__name__}: expected model.model.layers and "
                         "model.model.norm (Llama-family architecture)")
    return inner.layers, inner.norm


def _draft_config(target_config, n_layers: int):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    cfg.__dict__.pop("quantization_config", None)
    return cfg


def build_draft(target, layers: Sequence[int], kept_ids: torch.Tensor | None = None):
    """A draft built from ``target`` (not modified, weights shared where noted).

    Args:
        target: HF Llama-family causal LM (float32).
        layers: target layer indices copied into draft layers 0..N-1 (``[0, 1, 2, 3]``).
        kept_ids: optional long [V'] ids for a reduced output head (:class:`ReducedHead`).
    Returns:
        A causal LM with N decoder layers (fresh copies, trainable), a copied final norm
        (trainable), and the target's embedding / LM head tensors shared and frozen.
    """
    from transformers import AutoModelForCausalLM

    t_layers, t_norm = _decoder(target)
    L = len(t_layers)
    layers = [int(i) for i in layers]
    if not layers or any(not 0 <= i < L for i in layers):
        raise ValueError(f"layers {layers} must be non-empty indices in 0..{L - 1}")
    cfg = _draft_config(target.config, len(layers))
    dtype = next(target.parameters()).dtype
    draft = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    d_layers, d_norm = _decoder(draft)
    with torch.no_grad():
        for j, i in enumerate(layers):
            d_layers[j].load_state_dict(t_layers[i].state_dict())
        d_norm.load_state_dict(t_norm.state_dict())
    # Shared, frozen parts: the very tensors of the target (no copy).
    draft.model.embed_tokens.weight = target.get_input_embeddings().weight
    draft.lm_head.weight = target.get_output_embeddings().weight
    if kept_ids is not None:
        draft.lm_head = ReducedHead(target.get_output_embeddings().weight, kept_ids)
    draft.model.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    draft.generation_config = copy.deepcopy(getattr(target, "generation_config", None)) \
        or draft.generation_config
    return draft.eval()


def trained_state(draft) -> dict[str, torch.Tensor]:
    """The stored (trained) tensors: ``model.layers.*`` and ``model.norm.*``."""
    return {k: v for k, v in draft.state_dict().items()
            if k.startswith("model.layers.") or k.startswith("model.norm.")}


def trainable_parameters(draft) -> list[torch.nn.Parameter]:
    layers, norm = _decoder(draft)
    return list(layers.parameters()) + list(norm.parameters())


def embed_fingerprint(model) -> str:
    """SHA-256 (16 hex) of the float32 input embedding: identifies the shared tensor."""
    w = model.get_input_embeddings().weight.detach().float().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def save_draft(draft, out: str | Path, target_name: str, layers: Sequence[int],
               save_dtype: str = "float16", extra: dict | None = None,
               target=None) -> Path:
    """Write the draft folder: config.json, model.safetensors (trained tensors only, in
    ``save_dtype``), draft_vocab.safetensors (when the head is reduced) and the manifest.

    Args:
        draft: model from :func:`build_draft`.
        out: folder (created).
        target_name: how :func:`edge_sdk.models.load_model` finds the target again
            (preset name or path); written to the manifest.
        layers: the target layers the draft was initialised from (recorded).
        target: the target model, to fingerprint the shared embedding (optional).
    Returns:
        The folder path.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stored = _write_weights(draft, out, save_dtype)
    head = draft.lm_head
    reduced = isinstance(head, ReducedHead)
    _write_vocab_map(head if reduced else None, out)
    manifest = _manifest(draft, target_name, layers, stored, save_dtype, target)
    if extra:
        manifest.update(extra)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _write_weights(draft, out: Path, save_dtype: str) -> list[str]:
    """``model.safetensors`` (the trained tensors in ``save_dtype``) and ``config.json``
    in ``out``. Returns the stored tensor names, sorted."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(_DTYPES[save_dtype]).contiguous()
             for k, v in trained_state(draft).items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    cfg = copy.deepcopy(draft.config)
    cfg.torch_dtype = save_dtype
    cfg.architectures = [type(draft).__name__]
    cfg.save_pretrained(out)
    return sorted(state)


def _write_vocab_map(head: ReducedHead | None, out: Path) -> None:
    """``draft_vocab.safetensors`` (the kept token ids, int64 [K]) for a reduced head;
    removes a stale one for a full-vocabulary head."""
    from safetensors.torch import save_file

    if head is not None:
        save_file({"kept_ids": head.kept_ids.to(torch.int64).contiguous()},
                  str(out / VOCAB_NAME))
    elif (out / VOCAB_NAME).exists():
        (out / VOCAB_NAME).unlink()


def _manifest(draft, target_name: str, layers: Sequence[int], stored: list[str],
              save_dtype: str, target) -> dict:
    """The manifest (``specrelay_draft.json``) of a draft folder."""
    head = draft.lm_head
    reduced = isinstance(head, ReducedHead)
    tied = bool(getattr(draft.config, "tie_word_embeddings", False))
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "target": target_name,
        "target_embed_sha256": embed_fingerprint(target) if target is not None else None,
        "init_layers": [int(i) for i in layers],
        "num_hidden_layers": int(draft.config.num_hidden_layers),
        "stored": stored,
        "stored_dtype": save_dtype,
        "shared_from_target": {
            "model.embed_tokens.weight": "target model.embed_tokens.weight (frozen)",
            "lm_head.weight": ("tied to model.embed_tokens.weight" if tied
                               else "target lm_head.weight (frozen)"),
        },
        "head_vocab": int(head.kept_ids.numel()) if reduced else None,
        "vocab_map": VOCAB_NAME if reduced else None,
        "rebuild": ("edge_sdk.models.load_model(target) in float32; copy the stored "
                    "layers/norm into a config.json-shaped model; share the target's "
                    "embedding and LM head; when vocab_map is set, restrict the head to "
                    "its kept_ids (full-vocab logits, -inf elsewhere). "
                    "Use edge_sdk.models.load_model(folder)."),
    }


def is_draft_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a stored draft (its manifest)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def load_draft(folder: str | Path, dtype: str = "float32", target=None,
               threads: int | None = None, check_target: bool = True, load_target=None):
    """Rebuild a trained draft from its target plus the stored layers.

    Args:
        folder: the draft folder (``edge_sdk.models.load_model`` also takes presets).
        dtype: ``float32`` (default), ``bfloat16`` or ``float16`` for the returned model.
        target: optional already-loaded ``(model, tokenizer)`` of the target, or a model
            spec string overriding the manifest's ``target`` (saves a second load).
        threads: torch intra-op threads (None: unchanged).
        check_target: refuse a target whose embedding differs from the one trained with.
        load_target: ``(spec, dtype=) -> (model, tokenizer)`` loading the target named by
            a string (``edge_sdk.models.load_model``); needed unless ``target`` is given
            as a loaded pair.
    Returns:
        ``(model, tokenizer)``: eval mode, no grad; ``model(input_ids=..., cache=...,
        use_cache=True).logits`` is float [B, T, V] over the full vocabulary (``-inf``
        outside the kept ids for a reduced head).
    Raises:
        FileNotFoundError: no manifest; ValueError: wrong format or mismatched target.
    """
    folder = Path(folder)
    man = _read_manifest(folder)
    if threads:
        torch.set_num_threads(threads)
    tmodel, tok = _float32_target(target, man, load_target)
    want = man.get("target_embed_sha256")
    if check_target and want and embed_fingerprint(tmodel) != want:
        raise ValueError(f"{folder}: target {man['target']!r} has a different embedding "
                         "than the one this draft was trained with")
    draft = _rebuild(folder, man, tmodel)
    draft = draft.to(_DTYPES[dtype]).eval()
    draft.requires_grad_(False)
    return draft, tok


def _read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``. Raises FileNotFoundError (none there) or ValueError
    (another format, or a newer version)."""
    if not is_draft_folder(folder):
        raise FileNotFoundError(f"{folder}: no {MANIFEST_NAME}")
    man = json.loads((folder / MANIFEST_NAME).read_text())
    if man.get("format") != FORMAT or int(man.get("version", 0)) > FORMAT_VERSION:
        raise ValueError(f"{folder}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    return man


def _float32_target(target, man: dict, load_target):
    """``(model, tokenizer)`` of the target in float32: ``target`` as a loaded pair
    (copied to float32 when it is not), else loaded by name with ``load_target`` (the
    given name, or the manifest's). Raises ValueError: a name but no ``load_target``."""
    if target is None or isinstance(target, (str, Path)):
        if load_target is None:
            raise ValueError("load_draft needs load_target to load a target by name")
        return load_target(str(target or man["target"]), dtype="float32")
    tmodel, tok = target
    tmodel = tmodel if next(tmodel.parameters()).dtype == torch.float32 else \
        copy.deepcopy(tmodel).float()
    return tmodel, tok


def _rebuild(folder: Path, man: dict, tmodel):
    """The draft built on ``tmodel`` (float32) with the stored tensors copied in.
    Raises ValueError: the stored tensors are not the rebuilt draft's trained ones."""
    from safetensors.torch import load_file

    kept = None
    if man.get("vocab_map"):
        kept = load_file(str(folder / man["vocab_map"]))["kept_ids"].long()
    state = load_file(str(folder / WEIGHTS_NAME))
    n = int(man["num_hidden_layers"])
    draft = build_draft(tmodel, list(range(n)), kept)  # init is overwritten below
    own = trained_state(draft)
    if set(own) != set(state):
        raise ValueError(f"{folder}: stored tensors {sorted(set(state) ^ set(own))[:4]} "
                         "do not match the rebuilt draft")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))
    return draft
