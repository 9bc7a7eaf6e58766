"""Stages 1-3 of the distiller: prompts and their split, the target's generated data
(greedy continuations, MT-Bench second turns, sampled continuations) and teacher-forced
corpus data. Every batch is one shard in the data dir (``WorkDir.data``); a shard that
exists is read back instead of recomputed, so an interrupted run resumes."""

from __future__ import annotations

import json
import time

import torch

from exporters.distill.config import (DistillConfig, WorkDir, atomic_save, log,
                                      progress_bar, stable_hash)
from exporters.distill.corpus import corpus_chunks, default_corpus_dirs
from exporters.distill.prompts import (PromptItem, builtin_prompts, domain_of,
                                       read_prompts_file, split_prompts)
from exporters.distill.teacher import generate_batch, teacher_prefill


def encode_item(tok, item: PromptItem) -> list[int]:
    """Prompt ids of ``item`` (chat template for chat prompts, raw for completions)."""
    from edge_sdk.models import encode_prompt

    return encode_prompt(tok, item.text, chat=item.kind == "chat")


def _chat_ids(tok, msgs: list[dict]) -> list[int]:
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    text = "\n".join(m["content"] for m in msgs)
    return list(tok.encode(text, add_special_tokens=False))


def pad_id(model, tok) -> int:
    """The tokenizer's pad id, else the first EOS id, else 0."""
    from edge_sdk.models import eos_ids

    eos = eos_ids(model, tok)
    return int(tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0))


def _gen_stage(cfg, st, model, tok, name, jobs, temperature, seed_off) -> list[dict]:
    """Run generation jobs [(meta dict, prompt ids)] in batches; one shard per batch."""
    from edge_sdk.models import eos_ids

    eos = eos_ids(model, tok)
    pad = pad_id(model, tok)
    order = sorted(range(len(jobs)), key=lambda n: (len(jobs[n][1]), n))
    batches = [order[s:s + cfg.gen_batch] for s in range(0, len(order), cfg.gen_batch)]
    rows: list[dict] = []
    bar = progress_bar(len(batches), f"generate {name}", cfg.progress)
    for bi, batch in enumerate(batches):
        shard = st.data / f"{name}-{bi:05d}.pt"
        if shard.exists():
            part = torch.load(shard, weights_only=False)
        else:
            g = torch.Generator().manual_seed(cfg.seed * 1000003 + seed_off * 7919 + bi)
            t0 = time.perf_counter()
            res = generate_batch(model, [jobs[n][1] for n in batch], cfg.max_new_tokens, eos,
                                 cfg.topk, temperature, g, pad_id=pad)
            part = [jobs[n][0] | r for n, r in zip(batch, res)]
            new = sum(len(r["ids"]) - r["prompt_len"] for r in part)
            bar.set_postfix(tok_s=f"{new / (time.perf_counter() - t0):.0f}")
            atomic_save(part, shard)
        rows += part
        bar.update(1)
    bar.close()
    return rows


def _prompt_items(cfg: DistillConfig) -> list[PromptItem]:
    """The built-in and user prompts. Raises ValueError: none and no corpus, or a
    duplicate id."""
    items = builtin_prompts() if cfg.builtin_prompts else []
    for f in cfg.prompts_files:
        items += read_prompts_file(f)
    if not items and cfg.corpus_tokens <= 0:
        raise ValueError("no prompts and no corpus: nothing to distil on")
    ids_seen = set()
    for it in items:
        if it.id in ids_seen:
            raise ValueError(f"duplicate prompt id {it.id}")
        ids_seen.add(it.id)
    return items


