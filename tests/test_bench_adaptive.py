"""Adaptive-drafting bench group (RAPID; UCB-SpecStop): best-fixed / IPDG / NPDG ratios, the
``+slow`` contention variants and the ``--quick`` preset.

The runner test uses tiny random models (conftest) through the real cloud process,
link emulator and HTTP API.
"""

from __future__ import annotations

import os

import pytest

from bench import report
from bench.cells import profile as _profile
from bench.config import QUICK, BenchConfig
from bench.harness import run_bench
from bench.linkem import Profile
from bench.report.cell_metrics import depth_summary, proactive_timing
from bench.report.labels import split_contention
from bench.report.ratios import adaptive_ratios, best_fixed
from tests.test_bench_runner import PROMPTS, tiny_draft, tiny_target


def _run(mode, prof, w, **m):
    return {"mode": mode, "profile": prof, "workload": w, "metrics": m}


def test_split_contention_and_profile_variant():
    assert split_contention("medium+slow") == ("medium", True)
    assert split_contention("medium") == ("medium", False)
    p = _profile("weak+slow")
    assert p.name == "weak+slow" and p.rtt_s == _profile("weak").rtt_s
    with pytest.raises(ValueError, match="unknown profile"):
        _profile("nowhere+slow")


def test_best_fixed_and_ratio_orientation():
    runs = [
        _run("fixed-1", "p", "a", throughput_tok_s=5.0),
        _run("fixed-4", "p", "a", throughput_tok_s=8.0),
        _run("stop-and-wait", "p", "a", throughput_tok_s=6.0, tpot_s=0.2,
             wasted_draft_tokens=30),
        _run("caac", "p", "a", throughput_tok_s=10.0),
        _run("ipdg", "p", "a", tpot_s=0.1, wasted_draft_tokens=10,
             proactive_wasted_tokens=4),
        _run("npdg", "p", "a", tpot_s=0.12, wasted_draft_tokens=40,
             proactive_wasted_tokens=12),
        _run("ipdg-skip", "p", "a", tpot_s=0.25, wasted_draft_tokens=8,
             proactive_wasted_tokens=2),
        _run("fixed-2", "q", "a", throughput_tok_s=3.0),
        _run("caac", "q", "a", throughput_tok_s=1.5),
        _run("ipdg", "q", "a", tpot_s=0.1, wasted_draft_tokens=0),   # zero: skipped
        _run("npdg", "q", "a", tpot_s=0.1, wasted_draft_tokens=4),
    ]
    bf = best_fixed(runs)
    assert bf["p|a"] == {"mode": "fixed-4", "value": 8.0}
    assert bf["q|a"]["mode"] == "fixed-2"
    rows = {(r["metric"], r["profile"], r["mode"], r["baseline"]): r["value"]
            for r in adaptive_ratios(runs)}
    assert rows[("throughput_tok_s", "p", "caac", "best-fixed")] == pytest.approx(1.25)
    assert rows[("throughput_tok_s", "q", "caac", "best-fixed")] == pytest.approx(0.5)
    assert rows[("wasted_draft_tokens", "p", "ipdg", "npdg")] == pytest.approx(4.0)
    assert rows[("proactive_wasted_tokens", "p", "ipdg", "npdg")] == pytest.approx(3.0)
    assert ("wasted_draft_tokens", "q", "ipdg", "npdg") not in rows
    assert rows[("tpot_s", "p", "ipdg", "stop-and-wait")] == pytest.approx(2.0)
    assert rows[("wasted_draft_tokens", "p", "ipdg-skip", "npdg")] == pytest.approx(5.0)
    assert rows[("proactive_wasted_tokens", "p", "ipdg-skip", "npdg")] == pytest.approx(6.0)
    assert rows[("tpot_s", "p", "ipdg-skip", "stop-and-wait")] == pytest.approx(0.8)


