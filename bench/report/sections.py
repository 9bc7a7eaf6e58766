"""The mode families' sections of ``summary.md``: adaptive drafting, concurrent runs
and peer engines (each empty when the run has none of that family)."""
from __future__ import annotations

import numpy as np

from bench.report.labels import split_point
from bench.report.ratios import mode_flag, run_index
from bench.report.tables import runs_table

__all__ = ["adaptive_md", "concurrent_md", "peers_md"]

# --------------------------------------------------------------------------- adaptive

_ADAPTIVE_COLS = [
    ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"), ("tpot_s", "TPOT ms", 1e3, "{:.1f}"),
    ("acceptance_rate", "accept", 1.0, "{:.3f}"), ("depth_mean", "mean depth", 1.0, "{:.2f}"),
    ("wasted_draft_tokens", "wasted", 1.0, "{:.0f}"),
    ("proactive_wasted_tokens", "proactive wasted", 1.0, "{:.0f}"),
    ("proactive_hit_rate", "proactive hit", 1.0, "{:.3f}"),
    ("proactive_ready_before_response", "ready before resp", 1.0, "{:.2f}"),
    ("proactive_ready_minus_response_s", "ready−resp ms", 1e3, "{:.0f}"),
    ("proactive_late_steps", "late steps", 1.0, "{:.0f}"),
    ("proactive_skipped", "skipped", 1.0, "{:.0f}"),
]


def adaptive_md(results: dict) -> str:
    """Markdown for summary.md: the adaptive modes' (``adaptive`` on the mode: depth
    controllers, proactive drafting, fixed depths) depth, waste and proactive timing,
    and the best fixed depth per cell."""
    bf = results.get("config", {}).get("best_fixed") or {}
    return _section(
        [r for r in results["runs"] if mode_flag(r["mode"], "adaptive")], _ADAPTIVE_COLS,
        "Adaptive drafting (depth control, proactive drafting)",
        "profile `X+slow` = link X with the edge slowdown of the run config "
        "(`edge_slowdown` from `slowdown_at_s` into each run). ready−resp = median "
        "of (proactive draft ready − verdict arrived), ms; < 0: ready first.",
        "Best fixed depth per cell (chosen after the fact): " + ", ".join(
            f"{k} → {v['mode']} ({v['value']:.2f} tok/s)" for k, v in bf.items())
        if bf else None)


