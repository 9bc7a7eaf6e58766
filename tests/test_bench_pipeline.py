"""The confirmed-prefix pipeline bench mode (AsymSpec §IV-C) and its baselines.

Fast: tiny random models (conftest), one link profile, C = 4 concurrent requests.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench import report
from bench.cells import cell_prompts, requests_per_cell
from bench.cloud_process import parse_prometheus, scrape_server
from bench.config import QUICK, BenchConfig
from bench.harness import run_bench
from bench.linkem import Profile
from bench.modes import MODES, get_mode
from bench.modes.concurrent import BusyExecutor, ConcurrentMode
from bench.report.labels import point_label, split_point
from bench.report.ratios import (CONCURRENT_BASELINES, STRONGEST, pipeline_ratios,
                                 strongest_baselines)
from specrelay_data.workloads import Prompt
from tests.conftest import tiny_model, tiny_tokenizer

CONCURRENT = ["pipeline", "no-pipeline", "runahead", "standard-sd-concurrent",
              "pipeline-standard"]
PROMPTS = {"mini": [Prompt("mini/0", "mini", "w5 w9 w12 w3 w7", "completion"),
                    Prompt("mini/1", "mini", "w40 w41 w2 w2 w8 w30", "completion"),
                    Prompt("mini/2", "mini", "w17 w18 w19", "completion")]}
NEW_TOKENS = 12


def tiny_target():
    """(target, tokenizer) for the spawned cloud process (picklable by reference)."""
    return tiny_model(seed=0), tiny_tokenizer()


def tiny_draft():
    target = tiny_model(seed=0)
    return tiny_model(seed=1, like=target, noise=0.05), tiny_tokenizer()


def _target_only(prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Plain target greedy decoding (the reference every mode must reproduce)."""
    from cloud_api.service import CloudService
    from cloud_api.inprocess import InProcessTransport
    from edge_sdk import EdgeClient

    model, tok = tiny_target()
    svc = CloudService(model, tok)

    async def main():
        async with EdgeClient("inproc://", None, tok, chat=False,
                              transport=InProcessTransport(svc)) as c:
            return [(await c.generate(prompt_ids=p, max_new_tokens=n,
                                      target_only=True)).token_ids for p in prompt_ids]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline-bench")
    cfg = BenchConfig(modes=CONCURRENT, profiles=[Profile("lan", 100e6, 500e6, rtt_s=0.004)],
                      sampling=["greedy"], max_new_tokens=NEW_TOKENS, depth=4,
                      concurrent_depth=3,
                      concurrency=[4], target=tiny_target, draft=tiny_draft,
                      prompt_sets=PROMPTS,
                      # the tiny target verifies in ~1 ms: let the queue wait a little
                      # after the first block so arrived blocks of other requests batch
                      server_kw={"max_wait_s": 0.05})
    t0 = time.perf_counter()
    results = run_bench(cfg, out, progress=False, log=lambda s: None)
    return results, out, time.perf_counter() - t0


def test_concurrent_modes_registered():
    for name in CONCURRENT:
        cls = get_mode(name)
        assert issubclass(cls, ConcurrentMode) and cls.concurrent
    assert not MODES["pipeline"].baseline
    assert all(MODES[b].baseline for b in CONCURRENT_BASELINES)
    assert MODES["pipeline"].server_max_batch(16, 8) >= 16       # re-batching on
    assert MODES["no-pipeline"].server_max_batch(16, 8) == 1     # no cross-request batch
    assert MODES["runahead"].server_max_batch(16, 8) == 1
    assert MODES["standard-sd-concurrent"].server_max_batch(16, 8) == 1
    assert MODES["pipeline-standard"].server_max_batch(16, 8) == 16
    assert not MODES["pipeline-standard"].baseline
    assert MODES["pipeline-standard"].client_mode == "standard"
    assert MODES["runahead"].client_kw == {"proactive": "npdg"}


