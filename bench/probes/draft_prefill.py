"""The draft's prompt prefill with the LM head on every prompt row against the last row
only (the ONNX graph's ``logits_to_keep`` input), on the bench's real prompts.

    python -m bench.probes.draft_prefill [--prompts 4] [--workloads humaneval,mtbench]
        [--draft qwen2.5-coder-0.5b+onnx-int4] [--repeats 2] [--cpu 1]

Each prompt (chat template of the default pair's tokenizer, as the bench encodes it) is
prefilled from an empty cache both ways, alternating, ``repeats`` times each, on one
thread pinned to ``--cpu``; the two results' KV caches are checked equal. Prints one
line per prompt and a JSON object of the totals (milliseconds; ``speedup`` = all rows /
last row).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(prompts: int = 4, workloads: str = "humaneval,mtbench",
         draft: str = "qwen2.5-coder-0.5b+onnx-int4", repeats: int = 2,
         cpu: int | None = 1) -> dict:
    import numpy as np

    from bench.cells import encode_requests
    from edge_sdk.models import load_tokenizer
    from exporters.onnx.first_use import build_drafter
    from specrelay_data.workloads import load_workload

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    d, _ = build_drafter(draft, threads=1)
    runner = d.runner
    if not runner.keeps_logits:
        raise SystemExit(f"{draft}: the export has no logits_to_keep input (re-export it)")
    tok = load_tokenizer("qwen2.5-coder-1.5b")
    runner.forward_np([1, 2, 3], last=1)                     # warm the session
    rows, tot = [], {"all_ms": 0.0, "last_ms": 0.0, "tokens": 0}
    for w in workloads.split(","):
        for r in encode_requests(tok, load_workload(w)[:prompts], w, 0):
            ids = [int(t) for t in r.prompt_ids]
            best = {"all": [], "last": []}
            caches = {}
            for _ in range(repeats):
                for how, last in (("all", None), ("last", 1)):
                    runner.reset()
                    t0 = time.perf_counter()
                    runner.forward_np(ids, last=last)
                    best[how].append(1e3 * (time.perf_counter() - t0))
                    caches[how] = [p.copy() for p in runner.past]
            same = all(np.array_equal(a, b) for a, b in zip(caches["all"], caches["last"]))
            if not same:
                raise SystemExit(f"{r.prompt_id}: the two prefills left different KV caches")
            a, b = min(best["all"]), min(best["last"])
            rows.append({"prompt": r.prompt_id, "tokens": len(ids), "all_ms": round(a, 1),
                         "last_ms": round(b, 1)})
            print(f"{r.prompt_id:>16} {len(ids):4d} tokens: all rows {a:7.1f} ms, "
                  f"last row {b:7.1f} ms ({a / b:.2f}x)")
            tot["all_ms"] += a
            tot["last_ms"] += b
            tot["tokens"] += len(ids)
    out = {"draft": draft, "prompts": len(rows), **{k: round(v, 1) for k, v in tot.items()},
           "speedup": round(tot["all_ms"] / tot["last_ms"], 3)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--workloads", default="humaneval,mtbench")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b+onnx-int4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=1)
    a = ap.parse_args()
    main(a.prompts, a.workloads, a.draft, a.repeats, a.cpu)
