"""Batched drafting against drafting one request at a time, on the edge's ONNX draft.

    python -m bench.probes.draft_batch [DRAFT [ROWS [DEPTHS]]]
    python -m bench.probes.draft_batch qwen2.5-coder-0.5b+onnx-int4 4 1,2

Prints, per depth, the seconds (sorted, three runs) to draft one block for each of ROWS
requests whose draft caches lack their last 2 context tokens (the committed token and
the bonus, as after a verdict) after ~280-310-token contexts: one request after another
(``Drafter.propose``) and all together (:func:`edge_sdk.drafters.onnx.draft_batched`),
and whether the blocks are the same. One thread.
"""

from __future__ import annotations

import random
import sys
import time


def main(draft: str = "qwen2.5-coder-0.5b+onnx-int4", rows: str = "4",
         depths: str = "1,2") -> dict:
    from edge_sdk.drafters.base import Proposal
    from edge_sdk.drafters.onnx import draft_batched
    from edge_sdk.drafters.runtime import build_drafter
    from edge_sdk.protocol.sampling import SamplingConfig

    base, _ = build_drafter(draft, threads=1)
    cfg, rng, B = SamplingConfig(), random.Random(0), int(rows)
    ctxs = [[rng.randrange(1000, 20000) for _ in range(280 + 11 * b)] for b in range(B)]
    forks = [base.fork() for _ in range(B)]
    out = {}
    for depth in (int(x) for x in depths.split(",")):
        lone, together, same = [], [], True
        for _ in range(3):
            for d, c in zip(forks, ctxs):
                d.sync(c[:-2])
            t0 = time.perf_counter()
            a = [d.propose(c, depth, cfg) for d, c in zip(forks, ctxs)]
            lone.append(time.perf_counter() - t0)
            for d, c in zip(forks, ctxs):
                d.sync(c[:-2])
            t0 = time.perf_counter()
            b = draft_batched([d.runner for d in forks], [Proposal(c, depth, cfg) for c in ctxs])
            together.append(time.perf_counter() - t0)
            same &= [x.tokens for x in a] == [x.tokens for x in b]
        out[depth] = (sorted(lone), sorted(together), same)
        print(f"depth {depth}: one at a time", [f"{1000 * t:.0f}" for t in sorted(lone)],
              "ms; batched", [f"{1000 * t:.0f}" for t in sorted(together)],
              f"ms; same blocks {same}", flush=True)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
