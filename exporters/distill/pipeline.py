"""The whole distiller, stage after stage (:func:`run_distill`; the stages are listed in
:mod:`exporters.distill`), then the output draft folder (:mod:`edge_sdk.draft_format`)
and its ``eval.json``."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from edge_sdk.draft_format import EVAL_NAME, build_draft, save_draft, trained_state
from exporters.distill.config import DTYPES, DistillConfig, WorkDir, log
from exporters.distill.data import build_data
from exporters.distill.evaluate import cost, evaluate, heldout_paths
from exporters.distill.train import choose_vocab, train


def _count_kinds(rows):
    out: dict[str, int] = {}
    for r in rows:
        out[r["kind"]] = out.get(r["kind"], 0) + len(r["ids"]) - 1
    return out


def _kept_ids(cfg: DistillConfig, tmodel, tok, rows) -> torch.Tensor | None:
    """The reduced head's ids (:func:`choose_vocab`; EOS and special ids always kept),
    or None for a full head."""
    if not (cfg.head_vocab and cfg.head_vocab < int(tmodel.config.vocab_size)):
        return None
    from edge_sdk.models import eos_ids

    always = set(eos_ids(tmodel, tok)) | set(getattr(tok, "all_special_ids", []))
    return choose_vocab(rows, int(tmodel.config.vocab_size), cfg.head_vocab, always)


def _round_to_save_dtype(draft, save_dtype: str) -> None:
    """Evaluate exactly what gets stored: round the trained tensors to ``save_dtype``."""
    with torch.no_grad():
        for v in trained_state(draft).values():
            v.copy_(v.to(DTYPES[save_dtype]).to(v.dtype))


def _heldout(cfg: DistillConfig, st: WorkDir, tmodel, tok, held, draft) -> dict:
    """Stage 5: the trained draft, its untrained initialisation and the target's first
    ``len(cfg.layers)`` layers on the held-out paths, and the decode cost."""
    paths = heldout_paths(cfg, st, tmodel, tok, held)
    ev = evaluate(draft.float(), paths, cfg.eval_depth)
    base = evaluate(build_draft(tmodel, cfg.layers), paths, cfg.eval_depth)
    trunc = evaluate(build_draft(tmodel, list(range(len(cfg.layers)))), paths,
                     cfg.eval_depth)
    return {"heldout": ev, "heldout_untrained_init": base,
            "heldout_truncated_baseline": trunc,
            "heldout_prompt_ids": [p["id"] for p in paths],
            "speed": cost(draft.float(), tmodel)}


def _data(cfg: DistillConfig, st: WorkDir, tmodel, tok) -> tuple[list[dict], list, float]:
    """Stages 1-3 with the target in ``cfg.data_dtype`` (a copy unless float32).
    -> (rows of at least 2 tokens, held-out prompts, seconds). Raises ValueError: no
    training data."""
    dmodel = tmodel if cfg.data_dtype == "float32" else copy.deepcopy(tmodel).to(
        DTYPES[cfg.data_dtype])
    t0 = time.perf_counter()
    rows, held = build_data(cfg, st, dmodel, tok)
    data_s = time.perf_counter() - t0
    del dmodel
    rows = [r for r in rows if len(r["ids"]) >= 2]
    if not rows:
        raise ValueError("no training data")
    return rows, held, data_s


def run_distill(cfg: DistillConfig) -> dict:
    """Run the whole pipeline (resumable) and write ``cfg.out``. Returns the eval dict
    (also written to ``<out>/eval.json`` and ``<work>/train-*/eval.json``)."""
    from edge_sdk.models import load_model

    t_start = time.perf_counter()
    torch.set_num_threads(max(1, cfg.threads))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    st = WorkDir(cfg)
    log(cfg, f"work dir {st.root} (data {st.data.name}, train {st.train.name})")
    tmodel, tok = load_model(cfg.target, dtype="float32")
    rows, held, data_s = _data(cfg, st, tmodel, tok)
    kept = _kept_ids(cfg, tmodel, tok, rows)
    torch.manual_seed(cfg.seed)
    draft = build_draft(tmodel, cfg.layers, kept)
    n_gen = sum(len(r["ids"]) - r["prompt_len"] for r in rows if not r["kind"].startswith("corpus"))
    n_all = sum(len(r["ids"]) - 1 for r in rows)
    log(cfg, f"data: {len(rows)} sequences, {n_all} teacher positions "
             f"({n_gen} generated tokens), {data_s:.0f} s")
    summary = train(cfg, st, draft, rows)
    _round_to_save_dtype(draft, cfg.save_dtype)
    result = {"target": cfg.target, "layers": cfg.layers, "head_vocab": cfg.head_vocab or None,
              "data": {"sequences": len(rows), "teacher_positions": n_all,
                       "generated_tokens": n_gen, "data_seconds": round(data_s, 1),
                       "by_kind": _count_kinds(rows)},
              "train": summary}
    if cfg.eval:
        result |= _heldout(cfg, st, tmodel, tok, held, draft)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    man_extra = {"training": {"config": dataclasses.asdict(cfg) | {"progress": None},
                              "summary": summary}}
    save_draft(draft, cfg.out, cfg.target, cfg.layers, cfg.save_dtype, man_extra, tmodel)
    for folder in (Path(cfg.out), st.train):
        (folder / EVAL_NAME).write_text(json.dumps(result, indent=1) + "\n")
    return result
