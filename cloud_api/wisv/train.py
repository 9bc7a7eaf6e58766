"""Training data, labels and the fit of the WISV decision head (WISV §III-B) on a real
draft/target pair.

**Data.** Held-out text, teacher-forced through the target and the draft: HumanEval
prompts + their canonical solutions and + the target's own greedy completions, and
MT-Bench questions (chat template) + the target's own greedy answer (``answer_tokens``
tokens); greedy text is generated once and cached. Only
seed-0 indexes from :data:`cloud_api.exit_fit.HELDOUT_START` on are used (HumanEval
from 100, MT-Bench from 48); the benchmark and ``specrelay wisv eval`` evaluate the
first prompts of that order, so training and evaluation are disjoint. At every row of
the answer part where the draft's argmax ``d`` differs from the target's argmax ``t``
(a greedy mismatch), the features :func:`cloud_api.wisv.features.mismatch_features` of
that row are collected (target's final-norm hidden state at the row predicting the
mismatching position, and the row's logits).

**Label** (:data:`LABEL_CRITERION`): roll the target out greedily for ``n`` tokens
after ``prefix + d`` and after ``prefix + t`` (one padded batched pass per step over
many rollouts) and score each branch with the target's own log-likelihood
``S(x) = log p(x | prefix) + sum_k log p(c_k | prefix, x, c_<k)`` (nats; tokens after
an end-of-sequence token do not count). The mismatch is *acceptable* iff
``S(d) >= S(t) - delta``: continuing from the draft token costs the target at most
``delta`` nats over the next ``n + 1`` tokens compared with its own choice. Scores are
cached per sequence, so ``delta`` can change without new rollouts.

**Fit** (:func:`fit_head`): features standardised on the training part; logistic
regression (or one small ReLU layer) with an L2 penalty chosen by grouped
cross-validation; 20 % of the *sequences* (never single rows of a training sequence)
held out for the reported validation metrics (AUC, accuracy, precision at the
thresholds the channel policy uses).

Imported by ``specrelay wisv train`` only; the serving path never imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from cloud_api.wisv.features import SCALAR_FEATURES, mismatch_features, n_features
from cloud_api.wisv.head import DecisionHead, save_head

__all__ = ["LABEL_CRITERION", "DEFAULT_N", "DEFAULT_DELTA", "TrainSeq", "SeqData",
           "Dataset", "heldout_sequences", "greedy_answers", "teacher_force",
           "rollout", "label_sequence", "build_dataset", "label_text", "fit_head",
           "auc", "precision_at", "default_head_path", "train_head"]

log = logging.getLogger("cloud_api")

DEFAULT_N = 12
"""Greedy rollout length after the mismatching token (tokens)."""
DEFAULT_DELTA = 1.5
"""Likelihood margin of the label (nats)."""

LABEL_CRITERION = (
    "rollout-likelihood margin: at a greedy mismatch (draft argmax d != target argmax t) "
    "the target rolls out greedily n tokens after prefix+d and after prefix+t; "
    "S(x) = log p(x|prefix) + sum of the target's log-probabilities of its own "
    "continuation (nats, tokens after EOS not counted); acceptable iff "
    "S(d) >= S(t) - delta")


def label_text(n: int, delta: float) -> str:
    """The label criterion with its parameters, as written to the manifest."""
    return f"{LABEL_CRITERION} (n={int(n)}, delta={float(delta):g} nats)"


Progress = Callable[[int, int, str], None]
"""``progress(done, total, description)``."""


@dataclass(frozen=True)
class TrainSeq:
    """One teacher-forced sequence: token ``ids``; rows ``start - 1 .. len - 2`` (those
    predicting ids[start:]) are candidate mismatch rows; ``group`` names the source
    prompt (the validation split holds out whole groups)."""

    id: str
    workload: str
    ids: tuple[int, ...]
    start: int

    @property
    def group(self) -> str:
        """The source prompt (the id up to a ``#``)."""
        return self.id.split("#", 1)[0]


@dataclass
class SeqData:
    """The mismatches of one sequence: ``features`` float32 [M, F]; ``row`` long [M]
    (the row predicting the mismatching position), ``draft`` / ``target`` long [M]
    (d, t), ``score_draft`` / ``score_target`` float32 [M] (S(d), S(t), nats);
    ``positions`` the candidate rows examined."""

    features: torch.Tensor
    row: torch.Tensor
    draft: torch.Tensor
    target: torch.Tensor
    score_draft: torch.Tensor
    score_target: torch.Tensor
    positions: int

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("features", "row", "draft", "target",
                                              "score_draft", "score_target")} | {
            "positions": torch.tensor(self.positions)}

    @classmethod
    def from_dict(cls, d: dict) -> "SeqData":
        return cls(d["features"], d["row"], d["draft"], d["target"], d["score_draft"],
                   d["score_target"], int(d["positions"]))


