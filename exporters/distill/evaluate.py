"""Stage 5 of the distiller: the draft on held-out prompts, measured against the
**float32** target's greedy path.

Greedy agreement (overall / code / chat), the mean accepted length of simulated greedy
speculative blocks at draft depth ``g`` (Leviathan et al., 2023: a block of
``g`` drafts commits the matching prefix plus one target token, the correction or the
bonus token) and the draft's and target's decode cost in ms/token on this CPU.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from exporters.distill.config import DistillConfig, WorkDir, atomic_save, progress_bar
from exporters.distill.data import encode_item, pad_id
from exporters.distill.prompts import PromptItem, domain_of
from exporters.distill.teacher import generate_batch


def greedy_agreement(draft_argmax: torch.Tensor, target_argmax: torch.Tensor) -> float:
    """Fraction of positions where the draft's argmax equals the target's ([T] each)."""
    return float((draft_argmax == target_argmax).float().mean()) if target_argmax.numel() else 0.0


def simulate_blocks(match: Sequence[bool], depth: int) -> list[tuple[int, int]]:
    """Greedy speculative decoding along a target greedy path, simulated.

    ``match[j]``: the draft's argmax after the true prefix up to response position j
    equals the target's token there. A block starting at i drafts ``depth`` tokens; while
    drafts match, the draft's own prefix equals the target's, so the accepted count is
    the run of consecutive matches from i (capped at depth). Each round commits the
    accepted drafts plus one target token (correction or bonus); the last round is cut
    at the end of the path. Returns ``(accepted drafts, committed tokens)`` per round.
    """
    out, i, T = [], 0, len(match)
    while i < T:
        a = 0
        while a < depth and i + a < T and match[i + a]:
            a += 1
        c = min(a + 1, T - i)
        out.append((a, c))
        i += c
    return out


def accepted_lengths(match: Sequence[bool], depth: int) -> list[int]:
    """Committed tokens per simulated round (each in 1..depth+1), see
    :func:`simulate_blocks`."""
    return [c for _, c in simulate_blocks(match, depth)]


@torch.inference_mode()
def ms_per_token(model, ctx: int = 200, steps: int = 24, vocab: int | None = None,
                 seed: int = 0) -> float:
    """Decode cost, milliseconds per token, batch 1, one token per forward with a KV
    cache of ``ctx`` tokens; the minimum over ``steps`` (robust to other load)."""
    from transformers import DynamicCache

    V = vocab or int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (1, ctx), generator=g)
    cache = DynamicCache(config=model.config)
    model(input_ids=x, cache=cache, use_cache=True)
    best = float("inf")
    t = torch.tensor([[1]])
    for _ in range(steps):
        t0 = time.perf_counter()
        model(input_ids=t, cache=cache, use_cache=True)
        best = min(best, time.perf_counter() - t0)
    return best * 1000.0


@torch.inference_mode()
def heldout_paths(cfg: DistillConfig, st: WorkDir, tmodel, tok, held: list[PromptItem]):
    """Float32 target greedy continuations of the held-out prompts, verified teacher-
    forced (batch 1): each row is cut at the first position where the teacher-forced
    argmax differs from the batched generation, so ``ids[prompt_len:]`` is exactly the
    float32 target's greedy path. Cached in the data dir."""
    from edge_sdk.models import eos_ids

    path = st.data / f"heldout-fp32-{cfg.eval_max_new_tokens}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    eos = eos_ids(tmodel, tok)
    items = [(it, encode_item(tok, it)) for it in held]
    items = [(it, ids) for it, ids in items if len(ids) <= cfg.max_prompt_tokens]
    out = []
    bar = progress_bar(len(items), "held-out target paths (float32)", cfg.progress)
    for s in range(0, len(items), cfg.gen_batch):
        part = items[s:s + cfg.gen_batch]
        res = generate_batch(tmodel, [ids for _, ids in part], cfg.eval_max_new_tokens, eos,
                             0, 0.0, None, pad_id=pad_id(tmodel, tok))
        for (it, _), r in zip(part, res):
            ids = r["ids"].long()
            am = tmodel(input_ids=ids[None]).logits[0, :-1].argmax(-1)  # [L-1]
            P = r["prompt_len"]
            ok = am[P - 1:] == ids[P:]
            cut = len(ids) if bool(ok.all()) else P + int((~ok).float().argmax())
            out.append({"id": it.id, "domain": domain_of(it.source, it.kind),
                        "ids": ids[:cut].to(torch.int32), "prompt_len": P})
            bar.update(1)
    bar.close()
    atomic_save(out, path)
    return out


@torch.inference_mode()
def evaluate(draft, paths: list[dict], depth: int) -> dict:
    """Held-out metrics of a float32 ``draft`` along the target's greedy paths.

    Returns ``{"agreement", "agreement_code", "agreement_chat", "mean_accepted_length"
    (committed tokens per round incl. correction/bonus, 1..depth+1),
    "mean_accepted_drafts" (0..depth), "tokens", "prompts"}``.
    """
    per = {"code": [], "chat": []}
    rounds: list[tuple[int, int]] = []
    for p in paths:
        ids = p["ids"].long()
        P = p["prompt_len"]
        if len(ids) <= P:
            continue
        am = draft(input_ids=ids[None]).logits[0, P - 1:-1].argmax(-1)  # [T]
        match = (am == ids[P:]).tolist()
        per[p["domain"]] += match
        rounds += simulate_blocks(match, depth)
    allm = per["code"] + per["chat"]

    def mean(v):
        return float(sum(v) / len(v)) if v else None

    return {"agreement": mean(allm), "agreement_code": mean(per["code"]),
            "agreement_chat": mean(per["chat"]), "depth": depth,
            "mean_accepted_length": mean([c for _, c in rounds]),
            "mean_accepted_drafts": mean([a for a, _ in rounds]),
            "tokens": len(allm), "tokens_code": len(per["code"]),
            "tokens_chat": len(per["chat"]), "prompts": len(paths)}


def cost(draft, tmodel, repeats: int = 3) -> dict:
    """Draft and target decode cost on this CPU (:func:`ms_per_token`, interleaved
    repeats, the minimum of each) and their ratio."""
    d, t = [], []
    for r in range(repeats):  # interleaved: both see the same background load
        d.append(ms_per_token(draft, seed=r))
        t.append(ms_per_token(tmodel, seed=r))
    dm, tm = min(d), min(t)
    return {"draft_ms_per_token": round(dm, 3), "target_ms_per_token": round(tm, 3),
            "cost_ratio": round(dm / tm, 4), "threads": torch.get_num_threads(),
            "method": "float32, batch 1, KV cache of 200 tokens, min over 3x24 decode steps"}

