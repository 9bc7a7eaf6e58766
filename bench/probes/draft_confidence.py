"""Draft confidence against greedy agreement with the target, and a round simulation of
a confidence-based block stop and of deeper blocks (teacher-forced on the target's own
greedy continuations).

    python -m bench.probes.draft_confidence [--prompts 5] [--tokens 64]

Per workload (MT-Bench, HumanEval): the agreement by bins of the draft's top-1
probability, then simulated stop-and-wait rounds for max depth D and stop threshold tau
(a block stops after its first token with confidence < tau) with the cost model
pass 330 ms + RTT 40 ms + 15 ms per draft token: passes per token, tokens per round,
full-accept rate, tok/s; and passes per token for D in 4..16 (tau = 0).
"""

from __future__ import annotations

import argparse

BINS = [(0, .3), (.3, .5), (.5, .7), (.7, .9), (.9, .97), (.97, 1.01)]
PASS_S, RTT_S, DRAFT_S = 0.33, 0.04, 0.015


def traces(n_prompts: int, tokens: int) -> list[tuple[str, list[tuple[float, bool]]]]:
    """``(workload, [(draft top-1 prob, draft argmax == target token)] per position)``."""
    import torch

    from specrelay_data.workloads import load_workload
    from edge_sdk.models import encode_prompt, load_model

    torch.set_num_threads(2)
    tgt, tok = load_model("qwen2.5-coder-1.5b", dtype="bfloat16")
    drf, _ = load_model("qwen2.5-coder-0.5b", dtype="bfloat16")
    out = []
    for wl in ("mtbench", "humaneval"):
        for p in load_workload(wl, n_prompts, seed=1):
            ids = encode_prompt(tok, p.text, True)
            with torch.no_grad():
                seq = tgt.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
                cont = seq[0, len(ids):].tolist()
                lg = drf(seq).logits[0, len(ids) - 1: len(ids) - 1 + len(cont)].float()
            pm, am = torch.softmax(lg, -1).max(-1)
            out.append((wl, [(float(pm[j]), int(am[j]) == t) for j, t in enumerate(cont)]))
    return out


def simulate(seq, depth: int, tau: float) -> tuple[int, int, int, float]:
    """Stop-and-wait rounds over one trace: (rounds, drafted, fully accepted, seconds)."""
    i = rounds = drafted = full = 0
    t = 0.0
    while i < len(seq):
        g = a = 0
        ok = True
        while g < depth and i + g < len(seq):
            conf, agree = seq[i + g]
            g += 1
            ok = ok and agree
            a += ok
            if conf < tau:
                break
        rounds, drafted, full = rounds + 1, drafted + g, full + ok
        t += PASS_S + RTT_S + g * DRAFT_S
        i += a + 1
    return rounds, drafted, full, t


def report(data) -> None:
    for wl in ("mtbench", "humaneval"):
        rows = [x for w, s in data if w == wl for x in s]
        print(wl, f"agreement {sum(a for _, a in rows) / len(rows):.3f}")
        for lo, hi in BINS:
            b = [a for c, a in rows if lo <= c < hi]
            if b:
                print(f"  conf [{lo},{hi}) n={len(b)} agree={sum(b) / len(b):.2f}")
        seqs = [s for w, s in data if w == wl]
        n = sum(len(s) for s in seqs)
        for depth in (6, 8):
            for tau in (0, 0.3, 0.5, 0.6, 0.7):
                r = [simulate(s, depth, tau) for s in seqs]
                R, D, F, T = (sum(x[k] for x in r) for k in range(4))
                print(f"  D={depth} tau={tau}: passes/tok {R / n:.3f} tok/round {n / R:.2f} "
                      f"drafted/round {D / R:.2f} full-accept {F / R:.2f} tok/s {n / T:.2f}")
        print("  passes/tok by max depth:", " ".join(
            f"D{d}:{sum(simulate(s, d, 0)[0] for s in seqs) / n:.3f}"
            for d in (4, 6, 8, 10, 12, 16)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    report(traces(a.prompts, a.tokens))
