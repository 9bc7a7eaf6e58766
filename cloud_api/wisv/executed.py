"""Fitting the WISV decision head on executed-test labels (WISV §III-B trains the head
on whether accepting keeps the task outcome; here the outcome is executed, not
estimated by likelihood).

Input: reports of ``specrelay wisv check-labels`` (JSON rows + the head's inputs saved
beside them as ``.features.safetensors``). At each checked mismatch the target completed
the function from the draft token d and from its own t and both were run with the
problem's tests. The executed label is

    acceptable  iff  not (t-branch passes and d-branch fails)

i.e. accepting d does not turn a passing completion into a failing one (when the
t-branch fails too, exactness had nothing to keep). The head itself, its fit and its
file are those of :mod:`cloud_api.wisv.train` / :mod:`cloud_api.wisv.head`; only the
label differs. Because the checked problems are few (tens), the judgement is made out of
fold: each problem's mismatches are scored by a head fitted without that problem, and
the heads are compared at equal accept rates by the passes they would gain and lose
(:func:`accept_table`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from cloud_api.wisv.train import Dataset, _fit, auc

__all__ = ["EXECUTED_CRITERION", "load_executed", "out_of_fold", "accept_table",
           "harm_auc", "tally", "compare_heads", "fit_executed"]

EXECUTED_CRITERION = (
    "executed tests: at a greedy mismatch (draft argmax d != target argmax t) inside "
    "held-out HumanEval text the target completes the function greedily from prefix+d "
    "and from prefix+t; both are run with the problem's tests; acceptable iff not "
    "(t-branch passes and d-branch fails)")


def load_executed(paths: Sequence[str | Path]) -> tuple[Dataset, list[dict]]:
    """The executed mismatches of check-label reports ``paths`` (each ``X.json`` with
    ``X.features.safetensors`` beside it). Rows where a branch was not executed are
    dropped. Returns ``(dataset, rows)``: ``dataset.y`` the executed label, groups the
    problems' task ids; ``rows`` the JSON rows in the same order. Raises ValueError
    (one line, naming the file) when a features file is missing or its row count
    differs from the report's."""
    from safetensors.torch import load_file

    feats, rows = [], []
    for p in paths:
        p = Path(p)
        fp = p.with_suffix(".features.safetensors")
        if not p.is_file() or not fp.is_file():
            raise ValueError(f"{p}: report or its features file {fp.name} missing "
                             "(written by specrelay wisv check-labels)")
        rep = json.loads(p.read_text())
        f = load_file(str(fp))
        if f["features"].shape[0] != len(rep["rows"]):
            raise ValueError(f"{fp}: {f['features'].shape[0]} feature rows, the report "
                             f"has {len(rep['rows'])}")
        keep = [i for i, r in enumerate(rep["rows"])
                if "draft_passed" in r and "target_passed" in r]
        feats.append(f["features"][keep].float())
        rows += [rep["rows"][i] for i in keep]
    if not rows:
        raise ValueError("no executed mismatch in the reports")
    y = torch.tensor([not (r["target_passed"] and not r["draft_passed"]) for r in rows],
                     dtype=torch.float32)
    ds = Dataset(torch.cat(feats), torch.tensor([r["gap"] for r in rows]),
                 [r["task_id"] for r in rows], ["humaneval"] * len(rows), y=y)
    return ds, rows


def out_of_fold(ds: Dataset, width: int, l2: float, hidden_scale: float,
                folds: int = 8, seed: int = 0) -> torch.Tensor:
    """P(acceptable) float32 [N] of every row from a head fitted (:func:`_fit`) on the
    other folds' problems (``folds`` grouped folds; a fold whose training part has one
    class gets that class's rate)."""
    y = ds.labels(0.0)
    uniq = sorted(set(ds.groups))
    g = torch.Generator().manual_seed(seed)
    order = [uniq[i] for i in torch.randperm(len(uniq), generator=g).tolist()]
    fold_of = {u: k % folds for k, u in enumerate(order)}
    out = torch.empty(len(ds))
    for f in range(folds):
        a = [i for i in range(len(ds)) if fold_of[ds.groups[i]] != f]
        b = [i for i in range(len(ds)) if fold_of[ds.groups[i]] == f]
        if not b:
            continue
        if y[a].min() == y[a].max():
            out[b] = float(y[a].mean())
            continue
        h = _fit(ds.features[a], y[a], width, l2, seed, hidden_scale=hidden_scale)
        out[b] = h.prob(ds.features[b])
    return out


def tally(accepted: list[dict]) -> dict:
    """Executed rows of accepted mismatches: ``accepted`` count, ``draft_only_passes``
    (accepting gains a pass), ``target_only_passes`` (accepting loses one) and ``net``
    (their difference per accepted mismatch, 3 decimals; None when none)."""
    gain = sum(bool(r["draft_passed"] and not r["target_passed"]) for r in accepted)
    loss = sum(bool(r["target_passed"] and not r["draft_passed"]) for r in accepted)
    return {"accepted": len(accepted), "draft_only_passes": gain,
            "target_only_passes": loss,
            "net": round((gain - loss) / len(accepted), 3) if accepted else None}


