"""How often an early exit's provisional verdict equals the final one, on real draft
blocks (the FSD review, §III: the edge pre-drafts from a verdict streamed from an
intermediate layer; a pre-draft is kept only when that verdict was right).

:func:`calibrate` runs a greedy speculative loop (the draft proposes ``depth`` greedy
tokens, the target verifies context + block in one pass, the true greedy verdict is
committed) and, at every round, derives the provisional verdict of each exit head and
provisional rule from the hidden states of that same pass. :func:`select` picks the
exit that maximises ``hit_rate * (L - layer) / L`` (the share of the pass the edge
gains on a hit) among those whose exit costs at most ``max_cost`` of the pass.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Sequence

import torch

from cloud_api.early_exit import ExitHead, decoder_layers, restricted_vocab
from cloud_api.early_verdict import provisional_verdict
from edge_sdk.protocol import sampling as S

__all__ = ["provisional", "final_verdict", "calibrate", "select", "plot", "RULES"]

RULES = (1, 2, 4)
"""Provisional rules: a draft token is provisionally accepted when it ranks among the
top-k early logits."""

COVERAGE_K = (8192, 16384, 32768, 65536, 100000)
"""Restricted vocabulary sizes whose coverage of the final next tokens is reported."""


GREEDY = S.SamplingConfig()


def provisional(early: torch.Tensor, block: Sequence[int], k: int) -> tuple[int, int]:
    """The greedy provisional verdict ``(a', n')`` the server streams for early logits
    ``early`` float32 [g+1, V] on draft ``block`` [g] with rank rule ``k``
    (:func:`cloud_api.early_verdict.provisional_verdict`, the same function)."""
    return provisional_verdict(GREEDY, 0, [], list(block), None, early, k)


def final_verdict(logits: torch.Tensor, block: Sequence[int]) -> tuple[int, int]:
    """The greedy verdict ``(a, n)`` of the target's logits [g+1, V] on ``block``:
    accepted count and the target's next token (the verifier's rule)."""
    return S.greedy_verify(torch.tensor(list(block), dtype=torch.long),
                           S.process_logits(logits, GREEDY))


class _Capture:
    """Forward hooks keeping the last ``rows`` outputs of the given decoder layers
    (1-based) of the latest pass: ``self.h[l]`` [rows, H] in the model dtype."""

    def __init__(self, model, layers: Sequence[int]):
        self.h: dict[int, torch.Tensor] = {}
        self.rows = 1
        blocks = decoder_layers(model)
        self.hooks = [blocks[l - 1].register_forward_hook(self._keep(l)) for l in layers]

    def _keep(self, layer: int):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            self.h[layer] = out[0, -self.rows:].detach()
        return hook

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _draft_block(kv, context: list[int], depth: int) -> list[int]:
    """``depth`` greedy tokens of the draft after ``context`` (its KV cache reused)."""
    block = [int(kv.sync(context)[-1].argmax())]
    while len(block) < depth:
        block.append(int(kv.forward([block[-1]])[-1].argmax()))
    return block


def _rounds(target, draft, prompt: list[int], depth: int, max_new: int, cap: _Capture,
            eos: set[int]):
    """Greedy speculative rounds: yields ``(block, logits [g+1, V], t_pass_s, first,
    t_draft_s)`` after each verify pass, ``cap.h`` holding that pass's hidden rows."""
    from edge_sdk.kvmodel import KVModel

    tk, dk, ctx, new = KVModel(target), KVModel(draft), list(prompt), 0
    while new < max_new:
        t0 = time.perf_counter()
        block = _draft_block(dk, ctx, min(depth, max_new - new))
        cap.rows = len(block) + 1
        t1 = time.perf_counter()
        logits = tk.sync(ctx, block)
        yield block, logits, time.perf_counter() - t1, new == 0, t1 - t0
        a, n = final_verdict(logits, block)
        got = block[:a] + [n]
        ctx += got
        new += len(got)
        if eos & set(got):
            break


def _timed(head: ExitHead, h: torch.Tensor) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = head.logits(h)
    return out, time.perf_counter() - t0