@dataclass
class Dataset:
    """Every mismatch of a run: ``features`` float32 [N, F], ``gap`` float32 [N]
    (S(d) - S(t), nats), ``groups`` / ``workloads`` (str per row), ``positions`` per
    workload (candidate rows examined), ``cached_sequences`` (read from the cache, not
    labelled in this run), ``y`` float32 [N] labels that replace the likelihood one
    (None: label by the gap)."""

    features: torch.Tensor
    gap: torch.Tensor
    groups: list[str]
    workloads: list[str]
    positions: dict = field(default_factory=dict)
    cached_sequences: int = 0
    y: torch.Tensor | None = None

    def labels(self, delta: float) -> torch.Tensor:
        """float32 [N]: 1.0 where acceptable: the given labels ``y`` (e.g. executed
        outcomes) when set, else the likelihood label (gap >= -delta)."""
        if self.y is not None:
            return self.y.float()
        return (self.gap >= -float(delta)).float()

    def __len__(self) -> int:
        return int(self.gap.shape[0])


# ---------------------------------------------------------------- forward passes

def _lm_head(model):
    return model.get_output_embeddings()


@torch.inference_mode()
def teacher_force(model, ids: Sequence[int]):
    """One pass over ``ids`` (batch 1). Returns ``(hidden, logits, cache)``: the final
    norm's output (the LM head's input) [L, H] and the logits [L, V], both in the
    model's dtype, and the filled ``DynamicCache``. Raises ValueError for no tokens."""
    from transformers import DynamicCache

    if not len(ids):
        raise ValueError("teacher_force: no tokens")
    cache = DynamicCache(config=model.config)
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    out = model.model(input_ids=x, cache=cache, use_cache=True)
    hidden = out.last_hidden_state[0]
    return hidden, _lm_head(model)(hidden), cache


@torch.inference_mode()
def _argmax(model, ids: Sequence[int]) -> torch.Tensor:
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    return model(input_ids=x, use_cache=False).logits[0].argmax(-1).cpu()


def _stack_pasts(model, pasts):
    """A batched cache from ``pasts`` = [(DynamicCache, L)]: row r holds the first L_r
    entries of its cache, left-padded with zeros to max L. Returns (cache, L list)."""
    from transformers import DynamicCache

    L = [int(n) for _, n in pasts]
    Lm = max(L)
    cache = DynamicCache(config=model.config)
    for layer in range(len(pasts[0][0].layers)):
        ks, vs = [], []
        for (c, n) in pasts:
            k, v = c.layers[layer].keys[:, :, :n], c.layers[layer].values[:, :, :n]
            ks.append(torch.nn.functional.pad(k, (0, 0, Lm - n, 0)))
            vs.append(torch.nn.functional.pad(v, (0, 0, Lm - n, 0)))
        cache.update(torch.cat(ks), torch.cat(vs), layer)
    return cache, L


