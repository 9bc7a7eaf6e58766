"""Tests of benchmark aggregation, ratios, results.json schema, summary and plots."""
from __future__ import annotations

import copy
import json
import math

import pytest

from bench.report import (
    SCALAR_METRICS,
    aggregate,
    compute_ratios,
    load_results,
    validate_results,
    write_plots,
    write_results,
    write_summary_md,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scripted_requests():
    r1 = dict(committed_tokens=10, wall_s=2.0, ttft_s=0.5,
              token_times_s=[0.5] + [0.5 + 1.5 * i / 9 for i in range(1, 10)],
              drafted_tokens=12, accepted_tokens=8, rounds=4, uplink_bytes=400, downlink_bytes=200,
              target_passes=4, target_seconds=0.4, correction_mode_counts={"bounded": 1, "full": 1},
              tv_budget_spent=0.01, proactive_hits=2, proactive_attempts=3,
              breakdown_s=dict(draft=0.5, upload=0.2, wait=0.3, verify=0.8, download=0.2),
              accepted_per_round=[3, 3, 2, 0])
    r2 = dict(committed_tokens=6, wall_s=1.0, ttft_s=0.25, decode_s=0.5,
              drafted_tokens=8, accepted_tokens=4, rounds=2, uplink_bytes=200, downlink_bytes=100,
              target_passes=2, target_seconds=0.2, correction_modes={"proposal": 2},
              tv_budget_spent=0.03, proactive_hits=1, proactive_attempts=1, wasted_draft_tokens=7,
              breakdown_s=dict(draft=0.2, upload=0.1, wait=0.1, verify=0.4, download=0.2),
              accepted_per_round=[4, 0])
    return [r1, r2]


def test_aggregate_scripted_numbers():
    m = aggregate(_scripted_requests())
    assert m["acceptance_rate"] == pytest.approx(12 / 20)
    assert m["mean_accepted_length"] == pytest.approx(16 / 6)
    assert m["ttft_s"] == pytest.approx(0.375)
    assert m["tpot_s"] == pytest.approx((1.5 + 0.5) / (9 + 5))
    assert m["throughput_tok_s"] == pytest.approx(16 / 3.0)
    assert m["uplink_bytes_per_token"] == pytest.approx(600 / 16)
    assert m["downlink_bytes_per_token"] == pytest.approx(300 / 16)
    assert m["target_passes_per_token"] == pytest.approx(6 / 16)
    assert m["target_seconds_per_token"] == pytest.approx(0.6 / 16)
    assert m["wasted_draft_tokens"] == (12 - 8) + 7
    assert m["proactive_hit_rate"] == pytest.approx(3 / 4)
    assert m["correction_mode_counts"] == {"bounded": 1, "proposal": 2, "full": 1}
    assert m["tv_budget_spent"] == pytest.approx(0.02) and m["tv_budget_spent_max"] == 0.03
    assert m["breakdown_s"]["draft"] == pytest.approx(0.7 / 16)
    assert m["breakdown_s"]["verify"] == pytest.approx(1.2 / 16)
    assert m["accepted_hist"] == [2, 0, 1, 2, 1]
    assert (m["n_requests"], m["committed_tokens"], m["rounds"]) == (2, 16, 6)
    json.dumps(m)  # JSON-serialisable


def test_aggregate_concurrent_makespan_and_not_applicable():
    r1, r2 = _scripted_requests()
    r1.update(start_s=100.0, end_s=102.0)
    r2.update(start_s=100.5, end_s=101.5)
    assert aggregate([r1, r2])["throughput_tok_s"] == pytest.approx(16 / 2.0)

    target_only = aggregate([dict(committed_tokens=5, wall_s=1.0, ttft_s=0.2, target_passes=5)])
    assert target_only["acceptance_rate"] is None
    assert target_only["mean_accepted_length"] is None
    assert target_only["proactive_hit_rate"] is None
    assert target_only["tpot_s"] == pytest.approx(0.8 / 4)  # wall - ttft over 4 tokens
    assert target_only["target_passes_per_token"] == 1.0
    assert target_only["accepted_hist"] == []

    with pytest.raises(ValueError, match="ttft_s"):
        aggregate([dict(committed_tokens=1, wall_s=1.0)])
    with pytest.raises(ValueError, match="correction mode"):
        aggregate([dict(committed_tokens=1, wall_s=1.0, ttft_s=1.0, correction_modes={"lossy": 1})])
    with pytest.raises(ValueError):
        aggregate([])


def test_aggregate_accepts_sdk_request_metrics():
    from edge_sdk.metrics import RequestMetrics

    rm = RequestMetrics(t_start=10.0, t_first=10.5, t_end=12.0, drafted_tokens=12, accepted_tokens=8,
                        committed_tokens=10, rounds=4, target_seconds=0.4, draft_seconds=0.5,
                        net_seconds=0.3, uplink_bytes=400, downlink_bytes=200, wasted_draft_tokens=4,
                        tv_budget_spent=0.0, accepted_hist=[3, 3, 2, 0])
    rm.correction_mode_counts["proposal"] = 1
    m = aggregate([rm.to_dict()])
    assert m["acceptance_rate"] == pytest.approx(8 / 12)
    assert m["throughput_tok_s"] == pytest.approx(10 / 2.0)
    assert m["ttft_s"] == pytest.approx(0.5) and m["tpot_s"] == pytest.approx(1.5 / 9)
    assert m["target_passes_per_token"] == pytest.approx(0.4)
    assert m["correction_mode_counts"] == {"bounded": 0, "proposal": 1, "full": 0}
    assert m["accepted_hist"] == [1, 0, 1, 2]
    assert m["breakdown_s"] == pytest.approx(
        {"draft": 0.05, "upload": 0.0, "wait": 0.03, "verify": 0.04, "download": 0.0})


def _metrics(throughput, up_bpt, acceptance=0.6):
    m = aggregate(_scripted_requests())
    m.update(throughput_tok_s=throughput, uplink_bytes_per_token=up_bpt, acceptance_rate=acceptance)
    return m


def _results():
    runs = []
    for prof, k in (("weak", 1.0), ("strong", 2.0)):
        runs += [
            {"mode": "asym", "profile": prof, "workload": "mtbench", "metrics": _metrics(20 * k, 10.0)},
            {"mode": "asym", "profile": prof, "workload": "humaneval", "metrics": _metrics(40 * k, 10.0)},
            {"mode": "standard", "profile": prof, "workload": "mtbench", "metrics": _metrics(10 * k, 40.0)},
            {"mode": "standard", "profile": prof, "workload": "humaneval", "metrics": _metrics(5 * k, 40.0)},
            {"mode": "target", "profile": prof, "workload": "mtbench", "metrics": _metrics(8 * k, 2.0, None)},
        ]
    baselines = [("throughput_tok_s", "asym", "standard", True),
                 ("uplink_bytes_per_token", "asym", "standard", False),
                 ("throughput_tok_s", "asym", "target", True),
                 ("acceptance_rate", "asym", "target", True),  # null in baseline: skipped
                 ("throughput_tok_s", "asym", "missing-mode", True)]
    return {"config": {"model": "tiny", "profiles": ["weak", "strong"]}, "runs": runs,
            "ratios": compute_ratios(runs, baselines)}


def test_compute_ratios():
    rows = _results()["ratios"]
    by = {(r["metric"], r["profile"], r["mode"], r["baseline"]): r["value"] for r in rows}
    assert len(rows) == 6
    # throughput: mtbench 20/10 = 2, humaneval 40/5 = 8 -> geometric mean 4, same on both profiles
    assert by[("throughput_tok_s", "weak", "asym", "standard")] == pytest.approx(4.0)
    assert by[("throughput_tok_s", "strong", "asym", "standard")] == pytest.approx(4.0)
    # lower is better: baseline / mode = 40 / 10
    assert by[("uplink_bytes_per_token", "weak", "asym", "standard")] == pytest.approx(4.0)
    # only mtbench has a target run: 20/8 (weak), 40/16 (strong)
    assert by[("throughput_tok_s", "weak", "asym", "target")] == pytest.approx(2.5)
    assert not any(r["metric"] == "acceptance_rate" or r["baseline"] == "missing-mode" for r in rows)
    assert [r["profile"] for r in rows[:2]] == ["weak", "strong"]  # profile order of the runs
    for r in rows:
        assert set(r) == {"metric", "profile", "mode", "baseline", "value"}


def test_validate_accepts_good_and_round_trips(tmp_path):
    res = _results()
    validate_results(res)
    p = write_results(res, tmp_path / "out" / "results.json")
    assert load_results(p) == json.loads(json.dumps(res))


def _mutations():
    def drop_metric(r):
        del r["runs"][1]["metrics"]["ttft_s"]

    def set_metric(name, value, run=0):
        def f(r):
            r["runs"][run]["metrics"][name] = value
        return f

    def f_extra_top(r):
        r["extra"] = 1

    def f_run_key(r):
        r["runs"][0]["modee"] = r["runs"][0].pop("mode")

    def f_dup(r):
        r["runs"].append(copy.deepcopy(r["runs"][0]))

    def f_corr(r):
        del r["runs"][2]["metrics"]["correction_mode_counts"]["full"]

    def f_corr_float(r):
        r["runs"][2]["metrics"]["correction_mode_counts"]["full"] = 1.5

    def f_breakdown(r):
        r["runs"][0]["metrics"]["breakdown_s"]["net"] = 0.1

    def f_ratio_nan(r):
        r["ratios"][0]["value"] = math.nan

    def f_ratio_key(r):
        r["ratios"][1]["workload"] = "mtbench"

    def f_ratio_metric(r):
        r["ratios"][2]["metric"] = 3

    def f_config(r):
        r["config"] = []

    def f_hist(r):
        r["runs"][0]["metrics"]["accepted_hist"] = [1, -2]

    return [
        (drop_metric, r"runs\[1\]\.metrics\.ttft_s"),
        (set_metric("throughput_tok_s", -1.0), r"runs\[0\]\.metrics\.throughput_tok_s"),
        (set_metric("acceptance_rate", "0.5"), r"runs\[0\]\.metrics\.acceptance_rate"),
        (set_metric("tpot_s", True), r"runs\[0\]\.metrics\.tpot_s"),
        (set_metric("ttft_s", math.inf, 3), r"runs\[3\]\.metrics\.ttft_s"),
        (f_extra_top, r"results: keys"),
        (f_run_key, r"runs\[0\]: keys"),
        (f_dup, r"runs\[10\]: duplicate"),
        (f_corr, r"runs\[2\]\.metrics\.correction_mode_counts"),
        (f_corr_float, r"runs\[2\]\.metrics\.correction_mode_counts\.full"),
        (f_breakdown, r"runs\[0\]\.metrics\.breakdown_s"),
        (f_ratio_nan, r"ratios\[0\]\.value"),
        (f_ratio_key, r"ratios\[1\]: keys"),
        (f_ratio_metric, r"ratios\[2\]\.metric"),
        (f_config, r"config"),
        (f_hist, r"runs\[0\]\.metrics\.accepted_hist"),
    ]


@pytest.mark.parametrize("mutate,field", _mutations())
def test_validate_names_bad_field(mutate, field):
    res = _results()
    mutate(res)
    with pytest.raises(ValueError, match=field):
        validate_results(res)


def test_validate_rejects_non_objects(tmp_path):
    for bad in ([], None, {"config": {}, "runs": {}, "ratios": []}):
        with pytest.raises(ValueError):
            validate_results(bad)
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"config": {}, "runs": [], "ratios": [{"metric": "x"}]}))
    with pytest.raises(ValueError, match=r"ratios\[0\]"):
        load_results(p)
    assert all(name in _results()["runs"][0]["metrics"] for name in SCALAR_METRICS)