def _score_round(heads, cap, rnd, rules, acc, workload) -> None:
    """Adds one round ``rnd`` (as :func:`_rounds` yields it) to the accumulators."""
    block, logits, t_pass, first, t_draft = rnd
    a, n = final_verdict(logits, block)
    final_top = logits.argmax(-1)
    for kind, by_layer in heads.items():
        for layer, head in by_layer.items():
            early, dt = _timed(head, cap.h[layer])
            if not first:                       # the first pass also prefills the prompt
                acc["cost"][layer, kind].append(dt / t_pass)
            acc["top1"][layer, kind] += int((early.argmax(-1) == final_top).sum())
            for k in rules:
                a2, n2 = provisional(early, block, k)
                c = acc["rule"][layer, kind, k]
                c["agree"] += a2 == a
                c["hit"] += a2 == a and n2 == n
                c[f"hit_{workload}"] += a2 == a and n2 == n
    acc["rows"] += len(block) + 1
    acc["rounds"][workload] += 1
    acc["accepted"] += a
    acc["next"].append(n)
    acc["row_tokens"].extend(final_top.tolist())
    if not first:
        acc["pass"].append(t_pass)
        acc["draft"].append(t_draft)


def _new_acc() -> dict:
    return {"cost": defaultdict(list), "top1": defaultdict(int), "pass": [], "next": [],
            "draft": [],
            "rule": defaultdict(lambda: defaultdict(int)), "rounds": defaultdict(int),
            "rows": 0, "accepted": 0, "row_tokens": []}


def calibrate(target, draft, prompts: Sequence[tuple[str, list[int]]],
              heads: dict[str, dict[int, ExitHead]], depth: int = 6,
              max_new_tokens: int = 32, rules: Sequence[int] = RULES,
              max_cost: float = 0.05, eos: Sequence[int] = ()) -> dict:
    """Provisional-verdict hit rates of every exit head on real greedy rounds.

    Args:
        target, draft: HF causal LMs sharing a vocabulary.
        prompts: ``(workload, prompt token ids)`` pairs (evaluation prompts: the heads
            must not have been fitted on them).
        heads: kind (``"untrained"``, ``"tuned"``) -> exit layer -> :class:`ExitHead`;
            every head of one report should share one vocabulary.
        depth, max_new_tokens: draft block size and tokens generated per prompt.
        rules: provisional ``accept_topk`` values to score.
        max_cost: the largest exit cost, as a fraction of the verify pass, that
            :func:`select` allows.
        eos: ids ending a generation.
    Returns:
        A JSON-able report: ``results`` (one row per layer/kind/rule: ``hit_rate``,
        ``accept_agree``, ``top1`` agreement over all verified rows, ``cost_pct`` (median
        exit time / pass time, in % of the pass, prefill passes excluded), ``score``,
        per-workload hit rates), ``coverage`` (share of the final next tokens, and of
        all rows' greedy tokens, inside the restricted vocabulary; ``next_by_k``: the
        first share for other vocabulary sizes), ``rounds``, ``pass_ms`` and
        ``draft_ms`` (medians per round, prefill excluded), ``mean_accepted``, ``loop_s``
        and ``chosen`` (:func:`select`).
    Raises ValueError without prompts or heads.
    """
    if not prompts or not any(heads.values()):
        raise ValueError("calibrate needs prompts and at least one exit head")
    layers = sorted({l for by in heads.values() for l in by})
    acc, cap, t0 = _new_acc(), _Capture(target, layers), time.perf_counter()
    try:
        with torch.inference_mode():
            for workload, ids in prompts:
                for rnd in _rounds(target, draft, ids, depth, max_new_tokens, cap,
                                   set(eos)):
                    _score_round(heads, cap, rnd, rules, acc, workload)
    finally:
        cap.close()
    report = _report(heads, acc, rules, int(target.config.num_hidden_layers))
    report["chosen"] = select(report["results"], max_cost)
    report["loop_s"] = round(time.perf_counter() - t0, 1)
    report.update(depth=depth, max_new_tokens=max_new_tokens, max_cost_pct=100 * max_cost)
    return report


