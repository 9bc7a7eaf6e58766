"""The summary ``specrelay bench`` prints after a run (rich tables: every run, the
concurrent runs, the ratio rows; greedy identity; the files written)."""
from __future__ import annotations

__all__ = ["print_summary"]

_LEFT = ("mode", "profile", "workload")


def _f(v, scale=1.0, fmt="{:.2f}"):
    return "–" if v is None else fmt.format(v * scale)


def _table(title: str, cols):
    from rich.table import Table

    t = Table(title=title)
    for col in cols:
        t.add_column(col, justify="left" if col in _LEFT else "right")
    return t


def _runs_table(runs):
    t = _table("specrelay bench", ("mode", "profile", "workload", "tok/s", "TTFT ms",
                                   "accept", "tok/round", "up B/tok", "down B/tok"))
    for r in runs:
        m = r["metrics"]
        t.add_row(r["mode"], r["profile"], r["workload"], _f(m["throughput_tok_s"]),
                  _f(m["ttft_s"], 1e3, "{:.0f}"), _f(m["acceptance_rate"], 1, "{:.3f}"),
                  _f(m["mean_accepted_length"]), _f(m["uplink_bytes_per_token"], 1, "{:.1f}"),
                  _f(m["downlink_bytes_per_token"], 1, "{:.1f}"))
    return t


def _concurrent_table(conc):
    t = _table("concurrent runs (profile@c<concurrency>)",
               ("mode", "profile", "workload", "tok/s", "passes/tok", "mean batch",
                "edge util", "cloud util", "runahead wasted"))
    for r in conc:
        m = r["metrics"]
        t.add_row(r["mode"], r["profile"], r["workload"], _f(m["throughput_tok_s"]),
                  _f(m["target_passes_per_token"], 1, "{:.3f}"), _f(m.get("mean_batch_size")),
                  _f(m.get("edge_utilisation")), _f(m.get("cloud_utilisation")),
                  str(m.get("runahead_wasted_tokens", 0)))
    return t


def _ratios_table(ratios):
    from rich.table import Table

    t = Table(title="ratios (> 1: mode is better)")
    for col in ("metric", "profile", "mode", "baseline", "value"):
        t.add_column(col, justify="right" if col == "value" else "left")
    for r in ratios:
        t.add_row(r["metric"], r["profile"], r["mode"], r["baseline"], f"{r['value']:,.2f}x")
    return t


def _identity_lines(config: dict) -> list[str]:
    out = []
    ident = config.get("greedy_outputs_identical")
    if ident is not None:
        out.append(f"greedy outputs identical across modes: {ident}")
    div = config.get("greedy_divergences")
    if div and div.get("compared"):
        out.append(f"greedy vs target alone: {div['identical']}/{div['compared']} identical, "
                   f"near_tie_divergences {div['near_tie_divergences']}, "
                   f"hard_divergences {div['hard_divergences']}")
    return out


def print_summary(results: dict, out_dir: str, elapsed: float) -> None:
    """Print the run's tables to the terminal (160 columns when piped or logged)."""
    from rich.console import Console

    con = Console()
    if not con.is_terminal:          # piped/logged: do not squeeze the tables to 80 columns
        con = Console(width=160)
    con.print(_runs_table(results["runs"]))
    conc = [r for r in results["runs"] if r["metrics"].get("concurrency") is not None]
    if conc:
        con.print(_concurrent_table(conc))
    if results["ratios"]:
        con.print(_ratios_table(results["ratios"]))
    for line in _identity_lines(results["config"]):
        con.print(line)
    con.print(f"wrote {out_dir}/results.json, summary.md, throughput.png, "
              f"latency_breakdown.png, acceptance_hist.png, requests.jsonl "
              f"in {elapsed:.1f} s")