def test_summary_contains_runs_and_ratio_rows(tmp_path):
    res = _results()
    text = write_summary_md(res, tmp_path / "summary.md").read_text()
    assert "| asym | weak | mtbench | 20.00 |" in text
    assert "| throughput_tok_s | weak | asym | standard | 4.000× |" in text
    assert "| uplink_bytes_per_token | strong | asym | standard | 4.000× |" in text
    assert "| throughput_tok_s | strong | asym | target | 2.500× |" in text
    assert "**model**: `tiny`" in text
    # null metrics render as a dash, not "None"
    assert "None" not in text and "–" in text


def test_plots_are_real_pngs(tmp_path):
    paths = write_plots(_results(), tmp_path / "plots")
    assert [p.name for p in paths] == ["throughput.png", "latency_breakdown.png", "acceptance_hist.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_plots_without_histogram_data(tmp_path):
    m = aggregate([dict(committed_tokens=5, wall_s=1.0, ttft_s=0.2)])
    res = {"config": {}, "runs": [{"mode": "target", "profile": "none", "workload": "mtbench", "metrics": m}],
           "ratios": []}
    validate_results(res)
    for p in write_plots(res, tmp_path):
        assert p.read_bytes()[:8] == PNG_MAGIC
    assert "(none)" in write_summary_md(res, tmp_path / "s.md").read_text()
