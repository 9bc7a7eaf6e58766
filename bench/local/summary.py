"""``summary.md`` of the local-target benchmark (:mod:`bench.local.run`)."""

from __future__ import annotations

from edge_sdk.local_target.budget import draft_label

__all__ = ["summary_md"]


def _f(v, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v)


def summary_md(results: dict) -> str:
    """Markdown: one row per run (tokens/s, acceptance, plan, peak RSS vs budget), the
    cats / local-offload-ar ratios and the greedy identity count."""
    c = results["config"]
    lines = [f"# local target bench ({c['target']}, {c['dtype']})", "",
             f"{c['prompts']} prompts per workload, {c['max_new_tokens']} new tokens, "
             f"{c['elapsed_s']:.0f} s.", "",
             "| mode | profile | workload | tok/s | decode tok/s | acceptance | tokens/pass "
             "| R | exit | depth | width | sibling hits | budget GB | plan GB | peak RSS GB | RSS after import GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        m, p = r["metrics"], dict(r["local"]["plan"])
        if p.get("draft") == "skip":              # first R1 + last R2, or a set
            p["exit_layer"] = draft_label(p).replace("skip draft", "skip")
        beam = r["local"].get("beam", p.get("beam", 1))
        if beam > 1:                              # a dynamic tree: beam x nodes
            p["width"] = f"tree {beam}x{r['local'].get('nodes', p.get('nodes'))}"
        if r["mode"] == "local-offload-ar":       # the target alone: no draft
            p.update(exit_layer="-", depth="-", width="-")
        lines.append(
            f"| {r['mode']} | {r['profile']} | {r['workload']} | {_f(m['throughput_tok_s'])} "
            f"| {_f(m['decode_tok_s'])} | {_f(m['acceptance_rate'])} "
            f"| {_f(m['mean_accepted_length'])} | {p['resident_layers']} | {p['exit_layer']} "
            f"| {p['depth']} | {p.get('width', 1)} | {m.get('sibling_hits', '-')} | {p['budget'] / 1e9:.2f} | {p['memory'] / 1e9:.2f} "
            f"| {r['peak_rss_bytes'] / 1e9:.2f} | {r['rss_after_import_bytes'] / 1e9:.2f} |")
    lines += ["", "| ratio | profile | workload | value |", "|---|---|---|---|"]
    for q in results["ratios"]:
        lines.append(f"| {q['mode']} / {q['baseline']} tok/s | {q['profile']} "
                     f"| {q['workload']} | {q['value']:.2f}x |")
    ident = c.get("greedy_identity") or {}
    lines += ["", f"greedy outputs identical (cats vs local-offload-ar): "
              f"{ident.get('identical', 0)}/{ident.get('compared', 0)}", ""]
    return "\n".join(lines)
