"""Draft decode step of two ONNX exports of the same model at several context lengths:
typically the attention traced as the model has it (K and V repeated per query head)
against :func:`exporters.onnx.attention.gqa_attention` (each KV head read once).

    specrelay export onnx qwen2.5-coder-0.5b --dtype bfloat16 --int4 --threads 1 \\
        --attention model --out /tmp/q05-model-attn
    python -m bench.probes.draft_attention /tmp/q05-model-attn/int4 \\
        ~/.cache/specrelay/onnx/qwen2.5-coder-0.5b-int4 [--contexts 100,300,500]
        [--steps 20] [--repeats 3] [--cpu 1]

Both graphs run on one thread pinned to ``--cpu``. For each context length the cache is
prefilled with the same fixed token ids, then ``steps`` single-token decode steps are
timed; the two exports alternate, ``repeats`` times each, and the median step is kept.
The greedy tokens of the two exports over the timed steps are compared (an int4 export's
rounding may differ between graphs; the count of equal argmaxes is printed). Prints one
line per context and a JSON object last (milliseconds per step; ``speedup`` = A / B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _steps(runner, ids: list[int], ctx: int, steps: int) -> tuple[float, list[int]]:
    """Prefill ``ids[:ctx]``, then time ``steps`` decode steps feeding ``ids[ctx:]``.
    -> (ms per step, argmax after each step)."""
    runner.reset()
    runner.forward_np(ids[:ctx], last=1)
    top = []
    t0 = time.perf_counter()
    for i in range(steps):
        top.append(int(runner.forward_np([ids[ctx + i]], last=1)[-1].argmax()))
    return 1e3 * (time.perf_counter() - t0) / steps, top


def main(a: str, b: str, contexts: str = "100,300,500", steps: int = 20, repeats: int = 3,
         cpu: int | None = 1) -> dict:
    import numpy as np

    from edge_sdk.drafters.onnx import OnnxRunner

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    runners = {"a": OnnxRunner(os.path.expanduser(a), threads=1),
               "b": OnnxRunner(os.path.expanduser(b), threads=1)}
    vocab = min(r.vocab_size for r in runners.values())
    ctxs = [int(c) for c in contexts.split(",")]
    ids = [int(t) for t in np.random.RandomState(0).randint(100, min(vocab, 20000),
                                                             max(ctxs) + steps)]
    for r in runners.values():
        _steps(r, ids, 8, 2)                                   # warm both sessions
    rows = []
    for ctx in ctxs:
        ms = {"a": [], "b": []}
        tops = {}
        for _ in range(repeats):
            for k, r in runners.items():
                t, tops[k] = _steps(r, ids, ctx, steps)
                ms[k].append(t)
        ma, mb = statistics.median(ms["a"]), statistics.median(ms["b"])
        same = sum(x == y for x, y in zip(tops["a"], tops["b"]))
        rows.append({"context": ctx, "a_ms": round(ma, 2), "b_ms": round(mb, 2),
                     "speedup": round(ma / mb, 3), "same_argmax": f"{same}/{steps}"})
        print(f"context {ctx:5d}: A {ma:6.1f} ms/step, B {mb:6.1f} ms/step "
              f"({ma / mb:.2f}x), same argmax {same}/{steps}")
    out = {"a": a, "b": b, "steps": steps, "repeats": repeats, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="export folder A (the baseline)")
    ap.add_argument("b", help="export folder B")
    ap.add_argument("--contexts", default="100,300,500")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=1)
    x = ap.parse_args()
    main(x.a, x.b, x.contexts, x.steps, x.repeats, x.cpu)
