"""The teacher's side of distillation: the target continues prompts (batched, with a KV
cache) or reads given text in one prefill, and its top-k next-token distribution is
recorded at every position (what the draft is trained to match).

Row format (one dict per sequence): ``ids`` int32 [L] (prompt + continuation),
``prompt_len`` int, ``tk`` int32 [L-1, k] / ``tp`` float16 [L-1, k]: the target's top-k
ids / probabilities after each of positions 0..L-2.
"""

from __future__ import annotations

from typing import Iterable

import torch


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids int32 [..., k], probs float16 [..., k]) of softmax."""
    p = torch.softmax(logits.float(), dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


def _left_pad(prompts: list[list[int]], pad_id: int):
    """-> ids long [B, P], attention mask long [B, P], position ids long [B, P] of the
    prompts left-padded to the longest (P)."""
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _prompt_topk(model, h: torch.Tensor, lens: list[int], topk: int, head_chunk: int):
    """Top-k after every real (unpadded) prompt position of each row of the prefill's
    hidden states ``h`` [B, P, H]; the head runs ``head_chunk`` rows at a time.
    -> (per row: list of ids [n, k] chunks, per row: list of probs [n, k] chunks)."""
    P = h.shape[1]
    rows_tk: list[list[torch.Tensor]] = [[] for _ in lens]
    rows_tp: list[list[torch.Tensor]] = [[] for _ in lens]
    for b, n in enumerate(lens):
        hb = h[b, P - n:]
        for s in range(0, hb.shape[0], head_chunk):
            i, v = _topk(model.lm_head(hb[s:s + head_chunk]), topk)
            rows_tk[b].append(i)
            rows_tp[b].append(v)
    return rows_tk, rows_tp


def _next_token(last: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """logits [B, V] -> next ids [B]: argmax (lowest id on ties) at ``temperature`` 0,
    else a draw from softmax(logits / T) with ``generator``."""
    if temperature > 0:
        probs = torch.softmax(last / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return last.argmax(-1)


def _rows(prompts, gen, rows_tk, rows_tp, topk: int) -> list[dict]:
    """Assemble the row dicts (module docstring) of a finished batch."""
    out = []
    for b, p in enumerate(prompts):
        full = list(p) + gen[b]
        row = {"ids": torch.tensor(full, dtype=torch.int32), "prompt_len": len(p)}
        if topk:
            L = len(full)
            row["tk"] = torch.cat(rows_tk[b])[:L - 1].contiguous()
            row["tp"] = torch.cat(rows_tp[b])[:L - 1].contiguous()
        out.append(row)
    return out


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new: int, eos: Iterable[int],
                   topk: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None, pad_id: int = 0,
                   head_chunk: int = 1024) -> list[dict]:
    """Continue ``prompts`` with ``model`` (batched, left-padded) and record the model's
    top-k next-token distribution at every position.

    Args:
        prompts: B token-id lists. max_new: generated tokens per row at most (stops at
        any ``eos`` id, which is kept). temperature: 0 = greedy (argmax, lowest id on
        ties), else softmax(logits/T) sampling with ``generator``.
    Returns:
        B row dicts (module docstring); the row after the last token is not recorded.
        With ``topk=0`` only ``ids`` / ``prompt_len``.
    """
    from transformers import DynamicCache

    eos = set(int(e) for e in eos)
    B = len(prompts)
    ids, mask, pos = _left_pad(prompts, pad_id)
    cache = DynamicCache(config=model.config)
    h = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True).last_hidden_state  # [B, P, H]
    lens = [len(p) for p in prompts]
    rows_tk, rows_tp = (_prompt_topk(model, h, lens, topk, head_chunk) if topk
                        else ([[] for _ in lens], [[] for _ in lens]))
    last = model.lm_head(h[:, -1]).float()  # [B, V]
    gen: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    cur_pos = pos[:, -1].clone()
    for step in range(max_new):
        nxt = _next_token(last, temperature, generator)
        for b in range(B):
            if not done[b]:
                gen[b].append(int(nxt[b]))
                done[b] = gen[b][-1] in eos
        if all(done) or step + 1 == max_new:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
        cur_pos = cur_pos + 1
        h = model.model(input_ids=nxt[:, None], attention_mask=mask,
                        position_ids=cur_pos[:, None], cache=cache,
                        use_cache=True).last_hidden_state[:, -1]  # [B, H]
        last = model.lm_head(h).float()
        if topk:
            i, v = _topk(last, topk)
            for b in (b for b in range(B) if not done[b]):
                rows_tk[b].append(i[b:b + 1])
                rows_tp[b].append(v[b:b + 1])
    return _rows(prompts, gen, rows_tk, rows_tp, topk)


@torch.inference_mode()
def teacher_prefill(model, seqs: list[list[int]], topk: int, head_chunk: int = 1024
                    ) -> list[dict]:
    """Teacher-forced top-k distributions over given texts (one prefill, batched when
    lengths are equal). Same row format as :func:`generate_batch` (prompt_len = L)."""
    out = []
    by_len: dict[int, list[int]] = {}
    for n, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(n)
    res: dict[int, dict] = {}
    for L, idx in by_len.items():
        x = torch.tensor([seqs[n] for n in idx], dtype=torch.long)
        h = model.model(input_ids=x).last_hidden_state[:, :-1]  # [b, L-1, H]
        for r, n in enumerate(idx):
            tks, tps = [], []
            for s in range(0, h.shape[1], head_chunk):
                i, v = _topk(model.lm_head(h[r, s:s + head_chunk]), topk)
                tks.append(i)
                tps.append(v)
            res[n] = {"ids": x[r].to(torch.int32), "prompt_len": L,
                      "tk": torch.cat(tks), "tp": torch.cat(tps)}
    for n in range(len(seqs)):
        out.append(res[n])
    return out

