"""Stage 4 of the distiller: train the draft's own layers to match the target.

Loss: soft cross-entropy to the target's top-k distribution at every position (forward
KL up to the teacher's entropy), renormalised over the ids the draft head can produce;
AdamW, linear warm-up then cosine decay to 10 %, gradient clipping at 1.0, bf16
autocast (master weights float32). Batches are length-bucketed and shuffled per epoch
with a seeded RNG, so a run is deterministic and resumes exactly from its checkpoint.
"""

from __future__ import annotations

import math
import random
import time
from typing import Iterable

import torch

from edge_sdk.draft_format import ReducedHead, trainable_parameters, trained_state
from exporters.distill.config import (DTYPES, DistillConfig, WorkDir, atomic_save, log,
                                      progress_bar)


def choose_vocab(rows: list[dict], V: int, k: int, always: Iterable[int]) -> torch.Tensor:
    """The ``k`` most frequent ids among the data's tokens and the teacher's top-1
    predictions (ties: lower id), plus ``always`` (EOS, special tokens). long [<=k+|always|]."""
    cnt = torch.zeros(V, dtype=torch.long)
    for r in rows:
        cnt += torch.bincount(r["ids"].long(), minlength=V)
        if "tk" in r and r["tk"].numel():
            cnt += torch.bincount(r["tk"][:, 0].long(), minlength=V)
    always = sorted(set(int(a) for a in always if 0 <= int(a) < V))
    order = torch.argsort(-cnt, stable=True)
    keep = set(always)
    for i in order.tolist():
        if len(keep) >= max(k, len(always)):
            break
        keep.add(i)
    return torch.tensor(sorted(keep), dtype=torch.long)


