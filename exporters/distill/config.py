"""The distiller's settings (:class:`DistillConfig`) and its work-dir bookkeeping: every
stage's output is cached under a folder named by the hash of the settings it depends
on, so a rerun resumes where it stopped and a changed setting rebuilds only what it
touches."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DistillConfig:
    """Every knob of :func:`run_distill` (see ``specrelay draft distill --help``)."""

    target: str = "smollm2-135m"
    out: str = "distilled-draft"
    work_dir: str = "distill-work"
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5])
    head_vocab: int = 12288
    seed: int = 0
    threads: int = 1
    data_dtype: str = "bfloat16"
    train_dtype: str = "bfloat16"
    builtin_prompts: bool = True
    prompts_files: list[str] = field(default_factory=list)
    heldout_frac: float = 0.1
    heldout_min: int = 12
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128
    gen_batch: int = 32
    samples_per_prompt: int = 1
    temperature: float = 0.8
    second_turns: bool = True
    corpus_tokens: int = 150_000
    corpus_dirs: list[str] = field(default_factory=list)
    chunk_tokens: int = 256
    topk: int = 64
    epochs: float = 4.0
    max_steps: int = 0
    batch_tokens: int = 2048
    lr: float = 5e-4
    warmup: int = 30
    weight_decay: float = 0.0
    ckpt_every: int = 50
    eval: bool = True
    eval_max_new_tokens: int = 128
    eval_depth: int = 4
    save_dtype: str = "float16"
    progress: bool = True

    def data_key(self) -> dict:
        """Settings every data shard depends on (the data dir is named by their hash).
        Optional stages (second turns, samples, corpus) name their shards by their own
        settings, so turning them on or off later reuses what exists."""
        keys = ("target", "seed", "data_dtype", "builtin_prompts", "prompts_files",
                "heldout_frac", "heldout_min", "max_prompt_tokens", "max_new_tokens",
                "gen_batch", "topk")
        return {k: getattr(self, k) for k in keys}

    def data_used(self) -> dict:
        """Everything that selects the training rows (for the train dir's hash)."""
        keys = ("samples_per_prompt", "temperature", "second_turns", "corpus_tokens",
                "corpus_dirs", "chunk_tokens")
        return self.data_key() | {k: getattr(self, k) for k in keys}

    def train_key(self) -> dict:
        keys = ("layers", "head_vocab", "train_dtype", "epochs", "max_steps",
                "batch_tokens", "lr", "warmup", "weight_decay", "seed")
        return {k: getattr(self, k) for k in keys} | {"data": self.data_used()}


def stable_hash(o) -> str:
    """10 hex chars of the SHA-256 of ``o`` as sorted JSON (names cache folders)."""
    return hashlib.sha256(json.dumps(o, sort_keys=True).encode()).hexdigest()[:10]


def atomic_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary sibling, then rename: a crash never leaves a
    half-written shard or checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def progress_bar(total, desc, enabled):
    """A tqdm bar on stderr (disabled unless ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def log(cfg: DistillConfig, msg: str) -> None:
    """``[distill] msg`` on stderr when ``cfg.progress``."""
    if cfg.progress:
        print(f"[distill] {msg}", file=sys.stderr, flush=True)


class WorkDir:
    """Work-dir layout: ``root/data-<hash of data_key>`` (shards of stages 1-3) and
    ``root/train-<hash of train_key>`` (checkpoint, eval), each with its ``config.json``."""

    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.root = Path(cfg.work_dir)
        self.data = self.root / f"data-{stable_hash(cfg.data_key())}"
        self.train = self.root / f"train-{stable_hash(cfg.train_key())}"
        self.data.mkdir(parents=True, exist_ok=True)
        self.train.mkdir(parents=True, exist_ok=True)
        for d, key in ((self.data, cfg.data_key()), (self.train, cfg.train_key())):
            (d / "config.json").write_text(json.dumps(key, indent=1, sort_keys=True))
