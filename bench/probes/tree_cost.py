"""Verify-pass cost of a chain and of a sibling tree, with and without row invariance.

    python -m bench.probes.tree_cost [TARGET [DTYPE [CONTEXT]]]
    python -m bench.probes.tree_cost qwen2.5-coder-1.5b bfloat16 400

Prints, on one thread after a CONTEXT-token prefill (default 400), the milliseconds
(sorted, five runs) of one pass of a 9- and a 16-token chain and of a 16-row sibling
tree (a depth-8 chain plus one sibling at each of its first 7 depths), first with the
model's own kernels, then row-invariant (:mod:`edge_sdk.invariant`: each token's own
attention call, a sibling reading a copy of its past and ancestors followed by its own
entry).
"""

from __future__ import annotations

import sys
import time


def main(target: str = "qwen2.5-coder-1.5b", dtype: str = "bfloat16",
         context: str = "400") -> dict:
    import torch

    from edge_sdk.invariant import make_row_invariant
    from edge_sdk.kvmodel import KVModel
    from edge_sdk.models import load_model
    from edge_sdk.packed import packed_default
    from edge_sdk.protocol.tree import layout

    torch.set_num_threads(1)
    m, _ = load_model(target, dtype=dtype, packed=packed_default())
    ctx = list(range(1000, 1000 + int(context)))
    tree = layout(8, [[600 + i] if i < 7 else [] for i in range(8)])

    def run(t, n):
        kv = KVModel(m)
        kv.forward(ctx, last=1)
        ts = []
        for _ in range(5):
            kv.crop(len(ctx))
            t0 = time.perf_counter()
            kv.forward(list(range(500, 500 + n)), tree=t)
            ts.append(time.perf_counter() - t0)
        return sorted(round(1000 * x) for x in ts)

    out = {}
    for mode in ("own", "invariant"):
        if mode == "invariant":
            make_row_invariant(m)
        out[mode] = {"chain9": run(None, 9), "chain16": run(None, 16),
                     "tree16": run(tree, tree.rows)}
        print(mode, out[mode], flush=True)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