def _section(runs: list, cols: list, title: str, note: str, footer: str | None) -> str:
    """One family's section: heading, note, the runs table and an optional footer
    line; empty without runs."""
    if not runs:
        return ""
    lines = ["", f"## {title}", "", note, ""] + runs_table(runs, cols)
    if footer:
        lines += ["", footer, ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- concurrent

_CONCURRENT_COLS = [
    ("n_requests", "requests", 1.0, "{:.0f}"), ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"),
    ("target_passes_per_token", "passes/tok", 1.0, "{:.3f}"),
    ("mean_batch_size", "mean batch", 1.0, "{:.2f}"),
    ("edge_utilisation", "edge util", 1.0, "{:.2f}"),
    ("cloud_utilisation", "cloud util", 1.0, "{:.2f}"),
    ("edge_cpu_utilisation", "edge CPU", 1.0, "{:.2f}"),
    ("cloud_cpu_utilisation", "cloud CPU", 1.0, "{:.2f}"),
    ("mean_accepted_length", "tokens/round", 1.0, "{:.2f}"),
    ("runahead_wasted_tokens", "runahead wasted", 1.0, "{:.0f}"),
]


def concurrent_md(results: dict) -> str:
    """Markdown for summary.md: the concurrent runs' utilisation and pass counts."""
    sb = results.get("config", {}).get("strongest_baseline") or {}
    return _section(
        [r for r in results["runs"] if split_point(r["profile"])[1] is not None],
        _CONCURRENT_COLS, "Concurrent runs (confirmed-prefix pipeline and baselines)",
        "profile = network profile @ c<concurrency>; throughput over the makespan; "
        "passes/tok from the server's counter (a batched pass counts once); edge util "
        "= draft-worker busy s / makespan; cloud util = target s / makespan; edge/cloud "
        "CPU = CPU s of the whole edge/cloud process / makespan.",
        "Strongest baseline per operating point: "
        + ", ".join(f"{k} → {v}" for k, v in sb.items()) if sb else None)


# --------------------------------------------------------------------------- peers

_PEER_COLS = [
    ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"), ("ttft_s", "TTFT (ms)", 1e3, "{:.1f}"),
    ("tpot_s", "TPOT (ms)", 1e3, "{:.1f}"),
    ("engine_prompt_tok_s", "engine prompt tok/s", 1.0, "{:.1f}"),
    ("engine_eval_tok_s", "engine eval tok/s", 1.0, "{:.2f}"),
    ("acceptance_rate", "acceptance", 1.0, "{:.3f}"),
    ("target_passes_per_token", "target passes/tok", 1.0, "{:.3f}")]


def _is_peer(mode: str) -> bool:
    from bench.modes import MODES

    return bool(getattr(MODES.get(mode), "peer", False))


def _geo(vals: list[float]) -> float | None:
    vals = [v for v in vals if isinstance(v, (int, float)) and v > 0]
    return float(np.exp(np.mean(np.log(vals)))) if vals else None


def _gain_line(r: dict, idx: dict) -> str:
    """One speculative-gain table row: engine, modes, profile, both tok/s, the gain."""
    from bench.modes import MODES

    ws = sorted({w for (m, p, w) in idx if m == r["mode"] and p == r["profile"]})
    spec = _geo([(idx.get((r["mode"], r["profile"], w)) or {}).get("throughput_tok_s")
                 for w in ws])
    base = _geo([(idx.get((r["baseline"], r["profile"], w)) or {}).get(
        "throughput_tok_s") for w in ws])
    eng = (MODES[r["mode"]].engine if _is_peer(r["mode"])
           else "specrelay (edge + cloud, emulated link)")
    f = (lambda v: "–" if v is None else f"{v:.2f}")
    return (f"| {eng} | {r['mode']} | {r['baseline']} | {r['profile']} | "
            f"{f(spec)} | {f(base)} | {r['value']:.3f}× |")


def _gain_lines(results: dict) -> list[str]:
    """The speculative gain table (ours: our speculative modes / ``cloud-ar``; each
    peer: its speculative mode / its target-only mode)."""
    from bench.modes.peers import gain_pairs

    pairs = gain_pairs()
    idx, _, _ = run_index(results["runs"])
    rows = [r for r in results["ratios"] if r["metric"] == "throughput_tok_s" and (
        pairs.get(r["mode"]) == r["baseline"]
        or (r["baseline"] == "cloud-ar" and not _is_peer(r["mode"])))]
    lines = ["", "### Speculative gain (speculative tok/s / the same engine's "
             "target-only tok/s)", ""]
    if not rows:
        return lines + ["(no speculative / target-only pair ran)"]
    lines += ["| engine | speculative | target-only | profile | spec tok/s | "
              "target-only tok/s | gain |", "|---|---|---|---|---|---|---|"]
    return lines + [_gain_line(r, idx) for r in rows]


def _agreement(m: str, a: dict) -> str:
    r1 = (lambda v: "–" if v is None else f"{v:.1f}")
    txt = (f"{m}: {a['identical']}/{a['prompts']} identical to {a['reference']}, "
           f"common prefix {r1(a['mean_common_prefix'])} of "
           f"{r1(a['mean_tokens'])} tokens")
    if a.get("identical_to_engine_ar") is not None:
        txt += f", identical to its engine's target-only: {a['identical_to_engine_ar']}"
    return txt


def peers_md(results: dict) -> str:
    """Markdown appended to summary.md: the peer runs with their engines' own timings,
    and the speculative gain of every engine (ours: our speculative modes / ``cloud-ar``;
    each peer: its speculative mode / its target-only mode) with absolute tok/s."""
    runs = [r for r in results["runs"] if _is_peer(r["mode"])]
    if not runs:
        return ""
    cfg = results.get("config", {})
    lines = ["", "## Peer engines (same prompts and tokens; no network)", "",
             f"Peers run on CPUs {cfg.get('peer_cpus', cfg.get('cloud_cpus'))} with "
             f"{cfg.get('peer_threads', cfg.get('cloud_threads'))} thread(s) (our cloud: "
             f"{cfg.get('cloud_cpus')}, our edge: {cfg.get('edge_cpus')}); "
             f"transformers in dtype "
             f"`{cfg.get('dtype')}`, llama.cpp on the GGUF files. engine prompt/eval tok/s: "
             "llama.cpp's own timings.", ""]
    lines += runs_table(runs, _PEER_COLS)
    lines += _gain_lines(results)
    agree = cfg.get("peer_greedy_agreement") or {}
    if agree:
        lines += ["", "Greedy agreement of the peers with the target's tokens: "
                  + "; ".join(_agreement(m, a) for m, a in agree.items()) + "."]
    return "\n".join(lines) + "\n"
