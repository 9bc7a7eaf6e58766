"""Fitting the WISV head on executed-test labels (cloud_api.wisv.executed) and
``specrelay wisv fit-executed``, on synthetic check-label reports: the label, the
out-of-fold scoring (a head never scores its own problems), the accept table's counts,
the written head, and the one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cloud_api.wisv import executed as E
from cloud_api.wisv.features import n_features
from cloud_api.wisv.head import load_head
from cloud_api.wisv.train import auc

H = 32


def _report(path, n=120, problems=12, seed=0, signal=4.0):
    """A check-label report of ``n`` mismatches whose first feature predicts harm."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n_features(H), generator=g)
    rows = []
    for i in range(n):
        harm = bool(torch.rand(1, generator=g) < torch.sigmoid(signal * X[i, 0] - 1.0))
        t_pass = harm or bool(torch.rand(1, generator=g) < 0.5)
        d_pass = (not harm) and (t_pass or bool(torch.rand(1, generator=g) < 0.2))
        rows.append({"task_id": f"HumanEval/{i % problems}", "gap": -float(X[i, 0]),
                     "head_p": 0.5, "draft_token": " x", "target_token": " y",
                     "draft_passed": d_pass, "target_passed": t_pass})
    rows.append({"task_id": "HumanEval/0", "gap": 0.0, "head_p": 0.5, "draft_token": "a",
                 "target_token": "b", "target_passed": True})      # not executed: dropped
    X = torch.cat([X, torch.zeros(1, X.shape[1])])
    path.write_text(json.dumps({"rows": rows}))
    save_file({"features": X.contiguous(),
               "draft_passed": torch.zeros(len(rows), dtype=torch.int8),
               "target_passed": torch.zeros(len(rows), dtype=torch.int8),
               "gap": torch.zeros(len(rows))}, str(path.with_suffix(".features.safetensors")))
    return path


def test_load_executed_labels_and_groups(tmp_path):
    ds, rows = E.load_executed([_report(tmp_path / "a.json")])
    assert len(ds) == len(rows) == 120 and ds.features.shape == (120, n_features(H))
    want = [not (r["target_passed"] and not r["draft_passed"]) for r in rows]
    assert ds.labels(1.5).tolist() == [float(w) for w in want]       # delta ignored
    assert ds.groups[:3] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(ValueError, match="features file"):
        E.load_executed([tmp_path / "missing.json"])


def test_out_of_fold_never_scores_a_problem_with_its_own_head(tmp_path):
    ds, rows = E.load_executed([_report(tmp_path / "a.json")])
    p = E.out_of_fold(ds, 0, 1.0, 1.0, folds=4)
    assert p.shape == (120,) and bool(((p >= 0) & (p <= 1)).all())
    assert E.harm_auc(p, rows) > 0.6              # the signal is learnable out of fold
    # moving one problem's labels changes only the other problems' scores
    flipped = ds.labels(0.0).clone()
    own = [i for i, g in enumerate(ds.groups) if g == "HumanEval/3"]
    flipped[own] = 1 - flipped[own]
    ds2 = type(ds)(ds.features, ds.gap, ds.groups, ds.workloads, y=flipped)
    p2 = E.out_of_fold(ds2, 0, 1.0, 1.0, folds=4)
    assert torch.equal(p[own], p2[own])


def test_accept_table_counts():
    rows = [{"draft_passed": d, "target_passed": t} for d, t in
            ((True, False), (False, True), (True, True), (False, False))]
    tab = E.accept_table(torch.tensor([0.9, 0.8, 0.7, 0.1]), rows, (0.25, 0.5, 1.0))
    assert [(t["accepted"], t["gains"], t["harms"], t["net"]) for t in tab] == [
        (1, 1, 0, 1.0), (2, 1, 1, 0.0), (4, 1, 1, 0.0)]
    assert tab[1]["threshold"] == pytest.approx(0.8)
    assert E.harm_auc(torch.tensor([0.9, 0.8, 0.7, 0.1]), rows) == auc(
        torch.tensor([0.8, 0.7]), torch.tensor([0.0, 1.0]))


def test_fit_executed_writes_a_head_and_the_cli(tmp_path):
    a, b = _report(tmp_path / "a.json"), _report(tmp_path / "b.json", seed=1)
    out = tmp_path / "head.safetensors"
    rep = E.fit_executed([a, b], out=out, model="tiny", folds=4)
    assert rep["rows"] == 240 and len(rep["grid"]) == len(E.GRID) and "reference" not in rep
    head, man = load_head(out, H)
    assert man["label"] == E.EXECUTED_CRITERION and man["train"]["rows"] == 240
    ds, rows = E.load_executed([a, b])
    assert E.harm_auc(head.prob(ds.features), rows) > 0.6
    from specrelay_cli.wisv import wisv

    r = CliRunner().invoke(wisv, ["fit-executed", str(a), "--reference", str(out),
                                  "--folds", "4", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    assert "reference head" in r.output and "best out of fold" in r.output
    assert json.loads((tmp_path / "c.json").read_text())["reference"]["harm_auc"] > 0.6
    r = CliRunner().invoke(wisv, ["fit-executed", str(tmp_path / "none.json"),
                                  "--reference", "off"])
    assert r.exit_code == 2 and "features file" in r.output
