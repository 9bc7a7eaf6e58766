"""``specrelay bench --modes local-offload-ar,cats --memory-budget ...`` end to end on a
tiny checkpoint folder: each cell in a fresh process with its peak RSS, the budget and
storage in the profile label, a ratio row, greedy outputs identical."""

from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from edge_sdk.local_target.load import open_local_target

BUDGET = "1.75MB"    # 2 of the 6 layers resident (+ two streamed buffers + KV reserve)
STORAGE = "1MB/s"    # 148 ms per streamed pass: speculation pays


def test_local_bench_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    model = tiny_model(layers=6, seed=2)
    model.save_pretrained(folder)           # model.safetensors, config, generation config
    tiny_tokenizer().save_pretrained(folder)
    local = open_local_target(str(folder), BUDGET, STORAGE, "float32")
    assert local.target.R == 2 and local.plan.depth >= 1
    assert local.plan.draft == "skip"        # the layer-skipping draft: nothing to fit

    from specrelay_cli import main
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--modes", "local-offload-ar,cats",
                                    "--memory-budget", BUDGET, "--storage", STORAGE,
                                    "--workloads", "humaneval", "--prompts", "1",
                                    "--max-new-tokens", "6", "--dtype", "float32",
                                    "--target", str(folder), "--out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    assert {x["mode"] for x in r["runs"]} == {"local-offload-ar", "cats"}
    assert {x["profile"] for x in r["runs"]} == {"mem1.75MB-1MB/s"}
    assert all(x["peak_rss_bytes"] > 0 for x in r["runs"])
    assert r["ratios"] and r["config"]["greedy_identity"] == {"compared": 1, "identical": 1}
    assert "mem1.75MB-1MB/s" in (out / "summary.md").read_text()
    cats = next(x for x in r["runs"] if x["mode"] == "cats")
    assert cats["local"]["plan"]["draft"] == "skip" and cats["local"]["exit_head"].startswith("skip-")


def test_generate_local_with_trees_matches_the_target_alone(tmp_path, monkeypatch):
    """``specrelay generate --local`` on the tiny checkpoint (bf16): the plan drafts with
    the 4-bit self-draft, and on a torch without CPU int4 kernels it drafts dynamic
    trees of the skip draft at this budget and storage (a draft token is far under 10 %
    of the streamed pass), the stderr line names them; the tokens are the offloaded
    target's alone (``--local-method ar``), greedy."""
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    from edge_sdk.local_target import quant

    if quant.int4_supported():
        folder = tmp_path / "tiny"
        tiny_model(layers=6, seed=2).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        from specrelay_cli import main
        q = CliRunner().invoke(main, ["generate", "def f(x):", "--local", "--memory-budget",
                                      BUDGET, "--storage", STORAGE, "--local-target",
                                      str(folder), "--max-new-tokens", "12", "--json"])
        assert q.exit_code == 0, q.output
        qr = json.loads(q.output.strip().splitlines()[-1])
        assert qr["local"]["plan"]["draft"] == "quant" and qr["local"]["draft_bytes"] > 0
        quant_ids = qr["token_ids"]
    else:                                                      # pragma: no cover
        quant_ids = None
    monkeypatch.setattr(quant, "int4_supported", lambda: False)
    folder = tmp_path / "tiny"
    tiny_model(layers=6, seed=2).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    from specrelay_cli import main

    base = ["generate", "def f(x):", "--local", "--memory-budget", BUDGET, "--storage",
            STORAGE, "--local-target", str(folder), "--max-new-tokens", "12"]
    runs = {}
    for method in ("cats", "ar"):
        res = CliRunner().invoke(main, base + ["--local-method", method, "--json"])
        assert res.exit_code == 0, res.output
        runs[method] = json.loads(res.output.strip().splitlines()[-1])
    assert runs["cats"]["local"]["beam"] > 1 and runs["cats"]["local"]["nodes"] > 1
    assert runs["cats"]["token_ids"] == runs["ar"]["token_ids"]
    assert quant_ids in (None, runs["ar"]["token_ids"])
    assert runs["cats"]["metrics"]["rounds"] < runs["ar"]["metrics"]["rounds"]
    res = CliRunner().invoke(main, base)
    assert res.exit_code == 0 and "(trees " in res.output, res.output