def test_sdk_default_gets_generic_and_best_fixed_rows():
    # sr-paced (the SDK's default) is compared like a speculative mode (vs cloud-ar,
    # standard-sd, the best peer) and against the best fixed depth; other adaptive modes
    # (caac, fixed-N, stop-and-wait) keep to the adaptive rows
    from bench.report.ratios import peer_ratios, ratio_specs

    modes = ["cloud-ar", "standard-sd", "sr-paced", "caac", "fixed-3", "stop-and-wait"]
    specs = {(met, m, b) for met, m, b, _ in ratio_specs(modes)}
    assert specs == {("uplink_bytes_per_token", "sr-paced", "standard-sd"),
                     ("throughput_tok_s", "sr-paced", "cloud-ar"),
                     ("throughput_tok_s", "sr-paced", "standard-sd")}
    runs = [_run("fixed-3", "p", "a", throughput_tok_s=4.0),
            _run("stop-and-wait", "p", "a", throughput_tok_s=5.0),
            _run("sr-paced", "p", "a", throughput_tok_s=6.0),
            _run("llamacpp-ar", "p", "a", throughput_tok_s=3.0)]
    rows = {(r["mode"], r["baseline"]): r["value"] for r in adaptive_ratios(runs)}
    assert rows[("sr-paced", "best-fixed")] == pytest.approx(1.2)
    (peer,) = peer_ratios(runs)
    assert (peer["mode"], peer["value"]) == ("sr-paced", pytest.approx(2.0))


def test_the_sdk_default_mode_is_the_sdks_defaults():
    # exactly one mode claims to be the SDK's default, and it drafts as EdgeClient does
    # when given nothing (the bench's client mode adds only what the SDK leaves implicit)
    import inspect

    from bench.modes import MODES, get_mode
    from edge_sdk import EdgeClient
    from edge_sdk.defaults import DEFAULT_CONTROLLER, DEFAULT_PROACTIVE, DEFAULT_SIBLINGS

    flagged = [m for m in MODES if getattr(get_mode(m), "sdk_default", False)]
    assert flagged == ["sr-paced"]
    kw = get_mode("sr-paced").client_kw
    assert kw == {"controller": DEFAULT_CONTROLLER, "proactive": DEFAULT_PROACTIVE,
                  "send_ahead": True, "siblings": DEFAULT_SIBLINGS}
    sig = inspect.signature(EdgeClient).parameters
    assert sig["proactive_min_hit"].default == 0
    assert sig["siblings"].default == DEFAULT_SIBLINGS == "auto"
    # its ablation differs in the trees alone
    assert get_mode("sr-paced-chain").client_kw == {**kw, "siblings": 0}


def test_best_fixed_geomean_over_workloads():
    runs = [_run("fixed-1", "p", "a", throughput_tok_s=4.0),
            _run("fixed-2", "p", "b", throughput_tok_s=4.0),
            _run("caac", "p", "a", throughput_tok_s=8.0),
            _run("caac", "p", "b", throughput_tok_s=2.0)]
    (row,) = [r for r in adaptive_ratios(runs) if r["mode"] == "caac"]
    assert row["value"] == pytest.approx(1.0)


def test_proactive_timing_and_depths():
    per = [{"round_trace": [{"t_ready": 0.10, "t_response": 0.15},
                            {"t_ready": 0.30, "t_response": 0.20},
                            {"t_ready": None, "t_response": 0.4}],
            "depth_hist": [4, 2, 2]},
           {"round_trace": [{"t_ready": 0.5, "t_response": 0.5}], "depth_hist": [1, 0]}]
    t = proactive_timing(per)
    assert t["proactive_phases"] == 3
    assert t["proactive_ready_before_response"] == pytest.approx(2 / 3)
    assert t["proactive_ready_minus_response_s"] == pytest.approx(0.0)
    assert proactive_timing([{"round_trace": []}]) == {}
    d = depth_summary(per)
    assert d["depth_mean"] == pytest.approx(9 / 4)
    assert d["depth_counts"] == {"0": 1, "1": 1, "2": 2, "4": 1}


