"""The local-target benchmark (CATS): modes ``local-offload-ar`` and ``cats`` x memory
budgets x storage bandwidths x workloads, no cloud and no link.

Each (mode, budget, storage) runs in a fresh process (:mod:`bench.local.cell`) so its
``peak_rss_bytes`` is its own. The ``profile`` label of a run carries the budget and the
bandwidth (``mem50%-nvme``), so a ``cats`` run and a ``local-offload-ar`` run of one
budget and storage share it and are compared in the ``ratios`` rows. Writes
``results.json`` and ``summary.md`` under the output folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["LOCAL_MODES", "run_local_bench", "profile_label"]

LOCAL_MODES = {"local-offload-ar": "ar", "cats": "cats"}
"""Bench mode -> :func:`edge_sdk.local_target.session.build_local` method."""


def profile_label(budget: str, storage: str) -> str:
    """``mem50%-nvme`` for a fraction 0.5, ``mem1.5GB-emmc`` for a byte budget."""
    try:
        f = float(budget)
        b = f"{f * 100:g}%" if f <= 1.0 else f"{f / 1e9:g}GB"
    except ValueError:
        b = str(budget)
    return f"mem{b}-{storage}"


def _cell(spec: dict, timeout: float) -> dict:
    """Run one cell process; returns its JSON answer. Raises RuntimeError on failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "bench.local.cell", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode or "@@RESULT@@" not in proc.stdout:
        raise RuntimeError(f"local cell {spec['method']} {spec['budget']} {spec['storage']} "
                           f"failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.rsplit("@@RESULT@@", 1)[1])


def _metrics(recs: list[dict]) -> dict:
    """Run metrics of one workload's records (token-weighted)."""
    tot = lambda k: sum(r["stats"][k] for r in recs)            # noqa: E731
    committed, secs, pre = tot("committed"), tot("seconds"), tot("prefill_s")
    return {"throughput_tok_s": committed / secs if secs else None,
            "decode_tok_s": committed / (secs - pre) if secs > pre else None,
            "acceptance_rate": tot("accepted") / tot("drafted") if tot("drafted") else None,
            "mean_accepted_length": committed / max(1, tot("rounds")),
            "target_passes_per_token": tot("rounds") / max(1, committed),
            "storage_bytes_per_token": tot("storage_bytes") / max(1, committed),
            "ttft_s": pre / len(recs), "committed_tokens": committed, "requests": len(recs),
            "sibling_hits": sum(r["stats"].get("sibling_hits", 0) for r in recs)}


def _requests(target: str, workloads: Sequence[str], sampling: str, prompts: int,
              seed: int) -> list[dict]:
    from bench.cells import encode_requests
    from specrelay_data.workloads import load_workload
    from edge_sdk.models import load_tokenizer

    tok, out = load_tokenizer(target), []
    for w in workloads:
        label = w if sampling == "greedy" else f"{w}/{sampling}"
        for r in encode_requests(tok, load_workload(w)[:prompts], label, seed):
            out.append({"prompt_id": r.prompt_id, "workload": label,
                        "prompt_ids": list(r.prompt_ids), "seed": r.seed})
    return out


def _ratios(runs: list[dict]) -> list[dict]:
    """cats / local-offload-ar throughput per (profile, workload)."""
    base = {(r["profile"], r["workload"]): r for r in runs if r["mode"] == "local-offload-ar"}
    out = []
    for r in runs:
        b = base.get((r["profile"], r["workload"]))
        if r["mode"] == "cats" and b and b["metrics"]["throughput_tok_s"]:
            out.append({"metric": "throughput_tok_s", "profile": r["profile"], "mode": "cats",
                        "baseline": "local-offload-ar", "workload": r["workload"],
                        "value": r["metrics"]["throughput_tok_s"]
                        / b["metrics"]["throughput_tok_s"]})
    return out


def _identity(records: list[dict]) -> dict:
    """Greedy outputs of cats vs local-offload-ar per (profile, prompt)."""
    by = {}
    for r in records:
        by.setdefault((r["profile"], r["workload"], r["prompt_id"]), {})[r["mode"]] = r["token_ids"]
    pairs = [v for v in by.values() if len(v) == 2]
    return {"compared": len(pairs), "identical": sum(a == b for a, b in
                                                     (tuple(v.values()) for v in pairs))}


def run_local_bench(modes: Sequence[str], budgets: Sequence[str], storages: Sequence[str],
                    workloads: Sequence[str], sampling: Sequence[str], prompts: int,
                    max_new_tokens: int, seed: int, target: str, dtype: str,
                    threads: int | None, out_dir: str | None,
                    log: Callable[[str], None] = print, timeout: float = 3600) -> dict:
    """Measure every (mode, budget, storage) on the workloads; returns ``results.json``'s
    object. Raises ValueError for a mode that is not local, RuntimeError for a failed
    cell."""
    bad = [m for m in modes if m not in LOCAL_MODES]
    if bad:
        raise ValueError(f"local modes run apart from the cloud modes: {bad[0]!r} is not "
                         f"one of {sorted(LOCAL_MODES)}")
    runs, records, t0 = [], [], time.perf_counter()
    for samp in sampling:
        reqs = _requests(target, workloads, samp, prompts, seed)
        for budget in budgets:
            for storage in storages:
                prof = profile_label(budget, storage)
                for mode in modes:
                    log(f"local bench: {mode} | {prof} | {samp} ({len(reqs)} requests)")
                    if LOCAL_MODES[mode] == "cats":   # fit/cache the exit head apart:
                        _cell(_spec(target, "cats", budget, storage, dtype, threads, [],
                                    max_new_tokens, samp), timeout)   # not in peak RSS
                    ans = _cell(_spec(target, LOCAL_MODES[mode], budget, storage, dtype,
                                      threads, reqs, max_new_tokens, samp), timeout)
                    _collect(ans, mode, prof, runs, records)
    results = {"config": {"modes": list(modes), "budgets": list(budgets),
                          "storages": list(storages), "workloads": list(workloads),
                          "sampling": list(sampling), "prompts": prompts,
                          "max_new_tokens": max_new_tokens, "target": target, "dtype": dtype,
                          "greedy_identity": _identity([r for r in records if "/" not in
                                                        r["workload"]]),
                          "elapsed_s": time.perf_counter() - t0},
               "runs": runs, "ratios": _ratios(runs)}
    if out_dir:
        _write(results, records, out_dir)
    return results


def _spec(target, method, budget, storage, dtype, threads, reqs, max_new_tokens,
          samp) -> dict:
    """The JSON spec of one :mod:`bench.local.cell` run."""
    from bench.cells import sampling_config

    return {"target": target, "method": method, "budget": budget, "storage": storage,
            "dtype": dtype, "threads": threads, "requests": reqs,
            "max_new_tokens": max_new_tokens, "sampling": sampling_config(samp).to_dict(),
            "depth": None}


def _collect(ans: dict, mode: str, prof: str, runs: list, records: list) -> None:
    """One cell's answer -> a run row per workload (+ request records)."""
    mem = {k: ans[k] for k in ("peak_rss_bytes", "rss_after_import_bytes",
                               "rss_after_load_bytes")}
    for w in dict.fromkeys(r["workload"] for r in ans["records"]):
        recs = [r for r in ans["records"] if r["workload"] == w]
        runs.append({"mode": mode, "profile": prof, "workload": w, "metrics": _metrics(recs),
                     **mem, "local": ans["local"]})
        records += [{"mode": mode, "profile": prof, **r} for r in recs]


def _write(results: dict, records: list[dict], out_dir: str) -> None:
    from bench.local.summary import summary_md

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out / "summary.md").write_text(summary_md(results))
