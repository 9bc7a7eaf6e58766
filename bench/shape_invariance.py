"""Are a model's logits invariant to the shape of the pass that computes them?

Greedy identity between speculative decoding and the target alone needs the logits of
position t to be the same whether t is the single token of a decode pass or row k of a
(k+1)-token verify pass. This probe measures max |delta logit| over real prompts, per
attention implementation, and the pass times, for the near-tie policy
(``sampling.NEAR_TIE_GAP``) and for work on bit-exact bfloat16 verification::

    python -m bench.shape_invariance qwen2.5-coder-1.5b --attn sdpa,invariant

``invariant``: the serving engine's row-invariant passes (:mod:`edge_sdk.invariant`);
``eager``/``sdpa``: transformers' attention. The model is loaded as the serving engine
loads it (oneDNN-prepacked bf16 linears; ``SPECRELAY_PACKED=0``: plain).

Prints one JSON line per attention implementation.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def probe(model, prompt_ids: list[int], positions=(3, 11), rows=(1, 3, 5, 8),
          lengths=(1, 5, 9)) -> dict:
    """max |delta logit| between row 0 of a 1-token pass at position P+p and row k of a
    (k+1)-token pass starting k earlier (p in ``positions``, k in ``rows``; P = prompt
    length), and the best-of-3 seconds of passes of ``lengths`` tokens after the prompt.
    Uses one :class:`~edge_sdk.kvmodel.KVModel` cropped back between passes (the cache
    rows below the pass come from the same prefill in every case, as in serving)."""
    from edge_sdk.kvmodel import KVModel

    g = torch.Generator().manual_seed(0)
    full = list(prompt_ids) + torch.randint(0, 50_000, (max(positions) + 1,),
                                            generator=g).tolist()
    P = len(prompt_ids)
    kv = KVModel(model)
    kv.forward(full[:P - max(rows)])

    def run(start: int, n: int) -> torch.Tensor:
        kv.sync(full[:start]) if start > kv.cache_len() else kv.crop(start)
        return kv.forward(full[start:start + n])

    worst = 0.0
    for p in positions:
        t = P + p
        ref = run(t, 1)[0]
        for k in rows:
            worst = max(worst, float((run(t - k, k + 1)[k] - ref).abs().max()))
    times = {}
    for n in lengths:
        best = float("inf")
        for _ in range(3):
            kv.crop(P)
            t0 = time.perf_counter()
            run(P, n)
            best = min(best, time.perf_counter() - t0)
        times[n] = round(best * 1000, 1)
    return {"max_abs_delta_logit": worst, "pass_ms": times}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default="sdpa,invariant",
                    help="attention implementations (eager, sdpa, invariant)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from specrelay_data.workloads import load_workload
    from edge_sdk.invariant import make_row_invariant
    from edge_sdk.models import encode_prompt, load_model
    from edge_sdk.packed import packed_default

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype, packed=packed_default())
    ids = encode_prompt(tok, load_workload("humaneval", n=1, seed=5)[0].text, True)
    for impl in args.attn.split(","):
        if impl == "invariant":
            make_row_invariant(model)
        else:
            model.set_attn_implementation(impl)
        out = probe(model, ids)
        print(json.dumps({"model": args.model, "dtype": args.dtype, "attn": impl,
                          "prompt_tokens": len(ids), **out}), flush=True)


if __name__ == "__main__":
    main()