def _second_turn_jobs(cfg, tok, train: list[PromptItem], rows: list[dict]) -> list:
    """MT-Bench second turns after the target's own first answer (chat template only)."""
    by_id = {it.id: it for it in train}
    jobs = []
    for r in rows:
        it = by_id[r["id"]]
        if it.kind == "chat" and it.turn2 and getattr(tok, "chat_template", None):
            ans = tok.decode(r["ids"][r["prompt_len"]:].tolist(), skip_special_tokens=True)
            ids = _chat_ids(tok, [{"role": "user", "content": it.text},
                                  {"role": "assistant", "content": ans.strip()},
                                  {"role": "user", "content": it.turn2}])
            if len(ids) <= cfg.max_prompt_tokens:
                jobs.append(({"id": it.id + "#2", "kind": "chat"}, ids))
    return jobs


def _corpus_chunks(cfg: DistillConfig, st: WorkDir, tok) -> tuple[str, list]:
    """(cache key, [(kind, ids)]) of the corpus windows, cached in the data dir."""
    dirs = cfg.corpus_dirs or default_corpus_dirs()
    ckey = stable_hash([cfg.corpus_tokens, [str(d) for d in dirs], cfg.chunk_tokens])
    cpath = st.data / f"corpus-{ckey}-ids.pt"
    if cpath.exists():
        return ckey, torch.load(cpath, weights_only=False)
    log(cfg, f"reading corpus text under {', '.join(map(str, dirs))}")
    chunks = corpus_chunks(tok, dirs, cfg.corpus_tokens, cfg.chunk_tokens, cfg.seed)
    atomic_save(chunks, cpath)
    return ckey, chunks


def _corpus_stage(cfg: DistillConfig, st: WorkDir, model, tok) -> list[dict]:
    """Stage 3: teacher prefill over the corpus windows, one shard per batch."""
    ckey, chunks = _corpus_chunks(cfg, st, tok)
    per = max(1, cfg.gen_batch // 2)
    nb = (len(chunks) + per - 1) // per
    rows: list[dict] = []
    bar = progress_bar(nb, "teacher prefill corpus", cfg.progress)
    for bi in range(nb):
        shard = st.data / f"corpus-{ckey}-{bi:05d}.pt"
        if shard.exists():
            part = torch.load(shard, weights_only=False)
        else:
            sub = chunks[bi * per:(bi + 1) * per]
            t0 = time.perf_counter()
            res = teacher_prefill(model, [c[1] for c in sub], cfg.topk)
            part = [{"id": f"corpus/{bi}/{n}", "kind": k} | r
                    for n, ((k, _), r) in enumerate(zip(sub, res))]
            bar.set_postfix(tok_s=f"{sum(len(c[1]) for c in sub) / (time.perf_counter() - t0):.0f}")
            atomic_save(part, shard)
        rows += part
        bar.update(1)
    bar.close()
    return rows


def build_data(cfg: DistillConfig, st: WorkDir, model, tok) -> tuple[list[dict], list[PromptItem]]:
    """Stages 1-3: prompts split, generated data, teacher-forced corpus data.
    Returns (training rows, held-out prompts)."""
    train, held = split_prompts(_prompt_items(cfg), cfg.heldout_frac, cfg.heldout_min,
                                cfg.seed)
    (st.data / "split.json").write_text(json.dumps(
        {"train": [it.id for it in train], "heldout": [it.id for it in held]}, indent=0))
    jobs = []
    for it in train:
        ids = encode_item(tok, it)
        if len(ids) <= cfg.max_prompt_tokens:
            jobs.append(({"id": it.id, "kind": domain_of(it.source, it.kind)}, ids))
    rows = _gen_stage(cfg, st, model, tok, "greedy", jobs, 0.0, 0)
    if cfg.second_turns:
        rows += _gen_stage(cfg, st, model, tok, "turn2",
                           _second_turn_jobs(cfg, tok, train, rows), 0.0, 1)
    for s in range(cfg.samples_per_prompt):
        rows += _gen_stage(cfg, st, model, tok, f"sample{s}-t{cfg.temperature:g}", jobs,
                           cfg.temperature, 2 + s)
    if cfg.corpus_tokens > 0:
        rows += _corpus_stage(cfg, st, model, tok)
    return rows, held