def test_pipeline_bench_results_valid(bench_run):
    results, out, elapsed = bench_run
    assert elapsed < 120
    report.validate_results(report.load_results(out / "results.json"))
    runs = {r["mode"]: r for r in results["runs"]}
    assert set(runs) == set(CONCURRENT)
    assert results["config"]["concurrent_depth"] == 3
    for name, r in runs.items():
        m = r["metrics"]
        assert r["profile"] == "lan@c4" and r["workload"] == "mini"
        assert max(int(d) for d in m["depth_counts"]) == 3     # --concurrent-depth
        assert m["concurrency"] == 4 and m["network_profile"] == "lan"
        assert m["n_requests"] == 4                  # 3 prompts -> one whole wave of 4
        assert m["committed_tokens"] == 4 * NEW_TOKENS
        assert m["throughput_tok_s"] > 0 and m["makespan_s"] > 0
        # throughput over the makespan of the concurrent requests, not the sum of walls
        assert m["throughput_tok_s"] == pytest.approx(m["committed_tokens"] / m["makespan_s"])
        assert m["makespan_s"] < m["wall_s_total"]
        assert 0 < m["edge_utilisation"] <= 1.05 and m["edge_busy_s"] > 0
        assert 0 < m["cloud_utilisation"] <= 1.05
        assert m["edge_cpu_s"] > 0 and m["cloud_cpu_s"] > 0
        assert m["edge_cpu_utilisation"] > 0 and m["cloud_cpu_utilisation"] > 0
        assert m["server_target_passes"] > 0 and m["mean_batch_size"] >= 1
        assert m["target_passes_per_token"] == pytest.approx(
            m["server_target_passes"] / m["committed_tokens"])
        assert m["link_uplink_bytes_per_token"] > 0
        assert set(m["breakdown_s"]) == set(report.BREAKDOWN_PHASES)
    pipe, nop = runs["pipeline"]["metrics"], runs["no-pipeline"]["metrics"]
    assert pipe["server_max_batch"] == 4 and nop["server_max_batch"] == 1
    for b in CONCURRENT_BASELINES:                # no cross-request batching
        assert runs[b]["metrics"]["server_max_batch"] == 1
        assert runs[b]["metrics"]["mean_batch_size"] == 1.0
    assert pipe["mean_batch_size"] > 1.3            # re-batched across requests
    assert pipe["target_passes_per_token"] < 1.0
    # a batched pass counts once: never more passes than verification rounds
    assert pipe["server_target_passes"] <= pipe["rounds"]
    ra = runs["runahead"]["metrics"]
    assert ra["proactive_hit_rate"] is not None and ra["runahead_wasted_tokens"] >= 0
    for full_q in ("standard-sd-concurrent", "pipeline-standard"):
        assert runs[full_q]["metrics"]["uplink_bytes_per_token"] > \
            10 * pipe["uplink_bytes_per_token"]
    assert runs["pipeline-standard"]["metrics"]["mean_batch_size"] > 1.0


def test_pipeline_greedy_equals_target_only(bench_run, tok):
    from edge_sdk.models import encode_prompt

    results, out, _ = bench_run
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    texts = {p.id: p.text for p in PROMPTS["mini"]}
    base = lambda pid: pid.split("#")[0]  # noqa: E731 - cycled prompts: mini/0#1
    ids = sorted({r["prompt_id"] for r in recs})
    assert ids == ["mini/0", "mini/0#1", "mini/1", "mini/2"]
    ref = dict(zip(ids, _target_only([encode_prompt(tok, texts[base(i)], False) for i in ids],
                                     NEW_TOKENS)))
    for r in recs:
        assert r["token_ids"] == ref[r["prompt_id"]], (r["mode"], r["prompt_id"])
        assert len(r["token_ids"]) == NEW_TOKENS
        assert r["metrics"]["end_s"] > r["metrics"]["start_s"]
    assert results["config"]["greedy_outputs_identical"] is True
    # the four requests of a run overlapped in time
    pipe = sorted((r["metrics"]["start_s"], r["metrics"]["end_s"]) for r in recs
                  if r["mode"] == "pipeline")
    assert pipe[-1][0] < pipe[0][1]


