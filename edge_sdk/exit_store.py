"""Persisting exit heads (:class:`edge_sdk.exit_head.ExitHead`): one cache for the
edge's CATS drafting head and the cloud's FSD heads.

Heads are cached under ``$SPECRELAY_CACHE/exit-heads/<key>/L{layer}-v{K}.safetensors``
with a ``manifest.json`` beside them; ``<key>`` hashes the model's name, shape and a
slice of its weights, so two models never share a head.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

from edge_sdk.exit_head import ExitHead, restricted_vocab

__all__ = ["model_key", "head_path", "save_exit_head", "load_exit_head"]

log = logging.getLogger(__name__)


def model_key(model) -> str:
    """Cache key of a model: its name, layer count, hidden size, vocabulary size and a
    hash of a slice of its LM head and final norm (so two fine-tunes of one config do
    not share a head): ``<name>-<16 hex>``."""
    cfg = model.config
    name = str(getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", "model"))
    h = hashlib.sha256(f"{name}|{cfg.num_hidden_layers}|{cfg.hidden_size}|"
                       f"{cfg.vocab_size}".encode())
    with torch.inference_mode():
        head = model.get_output_embeddings().weight
        h.update(head[:8].float().cpu().numpy().tobytes())
        h.update(model.model.norm.weight.float().cpu().numpy().tobytes())
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or "model")[:40]
    return f"{base}-{h.hexdigest()[:16]}"


def head_path(model, layer: int, vocab: int | None) -> Path:
    """``$SPECRELAY_CACHE/exit-heads/<model_key>/L{layer}-v{K}.safetensors`` (K = the
    requested vocabulary size, ``full`` for None)."""
    from edge_sdk.cache import cache_dir

    return (cache_dir() / "exit-heads" / model_key(model)
            / f"L{layer}-v{'full' if vocab is None else int(vocab)}.safetensors")


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename onto ``path`` (readers never see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_exit_head(head: ExitHead, vocab: int | None, meta: dict) -> Path:
    """Write ``head``'s translator and vocabulary to :func:`head_path` and record
    ``meta`` (plus layer, vocab, accept_topk, model, date) under its file name in the
    ``manifest.json`` beside it, both atomically. Raises ValueError for a head without
    a translator."""
    from safetensors.torch import save_file

    if head.weight is None or head.bias is None:
        raise ValueError("save_exit_head: an untrained head has nothing to save")
    path = head_path(head.model, head.layer, vocab)
    info = {"layer": head.layer, "vocab": vocab, "accept_topk": head.accept_topk,
            "model": str(getattr(head.model.config, "name_or_path", "")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")} | dict(meta)
    tensors = {"weight": head.weight.float().contiguous(),
               "bias": head.bias.float().contiguous()}
    if head.vocab_ids is not None:
        tensors["vocab_ids"] = head.vocab_ids.long().contiguous()
    _atomic_write(path, lambda p: save_file(tensors, str(p), {"info": json.dumps(info)}))
    mpath = path.with_name("manifest.json")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError):
        manifest = {}
    manifest[path.name] = info
    _atomic_write(mpath, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))
    return path


def load_exit_head(model, layer: int, vocab: int | None, accept_topk: int = 1
                   ) -> ExitHead | None:
    """The cached tuned head of ``model`` at ``layer`` over the first ``vocab`` ids, or
    None when there is none or it does not fit (shape or vocabulary mismatch: a stale
    file is ignored, never trusted). ``accept_topk`` is the provisional rule to use."""
    from safetensors.torch import load_file

    path = head_path(model, layer, vocab)
    try:
        t = load_file(str(path))
    except (OSError, ValueError, RuntimeError):
        return None
    H, want = int(model.config.hidden_size), restricted_vocab(model, vocab)
    ids = t.get("vocab_ids")
    if t["weight"].shape != (H, H) or t["bias"].shape != (H,) or (
            (ids is None) != (want is None) or (ids is not None and not torch.equal(ids, want))):
        log.warning("ignoring exit head %s: it does not match the model", path)
        return None
    dev = model.get_output_embeddings().weight.device   # the meta embedding of a CATS
    # local target is no guide
    return ExitHead(model, layer, weight=t["weight"].to(dev), bias=t["bias"].to(dev),
                    vocab_ids=None if ids is None else ids.to(dev), accept_topk=accept_topk,
                    name=f"tuned-L{layer}-v{vocab or 'full'}")
