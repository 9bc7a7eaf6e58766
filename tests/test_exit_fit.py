"""Exit-head fitting, caching and the early-verdict calibration, on tiny random models
(the real pair's figures: docs/figures/fsd_calibration/)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model

from cloud_api.early_exit import untrained_head
from cloud_api.exit_calibrate import calibrate, final_verdict, plot, provisional, select
from cloud_api.exit_fit import (collect_hidden, fit_exit_heads, fit_translator,
                                head_agreement, head_path, load_exit_head, model_key)

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def deep():
    return tiny_model(layers=4, seed=3)


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 64, (48,), generator=g).tolist() for _ in range(40)]


@pytest.fixture(scope="module")
def hidden(deep, seqs):
    return collect_hidden(deep, seqs, LAYERS)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path))
    return tmp_path


def test_collect_hidden_shapes_and_final_argmax(deep, seqs, hidden):
    X, Y, arg = hidden
    N = sum(map(len, seqs))
    assert set(X) == set(LAYERS) and all(x.shape == (N, 32) for x in X.values())
    assert Y.shape == (N, 32) and arg.shape == (N,) and Y.dtype == torch.float32
    with torch.inference_mode():   # norm(pre-norm stream) -> head = the model's logits
        lg = deep.lm_head(deep.model.norm(Y[:48]))
        ref = deep(input_ids=torch.tensor([seqs[0]])).logits[0]
    assert torch.allclose(lg, ref, atol=1e-4) and torch.equal(arg[:48], ref.argmax(-1))
    with pytest.raises(ValueError):
        collect_hidden(deep, seqs[:1], [4])


def test_translator_fit_beats_identity(deep, hidden):
    X, Y, _ = hidden
    w, b = fit_translator(X[2], Y)
    assert w.shape == (32, 32) and b.shape == (32,) and w.dtype == torch.float32
    with torch.inference_mode():
        norm, want = deep.model.norm, deep.model.norm(Y)
        mse_fit = (norm(X[2] @ w + b) - want).pow(2).mean()
        mse_id = (norm(X[2]) - want).pow(2).mean()
    assert mse_fit < 0.7 * mse_id
    with pytest.raises(ValueError):
        fit_translator(X[2], Y[:, :16])


def test_tuned_head_agrees_better_than_untrained(deep, seqs, hidden, cache):
    X, _, arg = hidden
    heads, info = fit_exit_heads(deep, None, [2], None, seqs=seqs, save=False)
    tuned = heads[2]
    assert head_agreement(tuned, X[2], arg) > head_agreement(untrained_head(deep, 2), X[2], arg)
    assert info[2]["agreement"] > info[2]["untrained_agreement"]
    assert info[2]["positions"] + info[2]["heldout_positions"] == X[2].shape[0]
    assert not (cache / "exit-heads").exists()              # save=False writes nothing


def test_save_load_roundtrip_identical_logits(deep, seqs, hidden, cache):
    heads, info = fit_exit_heads(deep, None, [1, 2], 40, accept_topk=2, seqs=seqs)
    path = head_path(deep, 2, 40)
    assert path.is_file() and path.name == "L2-v40.safetensors"
    manifest = json.loads(path.with_name("manifest.json").read_text())
    assert set(manifest) == {"L1-v40.safetensors", "L2-v40.safetensors"}
    assert manifest[path.name]["layer"] == 2 and manifest[path.name]["vocab"] == 40
    assert manifest[path.name]["agreement"] == info[2]["agreement"]
    got = load_exit_head(deep, 2, 40, accept_topk=4)
    assert got is not None and got.accept_topk == 4
    h = hidden[0][2][:20]
    assert torch.equal(got.logits(h), heads[2].logits(h))
    assert torch.isinf(got.logits(h)[:, 45:]).all()          # restricted vocabulary kept
    assert load_exit_head(deep, 2, 50) is None                # another vocabulary: none
    assert load_exit_head(deep, 3, 40) is None
    assert not list(path.parent.glob(".*tmp"))                # no temporary left behind


def test_cache_key_differs_between_models(deep, cache):
    other = tiny_model(layers=4, seed=4)                      # same config, other weights
    wider = tiny_model(layers=4, hidden=64, seed=3)
    keys = {model_key(deep), model_key(other), model_key(wider)}
    assert len(keys) == 3 and model_key(deep) == model_key(tiny_model(layers=4, seed=3))
    assert head_path(deep, 2, 40) != head_path(other, 2, 40)


def test_a_head_of_another_model_is_not_loaded(deep, seqs, cache):
    fit_exit_heads(deep, None, [2], 40, seqs=seqs[:10])
    assert load_exit_head(tiny_model(layers=4, seed=4), 2, 40) is None


def test_provisional_verdict_rules():
    V = 8
    early = torch.full((4, V), -1.0)
    early[0, 5], early[0, 3] = 2.0, 1.0     # row 0: argmax 5, runner-up 3
    early[1, 6] = 2.0                       # row 1: argmax 6
    early[2, 1], early[3, 2] = 2.0, 2.0
    early[2, 7] = -2.0                      # row 2: 7 is last, below every tie
    assert provisional(early, [5, 6, 7], 1) == (2, 1)   # 7 not the argmax at row 2
    assert provisional(early, [3, 6, 7], 1) == (0, 5)
    assert provisional(early, [3, 6, 7], 2) == (2, 1)   # 3 is in the top-2 of row 0
    assert provisional(early, [5, 6, 1], 1) == (3, 2)   # all accepted: row g
    assert final_verdict(early, []) == (0, 5)
    # the server's rank rule (ties count for the draft): 4 ties the row-2 runner-ups
    assert provisional(early, [3, 6, 4], 2) == (3, 2)


def test_calibrate_end_to_end_on_tiny_pair(deep, seqs, tmp_path, cache, capsys):
    draft = tiny_model(layers=4, seed=4, like=deep, noise=0.03)
    tuned, _ = fit_exit_heads(deep, None, LAYERS, 48, seqs=seqs, save=False)
    heads = {"untrained": {l: untrained_head(deep, l, 48) for l in LAYERS}, "tuned": tuned}
    prompts = [("humaneval", seqs[0][:10]), ("mtbench", seqs[1][:7])]
    rep = calibrate(deep, draft, prompts, heads, depth=3, max_new_tokens=12, max_cost=1.0)
    assert len(rep["results"]) == len(LAYERS) * 2 * 3
    assert rep["rounds"] == sum(rep["rounds_by_workload"].values()) >= 2 * 3
    for r in rep["results"]:
        assert 0 <= r["hit_rate"] <= r["accept_agree"] <= 1 and 0 <= r["top1"] <= 1
        assert r["cost_pct"] is not None and r["cost_pct"] > 0
        assert set(r["hit_by_workload"]) == {"humaneval", "mtbench"}
        assert r["score"] == pytest.approx(r["hit_rate"] * (4 - r["layer"]) / 4, abs=1e-4)
    assert 0 <= rep["coverage"]["next_tokens"] <= 1 and rep["pass_ms"] > 0 < rep["draft_ms"]
    assert rep["coverage"]["next_by_k"][8192] == 1.0      # K >= V: the full vocabulary
    assert rep["chosen"] == select(rep["results"], 1.0) and rep["chosen"] in rep["results"]
    assert select(rep["results"], 0.0) is None        # nothing is free
    json.dumps(rep)
    from specrelay_cli.fsd import _print

    _print(rep | {"fit_s": 0.0})
    assert "final next tokens inside the exit vocabulary" in capsys.readouterr().out
    plot(rep | {"target": "tiny"}, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
    with pytest.raises(ValueError):
        calibrate(deep, draft, [], heads)


def test_calibration_text_uses_only_held_out_prompts():
    from specrelay_data.workloads import load_workload
    from cloud_api.exit_fit import heldout_prompts

    try:
        he, mt = heldout_prompts(64, 32)
    except RuntimeError as e:       # the workload data package is not installed
        pytest.skip(str(e))
    assert len(he) == 64 and len(mt) == 32
    assert not {p.id for p in he} & {p.id for p in load_workload("humaneval", 64)}
    assert not {p.id for p in mt} & {p.id for p in load_workload("mtbench", 48)}
    he, mt = heldout_prompts(100, 48, split="eval")          # cross-fitting: the others
    assert [p.id for p in he] == [p.id for p in load_workload("humaneval", 100)]
    assert [p.id for p in mt] == [p.id for p in load_workload("mtbench", 48)]
    with pytest.raises(ValueError, match="split"):
        heldout_prompts(1, 1, split="dev")