def test_quick_preset_has_the_adaptive_group():
    # caac vs best-fixed with and without the mid-run edge slowdown; ipdg vs npdg /
    # stop-and-wait (same depth) under the slowdown, where IPDG's interruption acts (RAPID);
    # the SDK's default (sr-paced) against cloud-ar, standard-sd and the peers
    from bench.report.ratios import FIXED_MODES

    for m in ("caac", "stop-and-wait"):
        assert m in QUICK["modes"] and QUICK["mode_profiles"][m] == ["medium", "medium+slow"]
    for m in ("fixed-3", "ipdg", "ipdg-skip", "npdg"):
        assert m in QUICK["modes"] and QUICK["mode_profiles"][m] == ["medium+slow"]
    for m in ("cloud-ar", "standard-sd", "sr-paced", "llamacpp-ar", "llamacpp-spec"):
        assert m in QUICK["modes"] and QUICK["mode_profiles"][m] == ["medium"]
    assert len(QUICK["modes"]) == len(set(QUICK["modes"]))
    # best-fixed has a choice where the depth that wins moves (under the slowdown)
    assert sum(m in FIXED_MODES and "medium+slow" in QUICK["mode_profiles"][m]
               for m in QUICK["modes"]) >= 2
    assert QUICK["prompts"] >= 4 and QUICK["max_new_tokens"] >= 32
    assert QUICK["edge_slowdown"] > 1 and QUICK["slowdown_at_s"] > 0
    assert {"medium", "medium+slow"} <= set(QUICK["profiles"])


