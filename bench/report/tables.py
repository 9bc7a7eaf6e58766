"""Markdown tables of ``summary.md``: the config, every run, the ratio rows, the latency
breakdown and the bytes per token (the mode families' own sections:
:mod:`bench.report.sections`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from bench.report.aggregation import BREAKDOWN_PHASES, CORRECTION_MODES

__all__ = ["runs_table", "write_summary_md", "breakdown_md"]

_SUMMARY_COLS = [
    ("throughput_tok_s", "throughput (tok/s)", 1.0, "{:.2f}"),
    ("ttft_s", "TTFT (ms)", 1e3, "{:.1f}"),
    ("tpot_s", "TPOT (ms)", 1e3, "{:.1f}"),
    ("acceptance_rate", "acceptance", 1.0, "{:.3f}"),
    ("mean_accepted_length", "tokens/round", 1.0, "{:.2f}"),
    ("uplink_bytes_per_token", "up B/tok", 1.0, "{:.1f}"),
    ("downlink_bytes_per_token", "down B/tok", 1.0, "{:.1f}"),
    ("target_passes_per_token", "target passes/tok", 1.0, "{:.3f}"),
    ("target_seconds_per_token", "target ms/tok", 1e3, "{:.2f}"),
    ("proactive_hit_rate", "proactive hit", 1.0, "{:.3f}"),
]


def _fmt(v: Any, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    return "–" if v is None else fmt.format(v * scale)


def runs_table(runs: Sequence[dict], cols: Sequence[tuple[str, str, float, str]]) -> list[str]:
    """Markdown table lines of ``runs``: mode, profile, workload, then one column per
    ``(metric key, title, scale, format)`` of ``cols`` (missing values: "–")."""
    lines = ["| mode | profile | workload | " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---|" * (3 + len(cols))]
    for run in runs:
        m = run["metrics"]
        lines.append(f"| {run['mode']} | {run['profile']} | {run['workload']} | "
                     + " | ".join(_fmt(m.get(k), sc, f) for k, _, sc, f in cols) + " |")
    return lines


def _runs_lines(runs: Sequence[dict]) -> list[str]:
    """The main runs table: the summary columns and the correction counts b/p/f."""
    header = ["mode", "profile", "workload"] + [c[1] for c in _SUMMARY_COLS] + ["corrections b/p/f"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        m = run["metrics"]
        cells = [run["mode"], run["profile"], run["workload"]]
        cells += [_fmt(m.get(k), s, f) for k, _, s, f in _SUMMARY_COLS]
        cc = m.get("correction_mode_counts") or {}
        cells.append("/".join(str(cc.get(k, 0)) for k in CORRECTION_MODES))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ratio_lines(ratios: Sequence[dict]) -> list[str]:
    if not ratios:
        return ["(none)"]
    lines = ["| metric | profile | mode | baseline | value |", "|---|---|---|---|---|"]
    for r in ratios:
        lines.append(f"| {r['metric']} | {r['profile']} | {r['mode']} | {r['baseline']} | {r['value']:.3f}× |")
    return lines


def write_summary_md(results: dict, path: str | Path) -> Path:
    """Write a markdown summary: config, a table of runs, a table of ratios."""
    lines = ["# specrelay benchmark summary", ""]
    cfg = results.get("config", {})
    if cfg:
        lines += [f"- **{k}**: `{json.dumps(v) if not isinstance(v, str) else v}`" for k, v in cfg.items()]
        lines.append("")
    lines += ["## Runs", ""] + _runs_lines(results["runs"])
    lines += ["", "## Ratios (value > 1: mode is better than baseline)", ""]
    lines += _ratio_lines(results["ratios"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def breakdown_md(results: dict) -> str:
    """Markdown appended to summary.md: latency breakdown and link-level bytes."""
    def ms(v):
        return "–" if v is None else f"{v * 1e3:.1f}"

    lines = ["", "## Latency breakdown (ms per committed token)", "",
             "draft = edge draft compute; verify = target compute; upload/download = link "
             "model (bytes x 8 / bandwidth + RTT/2 per exchange); wait = the rest "
             "(prefill, queueing, stalls, HTTP).", "",
             "| mode | profile | workload | " + " | ".join(BREAKDOWN_PHASES)
             + " | total |", "|" + "---|" * (4 + len(BREAKDOWN_PHASES))]
    for r in results["runs"]:
        bd = r["metrics"]["breakdown_s"]
        lines.append(f"| {r['mode']} | {r['profile']} | {r['workload']} | "
                     + " | ".join(ms(bd[p]) for p in BREAKDOWN_PHASES)
                     + f" | {ms(sum(bd.values()))} |")
    lines += ["", "## Bytes per committed token", "",
              "Protocol = message bodies (the shared metrics); link = every byte the link "
              "emulator carried (HTTP and signing headers included).", ""]
    lines += runs_table(results["runs"], [
        ("uplink_bytes_per_token", "protocol up", 1.0, "{:.1f}"),
        ("downlink_bytes_per_token", "protocol down", 1.0, "{:.1f}"),
        ("link_uplink_bytes_per_token", "link up", 1.0, "{:.1f}"),
        ("link_downlink_bytes_per_token", "link down", 1.0, "{:.1f}")])
    return "\n".join(lines) + "\n"
