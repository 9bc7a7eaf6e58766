"""Block agreement and per-token cost of the quantized self-draft of CATS (every decoder
layer of the target as 4-bit groups, :mod:`edge_sdk.local_target.quant`).

    python -m bench.probes.quant_agreement [--prompts 4] [--offset 4] [--tokens 32]
        [--attention sdpa]     (--prompts 0: the draft token's cost alone)

Teacher-forced on the full target's greedy continuation (bf16, one thread, nothing
streamed: storage ``ram``) of HumanEval and MT-Bench prompts ``offset..offset+n-1``:
for every start position, the draft (on the target's cache of the true prefix, as a
CATS round leaves it) drafts a block of ``--depth`` tokens greedily; ``acc@D`` is the mean
number of leading drafts equal to the target's tokens (the chain's accepted length
without an early stop; tokens per streamed pass = acc@D + 1). Also the first-token
agreement and the draft's milliseconds per token (a step after a ~200-token context).
Output: one JSON object (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    import torch

    from bench.probes.skip_agreement import _greedy, _prompts
    from edge_sdk.local_target.load import DRAFT_VOCAB, open_local_target
    from edge_sdk.local_target.quant import GROUP, QuantDraft

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4, help="per workload")
    ap.add_argument("--offset", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--group", type=int, default=GROUP)
    ap.add_argument("--attention", default="grouped",
                    help="the draft layers' attention: grouped (the draft's own), sdpa, eager")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    local = open_local_target(a.target, 1.0, "ram")          # everything resident
    t, tok = local.target, local.tokenizer
    t0 = time.perf_counter()
    d = QuantDraft(t, DRAFT_VOCAB, a.group, a.attention)
    build_s = time.perf_counter() - t0
    rows = {}
    for wl, prompt in _prompts(tok, a.prompts, a.offset):
        cont = _greedy(t, prompt, a.tokens)
        seq = prompt + cont
        r = rows.setdefault(wl, {"blocks": 0, "accepted": 0, "first": 0})
        t.reset()
        t.run_layers(t.embed(prompt[:-1]), 0, t.num_layers)    # the true prefix's cache
        for s in range(len(prompt), len(seq)):       # the block after seq[:s]
            x, acc = seq[s - 1], 0
            for j in range(a.depth):
                tok_j = int(d.step(x)[1].argmax())
                if s + j >= len(seq) or tok_j != seq[s + j]:
                    break
                acc, x = acc + 1, tok_j
            d.release(s - 1)
            t.run_layers(t.embed([seq[s - 1]]), 0, t.num_layers)
            r["blocks"] += 1
            r["accepted"] += acc
            r["first"] += acc > 0
    t.reset()
    t.run_layers(t.embed(list(range(300, 500))), 0, t.num_layers)
    t0 = time.perf_counter()
    for i in range(20):
        d.step(600 + i)
    ms = (time.perf_counter() - t0) / 20 * 1e3
    d.release(199)
    blocks = sum(r["blocks"] for r in rows.values())
    out = {"target": a.target, "group": a.group, "attention": a.attention,
           "depth": a.depth, "offset": a.offset,
           "prompts_per_workload": a.prompts, "tokens": a.tokens,
           "draft_bytes": d.nbytes(), "build_s": build_s, "ms_per_token": ms,
           "workloads": {w: {"acc@D": r["accepted"] / r["blocks"],
                             "first_token_agreement": r["first"] / r["blocks"],
                             "blocks": r["blocks"]} for w, r in rows.items()}}
    out["acc@D"] = sum(r["accepted"] for r in rows.values()) / blocks if blocks else None
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
