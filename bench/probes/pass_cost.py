"""Target verify-pass cost against the tokens in the pass and the sessions batched in it.

    python -m bench.probes.pass_cost [TARGET [DTYPE [SIZES [BATCHES [INVARIANT]]]]]
    python -m bench.probes.pass_cost qwen2.5-coder-1.5b bfloat16 1,2,3,4,5,6,7,8,9,13
    python -m bench.probes.pass_cost qwen2.5-coder-1.5b bfloat16 2,3 1,2,4,8

Prints, per pass size n (default 1, 9, 13, 17, 25) and batch size B (default 1), the
timings (ms, sorted, four runs) of one pass of n new tokens for each of B sessions (the
cloud's batched verification, :func:`edge_sdk.kvmodel.batched_forward`), session b
after a (200 + 7b)-token context, on one thread, with the serving engine's
oneDNN-prepacked linears (``SPECRELAY_PACKED=0``: plain ``F.linear``); for B > 1 also
the largest difference between a session's logits in the batched pass and in its own
unbatched pass (``max|dlogit|``; 0: bit for bit the same). INVARIANT ``1`` (default,
as the cloud's verifier serves) makes the passes row-invariant
(:mod:`edge_sdk.invariant`), ``0`` leaves the model's own attention, ``2`` is ``1``
with every one-row input run as two rows (the rule before each layer's one-row kernel
was checked, :func:`edge_sdk.invariant.one_row_agrees`).
"""

from __future__ import annotations

import sys
import time


def main(target: str = "qwen2.5-coder-1.5b", dtype: str = "bfloat16",
         sizes: str = "1,9,13,17,25", batches: str = "1", invariant: str = "1") -> dict:
    import torch

    from edge_sdk.invariant import make_row_invariant
    from edge_sdk.kvmodel import KVModel, batched_forward
    from edge_sdk.models import load_model
    from edge_sdk.packed import packed_default

    torch.set_num_threads(1)
    m, _ = load_model(target, dtype=dtype, packed=packed_default())
    if invariant in ("1", "2"):
        make_row_invariant(m)
        lins = [x for x in m.modules() if hasattr(x, "specrelay_one_row")]
        for x in lins if invariant == "2" else ():
            x.specrelay_one_row = False
        print(f"{sum(x.specrelay_one_row for x in lins)} of {len(lins)} linear layers run "
              "a one-row input alone", flush=True)
    out = {}
    for B in (int(x) for x in batches.split(",")):
        for n in (int(x) for x in sizes.split(",")):
            ts = []
            for _ in range(4):
                kvs = []
                for b in range(B):
                    kv = KVModel(m)
                    kv.forward(list(range(1000 + b, 1200 + 8 * b)), last=1)
                    kvs.append(kv)
                new = list(range(500, 500 + n))
                t0 = time.perf_counter()
                got = batched_forward(kvs, [new] * B)
                ts.append(time.perf_counter() - t0)
            diff = 0.0
            for b in range(1, B):        # each row against its own unbatched pass
                kv = KVModel(m)
                kv.forward(list(range(1000 + b, 1200 + 8 * b)), last=1)
                diff = max(diff, float((got[b] - kv.forward(new)).abs().max()))
            out[(B, n)] = sorted(1000 * t for t in ts)
            print(f"B={B} n={n}", [f"{t:.0f}" for t in out[(B, n)]],
                  f"max|dlogit| {diff:g}" if B > 1 else "", flush=True)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:6])