def test_cli_quick_passes_the_adaptive_settings(monkeypatch):
    from click.testing import CliRunner

    from bench import harness
    from bench.cli import bench

    seen = []
    monkeypatch.setattr(harness, "run_bench", lambda cfg, out_dir, progress=True, log=None:
                        seen.append(cfg) or {"config": {}, "runs": [], "ratios": []})
    r = CliRunner().invoke(bench, ["--quick", "--out", "/tmp/x", "--no-progress"])
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert cfg.edge_slowdown == QUICK["edge_slowdown"]
    assert cfg.mode_profiles["caac"] == ["medium", "medium+slow"]
    assert cfg.mode_profiles["cloud-ar"] == ["medium"]
    assert cfg.prompts >= 4 and cfg.max_new_tokens >= 32
    r = CliRunner().invoke(bench, ["--quick", "--modes", "caac,fixed-1", "--edge-slowdown",
                                   "2", "--out", "/tmp/x", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert seen[-1].mode_profiles is None and seen[-1].edge_slowdown == 2.0


def test_cli_skip_threshold_reaches_the_skip_modes(monkeypatch):
    from click.testing import CliRunner

    from bench import harness
    from bench.cli import bench
    from bench.modes import get_mode

    seen = []
    monkeypatch.setattr(harness, "run_bench", lambda cfg, out_dir, progress=True, log=None:
                        seen.append(cfg) or {"config": {}, "runs": [], "ratios": []})
    for m in ("ipdg-skip", "sr-paced-skip"):
        assert get_mode(m).client_kw["proactive_min_hit"] == 0.3
    r = CliRunner().invoke(bench, ["--modes", "ipdg,ipdg-skip,sr-paced-skip",
                                   "--proactive-min-hit", "0.4", "--out", "/tmp/x",
                                   "--no-progress"])
    assert r.exit_code == 0, r.output
    opts = seen[-1].mode_options
    assert opts["ipdg-skip"]["client"]["proactive_min_hit"] == 0.4
    assert opts["sr-paced-skip"]["client"]["proactive_min_hit"] == 0.4
    assert "ipdg" not in opts
    r = CliRunner().invoke(bench, ["--modes", "ipdg-skip", "--proactive-min-hit", "1",
                                   "--out", "/tmp/x", "--no-progress"])
    assert r.exit_code != 0 and "proactive-min-hit" in r.output


def test_adaptive_group_through_the_runner(tmp_path):
    """caac / fixed depths / ipdg / npdg / stop-and-wait on a link and its ``+slow``
    variant: only the variant is contended, the adaptive ratio rows are in
    results.json, proactive timing is reported, greedy outputs are identical."""
    lan = Profile("lan", 200e6, 200e6, rtt_s=0.01)
    slow = Profile("lan+slow", 200e6, 200e6, rtt_s=0.01)
    cfg = BenchConfig(modes=["caac", "fixed-1", "fixed-2", "stop-and-wait", "ipdg", "npdg"],
                      profiles=[lan, slow], sampling=["greedy"], max_new_tokens=10, depth=3,
                      target=tiny_target, draft=tiny_draft, prompt_sets=PROMPTS,
                      edge_slowdown=4.0, slowdown_at_s=0.0, warmup=False)
    results = run_bench(cfg, tmp_path, progress=False, log=lambda s: None)
    report.validate_results(report.load_results(tmp_path / "results.json"))
    runs = {(r["mode"], r["profile"]): r["metrics"] for r in results["runs"]}
    assert len(runs) == 12
    for (mode, prof), m in runs.items():
        assert (m["draft_slowed_calls"] > 0) == (prof == "lan+slow"), (mode, prof)
        assert m["committed_tokens"] > 0
    for prof in ("lan", "lan+slow"):
        assert set(runs[("fixed-1", prof)]["depth_counts"]) <= {"0", "1"}
        assert runs[("fixed-1", prof)]["depth_mean"] == 1.0
        assert runs[("ipdg", prof)]["proactive_phases"] > 0
        assert 0 <= runs[("ipdg", prof)]["proactive_ready_before_response"] <= 1
        assert runs[("stop-and-wait", prof)].get("proactive_phases") is None
        assert runs[("stop-and-wait", prof)]["proactive_drafted_tokens"] == 0
        assert runs[("npdg", prof)]["proactive_drafted_tokens"] > 0
    keys = {(r["metric"], r["mode"], r["baseline"]) for r in results["ratios"]}
    assert ("throughput_tok_s", "caac", "best-fixed") in keys
    assert ("tpot_s", "ipdg", "stop-and-wait") in keys
    assert not any(r["mode"] == "caac" and r["baseline"] == "fixed-1" for r in results["ratios"])
    assert results["config"]["contended_profiles"] == ["lan+slow"]
    assert set(results["config"]["best_fixed"]) == {"lan|mini", "lan+slow|mini"}
    assert results["config"]["greedy_outputs_identical"] is True
    summary = (tmp_path / "summary.md").read_text()
    assert "## Adaptive drafting" in summary and "Best fixed depth" in summary
    assert os.path.exists(tmp_path / "requests.jsonl")


def test_warmup_groups_share_one_request_per_code_path():
    # modes that differ only in a depth or proactive policy share a warm-up request;
    # a different protocol, drafting mechanism or engine gets its own
    from bench.modes import MODES

    key = {n: MODES[n].warmup_key() for n in (
        "caac", "fixed-3", "stop-and-wait", "ipdg", "ipdg-skip", "npdg", "sr-paced",
        "standard-sd", "cloud-ar", "llamacpp-ar", "llamacpp-spec", "pipeline", "no-pipeline",
        "runahead", "fsd", "wisv")}
    assert key["caac"] == key["fixed-3"] == key["stop-and-wait"]
    assert key["ipdg"] == key["ipdg-skip"]
    groups = {key[n] for n in ("caac", "ipdg", "npdg", "sr-paced", "standard-sd",
                               "cloud-ar", "llamacpp-ar", "llamacpp-spec", "pipeline",
                               "no-pipeline", "runahead", "fsd", "wisv")}
    assert len(groups) == 13