def test_pipeline_ratio_rows(bench_run):
    results, out, _ = bench_run
    rows = {(r["metric"], r["profile"], r["mode"], r["baseline"]): r["value"]
            for r in results["ratios"]}
    key = ("throughput_tok_s", "lan@c4", "pipeline", STRONGEST)
    assert key in rows and rows[key] > 0
    runs = {r["mode"]: r["metrics"] for r in results["runs"]}
    best = max(runs[b]["throughput_tok_s"] for b in CONCURRENT_BASELINES)
    assert rows[key] == pytest.approx(runs["pipeline"]["throughput_tok_s"] / best)
    assert ("target_passes_per_token", "lan@c4", "pipeline", STRONGEST) in rows
    for b in CONCURRENT_BASELINES:             # and against each baseline
        assert ("throughput_tok_s", "lan@c4", "pipeline", b) in rows
    sb = results["config"]["strongest_baseline"]
    assert sb["lan@c4|mini"] in CONCURRENT_BASELINES
    summary = (out / "summary.md").read_text()
    assert "Concurrent runs" in summary and "| pipeline | lan@c4 | mini |" in summary
    assert STRONGEST in summary


# --------------------------------------------------------------------------- units


def _run(mode, prof, tps, passes=0.2, w="mtbench"):
    return {"mode": mode, "profile": prof, "workload": w,
            "metrics": {"throughput_tok_s": tps, "target_passes_per_token": passes}}


def test_pipeline_ratios_strongest_and_strong_to_weak():
    runs = [_run("pipeline", "strong@c8", 10.0, 0.1), _run("pipeline", "weak@c8", 9.5, 0.1),
            _run("no-pipeline", "strong@c8", 4.0, 1.0), _run("no-pipeline", "weak@c8", 2.0),
            _run("runahead", "strong@c8", 5.0, 0.5), _run("runahead", "weak@c8", 1.0),
            _run("standard-sd-concurrent", "weak@c8", 0.5),
            _run("specrelay", "weak", 3.0)]          # sequential: not an operating point
    rows = {(r["metric"], r["profile"], r["mode"], r["baseline"]): r["value"]
            for r in pipeline_ratios(runs)}
    assert rows[("throughput_tok_s", "strong@c8", "pipeline", STRONGEST)] == 2.0
    assert rows[("throughput_tok_s", "weak@c8", "pipeline", STRONGEST)] == 4.75
    # passes: against the strongest (by throughput) baseline, lower is better
    assert rows[("target_passes_per_token", "strong@c8", "pipeline", STRONGEST)] == \
        pytest.approx(5.0)
    assert rows[("throughput_tok_s", "weak@c8", "pipeline", "pipeline@strong@c8")] == 0.95
    assert rows[("throughput_tok_s", "weak@c8", "no-pipeline", "no-pipeline@strong@c8")] == 0.5
    assert not any(k[1] == "weak" for k in rows)
    assert strongest_baselines(runs) == {"strong@c8|mtbench": "runahead",
                                           "weak@c8|mtbench": "no-pipeline"}


def test_labels_requests_and_prometheus_parsing():
    assert point_label("weak", 8) == "weak@c8"
    assert split_point("weak@c16") == ("weak", 16)
    assert split_point("cellular-edge") == ("cellular-edge", None)
    assert [requests_per_cell(n, 8) for n in (1, 8, 9)] == [8, 8, 16]
    assert requests_per_cell(5, 1) == 5
    ps = PROMPTS["mini"]
    got = cell_prompts(ps, 7)
    assert [p.id for p in got] == ["mini/0", "mini/1", "mini/2", "mini/0#1", "mini/1#1",
                                   "mini/2#1", "mini/0#2"]
    more = ps + [Prompt("mini/3", "mini", "w3", "completion")]
    assert [p.id for p in cell_prompts(ps, 4, more)] == ["mini/0", "mini/1", "mini/2",
                                                           "mini/3"]
    text = ("# HELP specrelay_target_passes_total Target forward passes\n"
            "# TYPE specrelay_target_passes_total counter\n"
            "specrelay_target_passes_total 12.0\n"
            "specrelay_target_seconds_total 1.5\n"
            'specrelay_batch_size_bucket{le="1.0"} 3.0\n'
            "specrelay_batch_size_sum 30.0\nspecrelay_batch_size_count 12.0\n")
    s = parse_prometheus(text)
    assert s["specrelay_target_passes_total"] == 12.0 and s["specrelay_batch_size_sum"] == 30
    assert not any("{" in k for k in s)


