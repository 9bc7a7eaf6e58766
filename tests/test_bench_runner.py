"""Benchmark runner, modes, the cloud-AR streaming route and edge contention.

Fast: tiny random models (conftest), a few tokens per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import msgpack
import pytest
import torch

from bench import report
from bench.linkem import Profile
from bench.config import BenchConfig
from bench.contention import EdgeLoad, SlowdownDrafter
from bench.harness import run_bench
from bench.modes import MODES, BenchMode, get_mode, register_mode
from bench.modes.cloud_stream import CloudStreamClient
from bench.modes.measure import breakdown
from specrelay_data.workloads import Prompt
from edge_sdk.drafters.base import Drafter
from edge_sdk.protocol.sampling import SamplingConfig
from tests.conftest import tiny_model, tiny_tokenizer


def tiny_target():
    """(target, tokenizer) for the spawned cloud process (picklable by reference)."""
    return tiny_model(seed=0), tiny_tokenizer()


def tiny_draft():
    target = tiny_model(seed=0)
    return tiny_model(seed=1, like=target, noise=0.05), tiny_tokenizer()


PROMPTS = {"mini": [Prompt("mini/0", "mini", "w5 w9 w12 w3 w7", "completion"),
                    Prompt("mini/1", "mini", "w40 w41 w2 w2 w8 w30", "completion")]}


# --------------------------------------------------------------------------- runner


def test_scripted_run_through_emulator(tmp_path):
    """2 modes x 1 profile through the emulator, cloud in a pinned spawned process:
    valid results.json, summary with ratios, PNG plots, greedy identity."""
    aff = os.sched_getaffinity(0)
    cfg = BenchConfig(modes=["cloud-ar", "specrelay"],
                      profiles=[Profile("lan", 200e6, 200e6, rtt_s=0.002)],
                      sampling=["greedy"], max_new_tokens=10, depth=3,
                      target=tiny_target, draft=tiny_draft, prompt_sets=PROMPTS)
    t0 = time.perf_counter()
    results = run_bench(cfg, tmp_path, progress=False, log=lambda s: None)
    assert time.perf_counter() - t0 < 45
    assert os.sched_getaffinity(0) == aff                      # edge pinning undone

    report.validate_results(report.load_results(tmp_path / "results.json"))
    runs = {r["mode"]: r["metrics"] for r in results["runs"]}
    assert set(runs) == {"cloud-ar", "specrelay"}
    assert all(r["profile"] == "lan" and r["workload"] == "mini" for r in results["runs"])
    ar, sr = runs["cloud-ar"], runs["specrelay"]
    assert ar["committed_tokens"] == sr["committed_tokens"] > 0
    assert ar["acceptance_rate"] is None and ar["target_passes_per_token"] == 1.0
    assert sr["acceptance_rate"] is not None and sr["rounds"] > 0
    assert sr["drafted_tokens"] > 0 and sum(sr["accepted_hist"]) == sr["rounds"]
    for m in (ar, sr):
        assert m["throughput_tok_s"] > 0 and m["uplink_bytes_per_token"] > 0
        # the link emulator carried the traffic: HTTP headers make it larger than bodies
        assert m["link_uplink_bytes_per_token"] > m["uplink_bytes_per_token"]
        bd = m["breakdown_s"]
        assert set(bd) == set(report.BREAKDOWN_PHASES)
        per_tok_wall = m["wall_s_total"] / m["committed_tokens"]
        assert sum(bd.values()) == pytest.approx(per_tok_wall, rel=0.02)
        assert bd["upload"] > 0 and bd["download"] > 0 and bd["verify"] > 0
    assert sr["breakdown_s"]["draft"] > 0 and ar["breakdown_s"]["draft"] == 0
    assert results["config"]["greedy_outputs_identical"] is True
    assert results["config"]["draft_prefill"] is None       # a torch draft: no graph
    if len(aff) >= 2:
        assert not set(results["config"]["cloud_cpus"]) & set(results["config"]["edge_cpus"])

    ratios = {(r["metric"], r["mode"], r["baseline"]) for r in results["ratios"]}
    assert ("throughput_tok_s", "specrelay", "cloud-ar") in ratios
    summary = (tmp_path / "summary.md").read_text()
    assert "throughput_tok_s" in summary and "| specrelay | lan | mini |" in summary
    assert "Latency breakdown" in summary and "link up" in summary
    for png in ("throughput.png", "latency_breakdown.png", "acceptance_hist.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 4
    recs = [json.loads(x) for x in lines]
    assert {r["prompt_id"] for r in recs} == {"mini/0", "mini/1"}


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown bench mode"):
        run_bench(BenchConfig(modes=["nope"]), progress=False)
    with pytest.raises(ValueError, match="unknown profile"):
        run_bench(BenchConfig(profiles=["nope"]), progress=False)


# --------------------------------------------------------------------------- stream route


async def _stream_vs_target_only(url, tok, ids, cfg, n):
    from edge_sdk import EdgeClient

    sc = CloudStreamClient(url, tok)
    try:
        a = await sc.generate(ids, cfg, n, seed=3)
        a2 = await sc.generate(ids, cfg, n, seed=3)
    finally:
        await sc.close()
    async with EdgeClient(url, None, tok, chat=False) as c:
        b = await c.generate(prompt_ids=ids, sampling=cfg, max_new_tokens=n, seed=3,
                             target_only=True)
    return a, a2, b


def test_cloud_ar_stream_matches_target_only_greedy(server, tok):
    ids = [5, 9, 12, 3, 7]
    a, a2, b = asyncio.run(_stream_vs_target_only(server.url, tok, ids, SamplingConfig(), 16))
    assert a["token_ids"] == b.token_ids and len(a["token_ids"]) > 0
    assert a["finish_reason"] == b.finish_reason
    m = a["metrics"]
    assert m["committed_tokens"] == len(a["token_ids"]) == len(m["token_times_s"])
    assert m["target_passes"] >= m["committed_tokens"] and m["target_seconds"] > 0
    assert m["token_times_s"] == sorted(m["token_times_s"])
    # sampling: replayable from the seed
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    s1, s2, _ = asyncio.run(_stream_vs_target_only(server.url, tok, ids, cfg, 12))
    assert s1["token_ids"] == s2["token_ids"]


def test_stream_route_ndjson_and_errors(server, tok):
    from edge_sdk.protocol import wire

    async def go():
        async with aiohttp.ClientSession() as http:
            body = wire.pack({"prompt_ids": [4, 5, 6], "max_new_tokens": 5})
            async with http.post(server.url + "/v1/sessions", data=body,
                                 headers={"content-type": "application/x-msgpack"}) as r:
                sid = wire.unpack(await r.read())["session_id"]
            path = f"{server.url}/v1/sessions/{sid}/generate"
            async with http.post(path, json={"max_new_tokens": 3},
                                 headers={"Accept": "application/x-ndjson"}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("application/x-ndjson")
                items = [json.loads(x) for x in (await r.text()).splitlines()]
            async with http.post(path, data=b"") as r:     # continues the same session
                more = list(msgpack.Unpacker(__import__("io").BytesIO(await r.read())))
            async with http.post(path, json={"max_new_tokens": 0}) as r:
                bad = (r.status, await r.json())
            async with http.post(server.url + "/v1/sessions/123/generate") as r:
                missing = r.status
            async with http.get(f"{server.url}/v1/sessions/{sid}") as r:
                state = await r.json()
        return items, more, bad, missing, state

    items, more, bad, missing, state = asyncio.run(go())
    toks = [x for x in items if x[0] == 5]
    assert items[-1][0] == 6 and items[-1][2] == len(toks) and 1 <= len(toks) <= 3
    assert all(isinstance(x[2], float) and x[2] > 0 for x in toks)
    assert more[-1][0] == 6
    assert bad[0] == 422 and bad[1]["error"]["field"] == "max_new_tokens"
    assert missing == 404
    n_more = sum(1 for x in more if x[0] == 5)
    assert state["generated"] == len(toks) + n_more


# --------------------------------------------------------------------------- contention


class _SleepyDrafter(Drafter):
    """Each forward takes ~``dt`` seconds; logits favour token 1."""

    vocab_size = 8

    def __init__(self, dt):
        self.dt, self.n = dt, 0

    def _logits(self):
        time.sleep(self.dt)
        return torch.arange(8, dtype=torch.float32).flip(0)

    def sync(self, context):
        self.n = len(context)
        return self._logits()

    def step(self, token):
        self.n += 1
        return self._logits()

    def cache_len(self):
        return self.n


def test_edge_slowdown_applies_after_switch_time():
    now = [0.0]
    d = SlowdownDrafter(_SleepyDrafter(0.02), factor=3.0, at_s=5.0, clock=lambda: now[0])
    d.restart_clock()
    before = d.propose([1, 2, 3], 4, SamplingConfig())
    assert d.slowed_calls == 0 and d.added_s == 0.0 and not d.active
    now[0] = 5.0                                               # the switch time
    after = d.propose([1, 2, 3], 4, SamplingConfig())
    assert d.active and d.slowed_calls == 4
    assert d.added_s >= 2 * 4 * 0.02 * 0.95                    # (factor-1) x forward time
    assert after.draft_s >= before.draft_s + d.added_s * 0.9
    assert after.tokens == before.tokens                       # slower, not different
    d.restart_clock()
    assert not d.active
    with pytest.raises(ValueError):
        SlowdownDrafter(_SleepyDrafter(0), factor=0.5)


def test_edge_load_processes_start_late_and_stop():
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    load = EdgeLoad(1, cpus, at_s=0.3).start()
    assert load.procs == []
    deadline = time.time() + 5
    while not load.procs and time.time() < deadline:
        time.sleep(0.05)
    assert len(load.procs) == 1 and load.procs[0].poll() is None
    procs = list(load.procs)
    load.stop()
    assert all(p.poll() is not None for p in procs)


# --------------------------------------------------------------------------- registry


def test_mode_registry_and_breakdown():
    assert {"cloud-ar", "standard-sd", "specrelay"} <= set(MODES)
    assert get_mode("cloud-ar").baseline and get_mode("standard-sd").baseline
    assert not get_mode("specrelay").baseline

    class Dup(BenchMode):
        name = "specrelay"

        async def run_request(self, req):  # pragma: no cover
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register_mode(Dup)

    @register_mode
    class Custom(BenchMode):
        name = "test-custom"

        async def run_request(self, req):  # pragma: no cover
            raise NotImplementedError

    try:
        assert get_mode("test-custom") is Custom
    finally:
        MODES.pop("test-custom")
    p = Profile("x", 8e6, 16e6, rtt_s=0.1)
    bd = breakdown(3.0, 0.3, 0.5, 4, 1_000_000, 1_000_000, p)
    assert bd["upload"] == pytest.approx(4 * 0.05 + 1.0)
    assert bd["download"] == pytest.approx(4 * 0.05 + 0.5)
    assert bd["wait"] == pytest.approx(0.3) and sum(bd.values()) == pytest.approx(3.0)


def test_cli_list_modes_and_bad_mode():
    from click.testing import CliRunner

    from bench.cli import bench

    r = CliRunner().invoke(bench, ["--list-modes"])
    assert r.exit_code == 0 and "cloud-ar" in r.output and "specrelay" in r.output
    r = CliRunner().invoke(bench, ["--modes", "nope", "--out", "/tmp/x"])
    assert r.exit_code != 0 and "unknown bench mode" in r.output
    r = CliRunner().invoke(bench, ["--modes", "sr-pacd", "--out", "/tmp/x"])
    assert r.exit_code == 2 and "did you mean sr-paced" in r.output
    assert "--list-modes" in r.output and "cloud-ar" not in r.output     # no 44-name list
