"""What one greedy draft token costs on the edge, split into the draft's forward and the
pick (the token, its next-best candidates and its probability), the one-pass pick
(:func:`edge_sdk.drafters.base.greedy_pick`) beside the general path
(:func:`edge_sdk.protocol.sampling.sample_next` + :func:`edge_sdk.drafters.base.candidates`)
on the same logits.

    python -m bench.probes.draft_step [--draft qwen2.5-coder-0.5b+onnx-int4]
        [--requests docs/figures/single16-1206/requests.jsonl] [--tokens 48] [--cpu 1]
        [--target qwen2.5-coder-1.5b]

``--draft`` is a draft spec or an ONNX export folder (which holds no tokenizer: the
prompts are encoded with ``--target``'s, the pair's shared tokenizer, as
``draft_quant`` does).

For each ``cloud-ar`` record of the bench run (the target's own greedy continuations),
the draft is synced to the prompt and then decodes its own greedy chain for
``--tokens`` steps, one thread pinned to ``--cpu``. Per step: ``forward_ms`` (the
drafter's ``step``: the graph call and its logits as a tensor), then both picks on the
same logits, timed (each goes first on every other step: the first reads the logits
from memory, the second from cache), and checked equal (token, probability, and the
candidates' values). Medians and
means in ms; ``pick_share`` = the pick's share of a drafted token. Output: one line per
pick, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv=None) -> dict:
    from bench.cells import encode_requests
    from bench.probes.draft_quant import _continuations
    from edge_sdk.drafters.base import candidates, greedy_pick
    from edge_sdk.protocol.sampling import SamplingConfig, sample_next
    from edge_sdk.models import load_tokenizer
    from specrelay_cli.options import make_drafter
    from specrelay_data.workloads import load_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b+onnx-int4")
    ap.add_argument("--requests", default="docs/figures/single16-1206/requests.jsonl")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    import torch

    torch.set_num_threads(1)
    drafter, _ = make_drafter(a.draft)
    tok = load_tokenizer(a.target)
    cfg = SamplingConfig()
    prompts = []
    for w in sorted({c[0] for c in _continuations(a.requests)}):
        wanted = {c[1] for c in _continuations(a.requests) if c[0] == w}
        texts = [p for p in load_workload(w) if p.id in wanted]
        prompts += [[int(t) for t in r.prompt_ids] for r in encode_requests(tok, texts, w, 0)]

    def general(x):
        d, _ = sample_next(x, cfg, None, None)
        return (d, *candidates(x, d))

    fwd, one, gen, mismatched = [], [], [], 0
    for prompt in prompts:
        logits = drafter.sync(prompt)
        for i in range(a.tokens):
            # the first pick reads the fresh logits from memory, the second from cache:
            # the two go first in turn
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    got = greedy_pick(logits)
                    one.append(1e3 * (time.perf_counter() - t0))
                else:
                    want = general(logits)
                    gen.append(1e3 * (time.perf_counter() - t0))
            same_cands = sorted(float(logits[j]) for j in got[1]) == sorted(
                float(logits[j]) for j in want[1])            # ties may come in any order
            mismatched += not (got[0] == want[0] and got[2] == want[2] and same_cands)
            t0 = time.perf_counter()
            logits = drafter.step(want[0])
            fwd.append(1e3 * (time.perf_counter() - t0))
    f = statistics.mean(fwd)
    out = {"draft": a.draft, "requests": a.requests, "prompts": len(prompts),
           "steps": len(fwd), "forward_ms": {"median": round(statistics.median(fwd), 2),
                                             "mean": round(f, 2)},
           "mismatched_picks": mismatched, "picks": {}}
    for name, ts in (("one-pass", one), ("general", gen)):
        m = statistics.mean(ts)
        out["picks"][name] = {"median_ms": round(statistics.median(ts), 3),
                              "mean_ms": round(m, 3), "pick_share": round(m / (f + m), 4)}
        print(f"{name}: pick {m:.3f} ms mean ({statistics.median(ts):.3f} median) of a "
              f"{f + m:.1f} ms draft token ({100 * m / (f + m):.1f} %)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
