"""A one-token target pass with each layer's one-row input run alone vs as two rows.

    python -m bench.probes.one_row [TARGET [DTYPE [PAIRS]]]
    python -m bench.probes.one_row qwen2.5-coder-1.5b float32 20

Loads the target as the cloud serves it (oneDNN-prepacked linears, row-invariant passes,
one thread), says how many of its linear layers run a one-row input alone
(:func:`edge_sdk.invariant.one_row_agrees`), then times PAIRS one-token decode passes
after a 200-token context under each rule, alternating (alone, two rows, alone, ...) so
that a drift of the machine's speed hits both alike, and checks that both rules give the
same logits bit for bit at every step. Prints the timings (ms: min / median / max) and
one JSON line last.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(target: str = "qwen2.5-coder-1.5b", dtype: str = "float32",
         pairs: str = "20") -> dict:
    import torch

    from edge_sdk.invariant import make_row_invariant
    from edge_sdk.kvmodel import KVModel
    from edge_sdk.models import load_model
    from edge_sdk.packed import packed_default

    torch.set_num_threads(1)
    m, _ = load_model(target, dtype=dtype, packed=packed_default())
    make_row_invariant(m)
    lins = [x for x in m.modules() if hasattr(x, "specrelay_one_row")]
    agree = [x.specrelay_one_row for x in lins]
    kv = KVModel(m)
    kv.forward(list(range(1000, 1200)), last=1)
    start = kv.cache_len()
    times: dict[str, list[float]] = {"alone": [], "two_rows": []}
    same = True
    for i in range(int(pairs)):
        out = {}
        for rule in ("alone", "two_rows"):
            for x, a in zip(lins, agree):
                x.specrelay_one_row = a and rule == "alone"
            kv.crop(start)
            t0 = time.perf_counter()
            out[rule] = kv.forward([500 + i])
            times[rule].append(1000 * (time.perf_counter() - t0))
        same &= torch.equal(out["alone"], out["two_rows"])
    for x, a in zip(lins, agree):
        x.specrelay_one_row = a
    res = {"target": target, "dtype": dtype, "linears": len(lins),
           "linears_alone": sum(agree), "pairs": int(pairs), "logits_identical": bool(same)}
    for rule, ts in times.items():
        res[f"{rule}_ms"] = {"min": round(min(ts), 1), "median": round(statistics.median(ts), 1),
                             "max": round(max(ts), 1)}
        print(f"{rule:9s} ms: min {min(ts):.0f}, median {statistics.median(ts):.0f}, "
              f"max {max(ts):.0f}", flush=True)
    res["median_ratio_two_rows_over_alone"] = round(
        res["two_rows_ms"]["median"] / res["alone_ms"]["median"], 3)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main(*sys.argv[1:4])
