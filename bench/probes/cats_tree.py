"""Chain + siblings against dynamic draft trees for CATS on the real target, in ONE
process (same load, same cores, configs interleaved per prompt so that drift on a
shared machine hits them alike):

    python -m bench.probes.cats_tree --budget 0.5 --storage nvme --prompts 2 --tokens 32 \\
        --configs "chain:5:8,tree:5:4:24,tree:6:4:32"

A config is ``chain:DEPTH:WIDTH`` (:class:`~edge_sdk.local_target.cats.CatsDecoder`'s
chain with ``WIDTH - 1`` siblings) or ``tree:DEPTH:BEAM:NODES`` (the dynamic tree of
:mod:`edge_sdk.local_target.dyntree`). Prints, per config and workload, decode tok/s
(prefill excluded), tokens per streamed pass, off-chain accepted tokens, the seconds per
round, and whether every output equals the first config's (greedy, bf16: a difference
is a near-tie of rows computed in passes of another shape); writes the JSON with
``--out``.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_config(text: str) -> dict:
    """``chain:D:W`` or ``tree:D:B:N`` -> the decoder's keyword arguments (+ ``name``).
    Raises ValueError otherwise."""
    parts = text.split(":")
    try:
        if parts[0] == "chain" and len(parts) == 3:
            return {"name": text, "depth": int(parts[1]), "width": int(parts[2])}
        if parts[0] == "tree" and len(parts) == 4:
            return {"name": text, "depth": int(parts[1]), "beam": int(parts[2]),
                    "nodes": int(parts[3])}
    except ValueError:
        pass
    raise ValueError(f"config {text!r}: expected chain:DEPTH:WIDTH or tree:DEPTH:BEAM:NODES")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--budget", default="0.5")
    ap.add_argument("--storage", default="nvme")
    ap.add_argument("--prompts", type=int, default=2, help="per workload")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--configs", default="chain:5:8,tree:5:4:24")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    configs = [parse_config(c) for c in a.configs.split(",")]

    import torch

    torch.set_num_threads(1)
    from bench.probes.skip_agreement import _prompts
    from edge_sdk.local_target.cats import CatsDecoder
    from edge_sdk.local_target.session import build_local
    from edge_sdk.protocol.sampling import SamplingConfig

    budget = float(a.budget) if float(a.budget) <= 1 else int(float(a.budget))
    sess = build_local(a.target, budget, a.storage, "bfloat16", "cats")
    plan = sess.plan
    print(f"plan: R={plan.resident_layers} draft={plan.draft} depth={plan.depth} "
          f"width={plan.width} gate={plan.gate:.3f} head={getattr(sess.local.head, 'name', None)}",
          flush=True)
    prompts = _prompts(sess.local.tokenizer, a.prompts, a.offset)
    rows: dict[str, dict] = {}
    first: dict[int, list[int]] = {}
    for i, (wl, ids) in enumerate(prompts):
        for c in configs:
            kw = {k: v for k, v in c.items() if k != "name"}
            dec = CatsDecoder(sess.local.target, sess.local.head, gate=plan.gate, **kw)
            t0 = time.perf_counter()
            toks, st = dec.generate(ids, a.tokens, SamplingConfig(), 0, sess.eos)
            wall = time.perf_counter() - t0
            r = rows.setdefault(f"{c['name']}|{wl}", {"config": c["name"], "workload": wl,
                                                     "tokens": 0, "decode_s": 0.0,
                                                     "rounds": 0, "off_chain": 0,
                                                     "identical": 0, "requests": 0})
            r["tokens"] += st.committed
            r["decode_s"] += st.seconds - st.prefill_s
            r["rounds"] += st.rounds
            r["off_chain"] += st.sibling_hits
            r["requests"] += 1
            first.setdefault(i, toks)
            r["identical"] += toks == first[i]
            print(f"{wl} #{i} {c['name']}: {st.committed} tok, {st.rounds} rounds, "
                  f"{st.committed / max(1e-9, st.seconds - st.prefill_s):.2f} tok/s "
                  f"(wall {wall:.1f} s)", flush=True)
    out = []
    for r in rows.values():
        r["decode_tok_s"] = r["tokens"] / r["decode_s"] if r["decode_s"] else 0.0
        r["tokens_per_pass"] = r["tokens"] / max(1, r["rounds"])
        r["s_per_round"] = r["decode_s"] / max(1, r["rounds"])
        out.append(r)
        print(f"{r['config']:>18} {r['workload']:>9}: {r['decode_tok_s']:.2f} tok/s, "
              f"{r['tokens_per_pass']:.2f} tokens/pass, {r['s_per_round']:.3f} s/round, "
              f"off-chain {r['off_chain']}, identical {r['identical']}/{r['requests']}")
    res = {"target": a.target, "budget": a.budget, "storage": a.storage,
           "tokens": a.tokens, "prompts_per_workload": a.prompts, "offset": a.offset,
           "plan": plan.to_dict(), "rows": out}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