def accept_table(score: torch.Tensor, rows: list[dict],
                 fractions: Sequence[float] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)) -> list[dict]:
    """Per accept fraction q: accepting the q * N highest-scored mismatches, the
    threshold that does it (the lowest accepted score), how many of them pass only from
    d (``gains``) and only from t (``harms``), and ``net`` = (gains - harms) / accepted:
    the change in passing completions per accepted mismatch."""
    order = torch.argsort(score, descending=True).tolist()
    out = []
    for q in fractions:
        k = max(1, round(q * len(order)))
        t = tally([rows[i] for i in order[:k]])
        out.append({"fraction": q, "accepted": k,
                    "threshold": round(float(score[order[k - 1]]), 4),
                    "gains": t["draft_only_passes"], "harms": t["target_only_passes"],
                    "net": t["net"]})
    return out


def harm_auc(score: torch.Tensor, rows: list[dict]) -> float:
    """ROC AUC of ``score`` separating safe from harmful among the mismatches whose
    t-branch passes (the only ones that can be harmed)."""
    tp = [i for i, r in enumerate(rows) if r["target_passed"]]
    y = torch.tensor([bool(rows[i]["draft_passed"]) for i in tp], dtype=torch.float64)
    return auc(score[tp].double(), y)


GRID = tuple({"width": 0, "l2": l2, "hidden_scale": hs} for hs in (1.0, 10.0, 1e4)
             for l2 in (0.1, 1.0, 10.0))
"""Settings judged out of fold: logistic heads (width 0), L2 and the hidden-state scale
of :func:`cloud_api.wisv.train._fit` (1e4: the token statistics alone, in effect)."""


def compare_heads(ds: Dataset, rows: list[dict], reference=None, folds: int = 8,
                  seed: int = 0) -> dict:
    """Out-of-fold judgement of heads fitted on the executed label (:func:`out_of_fold`
    for each setting of a small grid: L2 and hidden-state scale of :func:`_fit`) beside
    a ``reference`` head (e.g. the shipped likelihood-label head; its scores are not out
    of fold for its own label but are for the executed one). Returns ``{"rows",
    "problems", "acceptable", "reference": {"harm_auc", "table"}, "grid": [{setting,
    "harm_auc", "table"}], "best": setting}`` with ``table`` from
    :func:`accept_table`; ``best`` has the highest out-of-fold harm AUC."""
    out = {"rows": len(ds), "problems": len(set(ds.groups)),
           "acceptable": round(float(ds.labels(0.0).mean()), 4), "grid": []}
    if reference is not None:
        p = reference.prob(ds.features)
        out["reference"] = {"harm_auc": round(harm_auc(p, rows), 4),
                            "table": accept_table(p, rows)}
    for g in GRID:
        p = out_of_fold(ds, g["width"], g["l2"], g["hidden_scale"], folds, seed)
        out["grid"].append(g | {"harm_auc": round(harm_auc(p, rows), 4),
                                "table": accept_table(p, rows)})
    best = max(out["grid"], key=lambda g: -1 if g["harm_auc"] != g["harm_auc"]
               else g["harm_auc"])
    out["best"] = {k: best[k] for k in ("width", "l2", "hidden_scale")}
    return out


def fit_executed(paths: Sequence[str | Path], reference=None, out: str | Path | None = None,
                 model: str = "qwen2.5-coder-1.5b", folds: int = 8, seed: int = 0) -> dict:
    """Load the executed mismatches of ``paths``, judge the grid out of fold
    (:func:`compare_heads`) and, with ``out``, fit the best setting on every row and
    write it as a head file with its manifest (label: :data:`EXECUTED_CRITERION`).
    Returns the comparison (+ ``path`` when written). Raises ValueError as
    :func:`load_executed` and when the rows hold one label class."""
    from cloud_api.wisv.head import save_head

    ds, rows = load_executed(paths)
    y = ds.labels(0.0)
    if y.min() == y.max():
        raise ValueError(f"{len(ds)} executed mismatches with one label class: too few "
                         "to fit")
    rep = compare_heads(ds, rows, reference, folds, seed)
    if out is not None:
        b = rep["best"]
        head = _fit(ds.features, y, b["width"], b["l2"], seed, hidden_scale=b["hidden_scale"])
        man = {"model": model, "label": EXECUTED_CRITERION,
               "train": {"reports": [str(p) for p in paths], "rows": len(ds),
                         "problems": sorted(set(ds.groups)), "seed": seed},
               "metrics": {k: v for k, v in rep.items() if k != "grid"}}
        rep["path"] = str(save_head(head, out, man).with_suffix(".safetensors"))
    return rep