def test_busy_executor_counts_busy_seconds():
    ex = BusyExecutor()
    try:
        assert ex.submit(time.sleep, 0.05).result() is None
        assert ex.submit(lambda a, b=1: a + b, 1, b=2).result() == 3
        assert 0.04 < ex.busy_s < 0.5 and ex.calls == 2
    finally:
        ex.shutdown()


def test_scrape_server_reads_live_counters(server):
    m = scrape_server(server.url)
    assert set(m) == {"passes", "target_s", "batch_blocks", "batches"}
    assert all(v >= 0 for v in m.values())


def test_quick_preset_includes_the_pipeline():
    # the baseline that was the strongest in most runs, at the concurrency the pipeline
    # is judged at
    assert "pipeline" in QUICK["modes"] and QUICK["concurrency"] == [8]
    assert "no-pipeline" in set(QUICK["modes"]) & set(CONCURRENT_BASELINES)
    assert "weak" in QUICK["concurrent_profiles"]


def test_cli_concurrency_option():
    from click.testing import CliRunner

    from bench.cli import bench

    r = CliRunner().invoke(bench, ["--list-modes"])
    assert r.exit_code == 0
    for name in CONCURRENT:
        assert name in r.output
    for bad in ("4,x", "0", ","):
        r = CliRunner().invoke(bench, ["--concurrency", bad, "--out", "/tmp/x"])
        assert r.exit_code == 2 and "--concurrency takes" in r.output


def test_cli_quick_config(monkeypatch):
    """--quick builds a config with the pipeline family at 8 concurrent requests (the
    run itself is replaced: only the configuration is checked)."""
    from click.testing import CliRunner

    from bench import harness
    from bench.cli import bench

    seen = []

    def fake_run(cfg, out_dir, progress=True, log=None):
        seen.append(cfg)
        return {"config": {}, "runs": [], "ratios": []}

    monkeypatch.setattr(harness, "run_bench", fake_run)
    r = CliRunner().invoke(bench, ["--quick", "--out", "/tmp/x", "--no-progress"])
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert {"pipeline", "no-pipeline"} <= set(cfg.modes)
    assert cfg.concurrency == [8]
    assert cfg.concurrent_profiles == QUICK["concurrent_profiles"]
    assert cfg.concurrent_max_new_tokens == 32 and cfg.max_new_tokens == QUICK["max_new_tokens"]
    assert cfg.concurrent_depth == 1 and cfg.depth == 8
    r = CliRunner().invoke(bench, ["--quick", "--profiles", "lan", "--concurrency", "1,16",
                                   "--max-new-tokens", "5", "--out", "/tmp/x"])
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert cfg.profiles == ["lan"] and cfg.concurrent_profiles is None
    assert cfg.concurrency == [1, 16] and cfg.concurrent_max_new_tokens is None
    r = CliRunner().invoke(bench, ["--modes", "pipeline", "--concurrency", "4",
                                   "--out", "/tmp/x"])
    assert r.exit_code == 0, r.output
    assert seen[-1].concurrency == [4] and seen[-1].concurrent_profiles is None


def test_cli_concurrent_depth(monkeypatch):
    from click.testing import CliRunner

    from bench import harness
    from bench.cli import bench

    seen = []
    monkeypatch.setattr(harness, "run_bench", lambda cfg, out_dir, progress=True, log=None:
                        seen.append(cfg) or {"config": {}, "runs": [], "ratios": []})
    r = CliRunner().invoke(bench, ["--modes", "pipeline", "--concurrent-depth", "2",
                                   "--depth", "4", "--out", "/tmp/x", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert seen[-1].concurrent_depth == 2 and seen[-1].depth == 4
    r = CliRunner().invoke(bench, ["--modes", "pipeline", "--concurrent-depth", "17",
                                   "--out", "/tmp/x"])
    assert r.exit_code == 2
