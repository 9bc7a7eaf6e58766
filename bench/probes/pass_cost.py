"""Target verify-pass cost against the number of tokens in the pass.

    python -m bench.probes.pass_cost [TARGET [DTYPE [SIZES]]]
    python -m bench.probes.pass_cost qwen2.5-coder-1.5b bfloat16 1,2,3,4,5,6,7,8,9,13

Prints, per pass size n (default 1, 9, 13, 17, 25), the four timings (ms, sorted) of a
pass of n tokens after a 200-token context, on one thread, with the serving engine's
oneDNN-prepacked linears (``SPECRELAY_PACKED=0``: plain ``F.linear``).
"""

from __future__ import annotations

import sys
import time


def main(target: str = "qwen2.5-coder-1.5b", dtype: str = "bfloat16",
         sizes: str = "1,9,13,17,25") -> dict:
    import torch

    from edge_sdk.kvmodel import KVModel
    from edge_sdk.models import load_model
    from edge_sdk.packed import packed_default

    torch.set_num_threads(1)
    m, _ = load_model(target, dtype=dtype, packed=packed_default())
    ctx, out = list(range(1000, 1200)), {}
    for n in (int(x) for x in sizes.split(",")):
        ts = []
        for _ in range(4):
            kv = KVModel(m)
            kv.forward(ctx)
            t0 = time.perf_counter()
            kv.forward(list(range(500, 500 + n)))
            ts.append(time.perf_counter() - t0)
        out[n] = sorted(1000 * t for t in ts)
        print(n, [f"{t:.0f}" for t in out[n]], flush=True)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