@torch.inference_mode()
def rollout(model, pasts, first: Sequence[int], n: int, eos: Sequence[int] = ()
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuations of ``n`` tokens for R rows at once.

    Row r continues the first ``L_r`` cached tokens of ``pasts[r] = (cache, L_r)``
    (a teacher-forced cache of that prefix or longer; it is not modified) with the
    token ``first[r]``, then its own greedy choices. One padded pass per step (pasts
    left-padded, a 2-D attention mask hides the padding, position ids continue each
    row's prefix).

    Returns ``(tokens, logp)``, long [R, n] and float32 [R, n]: the continuation
    c_1..c_n and log p(c_k | prefix, first, c_<k) (nats), with 0 for tokens after an
    EOS (``first`` or an earlier c being in ``eos``). Raises ValueError for an empty
    batch or n < 1.
    """
    R = len(pasts)
    if R == 0 or len(first) != R or n < 1:
        raise ValueError("rollout: need R >= 1 pasts, R first tokens and n >= 1")
    cache, L = _stack_pasts(model, pasts)
    Lm = max(L)
    dev = model.device
    mask = torch.zeros(R, Lm + n, dtype=torch.long, device=dev)
    for r, l in enumerate(L):
        mask[r, Lm - l:Lm] = 1
    eos_t = torch.tensor(sorted(set(int(e) for e in eos)) or [-1], device=dev)
    cur = torch.tensor(list(first), dtype=torch.long, device=dev)
    done = torch.isin(cur, eos_t)
    pos0 = torch.tensor(L, device=dev)
    toks, lps = [], []
    for k in range(n):
        mask[:, Lm + k] = 1
        logits = model(input_ids=cur[:, None], attention_mask=mask[:, :Lm + k + 1],
                       position_ids=(pos0 + k)[:, None], cache=cache,
                       use_cache=True).logits[:, -1].float()
        lp = torch.log_softmax(logits, -1)
        nxt = logits.argmax(-1)
        lps.append(torch.where(done, torch.zeros(()), lp.gather(1, nxt[:, None])[:, 0]))
        toks.append(nxt)
        done = done | torch.isin(nxt, eos_t)
        cur = nxt
    return torch.stack(toks, 1).cpu(), torch.stack(lps, 1).cpu()


@torch.inference_mode()
def greedy_answers(model, prompts: Sequence[Sequence[int]], n: int,
                   eos: Sequence[int] = (), batch: int = 16) -> list[list[int]]:
    """The target's greedy answers to ``prompts`` (token lists): at most ``n`` tokens
    each, cut after the first EOS (kept). Each prompt is prefilled alone, then the
    answers are decoded in padded batches of ``batch``."""
    out: list[list[int]] = []
    eos = set(int(e) for e in eos)
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        pasts, first = [], []
        for p in chunk:
            _, logits, cache = teacher_force(model, p)
            pasts.append((cache, len(p)))
            first.append(int(logits[-1].float().argmax()))
        toks = (rollout(model, pasts, first, n - 1, sorted(eos))[0].tolist()
                if n > 1 else [[] for _ in chunk])
        for f, cont in zip(first, toks):
            ans = [f] + cont
            cut = next((j for j, t in enumerate(ans) if t in eos), None)
            out.append(ans if cut is None else ans[:cut + 1])
    return out


# ---------------------------------------------------------------- the held-out text

def _cache_root() -> Path:
    from edge_sdk.cache import cache_dir

    return cache_dir() / "wisv"


def _atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _cached_answers(target, prompts: dict, n: int, eos, name: str,
                    progress: Progress | None) -> dict:
    """prompt id -> the target's greedy answer (:func:`greedy_answers`, ``n`` tokens),
    cached in ``$SPECRELAY_CACHE/wisv/<target key>/<name>-<n>.json`` (only missing ids
    are generated; the file is rewritten after every batch)."""
    from edge_sdk.exit_store import model_key

    path = _cache_root() / model_key(target) / f"{name}-{int(n)}.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    todo = [pid for pid in prompts if pid not in cached]
    what = f"{name}: the target's greedy answers"
    for i in range(0, len(todo), 16):
        if progress:
            progress(i, len(todo), what)
        part = todo[i:i + 16]
        cached.update(zip(part, greedy_answers(target, [prompts[k] for k in part], n, eos)))
        _atomic_json(path, cached)
    if todo and progress:
        progress(len(todo), len(todo), what)
    return cached


def heldout_sequences(target, tokenizer, n_code: int, n_chat: int,
                      answer_tokens: int = 64, code_greedy_tokens: int = 128,
                      max_len: int = 640, eos: Sequence[int] = (),
                      progress: Progress | None = None,
                      split: str = "heldout") -> list[TrainSeq]:
    """The training text, from held-out prompts only:

    * ``n_code`` HumanEval problems: prompt + canonical solution (raw completion), and
      (``code_greedy_tokens`` > 0) prompt + the target's greedy completion of that many
      tokens (the prefixes the verifier sees when serving);
    * ``n_chat`` MT-Bench questions: first turn in the chat template + the target's
      greedy answer of ``answer_tokens`` tokens.

    Greedy answers are generated once and cached under
    ``$SPECRELAY_CACHE/wisv/<target key>/``. Each sequence is cut to ``max_len`` tokens;
    a sequence's ``id`` is its prompt's (``#greedy`` appended for the target's own code
    completion: both share the prompt's validation group). ``split="eval"`` takes the
    evaluated prompts instead (cross-fitting only: :func:`cloud_api.exit_fit.heldout_prompts`).
    Raises RuntimeError when the workload data packages are missing.
    """
    from cloud_api.exit_fit import heldout_prompts
    from edge_sdk.models import encode_prompt
    from specrelay_data.workloads import humaneval_problems

    he, mt = heldout_prompts(n_code, n_chat, split)
    sol = {p["task_id"]: p["canonical_solution"] for p in humaneval_problems()}
    seqs = []
    code_prompts = {p.id: encode_prompt(tokenizer, p.text, False) for p in he}
    for p in he:
        pre = code_prompts[p.id]
        ids = encode_prompt(tokenizer, p.text + sol[p.id], False)
        start = next((i for i, (a, b) in enumerate(zip(pre, ids)) if a != b),
                     min(len(pre), len(ids)))
        if start < len(ids):
            seqs.append(TrainSeq(p.id, "humaneval", tuple(ids[:max_len]), max(1, start)))
    groups = []
    if he and code_greedy_tokens > 0:
        groups.append(("humaneval", "#greedy", code_prompts, code_greedy_tokens,
                       "humaneval-greedy"))
    if mt:
        groups.append(("mtbench", "", {p.id: encode_prompt(tokenizer, p.text, True)
                                       for p in mt}, answer_tokens, "mtbench-answers"))
    for workload, suffix, prompts, n, name in groups:
        answers = _cached_answers(target, prompts, n, eos, name, progress)
        for pid, pr in prompts.items():
            ids = list(pr) + list(answers[pid])
            if len(pr) < min(len(ids), max_len):
                seqs.append(TrainSeq(pid + suffix, workload, tuple(ids[:max_len]), len(pr)))
    return seqs


# ---------------------------------------------------------------- mismatches and labels

@torch.inference_mode()
def _mismatches(target, draft, seq: TrainSeq):
    """Teacher-force ``seq`` through both models. Returns ``(data, cache)``: the
    :class:`SeqData` of its greedy mismatches with the scores holding only
    log p(d | prefix) and log p(t | prefix) so far, and the target's cache of ``seq``
    (the rollouts start from its prefixes). Draft ids beyond the target's vocabulary
    (padding rows) are skipped."""
    ids = list(seq.ids)
    hidden, logits, cache = teacher_force(target, ids)
    t_arg = logits.argmax(-1).cpu()
    d_arg = _argmax(draft, ids)
    rows = [r for r in range(seq.start - 1, len(ids) - 1) if int(d_arg[r]) != int(t_arg[r])
            and int(d_arg[r]) < logits.shape[-1]]
    n_pos = max(0, len(ids) - seq.start)
    if not rows:
        z = torch.zeros(0)
        return SeqData(torch.zeros(0, n_features(hidden.shape[-1])), z.long(), z.long(),
                       z.long(), z, z, n_pos), cache
    r_t = torch.tensor(rows)
    d, t = d_arg[r_t], t_arg[r_t]
    lg = logits[r_t].float().cpu()
    feats = mismatch_features(hidden[r_t].float().cpu(), lg, d)
    logp = torch.log_softmax(lg, -1)
    return SeqData(feats, r_t.long(), d.long(), t.long(),
                   logp.gather(1, d[:, None])[:, 0].clone(),
                   logp.gather(1, t[:, None])[:, 0].clone(), n_pos), cache


@torch.inference_mode()
def _score(target, jobs, n: int, eos: Sequence[int]) -> None:
    """Roll out both branches of each job ``(data, i, cache)`` (mismatch i of ``data``,
    whose prefix sits in ``cache``) in one batch of 2 * len(jobs) rows, adding the
    continuation log-likelihoods to ``data.score_draft[i]`` / ``score_target[i]``."""
    pasts = [(c, int(dt.row[i]) + 1) for dt, i, c in jobs] * 2
    first = [int(dt.draft[i]) for dt, i, _ in jobs] + [int(dt.target[i]) for dt, i, _ in jobs]
    _, lp = rollout(target, pasts, first, n, eos)
    tot, k = lp.sum(1), len(jobs)
    for j, (dt, i, _) in enumerate(jobs):
        dt.score_draft[i] += tot[j]
        dt.score_target[i] += tot[k + j]


@torch.inference_mode()
def label_sequence(target, draft, seq: TrainSeq, n: int = DEFAULT_N,
                   eos: Sequence[int] = (), batch: int = 8) -> SeqData:
    """Find the greedy mismatches of ``seq`` and score both branches (module docstring:
    S(d), S(t) in nats). ``batch`` mismatches (2 * batch rollouts) share one padded
    pass per step."""
    data, cache = _mismatches(target, draft, seq)
    jobs = [(data, i, cache) for i in range(data.row.shape[0])]
    for i in range(0, len(jobs), batch):
        _score(target, jobs[i:i + batch], n, eos)
    return data


def _seq_key(seq: TrainSeq, n: int) -> str:
    return hashlib.sha256(json.dumps([seq.id, list(seq.ids), seq.start, n]).encode()
                          ).hexdigest()[:20]


def _save(path: Path, data: SeqData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(data.to_dict(), tmp)
    os.replace(tmp, path)


def build_dataset(target, draft, seqs: Sequence[TrainSeq], n: int = DEFAULT_N,
                  eos: Sequence[int] = (), batch: int = 8, cache: bool = True,
                  progress: Progress | None = None) -> Dataset:
    """Label every sequence (as :func:`label_sequence`; rollouts of mismatches from
    several sequences share a batch), each sequence cached once complete under
    ``$SPECRELAY_CACHE/wisv/<target key>+<draft key>/n<n>/`` so a rerun (or a run with
    more sequences) labels only what is new. ``progress(done, total, text)`` counts
    sequences. Raises ValueError when no mismatch is found."""
    from edge_sdk.exit_store import model_key

    root = _cache_root() / f"{model_key(target)}+{model_key(draft)}" / f"n{int(n)}"
    eos = sorted(set(int(e) for e in eos))
    done: dict[int, SeqData] = {}
    queue: list = []             # (data, i, kv cache, seq index)
    left: dict[int, int] = {}    # seq index -> mismatches not yet scored

    def finish(k: int, data: SeqData) -> None:
        done[k] = data
        if cache:
            _save(root / f"{_seq_key(seqs[k], n)}.pt", data)
        if progress:
            progress(len(done), len(seqs),
                     f"{seqs[k].id}: {data.features.shape[0]} mismatches")

    def flush(min_size: int) -> None:
        while len(queue) >= max(1, min_size):
            part, queue[:] = queue[:batch], queue[batch:]
            _score(target, [(d, i, c) for d, i, c, _ in part], n, eos)
            for d, _, _, k in part:
                left[k] -= 1
                if left[k] == 0:
                    finish(k, d)

    n_cached = 0
    for k, seq in enumerate(seqs):
        path = root / f"{_seq_key(seq, n)}.pt"
        if cache and path.is_file():
            done[k] = SeqData.from_dict(torch.load(path, weights_only=True))
            n_cached += 1
            if progress:
                progress(len(done), len(seqs), f"{seq.id}: cached")
            continue
        data, kv = _mismatches(target, draft, seq)
        m = int(data.row.shape[0])
        if m == 0:
            finish(k, data)
            continue
        left[k] = m
        queue += [(data, i, kv, k) for i in range(m)]
        flush(batch)
    flush(1)
    parts = [(seqs[k], done[k]) for k in range(len(seqs))]
    feats = [d.features for _, d in parts if d.features.shape[0]]
    if not feats:
        raise ValueError("no greedy mismatch between draft and target in the training text")
    pos: dict[str, int] = {}
    for s, d in parts:
        pos[s.workload] = pos.get(s.workload, 0) + d.positions
    return Dataset(torch.cat(feats), torch.cat([d.score_draft - d.score_target
                                                for _, d in parts]),
                   [s.group for s, d in parts for _ in range(d.features.shape[0])],
                   [s.workload for s, d in parts for _ in range(d.features.shape[0])], pos,
                   n_cached)


# ---------------------------------------------------------------- the fit

def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve of ``score`` for binary labels ``y`` (ties count half;
    NaN when one class is missing)."""
    score, y = score.double().flatten(), y.flatten() > 0.5
    npos, nneg = int(y.sum()), int((~y).sum())
    if npos == 0 or nneg == 0:
        return float("nan")
    order = torch.argsort(score)
    s = score[order]
    ranks = torch.empty_like(s)
    i = 0
    while i < len(s):                         # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i:j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = torch.empty_like(ranks)
    r[order] = ranks
    return float((r[y].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def precision_at(prob: torch.Tensor, y: torch.Tensor, thr: float) -> dict:
    """At threshold ``thr``: ``precision`` (acceptable among prob >= thr; None when
    none), ``accept_rate`` (fraction with prob >= thr), ``recall``."""
    sel = prob >= thr
    k, pos = int(sel.sum()), int((y > 0.5).sum())
    tp = int((y[sel] > 0.5).sum())
    return {"precision": None if k == 0 else round(tp / k, 4),
            "accept_rate": round(k / max(1, len(y)), 4),
            "recall": None if pos == 0 else round(tp / pos, 4)}


def _fit(X: torch.Tensor, y: torch.Tensor, width: int, l2: float, seed: int = 0,
         epochs: int = 300, hidden_scale: float = 1.0) -> DecisionHead:
    """One head on standardised ``X`` [N, F] (statistics from X itself): mean BCE +
    ``l2/2 * |W|^2`` (weights, not biases); L-BFGS for the logistic head, Adam for the
    hidden layer. ``hidden_scale`` > 1 divides the standardised hidden-state features
    by that factor (stored in ``std``), i.e. an L2 penalty ``hidden_scale**2`` times
    stronger on their weights than on the scalar features' (1e4: the scalars alone, in
    effect)."""
    torch.manual_seed(seed)
    H = X.shape[1] - len(SCALAR_FEATURES)
    head = DecisionHead(H, width)
    head.mean.copy_(X.mean(0))
    head.std.copy_(X.std(0).clamp_min(1e-4))
    head.std[:H] *= float(hidden_scale)
    pos = float(y.mean())
    last = head.net if width == 0 else head.net[-1]
    with torch.no_grad():
        last.bias.fill_(math.log(max(pos, 1e-3) / max(1 - pos, 1e-3)))
    weights = [p for nm, p in head.net.named_parameters() if nm.endswith("weight")]
    bce = torch.nn.BCEWithLogitsLoss()

    def loss_fn():
        return bce(head(X), y) + 0.5 * l2 * sum((w ** 2).sum() for w in weights)

    if width == 0:
        opt = torch.optim.LBFGS(head.net.parameters(), lr=1.0, max_iter=200,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            return loss
        opt.step(closure)
    else:
        opt = torch.optim.Adam(head.net.parameters(), lr=3e-3)
        for _ in range(epochs):
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
    head.eval()
    return head


def _group_split(groups: Sequence[str], frac: float, seed: int) -> tuple[list, list]:
    """(train rows, held-out rows): ``frac`` of the distinct groups held out."""
    import random

    uniq = sorted(set(groups))
    random.Random(seed).shuffle(uniq)
    k = max(1, round(frac * len(uniq))) if len(uniq) > 1 else 0
    held = set(uniq[:k])
    return ([i for i, g in enumerate(groups) if g not in held],
            [i for i, g in enumerate(groups) if g in held])


def fit_head(ds: Dataset, delta: float = DEFAULT_DELTA,
             widths: Sequence[int] = (0,), l2s: Sequence[float] = (1e-2, 1e-1, 1.0, 10.0),
             hidden_scales: Sequence[float] = (1.0, 10.0, 1e4),
             val_frac: float = 0.2, folds: int = 4, seed: int = 0,
             thresholds: Sequence[float] = (0.9, 0.73, 0.66)) -> tuple[DecisionHead, dict]:
    """Fit the decision head on ``ds`` labelled with ``delta``.

    ``val_frac`` of the source sequences are held out; on the rest, (width, L2, hidden
    scale: see :func:`_fit`) is chosen by ``folds``-fold grouped cross-validation AUC,
    then refitted on the whole training part. Returns ``(head, metrics)``: metrics hold the sizes and label
    balance, the chosen setting and its CV AUC, a histogram of S(d) - S(t)
    (``gap_histogram``, 0.5-nat bins), and on the held-out part ``auc``, ``accuracy``
    (at 0.5), ``precision_at`` each threshold, the AUC of the log-prob gap alone
    (``auc_logp_gap``), the same per workload and ``curve`` (precision and accept rate
    at thresholds 0.05 .. 0.95). Raises ValueError for fewer
    than 10 mismatches or a single class.
    """
    X, y = ds.features.float(), ds.labels(delta)
    if len(ds) < 10 or y.min() == y.max():
        raise ValueError(f"{len(ds)} mismatches with one label class: too few to fit "
                         "(label more sequences or change delta)")
    tr, va = _group_split(ds.groups, val_frac, seed)
    if not va:
        tr, va = list(range(len(ds))), list(range(len(ds)))
    gtr = [ds.groups[i] for i in tr]
    uniq = sorted(set(gtr))
    fold_of = {g: k % folds for k, g in enumerate(uniq)}
    grid = []
    for w in widths:
        for hs in hidden_scales:
            for l2 in l2s:
                aucs = []
                for f in range(folds):
                    a = [i for i in tr if fold_of[ds.groups[i]] != f]
                    b = [i for i in tr if fold_of[ds.groups[i]] == f]
                    if not a or not b or y[a].min() == y[a].max():
                        continue
                    h = _fit(X[a], y[a], w, l2, seed, hidden_scale=hs)
                    aucs.append(auc(h.prob(X[b]), y[b]))
                aucs = [v for v in aucs if v == v]
                grid.append({"width": w, "l2": l2, "hidden_scale": hs,
                             "cv_auc": round(sum(aucs) / len(aucs), 4) if aucs else None})
    best = max(grid, key=lambda g: -1 if g["cv_auc"] is None else g["cv_auc"])
    head = _fit(X[tr], y[tr], best["width"], best["l2"], seed,
                hidden_scale=best["hidden_scale"])
    p = head.prob(X[va])
    yv = y[va]
    gap_i = n_features(head.hidden_size) - len(SCALAR_FEATURES) + \
        SCALAR_FEATURES.index("logp_gap")

    def block(idx):
        pv, yy = head.prob(X[idx]), y[idx]
        return {"n": len(idx), "acceptable": round(float(yy.mean()), 4),
                "auc": round(auc(pv, yy), 4),
                "accuracy": round(float(((pv >= 0.5).float() == yy).float().mean()), 4),
                "auc_logp_gap": round(auc(X[idx, gap_i], yy), 4),
                "precision_at": {f"{t:g}": precision_at(pv, yy, t) for t in thresholds}}

    val = block(va)
    val["by_workload"] = {w: block([i for i in va if ds.workloads[i] == w])
                          for w in sorted(set(ds.workloads[i] for i in va))}
    val["curve"] = [{"threshold": round(t, 2)} | precision_at(p, yv, t)
                    for t in [k / 20 for k in range(1, 20)]]
    edges = [-8.0 + 0.5 * k for k in range(25)]             # nats, -8 .. +4
    gap = ds.gap.clamp(edges[0], edges[-1] - 1e-6)
    hist = {"edges": edges, "counts": torch.histc(gap, bins=24, min=edges[0],
                                                  max=edges[-1]).long().tolist()}
    metrics = {"mismatches": len(ds), "acceptable": round(float(y.mean()), 4),
               "acceptable_by_workload": {
                   w: round(float(y[[i for i, x in enumerate(ds.workloads) if x == w]].mean()), 4)
                   for w in sorted(set(ds.workloads))},
               "mismatches_by_workload": {w: ds.workloads.count(w)
                                          for w in sorted(set(ds.workloads))},
               "positions_by_workload": dict(ds.positions),
               "train_rows": len(tr), "validation_rows": len(va),
               "validation_groups": len(set(ds.groups[i] for i in va)),
               "grid": grid, "chosen": {k: best[k] for k in ("width", "l2", "hidden_scale")},
               "validation": val, "gap_histogram": hist,
               "train_auc": round(auc(head.prob(X[tr]), y[tr]), 4)}
    return head, metrics


# ---------------------------------------------------------------- the whole run

def default_head_path(preset: str) -> Path:
    """``cloud_api/assets/wisv/<preset>.safetensors`` (what ``--wisv-head auto`` loads)."""
    return Path(__file__).resolve().parents[1] / "assets" / "wisv" / f"{preset}.safetensors"


def train_head(target: str = "qwen2.5-coder-1.5b", draft: str = "qwen2.5-coder-0.5b",
               n_code: int = 64, n_chat: int = 32, n: int = DEFAULT_N,
               delta: float = DEFAULT_DELTA, answer_tokens: int = 64,
               code_greedy_tokens: int = 128, out: str | os.PathLike | None = None,
               dtype: str = "auto", threads: int | None = 1, widths: Sequence[int] = (0,),
               batch: int = 8, seed: int = 0, models=None,
               progress: Progress | None = None, split: str = "heldout") -> dict:
    """Load the pair, build (or read from the cache) the labelled mismatches, fit the
    head and write it with its manifest to ``out`` (default
    :func:`default_head_path` of ``target``). ``models``: ``(target, draft, tokenizer)``
    already loaded (tests). ``threads``: torch threads (1 by default: on a 2-core
    machine shared with other work, 2 threads oversubscribed are several times slower
    than one; None leaves torch's setting). ``split``: ``heldout`` (the prompts no
    evaluation reports) or ``eval`` (the evaluated ones, for cross-fitting: such a head
    is judged with ``wisv eval --split dev``; its manifest says so). Returns the
    manifest.

    Raises ValueError (too few mismatches, bad counts) and what ``load_model`` raises
    (``PartsError`` for a missing preset package).
    """
    from cloud_api.exit_fit import HELDOUT_START
    from edge_sdk.models import eos_ids, load_model, resolve_dtype

    if n_code < 0 or n_chat < 0 or n_code + n_chat == 0:
        raise ValueError("need n_code + n_chat >= 1 (and both >= 0)")
    if split not in ("heldout", "eval"):
        raise ValueError(f"split must be 'heldout' or 'eval', not {split!r}")
    if n < 1:
        raise ValueError("n (rollout tokens) must be >= 1")
    if delta < 0:
        raise ValueError("delta must be >= 0 nats")
    t0 = time.monotonic()
    if threads:
        torch.set_num_threads(int(threads))
    if models is None:
        dt = resolve_dtype(dtype)
        tm, tok = load_model(target, dtype=dt)
        dm, _ = load_model(draft, dtype=dt)
    else:
        (tm, dm, tok), dt = models, str(next(models[0].parameters()).dtype).split(".")[-1]
    t_load = time.monotonic() - t0
    eos = eos_ids(tm, tok)
    seqs = heldout_sequences(tm, tok, n_code, n_chat, answer_tokens, code_greedy_tokens,
                             eos=eos, progress=progress, split=split)
    t1 = time.monotonic()
    ds = build_dataset(tm, dm, seqs, n, eos, batch, progress=progress)
    t_label = time.monotonic() - t1
    head, metrics = fit_head(ds, delta, widths=widths, seed=seed)
    t_fit = time.monotonic() - t1 - t_label
    he = [s.id for s in seqs if s.workload == "humaneval"]
    mt = [s.id for s in seqs if s.workload == "mtbench"]
    manifest = {
        "model": target if isinstance(target, str) else "custom",
        "draft": draft if isinstance(draft, str) else "custom",
        "dtype": dt, "label": label_text(n, delta),
        "train": {"n": n, "delta": delta, "answer_tokens": answer_tokens,
                  "code_greedy_tokens": code_greedy_tokens,
                  "humaneval": he, "mtbench": mt,
                  "split": split,
                  "heldout": (f"seed-0 order: HumanEval from index "
                              f"{HELDOUT_START['humaneval']}, MT-Bench from index "
                              f"{HELDOUT_START['mtbench']}; the evaluation uses the "
                              "first problems of that order (disjoint)")
                  if split == "heldout" else
                  (f"cross-fitting: trained on the evaluated prompts (seed-0 order, "
                   f"HumanEval before index {HELDOUT_START['humaneval']}, MT-Bench "
                   f"before {HELDOUT_START['mtbench']}); judge it on the dev split only"),
                  "text": "HumanEval prompt + canonical solution, and prompt + the "
                          "target's greedy completion (code_greedy_tokens); MT-Bench "
                          "first turn (chat template) + the target's greedy answer "
                          "(answer_tokens)",
                  "seed": seed, "validation": "20 % of the source prompts held out",
                  "sequences": len(seqs), "sequences_labelled_earlier": ds.cached_sequences},
        "metrics": metrics,
        "wall_s": {"load": round(t_load, 1), "label": round(t_label, 1),
                   "fit": round(t_fit, 1), "total": round(time.monotonic() - t0, 1)},
    }
    path = Path(out) if out is not None else default_head_path(
        target if isinstance(target, str) else "custom")
    save_head(head, path, manifest)
    manifest["path"] = str(path)
    return manifest