def _batches(rows: list[dict], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of row indices (~batch_tokens padded tokens each),
    shuffled deterministically per epoch."""
    rng = random.Random(f"{seed}:{epoch}")
    idx = list(range(len(rows)))
    rng.shuffle(idx)
    idx.sort(key=lambda n: len(rows[n]["ids"]))
    out, cur, mx = [], [], 0
    for n in idx:
        L = len(rows[n]["ids"])
        if cur and max(mx, L) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, mx = [], 0
        cur.append(n)
        mx = max(mx, L)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _collate(rows: list[dict], batch: list[int], remap: torch.Tensor | None):
    """-> input ids [B, T] (right-padded), loss mask [B, T], teacher ids [N, k] (kept-head
    indices, -1 = not in the head), teacher probs [N, k] float32 (N = mask.sum())."""
    T = max(len(rows[n]["ids"]) for n in batch)
    B = len(batch)
    x = torch.zeros((B, T), dtype=torch.long)
    m = torch.zeros((B, T), dtype=torch.bool)
    tks, tps = [], []
    for b, n in enumerate(batch):
        r = rows[n]
        L = len(r["ids"])
        x[b, :L] = r["ids"].long()
        m[b, :L - 1] = True
        tks.append(r["tk"].long())
        tps.append(r["tp"].float())
    tk = torch.cat(tks)
    if remap is not None:
        tk = remap[tk]
    return x, m, tk, torch.cat(tps)


def _loss(draft, x, m, tk, tp):
    """Soft cross-entropy to the teacher's top-k (renormalised over the ids the head can
    produce) -> (loss, kl, agreement, n). kl = loss - H(teacher top-k)."""
    h = draft.model(input_ids=x).last_hidden_state[m]  # [N, H]
    head = draft.lm_head
    logits = head.sub_logits(h) if isinstance(head, ReducedHead) else head(h)
    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, V or V']
    valid = tk >= 0
    p = tp * valid
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    lq = logq.gather(-1, tk.clamp_min(0))
    ce = -(p * lq).sum(-1)
    ent = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)
    loss = ce.mean()
    top1 = torch.where(valid[:, 0], tk[:, 0], torch.full_like(tk[:, 0], -2))
    agree = (logq.argmax(-1) == top1).float().mean()
    return loss, float((ce - ent).detach().mean()), float(agree), int(h.shape[0])


@torch.no_grad()
def data_metrics(draft, rows, batches, remap, dtype) -> dict:
    """Mean top-k KL and top-1 agreement of ``draft`` on ``rows`` (token-weighted)."""
    tot, kl, ag = 0, 0.0, 0.0
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for b in batches:
            _, k, a, n = _loss(draft, *_collate(rows, b, remap))
            tot += n
            kl += k * n
            ag += a * n
    return {"kl": kl / max(tot, 1), "agreement": ag / max(tot, 1), "tokens": tot}




def _head_remap(draft) -> torch.Tensor | None:
    """Full-vocabulary id -> index in a reduced head (-1: not kept) [V]; None for a
    full head."""
    head = draft.lm_head
    if not isinstance(head, ReducedHead):
        return None
    remap = torch.full((head.vocab_size,), -1, dtype=torch.long)
    remap[head.kept_ids] = torch.arange(head.kept_ids.numel())
    return remap


def _lr_schedule(cfg: DistillConfig, total: int):
    """step -> learning rate: linear warm-up over ``cfg.warmup`` steps, then cosine from
    ``cfg.lr`` down to 10 % of it at step ``total``."""
    def lr_at(s):
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        f = (s - cfg.warmup) / max(1, total - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))

    return lr_at


def _probe(cfg: DistillConfig, rows: list[dict]):
    """Fixed probe set for before/after metrics: up to 64 rows, deterministic.
    -> (rows, batches)."""
    probe_idx = sorted(random.Random(cfg.seed).sample(range(len(rows)), min(64, len(rows))))
    probe_rows = [rows[n] for n in probe_idx]
    return probe_rows, _batches(probe_rows, cfg.batch_tokens, cfg.seed, -1)


def _resume(cfg: DistillConfig, ck, draft, opt, total: int) -> dict:
    """The training state (``step``, ``hist``, ``seconds``, ``before``) from checkpoint
    ``ck`` (loaded into ``draft`` and ``opt``), or a fresh one."""
    if not ck.exists():
        return {"step": 0, "hist": [], "seconds": 0.0, "before": None}
    s = torch.load(ck, weights_only=False)
    draft.load_state_dict(s["model"], strict=False)
    opt.load_state_dict(s["opt"])
    log(cfg, f"resumed training at step {s['step']}/{total}")
    return {k: s[k] for k in ("step", "hist", "seconds", "before")}


def _run_steps(cfg, draft, opt, params, rows, remap, dtype, per_epoch, total, state, ck):
    """Optimiser steps from ``state["step"]`` to ``total``, checkpointing every
    ``cfg.ckpt_every`` steps and at the end. Returns the training seconds in all."""
    lr_at = _lr_schedule(cfg, total)
    step, hist, t_spent = state["step"], state["hist"], state["seconds"]
    bar = progress_bar(total, "distill", cfg.progress)
    bar.update(step)
    t0 = time.perf_counter()
    ema_l = ema_a = None
    while step < total:
        epoch, within = divmod(step, per_epoch)
        batch = _batches(rows, cfg.batch_tokens, cfg.seed, epoch)[within]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss, kl, agree, n = _loss(draft, *_collate(rows, batch, remap))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema_l = kl if ema_l is None else 0.9 * ema_l + 0.1 * kl
        ema_a = agree if ema_a is None else 0.9 * ema_a + 0.1 * agree
        hist.append({"step": step, "kl": kl, "agreement": agree, "tokens": n})
        bar.set_postfix(kl=f"{ema_l:.3f}", agree=f"{ema_a:.3f}", lr=f"{lr_at(step - 1):.1e}")
        bar.update(1)
        if step % cfg.ckpt_every == 0 or step == total:
            atomic_save({"model": trained_state(draft), "opt": opt.state_dict(),
                         "step": step, "hist": hist, "before": state["before"],
                         "seconds": t_spent + time.perf_counter() - t0}, ck)
    bar.close()
    return t_spent + time.perf_counter() - t0


def train(cfg: DistillConfig, st: WorkDir, draft, rows: list[dict]) -> dict:
    """Stage 4: distil; resumes from ``<work>/train-*/ckpt.pt``. Returns a summary
    (``steps``, ``train_seconds``, ``probe_before`` / ``probe_after``: :func:`data_metrics`
    on the probe set, ``train_tokens_per_epoch``)."""
    dtype = DTYPES[cfg.train_dtype]
    remap = _head_remap(draft)
    params = trainable_parameters(draft)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    per_epoch = len(_batches(rows, cfg.batch_tokens, cfg.seed, 0))
    total = max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    probe_rows, probe_batches = _probe(cfg, rows)
    ck = st.train / "ckpt.pt"
    state = _resume(cfg, ck, draft, opt, total)
    draft.eval()  # no dropout in Llama; eval() keeps behaviour deterministic
    if state["before"] is None:
        state["before"] = data_metrics(draft, probe_rows, probe_batches, remap, dtype)
    t_spent = _run_steps(cfg, draft, opt, params, rows, remap, dtype, per_epoch, total,
                         state, ck)
    for p in params:
        p.requires_grad_(False)
    after = data_metrics(draft, probe_rows, probe_batches, remap, dtype)
    return {"steps": total, "train_seconds": round(t_spent, 1),
            "probe_before": state["before"], "probe_after": after,
            "train_tokens_per_epoch": sum(len(r["ids"]) - 1 for r in rows)}