def _coverage(tokens: list[int], ids: torch.Tensor | None) -> float | None:
    """Share of ``tokens`` inside ``ids`` (None: the full vocabulary, share 1)."""
    if not tokens:
        return None
    if ids is None:
        return 1.0
    return round(float(torch.isin(torch.tensor(tokens), ids.cpu()).float().mean()), 4)


def _report(heads, acc, rules, L: int) -> dict:
    rounds = sum(acc["rounds"].values())
    head = next(h for by in heads.values() for h in by.values())
    rows = []
    for kind, by_layer in heads.items():
        for layer in sorted(by_layer):
            cost = acc["cost"][layer, kind]
            cost_pct = 100 * statistics.median(cost) if cost else None
            for k in rules:
                c = acc["rule"][layer, kind, k]
                hit = c["hit"] / rounds
                rows.append({
                    "layer": layer, "kind": kind, "rule": k, "hit_rate": round(hit, 4),
                    "accept_agree": round(c["agree"] / rounds, 4),
                    "top1": round(acc["top1"][layer, kind] / acc["rows"], 4),
                    "cost_pct": None if cost_pct is None else round(cost_pct, 2),
                    "score": round(hit * (L - layer) / L, 4),
                    "hit_by_workload": {w: round(c[f"hit_{w}"] / n, 4)
                                        for w, n in acc["rounds"].items()}})
    return {"results": rows, "rounds": rounds, "rows": acc["rows"],
            "rounds_by_workload": dict(acc["rounds"]), "num_layers": L,
            "mean_accepted": round(acc["accepted"] / rounds, 3),
            "pass_ms": _median_ms(acc["pass"]), "draft_ms": _median_ms(acc["draft"]),
            "coverage": {"next_tokens": _coverage(acc["next"], head.vocab_ids),
                         "all_rows": _coverage(acc["row_tokens"], head.vocab_ids),
                         "next_by_k": {k: _coverage(acc["next"],
                                                    restricted_vocab(head.model, k))
                                       for k in COVERAGE_K}}}


def _median_ms(ts: list[float]) -> float | None:
    return round(1000 * statistics.median(ts), 1) if ts else None


def select(results: Sequence[dict], max_cost: float = 0.05) -> dict | None:
    """The result row with the largest ``score`` (hit rate x share of the pass saved)
    among those whose ``cost_pct`` is at most ``100 * max_cost`` (a row without a
    measured cost counts as too costly). None when no row qualifies."""
    ok = [r for r in results if r["cost_pct"] is not None and r["cost_pct"] <= 100 * max_cost]
    return max(ok, key=lambda r: (r["score"], -r["layer"]), default=None)


def plot(report: dict, path) -> None:
    """Hit rate against exit layer, one line per head kind and rule, as a PNG at
    ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    series = defaultdict(list)
    for r in report["results"]:
        series[r["kind"], r["rule"]].append((r["layer"], r["hit_rate"]))
    colours = {k: f"C{i}" for i, k in enumerate(sorted({k for _, k in series}))}
    for (kind, k), pts in sorted(series.items(), key=lambda kv: (kv[0][0] != "tuned", kv[0])):
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o" if kind == "tuned" else "x", color=colours[k],
                ls="-" if kind == "tuned" else ":", label=f"{kind}, top-{k}")
    if report.get("chosen"):
        c = report["chosen"]
        ax.axvline(c["layer"], color="grey", lw=0.8)
        ax.annotate(f"chosen: L{c['layer']} {c['kind']} top-{c['rule']}",
                    (c["layer"], c["hit_rate"]), textcoords="offset points", xytext=(-60, 12),
                    fontsize=8, bbox={"fc": "white", "ec": "none", "alpha": 0.8})
    ax.set(xlabel=f"exit layer (of {report['num_layers']})",
           ylabel="provisional verdict hit rate", ylim=(0, 1),
           title=f"FSD early exit: {report.get('target', 'target')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
